"""Run creation and reads in the local store.

``create_run`` is the one way a Run comes to exist: queued Run, claimed Attempt, ``run.created``
and ``run.queued`` in the caller's transaction, under a unique (project, idempotency key).
``task_start`` is ADR-0376 §2 for the SQLite authority; the scheduler and the CLI use the same
``create_run``.
"""

from __future__ import annotations

import sqlite3

import msgspec

from ...core import states
from ...core.canonical import idempotency_key, sha256_hex, snapshot_ref
from ...core.cursor import format_run_cursor, parse_run_cursor
from ...core.errors import FenceRejected, NotFoundError, UnavailableError, ValidationError
from ...core.ids import new_id
from ...core.models import START_ROLES, Attempt, CreatedRun, Run, RunEvent, ScheduleCursor, TaskHead
from ...core.receipt import TruncationFact
from . import definitions as defs
from . import policy

_enc = msgspec.json.Encoder(order="sorted")


def sql_in(values: frozenset, order: tuple[str, ...]) -> str:
    """``('a','b')``: a state set (core.states) as a SQL ``IN`` list, in lifecycle ``order`` so the
    text is stable (SQLite picks a partial index only when a query repeats its WHERE verbatim)."""
    return "(" + ",".join(f"'{v}'" for v in order if v in values) + ")"


RUN_LIVE_SQL = sql_in(states.RUN_LIVE, states.RunState.ALL)     # ('queued','starting','running'): runs_by_state
RUN_ACTIVE_SQL = sql_in(states.RUN_ACTIVE, states.RunState.ALL)
ATTEMPT_ACTIVE_SQL = sql_in(states.ATTEMPT_ACTIVE, states.AttemptState.ALL)


def append_event(conn: sqlite3.Connection, run_id: str, sequence: int, type_: str, actor: str,
                 payload: dict, now_us: int) -> str:
    """Append RunEvent ``sequence`` (the caller bumped ``runs.event_sequence`` to it)."""
    eid = new_id()
    conn.execute("INSERT INTO run_events VALUES (?, ?, ?, ?, ?, ?, ?)",
                 (run_id, sequence, eid, type_, actor, _enc.encode(payload).decode(), now_us))
    return eid


def live_run_count(conn: sqlite3.Connection, task_id: str) -> int:
    """Runs of the Task not yet ended (queued included): a single-instance fire is skipped then."""
    return conn.execute(f"SELECT count(*) FROM runs WHERE task_id = ? AND state IN {RUN_LIVE_SQL}",
                        (task_id,)).fetchone()[0]


def set_holds(conn: sqlite3.Connection, task_id: str) -> None:
    """Recompute ``runs.held`` for a Task's queued single-instance Runs after one of its Runs
    was created, started or ended: held (out of the dispatch index) while the Task has a
    starting/running Run, released when it has none. Equality seeks on runs_by_task_state
    only, so the cost is the number of Runs whose flag changes. Admission still re-checks."""
    live = conn.execute("SELECT EXISTS (SELECT 1 FROM runs WHERE task_id = ?1 AND state = 'starting') "
                        "OR EXISTS (SELECT 1 FROM runs WHERE task_id = ?1 AND state = 'running')",
                        (task_id,)).fetchone()[0]
    conn.execute("UPDATE runs SET held = ?1 WHERE task_id = ?2 AND state = 'queued' AND single_instance = 1 "
                 "AND held = ?3", (int(live), task_id, int(not live)))


