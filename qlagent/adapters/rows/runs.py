"""Run creation, cancels of queued Runs, Run reads and schedule cursors on either store. Every
function takes the ``rows.dialect.Db`` of the caller's transaction.

``create_run`` is the one way a Run comes to exist: queued Run, claimed Attempt, ``run.created``
and ``run.queued`` in the caller's transaction, under a unique (project, idempotency key);
``task_start`` is ADR-0376 §2 inside it (the local store's BEGIN IMMEDIATE, the cluster's
SERIALIZABLE transaction with the Project and Task rows locked).
"""

from __future__ import annotations

from ...core.canonical import idempotency_key, sha256_hex, snapshot_ref
from ...core.cursor import format_run_cursor, parse_run_cursor
from ...core.errors import FenceRejected, NotFoundError, QlError, UnavailableError, ValidationError
from ...core.ids import new_id
from ...core.models import START_ROLES, Attempt, CreatedRun, Run, RunEvent, ScheduleCursor, TaskHead
from ...core.receipt import TruncationFact
from ...core.states import RunState
from ...core.text import quote_bounded
from . import definitions as defs
from . import policy
from .dialect import Db

MAX_PAGE = 200


def append_event(db: Db, run_id: str, sequence: int, type_: str, actor: str, payload: dict, now_us: int) -> str:
    """Append RunEvent ``sequence`` (the caller moved ``runs.event_sequence`` to it); returns its ID."""
    eid = new_id()
    db.run("EVENT_INSERT", (run_id, sequence, eid, type_, actor, db.dialect.encode_json(payload), now_us))
    return eid


def live_run_count(db: Db, task_id: str) -> int:
    """Runs of the Task not yet ended (queued included): a single-instance fire is skipped then."""
    return db.one("RUN_LIVE_COUNT", (task_id,))["n"]


def set_holds(db: Db, task_id: str) -> None:
    """Recompute ``runs.held`` of the Task's queued single-instance Runs after one of its Runs
    was created, started or ended: held (out of the candidate pages) while the Task has a Run
    that occupies it (``TASK_OCCUPIED``: starting or running; on the cluster also leased to a
    Worker), released when it has none. Admission still re-checks."""
    live = bool(db.one("TASK_OCCUPIED", (task_id,))["live"])
    db.run("RUNS_HOLD", (live, task_id, not live))


def create_run(db: Db, *, head: TaskHead, origin: str, trigger_type: str, idempotency_key: str, requested_by: str,
               now_us: int, executor_type: str = "local_process", scheduled_for_us: int | None = None,
               fences: dict | None = None, execution_digest: str | None = None) -> CreatedRun | None:
    """Insert a queued Run, its claimed Attempt (``executor_type``: the local agent runs
    ``local_process``; a remote Worker runs the Task's ``local_process`` spec) and
    ``run.created`` + ``run.queued``; None, with nothing written, when the Project already has a
    Run under ``idempotency_key`` (the unique key decides, so racing creators need no read first).

    Run fields follow ADR-0376 §2: execution_owner=runtime, priority from the definition
    (0 for task_start), version=2, event_sequence=2, task_snapshot_ref ``qltd:v1:{rev}:{digest}``.
    Event payloads carry digests and fences only (``execution_digest``: the revision's, when the
    caller has read it already). A single-instance Run is created held while its Task is
    occupied; the Task's other queued Runs keep the holds the moves that occupied or freed it set.
    """
    run_id, attempt_id = new_id(), new_id()
    ref = snapshot_ref(head.revision, head.content_digest)
    priority = 0 if trigger_type == "task_start" else head.definition.priority
    single = head.definition.concurrency == "single"
    held = single and bool(db.one("TASK_OCCUPIED", (head.task_id,))["live"])
    if not db.run("RUN_INSERT", (run_id, head.project_id, head.task_id, head.revision, ref, priority, origin,
                                 trigger_type, idempotency_key, requested_by, scheduled_for_us, attempt_id, now_us,
                                 now_us, now_us, single, held)).rowcount:
        return None
    db.run("ATTEMPT_FIRST_INSERT", (attempt_id, run_id, executor_type, now_us))
    if execution_digest is None:
        ex = db.one("EXECUTION_REVISION_DIGEST", (head.task_id, head.revision))
        execution_digest = ex["execution_digest"] if ex else None
    created = {"taskSnapshotRef": ref, "contentDigest": head.content_digest,
               "executionDigest": execution_digest, "trigger": trigger_type}
    if scheduled_for_us is not None:
        created["scheduledForUs"] = scheduled_for_us
    created.update(fences or {})
    e1, e2 = new_id(), new_id()
    encode = db.dialect.encode_json
    db.run("EVENTS_FIRST_TWO_INSERT", (run_id, 1, e1, "run.created", requested_by, encode(created), now_us,
                                       run_id, 2, e2, "run.queued", requested_by,
                                       encode({"attemptId": attempt_id, "executorType": executor_type}), now_us))
    return CreatedRun(run_id=run_id, attempt_id=attempt_id, event_ids=(e1, e2), task_revision=head.revision,
                      task_snapshot_ref=ref, state=RunState.QUEUED, created_at_us=now_us)


