"""Run creation and reads on the cluster authority; the PostgreSQL twin of
``adapters.sqlite.runs``. ``create_run`` is the one way a Run comes to exist (queued Run,
claimed Attempt, ``run.created`` + ``run.queued``) under the unique (project, idempotency key);
``task_start`` is ADR-0376 §2 inside the caller's SERIALIZABLE transaction. Functions take a
dict-row cursor."""

from __future__ import annotations

from ...core import states
from ...core.canonical import idempotency_key, sha256_hex, snapshot_ref
from ...core.cursor import format_run_cursor, parse_run_cursor
from ...core.errors import FenceRejected, NotFoundError, UnavailableError, ValidationError
from ...core.ids import new_id
from ...core.models import START_ROLES, Attempt, CreatedRun, Run, RunEvent, ScheduleCursor, TaskHead
from ...core.receipt import TruncationFact
from . import definitions as defs
from . import policy

MAX_PAGE = 200
# Runs not ended: the local live set plus the cluster's ``dispatching`` (a Lease is being offered).
LIVE = tuple(s for s in states.RunState.ALL_CLUSTER if s in states.RUN_LIVE_CLUSTER)
ACTIVE = tuple(s for s in states.RunState.ALL if s in states.RUN_ACTIVE)
# Runs that occupy a single-instance Task: leased to a Worker (``dispatching``) or started.
OCCUPYING = ("dispatching", *ACTIVE)


def append_event(cur, run_id: str, sequence: int, type_: str, actor: str, payload: dict, now_us: int) -> str:
    """Append RunEvent ``sequence`` (the caller moved ``runs.event_sequence`` to it)."""
    from psycopg.types.json import Jsonb
    eid = new_id()
    cur.execute("INSERT INTO run_events(run_id, sequence, event_id, type, actor, payload_json, created_at_us) "
                "VALUES (%s, %s, %s, %s, %s, %s, %s)", (run_id, sequence, eid, type_, actor, Jsonb(payload), now_us))
    return eid


def live_run_count(cur, task_id: str) -> int:
    return cur.execute("SELECT count(*) AS n FROM runs WHERE task_id = %s AND state = ANY(%s)",
                       (task_id, list(LIVE))).fetchone()["n"]


def set_holds(cur, task_id: str) -> None:
    """Recompute ``runs.held`` of the Task's queued single-instance Runs: held while the Task has
    a live Run (``dispatching`` — leased to a Worker —, ``starting`` or ``running``), as the
    local store does with its live states. Called wherever a Run of the Task enters or leaves
    the live set. Rows another transaction has locked are skipped, never waited for: a Pull
    holding its candidate page while it queues on the Task's row would otherwise deadlock with
    the claim that holds the row (the Pull's own claim guard then holds what it locked), and a
    hold left by a concurrent transaction is released by the sweeper
    (``PgLeaseStore.release_holds``)."""
    live = cur.execute("SELECT EXISTS (SELECT 1 FROM runs WHERE task_id = %s AND state = ANY(%s)) AS live",
                       (task_id, list(OCCUPYING))).fetchone()["live"]
    cur.execute("UPDATE runs SET held = %s WHERE run_id IN (SELECT run_id FROM runs WHERE task_id = %s"
                " AND state = 'queued' AND single_instance AND held = %s FOR NO KEY UPDATE SKIP LOCKED)",
                (live, task_id, not live))


