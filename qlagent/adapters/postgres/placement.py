"""Unplaceable Runs (issue 10 §5): a queued Run whose Placement no enrolled Worker could ever
satisfy is reported with a ``run.unplaceable`` RunEvent (shown by ``run show``) rather than
waiting silently. "Could ever" reads the enrolments (labels, executor types, Projects), not the Sessions:
a Worker that is offline now may connect later; a removed one never will. Each queued Run is
checked once (``runs.placement_checked``); it stays queued and is offered as soon as a matching
Worker appears. A Run whose ``grace_s`` the Lease cannot hold (core.leasefit: its Worker would
stop it right after it starts) is reported with reason ``grace_exceeds_lease``, its grace and the
limit; the dispatcher never offers it (cluster.placement.LeaseFitPlans)."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from ...core.executors import EXECUTOR_LABEL
from .connection import transaction
from .queries import PLACEMENT_CHECKED, PLACEMENT_UNCHECKED_FOR_UPDATE, PLACEMENT_WORKER_FITS
from .transitions import event, now_us

if TYPE_CHECKING:   # annotations only: psycopg loads where a connection is opened
    from psycopg_pool import ConnectionPool


class PgPlacementReport:
    """Over a psycopg pool; ``report(limit)`` checks up to ``limit`` Runs per call.
    ``max_grace_ms``: the longest grace the replica's Lease holds (core.leasefit.max_grace_ms)."""

    def __init__(self, pool: ConnectionPool, max_grace_ms: int) -> None:
        self._pool, self._max_grace_ms = pool, max_grace_ms

    def report(self, limit: int) -> tuple[int, int]:
        """One bounded pass (``FOR UPDATE SKIP LOCKED``: replicas share the work). Returns
        (Runs checked, Runs reported unplaceable)."""
        from psycopg.types.json import Jsonb

        def tx(cur):
            rows = cur.execute(
                PLACEMENT_UNCHECKED_FOR_UPDATE, (limit,)).fetchall()
            now, reported = now_us(cur), 0
            for r in rows:
                definition = json.loads(r["definition_json"])
                cur.execute(PLACEMENT_CHECKED, (r["run_id"],))
                grace_ms = definition.get("graceMs") or 0
                if grace_ms > self._max_grace_ms:
                    event(cur, r["run_id"], "run.unplaceable", "control-plane",
                          {"attemptId": r["attempt_id"], "reason": "grace_exceeds_lease", "field": "grace_s",
                           "graceS": grace_ms / 1000, "limitS": max(self._max_grace_ms, 0) / 1000}, now)
                    reported += 1
                    continue
                required = dict((definition.get("placement") or {}).get("required") or {})
                executor = required.pop(EXECUTOR_LABEL, r["worker_executor"])
                possible = cur.execute(PLACEMENT_WORKER_FITS,
                                       (Jsonb(required), executor, r["project_id"])).fetchone()["ok"]
                if not possible:
                    event(cur, r["run_id"], "run.unplaceable", "control-plane",
                          {"attemptId": r["attempt_id"], "reason": "no_enrolled_worker_matches",
                           "required": {**required, EXECUTOR_LABEL: executor}}, now)
                    reported += 1
            return len(rows), reported
        return transaction(self._pool, tx)