def persisted_identity(db: Db, run_row) -> CreatedRun:
    """The persisted identities of a Run (first Attempt, first two events) for exact replay."""
    attempt = db.one("FIRST_ATTEMPT_ID", (run_row["run_id"],))["attempt_id"]
    events = tuple(r["event_id"] for r in db.all("FIRST_EVENT_IDS", (run_row["run_id"],)))
    return CreatedRun(run_id=run_row["run_id"], attempt_id=attempt, event_ids=events,
                      task_revision=run_row["task_revision"], task_snapshot_ref=run_row["task_snapshot_ref"],
                      state=run_row["state"], created_at_us=run_row["created_at_us"], existing=True)


def refusal(outcome: str, task: str, head_revision: int | None = None, head_digest: str | None = None) -> QlError:
    """The error a Task Start of ``task`` ends in when refused with ``outcome`` (ADR-0376 §3),
    one vocabulary for both stores' paths (the cluster's ``ql_task_start`` returns it):
    ``task_not_found`` → NotFoundError; ``project_changed``/``binding_changed`` →
    FenceRejected(authorization_changed); ``definition_changed`` (naming the head's revision and
    digest), ``task_disabled``, ``task_not_executable``, ``mutation_conflict`` → FenceRejected of
    that reason; ``execution_corrupt``/``key_unreadable`` → UnavailableError(task_start_unavailable)."""
    if outcome == "task_not_found":
        return NotFoundError(f"task {quote_bounded(task)} does not exist", code="task_not_found")
    if outcome == "definition_changed":
        return FenceRejected(outcome, f"task is at revision {head_revision} with digest {head_digest}")
    if outcome in _UNAVAILABLE:
        return UnavailableError(_UNAVAILABLE[outcome], code="task_start_unavailable")
    reason = "authorization_changed" if outcome in _AUTHORIZATION else outcome
    return FenceRejected(reason, _AUTHORIZATION.get(outcome) or _FENCES[outcome])


_AUTHORIZATION = {"project_changed": "the project changed since the request was admitted",
                  "binding_changed": "the subject's role binding no longer allows run.start"}
_FENCES = {"task_disabled": "the task is disabled",
           "task_not_executable": "the task revision has no published execution revision",
           "mutation_conflict": "this mutationId was used for a different request"}
_UNAVAILABLE = {"execution_corrupt": "execution revision is corrupt",
                "key_unreadable": "the idempotency key changed during the transaction"}


