"""The cluster dispatch store on PostgreSQL (``core.cluster.ClusterDispatchStore``) and the plan
source that rebuilds a Run's plan from its pinned revision (``core.cluster.PlanSource``).

Pages read ``limit + 1`` rows (the extra one only proves truncation) in keyset order, never
OFFSET. A claim is one READ COMMITTED transaction: the Session row is locked (its free slots are
counted under the lock), the Run moves ``queued → dispatching`` by compare-and-set on its
version, the Attempt's lease generation advances by compare-and-set, and the Lease row is
inserted under a unique index of one active Lease per Attempt, so concurrent claimers on any
number of replicas produce exactly one Lease.
"""

from __future__ import annotations

import json

from ...core.cluster import ClaimOutcome, ClusterCandidate, DispatchPlan, Lease, Page, Recovery, WorkerSnapshot
from ...core.errors import ConflictError
from ...core.profiles import Profile
from .connection import read, transaction
from .transitions import authenticate, event, finish_attempt, now_us

_CANDIDATE_COLS = """r.run_id, a.attempt_id, r.project_id, r.task_id, r.task_revision, a.worker_executor,
    r.version, r.priority, r.created_at_us, r.latest_attempt_created_at_us, a.lease_generation"""
_KEY = "(-r.priority), r.created_at_us, r.latest_attempt_created_at_us, r.latest_attempt_id"


def _candidate(row: dict) -> ClusterCandidate:
    return ClusterCandidate(row["run_id"], row["attempt_id"], row["project_id"], row["task_id"], row["task_revision"],
                            row["worker_executor"], row["version"], row["priority"], row["created_at_us"],
                            row["latest_attempt_created_at_us"], row["lease_generation"])


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


class _Unclaimable(Exception):
    pass


