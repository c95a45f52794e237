"""Log chunks in the authority (issue 10 §9): offset-addressed, idempotent per offset, capped
at a quota with a write-once truncation fact, so any replica serves ``run logs``."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ...core.cluster import ChunkConflict, LeaseFence
from ...core.errors import ConflictError
from ...core.receipt import QUOTA, TruncationFact
from ...core.states import LeaseState
from .connection import transaction
from .queries import (ATTEMPT_LOG_NEXT_FOR_NO_KEY_UPDATE, ATTEMPT_LOG_NEXT_SET, LOG_CHUNKS_RANGE, LOG_CHUNK_AT,
                      LOG_CHUNK_INSERT, RUN_LOG_LATEST_ATTEMPT, TRUNCATION_FACT_EXISTS, TRUNCATION_FACT_INSERT)
from .transitions import fenced_lease, now_us

if TYPE_CHECKING:   # annotations only: psycopg loads where a connection is opened
    from psycopg_pool import ConnectionPool


class PgLogStore:
    """Log chunks of Attempts over a psycopg pool."""

    def __init__(self, pool: ConnectionPool) -> None:
        self._pool = pool

    def append(self, fence: LeaseFence, offset: int, data: bytes, quota_bytes: int) -> tuple[int, bool]:
        """Store ``data`` at byte ``offset`` of the Attempt's log; return (next expected offset,
        truncated). Bytes past ``quota_bytes`` are received (the offset advances) but not kept.

        ConflictError codes: chunk_gap (offset beyond the received end), chunk_mismatch (the
        offset holds other bytes), lease_not_active (the Lease was expired or fenced), and the
        fence's own codes.
        """
        def tx(cur):
            lease = fenced_lease(cur, fence)
            if lease["state"] not in (LeaseState.ACTIVE, LeaseState.COMPLETED):
                raise ConflictError(f"the Lease is {lease['state']}", code="lease_not_active")
            a = cur.execute(ATTEMPT_LOG_NEXT_FOR_NO_KEY_UPDATE, (fence.attempt_id,)).fetchone()
            end = a["log_next_offset"]
            truncated = cur.execute(TRUNCATION_FACT_EXISTS, (fence.attempt_id,)).fetchone() is not None
            if offset < end:
                kept = cur.execute(LOG_CHUNK_AT, (fence.attempt_id, offset)).fetchone()
                stored = bytes(kept["data"]) if kept else b""
                if offset + len(data) > end or stored != data[:len(stored)] or (
                        not stored and offset < min(end, quota_bytes)):
                    raise ChunkConflict(f"offset {offset} already holds other bytes", code="chunk_mismatch",
                                        next_offset=end)
                return end, truncated
            if offset > end:
                raise ChunkConflict(f"offset {offset} leaves a gap; next expected offset is {end}", code="chunk_gap",
                                    next_offset=end)
            keep = max(0, min(len(data), quota_bytes - offset))
            if keep:
                cur.execute(LOG_CHUNK_INSERT, (fence.attempt_id, offset, data[:keep]))
            if keep < len(data) and not truncated:
                cur.execute(TRUNCATION_FACT_INSERT, (fence.attempt_id, quota_bytes, quota_bytes, QUOTA, now_us(cur)))
                truncated = True
            cur.execute(ATTEMPT_LOG_NEXT_SET, (offset + len(data), fence.attempt_id))
            return offset + len(data), truncated
        return transaction(self._pool, tx)

    def read(self, attempt_id: str, offset: int, limit: int) -> bytes:
        """Up to ``limit`` kept bytes of the Attempt's log from ``offset``."""
        rows = transaction(self._pool, lambda cur: cur.execute(
            LOG_CHUNKS_RANGE, (attempt_id, offset, offset + limit)).fetchall())
        out = b"".join(bytes(r["data"]) for r in rows)
        start = offset - rows[0]["offset_bytes"] if rows else 0
        return out[start:start + limit]

    def read_range(self, run_id: str, offset: int, limit: int) -> tuple[bytes, int, TruncationFact | None]:
        """``run logs`` of a Worker-run Attempt from the authority (any replica): (up to ``limit``
        bytes at ``offset`` of the Run's latest Attempt's uploaded log, the log's size in bytes,
        its truncation fact or None), in one snapshot."""
        def tx(cur):
            a = cur.execute(RUN_LOG_LATEST_ATTEMPT, (run_id,)).fetchone()
            if a is None:
                return b"", 0, None
            rows = cur.execute(LOG_CHUNKS_RANGE, (a["attempt_id"], offset, offset + limit)).fetchall()
            out = b"".join(bytes(r["data"]) for r in rows)
            start = offset - rows[0]["offset_bytes"] if rows else 0
            fact = None if a["quota_bytes"] is None else TruncationFact(a["quota_bytes"], a["bytes_kept"],
                                                                         a["bytes_dropped"], a["reason"])
            return out[start:start + limit], a["size"], fact
        return transaction(self._pool, tx)
