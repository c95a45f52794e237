"""The cluster authority's own Run rows; the rows both stores share are ``adapters.rows.runs``.

``set_holds`` serves the modules that hold a bare psycopg cursor (dispatch, transitions);
``record_fire`` marks a cron fire's (Task, instant) for ``PgStore``; ``start_args``/``started``
are ADR-0376 §2 as one call of the database function ``ql_task_start`` (migration 0016).
"""

from __future__ import annotations

from ...core.models import START_ROLES, CreatedRun
from ..rows import runs as shared
from .dialect import POSTGRES

_START_ROLES = sorted(START_ROLES)


def set_holds(cur, task_id: str) -> None:
    """``rows.runs.set_holds`` on a dict-row cursor of the caller's transaction."""
    shared.set_holds(POSTGRES.db(cur), task_id)


def record_fire(db, task_id: str, instant_us: int | None, run_id: str | None, now_us: int) -> None:
    """The (Task, instant) row of ``schedule_fires``: a second replica's fire of the same instant
    conflicts on its primary key (the transaction retries and finds the Run)."""
    if instant_us is not None:
        db.run("SCHEDULE_FIRE_INSERT", (task_id, instant_us, run_id, now_us))


def start_args(*, project: str, task: str, subject: str, mutation_id: str, expected_revision: int,
               expected_digest: str, admitted_project_version: int | None, admitted_binding_version: int | None,
               now_us: int | None, executor_type: str) -> tuple:
    """The parameters of ``queries.TASK_START`` (``rows.runs.task_start``'s; ``now_us`` None:
    the database clock)."""
    return (project, task, subject, mutation_id, expected_revision, expected_digest, admitted_project_version,
            admitted_binding_version, _START_ROLES, executor_type, now_us)


def start_in_one_message(db, args: tuple, project: str, key: str, task: str) -> CreatedRun:
    """``queries.TASK_START_ROUND_TRIP`` on a client-side binding cursor in autocommit: BEGIN,
    the call, COMMIT and the Pulls' wake-up for a queued Run under ``key`` in ONE simple query;
    ``started`` of the call's row."""
    db.run("TASK_START_ROUND_TRIP", (*args, project, key))
    db.nextset()                # past BEGIN: the function's row
    return started(db.fetchone(), task)


def started(row: dict, task: str) -> CreatedRun:
    """The Run of ``ql_task_start``'s row (ADR-0376 §2 on the cluster: the same steps in the same
    order as ``rows.runs.task_start``, in the caller's SERIALIZABLE transaction); a refusal
    raises what ``rows.runs.refusal`` names for it (nothing was written)."""
    if row["outcome"] not in ("accepted", "existing"):
        raise shared.refusal(row["outcome"], task, row["head_revision"], row["head_digest"])
    return CreatedRun(run_id=row["run_id"], attempt_id=row["attempt_id"], event_ids=tuple(row["event_ids"]),
                      task_revision=row["task_revision"], task_snapshot_ref=row["task_snapshot_ref"],
                      state=row["state"], created_at_us=row["created_at_us"], existing=row["outcome"] == "existing")