def create_run(conn: sqlite3.Connection, *, head: TaskHead, origin: str, trigger_type: str,
               idempotency_key: str, requested_by: str, now_us: int, executor_type: str = "local_process",
               scheduled_for_us: int | None = None, fences: dict | None = None) -> CreatedRun:
    """Insert a queued Run, its claimed Attempt (``executor_type``: the local agent runs
    ``local_process``) and ``run.created`` + ``run.queued``.

    Run fields follow ADR-0376 §2: execution_owner=runtime, priority from the definition
    (0 for task_start), version=2, event_sequence=2, task_snapshot_ref ``qltd:v1:{rev}:{digest}``.
    Event payloads carry digests and fences only. Raises sqlite3.IntegrityError if the
    idempotency key exists (callers look it up first inside the same transaction).
    """
    run_id, attempt_id = new_id(), new_id()
    ref = snapshot_ref(head.revision, head.content_digest)
    priority = 0 if trigger_type == "task_start" else head.definition.priority
    conn.execute(
        "INSERT INTO runs(run_id, project_id, task_id, task_revision, task_snapshot_ref, state, priority, "
        "execution_origin, execution_owner, trigger_type, idempotency_key, requested_by, scheduled_for_us, "
        "version, event_sequence, latest_attempt_id, latest_attempt_created_at_us, created_at_us, updated_at_us, "
        "single_instance) VALUES (?, ?, ?, ?, ?, 'queued', ?, ?, 'runtime', ?, ?, ?, ?, 2, 2, ?, ?, ?, ?, ?)",
        (run_id, head.project_id, head.task_id, head.revision, ref, priority, origin, trigger_type,
         idempotency_key, requested_by, scheduled_for_us, attempt_id, now_us, now_us, now_us,
         int(head.definition.concurrency == "single")))
    conn.execute("INSERT INTO attempts(attempt_id, run_id, attempt_no, state, executor_type, created_at_us) "
                 "VALUES (?, ?, 1, 'claimed', ?, ?)", (attempt_id, run_id, executor_type, now_us))
    exec_digest = conn.execute("SELECT execution_digest FROM execution_revisions WHERE task_id = ? AND revision = ?",
                               (head.task_id, head.revision)).fetchone()
    created = {"taskSnapshotRef": ref, "contentDigest": head.content_digest,
               "executionDigest": exec_digest[0] if exec_digest else None, "trigger": trigger_type}
    if scheduled_for_us is not None:
        created["scheduledForUs"] = scheduled_for_us
    created.update(fences or {})
    e1 = append_event(conn, run_id, 1, "run.created", requested_by, created, now_us)
    e2 = append_event(conn, run_id, 2, "run.queued", requested_by,
                      {"attemptId": attempt_id, "executorType": executor_type}, now_us)
    set_holds(conn, head.task_id)
    return CreatedRun(run_id=run_id, attempt_id=attempt_id, event_ids=(e1, e2), task_revision=head.revision,
                      task_snapshot_ref=ref, state="queued", created_at_us=now_us)


def persisted_identity(conn: sqlite3.Connection, run_row) -> CreatedRun:
    """The persisted identities of a Run (first Attempt, first two events) for exact replay."""
    attempt = conn.execute("SELECT attempt_id FROM attempts WHERE run_id = ? AND attempt_no = 1",
                           (run_row["run_id"],)).fetchone()[0]
    events = tuple(r[0] for r in conn.execute(
        "SELECT event_id FROM run_events WHERE run_id = ? AND sequence <= 2 ORDER BY sequence", (run_row["run_id"],)))
    return CreatedRun(run_id=run_row["run_id"], attempt_id=attempt, event_ids=events,
                      task_revision=run_row["task_revision"], task_snapshot_ref=run_row["task_snapshot_ref"],
                      state=run_row["state"], created_at_us=run_row["created_at_us"], existing=True)


