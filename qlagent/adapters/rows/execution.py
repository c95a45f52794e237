"""Attempt/Run transitions of ``core.ports.DispatchStore`` / ``ExecutionStore`` on either store
(ADR-0071 §3, §4), and the reads recovery and retention use. Every function takes the
``rows.dialect.Db`` of the caller's transaction. Candidate pages are each store's own
(``sqlite/execution.py``, ``postgres/execution.py``).

Transitions are compare-and-set on ``runs.version`` and the Attempt's state, so two passes racing
on one candidate cannot both win, and each appends one RunEvent with the next per-Run sequence.
"""

from __future__ import annotations

import msgspec

from ...core import states
from ...core.dispatch import Candidate, Finish, LiveAttempt, Plan
from ...core.ids import new_id
from ...core.models import ContextRecipe, ExecutionSpec, RetentionEntry, RetryPolicy
from ...core.receipt import TruncationFact
from .dialect import Db
from .runs import append_event, cancel_queued, set_holds

FORGET_BATCH = 500      # attempt IDs per statement (SQLite binds at most 999 values in old builds)

_dec = msgspec.json.Decoder(dict)


class AttemptNotClaimed(Exception):
    """Rolls back a Run CAS whose Attempt was no longer ``claimed``."""


def next_backoff_us(db: Db, now_us: int) -> int | None:
    """Earliest ``not_before_us`` (µs) of a queued retry that is not yet due (the loop's next wake-up)."""
    return db.one("NEXT_BACKOFF", (now_us,))["t"]


def reread_candidate(db: Db, c: Candidate) -> bool:
    """ADR-0071 §4 step 1: is this exact candidate still queued, uncancelled, same version and Attempt?"""
    return db.one("CANDIDATE_STILL_QUEUED", (c.run_id, c.version, c.attempt_id)) is not None


def load_plan(db: Db, task_id: str, revision: int) -> tuple[Plan | None, str | None]:
    """ADR-0071 §4 steps 2–3: pinned execution revision and its context recipe.

    Returns (plan, None) or (None, reason) with reason ``revision_missing`` / ``recipe_missing``.
    """
    row = db.one("PLAN", (task_id, revision))
    if row is None:
        return None, "revision_missing"
    if row["recipe_json"] is None:
        return None, "recipe_missing"
    spec = _dec.decode(row["spec_json"])
    spec.pop("recipeRef", None)
    rec = _dec.decode(row["recipe_json"])
    d = _dec.decode(row["definition_json"])
    return Plan(execution=msgspec.convert(spec, ExecutionSpec),
                recipe=ContextRecipe(public=rec["public"], secret_refs=rec["secretRefs"]),
                timeout_ms=d["timeoutMs"], grace_ms=d["graceMs"], retry=msgspec.convert(d["retry"], RetryPolicy),
                concurrency=d["concurrency"], network_require=d["network"]["require"],
                network_interface=d["network"]["interface"], task_name=d["name"]), None


def active_count(db: Db) -> int:
    """Runs starting or running (the global concurrency limit); reads only live Runs."""
    return db.one("RUNS_ACTIVE_COUNT")["n"]


def task_active_count(db: Db, task_id: str) -> int:
    """Runs of the Task that are starting or running (single-instance admission); reads only
    live Runs, never the Task's history."""
    return db.one("TASK_RUNS_ACTIVE_COUNT", (task_id,))["n"]


def _sequence(db: Db, cur, run_id: str) -> int | None:
    """The event sequence a Run move by ``cur`` took, or None if it moved nothing. A statement
    with RETURNING (PostgreSQL) has a result; the local store reads the sequence back."""
    if cur.rowcount == 0:
        return None
    row = cur.fetchone() if cur.description is not None else db.one("RUN_EVENT_SEQUENCE", (run_id,))
    return row["event_sequence"]


def _move(db: Db, run_id: str, src: str, dst: str, now_us: int, version: int | None = None) -> int | None:
    """CAS the Run ``src → dst`` (at ``version`` if given); the new event sequence, or None if the CAS lost."""
    states.check_run(src, dst)
    if version is None:
        return _sequence(db, db.run("RUN_MOVE", (dst, now_us, run_id, src)), run_id)
    return _sequence(db, db.run("RUN_MOVE_AT_VERSION", (dst, now_us, run_id, src, version)), run_id)


