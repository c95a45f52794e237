"""Dispatch candidates and Attempt/Run transitions in the local store (ADR-0071 §3, §4).

Candidate discovery uses the ``runs_dispatch_candidates`` partial index with a keyset cursor
and ``limit + 1`` rows; never OFFSET. Transitions are compare-and-set on ``runs.version`` and
the Attempt's state, so two passes racing on one candidate cannot both win, and each appends
one RunEvent with the next per-Run sequence.
"""

from __future__ import annotations

import sqlite3

import msgspec

from ...core import states
from ...core.dispatch import Candidate, Finish, LiveAttempt, Plan
from ...core.ids import new_id
from ...core.models import ContextRecipe, ExecutionSpec, RetentionEntry, RetryPolicy
from ...core.receipt import TruncationFact
from .runs import ATTEMPT_ACTIVE_SQL, RUN_ACTIVE_SQL, RUN_LIVE_SQL, append_event, cancel_queued, set_holds


_CAND = ("SELECT r.run_id, r.latest_attempt_id, r.project_id, r.task_id, r.task_revision, r.version, r.priority, "
         "r.created_at_us, r.latest_attempt_created_at_us FROM runs r INDEXED BY runs_dispatch_candidates "
         "JOIN attempts a ON a.attempt_id = r.latest_attempt_id "
         "WHERE r.state = 'queued' AND r.cancel_requested_at_us IS NULL "
         "AND a.state = 'claimed' AND a.executor_type = 'local_process' "
         "AND (a.not_before_us IS NULL OR a.not_before_us <= ?) AND r.held = 0 ")
_ORDER = "ORDER BY r.priority DESC, r.created_at_us, r.latest_attempt_created_at_us, r.latest_attempt_id LIMIT ?"
# Keyset "after (p, c, ac, id)" for ORDER BY priority DESC, created ASC, attempt created ASC, attempt id ASC.
# One OR-chained predicate cannot seek the index (SQLite would scan from the first queued Run
# up to the cursor: an OFFSET in disguise), so the page is the union of two index seeks:
# the rest of priority p after (c, ac, id) as a row value, then the priorities below p.
_AFTER = ("SELECT * FROM (" + _CAND + "AND r.priority = ? AND (r.created_at_us, r.latest_attempt_created_at_us, "
          "r.latest_attempt_id) > (?, ?, ?) ORDER BY r.created_at_us, r.latest_attempt_created_at_us, "
          "r.latest_attempt_id LIMIT ?) UNION ALL SELECT * FROM (" + _CAND + "AND r.priority < ? " + _ORDER + ") "
          "ORDER BY priority DESC, created_at_us, latest_attempt_created_at_us, latest_attempt_id LIMIT ?")


def candidate_page(conn: sqlite3.Connection, limit: int, after: tuple | None, now_us: int) -> list[Candidate]:
    """Up to ``limit + 1`` candidates after keyset ``after`` (None: from the start). A Run whose
    pinned revision is missing is still a candidate: the materialiser fails it with
    ``revision_missing`` rather than leaving it queued unseen."""
    if after is None:
        rows = conn.execute(_CAND + _ORDER, (now_us, limit + 1))
    else:
        p, c, ac, aid = after
        rows = conn.execute(_AFTER, (now_us, p, c, ac, aid, limit + 1, now_us, p, limit + 1, limit + 1))
    return [Candidate(*r) for r in rows]


def next_backoff_us(conn: sqlite3.Connection, now_us: int) -> int | None:
    """Earliest ``not_before_us`` of a queued retry that is not yet due (the loop's next wake-up)."""
    row = conn.execute("SELECT min(a.not_before_us) FROM runs r JOIN attempts a ON a.attempt_id = r.latest_attempt_id "
                       "WHERE r.state = 'queued' AND a.state = 'claimed' AND a.not_before_us > ?", (now_us,)).fetchone()
    return row[0]


def reread_candidate(conn: sqlite3.Connection, c: Candidate) -> bool:
    """ADR-0071 §4 step 1: is this exact candidate still queued, uncancelled, same version and Attempt?"""
    return conn.execute(
        "SELECT 1 FROM runs r JOIN attempts a ON a.attempt_id = r.latest_attempt_id WHERE r.run_id = ? "
        "AND r.version = ? AND r.state = 'queued' AND r.cancel_requested_at_us IS NULL AND a.attempt_id = ? "
        "AND a.state = 'claimed'", (c.run_id, c.version, c.attempt_id)).fetchone() is not None


_spec_dec = msgspec.json.Decoder(dict)


