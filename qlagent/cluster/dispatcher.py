"""ClusterDispatcher: one bounded, transport-agnostic dispatch cycle (ADR-0014 §1–§5).

``dispatch_once()`` owns no timer or thread; the caller schedules the next cycle. Fixed order:

1. one ``observedAt`` from the authority's clock; active Lease recovery first (Run dispatching,
   Attempt claimed, not cancelled, Lease unexpired, Session current): a recoverable Lease is
   offered again with the SAME offerId and token (both derive from the Lease), its plan rebuilt
   from the Run's pinned revision; a missing plan or a drifted identity fails the cycle closed.
   Recovery walks the Leases with a keyset cursor across cycles (one recovery page read per
   cycle, one offer): each recoverable Lease is offered once per walk; a walk ends when no Lease
   is left after the cursor (that cycle goes on to new candidates) or after
   ``recovery_page_size × recovery_pages`` offers (that cycle returns ``truncated`` with reason
   ``recovery_budget`` and the next one starts a new walk);
2. only then the first candidate page; no candidate → no Worker query, no plan, no claim;
3. a bounded Worker snapshot (Worker ID order), read once per cycle after the first candidate;
4. one plan at a time (``PlanSource.prepare``);
5. the ExecutionSpec sanitised (``execspec.sanitize``: deep copy, unknown fields stripped,
   validated, identity-checked) before any claim;
6. Placement with the candidate's executor type required (``placement.with_executor``);
7. deterministic order: score desc, free slots desc, Worker ID asc;
8. atomic claim with the snapshot record's Worker ID, Session ID and generation; a Worker that
   became unavailable → the next matched Worker (within the claim budget); an Attempt that is no
   longer claimable → stop that candidate;
9. only a committed Lease yields a ClaimedExecutionOffer.

Pages are checked fail-closed: more rows than asked, a duplicate, an order regression, a
truncated page without a cursor or a cursor that does not advance refuse the cycle
(``status="refused"``). A budget that runs out returns ``status="truncated"`` with its reason,
never "no candidate". Results without a claim carry counts and a low-cardinality reason only.

New-claim lease tokens are derived by the control plane: base64url(HMAC-SHA256(lease_key,
offerId)), so a restarted dispatcher rebuilds the same token from the same Lease while the
database holds only its SHA-256. Budgets and ceilings: ``DispatcherBudgets``.
"""

from __future__ import annotations

import base64
import hmac
from collections.abc import Callable

import msgspec

from ..core.canonical import sha256_hex
from ..core.cluster import (ClaimOutcome, ClusterCandidate, ClusterDispatchStore, Lease, Page, PlanSource,
                            PullUnit, WorkerSnapshot)
from ..core.errors import ValidationError
from ..core.leasefit import check_lease_ttl
from .execspec import ExecutionSpec, sanitize, spec_digest
from ..core.cluster import ClaimedExecutionOffer
from .offer import offer_id
from .placement import rank, with_executor

# ADR-0014 §1 hard ceilings.
MAX_PAGE_SIZE = 64
MAX_PAGES = 16
MAX_WORKERS = 64
MAX_CLAIM_TRIES = 64
MIN_LEASE_KEY_BYTES = 32


