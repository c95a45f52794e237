"""Dispatch candidates and Attempt/Run transitions of ``core.ports.DispatchStore`` /
``ExecutionStore`` on the cluster authority; the PostgreSQL twin of
``adapters.sqlite.execution``. Candidates are read in keyset order with ``limit + 1`` rows over
``runs_dispatch_candidates`` (never OFFSET); transitions are compare-and-set on ``runs.version``
and the Attempt's state, each appending one RunEvent with the next per-Run sequence."""

from __future__ import annotations

import msgspec

from ...core import states
from ...core.dispatch import Candidate, Finish, LiveAttempt, Plan
from ...core.ids import new_id
from ...core.models import ContextRecipe, ExecutionSpec, RetentionEntry, RetryPolicy
from ...core.receipt import TruncationFact
from .runs import ACTIVE, append_event, cancel_queued, set_holds

_CAND = ("SELECT r.run_id, r.latest_attempt_id, r.project_id, r.task_id, r.task_revision, r.version, r.priority, "
         "r.created_at_us, r.latest_attempt_created_at_us FROM runs r JOIN attempts a "
         "ON a.attempt_id = r.latest_attempt_id WHERE r.state = 'queued' AND r.cancel_requested_at_us IS NULL "
         "AND NOT r.held AND a.state = 'claimed' AND a.executor_type = %(ex)s "
         "AND (a.not_before_us IS NULL OR a.not_before_us <= %(now)s) ")
_KEY = "(-r.priority), r.created_at_us, r.latest_attempt_created_at_us, r.latest_attempt_id"


def candidate_page(cur, limit: int, after: tuple | None, now_us: int, executor_type: str) -> list[Candidate]:
    """Up to ``limit + 1`` candidates of ``executor_type`` strictly after keyset ``after``
    (a ``Candidate.key()``: priority, created, attempt created, attempt ID)."""
    args = {"ex": executor_type, "now": now_us, "lim": limit + 1}
    sql = _CAND
    if after is not None:
        p, c, ac, aid = after
        sql += f"AND ({_KEY}) > (%(p)s, %(c)s, %(ac)s, %(aid)s) "
        args.update(p=-p, c=c, ac=ac, aid=aid)
    return [Candidate(*r.values()) for r in cur.execute(sql + f"ORDER BY {_KEY} LIMIT %(lim)s", args)]


def next_backoff_us(cur, now_us: int) -> int | None:
    return cur.execute("SELECT min(a.not_before_us) AS t FROM runs r JOIN attempts a "
                       "ON a.attempt_id = r.latest_attempt_id WHERE r.state = 'queued' AND a.state = 'claimed' "
                       "AND a.not_before_us > %s", (now_us,)).fetchone()["t"]


def reread_candidate(cur, c: Candidate) -> bool:
    """ADR-0071 §4 step 1: still queued, uncancelled, same version and claimed Attempt?"""
    return cur.execute(
        "SELECT 1 FROM runs r JOIN attempts a ON a.attempt_id = r.latest_attempt_id WHERE r.run_id = %s "
        "AND r.version = %s AND r.state = 'queued' AND r.cancel_requested_at_us IS NULL AND a.attempt_id = %s "
        "AND a.state = 'claimed'", (c.run_id, c.version, c.attempt_id)).fetchone() is not None