def task_start(conn: sqlite3.Connection, *, project: str, task: str, subject: str, mutation_id: str,
               expected_revision: int, expected_digest: str, admitted_project_version: int | None,
               admitted_binding_version: int | None, now_us: int) -> CreatedRun:
    """ADR-0376 §2, one BEGIN IMMEDIATE transaction (the caller's ``authority.write``), in order:

    1. active Project and projectVersion (re-verified against admission when given);
    2. subject's latest active RoleBinding, bindingVersion and a start role;
    3. idempotency key ``ql3:task-start:v1:{mutationId}``: exact replay → persisted identity
       (``existing=True``), any drift → FenceRejected(mutation_conflict);
    4. Task head: NotFoundError(task_not_found); fence → definition_changed; enabled → task_disabled;
    5. published execution revision → task_not_executable if missing, UnavailableError if corrupt;
    6. server-generated Run, Attempt, two RunEvents and time.
    """
    try:
        proj = policy.get_project(conn, project)
    except NotFoundError:
        raise NotFoundError(f"task {task!r} does not exist", code="task_not_found") from None
    if not proj.active or (admitted_project_version is not None and proj.project_version != admitted_project_version):
        raise FenceRejected("authorization_changed", "the project changed since the request was admitted")
    binding = policy.latest_binding(conn, proj.project_id, subject)
    if binding is None or binding.role not in START_ROLES or (
            admitted_binding_version is not None and binding.binding_version != admitted_binding_version):
        raise FenceRejected("authorization_changed", "the subject's role binding no longer allows run.start")
    key = idempotency_key(mutation_id)
    prior = conn.execute("SELECT * FROM runs WHERE project_id = ? AND idempotency_key = ?",
                         (proj.project_id, key)).fetchone()
    if prior is not None:
        same_task = prior["task_id"] == task or conn.execute(
            "SELECT 1 FROM tasks WHERE task_id = ? AND name = ?", (prior["task_id"], task)).fetchone()
        if (same_task and prior["task_snapshot_ref"] == snapshot_ref(expected_revision, expected_digest)
                and prior["requested_by"] == subject and prior["trigger_type"] == "task_start"):
            return persisted_identity(conn, prior)
        raise FenceRejected("mutation_conflict", "this mutationId was used for a different request")
    head = defs.get_head(conn, proj.project_id, task)
    if (head.revision, head.content_digest) != (expected_revision, expected_digest):
        raise FenceRejected("definition_changed",
                            f"task is at revision {head.revision} with digest {head.content_digest}")
    if not head.enabled:
        raise FenceRejected("task_disabled", "the task is disabled")
    ex = conn.execute("SELECT kind, execution_digest, spec_json FROM execution_revisions "
                      "WHERE task_id = ? AND revision = ?", (head.task_id, head.revision)).fetchone()
    if ex is None:
        raise FenceRejected("task_not_executable", "the task revision has no published execution revision")
    # ADR-0376 §2 "digest 正确": the stored spec must hash to its execution digest (fail closed).
    if ex[0] not in ("local_process", "shell") or sha256_hex(ex[2].encode()) != ex[1]:
        raise UnavailableError("execution revision is corrupt", code="task_start_unavailable")
    return create_run(conn, head=head, origin="manual", trigger_type="task_start", idempotency_key=key,
                      requested_by=subject, now_us=now_us,
                      fences={"mutationId": mutation_id, "projectVersion": proj.project_version,
                              "bindingVersion": binding.binding_version})


def cancel_queued_for_task(conn: sqlite3.Connection, task_id: str, actor: str, reason: str, now_us: int) -> int:
    """Cancel every queued Run of a Task (disable/remove); returns how many."""
    rows = conn.execute("SELECT run_id, event_sequence, version FROM runs WHERE task_id = ? AND state = 'queued'",
                        (task_id,)).fetchall()
    for r in rows:
        cancel_queued(conn, r[0], r[1], r[2], actor, reason, now_us)
    return len(rows)


def cancel_queued(conn: sqlite3.Connection, run_id: str, seq: int, version: int, actor: str, reason: str,
                  now_us: int) -> bool:
    """queued → cancelled with CAS on version; the claimed Attempt becomes cancelled too."""
    n = conn.execute("UPDATE runs SET state = 'cancelled', version = version + 1, event_sequence = ?, "
                     "cancel_requested_at_us = coalesce(cancel_requested_at_us, ?), updated_at_us = ?, "
                     "ended_at_us = ? WHERE run_id = ? AND version = ? AND state = 'queued'",
                     (seq + 1, now_us, now_us, now_us, run_id, version)).rowcount
    if n:
        conn.execute("UPDATE attempts SET state = 'cancelled', ended_at_us = ? WHERE run_id = ? AND state = 'claimed'",
                     (now_us, run_id))
        append_event(conn, run_id, seq + 1, "run.cancelled", actor, {"reason": reason, "from": "queued"}, now_us)
    return bool(n)


_RUN_SQL = ("SELECT r.*, t.name AS task_name FROM runs r JOIN tasks t ON t.task_id = r.task_id ")


