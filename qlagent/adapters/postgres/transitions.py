"""Run/Attempt transitions shared by the cluster's PostgreSQL stores, inside the caller's
transaction: RunEvents with the next per-Run sequence, the Run's retry decision after an
Attempt ended (``core.cluster.decide_after_attempt``), the end of a Lease (expiry or fencing),
its adoption by a new Session of the same Worker, and the Lease fence every Worker fact passes
through. The row writes of an event, a fence, an Attempt's end and the Run's next step are
database functions (migration 0019: one round trip each); the decisions stay here."""

from __future__ import annotations

from ...core.cluster import AdoptedLease, AdoptRefusal, AttemptEnd, LeaseFence, WorkerAuthError, decide_after_attempt
from ...core.errors import ConflictError, NotFoundError, QlError
from ...core.models import RetryPolicy
from ...core.states import AttemptState, LeaseState, RunState, SessionState
from .queries import (DB_NOW, EVENT_APPEND, LEASE_FENCE, LEASES_OF_OTHER_SESSIONS_FOR_UPDATE, LEASE_ADOPT,
                      LEASE_ATTEMPT_RUN_FOR_NO_KEY_UPDATE, LEASE_END, LEASE_TO_ADOPT_FOR_UPDATE, RUN_AFTER_ATTEMPT,
                      RUN_REQUEUE_DISPATCHING, SESSIONS_CLOSE_OTHERS, WORKER_ATTEMPT_END, WORKER_BY_CREDENTIAL,
                      WORKER_BY_CREDENTIAL_FOR_NO_KEY_UPDATE)
from .runs import set_holds


def now_us(cur) -> int:
    return cur.execute(DB_NOW).fetchone()["now"]


def event(cur, run_id: str, type_: str, actor: str, payload: dict, now: int) -> None:
    """Append one RunEvent (payload: identities, fences and figures only)."""
    from psycopg.types.json import Jsonb
    cur.execute(EVENT_APPEND, (run_id, type_, actor, Jsonb(payload), now))


def finish_attempt(cur, run_id: str, attempt_id: str, attempt_state: str, actor: str, now: int, *,
                   failure_reason: str | None = None, figures: dict | None = None) -> str:
    """End the Attempt in ``attempt_state`` and let the retry policy decide the Run; return the
    Run's new state (``queued`` when a new claimed Attempt follows)."""
    f = figures or {}
    ended = cur.execute(WORKER_ATTEMPT_END, (
        run_id, attempt_id, attempt_state, now, failure_reason, f.get("exit_code"), f.get("signal"),
        f.get("bytes_kept"), f.get("bytes_dropped"), f.get("peak_rss_bytes"), f.get("cpu_time_us"))).fetchone()
    return after_attempt(cur, ended, run_id, attempt_id, attempt_state, actor, now, failure_reason,
                         f.get("exit_code"), f.get("signal"))


def after_attempt(cur, ended: dict, run_id: str, attempt_id: str, attempt_state: str, actor: str, now: int,
                  failure_reason: str | None, exit_code: int | None, signal: int | None) -> str:
    """The retry policy's decision (``core.cluster.decide_after_attempt``) on the facts of an
    Attempt that just ended (``ended``: ``ql_attempt_end``'s row: its number and executor,
    whether the Run was asked to cancel, its Task, the retry policy of its revision), applied
    by ``ql_after_attempt``: the attempt event, then a new claimed Attempt (``run.retrying``)
    or the Run's end, then the Task's holds. Returns the Run's new state."""
    retry = None if ended["max_attempts"] is None else RetryPolicy(max_attempts=ended["max_attempts"],
                                                                   backoff_ms=ended["backoff_ms"])
    decision = decide_after_attempt(AttemptEnd(attempt_state, ended["attempt_no"], retry, ended["cancel_requested"]))
    return cur.execute(RUN_AFTER_ATTEMPT, (
        run_id, attempt_id, attempt_state, actor, now, failure_reason, decision.retry, decision.run_state,
        ended["attempt_no"], ended["worker_executor"], now + decision.backoff_ms * 1000, exit_code, signal,
        ended["task_id"])).fetchone()["state"]