def load_plan(conn: sqlite3.Connection, task_id: str, revision: int) -> tuple[Plan | None, str | None]:
    """ADR-0071 §4 steps 2–3: pinned execution revision and its context recipe.

    Returns (plan, None) or (None, reason) with reason ``revision_missing`` / ``recipe_missing``.
    """
    x = conn.execute("SELECT spec_json, recipe_ref FROM execution_revisions WHERE task_id = ? AND revision = ?",
                     (task_id, revision)).fetchone()
    d = conn.execute("SELECT definition_json FROM task_revisions WHERE task_id = ? AND revision = ?",
                     (task_id, revision)).fetchone()
    if x is None or d is None:
        return None, "revision_missing"
    r = conn.execute("SELECT recipe_json FROM context_recipes WHERE recipe_ref = ?", (x[1],)).fetchone()
    if r is None:
        return None, "recipe_missing"
    spec = _spec_dec.decode(x[0])
    spec.pop("recipeRef", None)
    rec = _spec_dec.decode(r[0])
    definition = _spec_dec.decode(d[0])
    return Plan(execution=msgspec.convert(spec, ExecutionSpec),
                recipe=ContextRecipe(public=rec["public"], secret_refs=rec["secretRefs"]),
                timeout_ms=definition["timeoutMs"], grace_ms=definition["graceMs"],
                retry=msgspec.convert(definition["retry"], RetryPolicy), concurrency=definition["concurrency"],
                network_require=definition["network"]["require"], network_interface=definition["network"]["interface"],
                task_name=definition["name"]), None


# SQLite uses the partial index runs_by_state only when the query repeats its WHERE term
# verbatim; without it both counts scan every Run ever stored (the whole table, or the Task's
# whole history) on every dispatcher pass, so a pass would grow with the backlog.
_LIVE = f"state IN {RUN_LIVE_SQL} AND state IN {RUN_ACTIVE_SQL}"


def task_active_count(conn: sqlite3.Connection, task_id: str) -> int:
    """Runs of the Task that are starting or running (single-instance admission); reads only
    live Runs, never the Task's history."""
    return conn.execute(f"SELECT count(*) FROM runs INDEXED BY runs_by_state WHERE {_LIVE} AND task_id = ?",
                        (task_id,)).fetchone()[0]


def active_count(conn: sqlite3.Connection) -> int:
    """Runs starting or running (the global concurrency limit); reads only live Runs."""
    return conn.execute(f"SELECT count(*) FROM runs WHERE {_LIVE}").fetchone()[0]


def _bump(conn, run_id: str, src: str, dst: str, version: int | None, now_us: int, **cols) -> int | None:
    """CAS the Run ``src → dst``; returns the new event sequence, or None if the CAS lost."""
    states.check_run(src, dst)
    sets = ", ".join(f"{k} = :{k}" for k in cols)
    q = (f"UPDATE runs SET state = :dst, version = version + 1, event_sequence = event_sequence + 1, "
         f"updated_at_us = :now{', ' + sets if sets else ''} WHERE run_id = :run AND state = :src")
    args = {"dst": dst, "now": now_us, "run": run_id, "src": src, **cols}
    if version is not None:
        q += " AND version = :ver"
        args["ver"] = version
    if conn.execute(q, args).rowcount == 0:
        return None
    return conn.execute("SELECT event_sequence FROM runs WHERE run_id = ?", (run_id,)).fetchone()[0]


def claim_starting(conn: sqlite3.Connection, c: Candidate, artifact_path: str, now_us: int) -> bool:
    """queued → starting and claimed → starting, CAS on the version read with the candidate.

    False means another pass won the race: the caller must not spawn.
    """
    seq = _bump(conn, c.run_id, "queued", "starting", c.version, now_us)
    if seq is None:
        return False
    states.check_attempt("claimed", "starting")
    if conn.execute("UPDATE attempts SET state = 'starting', artifact_path = ?, version = version + 1 "
                    "WHERE attempt_id = ? AND state = 'claimed'", (artifact_path, c.attempt_id)).rowcount == 0:
        raise sqlite3.IntegrityError("attempt was not claimed")  # rolls the Run CAS back too
    append_event(conn, c.run_id, seq, "run.starting", "dispatcher", {"attemptId": c.attempt_id}, now_us)
    set_holds(conn, c.task_id)
    return True