def _run(row) -> Run:
    return Run(run_id=row["run_id"], project_id=row["project_id"], task_id=row["task_id"], task_name=row["task_name"],
               task_revision=row["task_revision"], task_snapshot_ref=row["task_snapshot_ref"], state=row["state"],
               priority=row["priority"], execution_origin=row["execution_origin"],
               execution_owner=row["execution_owner"], trigger_type=row["trigger_type"],
               requested_by=row["requested_by"], scheduled_for_us=row["scheduled_for_us"], version=row["version"],
               event_sequence=row["event_sequence"], cancel_requested=row["cancel_requested_at_us"] is not None,
               latest_attempt_id=row["latest_attempt_id"], exit_code=row["exit_code"],
               exit_signal=row["exit_signal"], created_at_us=row["created_at_us"],
               updated_at_us=row["updated_at_us"], ended_at_us=row["ended_at_us"],
               held=bool(row["held"]))


def get_run(conn: sqlite3.Connection, run_id: str, project_id: str | None = None) -> Run:
    """A Run by ID (or unique ID prefix ≥ 8 chars, for the CLI); NotFoundError (``run_not_found``)."""
    if project_id is not None:
        rows = conn.execute(_RUN_SQL + "WHERE r.run_id = ? AND r.project_id = ?", (run_id, project_id)).fetchall()
    elif len(run_id) >= 8:
        rows = conn.execute(_RUN_SQL + "WHERE r.run_id >= ? AND r.run_id < ? LIMIT 2",
                            (run_id, run_id + "\uffff")).fetchall()
    else:
        rows = []
    if len(rows) != 1:
        raise NotFoundError(f"run {run_id!r} does not exist" if not rows else f"run prefix {run_id!r} is ambiguous",
                            code="run_not_found")
    return _run(rows[0])


MAX_PAGE = 200


def list_runs(conn: sqlite3.Connection, project_id: str, *, task_id: str | None = None, state: str | None = None,
              limit: int = 50, cursor: str | None = None) -> tuple[list[Run], str | None]:
    """Keyset page of Runs, newest first (created desc, run_id desc); returns (runs, next cursor).

    Reads ``limit + 1`` rows: the extra row only proves there is a next page.
    ``limit`` 1..200; cursor is ``{created_at_us}.{run_id}`` from the previous page.
    """
    if not (1 <= limit <= MAX_PAGE):
        raise ValidationError("limit", f"{limit} outside 1..{MAX_PAGE}", limit=MAX_PAGE)
    if state is not None and state not in states.RunState.ALL:
        raise ValidationError("state", f"unknown state {state!r}; one of {', '.join(sorted(states.RunState.ALL))}")
    where, args = ["r.project_id = ?"], [project_id]
    if task_id:
        where.append("r.task_id = ?")
        args.append(task_id)
    if state:
        where.append("r.state = ?")
        args.append(state)
    if cursor is not None:
        c_at, c_id = parse_run_cursor(cursor)
        where.append("(r.created_at_us < ? OR (r.created_at_us = ? AND r.run_id < ?))")
        args += [c_at, c_at, c_id]
    rows = conn.execute(_RUN_SQL + "WHERE " + " AND ".join(where) +
                        " ORDER BY r.created_at_us DESC, r.run_id DESC LIMIT ?", (*args, limit + 1)).fetchall()
    runs = [_run(r) for r in rows[:limit]]
    nxt = format_run_cursor(runs[-1].created_at_us, runs[-1].run_id) if len(rows) > limit else None
    return runs, nxt


def list_events(conn: sqlite3.Connection, run_id: str) -> list[RunEvent]:
    return [RunEvent(run_id=r[0], sequence=r[1], event_id=r[2], type=r[3], actor=r[4],
                     payload=msgspec.json.decode(r[5]), created_at_us=r[6])
            for r in conn.execute("SELECT * FROM run_events WHERE run_id = ? ORDER BY sequence", (run_id,))]


def list_attempts(conn: sqlite3.Connection, run_id: str) -> list[Attempt]:
    rows = conn.execute("SELECT a.*, (f.attempt_id IS NOT NULL) AS truncated FROM attempts a "
                        "LEFT JOIN truncation_facts f ON f.attempt_id = a.attempt_id "
                        "WHERE a.run_id = ? ORDER BY a.attempt_no", (run_id,)).fetchall()
    return [Attempt(attempt_id=r["attempt_id"], run_id=r["run_id"], attempt_no=r["attempt_no"], state=r["state"],
                    executor_type=r["executor_type"], exit_code=r["exit_code"], exit_signal=r["exit_signal"],
                    bytes_kept=r["bytes_kept"], bytes_dropped=r["bytes_dropped"], truncated=bool(r["truncated"]),
                    peak_rss_bytes=r["peak_rss_bytes"], cpu_time_us=r["cpu_time_us"],
                    failure_reason=r["failure_reason"], created_at_us=r["created_at_us"],
                    started_at_us=r["started_at_us"], ended_at_us=r["ended_at_us"], start_error=r["start_error"],
                    orphans_stopped=r["orphans_stopped"]) for r in rows]