def create_run(cur, *, head: TaskHead, origin: str, trigger_type: str, idempotency_key: str, requested_by: str,
               now_us: int, executor_type: str, scheduled_for_us: int | None = None,
               fences: dict | None = None) -> CreatedRun:
    """Insert a queued Run, its claimed Attempt (``executor_type``; a remote Worker runs the
    Task's ``local_process`` spec), ``run.created`` and ``run.queued`` (ADR-0376 §2 fields).
    A duplicate idempotency key is a unique violation (the caller's transaction retries)."""
    run_id, attempt_id = new_id(), new_id()
    ref = snapshot_ref(head.revision, head.content_digest)
    priority = 0 if trigger_type == "task_start" else head.definition.priority
    cur.execute(
        "INSERT INTO runs(run_id, project_id, task_id, task_revision, task_snapshot_ref, state, priority, "
        "execution_origin, execution_owner, trigger_type, idempotency_key, requested_by, scheduled_for_us, "
        "version, event_sequence, latest_attempt_id, latest_attempt_created_at_us, created_at_us, updated_at_us, "
        "single_instance) VALUES (%s, %s, %s, %s, %s, 'queued', %s, %s, 'runtime', %s, %s, %s, %s, 2, 2, %s, %s, "
        "%s, %s, %s)",
        (run_id, head.project_id, head.task_id, head.revision, ref, priority, origin, trigger_type, idempotency_key,
         requested_by, scheduled_for_us, attempt_id, now_us, now_us, now_us, head.definition.concurrency == "single"))
    cur.execute("INSERT INTO attempts(attempt_id, run_id, attempt_no, state, executor_type, created_at_us) "
                "VALUES (%s, %s, 1, 'claimed', %s, %s)", (attempt_id, run_id, executor_type, now_us))
    ex = cur.execute("SELECT execution_digest FROM execution_revisions WHERE task_id = %s AND revision = %s",
                     (head.task_id, head.revision)).fetchone()
    created = {"taskSnapshotRef": ref, "contentDigest": head.content_digest,
               "executionDigest": ex["execution_digest"] if ex else None, "trigger": trigger_type}
    if scheduled_for_us is not None:
        created["scheduledForUs"] = scheduled_for_us
    created.update(fences or {})
    e1 = append_event(cur, run_id, 1, "run.created", requested_by, created, now_us)
    e2 = append_event(cur, run_id, 2, "run.queued", requested_by,
                      {"attemptId": attempt_id, "executorType": executor_type}, now_us)
    set_holds(cur, head.task_id)
    return CreatedRun(run_id=run_id, attempt_id=attempt_id, event_ids=(e1, e2), task_revision=head.revision,
                      task_snapshot_ref=ref, state="queued", created_at_us=now_us)


def _persisted(cur, run: dict) -> CreatedRun:
    attempt = cur.execute("SELECT attempt_id FROM attempts WHERE run_id = %s AND attempt_no = 1",
                          (run["run_id"],)).fetchone()["attempt_id"]
    events = tuple(r["event_id"] for r in cur.execute(
        "SELECT event_id FROM run_events WHERE run_id = %s AND sequence <= 2 ORDER BY sequence", (run["run_id"],)))
    return CreatedRun(run_id=run["run_id"], attempt_id=attempt, event_ids=events, task_revision=run["task_revision"],
                      task_snapshot_ref=run["task_snapshot_ref"], state=run["state"],
                      created_at_us=run["created_at_us"], existing=True)