def load_plan(cur, task_id: str, revision: int) -> tuple[Plan | None, str | None]:
    """Pinned execution revision and context recipe, or (None, ``revision_missing``/``recipe_missing``)."""
    row = cur.execute("SELECT x.spec_json, x.recipe_ref, d.definition_json, cr.recipe_json FROM execution_revisions x "
                      "JOIN task_revisions d ON d.task_id = x.task_id AND d.revision = x.revision "
                      "LEFT JOIN context_recipes cr ON cr.recipe_ref = x.recipe_ref "
                      "WHERE x.task_id = %s AND x.revision = %s", (task_id, revision)).fetchone()
    if row is None:
        return None, "revision_missing"
    if row["recipe_json"] is None:
        return None, "recipe_missing"
    spec = msgspec.json.decode(row["spec_json"])
    spec.pop("recipeRef", None)
    rec = msgspec.json.decode(row["recipe_json"])
    d = msgspec.json.decode(row["definition_json"])
    return Plan(execution=msgspec.convert(spec, ExecutionSpec),
                recipe=ContextRecipe(public=rec["public"], secret_refs=rec["secretRefs"]),
                timeout_ms=d["timeoutMs"], grace_ms=d["graceMs"], retry=msgspec.convert(d["retry"], RetryPolicy),
                concurrency=d["concurrency"], network_require=d["network"]["require"],
                network_interface=d["network"]["interface"], task_name=d["name"]), None


def active_count(cur) -> int:
    return cur.execute("SELECT count(*) AS n FROM runs WHERE state = ANY(%s)", (list(ACTIVE),)).fetchone()["n"]


def task_active_count(cur, task_id: str) -> int:
    return cur.execute("SELECT count(*) AS n FROM runs WHERE task_id = %s AND state = ANY(%s)",
                       (task_id, list(ACTIVE))).fetchone()["n"]


def _bump(cur, run_id: str, src: str, dst: str, version: int | None, now_us: int, **cols) -> int | None:
    """CAS the Run ``src → dst``; the new event sequence, or None if the CAS lost."""
    states.check_run(src, dst)
    sets = "".join(f", {k} = %({k})s" for k in cols)
    sql = (f"UPDATE runs SET state = %(dst)s, version = version + 1, event_sequence = event_sequence + 1, "
           f"updated_at_us = %(now)s{sets} WHERE run_id = %(run)s AND state = %(src)s")
    args = {"dst": dst, "now": now_us, "run": run_id, "src": src, **cols}
    if version is not None:
        sql += " AND version = %(ver)s"
        args["ver"] = version
    row = cur.execute(sql + " RETURNING event_sequence", args).fetchone()
    return None if row is None else row["event_sequence"]


class AttemptNotClaimed(Exception):
    """Rolls back a Run CAS whose Attempt was no longer ``claimed``."""


def claim_starting(cur, c: Candidate, artifact_path: str, now_us: int) -> bool:
    """queued → starting and claimed → starting by CAS on the candidate's version; False: lost."""
    seq = _bump(cur, c.run_id, "queued", "starting", c.version, now_us)
    if seq is None:
        return False
    states.check_attempt("claimed", "starting")
    if cur.execute("UPDATE attempts SET state = 'starting', artifact_path = %s, version = version + 1 "
                   "WHERE attempt_id = %s AND state = 'claimed'", (artifact_path, c.attempt_id)).rowcount == 0:
        raise AttemptNotClaimed(c.attempt_id)
    append_event(cur, c.run_id, seq, "run.starting", "dispatcher", {"attemptId": c.attempt_id}, now_us)
    set_holds(cur, c.task_id)
    return True


def mark_running(cur, run_id: str, attempt_id: str, shim_pid: int, shim_start: float, deadline_us: int,
                 now_us: int) -> None:
    states.check_attempt("starting", "running")
    cur.execute("UPDATE attempts SET state = 'running', shim_pid = %s, shim_start_time = %s, deadline_at_us = %s, "
                "started_at_us = %s, version = version + 1 WHERE attempt_id = %s AND state = 'starting'",
                (shim_pid, shim_start, deadline_us, now_us, attempt_id))
    seq = _bump(cur, run_id, "starting", "running", None, now_us)
    if seq is not None:
        append_event(cur, run_id, seq, "run.running", "coordinator", {"attemptId": attempt_id,
                                                                      "deadlineUs": deadline_us}, now_us)


def _next_seq(cur, run_id: str) -> int:
    return cur.execute("UPDATE runs SET event_sequence = event_sequence + 1 WHERE run_id = %s "
                       "RETURNING event_sequence", (run_id,)).fetchone()["event_sequence"]