def end_lease(cur, lease: dict, lease_state: str, reason: str, now: int) -> str:
    """End an active Lease (``expired`` or ``fenced``) and move its Attempt: still ``claimed`` →
    the Run is queued again for a new offer (or cancelled when asked); ``starting``/``running``
    → the Attempt is ``lost`` (the Worker may have started it: never offered twice) and the
    retry policy decides. Returns the Run's new state."""
    cur.execute(LEASE_END, (lease_state, now, lease["attempt_id"], lease["lease_generation"]))
    a = cur.execute(LEASE_ATTEMPT_RUN_FOR_NO_KEY_UPDATE, (lease["attempt_id"],)).fetchone()
    facts = {"attemptId": lease["attempt_id"], "leaseGeneration": lease["lease_generation"], "reason": reason}
    if a["state"] == AttemptState.CLAIMED:
        if a["cancel_requested_at_us"] is not None:
            return finish_attempt(cur, lease["run_id"], lease["attempt_id"], AttemptState.CANCELLED, "control-plane", now,
                                  failure_reason=reason)
        requeued = cur.execute(RUN_REQUEUE_DISPATCHING, (now, lease["run_id"])).fetchone()
        event(cur, lease["run_id"], "run.requeued", "control-plane", facts, now)
        if requeued is not None:
            set_holds(cur, requeued["task_id"])
        return RunState.QUEUED
    if a["state"] in (AttemptState.STARTING, AttemptState.RUNNING):
        return finish_attempt(cur, lease["run_id"], lease["attempt_id"], AttemptState.LOST, "control-plane", now,
                              failure_reason=reason)
    return a["state"]


def fence_sessions(cur, worker_id: str, keep_session: str | None, reason: str, now: int) -> int:
    """Close every other open Session of the Worker and fence its active Leases; return how many
    Leases were fenced."""
    cur.execute(SESSIONS_CLOSE_OTHERS, (SessionState.REPLACED if keep_session else SessionState.CLOSED, worker_id, keep_session))
    leases = cur.execute(LEASES_OF_OTHER_SESSIONS_FOR_UPDATE, (worker_id, keep_session)).fetchall()
    for lease in leases:
        end_lease(cur, lease, LeaseState.FENCED, reason, now)
    return len(leases)


def adopt_leases(cur, worker_id: str, session_id: str, generation: int, claims, now: int) -> tuple[list, list]:
    """Re-bind to the new Session/generation each claimed Lease ((Attempt ID, lease generation,
    token digest), Attempt ID order: the lock order) that is this Worker's, matches the token
    digest and is either ``completed`` or active, unexpired at ``now``, its Attempt
    ``starting``/``running`` and its Run not asked to cancel (``cluster.registry``). Returns
    (``AdoptedLease`` list, ``AdoptRefusal`` list); each adoption appends ``lease.adopted``
    (identities and fences only, never the token); a refusal writes nothing (the caller's
    ``fence_sessions`` then ends the Lease if it is still active)."""
    adopted, refused = [], []
    for attempt_id, lease_generation, digest in claims:
        row = cur.execute(LEASE_TO_ADOPT_FOR_UPDATE, (attempt_id, lease_generation, worker_id)).fetchone()
        reason = None
        if row is None:
            reason = "lease_not_found"              # also another Worker's Lease: nothing said about it
        elif row["token_digest"] != digest:
            reason = "lease_token_mismatch"
        elif row["state"] in LeaseState.ENDED:
            reason = "lease_not_active"
        elif row["state"] == LeaseState.ACTIVE and row["expires_at_us"] <= now:
            reason = "lease_expired"
        elif row["state"] == LeaseState.ACTIVE and row["attempt_state"] not in (AttemptState.STARTING, AttemptState.RUNNING):
            reason = "not_started"                  # claimed: never spawned, ADR-0014 re-offers it
        elif row["state"] == LeaseState.ACTIVE and row["cancel_requested_at_us"] is not None:
            reason = "run_cancelled"
        if reason is not None:
            refused.append(AdoptRefusal(attempt_id, lease_generation, reason))
            continue
        cur.execute(LEASE_ADOPT, (session_id, generation, attempt_id, lease_generation))
        event(cur, row["run_id"], "lease.adopted", f"worker:{worker_id}",
              {"attemptId": attempt_id, "leaseGeneration": lease_generation, "sessionId": session_id,
               "generation": generation, "fromGeneration": row["worker_generation"]}, now)
        adopted.append(AdoptedLease(attempt_id, lease_generation, row["expires_at_us"]))
    return adopted, refused