def mark_running(conn: sqlite3.Connection, run_id: str, attempt_id: str, shim_pid: int, shim_start: float,
                 deadline_us: int, now_us: int) -> None:
    """starting → running once the shim process exists."""
    states.check_attempt("starting", "running")
    conn.execute("UPDATE attempts SET state = 'running', shim_pid = ?, shim_start_time = ?, deadline_at_us = ?, "
                 "started_at_us = ?, version = version + 1 WHERE attempt_id = ? AND state = 'starting'",
                 (shim_pid, shim_start, deadline_us, now_us, attempt_id))
    seq = _bump(conn, run_id, "starting", "running", None, now_us)
    if seq is not None:
        append_event(conn, run_id, seq, "run.running", "coordinator",
                     {"attemptId": attempt_id, "deadlineUs": deadline_us}, now_us)


def finish_attempt(conn: sqlite3.Connection, run_id: str, attempt_id: str, f: Finish, retry: RetryPolicy | None,
                   now_us: int) -> str:
    """End an Attempt and its Run (or queue a retry Attempt). Returns the Run's new state.

    Idempotent: an Attempt that is already terminal is left alone and the Run state returned.
    Retry (policy max_attempts, exponential backoff from backoff_ms) follows failed, timed_out,
    lost and start_failed Attempts unless cancellation was requested. A ``start_failed``
    Attempt first appends ``run.start_failed`` {attemptId, reason, error} (issue 12 §2).
    """
    a = conn.execute("SELECT state, attempt_no FROM attempts WHERE attempt_id = ?", (attempt_id,)).fetchone()
    run = conn.execute("SELECT state, cancel_requested_at_us, task_id FROM runs WHERE run_id = ?", (run_id,)).fetchone()
    if a is None or a[0] in states.ATTEMPT_TERMINAL:
        return run[0]
    states.check_attempt(a[0], f.attempt_state)
    ended = f.ended_at_us or now_us
    conn.execute("UPDATE attempts SET state = ?, exit_code = ?, exit_signal = ?, bytes_kept = ?, bytes_dropped = ?, "
                 "peak_rss_bytes = ?, cpu_time_us = ?, failure_reason = ?, ended_at_us = ?, start_error = ?, "
                 "orphans_stopped = ?, version = version + 1 WHERE attempt_id = ?",
                 (f.attempt_state, f.exit_code, f.exit_signal, f.bytes_kept, f.bytes_dropped, f.peak_rss_bytes,
                  f.cpu_time_us, f.failure_reason, ended, f.start_error, f.orphans_stopped, attempt_id))
    figures = {"attemptId": attempt_id, "attemptState": f.attempt_state, "exitCode": f.exit_code,
               "signal": f.exit_signal, "bytesKept": f.bytes_kept, "bytesDropped": f.bytes_dropped}
    if f.orphans_stopped:
        figures["orphansStopped"] = f.orphans_stopped
    if f.failure_reason:
        figures["reason"] = f.failure_reason
    if f.attempt_state == "start_failed":
        conn.execute("UPDATE runs SET event_sequence = event_sequence + 1 WHERE run_id = ?", (run_id,))
        seq = conn.execute("SELECT event_sequence FROM runs WHERE run_id = ?", (run_id,)).fetchone()[0]
        append_event(conn, run_id, seq, "run.start_failed", "coordinator",
                     {"attemptId": attempt_id, "reason": f.failure_reason, "error": f.start_error}, now_us)
    attempt_no = a[1]
    if (retry is not None and states.retryable(f.attempt_state) and run[1] is None
            and attempt_no < retry.max_attempts):
        new_id_ = _new_attempt(conn, run_id, attempt_no + 1,
                               now_us + states.backoff_ms(retry.backoff_ms, attempt_no) * 1000, now_us)
        if run[0] == "queued":      # never left the queue (unlaunchable): only the Attempt changes
            conn.execute("UPDATE runs SET version = version + 1, event_sequence = event_sequence + 1, "
                         "latest_attempt_id = ?, latest_attempt_created_at_us = ?, updated_at_us = ? "
                         "WHERE run_id = ?", (new_id_, now_us, now_us, run_id))
            seq = conn.execute("SELECT event_sequence FROM runs WHERE run_id = ?", (run_id,)).fetchone()[0]
        else:
            seq = _bump(conn, run_id, run[0], "queued", None, now_us, latest_attempt_id=new_id_,
                        latest_attempt_created_at_us=now_us)
        append_event(conn, run_id, seq, "run.retry_queued", "coordinator", {**figures, "nextAttemptId": new_id_}, now_us)
        set_holds(conn, run[2])
        return "queued"
    run_state = "failed" if f.attempt_state == "start_failed" else f.attempt_state
    seq = _bump(conn, run_id, run[0], run_state, None, now_us, exit_code=f.exit_code, exit_signal=f.exit_signal,
                ended_at_us=ended)
    append_event(conn, run_id, seq, f"run.{run_state}", "coordinator", figures, now_us)
    set_holds(conn, run[2])
    return run_state


