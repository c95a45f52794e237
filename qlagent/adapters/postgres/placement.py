"""Unplaceable Runs (issue 10 §5): a queued Run whose Placement no enrolled Worker could ever
satisfy is reported with a ``run.unplaceable`` RunEvent (shown by ``run show``) rather than
waiting silently. "Could ever" reads the enrolments (labels, executor types), not the Sessions:
a Worker that is offline now may connect later; a removed one never will. Each queued Run is
checked once (``runs.placement_checked``); it stays queued and is offered as soon as a matching
Worker appears."""

from __future__ import annotations

import json

from ...core.cluster import EXECUTOR_LABEL
from .connection import transaction
from .transitions import event, now_us


class PgPlacementReport:
    """Over a psycopg pool; ``report(limit)`` checks up to ``limit`` Runs per call."""

    def __init__(self, pool) -> None:
        self._pool = pool

    def report(self, limit: int) -> tuple[int, int]:
        """One bounded pass (``FOR UPDATE SKIP LOCKED``: replicas share the work). Returns
        (Runs checked, Runs reported unplaceable)."""
        from psycopg.types.json import Jsonb

        def tx(cur):
            rows = cur.execute(
                "SELECT r.run_id, a.attempt_id, a.worker_executor, tr.definition_json FROM runs r"
                " JOIN attempts a ON a.attempt_id = r.latest_attempt_id"
                " JOIN task_revisions tr ON tr.task_id = r.task_id AND tr.revision = r.task_revision"
                " WHERE r.state = 'queued' AND NOT r.placement_checked AND a.executor_type = 'remote_worker'"
                " ORDER BY r.created_at_us LIMIT %s FOR UPDATE OF r SKIP LOCKED", (limit,)).fetchall()
            now, reported = now_us(cur), 0
            for r in rows:
                required = dict((json.loads(r["definition_json"]).get("placement") or {}).get("required") or {})
                executor = required.pop(EXECUTOR_LABEL, r["worker_executor"])
                possible = cur.execute("SELECT EXISTS (SELECT 1 FROM workers WHERE state <> 'removed'"
                                       " AND labels @> %s AND %s = ANY(executor_types)) AS ok",
                                       (Jsonb(required), executor)).fetchone()["ok"]
                cur.execute("UPDATE runs SET placement_checked = true WHERE run_id = %s", (r["run_id"],))
                if not possible:
                    event(cur, r["run_id"], "run.unplaceable", "control-plane",
                          {"attemptId": r["attempt_id"], "reason": "no_enrolled_worker_matches",
                           "required": {**required, EXECUTOR_LABEL: executor}}, now)
                    reported += 1
            return len(rows), reported
        return transaction(self._pool, tx)