def claim_starting(db: Db, c: Candidate, artifact_path: str, now_us: int) -> bool:
    """queued → starting and claimed → starting, CAS on the version read with the candidate.

    False means another pass won the race: the caller must not spawn. AttemptNotClaimed when
    the Run moved but its Attempt was not claimed (the caller's transaction rolls both back).
    """
    seq = _move(db, c.run_id, states.RunState.QUEUED, states.RunState.STARTING, now_us, c.version)
    if seq is None:
        return False
    states.check_attempt(states.AttemptState.CLAIMED, states.AttemptState.STARTING)
    if db.run("ATTEMPT_START", (artifact_path, c.attempt_id)).rowcount == 0:
        raise AttemptNotClaimed(c.attempt_id)
    append_event(db, c.run_id, seq, "run.starting", "dispatcher", {"attemptId": c.attempt_id}, now_us)
    set_holds(db, c.task_id)
    return True


def mark_running(db: Db, run_id: str, attempt_id: str, shim_pid: int, shim_start: float, deadline_us: int,
                 now_us: int) -> None:
    """starting → running once the shim process exists (``deadline_us``: its timeout, µs)."""
    states.check_attempt(states.AttemptState.STARTING, states.AttemptState.RUNNING)
    db.run("ATTEMPT_RUNNING", (shim_pid, shim_start, deadline_us, now_us, attempt_id))
    seq = _move(db, run_id, states.RunState.STARTING, states.RunState.RUNNING, now_us)
    if seq is not None:
        append_event(db, run_id, seq, "run.running", "coordinator",
                     {"attemptId": attempt_id, "deadlineUs": deadline_us}, now_us)


def finish_attempt(db: Db, run_id: str, attempt_id: str, f: Finish, retry: RetryPolicy | None, now_us: int,
                   executor_type: str) -> str:
    """End an Attempt and its Run (or queue a retry Attempt of ``executor_type``). Returns the
    Run's new state.

    Idempotent: an Attempt that is already terminal is left alone and the Run state returned.
    Retry (policy max_attempts, exponential backoff from backoff_ms) follows failed, timed_out,
    lost and start_failed Attempts unless cancellation was requested. A ``start_failed``
    Attempt first appends ``run.start_failed`` {attemptId, reason, error} (issue 12 §2).
    """
    a = db.one("ATTEMPT_STATE_FOR_UPDATE", (attempt_id,))
    run = db.one("RUN_STATE_FOR_UPDATE", (run_id,))
    if a is None or a["state"] in states.AttemptState.TERMINAL:
        return run["state"]
    states.check_attempt(a["state"], f.attempt_state)
    ended = f.ended_at_us or now_us
    db.run("ATTEMPT_END", (f.attempt_state, f.exit_code, f.exit_signal, f.bytes_kept, f.bytes_dropped,
                           f.peak_rss_bytes, f.cpu_time_us, f.failure_reason, ended, f.start_error,
                           f.orphans_stopped, attempt_id))
    figures = {"attemptId": attempt_id, "attemptState": f.attempt_state, "exitCode": f.exit_code,
               "signal": f.exit_signal, "bytesKept": f.bytes_kept, "bytesDropped": f.bytes_dropped}
    if f.orphans_stopped:
        figures["orphansStopped"] = f.orphans_stopped
    if f.failure_reason:
        figures["reason"] = f.failure_reason
    if f.attempt_state == states.AttemptState.START_FAILED:
        seq = _sequence(db, db.run("RUN_NEXT_EVENT", (run_id,)), run_id)
        append_event(db, run_id, seq, "run.start_failed", "coordinator",
                     {"attemptId": attempt_id, "reason": f.failure_reason, "error": f.start_error}, now_us)
    attempt_no = a["attempt_no"]
    if (retry is not None and states.retryable(f.attempt_state) and run["cancel_requested_at_us"] is None
            and attempt_no < retry.max_attempts):
        nxt = new_id()
        db.run("ATTEMPT_RETRY_INSERT", (nxt, run_id, attempt_no + 1, executor_type,
                                        now_us + states.backoff_ms(retry.backoff_ms, attempt_no) * 1000, now_us))
        if run["state"] == states.RunState.QUEUED:      # never left the queue (unlaunchable): only the Attempt changes
            seq = _sequence(db, db.run("RUN_NEXT_ATTEMPT", (nxt, now_us, now_us, run_id)), run_id)
        else:
            states.check_run(run["state"], states.RunState.QUEUED)
            seq = _sequence(db, db.run("RUN_MOVE_REQUEUE", (states.RunState.QUEUED, now_us, nxt, now_us, run_id, run["state"])),
                            run_id)
        append_event(db, run_id, seq, "run.retry_queued", "coordinator", {**figures, "nextAttemptId": nxt}, now_us)
        set_holds(db, run["task_id"])
        return states.RunState.QUEUED
    run_state = states.RunState.FAILED if f.attempt_state == states.AttemptState.START_FAILED else f.attempt_state
    states.check_run(run["state"], run_state)
    seq = _sequence(db, db.run("RUN_MOVE_END", (run_state, now_us, f.exit_code, f.exit_signal, ended, run_id,
                                                run["state"])), run_id)
    append_event(db, run_id, seq, f"run.{run_state}", "coordinator", figures, now_us)
    set_holds(db, run["task_id"])
    return run_state