class PgDispatchStore:
    """``core.cluster.ClusterDispatchStore`` and ``SessionView`` over a psycopg pool."""

    def __init__(self, pool) -> None:
        self._pool = pool

    def now_us(self) -> int:
        return read(self._pool, lambda cur: cur.execute("SELECT ql_now_us() AS now").fetchone()["now"])

    def candidate_page(self, observed_at_us: int, limit: int, after: tuple | None) -> Page:
        sql = (f"SELECT {_CANDIDATE_COLS} FROM runs r JOIN attempts a ON a.attempt_id = r.latest_attempt_id"
               " WHERE r.state = 'queued' AND r.cancel_requested_at_us IS NULL AND NOT r.held"
               " AND a.state = 'claimed' AND a.executor_type = 'remote_worker'"
               " AND (a.not_before_us IS NULL OR a.not_before_us <= %s)")
        args: list = [observed_at_us]
        if after is not None:
            sql += f" AND ({_KEY}) > (%s, %s, %s, %s)"
            args += list(after)
        sql += f" ORDER BY {_KEY} LIMIT %s"
        rows = read(self._pool, lambda cur: cur.execute(sql, (*args, limit + 1)).fetchall())
        return _page([_candidate(r) for r in rows], limit)

    def recovery_page(self, observed_at_us: int, limit: int, after: tuple | None) -> Page:
        sql = (f"SELECT {_CANDIDATE_COLS}, l.* FROM run_leases l"
               " JOIN attempts a ON a.attempt_id = l.attempt_id JOIN runs r ON r.run_id = l.run_id"
               " JOIN worker_sessions s ON s.session_id = l.session_id JOIN workers w ON w.worker_id = l.worker_id"
               " WHERE l.state = 'active' AND l.pull_id IS NULL AND a.state = 'claimed'"
               " AND r.state = 'dispatching' AND r.latest_attempt_id = a.attempt_id"
               " AND r.cancel_requested_at_us IS NULL AND l.expires_at_us > %(obs)s"
               " AND s.state = 'open' AND s.expires_at_us > %(obs)s AND w.current_session_id = l.session_id"
               " AND w.generation = l.worker_generation AND w.state IN ('active', 'draining')")
        args = {"obs": observed_at_us, "lim": limit + 1}
        if after is not None:
            sql += " AND l.attempt_id > %(after)s"
            args["after"] = after[0]
        sql += " ORDER BY l.attempt_id LIMIT %(lim)s"
        rows = read(self._pool, lambda cur: cur.execute(sql, args).fetchall())
        return _page([Recovery(_candidate(r), lease_of(r)) for r in rows], limit)

    def worker_page(self, observed_at_us: int, limit: int, after: tuple | None) -> Page:
        sql = ("SELECT w.worker_id, s.session_id, s.generation, s.labels, s.executor_types, s.slots,"
               " s.slots - (SELECT count(*) FROM run_leases l WHERE l.session_id = s.session_id"
               "            AND l.state = 'active') AS free"
               " FROM workers w JOIN worker_sessions s ON s.session_id = w.current_session_id"
               " WHERE w.state = 'active' AND s.state = 'open' AND s.expires_at_us > %(obs)s"
               " AND s.generation = w.generation")
        args = {"obs": observed_at_us, "lim": limit + 1}
        if after is not None:
            sql += " AND w.worker_id > %(after)s"
            args["after"] = after[0]
        sql += " ORDER BY w.worker_id LIMIT %(lim)s"
        rows = read(self._pool, lambda cur: cur.execute(sql, args).fetchall())
        return _page([WorkerSnapshot(r["worker_id"], r["session_id"], r["generation"], r["labels"],
                                     tuple(r["executor_types"]), r["slots"], max(0, r["free"])) for r in rows], limit)

    def claim(self, c: ClusterCandidate, w: WorkerSnapshot, token_digest: str, lease_ttl_us: int,
              pull_id: str | None = None) -> ClaimOutcome:
        from psycopg import errors

        def tx(cur):
            s = cur.execute(
                "SELECT s.slots, s.state, s.expires_at_us, w.state AS worker_state, w.current_session_id,"
                " w.generation AS worker_generation, ql_now_us() AS now,"
                " (SELECT count(*) FROM run_leases l WHERE l.session_id = s.session_id AND l.state = 'active') AS used"
                " FROM worker_sessions s JOIN workers w ON w.worker_id = s.worker_id"
                " WHERE s.session_id = %s AND s.worker_id = %s AND s.generation = %s FOR NO KEY UPDATE OF s",
                (w.session_id, w.worker_id, w.generation)).fetchone()
            if s is None:
                return ClaimOutcome("worker_unavailable", "session_unknown")
            now = s["now"]
            if not (s["state"] == "open" and s["expires_at_us"] > now and s["worker_state"] == "active"
                    and s["current_session_id"] == w.session_id and s["worker_generation"] == w.generation):
                return ClaimOutcome("worker_unavailable", "session_not_current")
            if s["used"] >= s["slots"]:
                return ClaimOutcome("worker_unavailable", "no_free_slot")
            # A Run another claimer holds is lost to it: stop this candidate at once rather than
            # wait for that commit only to fail the version check after it.
            if cur.execute("SELECT 1 FROM runs WHERE run_id = %s FOR NO KEY UPDATE SKIP LOCKED",
                           (c.run_id,)).fetchone() is None:
                return ClaimOutcome("attempt_unavailable", "run_locked")
            run = cur.execute("UPDATE runs SET state = 'dispatching', version = version + 1, updated_at_us = %s"
                              " WHERE run_id = %s AND version = %s AND state = 'queued'"
                              " AND cancel_requested_at_us IS NULL AND latest_attempt_id = %s RETURNING run_id",
                              (now, c.run_id, c.version, c.attempt_id)).fetchone()
            if run is None:
                return ClaimOutcome("attempt_unavailable", "run_changed")
            a = cur.execute("UPDATE attempts SET lease_generation = lease_generation + 1, worker_id = %s,"
                            " version = version + 1 WHERE attempt_id = %s AND state = 'claimed'"
                            " AND lease_generation = %s RETURNING lease_generation",
                            (w.worker_id, c.attempt_id, c.lease_generation)).fetchone()
            if a is None:
                raise _Unclaimable()
            row = cur.execute(
                "INSERT INTO run_leases(attempt_id, lease_generation, run_id, worker_id, session_id,"
                " worker_generation, token_digest, pull_id, state, claimed_at_us, expires_at_us)"
                " VALUES (%s, %s, %s, %s, %s, %s, %s, %s, 'active', %s, %s) RETURNING *",
                (c.attempt_id, a["lease_generation"], c.run_id, w.worker_id, w.session_id, w.generation,
                 token_digest, pull_id, now, now + lease_ttl_us)).fetchone()
            event(cur, c.run_id, "run.dispatching", "control-plane",
                  {"attemptId": c.attempt_id, "workerId": w.worker_id, "sessionId": w.session_id,
                   "generation": w.generation, "leaseGeneration": a["lease_generation"]}, now)
            return ClaimOutcome("claimed", lease=lease_of(row))

        try:
            return transaction(self._pool, tx)
        except (_Unclaimable, errors.UniqueViolation):
            return ClaimOutcome("attempt_unavailable", "lease_exists")

    def session(self, worker_id: str, credential_digest: str, session_id: str, generation: int) -> WorkerSnapshot:
        """The authenticated Worker's current Session (``core.cluster.SessionView``)."""
        def tx(cur):
            w = authenticate(cur, worker_id, credential_digest)
            s = cur.execute(
                "SELECT s.*, ql_now_us() AS now, (SELECT count(*) FROM run_leases l WHERE l.session_id = s.session_id"
                " AND l.state = 'active') AS used FROM worker_sessions s WHERE s.session_id = %s AND s.worker_id = %s",
                (session_id, worker_id)).fetchone()
            if s is None or s["generation"] != generation or w["generation"] != generation:
                raise ConflictError(f"generation {generation} is stale (current {w['generation']})",
                                    code="stale_generation")
            if s["state"] != "open" or s["expires_at_us"] <= s["now"]:
                raise ConflictError("the Session expired; open a new one", code="session_expired")
            return WorkerSnapshot(worker_id, session_id, generation, s["labels"], tuple(s["executor_types"]),
                                  s["slots"], max(0, s["slots"] - s["used"]), w["state"] == "draining")
        return read(self._pool, tx)

    def lease_for_pull(self, session_id: str, pull_id: str) -> tuple[Lease, ClusterCandidate, str] | None:
        row = read(self._pool, lambda cur: cur.execute(
            f"SELECT {_CANDIDATE_COLS}, l.*, a.state AS attempt_state FROM run_leases l"
            " JOIN attempts a ON a.attempt_id = l.attempt_id JOIN runs r ON r.run_id = l.run_id"
            " WHERE l.session_id = %s AND l.pull_id = %s", (session_id, pull_id)).fetchone())
        if row is None:
            return None
        return lease_of(row), _candidate(row), row["attempt_state"]

    def fail_claimed(self, attempt_id: str, lease_generation: int, reason: str) -> str | None:
        """``core.cluster.ClusterDispatchStore.fail_claimed`` in one transaction; the events are
        ``attempt.start_failed`` (payload ``reason``) then ``run.failed`` or ``run.retrying``."""
        def tx(cur):
            lease = cur.execute("SELECT l.run_id, a.state FROM run_leases l JOIN attempts a USING (attempt_id)"
                                " WHERE l.attempt_id = %s AND l.lease_generation = %s AND l.state = 'active'"
                                " FOR UPDATE OF l, a", (attempt_id, lease_generation)).fetchone()
            if lease is None or lease["state"] != "claimed":
                return None
            now = now_us(cur)
            cur.execute("UPDATE run_leases SET state = 'completed', ended_at_us = %s"
                        " WHERE attempt_id = %s AND lease_generation = %s", (now, attempt_id, lease_generation))
            return finish_attempt(cur, lease["run_id"], attempt_id, "start_failed", "control-plane", now,
                                  failure_reason=reason)
        return transaction(self._pool, tx)


