"""Secret rows: names and ciphertext only (plaintext never reaches SQLite)."""

from __future__ import annotations

import sqlite3

import msgspec

from ...core.errors import ConflictError, NotFoundError


def put_secret(conn: sqlite3.Connection, project_id: str, name: str, ciphertext: bytes, key_id: str,
               now_us: int) -> None:
    conn.execute("INSERT INTO secrets VALUES (?, ?, ?, ?, ?) ON CONFLICT(project_id, name) DO UPDATE SET "
                 "ciphertext = excluded.ciphertext, key_id = excluded.key_id, updated_at_us = excluded.updated_at_us",
                 (project_id, name, ciphertext, key_id, now_us))


def secret_names(conn: sqlite3.Connection, project_id: str) -> list[tuple[str, int]]:
    """(name, updated_at_us) pairs, by name."""
    return [(r[0], r[1]) for r in conn.execute(
        "SELECT name, updated_at_us FROM secrets WHERE project_id = ? ORDER BY name", (project_id,))]


def delete_secret(conn: sqlite3.Connection, project_id: str, name: str, *, force: bool = False) -> list[str]:
    """Delete Secret ``name``; returns the live Tasks that still refer to it (their Runs will
    fail ``secret_missing:NAME``). Without ``force`` a used Secret is refused (ConflictError
    naming the Tasks, nothing deleted); NotFoundError if it does not exist."""
    users = [t for t, n, _ in secret_uses(conn, project_id) if n == name]
    if users and not force:
        raise ConflictError(f"secret {name!r} is used by task(s) {', '.join(users)}; edit them first, "
                            "or pass --force to remove it anyway (their runs then fail secret_missing)",
                            code="secret_in_use", field="name")
    if conn.execute("DELETE FROM secrets WHERE project_id = ? AND name = ?", (project_id, name)).rowcount == 0:
        raise NotFoundError(f"secret {name!r} does not exist", code="secret_not_found")
    return users


def ciphertexts(conn: sqlite3.Connection, project_id: str, names: list[str]) -> dict[str, bytes]:
    """Ciphertext of each present name (missing names are simply absent)."""
    if not names:
        return {}
    marks = ",".join("?" * len(names))
    return {r[0]: r[1] for r in conn.execute(
        f"SELECT name, ciphertext FROM secrets WHERE project_id = ? AND name IN ({marks})", (project_id, *names))}


def secret_uses(conn: sqlite3.Connection, project_id: str | None) -> list[tuple[str, str, bool]]:
    """(task name, Secret name, stored?) for each SecretRef of each live Task head of the
    Project (every Project when None), by task then Secret name (names only: a recipe never
    holds a value)."""
    # Tuples, not the connection's row objects: an sqlite3.Row never equals a tuple.
    stored = {(r[0], r[1]) for r in conn.execute("SELECT project_id, name FROM secrets")}
    out = []
    for pid, task, doc in conn.execute(
            "SELECT t.project_id, t.name, cr.recipe_json FROM tasks t JOIN execution_revisions e "
            "ON e.task_id = t.task_id AND e.revision = t.head_revision "
            "JOIN context_recipes cr ON cr.recipe_ref = e.recipe_ref "
            "WHERE (?1 IS NULL OR t.project_id = ?1) AND t.deleted_at_us IS NULL ORDER BY t.name", (project_id,)):
        for name in sorted(set(msgspec.json.decode(doc).get("secretRefs", {}).values())):
            out.append((task, name, (pid, name) in stored))
    return out


def legacy_ciphertexts(conn: sqlite3.Connection, magic: bytes) -> list[tuple[str, str, bytes]]:
    """(project_id, name, ciphertext) of every row whose ciphertext starts with ``magic``."""
    return [(r[0], r[1], bytes(r[2])) for r in conn.execute(
        "SELECT project_id, name, ciphertext FROM secrets WHERE substr(ciphertext, 1, ?) = ? ORDER BY project_id, name",
        (len(magic), magic))]


def replace_ciphertext(conn: sqlite3.Connection, project_id: str, name: str, old: bytes, new: bytes,
                       key_id: str) -> bool:
    """Swap ``old`` for ``new`` (same value, re-encrypted) unless the row changed meanwhile;
    ``updated_at_us`` stays: the value is the one the operator set then. True if swapped."""
    return conn.execute("UPDATE secrets SET ciphertext = ?, key_id = ? WHERE project_id = ? AND name = ? "
                        "AND ciphertext = ?", (new, key_id, project_id, name, old)).rowcount == 1