def record_truncation(db: Db, attempt_id: str, fact: TruncationFact, now_us: int) -> None:
    """Write the truncation fact once (its reason with it); a second write keeps the first
    (write-once) and only fills in ``bytes_dropped`` if it was unknown."""
    db.run("TRUNCATION_PUT", (attempt_id, fact.quota_bytes, fact.bytes_kept, fact.bytes_dropped, fact.reason,
                              now_us))


def live_attempts(db: Db) -> list[LiveAttempt]:
    """Every Attempt of this executor in starting/running (restart recovery and cancel sweeps)."""
    return [LiveAttempt(r["run_id"], r["attempt_id"], r["task_id"], r["task_revision"], r["state"], r["shim_pid"],
                        r["shim_start_time"], r["deadline_at_us"], r["artifact_path"],
                        r["cancel_requested_at_us"] is not None) for r in db.all("LIVE_ATTEMPTS")]


def attempt_revision(db: Db, attempt_id: str) -> tuple[str, int] | None:
    """(task ID, revision) of an Attempt's Run, or None for an Attempt this store never had."""
    r = db.one("ATTEMPT_REVISION", (attempt_id,))
    return None if r is None else (r["task_id"], r["task_revision"])


def claimed_attempt_ids(db: Db) -> list[str]:
    """Attempts still claimed: a crash between Artifact allocation and the claim may have left
    their (deterministic) log file behind, which recovery removes."""
    return [r["attempt_id"] for r in db.all("CLAIMED_ATTEMPT_IDS")]


def request_cancel(db: Db, run_id: str, actor: str, now_us: int) -> str:
    """Record a cancellation intent. queued → cancelled at once; a Run under way (on the
    cluster also one leased to a Worker) keeps its state, with the intent recorded once, until
    its process tree is stopped. Idempotent. Returns the Run's state."""
    r = db.one("RUN_STATE_FOR_UPDATE", (run_id,))
    if r["state"] == states.RunState.QUEUED:
        cancel_queued(db, run_id, r["event_sequence"], r["version"], actor, "cancel_requested", now_us)
        return states.RunState.CANCELLED
    if r["state"] not in states.RunState.TERMINAL and r["cancel_requested_at_us"] is None:
        db.run("RUN_CANCEL_REQUEST", (now_us, now_us, run_id))
        append_event(db, run_id, r["event_sequence"] + 1, "run.cancel_requested", actor, {}, now_us)
    return r["state"]


def retention_entries(db: Db) -> list[RetentionEntry]:
    """Ended Attempts with a log, oldest first."""
    return [RetentionEntry(attempt_id=r["attempt_id"], task_id=r["task_id"], artifact_path=r["artifact_path"],
                           ended_at_us=r["ended_at_us"]) for r in db.all("RETENTION_ENTRIES")]


def forget_artifacts(db: Db, attempt_ids: list[str]) -> None:
    """Clear the artifact path of pruned logs (the Attempt rows and truncation facts stay)."""
    for i in range(0, len(attempt_ids), FORGET_BATCH):
        db.run_in("ARTIFACTS_FORGET", (), attempt_ids[i:i + FORGET_BATCH])
