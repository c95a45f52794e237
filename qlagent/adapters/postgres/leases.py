"""Run Lease facts on PostgreSQL: Worker ACKs (ADR-0109) and the bounded lease sweeper.

Every ACK runs in one transaction behind ``transitions.fenced_lease`` (credential, lease token
digest, Session and generation). An ACK already applied is answered again as a replay without
changing anything; an ACK against a Lease that expired or was fenced is refused.
"""

from __future__ import annotations

from ...core.cluster import Ack, AckResult, LeaseFence
from ...core.errors import ConflictError
from ...core.receipt import TruncationFact
from ...core.states import AttemptState, LeaseState
from .connection import transaction
from ..rows.execution import record_truncation
from .dialect import POSTGRES
from .queries import (ACK_ATTEMPT_FOR_NO_KEY_UPDATE, ACK_ATTEMPT_MOVE, ACK_RUN_MOVE, LEASES_EXPIRED_FOR_UPDATE,
                      LEASE_COMPLETE, LEASE_EXTEND, OCCUPYING, RUNS_RELEASE_HOLDS, RUN_STATE)
from .transitions import end_lease, event, fenced_lease, finish_attempt, now_us

# Attempt progress order: an ACK for a state at or behind the current one is a replay.
_RANK = {AttemptState.CLAIMED: 0, AttemptState.STARTING: 1, AttemptState.RUNNING: 2}
_TERMINAL = AttemptState.TERMINAL


class PgLeaseStore:
    """ACKs and the expired-Lease sweep over a psycopg pool."""

    def __init__(self, pool) -> None:
        self._pool = pool

    def apply_ack(self, fence: LeaseFence, ack: Ack, target: str, lease_ttl_us: int) -> AckResult:
        """Move the Attempt to ``target`` (starting, running or a terminal state) under the fence.

        ConflictError codes: stale_generation, lease_token_mismatch, lease_not_active,
        lease_expired, ack_out_of_order, ack_conflict (a different terminal state was recorded).
        """
        actor = f"worker:{fence.worker_id}"

        def tx(cur):
            lease, _ = fenced_lease(cur, fence)
            a = cur.execute(ACK_ATTEMPT_FOR_NO_KEY_UPDATE, (fence.attempt_id,)).fetchone()
            state = a["state"]
            if lease["state"] in LeaseState.ENDED or a["lease_generation"] != fence.lease_generation:
                # An ended or superseded Lease answers nothing, not even a replay: its Worker must stop.
                raise ConflictError(f"the Lease is {lease['state']}", code="lease_not_active")
            if state in _TERMINAL or (target in _RANK and _RANK.get(state, 3) >= _RANK[target]):
                if target in _TERMINAL and state != target:
                    raise ConflictError(f"the Attempt already ended {state}", code="ack_conflict")
                return AckResult(state, self._run_state(cur, lease["run_id"]), True)
            if lease["state"] != LeaseState.ACTIVE:
                raise ConflictError(f"the Lease is {lease['state']}", code="lease_not_active")
            now = now_us(cur)
            if lease["expires_at_us"] <= now:
                raise ConflictError("the Lease expired", code="lease_expired")
            allowed = {AttemptState.STARTING: (AttemptState.CLAIMED,), AttemptState.RUNNING: (AttemptState.STARTING,),
                       AttemptState.START_FAILED: (AttemptState.CLAIMED, AttemptState.STARTING),
                       }.get(target, (AttemptState.STARTING, AttemptState.RUNNING))
            if state not in allowed:
                raise ConflictError(f"{ack.kind} ACK while the Attempt is {state}", code="ack_out_of_order")
            if target in _RANK:
                cur.execute(ACK_ATTEMPT_MOVE, (target, now, fence.attempt_id))
                cur.execute(ACK_RUN_MOVE, (target, now, lease["run_id"]))
                cur.execute(LEASE_EXTEND, (now + lease_ttl_us, fence.attempt_id, fence.lease_generation))
                event(cur, lease["run_id"], f"run.{target}", actor,
                      {"attemptId": fence.attempt_id, "leaseGeneration": fence.lease_generation}, now)
                return AckResult(target, target)
            cur.execute(LEASE_COMPLETE, (now, fence.attempt_id, fence.lease_generation))
            if ack.bytes_dropped:
                # The quota cut the log on the Worker: the shim keeps exactly the quota once it
                # drops (core.receipt), so the completion's figures are the truncation fact. The
                # Worker uploads only the kept bytes, so no chunk would ever record it.
                kept = ack.bytes_kept or 0
                record_truncation(POSTGRES.db(cur), fence.attempt_id, TruncationFact(quota_bytes=kept, bytes_kept=kept,
                                                                         bytes_dropped=ack.bytes_dropped), now)
            figures = {"exit_code": ack.exit_code, "signal": ack.signal, "bytes_kept": ack.bytes_kept,
                       "bytes_dropped": ack.bytes_dropped, "peak_rss_bytes": ack.peak_rss_bytes,
                       "cpu_time_us": ack.cpu_time_us}
            run_state = finish_attempt(cur, lease["run_id"], fence.attempt_id, target, actor, now,
                                       failure_reason=ack.start_error or ack.kill_reason, figures=figures)
            return AckResult(target, run_state)
        return transaction(self._pool, tx)

    @staticmethod
    def _run_state(cur, run_id: str) -> str:
        return cur.execute(RUN_STATE, (run_id,)).fetchone()["state"]

    def release_holds(self, limit: int) -> int:
        """Release up to ``limit`` held queued Runs whose Task no Run occupies any more (a hold a
        concurrent transaction could not see when that Run ended; ``runs.set_holds``), oldest
        first, skipping rows another replica holds. Returns how many were released. The claim's
        own guard keeps a single-instance Task to one live Run whatever this pass sees."""
        def tx(cur):
            return len(cur.execute(
                RUNS_RELEASE_HOLDS, (list(OCCUPYING), limit)).fetchall())
        return transaction(self._pool, tx)

    def sweep_expired(self, limit: int) -> list[tuple[str, str]]:
        """End up to ``limit`` active Leases past their expiry (database clock), skipping rows
        another replica holds (``FOR UPDATE SKIP LOCKED``); return (Attempt ID, Run state) pairs."""
        def tx(cur):
            now = now_us(cur)
            rows = cur.execute(LEASES_EXPIRED_FOR_UPDATE, (now, limit)).fetchall()
            return [(r["attempt_id"], end_lease(cur, r, LeaseState.EXPIRED, "lease_expired", now)) for r in rows]
        return transaction(self._pool, tx)