def _replay(db: Db, project_id: str, key: str, *, task: str, subject: str, expected_revision: int,
            expected_digest: str) -> CreatedRun | None:
    """ADR-0376 §2 step 3 for a key that may exist: the persisted identity on an exact replay,
    FenceRejected(mutation_conflict) on any drift, None when the Project has no Run under it."""
    prior = db.one("RUN_BY_KEY", (project_id, key))
    if prior is None:
        return None
    if (task in (prior["task_id"], prior["task_name"])
            and prior["task_snapshot_ref"] == snapshot_ref(expected_revision, expected_digest)
            and prior["requested_by"] == subject and prior["trigger_type"] == "task_start"):
        return persisted_identity(db, prior)
    raise refusal("mutation_conflict", task)


def _creatable(db: Db, project_id: str, task: str, expected_revision: int, expected_digest: str):
    """Steps 4–5 of ADR-0376 §2: (head, execution digest), or the error they end in, returned
    rather than raised so that step 3 (the key) can be decided first."""
    try:
        head = defs.get_head(db, project_id, task, lock=True)
    except NotFoundError:
        return refusal("task_not_found", task)
    if (head.revision, head.content_digest) != (expected_revision, expected_digest):
        return refusal("definition_changed", task, head.revision, head.content_digest)
    if not head.enabled:
        return refusal("task_disabled", task)
    ex = db.one("EXECUTION_REVISION", (head.task_id, head.revision))
    if ex is None:
        return refusal("task_not_executable", task)
    # ADR-0376 §2 "digest 正确": the stored spec must hash to its execution digest (fail closed).
    if ex["kind"] not in ("local_process", "shell") or sha256_hex(ex["spec_json"].encode()) != ex["execution_digest"]:
        return refusal("execution_corrupt", task)
    return head, ex["execution_digest"]


def task_start(db: Db, *, project: str, task: str, subject: str, mutation_id: str, expected_revision: int,
               expected_digest: str, admitted_project_version: int | None, admitted_binding_version: int | None,
               now_us: int, executor_type: str) -> CreatedRun:
    """ADR-0376 §2 in the record's order of decisions, inside the caller's write transaction:

    1. active Project and projectVersion (re-verified against admission when given; locked);
    2. subject's latest active RoleBinding, bindingVersion and a start role;
    3. idempotency key ``ql3:task-start:v1:{mutationId}``: exact replay → persisted identity
       (``existing=True``), any drift → FenceRejected(mutation_conflict);
    4. Task head (locked): NotFoundError(task_not_found); fence → definition_changed; enabled →
       task_disabled;
    5. published execution revision → task_not_executable if missing, UnavailableError
       (task_start_unavailable) if corrupt;
    6. server-generated Run, Attempt (``executor_type``), two RunEvents and time.

    Step 3 is decided by the Run's insert (the unique key): the key is read only when the insert
    finds it taken or when step 4 or 5 fails, so a new start reads no shared index page before
    it writes. The Task's head row lock orders starts of one Task; other Tasks' never wait on it.
    """
    try:
        proj = policy.get_project(db, project, lock=True)
    except NotFoundError:
        raise refusal("task_not_found", task) from None
    if not proj.active or (admitted_project_version is not None and proj.project_version != admitted_project_version):
        raise refusal("project_changed", task)
    binding = policy.latest_binding(db, proj.project_id, subject)
    if binding is None or binding.role not in START_ROLES or (
            admitted_binding_version is not None and binding.binding_version != admitted_binding_version):
        raise refusal("binding_changed", task)
    key = idempotency_key(mutation_id)
    replay = dict(task=task, subject=subject, expected_revision=expected_revision, expected_digest=expected_digest)
    found = _creatable(db, proj.project_id, task, expected_revision, expected_digest)
    if isinstance(found, Exception):
        prior = _replay(db, proj.project_id, key, **replay)
        if prior is not None:
            return prior
        raise found
    head, execution_digest = found
    created = create_run(db, head=head, origin="manual", trigger_type="task_start", idempotency_key=key,
                         requested_by=subject, now_us=now_us, executor_type=executor_type,
                         execution_digest=execution_digest,
                         fences={"mutationId": mutation_id, "projectVersion": proj.project_version,
                                 "bindingVersion": binding.binding_version})
    if created is not None:
        return created
    prior = _replay(db, proj.project_id, key, **replay)
    if prior is None:       # the insert met a key this snapshot cannot read: no serial order holds
        raise refusal("key_unreadable", task)
    return prior