def finish_attempt(cur, run_id: str, attempt_id: str, f: Finish, retry: RetryPolicy | None, now_us: int,
                   executor_type: str) -> str:
    """End an Attempt and its Run, or queue a retry Attempt (``executor_type``); the Run's new
    state. Idempotent for an Attempt already terminal (the local store's rules)."""
    a = cur.execute("SELECT state, attempt_no FROM attempts WHERE attempt_id = %s FOR UPDATE",
                    (attempt_id,)).fetchone()
    run = cur.execute("SELECT state, cancel_requested_at_us, task_id FROM runs WHERE run_id = %s FOR UPDATE",
                      (run_id,)).fetchone()
    if a is None or a["state"] in states.ATTEMPT_TERMINAL:
        return run["state"]
    states.check_attempt(a["state"], f.attempt_state)
    ended = f.ended_at_us or now_us
    cur.execute("UPDATE attempts SET state = %s, exit_code = %s, exit_signal = %s, bytes_kept = %s, "
                "bytes_dropped = %s, peak_rss_bytes = %s, cpu_time_us = %s, failure_reason = %s, ended_at_us = %s, "
                "start_error = %s, orphans_stopped = %s, version = version + 1 WHERE attempt_id = %s",
                (f.attempt_state, f.exit_code, f.exit_signal, f.bytes_kept, f.bytes_dropped, f.peak_rss_bytes,
                 f.cpu_time_us, f.failure_reason, ended, f.start_error, f.orphans_stopped, attempt_id))
    figures = {"attemptId": attempt_id, "attemptState": f.attempt_state, "exitCode": f.exit_code,
               "signal": f.exit_signal, "bytesKept": f.bytes_kept, "bytesDropped": f.bytes_dropped}
    if f.orphans_stopped:
        figures["orphansStopped"] = f.orphans_stopped
    if f.failure_reason:
        figures["reason"] = f.failure_reason
    if f.attempt_state == "start_failed":
        append_event(cur, run_id, _next_seq(cur, run_id), "run.start_failed", "coordinator",
                     {"attemptId": attempt_id, "reason": f.failure_reason, "error": f.start_error}, now_us)
    attempt_no = a["attempt_no"]
    if (retry is not None and states.retryable(f.attempt_state) and run["cancel_requested_at_us"] is None
            and attempt_no < retry.max_attempts):
        nxt = new_id()
        cur.execute("INSERT INTO attempts(attempt_id, run_id, attempt_no, state, executor_type, not_before_us, "
                    "created_at_us) VALUES (%s, %s, %s, 'claimed', %s, %s, %s)",
                    (nxt, run_id, attempt_no + 1, executor_type,
                     now_us + states.backoff_ms(retry.backoff_ms, attempt_no) * 1000, now_us))
        if run["state"] == "queued":      # never left the queue (unlaunchable): only the Attempt changes
            seq = cur.execute("UPDATE runs SET version = version + 1, event_sequence = event_sequence + 1, "
                              "latest_attempt_id = %s, latest_attempt_created_at_us = %s, updated_at_us = %s "
                              "WHERE run_id = %s RETURNING event_sequence", (nxt, now_us, now_us, run_id)
                              ).fetchone()["event_sequence"]
        else:
            seq = _bump(cur, run_id, run["state"], "queued", None, now_us, latest_attempt_id=nxt,
                        latest_attempt_created_at_us=now_us)
        append_event(cur, run_id, seq, "run.retry_queued", "coordinator", {**figures, "nextAttemptId": nxt}, now_us)
        set_holds(cur, run["task_id"])
        return "queued"
    run_state = "failed" if f.attempt_state == "start_failed" else f.attempt_state
    seq = _bump(cur, run_id, run["state"], run_state, None, now_us, exit_code=f.exit_code, exit_signal=f.exit_signal,
                ended_at_us=ended)
    append_event(cur, run_id, seq, f"run.{run_state}", "coordinator", figures, now_us)
    set_holds(cur, run["task_id"])
    return run_state