def authenticate(cur, worker_id: str, credential_digest: str, *, lock: bool = False) -> dict:
    """The Worker row for this credential; WorkerAuthError unless it names this live Worker."""
    row = cur.execute(WORKER_BY_CREDENTIAL_FOR_NO_KEY_UPDATE if lock else WORKER_BY_CREDENTIAL,
                      (worker_id, credential_digest)).fetchone()
    if row is None:
        raise WorkerAuthError("worker credential does not match this Worker ID")
    return row


def fenced_lease(cur, f: LeaseFence) -> dict:
    """The lease row, locked FOR UPDATE, after the ADR-0109 fence (``ql_lease_fence``), else
    the error ``fence_refusal`` names.

    The generation is checked right after the credential and before the Lease is looked up
    (issue 10 §7): a replay from an older generation answers ``stale_generation`` whatever its
    Attempt, lease generation or token, so the answer depends on nothing but the Worker's own
    row and reveals neither whether the Lease exists nor whether the token matches."""
    row = cur.execute(LEASE_FENCE, (f.worker_id, f.credential_digest, f.session_id, f.generation, f.attempt_id,
                                    f.lease_generation, f.token_digest)).fetchone()
    refused = fence_refusal(row, f)
    if refused is not None:
        raise refused
    return row


def fence_refusal(row: dict, f: LeaseFence) -> QlError | None:
    """The error of a Lease fence that refused (``row["code"]`` of ``ql_lease_fence`` or
    ``ql_ack``), None when it passed: WorkerAuthError; ConflictError ``stale_generation`` (an
    older generation than the Worker's current one, or a Lease bound to another Session or
    generation than the request names); NotFoundError ``lease_not_found``; ConflictError
    ``lease_token_mismatch``."""
    code = row["code"]
    if code == "worker_unauthorized":
        return WorkerAuthError("worker credential does not match this Worker ID")
    if code == "stale_generation":
        return stale_session(f.session_id, f.generation, {"current_session_id": row["current_session_id"],
                                                          "generation": row["current_generation"]})
    if code == "lease_not_found":
        return NotFoundError("no such Lease for this Worker", code="lease_not_found")
    if code == "lease_token_mismatch":
        return ConflictError("lease token does not match the Lease", code="lease_token_mismatch")
    if code == "lease_elsewhere":
        return ConflictError(f"the Lease is bound to Session {row['session_id']} (generation "
                             f"{row['worker_generation']}), not to Session {f.session_id} (generation "
                             f"{f.generation}) the request names", code="stale_generation")
    return None


def stale_session(session_id: str, generation: int, worker: dict) -> ConflictError:
    """ConflictError ``stale_generation`` naming the Session and generation a request carried
    and the Worker's current ones (``worker``: its row)."""
    return ConflictError(f"Session {session_id} (generation {generation}) is not the Worker's current one: "
                         f"Session {worker['current_session_id']} (generation {worker['generation']})",
                         code="stale_generation")
