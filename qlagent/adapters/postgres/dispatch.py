"""The cluster dispatch store on PostgreSQL (``core.cluster.PullStore``) and the plan source
that rebuilds a Run's plan from its pinned revision (``core.cluster.PlanSource``).

Pages read ``limit + 1`` rows (the extra one only proves truncation) in keyset order, never
OFFSET. A lease is written by one statement (``queries.LEASE_CLAIM``): the Attempt's lease generation
advances by compare-and-set (guarded by the Run's version, state and latest Attempt and by no
active Lease), the Run moves ``queued → dispatching`` with its next event sequence, the Lease
row and the ``run.dispatching`` RunEvent are inserted; a unique index keeps one active Lease per
Attempt, so concurrent claimers on any number of replicas produce exactly one Lease.

A Worker Pull is one transaction from authentication to claim (``pull_unit``): the Session locked by the statement that authenticates it, candidate pages
locked ``FOR NO KEY UPDATE SKIP LOCKED`` (so concurrent Pulls take different Runs), plans from
the plan source's cache, then ``queries.LEASE_CLAIM``: 4 statements besides BEGIN/COMMIT for a new claim.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

import msgspec

from ...core.cluster import (ClaimOutcome, ClaimStatus, ClusterCandidate, DispatchPlan, Lease, Page, QuickPull,
                             QuickStatus, WorkerSnapshot)
from ...core.errors import ConflictError
from ...core.ids import new_id
from ...core.profiles import Profile
from ...core.states import AttemptState, LeaseState, SessionState, WorkerState
from .connection import read, statement, transaction
from .queries import (DB_NOW, LEASE_ACTIVE_ATTEMPT_FOR_UPDATE, LEASE_CLAIM, LEASE_COMPLETE, OCCUPYING, OFFER_DEFINITION,
                      PULL_CANDIDATE_PAGE, PULL_CANDIDATE_PAGE_AFTER, PULL_CANDIDATE_PAGE_SCOPED,
                      PULL_CANDIDATE_PAGE_SCOPED_AFTER, PULL_HELD_ELSEWHERE, PULL_HELD_ELSEWHERE_SCOPED, PULL_PRIOR,
                      PULL_QUICK, PULL_SESSION, TASK_FOR_NO_KEY_UPDATE)
from .runs import set_holds
from .transitions import authenticate, finish_attempt, now_us, stale_session

if TYPE_CHECKING:   # annotations only: psycopg loads where a connection is opened
    from psycopg_pool import ConnectionPool


def _candidate(row: dict) -> ClusterCandidate:
    return ClusterCandidate(row["run_id"], row["attempt_id"], row["project_id"], row["task_id"], row["task_revision"],
                            row["worker_executor"], row["version"], row["priority"], row["created_at_us"],
                            row["latest_attempt_created_at_us"], row["lease_generation"], row["single_instance"])


def lease_of(row: dict) -> Lease:
    return Lease(attempt_id=row["attempt_id"], run_id=row["run_id"], lease_generation=row["lease_generation"],
                 worker_id=row["worker_id"], session_id=row["session_id"],
                 worker_generation=row["worker_generation"], token_digest=row["token_digest"], state=row["state"],
                 claimed_at_us=row["claimed_at_us"], expires_at_us=row["expires_at_us"], pull_id=row["pull_id"])


def _page(items: list, limit: int) -> Page:
    if len(items) > limit:
        items = items[:limit]
        return Page(items, True, items[-1].key())
    return Page(items)


def _candidate_page(cur, observed_at_us: int, limit: int, after: tuple | None,
                    projects: tuple[str, ...] = ()) -> Page:
    """A keyset page of queued candidates, their Runs locked or skipped when another Pull holds
    them; ``projects``: only theirs (a scoped Worker's Pull: another Project's queue must not
    fill its pages)."""
    if projects:
        sql = PULL_CANDIDATE_PAGE_SCOPED if after is None else PULL_CANDIDATE_PAGE_SCOPED_AFTER
    else:
        sql = PULL_CANDIDATE_PAGE if after is None else PULL_CANDIDATE_PAGE_AFTER
    args = [observed_at_us, *([list(projects)] if projects else []), *(after or ())]
    # Plain tuples in ClusterCandidate's field order: no dict per row (a page is up to 65 rows).
    with cur.connection.cursor() as tuples:
        rows = tuples.execute(sql, (*args, limit + 1)).fetchall()
    return _page([ClusterCandidate(*r) for r in rows], limit)


def _lease(cur, c: ClusterCandidate, w: WorkerSnapshot, token_digest: str, lease_ttl_us: int, pull_id: str | None,
           now: int) -> ClaimOutcome:
    """``queries.LEASE_CLAIM`` for a Run whose row the caller has locked. A single-instance Run is claimed
    only while no other Run of its Task is live: claimers of one Task queue on the Task's row,
    so the guard in ``queries.LEASE_CLAIM`` (a statement of its own: a snapshot taken after that wait) sees
    a Run another claimer just moved to ``dispatching``; the Task's other queued Runs are then
    held (``runs.set_holds``) and leave the candidate pages until it ends."""
    from psycopg.types.json import Jsonb
    if c.single_instance:
        cur.execute(TASK_FOR_NO_KEY_UPDATE, (c.task_id,))
    row = cur.execute(LEASE_CLAIM, {
        "worker": w.worker_id, "session": w.session_id, "generation": w.generation, "attempt": c.attempt_id,
        "single": c.single_instance, "task": c.task_id, "occupying": list(OCCUPYING),
        "run": c.run_id, "version": c.version, "lg": c.lease_generation, "now": now, "expires": now + lease_ttl_us,
        "digest": token_digest, "pull": pull_id, "event": new_id(),
        "payload": Jsonb({"attemptId": c.attempt_id, "workerId": w.worker_id, "sessionId": w.session_id,
                          "generation": w.generation, "leaseGeneration": c.lease_generation + 1},
                         msgspec.json.encode)}).fetchone()
    if c.single_instance:
        # Claimed: the Task's other queued Runs wait. Refused while another Run occupies the
        # Task: the Runs this claimer locked (which that claim could not hold) wait too.
        set_holds(cur, c.task_id)
    if row is None:
        return ClaimOutcome(ClaimStatus.ATTEMPT_UNAVAILABLE, "run_changed")
    return ClaimOutcome(ClaimStatus.CLAIMED, lease=Lease(c.attempt_id, c.run_id, row["lease_generation"], w.worker_id,
                                               w.session_id, w.generation, token_digest, LeaseState.ACTIVE, now,
                                               now + lease_ttl_us, pull_id))


class PgDispatchStore:
    """``core.cluster.PullStore`` over a psycopg pool; Pull units rebuild plans with ``plans``
    (a ``PgPlanSource``) through their own connection."""

    def __init__(self, pool: ConnectionPool, plans: PgPlanSource | None = None) -> None:
        self._pool, self._plans = pool, plans

    def now_us(self) -> int:
        return read(self._pool, lambda cur: cur.execute(DB_NOW).fetchone()["now"])

    def pull_unit(self, worker_id: str, credential_digest: str, session_id: str, generation: int, pull_id: str,
                  work):
        """``core.cluster.PullStore.pull_unit``: one transaction, see the module docstring."""
        from psycopg import errors

        def tx(cur):
            s = cur.execute(PULL_SESSION, {"worker": worker_id, "credential": credential_digest,
                                            "session": session_id, "pull": pull_id}).fetchone()
            if s is None or s["generation"] != generation or s["worker_generation"] != generation:
                raise stale_session(session_id, generation, authenticate(cur, worker_id, credential_digest))
            if s["state"] != SessionState.OPEN or s["expires_at_us"] <= s["now"]:
                raise ConflictError("the Session expired; open a new one", code="session_expired")
            w = WorkerSnapshot(worker_id, session_id, generation, s["labels"], tuple(s["executor_types"]), s["slots"],
                               max(0, s["slots"] - s["used"]), s["worker_state"] == WorkerState.DRAINING,
                               tuple(s["projects"]))
            return work(_PgPullUnit(cur, self._plans, w, s["now"], pull_id if s["prior"] else None))

        try:
            return transaction(self._pool, tx)
        except errors.UniqueViolation:
            raise ConflictError("the database refused a second active Lease for an Attempt",
                                code="lease_exists") from None

    def quick_pull(self, worker_id: str, credential_digest: str, session_id: str, generation: int, pull_id: str,
                   token_digest: str, lease_ttl_us: int, claimable: list[str], waiting: bool) -> QuickPull:
        """``core.cluster.PullStore.quick_pull``: one call of ``ql_pull`` (migration 0018), its
        own transaction at READ COMMITTED like a Pull unit's."""
        from psycopg import errors
        args = (worker_id, credential_digest, session_id, generation, pull_id, token_digest, lease_ttl_us, claimable,
                waiting)
        try:
            row = statement(self._pool, lambda cur: cur.execute(PULL_QUICK, args).fetchone())
        except errors.UniqueViolation:
            raise ConflictError("the database refused a second active Lease for an Attempt",
                                code="lease_exists") from None
        if row["outcome"] != QuickStatus.LEASED:
            return QuickPull(row["outcome"], row["reason"], bool(row["held"]))
        now = row["now_us"]
        c = ClusterCandidate(row["run_id"], row["attempt_id"], row["project_id"], row["task_id"], row["task_revision"],
                             row["worker_executor"], row["version"], row["priority"], row["created_at_us"],
                             row["attempt_created_at_us"], row["lease_generation"], row["single_instance"])
        lease = Lease(c.attempt_id, c.run_id, row["new_lease_generation"], worker_id, session_id, generation,
                      token_digest, LeaseState.ACTIVE, now, row["expires_at_us"], pull_id)
        return QuickPull(QuickStatus.LEASED, candidate=c, lease=lease)

    def fail_claimed(self, attempt_id: str, lease_generation: int, reason: str) -> str | None:
        """``core.cluster.PullStore.fail_claimed`` in one transaction; the events are
        ``attempt.start_failed`` (payload ``reason``) then ``run.failed`` or ``run.retrying``."""
        def tx(cur):
            lease = cur.execute(LEASE_ACTIVE_ATTEMPT_FOR_UPDATE, (attempt_id, lease_generation)).fetchone()
            if lease is None or lease["state"] != AttemptState.CLAIMED:
                return None
            now = now_us(cur)
            cur.execute(LEASE_COMPLETE, (now, attempt_id, lease_generation))
            return finish_attempt(cur, lease["run_id"], attempt_id, AttemptState.START_FAILED, "control-plane", now,
                                  failure_reason=reason)
        return transaction(self._pool, tx)