def _new_attempt(conn, run_id: str, attempt_no: int, not_before_us: int, now_us: int) -> str:
    aid = new_id()
    conn.execute("INSERT INTO attempts(attempt_id, run_id, attempt_no, state, executor_type, not_before_us, "
                 "created_at_us) VALUES (?, ?, ?, 'claimed', 'local_process', ?, ?)",
                 (aid, run_id, attempt_no, not_before_us, now_us))
    return aid


def record_truncation(conn: sqlite3.Connection, attempt_id: str, fact: TruncationFact, now_us: int) -> None:
    """Write the truncation fact once; a second write keeps the first (write-once) and only
    fills in ``bytes_dropped`` if it was unknown."""
    conn.execute("INSERT INTO truncation_facts VALUES (?, ?, ?, ?, ?) ON CONFLICT(attempt_id) DO UPDATE SET "
                 "bytes_dropped = coalesce(truncation_facts.bytes_dropped, excluded.bytes_dropped)",
                 (attempt_id, fact.quota_bytes, fact.bytes_kept, fact.bytes_dropped, now_us))


def live_attempts(conn: sqlite3.Connection) -> list[LiveAttempt]:
    """Every Attempt in starting/running (restart recovery and cancel sweeps)."""
    return [LiveAttempt(*r[:9], r[9] is not None) for r in conn.execute(
        "SELECT r.run_id, a.attempt_id, r.task_id, r.task_revision, a.state, a.shim_pid, a.shim_start_time, "
        "a.deadline_at_us, a.artifact_path, r.cancel_requested_at_us FROM attempts a "
        f"JOIN runs r ON r.run_id = a.run_id WHERE a.state IN {ATTEMPT_ACTIVE_SQL}")]


def attempt_revision(conn: sqlite3.Connection, attempt_id: str) -> tuple[str, int] | None:
    """(task ID, revision) of an Attempt's Run, or None for an Attempt this store never had."""
    r = conn.execute("SELECT r.task_id, r.task_revision FROM attempts a JOIN runs r ON r.run_id = a.run_id "
                     "WHERE a.attempt_id = ?", (attempt_id,)).fetchone()
    return None if r is None else (r[0], r[1])


def claimed_attempt_ids(conn: sqlite3.Connection) -> list[str]:
    """Attempts still claimed: a crash between Artifact allocation and the claim may have left
    their (deterministic) log file behind, which recovery removes."""
    return [r[0] for r in conn.execute("SELECT attempt_id FROM attempts WHERE state = 'claimed'")]


def request_cancel(conn: sqlite3.Connection, run_id: str, actor: str, now_us: int) -> str:
    """Record a cancellation intent. queued → cancelled at once; a live Run keeps its state until
    the coordinator has stopped its process tree. Idempotent. Returns the Run's state."""
    r = conn.execute("SELECT state, version, event_sequence, cancel_requested_at_us FROM runs WHERE run_id = ?",
                     (run_id,)).fetchone()
    if r[0] == states.RunState.QUEUED:
        cancel_queued(conn, run_id, r[2], r[1], actor, "cancel_requested", now_us)
        return "cancelled"
    if r[0] in states.RUN_ACTIVE and r[3] is None:
        conn.execute("UPDATE runs SET cancel_requested_at_us = ?, event_sequence = event_sequence + 1, "
                     "updated_at_us = ? WHERE run_id = ?", (now_us, now_us, run_id))
        append_event(conn, run_id, r[2] + 1, "run.cancel_requested", actor, {}, now_us)
    return r[0]


def retention_entries(conn: sqlite3.Connection) -> list[RetentionEntry]:
    """Ended Attempts with a log, oldest first."""
    return [RetentionEntry(attempt_id=r[0], task_id=r[1], artifact_path=r[2], ended_at_us=r[3]) for r in conn.execute(
        "SELECT a.attempt_id, r.task_id, a.artifact_path, a.ended_at_us FROM attempts a JOIN runs r "
        "ON r.run_id = a.run_id WHERE a.artifact_path IS NOT NULL AND a.ended_at_us IS NOT NULL "
        "ORDER BY a.ended_at_us")]


def forget_artifacts(conn: sqlite3.Connection, attempt_ids: list[str]) -> None:
    """Clear the artifact path of pruned logs (the Attempt rows and truncation facts stay)."""
    conn.executemany("UPDATE attempts SET artifact_path = NULL WHERE attempt_id = ?", [(a,) for a in attempt_ids])
