"""A Worker's credential re-issued on PostgreSQL (issue 26, ``workers rotate-credential``):
the row keeps its Worker ID, name and enrolment; only the stored SHA-256 changes, so the old
credential fails its next request (``transitions.authenticate``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ...core.errors import NotFoundError
from .connection import transaction
from .queries import WORKER_CREDENTIAL_SET
from .transitions import now_us

if TYPE_CHECKING:   # annotations only: psycopg loads where a connection is opened
    from psycopg_pool import ConnectionPool


class PgCredentials:
    """``workers.credential_digest`` over a psycopg pool."""

    def __init__(self, pool: ConnectionPool) -> None:
        self._pool = pool

    def replace(self, name: str, credential_digest: str) -> str:
        """Store ``credential_digest`` for the live Worker ``name``; its Worker ID.
        NotFoundError ``worker_not_found``."""
        def tx(cur):
            row = cur.execute(WORKER_CREDENTIAL_SET, (credential_digest, now_us(cur), name)).fetchone()
            if row is None:
                raise NotFoundError(f"no Worker named {name!r}", code="worker_not_found")
            return row["worker_id"]
        return transaction(self._pool, tx)
