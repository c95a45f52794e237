"""The cluster authority's own Run rows; the rows both stores share are ``adapters.rows.runs``.

``set_holds`` serves the modules that hold a bare psycopg cursor (dispatch, transitions);
``record_fire`` marks a cron fire's (Task, instant) for ``PgStore``.
"""

from __future__ import annotations

from ..rows import runs as shared
from .dialect import POSTGRES


def set_holds(cur, task_id: str) -> None:
    """``rows.runs.set_holds`` on a dict-row cursor of the caller's transaction."""
    shared.set_holds(POSTGRES.db(cur), task_id)


def record_fire(db, task_id: str, instant_us: int | None, run_id: str | None, now_us: int) -> None:
    """The (Task, instant) row of ``schedule_fires``: a second replica's fire of the same instant
    conflicts on its primary key (the transaction retries and finds the Run)."""
    if instant_us is not None:
        db.run("SCHEDULE_FIRE_INSERT", (task_id, instant_us, run_id, now_us))