class _PgPullUnit:
    """``core.cluster.PullUnit`` over the unit's cursor."""

    __slots__ = ("_cur", "_plans", "worker", "now_us", "_prior_pull", "_returned")

    def __init__(self, cur, plans: PgPlanSource, worker: WorkerSnapshot, now: int, prior_pull: str | None) -> None:
        self._cur, self._plans, self.worker, self.now_us, self._prior_pull = cur, plans, worker, now, prior_pull
        self._returned: list[str] = []

    def prior(self) -> tuple[Lease, ClusterCandidate, str] | None:
        if self._prior_pull is None:
            return None
        row = self._cur.execute(PULL_PRIOR, (self.worker.session_id, self._prior_pull)).fetchone()
        return lease_of(row), _candidate(row), row["attempt_state"]

    def candidate_page(self, observed_at_us: int, limit: int, after: tuple | None) -> Page:
        page = _candidate_page(self._cur, observed_at_us, limit, after, self.worker.projects)
        self._returned += [c.attempt_id for c in page.items]
        return page

    def held_elsewhere(self, observed_at_us: int) -> bool:
        if self.worker.projects:
            sql, args = PULL_HELD_ELSEWHERE_SCOPED, (observed_at_us, self._returned, list(self.worker.projects))
        else:
            sql, args = PULL_HELD_ELSEWHERE, (observed_at_us, self._returned)
        return self._cur.execute(sql, args).fetchone()["held"]

    def prepare(self, c: ClusterCandidate) -> DispatchPlan | None:
        return self._plans.prepare_with(self._cur, c)

    def claim(self, c: ClusterCandidate, w: WorkerSnapshot, token_digest: str, lease_ttl_us: int,
              pull_id: str | None = None) -> ClaimOutcome:
        if w != self.worker:
            # Only this unit's Session is locked and counted: any other Worker is not claimable here.
            return ClaimOutcome(ClaimStatus.WORKER_UNAVAILABLE, "not_this_session")
        return _lease(self._cur, c, w, token_digest, lease_ttl_us, pull_id, self.now_us)


