"""Projects, RoleBindings and API tokens in the local store (ADR-0376 §2 Policy fence)."""

from __future__ import annotations

import sqlite3

from ...core.definitions import check_project_name
from ...core.errors import ConflictError, NotFoundError, ValidationError
from ...core.ids import new_id
from ...core.models import LOCAL_SUBJECT, ROLES, Project, RoleBinding, TokenInfo


def ensure_project(conn: sqlite3.Connection, name: str, now_us: int, project_id: str | None = None) -> Project:
    """Return Project ``name``, creating it (with ``local:cli`` as owner) if missing. Write txn.
    ``project_id``: the ID to create it with (a store that deferred the creation to its first
    write has handed that ID out already); ConflictError ``project_created_concurrently`` if
    ``name`` exists meanwhile under another ID. Raises ValidationError for a malformed name."""
    row = conn.execute("SELECT * FROM projects WHERE name = ?", (name,)).fetchone()
    if row is not None and project_id is not None and row["project_id"] != project_id:
        raise _created_concurrently(name)
    if row is None:
        check_project_name(name)
        pid = project_id or new_id()
        conn.execute("INSERT INTO projects(project_id, name, project_version, active, created_at_us) "
                     "VALUES (?, ?, 1, 1, ?)", (pid, name, now_us))
        conn.execute("INSERT INTO role_bindings VALUES (?, ?, ?, 'owner', 1, 1, ?)",
                     (new_id(), pid, LOCAL_SUBJECT, now_us))
        row = conn.execute("SELECT * FROM projects WHERE project_id = ?", (pid,)).fetchone()
    return _project(row)


def _project(row) -> Project:
    return Project(project_id=row["project_id"], name=row["name"],
                   project_version=row["project_version"], active=bool(row["active"]))


def get_project(conn: sqlite3.Connection, name_or_id: str) -> Project:
    """Project by name or ID; raises NotFoundError."""
    row = conn.execute("SELECT * FROM projects WHERE name = ? OR project_id = ?",
                       (name_or_id, name_or_id)).fetchone()
    if row is None:
        raise NotFoundError(f"project {name_or_id!r} does not exist", code="project_not_found")
    return _project(row)


def latest_binding(conn: sqlite3.Connection, project_id: str, subject: str) -> RoleBinding | None:
    """The subject's latest active RoleBinding in the Project, or None (ADR-0376 §2 step 2)."""
    row = conn.execute(
        "SELECT * FROM role_bindings WHERE project_id = ? AND subject = ? "
        "ORDER BY binding_version DESC LIMIT 1", (project_id, subject)).fetchone()
    if row is None or not row["active"]:
        return None
    return RoleBinding(project_id=project_id, subject=subject, role=row["role"],
                       binding_version=row["binding_version"])


def bind_role(conn: sqlite3.Connection, project_id: str, subject: str, role: str | None, now_us: int) -> int:
    """Append a new bindingVersion for ``subject`` (``role=None`` revokes). Returns the version."""
    if role is not None and role not in ROLES:
        raise ValidationError("role", f"{role!r} is not one of {list(ROLES)}")
    if not subject or len(subject) > 128:
        raise ValidationError("subject", "must be 1..128 characters", limit=128)
    cur = conn.execute("SELECT coalesce(max(binding_version), 0) FROM role_bindings "
                       "WHERE project_id = ? AND subject = ?", (project_id, subject)).fetchone()[0]
    prev = latest_binding(conn, project_id, subject)
    conn.execute("INSERT INTO role_bindings VALUES (?, ?, ?, ?, ?, ?, ?)",
                 (new_id(), project_id, subject, role or (prev.role if prev else "viewer"),
                  cur + 1, 0 if role is None else 1, now_us))
    return cur + 1


def add_token(conn: sqlite3.Connection, project_id: str, subject: str, digest: str, now_us: int) -> str:
    """Store a bearer token's SHA-256 digest for ``subject``; returns the token ID."""
    tid = new_id()
    try:
        conn.execute("INSERT INTO api_tokens VALUES (?, ?, ?, ?, ?, NULL)", (digest, tid, project_id, subject, now_us))
    except sqlite3.IntegrityError:
        raise ConflictError("token digest already stored") from None
    return tid


def revoke_token(conn: sqlite3.Connection, token_id: str, now_us: int) -> None:
    """Revoke a token by ID (idempotent); NotFoundError if unknown."""
    if conn.execute("UPDATE api_tokens SET revoked_at_us = coalesce(revoked_at_us, ?) WHERE token_id = ?",
                    (now_us, token_id)).rowcount == 0:
        raise NotFoundError(f"token {token_id} does not exist", code="token_not_found")


def lookup_token(conn: sqlite3.Connection, digest: str) -> tuple[str, str] | None:
    """(project_id, subject) of a live token digest, else None."""
    row = conn.execute("SELECT project_id, subject FROM api_tokens WHERE token_digest = ? AND revoked_at_us IS NULL",
                       (digest,)).fetchone()
    return (row[0], row[1]) if row else None


def token_id_of(conn: sqlite3.Connection, digest: str) -> str | None:
    """The ID of the token with this SHA-256 hex digest, else None."""
    row = conn.execute("SELECT token_id FROM api_tokens WHERE token_digest = ?", (digest,)).fetchone()
    return row[0] if row else None


def list_tokens(conn: sqlite3.Connection, project_id: str) -> list[TokenInfo]:
    """Tokens of the Project, oldest first (IDs only, never a token)."""
    return [TokenInfo(token_id=r[0], subject=r[1], created_at_us=r[2], revoked_at_us=r[3]) for r in conn.execute(
        "SELECT token_id, subject, created_at_us, revoked_at_us FROM api_tokens WHERE project_id = ? "
        "ORDER BY created_at_us", (project_id,))]


def _created_concurrently(name: str) -> ConflictError:
    # The caller already sealed/derived rows with the ID it was handed: it must not land them
    # under another Project's ID; a re-run finds the Project and acts in it.
    return ConflictError(f"project {name!r} was created by another command meanwhile; retry",
                         code="project_created_concurrently")