def cancel_queued(db: Db, run_id: str, seq: int, version: int, actor: str, reason: str, now_us: int) -> bool:
    """queued → cancelled by compare-and-set on version; the claimed Attempt is cancelled too."""
    n = db.run("RUN_CANCEL_QUEUED", (seq + 1, now_us, now_us, now_us, run_id, version)).rowcount
    if n:
        db.run("ATTEMPT_CANCEL_CLAIMED", (now_us, run_id))
        append_event(db, run_id, seq + 1, "run.cancelled", actor, {"reason": reason, "from": RunState.QUEUED}, now_us)
    return bool(n)


def cancel_queued_for_task(db: Db, task_id: str, actor: str, reason: str, now_us: int) -> int:
    """Cancel every queued Run of a Task (disable/remove); returns how many."""
    rows = db.all("RUNS_QUEUED_OF_TASK_FOR_UPDATE", (task_id,))
    for r in rows:
        cancel_queued(db, r["run_id"], r["event_sequence"], r["version"], actor, reason, now_us)
    return len(rows)


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


def get_run(db: Db, run_id: str, project_id: str | None = None) -> Run:
    """A Run by ID (without ``project_id`` also a unique ID prefix ≥ 8 chars, for the CLI);
    NotFoundError ``run_not_found``."""
    if project_id is not None:
        rows = db.all("RUN_IN_PROJECT", (run_id, project_id))
    elif len(run_id) >= 8:
        rows = db.all("RUN_BY_PREFIX", (run_id, run_id + "\uffff"))
    else:
        rows = []
    if len(rows) != 1:
        shown = quote_bounded(run_id)
        raise NotFoundError(f"run {shown} does not exist" if not rows else f"run prefix {shown} is ambiguous",
                            code="run_not_found")
    return _run(rows[0])


def list_runs(db: Db, project_id: str, *, task_id: str | None = None, state: str | None = None, limit: int = 50,
              cursor: str | None = None) -> tuple[list[Run], str | None]:
    """Keyset page of Runs, newest first (created desc, run_id desc); returns (runs, next cursor).

    Reads ``limit + 1`` rows: the extra row only proves there is a next page. ``limit``
    1..200 and ``state`` one the store holds, else ValidationError; cursor is
    ``{created_at_us}.{run_id}`` from the previous page.
    """
    if not (1 <= limit <= MAX_PAGE):
        raise ValidationError("limit", f"{limit} outside 1..{MAX_PAGE}", limit=MAX_PAGE)
    known = db.dialect.run_states
    if state is not None and state not in known:
        raise ValidationError("state", f"unknown state {state!r}; one of {', '.join(sorted(known))}")
    name, args = "RUNS_PAGE", [project_id]
    if task_id:
        name += "_TASK"
        args.append(task_id)
    if state:
        name += "_STATE"
        args.append(state)
    if cursor is not None:
        c_at, c_id = parse_run_cursor(cursor)
        name += "_BEFORE"
        args += [c_at, c_at, c_id]
    rows = db.all(name, (*args, limit + 1))
    runs = [_run(r) for r in rows[:limit]]
    nxt = format_run_cursor(runs[-1].created_at_us, runs[-1].run_id) if len(rows) > limit else None
    return runs, nxt


def list_events(db: Db, run_id: str) -> list[RunEvent]:
    """The Run's events in sequence order."""
    decode = db.dialect.decode_json
    return [RunEvent(run_id=r["run_id"], sequence=r["sequence"], event_id=r["event_id"], type=r["type"],
                     actor=r["actor"], payload=decode(r["payload_json"]), created_at_us=r["created_at_us"])
            for r in db.all("EVENTS_OF_RUN", (run_id,))]


