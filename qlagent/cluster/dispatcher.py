"""ADR-0014 §2 steps 2–9 over one walk of the candidates: ``CandidateClaimer``, what a Worker
Pull (``cluster.pull``) runs inside its one transaction, with its budgets and ceilings.

1. candidate pages in ``ClusterCandidate.key()`` order, each checked fail-closed (more rows
   than asked, a duplicate, an order regression, a truncated page without a cursor or a cursor
   that does not advance refuse the Pull: ``FailClosed``); no candidate → no plan, no claim;
2. one plan at a time (``PlanSource.prepare``);
3. the ExecutionSpec sanitised (``execspec.sanitize``: deep copy, unknown fields stripped,
   validated, identity-checked) before any claim;
4. Placement with the candidate's executor type required (``placement.with_executor``);
5. deterministic order: score desc, free slots desc, Worker ID asc;
6. atomic claim with the snapshot record's Worker ID, Session ID and generation; a Worker that
   became unavailable → the next matched Worker (within the claim budget); an Attempt that is no
   longer claimable → stop that candidate;
7. only a written Lease yields a ClaimedExecutionOffer.

A budget that runs out raises ``BudgetExhausted`` naming it, never "no candidate". Budgets and
ceilings: ``DispatcherBudgets`` (``[cluster.dispatcher]``).
"""

from __future__ import annotations

from collections.abc import Callable

import msgspec

from ..core.canonical import sha256_hex
from ..core.cluster import (ClaimedExecutionOffer, ClaimOutcome, ClaimStatus, ClusterCandidate, Lease, Page, PlanSource,
                            PullUnit, WorkerSnapshot)
from ..core.errors import ValidationError
from ..core.leasefit import check_lease_ttl
from .execspec import ExecutionSpec, sanitize, spec_digest
from .offer import offer_id
from .placement import rank, with_executor

# ADR-0014 §1 hard ceilings.
MAX_PAGE_SIZE = 64
MAX_PAGES = 16
MAX_CLAIM_TRIES = 64