def task_start(cur, *, project: str, task: str, subject: str, mutation_id: str, expected_revision: int,
               expected_digest: str, admitted_project_version: int | None, admitted_binding_version: int | None,
               now_us: int, executor_type: str) -> CreatedRun:
    """ADR-0376 §2 in the record's order, inside the caller's SERIALIZABLE transaction:
    Project (FOR SHARE) → RoleBinding → idempotency key ``ql3:task-start:v1:{mutationId}`` →
    Task head (FOR UPDATE) fences → published execution revision → server IDs and time.
    Raises NotFoundError(task_not_found), FenceRejected(authorization_changed | mutation_conflict
    | definition_changed | task_disabled | task_not_executable), UnavailableError
    (task_start_unavailable) for a corrupt execution revision."""
    try:
        proj = policy.get_project(cur, project, lock=True)
    except NotFoundError:
        raise NotFoundError(f"task {task!r} does not exist", code="task_not_found") from None
    if not proj.active or (admitted_project_version is not None and proj.project_version != admitted_project_version):
        raise FenceRejected("authorization_changed", "the project changed since the request was admitted")
    binding = policy.latest_binding(cur, proj.project_id, subject)
    if binding is None or binding.role not in START_ROLES or (
            admitted_binding_version is not None and binding.binding_version != admitted_binding_version):
        raise FenceRejected("authorization_changed", "the subject's role binding no longer allows run.start")
    key = idempotency_key(mutation_id)
    prior = cur.execute("SELECT r.*, t.name AS task_name FROM runs r JOIN tasks t ON t.task_id = r.task_id "
                        "WHERE r.project_id = %s AND r.idempotency_key = %s", (proj.project_id, key)).fetchone()
    if prior is not None:
        if (task in (prior["task_id"], prior["task_name"])
                and prior["task_snapshot_ref"] == snapshot_ref(expected_revision, expected_digest)
                and prior["requested_by"] == subject and prior["trigger_type"] == "task_start"):
            return _persisted(cur, prior)
        raise FenceRejected("mutation_conflict", "this mutationId was used for a different request")
    head = defs.get_head(cur, proj.project_id, task, lock=True)
    if (head.revision, head.content_digest) != (expected_revision, expected_digest):
        raise FenceRejected("definition_changed",
                            f"task is at revision {head.revision} with digest {head.content_digest}")
    if not head.enabled:
        raise FenceRejected("task_disabled", "the task is disabled")
    ex = cur.execute("SELECT kind, execution_digest, spec_json FROM execution_revisions "
                     "WHERE task_id = %s AND revision = %s", (head.task_id, head.revision)).fetchone()
    if ex is None:
        raise FenceRejected("task_not_executable", "the task revision has no published execution revision")
    # ADR-0376 §2 "digest 正确": the stored spec must hash to its execution digest (fail closed).
    if ex["kind"] not in ("local_process", "shell") or sha256_hex(ex["spec_json"].encode()) != ex["execution_digest"]:
        raise UnavailableError("execution revision is corrupt", code="task_start_unavailable")
    return create_run(cur, head=head, origin="manual", trigger_type="task_start", idempotency_key=key,
                      requested_by=subject, now_us=now_us, executor_type=executor_type,
                      fences={"mutationId": mutation_id, "projectVersion": proj.project_version,
                              "bindingVersion": binding.binding_version})


def cancel_queued(cur, run_id: str, seq: int, version: int, actor: str, reason: str, now_us: int) -> bool:
    """queued → cancelled by compare-and-set on version; the claimed Attempt is cancelled too."""
    n = cur.execute("UPDATE runs SET state = 'cancelled', version = version + 1, event_sequence = %s, "
                    "cancel_requested_at_us = coalesce(cancel_requested_at_us, %s), updated_at_us = %s, "
                    "ended_at_us = %s WHERE run_id = %s AND version = %s AND state = 'queued'",
                    (seq + 1, now_us, now_us, now_us, run_id, version)).rowcount
    if n:
        cur.execute("UPDATE attempts SET state = 'cancelled', ended_at_us = %s WHERE run_id = %s AND state = 'claimed'",
                    (now_us, run_id))
        append_event(cur, run_id, seq + 1, "run.cancelled", actor, {"reason": reason, "from": "queued"}, now_us)
    return bool(n)


def cancel_queued_for_task(cur, task_id: str, actor: str, reason: str, now_us: int) -> int:
    rows = cur.execute("SELECT run_id, event_sequence, version FROM runs WHERE task_id = %s AND state = 'queued' "
                       "ORDER BY run_id FOR UPDATE", (task_id,)).fetchall()
    for r in rows:
        cancel_queued(cur, r["run_id"], r["event_sequence"], r["version"], actor, reason, now_us)
    return len(rows)


_RUN_SQL = "SELECT r.*, t.name AS task_name FROM runs r JOIN tasks t ON t.task_id = r.task_id "


def _run(row: dict) -> Run:
    return Run(run_id=row["run_id"], project_id=row["project_id"], task_id=row["task_id"], task_name=row["task_name"],
               task_revision=row["task_revision"], task_snapshot_ref=row["task_snapshot_ref"], state=row["state"],
               priority=row["priority"], execution_origin=row["execution_origin"],
               execution_owner=row["execution_owner"], trigger_type=row["trigger_type"],
               requested_by=row["requested_by"], scheduled_for_us=row["scheduled_for_us"], version=row["version"],
               event_sequence=row["event_sequence"], cancel_requested=row["cancel_requested_at_us"] is not None,
               latest_attempt_id=row["latest_attempt_id"], exit_code=row["exit_code"], exit_signal=row["exit_signal"],
               created_at_us=row["created_at_us"], updated_at_us=row["updated_at_us"], ended_at_us=row["ended_at_us"],
               held=bool(row["held"]))


