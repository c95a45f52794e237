"""Placement (ADR-0014 §2 steps 6–7): which Worker Sessions may run a candidate, in which order.

A Placement document is ``{"required": {label: value}, "preferred": {label: value}}``. The
reserved label ``executor`` names the executor type the Worker must offer: the dispatcher adds
the candidate's executor type as a required ``executor`` when absent and refuses a conflicting
one. A Worker matches when it has a free slot, offers the executor and carries every required
label with the same value; its score is the number of preferred labels it carries with the same
value. Order: score desc, free slots desc, Worker ID asc (deterministic for equal inputs).
"""

from __future__ import annotations

import msgspec

from ..core import limits as L
from ..core.cluster import ClusterCandidate, DispatchPlan, WorkerSnapshot
from ..core.executors import EXECUTOR_LABEL
from ..core.errors import ValidationError
from ..core.leasefit import max_grace_ms
from ..core.ports import ClusterPlans


class Placement(msgspec.Struct, frozen=True):
    required: dict[str, str]
    preferred: dict[str, str]


def check_labels(field: str, value) -> dict[str, str]:
    """A validated label table (≤ 32 labels, each name/value ≤ 128 bytes, no NUL), sorted."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ValidationError(field, "must be a table of label = \"value\"")
    if len(value) > L.MAX_LABELS:
        raise ValidationError(field, f"{len(value)} labels", limit=L.MAX_LABELS)
    out = {}
    for k, v in value.items():
        if not isinstance(k, str) or not isinstance(v, str) or not k:
            raise ValidationError(f"{field}.{k}", "label names and values are strings")
        if len(k.encode()) > L.MAX_LABEL_BYTES or len(v.encode()) > L.MAX_LABEL_BYTES or "\x00" in k + v:
            raise ValidationError(f"{field}.{k}", "label too long or contains NUL", limit=L.MAX_LABEL_BYTES)
        out[k] = v
    return dict(sorted(out.items()))


def with_executor(document: dict | None, executor_type: str) -> Placement:
    """The candidate's Placement with its executor type required (ADR-0014 §2 step 6).

    Raises ValidationError(field="placement.required.executor") when the document requires a
    different executor, or naming the offending label for malformed labels.
    """
    document = document or {}
    if not isinstance(document, dict) or set(document) - {"required", "preferred"}:
        raise ValidationError("placement", "expected only 'required' and 'preferred' tables")
    required = check_labels("placement.required", document.get("required"))
    preferred = check_labels("placement.preferred", document.get("preferred"))
    have = required.get(EXECUTOR_LABEL)
    if have is not None and have != executor_type:
        raise ValidationError("placement.required.executor",
                              f"requires {have!r} but the candidate's executor type is {executor_type!r}")
    required[EXECUTOR_LABEL] = executor_type
    return Placement(required=dict(sorted(required.items())), preferred=preferred)


def matches(p: Placement, w: WorkerSnapshot) -> bool:
    """Does ``w`` satisfy every required label, offer the executor and have a free slot?"""
    if w.free_slots <= 0 or w.draining:
        return False
    for k, v in p.required.items():
        if k == EXECUTOR_LABEL:
            if v not in w.executor_types:
                return False
        elif w.labels.get(k) != v:
            return False
    return True


def score(p: Placement, w: WorkerSnapshot) -> int:
    """Number of preferred labels ``w`` carries with the same value."""
    return sum(1 for k, v in p.preferred.items()
               if (v in w.executor_types if k == EXECUTOR_LABEL else w.labels.get(k) == v))


def rank(p: Placement, workers: list[WorkerSnapshot]) -> list[tuple[int, WorkerSnapshot]]:
    """Matching Workers as (score, Worker), ordered score desc, free slots desc, Worker ID asc."""
    scored = [(score(p, w), w) for w in workers if matches(p, w)]
    scored.sort(key=lambda sw: (-sw[0], -sw[1].free_slots, sw[1].worker_id))
    return scored


class LeaseFitPlans:
    """A plan source (over ``core.ports.ClusterPlans``) that yields no plan for an
    Attempt whose ``graceMs`` a Lease of ``lease_ttl_s`` cannot hold (core.leasefit): its Worker
    would stop it right after it starts, so it is never offered (the dispatcher and Pull skip it
    as ``plan_missing``; it stays queued and the replica's placement report
    (``bootstrap.ClusterServices.placement_report``) records ``run.unplaceable``, reason
    ``grace_exceeds_lease``)."""

    def __init__(self, plans: ClusterPlans, lease_ttl_s: int) -> None:
        self._plans, self.max_grace_ms = plans, max_grace_ms(lease_ttl_s)

    def _fit(self, plan: DispatchPlan | None) -> DispatchPlan | None:
        return None if plan is None or (plan.spec.get("graceMs") or 0) > self.max_grace_ms else plan

    def prepare(self, candidate: ClusterCandidate) -> DispatchPlan | None:
        return self._fit(self._plans.prepare(candidate))

    def prepare_with(self, tx, candidate: ClusterCandidate) -> DispatchPlan | None:
        return self._fit(self._plans.prepare_with(tx, candidate))
