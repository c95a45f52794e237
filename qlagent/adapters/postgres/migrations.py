"""Numbered, checksummed migrations of the cluster authority (mirrors the SQLite migrator).

Files ``migrations/NNNN_name.sql`` are applied in number order, each in its own transaction
together with its ``schema_migrations`` row (version, name, SHA-256 of the file). The whole run
holds ``pg_advisory_lock(MIGRATION_LOCK)``, so N replicas starting together migrate once: the
first applies, the others wait, then find nothing pending. A database whose history names a
migration this build does not know, or whose checksum/name differs, is refused
(StoreIntegrityError) before anything is applied.
"""

from __future__ import annotations

import os

from ...core.canonical import sha256_hex
from ...core.errors import UnavailableError
from ..migration_files import Migration, pending, read_migrations

_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "migrations")
# First 8 bytes of sha256("qlagent:cluster:migrations") as a signed bigint: one fixed lock key.
MIGRATION_LOCK = int.from_bytes(bytes.fromhex(sha256_hex(b"qlagent:cluster:migrations")[:16]), "big", signed=True)
REQUIRED_CAPABILITIES = {"cluster-control-core": 1, "store-ports": 1}


def known_migrations() -> list[Migration]:
    """The migrations shipped with this build, in order."""
    return read_migrations(_DIR)


def verify_history(conn, known: list[Migration]) -> list[Migration]:
    """Check the recorded history against ``known``; return the migrations still to apply.

    Raises StoreIntegrityError naming the first unknown or altered migration.
    """
    conn.execute("""CREATE TABLE IF NOT EXISTS schema_migrations (
        version integer PRIMARY KEY, name text NOT NULL, checksum text NOT NULL,
        applied_at_us bigint NOT NULL)""")
    applied = conn.execute("SELECT version, name, checksum FROM schema_migrations ORDER BY version").fetchall()
    return pending([tuple(r) for r in applied], known)


def migrate(conn) -> list[str]:
    """Under the advisory lock: verify history, apply pending migrations; return names applied.

    ``conn`` must be an autocommit psycopg connection (each migration opens its own transaction).
    Raises StoreIntegrityError (altered/unknown history) or UnavailableError (a migration failed;
    it and its history row rolled back together).
    """
    import psycopg
    conn.execute("SELECT pg_advisory_lock(%s)", (MIGRATION_LOCK,))
    try:
        pending = verify_history(conn, known_migrations())
        applied = []
        for m in pending:
            try:
                with conn.transaction():
                    conn.execute(m.sql)
                    conn.execute("INSERT INTO schema_migrations(version, name, checksum, applied_at_us) "
                                 "VALUES (%s, %s, %s, ql_now_us())", (m.version, m.name, m.checksum))
            except psycopg.Error as e:
                raise UnavailableError(f"migration {m.version:04d}_{m.name} failed: {str(e).splitlines()[0]}") from None
            applied.append(f"{m.version:04d}_{m.name}")
        return applied
    finally:
        conn.execute("SELECT pg_advisory_unlock(%s)", (MIGRATION_LOCK,))


def check_capabilities(conn) -> dict[str, int]:
    """Readiness: the declared capabilities; UnavailableError if one this build needs is missing."""
    import psycopg
    try:
        caps = dict(conn.execute("SELECT name, version FROM capabilities").fetchall())
    except psycopg.errors.UndefinedTable:
        caps = {}
    for name, version in REQUIRED_CAPABILITIES.items():
        if caps.get(name, 0) < version:
            raise UnavailableError(f"store capability {name}:{version} is missing (have {caps.get(name)})")
    return caps