def list_attempts(db: Db, run_id: str) -> list[Attempt]:
    """The Run's Attempts in number order."""
    return [Attempt(attempt_id=r["attempt_id"], run_id=r["run_id"], attempt_no=r["attempt_no"], state=r["state"],
                    executor_type=r["executor_type"], exit_code=r["exit_code"], exit_signal=r["exit_signal"],
                    bytes_kept=r["bytes_kept"], bytes_dropped=r["bytes_dropped"], truncated=bool(r["truncated"]),
                    truncation_reason=r["truncation_reason"],
                    peak_rss_bytes=r["peak_rss_bytes"], cpu_time_us=r["cpu_time_us"],
                    failure_reason=r["failure_reason"], created_at_us=r["created_at_us"],
                    started_at_us=r["started_at_us"], ended_at_us=r["ended_at_us"], start_error=r["start_error"],
                    orphans_stopped=r["orphans_stopped"], worker_id=r["worker_id"], worker_name=r["worker_name"])
            for r in db.all("ATTEMPTS_OF_RUN", (run_id,))]


def latest_artifact(db: Db, run_id: str) -> tuple[str | None, TruncationFact | None]:
    """(artifact path of the latest Attempt that has one, its truncation fact or None).

    Raises NotFoundError(code ``log_not_found``) when the Run wrote output whose log retention
    has since deleted (an empty log and a never-started Run give (None, None)).
    """
    row = db.one("ATTEMPT_LATEST_LOG", (run_id,))
    if row is None:
        if db.one("ATTEMPT_LOG_PRUNED", (run_id,)):
            raise NotFoundError("the log of this run was pruned by retention", code="log_not_found")
        return None, None
    fact = None if row["quota_bytes"] is None else TruncationFact(
        quota_bytes=row["quota_bytes"], bytes_kept=row["bytes_kept"], bytes_dropped=row["bytes_dropped"],
        reason=row["reason"])
    return row["artifact_path"], fact


def active_run_ids(db: Db, task_id: str) -> list[str]:
    """The Task's Runs that are under way (starting or running; on the cluster also leased)."""
    return [r["run_id"] for r in db.all("RUNS_ACTIVE_OF_TASK", (task_id,))]


def queued_count(db: Db) -> int:
    """Runs waiting in ``queued``, every Project."""
    return db.one("RUNS_QUEUED_COUNT")["n"]


def oldest_queued_us(db: Db) -> int | None:
    """``created_at_us`` of the oldest queued Run (µs), None when none is queued."""
    return db.one("RUNS_OLDEST_QUEUED")["t"]


def state_counts(db: Db) -> dict[str, int]:
    """state → Runs in it, every Project (states without a Run left out)."""
    return {r["state"]: r["n"] for r in db.all("RUN_STATE_COUNTS")}


def run_id_for_key(db: Db, project_id: str, key: str) -> str | None:
    """The Run created under idempotency ``key`` in the Project, else None."""
    row = db.one("RUN_ID_FOR_KEY", (project_id, key))
    return row["run_id"] if row else None


def schedule_cursors(db: Db) -> dict[str, ScheduleCursor]:
    """Every Task's schedule cursor, by Task ID."""
    return {r["task_id"]: ScheduleCursor(last_instant_us=r["last_instant_us"], observed_wall_us=r["observed_wall_us"])
            for r in db.all("SCHEDULE_CURSORS")}


def schedule_cursor(db: Db, task_id: str) -> ScheduleCursor | None:
    """The Task's cursor (held until the transaction ends: replicas compare-and-set it in turn)."""
    row = db.one("SCHEDULE_CURSOR_FOR_UPDATE", (task_id,))
    return None if row is None else ScheduleCursor(last_instant_us=row["last_instant_us"],
                                                   observed_wall_us=row["observed_wall_us"])


def put_schedule_cursor(db: Db, task_id: str, c: ScheduleCursor) -> None:
    """Set the Task's schedule cursor."""
    db.run("SCHEDULE_CURSOR_PUT", (task_id, c.last_instant_us, c.observed_wall_us))
