"""Numbered, checksummed migrations of the cluster authority (mirrors the SQLite migrator).

Files ``migrations/NNNN_name.sql`` are applied in number order, each in its own transaction
together with its ``schema_migrations`` row (version, name, SHA-256 of the file) and the
transaction-scoped ``pg_advisory_xact_lock(MIGRATION_LOCK)``, under which it re-reads the history,
so N replicas starting together migrate once (also behind a transaction-mode pooler): one
applies, the others wait, then find nothing pending. A database whose history names a
migration this build does not know, or whose checksum/name differs, is refused
(StoreIntegrityError) before anything is applied.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from ...core.canonical import sha256_hex
from ...core.errors import UnavailableError
from ..migration_files import Migration, pending, read_migrations
from .queries import (ADVISORY_XACT_LOCK, CAPABILITIES, MIGRATIONS_APPLIED, MIGRATIONS_TABLE_CREATE,
                      MIGRATION_LOCK_HOLDERS, MIGRATION_RECORD)

if TYPE_CHECKING:   # annotations only: psycopg loads where a connection is opened
    from psycopg import Connection

_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "migrations")
# First 8 bytes of sha256("qlagent:cluster:migrations") as a signed bigint: one fixed lock key.
MIGRATION_LOCK = int.from_bytes(bytes.fromhex(sha256_hex(b"qlagent:cluster:migrations")[:16]), "big", signed=True)
REQUIRED_CAPABILITIES = {"cluster-control-core": 1, "store-ports": 1}
LOCK_WAIT_S = 30.0     # longest wait for the migration lock (s): then UnavailableError naming its holder


def known_migrations() -> list[Migration]:
    """The migrations shipped with this build, in order."""
    return read_migrations(_DIR)


def verify_history(conn: Connection, known: list[Migration]) -> list[Migration]:
    """Check the recorded history against ``known``; return the migrations still to apply.

    Raises StoreIntegrityError naming the first unknown or altered migration.
    """
    conn.execute(MIGRATIONS_TABLE_CREATE)
    applied = conn.execute(MIGRATIONS_APPLIED).fetchall()
    return pending([tuple(r) for r in applied], known)


def migrate(conn: Connection) -> list[str]:
    """Apply pending migrations, each in its own transaction under the migration lock; return
    the names applied.

    ``conn`` must be an autocommit psycopg connection. The lock is transaction-scoped
    (``pg_advisory_xact_lock``), taken again by every migration's transaction, which re-reads
    the history under it: behind a transaction-mode pooler each transaction may run on another
    server backend, and a session lock would stay on one of them. The wait for it is bounded by
    ``LOCK_WAIT_S``. Raises StoreIntegrityError (altered/unknown history) or UnavailableError (a
    migration failed — it and its history row rolled back together — or the lock stayed held:
    the message names the holding backend's pid).
    """
    import psycopg
    known = known_migrations()
    applied: list[str] = []
    while True:
        try:
            with conn.transaction():
                conn.execute(f"SET LOCAL lock_timeout = {int(LOCK_WAIT_S * 1000)}")
                conn.execute(ADVISORY_XACT_LOCK, (MIGRATION_LOCK,))
                todo = verify_history(conn, known)
                if not todo:
                    return applied
                m = todo[0]
                try:
                    conn.execute(m.sql)
                    conn.execute(MIGRATION_RECORD, (m.version, m.name, m.checksum))
                except psycopg.Error as e:      # its own lock waits too: a failed migration
                    raise UnavailableError(f"migration {m.version:04d}_{m.name} failed: "
                                           f"{str(e).splitlines()[0]}") from None
        except psycopg.errors.LockNotAvailable:
            raise UnavailableError(f"the migration lock stayed held for {LOCK_WAIT_S:g} s (by {_holder(conn)}); "
                                   "another qlagent may be migrating: retry, or end that session") from None
        applied.append(f"{m.version:04d}_{m.name}")


def _holder(conn: Connection) -> str:
    """Who holds ``MIGRATION_LOCK`` (pg_locks: key split in two 32-bit halves), for the message."""
    key = MIGRATION_LOCK & 0xFFFFFFFFFFFFFFFF
    rows = conn.execute(MIGRATION_LOCK_HOLDERS, (key >> 32, key & 0xFFFFFFFF)).fetchall()
    if not rows:
        return "a backend that has let go since"
    return ", ".join(f"backend pid {pid} ({app or 'no application_name'}, {addr or 'local'}, {state}; "
                     f"SELECT pg_terminate_backend({pid}) ends it)" for pid, app, addr, state in rows)


def check_capabilities(conn: Connection) -> dict[str, int]:
    """Readiness: the declared capabilities; UnavailableError if one this build needs is missing."""
    import psycopg
    try:
        caps = dict(conn.execute(CAPABILITIES).fetchall())
    except psycopg.errors.UndefinedTable:
        caps = {}
    for name, version in REQUIRED_CAPABILITIES.items():
        if caps.get(name, 0) < version:
            raise UnavailableError(f"store capability {name}:{version} is missing (have {caps.get(name)})")
    return caps