class DispatcherBudgets(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Per-cycle budgets (ADR-0014 §1 defaults: 8 per page × 2 pages, 8 claim tries).
    ``lease_ttl_s``: seconds a new Lease lives before the Worker's starting ACK (core.leasefit: 6..3600)."""

    recovery_page_size: int = 8
    recovery_pages: int = 2
    candidate_page_size: int = 8
    candidate_pages: int = 2
    worker_page_size: int = 8
    worker_pages: int = 2
    claim_tries: int = 8
    lease_ttl_s: int = 30


def check_budgets(b: DispatcherBudgets, prefix: str = "cluster.dispatcher") -> DispatcherBudgets:
    """Refuse a configuration over a hard ceiling. Raises ValidationError naming the field."""
    for name in ("recovery_page_size", "candidate_page_size", "worker_page_size"):
        v = getattr(b, name)
        if not 1 <= v <= MAX_PAGE_SIZE:
            raise ValidationError(f"{prefix}.{name}", f"{v} outside 1..{MAX_PAGE_SIZE}", limit=MAX_PAGE_SIZE)
    for name in ("recovery_pages", "candidate_pages", "worker_pages"):
        v = getattr(b, name)
        if not 1 <= v <= MAX_PAGES:
            raise ValidationError(f"{prefix}.{name}", f"{v} outside 1..{MAX_PAGES}", limit=MAX_PAGES)
    if b.worker_page_size * b.worker_pages > MAX_WORKERS:
        raise ValidationError(f"{prefix}.worker_pages",
                              f"{b.worker_page_size} × {b.worker_pages} Workers exceed the per-cycle ceiling",
                              limit=MAX_WORKERS)
    if not 1 <= b.claim_tries <= MAX_CLAIM_TRIES:
        raise ValidationError(f"{prefix}.claim_tries", f"{b.claim_tries} outside 1..{MAX_CLAIM_TRIES}",
                              limit=MAX_CLAIM_TRIES)
    check_lease_ttl("cluster.lease_ttl_s", b.lease_ttl_s)     # a [cluster] key, not a dispatcher one
    return b


class CycleResult(msgspec.Struct, frozen=True, kw_only=True):
    """Outcome of one cycle. ``status``: offered | idle | unmatched | truncated | refused.
    ``reason`` is a short code; only ``offered`` carries an ``offer``."""

    status: str
    reason: str | None = None
    truncated: bool = False
    recovery_read: int = 0
    candidates_read: int = 0
    workers_read: int = 0
    plans: int = 0
    claim_tries: int = 0
    skipped: int = 0
    offer: ClaimedExecutionOffer | None = None


class FailClosed(Exception):
    """A port broke the paging contract or a recovery cannot be proven; refuse the cycle."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class BudgetExhausted(Exception):
    """A scan or claim budget ran out; ``reason`` names it (reported as ``truncated``)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class CycleCounts:
    """What one cycle read, prepared and tried (low-cardinality figures of its result)."""

    __slots__ = ("recovery_read", "candidates_read", "workers_read", "plans", "claim_tries", "skipped",
                 "skip_reason", "workers_truncated")

    def __init__(self) -> None:
        self.recovery_read = self.candidates_read = self.workers_read = 0
        self.plans = self.claim_tries = self.skipped = 0
        self.skip_reason: str | None = None
        self.workers_truncated = False

    def skip(self, reason: str) -> None:
        self.skipped += 1
        self.skip_reason = reason

    def result(self, status: str, reason: str | None = None, offer=None) -> CycleResult:
        return CycleResult(status=status, reason=reason, truncated=status == "truncated", offer=offer,
                           recovery_read=self.recovery_read, candidates_read=self.candidates_read,
                           workers_read=self.workers_read, plans=self.plans, claim_tries=self.claim_tries,
                           skipped=self.skipped)


def _ident(item) -> str:
    if isinstance(item, WorkerSnapshot):
        return item.worker_id
    return item.lease.attempt_id if hasattr(item, "lease") else item.attempt_id


def checked_page(page: Page, limit: int, after: tuple | None, seen: set, what: str) -> list:
    """The page's items if it keeps the paging contract, else FailClosed(``{what}_…``)."""
    if len(page.items) > limit:
        raise FailClosed(f"{what}_page_overflow")
    prev = after
    for item in page.items:
        ident, key = _ident(item), item.key()
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


def derived_token(lease_key: bytes, oid: str) -> str:
    """Control-plane lease token of one offer: base64url(HMAC-SHA256(lease_key, offerId))."""
    mac = hmac.new(lease_key, oid.encode(), "sha256").digest()
    return base64.urlsafe_b64encode(mac).rstrip(b"=").decode()


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
    """ADR-0014 §2 steps 2–9 over one candidate walk; shared by the dispatcher (over the
    ``ClusterDispatchStore``) and Worker Pull (over its ``PullUnit``)."""

    def __init__(self, budgets: DispatcherBudgets) -> None:
        self.b = budgets

    def run(self, store: ClusterDispatchStore | PullUnit, plans: PlanSource, observed_at_us: int, n: CycleCounts,
            workers: Callable[[], list[WorkerSnapshot]], token_for: Callable[[ClusterCandidate, WorkerSnapshot], str],
            pull_id: str | None = None) -> ClaimedExecutionOffer | None:
        """The first offer whose Lease ``store.claim`` wrote (committed by then for the
        dispatcher's store; at the end of the unit for a PullUnit), or None when every candidate
        was seen and none claimed. Raises FailClosed or BudgetExhausted."""
        b = self.b
        after, seen, snapshot = None, set(), None
        for _ in range(b.candidate_pages):
            page = store.candidate_page(observed_at_us, b.candidate_page_size, after)
            items = checked_page(page, b.candidate_page_size, after, seen, "candidate")
            n.candidates_read += len(items)
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

    def _one(self, store, plans, c, n: CycleCounts, snapshot: list[WorkerSnapshot], token_for, pull_id):
        plan = plans.prepare(c)
        n.plans += 1
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
            if out.status == "claimed":
                return build_offer(c, out.lease, spec, token, "new_claim", score)
            if out.status == "attempt_unavailable":
                return n.skip("attempt_unavailable")
            # The Worker went away or filled up after the snapshot: not for the rest of the cycle.
            snapshot[:] = [x for x in snapshot if x.worker_id != w.worker_id]
        return n.skip("worker_unavailable")


class ClusterDispatcher:
    """In-process dispatcher of a control plane (ADR-0014). See the module docstring.

    ``lease_key``: ≥ 32 secret bytes the control plane derives lease tokens from. Raises
    ValidationError at construction for a budget over a ceiling or a short key.
    """

    def __init__(self, store: ClusterDispatchStore, plans: PlanSource, lease_key: bytes,
                 budgets: DispatcherBudgets = DispatcherBudgets()) -> None:
        self._b = check_budgets(budgets)
        if not isinstance(lease_key, bytes) or len(lease_key) < MIN_LEASE_KEY_BYTES:
            raise ValidationError("cluster.lease_key", f"needs at least {MIN_LEASE_KEY_BYTES} bytes",
                                  limit=MIN_LEASE_KEY_BYTES)
        self._store, self._plans, self._key = store, plans, lease_key
        self._claimer = CandidateClaimer(self._b)
        self._recovery_after: tuple | None = None
        self._walked = 0

    def dispatch_once(self) -> CycleResult:
        """One bounded cycle; never raises for a candidate's problems (UnavailableError from the
        store propagates: the authority is unreachable)."""
        n = CycleCounts()
        observed = self._store.now_us()
        try:
            offer = self._recover(observed, n)
            if offer is not None:
                return n.result("offered", "lease_recovery", offer)
            offer = self._claimer.run(self._store, self._plans, observed, n, lambda: self._workers(observed, n),
                                      self._token)
        except FailClosed as e:
            return n.result("refused", e.reason)
        except BudgetExhausted as e:
            return n.result("truncated", e.reason)
        if offer is not None:
            return n.result("offered", "new_claim", offer)
        if n.workers_truncated and n.skipped:
            return n.result("truncated", "worker_budget")
        if n.candidates_read == 0:
            return n.result("idle")
        return n.result("unmatched", n.skip_reason)

    def _token(self, c: ClusterCandidate, w: WorkerSnapshot) -> str:
        return derived_token(self._key, offer_id(c.attempt_id, c.lease_generation + 1, w.session_id))

    def _recover(self, observed: int, n: CycleCounts) -> ClaimedExecutionOffer | None:
        b = self._b
        if self._walked >= b.recovery_page_size * b.recovery_pages:
            # This walk used its budget: say so; the next cycle starts a new walk.
            self._recovery_after, self._walked = None, 0
            raise BudgetExhausted("recovery_budget")
        after = self._recovery_after
        page = self._store.recovery_page(observed, b.recovery_page_size, after)
        items = checked_page(page, b.recovery_page_size, after, set(), "recovery")
        n.recovery_read += len(items)
        if not items:
            self._recovery_after, self._walked = None, 0
            return None
        r = items[0]
        lease = r.lease
        if lease.state != "active" or lease.expires_at_us <= observed:
            raise FailClosed("recovery_lease_expired")
        plan = self._plans.prepare(r.candidate)
        n.plans += 1
        if plan is None:
            raise FailClosed("recovery_plan_missing")
        try:
            spec = sanitize(plan.spec, r.candidate)
        except ValidationError:
            raise FailClosed("recovery_plan_drift") from None
        token = derived_token(self._key, offer_id(lease.attempt_id, lease.lease_generation, lease.session_id))
        if sha256_hex(token.encode()) != lease.token_digest:
            raise FailClosed("recovery_token_mismatch")
        self._recovery_after, self._walked = r.key(), self._walked + 1
        return build_offer(r.candidate, lease, spec, token, "lease_recovery", None)

    def _workers(self, observed: int, n: CycleCounts) -> list[WorkerSnapshot]:
        b, after, seen, out = self._b, None, set(), []
        for _ in range(b.worker_pages):
            page = self._store.worker_page(observed, b.worker_page_size, after)
            out += checked_page(page, b.worker_page_size, after, seen, "worker")
            n.workers_read = len(out)
            if len(out) > MAX_WORKERS:
                raise FailClosed("worker_total_over_limit")
            if not page.truncated:
                return out
            after = page.next_cursor
        n.workers_truncated = True
        return out