class PgPlanSource:
    """Rebuilds a Run's plan from its pinned Task revision, execution revision and context
    recipe; identities come from the database rows, never from the candidate passed in."""

    def __init__(self, pool, profile: Profile) -> None:
        self._pool, self._profile = pool, profile

    def prepare(self, c: ClusterCandidate) -> DispatchPlan | None:
        row = read(self._pool, lambda cur: cur.execute(
            "SELECT r.run_id, r.project_id, r.task_id, r.task_revision, a.attempt_id, a.worker_executor,"
            " tr.definition_json, er.spec_json, cr.recipe_json"
            " FROM runs r JOIN attempts a ON a.attempt_id = %s AND a.run_id = r.run_id"
            " JOIN task_revisions tr ON tr.task_id = r.task_id AND tr.revision = r.task_revision"
            " JOIN execution_revisions er ON er.task_id = r.task_id AND er.revision = r.task_revision"
            " JOIN context_recipes cr ON cr.recipe_ref = er.recipe_ref WHERE r.run_id = %s",
            (c.attempt_id, c.run_id)).fetchone())
        if row is None:
            return None
        definition, execution, recipe = (json.loads(row[k]) for k in ("definition_json", "spec_json", "recipe_json"))
        spec = {"runId": row["run_id"], "attemptId": row["attempt_id"], "projectId": row["project_id"],
                "taskId": row["task_id"], "taskRevision": row["task_revision"],
                "executorType": row["worker_executor"], "kind": execution.get("kind"),
                "argv": execution.get("argv") or [], "shell": execution.get("shell"),
                "script": execution.get("script"), "cwd": execution.get("cwd"),
                "umask": execution.get("umask"), "keepOrphans": execution.get("keepOrphans", False),
                "onLeaseLoss": execution.get("onLeaseLoss") or "kill",
                "env": recipe.get("public", {}), "secretRefs": recipe.get("secretRefs", {}),
                "timeoutMs": definition.get("timeoutMs"), "graceMs": definition.get("graceMs"),
                "logQuotaBytes": self._profile.log_max_bytes}
        return DispatchPlan(spec=spec, placement=definition.get("placement") or {})
