"""Numbered, checksummed migrations of the local store (ADR-0071 §2).

Files ``migrations/NNNN_name.sql`` (the Worker's inbox file: ``inbox_migrations/``, ``inbox``)
are applied in number order, each inside its own ``BEGIN IMMEDIATE`` transaction together with
its row in ``schema_migrations`` (version, name, SHA-256 of the file). Start-up refuses a database whose history names a migration this build
does not know or whose checksum differs: that database was written by another build or edited.
Capabilities are declared by their own migration after the DDL they depend on is durable
(ADR-0071 §2 "DDL 与 capability 分步").
"""

from __future__ import annotations

import os
import sqlite3
import time

from ...core.errors import UnavailableError
from ..migration_files import Migration, pending, read_migrations
from .migration_queries import (CAPABILITIES, MIGRATION_APPLY, MIGRATION_RECORD, MIGRATIONS_APPLIED,
                               MIGRATIONS_TABLE_CREATE)

_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "migrations")

# Readiness: the capabilities this build needs before it may dispatch (ADR-0071 §2).
REQUIRED_CAPABILITIES = {"local-control-core": 3, "local_dispatch_plan": 1}


def known_migrations() -> list[Migration]:
    """The migrations shipped with this build, in version order."""
    return read_migrations(_DIR)


def _history(conn: sqlite3.Connection) -> list[tuple[int, str, str]]:
    conn.execute(MIGRATIONS_TABLE_CREATE)
    return [tuple(r) for r in conn.execute(MIGRATIONS_APPLIED)]


def verify_history(conn: sqlite3.Connection, known: list[Migration]) -> list[Migration]:
    """Check the recorded history against ``known``; return the migrations still to apply.

    Raises StoreIntegrityError naming the first unknown or altered migration.
    """
    return pending(_history(conn), known)


def migrate(conn: sqlite3.Connection, known: list[Migration] | None = None) -> list[str]:
    """Verify history, then apply pending migrations in order; return the names applied.
    ``known``: the migrations of another file of this build (the Worker's inbox), else the
    store's. Each migration and its history row commit together or not at all.
    """
    pending = verify_history(conn, known_migrations() if known is None else known)
    applied = []
    for m in pending:
        try:
            conn.executescript(MIGRATION_APPLY.format(sql=m.sql, version=m.version, name=m.name, checksum=m.checksum,
                                                      applied_at_us=time.time_ns() // 1000))
        except sqlite3.Error as e:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise UnavailableError(f"migration {m.version:04d}_{m.name} failed: {e}") from None
        applied.append(f"{m.version:04d}_{m.name}")
    return applied


def adopt_history(conn: sqlite3.Connection, done: list[Migration]) -> None:
    """Record ``done`` as applied, in one transaction: a file whose schema this build once
    created or changed in place, without migration files, already has what they make."""
    _history(conn)
    conn.execute("BEGIN IMMEDIATE")
    try:
        conn.executemany(MIGRATION_RECORD, [(m.version, m.name, m.checksum, time.time_ns() // 1000) for m in done])
        conn.execute("COMMIT")
    except BaseException:
        conn.execute("ROLLBACK")
        raise


def check_capabilities(conn: sqlite3.Connection) -> dict[str, int]:
    """Readiness: return the declared capabilities; raise UnavailableError if one is missing."""
    try:
        caps = {r[0]: r[1] for r in conn.execute(CAPABILITIES)}
    except sqlite3.OperationalError:
        caps = {}
    for name, version in REQUIRED_CAPABILITIES.items():
        if caps.get(name, 0) < version:
            raise UnavailableError(f"store capability {name}:{version} is missing (have {caps.get(name)})")
    return caps
