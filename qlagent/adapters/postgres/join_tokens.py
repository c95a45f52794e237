"""Join tokens on PostgreSQL (issue 26; policy: ``cluster.joins``): a row per token issued
(``join_tokens``: ID, Worker, issue and expiry time, when it was used; never the credential it
carries), redeemed once by the Worker whose credential it holds."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ...core.errors import ConflictError, NotFoundError
from .connection import transaction
from .queries import JOIN_TOKEN_FOR_UPDATE, JOIN_TOKEN_INSERT, JOIN_TOKEN_USE
from .transitions import authenticate, now_us

if TYPE_CHECKING:   # annotations only: psycopg loads where a connection is opened
    from psycopg_pool import ConnectionPool


class PgJoinTokens:
    """``join_tokens`` rows over a psycopg pool."""

    def __init__(self, pool: ConnectionPool) -> None:
        self._pool = pool

    def issue(self, token_id: str, worker_id: str, ttl_us: int) -> int:
        """Record a token for ``worker_id`` valid ``ttl_us`` µs from the database's now; its
        expiry (µs, database clock)."""
        def tx(cur):
            now = now_us(cur)
            cur.execute(JOIN_TOKEN_INSERT, (token_id, worker_id, now, now + ttl_us))
            return now + ttl_us
        return transaction(self._pool, tx)

    def redeem(self, token_id: str, worker_id: str, credential_digest: str) -> None:
        """Mark the token used. WorkerAuthError unless the credential is this live Worker's (a
        removed Worker's token is refused so); NotFoundError ``join_token_not_found``;
        ConflictError ``join_token_used`` / ``join_token_expired`` (nothing written)."""
        def tx(cur):
            authenticate(cur, worker_id, credential_digest)
            row = cur.execute(JOIN_TOKEN_FOR_UPDATE, (token_id, worker_id)).fetchone()
            if row is None:
                raise NotFoundError("no such join token for this Worker", code="join_token_not_found")
            if row["used_at_us"] is not None:
                raise ConflictError("this join token has been used; issue a new one (`qlagent workers "
                                    "rotate-credential NAME --join-token`)", code="join_token_used")
            now = now_us(cur)
            if row["expires_at_us"] <= now:
                raise ConflictError("this join token has expired; issue a new one (`qlagent workers "
                                    "rotate-credential NAME --join-token`)", code="join_token_expired")
            cur.execute(JOIN_TOKEN_USE, (now, token_id))
        transaction(self._pool, tx)