def get_run(cur, run_id: str, project_id: str | None = None) -> Run:
    """By ID (without ``project_id`` also a unique prefix ≥ 8 chars); NotFoundError ``run_not_found``."""
    if project_id is not None:
        rows = cur.execute(_RUN_SQL + "WHERE r.run_id = %s AND r.project_id = %s", (run_id, project_id)).fetchall()
    elif len(run_id) >= 8:
        rows = cur.execute(_RUN_SQL + "WHERE r.run_id >= %s AND r.run_id < %s ORDER BY r.run_id LIMIT 2",
                           (run_id, run_id + "\uffff")).fetchall()
    else:
        rows = []
    if len(rows) != 1:
        raise NotFoundError(f"run {run_id!r} does not exist" if not rows else f"run prefix {run_id!r} is ambiguous",
                            code="run_not_found")
    return _run(rows[0])


def list_runs(cur, project_id: str, *, task_id: str | None, state: str | None, limit: int,
              cursor: str | None) -> tuple[list[Run], str | None]:
    """Keyset page newest first (created desc, run_id desc), ``limit + 1`` rows read."""
    if not (1 <= limit <= MAX_PAGE):
        raise ValidationError("limit", f"{limit} outside 1..{MAX_PAGE}", limit=MAX_PAGE)
    if state is not None and state not in states.RunState.ALL_CLUSTER:
        raise ValidationError("state", f"unknown state {state!r}; one of "
                                       f"{', '.join(sorted(states.RunState.ALL_CLUSTER))}")
    where, args = ["r.project_id = %s"], [project_id]
    if task_id:
        where.append("r.task_id = %s")
        args.append(task_id)
    if state:
        where.append("r.state = %s")
        args.append(state)
    if cursor is not None:
        c_at, c_id = parse_run_cursor(cursor)
        where.append("(r.created_at_us, r.run_id) < (%s, %s)")
        args += [c_at, c_id]
    rows = cur.execute(_RUN_SQL + "WHERE " + " AND ".join(where) + " ORDER BY r.created_at_us DESC, r.run_id DESC "
                       "LIMIT %s", (*args, limit + 1)).fetchall()
    runs = [_run(r) for r in rows[:limit]]
    nxt = format_run_cursor(runs[-1].created_at_us, runs[-1].run_id) if len(rows) > limit else None
    return runs, nxt


def list_events(cur, run_id: str) -> list[RunEvent]:
    return [RunEvent(run_id=r["run_id"], sequence=r["sequence"], event_id=r["event_id"], type=r["type"],
                     actor=r["actor"], payload=r["payload_json"], created_at_us=r["created_at_us"])
            for r in cur.execute("SELECT * FROM run_events WHERE run_id = %s ORDER BY sequence", (run_id,))]


def list_attempts(cur, run_id: str) -> list[Attempt]:
    rows = cur.execute("SELECT a.*, (f.attempt_id IS NOT NULL) AS truncated, w.name AS worker_name FROM attempts a "
                       "LEFT JOIN truncation_facts f ON f.attempt_id = a.attempt_id "
                       "LEFT JOIN workers w ON w.worker_id = a.worker_id "
                       "WHERE a.run_id = %s ORDER BY a.attempt_no", (run_id,)).fetchall()
    return [Attempt(attempt_id=r["attempt_id"], run_id=r["run_id"], attempt_no=r["attempt_no"], state=r["state"],
                    executor_type=r["executor_type"], exit_code=r["exit_code"], exit_signal=r["exit_signal"],
                    bytes_kept=r["bytes_kept"], bytes_dropped=r["bytes_dropped"], truncated=bool(r["truncated"]),
                    peak_rss_bytes=r["peak_rss_bytes"], cpu_time_us=r["cpu_time_us"],
                    failure_reason=r["failure_reason"], created_at_us=r["created_at_us"],
                    started_at_us=r["started_at_us"], ended_at_us=r["ended_at_us"], start_error=r["start_error"],
                    orphans_stopped=r["orphans_stopped"], worker_id=r["worker_id"],
                    worker_name=r["worker_name"]) for r in rows]