PLAN_CACHE_REVISIONS = 256      # Task revisions a replica keeps parsed (each a few KiB at most)


class _Revision(msgspec.Struct, frozen=True):
    """The append-only rows of one Task revision a plan is built from, as JSON text."""

    project_id: str
    definition_json: str
    spec_json: str
    recipe_json: str


class PgPlanSource:
    """Rebuilds a Run's plan from its pinned Task revision, execution revision and context
    recipe. Those rows are append-only (the database refuses UPDATE and DELETE), so the rows of
    up to ``PLAN_CACHE_REVISIONS`` (Task, revision) pairs are kept, the oldest read dropped
    first; each plan decodes fresh documents from them, so a caller changing a plan's objects
    never changes another plan. The Task identity (project, Task, revision) comes from the
    revision's rows, the Run's and Attempt's from the candidate the authority returned."""

    def __init__(self, pool: ConnectionPool, profile: Profile, revisions: int = PLAN_CACHE_REVISIONS) -> None:
        self._pool, self._profile, self._max = pool, profile, revisions
        self._cache: dict[tuple[str, int], _Revision] = {}
        self._lock = threading.Lock()

    def prepare(self, candidate: ClusterCandidate) -> DispatchPlan | None:
        c = candidate
        rev = self._cache.get((c.task_id, c.task_revision))
        if rev is None:
            rev = read(self._pool, lambda cur: self._load(cur, c.task_id, c.task_revision))
        return None if rev is None else self._plan(rev, c)

    def prepare_with(self, tx, candidate: ClusterCandidate) -> DispatchPlan | None:
        """``prepare`` reading a missing revision through the caller's cursor ``tx``."""
        c = candidate
        rev = self._cache.get((c.task_id, c.task_revision)) or self._load(tx, c.task_id, c.task_revision)
        return None if rev is None else self._plan(rev, c)

    def _load(self, cur, task_id: str, revision: int) -> _Revision | None:
        row = cur.execute(
            OFFER_DEFINITION, (revision, task_id)).fetchone()
        if row is None:
            return None
        rev = _Revision(row["project_id"], row["definition_json"], row["spec_json"], row["recipe_json"])
        with self._lock:
            while len(self._cache) >= self._max:
                del self._cache[next(iter(self._cache))]
            self._cache[(task_id, revision)] = rev
        return rev

    def _plan(self, rev: _Revision, c: ClusterCandidate) -> DispatchPlan:
        definition = msgspec.json.decode(rev.definition_json)
        execution = msgspec.json.decode(rev.spec_json)
        recipe = msgspec.json.decode(rev.recipe_json)
        spec = {"runId": c.run_id, "attemptId": c.attempt_id, "projectId": rev.project_id,
                "taskId": c.task_id, "taskRevision": c.task_revision, "taskName": definition.get("name") or "",
                "executorType": c.executor_type, "kind": execution.get("kind"),
                "argv": execution.get("argv") or [], "shell": execution.get("shell"),
                "script": execution.get("script"), "cwd": execution.get("cwd"),
                "umask": execution.get("umask"), "keepOrphans": execution.get("keepOrphans", False),
                "onLeaseLoss": execution.get("onLeaseLoss") or "kill",
                "env": recipe.get("public", {}), "secretRefs": recipe.get("secretRefs", {}),
                "timeoutMs": definition.get("timeoutMs"), "graceMs": definition.get("graceMs"),
                "logQuotaBytes": self._profile.log_max_bytes}
        return DispatchPlan(spec=spec, placement=definition.get("placement") or {})