def latest_artifact(conn: sqlite3.Connection, run_id: str) -> tuple[str | None, TruncationFact | None]:
    """(artifact path of the latest Attempt that has one, its truncation fact or None).

    Raises NotFoundError(code ``log_not_found``) when the Run wrote output whose log retention
    has since deleted (an empty log and a never-started Run give (None, None)).
    """
    row = conn.execute("SELECT a.attempt_id, a.artifact_path, f.quota_bytes, f.bytes_kept, f.bytes_dropped "
                       "FROM attempts a LEFT JOIN truncation_facts f ON f.attempt_id = a.attempt_id "
                       "WHERE a.run_id = ? AND a.artifact_path IS NOT NULL ORDER BY a.attempt_no DESC LIMIT 1",
                       (run_id,)).fetchone()
    if row is None:
        if conn.execute("SELECT 1 FROM attempts WHERE run_id = ? AND ended_at_us IS NOT NULL "
                        "AND bytes_kept > 0 LIMIT 1", (run_id,)).fetchone():
            raise NotFoundError("the log of this run was pruned by retention", code="log_not_found")
        return None, None
    fact = None if row[2] is None else TruncationFact(quota_bytes=row[2], bytes_kept=row[3], bytes_dropped=row[4])
    return row[1], fact


def active_run_ids(conn: sqlite3.Connection, task_id: str) -> list[str]:
    """The Task's Runs that are starting or running."""
    return [r[0] for r in conn.execute(f"SELECT run_id FROM runs WHERE task_id = ? AND state IN {RUN_ACTIVE_SQL}",
                                       (task_id,))]


def queued_count(conn: sqlite3.Connection) -> int:
    return conn.execute("SELECT count(*) FROM runs WHERE state = 'queued'").fetchone()[0]


def oldest_queued_us(conn: sqlite3.Connection) -> int | None:
    """``created_at_us`` of the oldest queued Run, None when none is queued."""
    return conn.execute("SELECT min(created_at_us) FROM runs WHERE state = 'queued'").fetchone()[0]


def state_counts(conn: sqlite3.Connection) -> dict[str, int]:
    """state → Runs in it (states without a Run left out)."""
    return dict(conn.execute("SELECT state, count(*) FROM runs GROUP BY state").fetchall())


def run_id_for_key(conn: sqlite3.Connection, project_id: str, key: str) -> str | None:
    """The Run created under idempotency ``key`` in the Project, else None."""
    row = conn.execute("SELECT run_id FROM runs WHERE project_id = ? AND idempotency_key = ?",
                       (project_id, key)).fetchone()
    return row[0] if row else None


def schedule_cursors(conn: sqlite3.Connection) -> dict[str, ScheduleCursor]:
    return {r[0]: ScheduleCursor(last_instant_us=r[1], observed_wall_us=r[2]) for r in conn.execute(
        "SELECT task_id, last_instant_us, observed_wall_us FROM schedule_cursors")}


def schedule_cursor(conn: sqlite3.Connection, task_id: str) -> ScheduleCursor | None:
    row = conn.execute("SELECT last_instant_us, observed_wall_us FROM schedule_cursors WHERE task_id = ?",
                       (task_id,)).fetchone()
    return None if row is None else ScheduleCursor(last_instant_us=row[0], observed_wall_us=row[1])


def put_schedule_cursor(conn: sqlite3.Connection, task_id: str, cur: ScheduleCursor) -> None:
    conn.execute("INSERT INTO schedule_cursors VALUES (?, ?, ?) ON CONFLICT(task_id) DO UPDATE SET "
                 "last_instant_us = excluded.last_instant_us, observed_wall_us = excluded.observed_wall_us",
                 (task_id, cur.last_instant_us, cur.observed_wall_us))
