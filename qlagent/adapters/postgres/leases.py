"""Run Lease facts on PostgreSQL: Worker ACKs (ADR-0109) and the bounded lease sweeper.

Every ACK runs behind the Lease fence (credential, lease token digest, Session and generation:
``ql_lease_fence``, inside ``ql_ack``). An ACK already applied is answered again as a replay
without changing anything; an ACK against a Lease that expired or was fenced is refused.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ...core.cluster import Ack, AckResult, LeaseFence
from ...core.errors import ConflictError
from ...core.receipt import QUOTA, TruncationFact
from ...core.states import AttemptState, LeaseState
from .connection import statement, transaction
from ..rows.execution import record_truncation
from .dialect import POSTGRES
from .queries import ACK, LEASES_EXPIRED_FOR_UPDATE, OCCUPYING, RUNS_RELEASE_HOLDS
from .transitions import after_attempt, end_lease, fence_refusal, now_us

if TYPE_CHECKING:   # annotations only: psycopg loads where a connection is opened
    from psycopg_pool import ConnectionPool


class PgLeaseStore:
    """ACKs and the expired-Lease sweep over a psycopg pool."""

    def __init__(self, pool: ConnectionPool) -> None:
        self._pool = pool

    def apply_ack(self, fence: LeaseFence, ack: Ack, target: str, lease_ttl_us: int) -> AckResult:
        """Move the Attempt to ``target`` (starting, running or a terminal state) under the fence:
        one call of ``ql_ack`` (migration 0019, same checks in the same order as a fence, a
        replay, the Lease's state and expiry, the step's order). A step (starting, running) is
        that call alone, a transaction of its own in one round trip; an end continues in the same
        transaction with its truncation fact and the retry decision (``transitions.after_attempt``).

        ConflictError codes: stale_generation, lease_token_mismatch, lease_not_active,
        lease_expired, ack_out_of_order, ack_conflict (a different terminal state was recorded).
        """
        actor = f"worker:{fence.worker_id}"
        reason = ack.start_error or ack.kill_reason
        args = (fence.worker_id, fence.credential_digest, fence.session_id, fence.generation, fence.attempt_id,
                fence.lease_generation, fence.token_digest, target, lease_ttl_us, reason, ack.exit_code, ack.signal,
                ack.bytes_kept, ack.bytes_dropped, ack.peak_rss_bytes, ack.cpu_time_us)

        def tx(cur):
            row = cur.execute(ACK, args).fetchone()
            if row["code"] != "ended":
                return _answer(row, fence, ack)
            now = row["now_us"]
            if ack.bytes_dropped:
                # The quota (or a failed write: ``truncation_reason``) cut the log on the Worker:
                # the shim keeps exactly the quota once it drops (core.receipt), so the
                # completion's figures are the truncation fact. The Worker uploads only the kept
                # bytes, so no chunk would ever record it.
                kept = ack.bytes_kept or 0
                record_truncation(POSTGRES.db(cur), fence.attempt_id, TruncationFact(
                    quota_bytes=kept, bytes_kept=kept, bytes_dropped=ack.bytes_dropped,
                    reason=ack.truncation_reason or QUOTA), now)
            run_state = after_attempt(cur, row, row["run_id"], fence.attempt_id, target, actor, now, reason,
                                      ack.exit_code, ack.signal)
            return AckResult(target, run_state)
        return (transaction if target in AttemptState.TERMINAL else statement)(self._pool, tx)

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


def _answer(row: dict, fence: LeaseFence, ack: Ack) -> AckResult:
    """The answer of an ACK ``ql_ack`` did not end the Attempt for: applied, a replay, or the
    refusal its code names."""
    code = row["code"]
    refused = fence_refusal(row, fence)
    if refused is not None:
        raise refused
    if code == "lease_not_active":
        # An ended or superseded Lease answers nothing, not even a replay: its Worker must stop.
        raise ConflictError(f"the Lease is {row['lease_state']}", code="lease_not_active")
    if code == "ack_conflict":
        raise ConflictError(f"the Attempt already ended {row['attempt_state']}", code="ack_conflict")
    if code == "lease_expired":
        raise ConflictError("the Lease expired", code="lease_expired")
    if code == "ack_out_of_order":
        raise ConflictError(f"{ack.kind} ACK while the Attempt is {row['attempt_state']}", code="ack_out_of_order")
    return AckResult(row["attempt_state"], row["run_state"], code == "replay")
