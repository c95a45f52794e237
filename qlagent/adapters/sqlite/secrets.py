"""Secret rows: names and ciphertext only (plaintext never reaches SQLite)."""

from __future__ import annotations

import sqlite3

from ...core.errors import NotFoundError


def put_secret(conn: sqlite3.Connection, project_id: str, name: str, ciphertext: bytes, key_id: str,
               now_us: int) -> None:
    conn.execute("INSERT INTO secrets VALUES (?, ?, ?, ?, ?) ON CONFLICT(project_id, name) DO UPDATE SET "
                 "ciphertext = excluded.ciphertext, key_id = excluded.key_id, updated_at_us = excluded.updated_at_us",
                 (project_id, name, ciphertext, key_id, now_us))


def list_secret_names(conn: sqlite3.Connection, project_id: str) -> list[tuple[str, int]]:
    """(name, updated_at_us) pairs, by name."""
    return [(r[0], r[1]) for r in conn.execute(
        "SELECT name, updated_at_us FROM secrets WHERE project_id = ? ORDER BY name", (project_id,))]


def delete_secret(conn: sqlite3.Connection, project_id: str, name: str) -> None:
    if conn.execute("DELETE FROM secrets WHERE project_id = ? AND name = ?", (project_id, name)).rowcount == 0:
        raise NotFoundError(f"secret {name!r} does not exist", code="secret_not_found")


def get_ciphertexts(conn: sqlite3.Connection, project_id: str, names: list[str]) -> dict[str, bytes]:
    """Ciphertext of each present name (missing names are simply absent)."""
    if not names:
        return {}
    marks = ",".join("?" * len(names))
    return {r[0]: r[1] for r in conn.execute(
        f"SELECT name, ciphertext FROM secrets WHERE project_id = ? AND name IN ({marks})", (project_id, *names))}