class DispatcherBudgets(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Per-Pull budgets (ADR-0014 §1 defaults: 8 candidates per page × 2 pages, 8 claim tries).
    ``lease_ttl_s``: seconds a new Lease lives before the Worker's starting ACK (core.leasefit: 6..3600)."""

    candidate_page_size: int = 8
    candidate_pages: int = 2
    claim_tries: int = 8
    lease_ttl_s: int = 30


def check_budgets(b: DispatcherBudgets, prefix: str = "cluster.dispatcher") -> DispatcherBudgets:
    """Refuse a configuration over a hard ceiling. Raises ValidationError naming the field."""
    if not 1 <= b.candidate_page_size <= MAX_PAGE_SIZE:
        raise ValidationError(f"{prefix}.candidate_page_size", f"{b.candidate_page_size} outside 1..{MAX_PAGE_SIZE}",
                              limit=MAX_PAGE_SIZE)
    if not 1 <= b.candidate_pages <= MAX_PAGES:
        raise ValidationError(f"{prefix}.candidate_pages", f"{b.candidate_pages} outside 1..{MAX_PAGES}",
                              limit=MAX_PAGES)
    if not 1 <= b.claim_tries <= MAX_CLAIM_TRIES:
        raise ValidationError(f"{prefix}.claim_tries", f"{b.claim_tries} outside 1..{MAX_CLAIM_TRIES}",
                              limit=MAX_CLAIM_TRIES)
    check_lease_ttl("cluster.lease_ttl_s", b.lease_ttl_s)     # a [cluster] key, not a dispatcher one
    return b


class FailClosed(Exception):
    """A page broke the paging contract; refuse the Pull."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class BudgetExhausted(Exception):
    """The candidate or claim budget ran out; ``reason`` names it (answered ``truncated``)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class CycleCounts:
    """What one walk tried (claims, against ``claim_tries``) and skipped, and why it last
    skipped a candidate."""

    __slots__ = ("claim_tries", "skipped", "skip_reason")

    def __init__(self) -> None:
        self.claim_tries = self.skipped = 0
        self.skip_reason: str | None = None

    def skip(self, reason: str) -> None:
        self.skipped += 1
        self.skip_reason = reason


def checked_page(page: Page, limit: int, after: tuple | None, seen: set, what: str) -> list:
    """The page's items if it keeps the paging contract, else FailClosed(``{what}_…``)."""
    if len(page.items) > limit:
        raise FailClosed(f"{what}_page_overflow")
    prev = after
    for item in page.items:
        ident, key = item.attempt_id, item.key()
        if ident in seen:
            raise FailClosed(f"{what}_duplicate")
        if prev is not None and not key > prev:
            raise FailClosed(f"{what}_order")
        seen.add(ident)
        prev = key
    if page.truncated:
        if page.next_cursor is None or not page.items or page.next_cursor != page.items[-1].key() or (
                after is not None and not page.next_cursor > after):
            raise FailClosed(f"{what}_cursor_not_advancing")
    return list(page.items)


def build_offer(c: ClusterCandidate, lease: Lease, spec: ExecutionSpec, token: str, source: str,
                score: int | None) -> ClaimedExecutionOffer:
    """The offer of a committed Lease (ADR-0014 §3): identities from the candidate, Session and
    generations from the Lease, the sanitised spec and its digest."""
    return ClaimedExecutionOffer(
        offer_id=offer_id(lease.attempt_id, lease.lease_generation, lease.session_id), source=source,
        run_id=c.run_id, attempt_id=c.attempt_id, project_id=c.project_id, task_id=c.task_id,
        task_revision=c.task_revision, worker_id=lease.worker_id, session_id=lease.session_id,
        generation=lease.worker_generation, lease_generation=lease.lease_generation,
        lease_expires_at_us=lease.expires_at_us, lease_token=token, spec_digest=spec_digest(spec),
        spec=spec, placement_score=score)


class CandidateClaimer:
    """ADR-0014 §2 steps 2–9 over one candidate walk inside a Worker Pull's ``PullUnit``."""

    def __init__(self, budgets: DispatcherBudgets) -> None:
        self.b = budgets

    def run(self, store: PullUnit, plans: PlanSource, observed_at_us: int, n: CycleCounts,
            workers: Callable[[], list[WorkerSnapshot]], token_for: Callable[[ClusterCandidate, WorkerSnapshot], str],
            pull_id: str | None = None) -> ClaimedExecutionOffer | None:
        """The first offer whose Lease ``store.claim`` wrote (committed at the end of the unit),
        or None when every candidate was seen and none claimed. Raises FailClosed or
        BudgetExhausted."""
        b = self.b
        after, seen, snapshot = None, set(), None
        for _ in range(b.candidate_pages):
            page = store.candidate_page(observed_at_us, b.candidate_page_size, after)
            items = checked_page(page, b.candidate_page_size, after, seen, "candidate")
            if not items:
                return None
            if snapshot is None:
                snapshot = workers()
            for c in items:
                got = self._one(store, plans, c, n, snapshot, token_for, pull_id)
                if isinstance(got, ClaimedExecutionOffer):
                    return got
            if not page.truncated:
                return None
            after = page.next_cursor
        raise BudgetExhausted("candidate_budget")

    def _one(self, store: PullUnit, plans: PlanSource, c: ClusterCandidate, n: CycleCounts,
             snapshot: list[WorkerSnapshot], token_for: Callable[[ClusterCandidate, WorkerSnapshot], str],
             pull_id: str | None) -> ClaimedExecutionOffer | None:
        plan = plans.prepare(c)
        if plan is None:
            return n.skip("plan_missing")
        try:
            spec = sanitize(plan.spec, c)
        except ValidationError:
            return n.skip("invalid_execution_spec")
        try:
            placement = with_executor(plan.placement, c.executor_type)
        except ValidationError:
            return n.skip("placement_conflict")
        ranked = rank(placement, [w for w in snapshot if w.serves(c.project_id)])
        if not ranked:
            return n.skip("no_matching_worker")
        for score, w in ranked:
            if n.claim_tries >= self.b.claim_tries:
                raise BudgetExhausted("claim_budget")
            n.claim_tries += 1
            token = token_for(c, w)
            out: ClaimOutcome = store.claim(c, w, sha256_hex(token.encode()), self.b.lease_ttl_s * 1_000_000, pull_id)
            if out.status == ClaimStatus.CLAIMED:
                return build_offer(c, out.lease, spec, token, "new_claim", score)
            if out.status == ClaimStatus.ATTEMPT_UNAVAILABLE:
                return n.skip(ClaimStatus.ATTEMPT_UNAVAILABLE)
            # The Worker went away or filled up after the snapshot: not for the rest of the cycle.
            snapshot[:] = [x for x in snapshot if x.worker_id != w.worker_id]
        return n.skip(ClaimStatus.WORKER_UNAVAILABLE)
