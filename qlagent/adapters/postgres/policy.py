"""Projects, RoleBindings and API tokens on the cluster authority (ADR-0376 §2 Policy fence);
the PostgreSQL twin of ``adapters.sqlite.policy``. Functions take a dict-row cursor inside the
caller's transaction."""

from __future__ import annotations

from ...core.definitions import check_project_name
from ...core.errors import ConflictError, NotFoundError, ValidationError
from ...core.ids import new_id
from ...core.models import LOCAL_SUBJECT, ROLES, Project, RoleBinding, TokenInfo


def _project(row: dict) -> Project:
    return Project(project_id=row["project_id"], name=row["name"], project_version=row["project_version"],
                   active=bool(row["active"]))


def ensure_project(cur, name: str, now_us: int, project_id: str | None = None) -> Project:
    """Project ``name``, created with ``local:cli`` as owner if missing. ValidationError for a bad name.
    ``project_id``: the ID to create it with (as ``adapters.sqlite.policy.ensure_project``);
    ConflictError ``project_created_concurrently`` if ``name`` exists under another ID."""
    row = cur.execute("SELECT * FROM projects WHERE name = %s", (name,)).fetchone()
    if row is not None and project_id is not None and row["project_id"] != project_id:
        raise _created_concurrently(name)
    if row is None:
        check_project_name(name)
        pid = project_id or new_id()
        cur.execute("INSERT INTO projects(project_id, name, project_version, active, created_at_us) "
                    "VALUES (%s, %s, 1, true, %s)", (pid, name, now_us))
        cur.execute("INSERT INTO role_bindings VALUES (%s, %s, %s, 'owner', 1, true, %s)",
                    (new_id(), pid, LOCAL_SUBJECT, now_us))
        row = cur.execute("SELECT * FROM projects WHERE project_id = %s", (pid,)).fetchone()
    return _project(row)


def get_project(cur, name_or_id: str, *, lock: bool = False) -> Project:
    """Project by name or ID (``lock``: FOR SHARE, ADR-0376 §2 step 1); NotFoundError ``project_not_found``."""
    row = cur.execute("SELECT * FROM projects WHERE name = %s OR project_id = %s" + (" FOR SHARE" if lock else ""),
                      (name_or_id, name_or_id)).fetchone()
    if row is None:
        raise NotFoundError(f"project {name_or_id!r} does not exist", code="project_not_found")
    return _project(row)


def latest_binding(cur, project_id: str, subject: str) -> RoleBinding | None:
    """The subject's latest RoleBinding if it is active, else None (ADR-0376 §2 step 2)."""
    row = cur.execute("SELECT role, binding_version, active FROM role_bindings WHERE project_id = %s "
                      "AND subject = %s ORDER BY binding_version DESC LIMIT 1", (project_id, subject)).fetchone()
    if row is None or not row["active"]:
        return None
    return RoleBinding(project_id=project_id, subject=subject, role=row["role"],
                       binding_version=row["binding_version"])


def bind_role(cur, project_id: str, subject: str, role: str | None, now_us: int) -> int:
    """Append bindingVersion+1 for ``subject`` (``role=None`` revokes); returns it."""
    if role is not None and role not in ROLES:
        raise ValidationError("role", f"{role!r} is not one of {list(ROLES)}")
    if not subject or len(subject) > 128:
        raise ValidationError("subject", "must be 1..128 characters", limit=128)
    prev = cur.execute("SELECT role, binding_version FROM role_bindings WHERE project_id = %s AND subject = %s "
                       "ORDER BY binding_version DESC LIMIT 1", (project_id, subject)).fetchone()
    version = (prev["binding_version"] if prev else 0) + 1
    cur.execute("INSERT INTO role_bindings VALUES (%s, %s, %s, %s, %s, %s, %s)",
                (new_id(), project_id, subject, role or (prev["role"] if prev else "viewer"), version,
                 role is not None, now_us))
    return version


def add_token(cur, project_id: str, subject: str, digest: str, now_us: int) -> str:
    """Store a bearer token's SHA-256 digest; returns the token ID (a duplicate digest is a
    unique violation: the caller's transaction retries and finds it)."""
    tid = new_id()
    cur.execute("INSERT INTO api_tokens VALUES (%s, %s, %s, %s, %s, NULL)", (digest, tid, project_id, subject, now_us))
    return tid


def revoke_token(cur, token_id: str, now_us: int) -> None:
    """Revoke by ID (idempotent); NotFoundError ``token_not_found``."""
    if cur.execute("UPDATE api_tokens SET revoked_at_us = coalesce(revoked_at_us, %s) WHERE token_id = %s",
                   (now_us, token_id)).rowcount == 0:
        raise NotFoundError(f"token {token_id} does not exist", code="token_not_found")


def lookup_token(cur, digest: str) -> tuple[str, str] | None:
    row = cur.execute("SELECT project_id, subject FROM api_tokens WHERE token_digest = %s AND revoked_at_us IS NULL",
                      (digest,)).fetchone()
    return (row["project_id"], row["subject"]) if row else None


def token_id_of(cur, digest: str) -> str | None:
    row = cur.execute("SELECT token_id FROM api_tokens WHERE token_digest = %s", (digest,)).fetchone()
    return row["token_id"] if row else None


def list_tokens(cur, project_id: str) -> list[TokenInfo]:
    return [TokenInfo(token_id=r["token_id"], subject=r["subject"], created_at_us=r["created_at_us"],
                      revoked_at_us=r["revoked_at_us"]) for r in cur.execute(
        "SELECT token_id, subject, created_at_us, revoked_at_us FROM api_tokens WHERE project_id = %s "
        "ORDER BY created_at_us, seq", (project_id,))]


def _created_concurrently(name: str) -> ConflictError:
    # The caller already sealed/derived rows with the ID it was handed: it must not land them
    # under another Project's ID; a re-run finds the Project and acts in it.
    return ConflictError(f"project {name!r} was created by another command meanwhile; retry",
                         code="project_created_concurrently")