def record_truncation(cur, attempt_id: str, fact: TruncationFact, now_us: int) -> None:
    """Write the truncation fact once; a later write only fills in an unknown ``bytes_dropped``."""
    cur.execute("INSERT INTO truncation_facts(attempt_id, quota_bytes, bytes_kept, bytes_dropped, recorded_at_us) "
                "VALUES (%s, %s, %s, %s, %s) ON CONFLICT (attempt_id) DO UPDATE SET bytes_dropped = "
                "coalesce(truncation_facts.bytes_dropped, excluded.bytes_dropped)",
                (attempt_id, fact.quota_bytes, fact.bytes_kept, fact.bytes_dropped, now_us))


def attempt_revision(cur, attempt_id: str) -> tuple[str, int] | None:
    """(task ID, revision) of an Attempt's Run, or None for an Attempt this store never had."""
    r = cur.execute("SELECT r.task_id, r.task_revision FROM attempts a JOIN runs r ON r.run_id = a.run_id "
                    "WHERE a.attempt_id = %s", (attempt_id,)).fetchone()
    return None if r is None else (r["task_id"], r["task_revision"])


def live_attempts(cur) -> list[LiveAttempt]:
    return [LiveAttempt(r["run_id"], r["attempt_id"], r["task_id"], r["task_revision"], r["state"], r["shim_pid"],
                        r["shim_start_time"], r["deadline_at_us"], r["artifact_path"],
                        r["cancel_requested_at_us"] is not None) for r in cur.execute(
        "SELECT r.run_id, a.attempt_id, r.task_id, r.task_revision, a.state, a.shim_pid, a.shim_start_time, "
        "a.deadline_at_us, a.artifact_path, r.cancel_requested_at_us FROM attempts a JOIN runs r "
        "ON r.run_id = a.run_id WHERE a.state = ANY(%s) AND a.worker_id IS NULL ORDER BY a.attempt_id",
        (list(states.ATTEMPT_ACTIVE),))]


def claimed_attempt_ids(cur) -> list[str]:
    return [r["attempt_id"] for r in cur.execute("SELECT attempt_id FROM attempts WHERE state = 'claimed' "
                                                 "AND worker_id IS NULL ORDER BY attempt_id")]


def request_cancel(cur, run_id: str, actor: str, now_us: int) -> str:
    """queued → cancelled at once; an active Run (dispatching included) gets the intent once."""
    r = cur.execute("SELECT state, version, event_sequence, cancel_requested_at_us FROM runs WHERE run_id = %s "
                    "FOR UPDATE", (run_id,)).fetchone()
    if r["state"] == states.RunState.QUEUED:
        cancel_queued(cur, run_id, r["event_sequence"], r["version"], actor, "cancel_requested", now_us)
        return "cancelled"
    if r["state"] in states.RUN_LIVE_CLUSTER and r["cancel_requested_at_us"] is None:
        cur.execute("UPDATE runs SET cancel_requested_at_us = %s, event_sequence = event_sequence + 1, "
                    "updated_at_us = %s WHERE run_id = %s", (now_us, now_us, run_id))
        append_event(cur, run_id, r["event_sequence"] + 1, "run.cancel_requested", actor, {}, now_us)
    return r["state"]


def retention_entries(cur) -> list[RetentionEntry]:
    return [RetentionEntry(attempt_id=r["attempt_id"], task_id=r["task_id"], artifact_path=r["artifact_path"],
                           ended_at_us=r["ended_at_us"]) for r in cur.execute(
        "SELECT a.attempt_id, r.task_id, a.artifact_path, a.ended_at_us FROM attempts a JOIN runs r "
        "ON r.run_id = a.run_id WHERE a.artifact_path IS NOT NULL AND a.ended_at_us IS NOT NULL "
        "ORDER BY a.ended_at_us, a.attempt_id")]


def forget_artifacts(cur, attempt_ids: list[str]) -> None:
    cur.execute("UPDATE attempts SET artifact_path = NULL WHERE attempt_id = ANY(%s)", (list(attempt_ids),))