def latest_artifact(cur, run_id: str) -> tuple[str | None, TruncationFact | None]:
    """(log path of the latest Attempt with one, its truncation fact); NotFoundError
    ``log_not_found`` when retention pruned a log that had bytes."""
    row = cur.execute("SELECT a.artifact_path, f.quota_bytes, f.bytes_kept, f.bytes_dropped FROM attempts a "
                      "LEFT JOIN truncation_facts f ON f.attempt_id = a.attempt_id WHERE a.run_id = %s "
                      "AND a.artifact_path IS NOT NULL ORDER BY a.attempt_no DESC LIMIT 1", (run_id,)).fetchone()
    if row is None:
        if cur.execute("SELECT 1 FROM attempts WHERE run_id = %s AND ended_at_us IS NOT NULL AND bytes_kept > 0 "
                       "AND worker_id IS NULL LIMIT 1", (run_id,)).fetchone():
            raise NotFoundError("the log of this run was pruned by retention", code="log_not_found")
        return None, None
    fact = None if row["quota_bytes"] is None else TruncationFact(
        quota_bytes=row["quota_bytes"], bytes_kept=row["bytes_kept"], bytes_dropped=row["bytes_dropped"])
    return row["artifact_path"], fact


def active_run_ids(cur, task_id: str) -> list[str]:
    return [r["run_id"] for r in cur.execute("SELECT run_id FROM runs WHERE task_id = %s AND state = ANY(%s) "
                                             "ORDER BY run_id", (task_id, ["dispatching", *ACTIVE]))]


def queued_count(cur) -> int:
    return cur.execute("SELECT count(*) AS n FROM runs WHERE state = 'queued'").fetchone()["n"]


def oldest_queued_us(cur) -> int | None:
    """``created_at_us`` of the oldest queued Run, None when none is queued."""
    return cur.execute("SELECT min(created_at_us) AS t FROM runs WHERE state = 'queued'").fetchone()["t"]


def state_counts(cur) -> dict[str, int]:
    """state → Runs in it (states without a Run left out)."""
    rows = cur.execute("SELECT state, count(*) AS n FROM runs GROUP BY state").fetchall()
    return {r["state"]: r["n"] for r in rows}


def run_id_for_key(cur, project_id: str, key: str) -> str | None:
    row = cur.execute("SELECT run_id FROM runs WHERE project_id = %s AND idempotency_key = %s",
                      (project_id, key)).fetchone()
    return row["run_id"] if row else None


def schedule_cursors(cur) -> dict[str, ScheduleCursor]:
    return {r["task_id"]: ScheduleCursor(last_instant_us=r["last_instant_us"], observed_wall_us=r["observed_wall_us"])
            for r in cur.execute("SELECT * FROM schedule_cursors")}


def schedule_cursor(cur, task_id: str) -> ScheduleCursor | None:
    """The Task's cursor, row-locked (FOR UPDATE) so concurrent replicas compare-and-set it in turn."""
    row = cur.execute("SELECT * FROM schedule_cursors WHERE task_id = %s FOR UPDATE", (task_id,)).fetchone()
    return None if row is None else ScheduleCursor(last_instant_us=row["last_instant_us"],
                                                   observed_wall_us=row["observed_wall_us"])


def put_schedule_cursor(cur, task_id: str, c: ScheduleCursor) -> None:
    cur.execute("INSERT INTO schedule_cursors VALUES (%s, %s, %s) ON CONFLICT (task_id) DO UPDATE SET "
                "last_instant_us = excluded.last_instant_us, observed_wall_us = excluded.observed_wall_us",
                (task_id, c.last_instant_us, c.observed_wall_us))


def record_fire(cur, task_id: str, instant_us: int | None, run_id: str | None, now_us: int) -> None:
    """The (Task, instant) row of ``schedule_fires``: a second replica's fire of the same instant
    conflicts on its primary key (the transaction retries and finds the Run)."""
    if instant_us is not None:
        cur.execute("INSERT INTO schedule_fires VALUES (%s, %s, %s, %s)", (task_id, instant_us, run_id, now_us))

