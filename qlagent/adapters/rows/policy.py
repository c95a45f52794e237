"""Projects, RoleBindings and API tokens (ADR-0376 §2 Policy fence), on either store: every
function takes the ``rows.dialect.Db`` of the caller's transaction."""

from __future__ import annotations

from ...core.definitions import check_project_name
from ...core.errors import ConflictError, NotFoundError, ValidationError
from ...core.ids import new_id
from ...core.text import check_text, quote_bounded
from ...core.tokens import TOKEN_PREFIX
from ...core.models import LOCAL_SUBJECT, ROLES, Admission, Project, RoleBinding, TokenInfo
from .dialect import Db


def _project(row) -> Project:
    return Project(project_id=row["project_id"], name=row["name"], project_version=row["project_version"],
                   active=bool(row["active"]))


def ensure_project(db: Db, name: str, now_us: int, project_id: str | None = None) -> Project:
    """Project ``name``, created with ``local:cli`` as owner if missing. Write transaction.
    ``project_id``: the ID to create it with (a store that deferred the creation to its first
    write has handed that ID out already); ConflictError ``project_created_concurrently`` if
    ``name`` exists meanwhile under another ID. ValidationError for a malformed name."""
    row = db.one("PROJECT_BY_NAME", (name,))
    if row is not None and project_id is not None and row["project_id"] != project_id:
        raise _created_concurrently(name)
    if row is None:
        check_project_name(name)
        pid = project_id or new_id()
        db.run("PROJECT_INSERT", (pid, name, True, now_us))
        db.run("BINDING_INSERT", (new_id(), pid, LOCAL_SUBJECT, "owner", 1, True, now_us))
        row = db.one("PROJECT_BY_ID", (pid,))
    return _project(row)


def get_project(db: Db, name_or_id: str, *, lock: bool = False) -> Project:
    """Project by name or ID (``lock``: held against change until the transaction ends,
    ADR-0376 §2 step 1); NotFoundError ``project_not_found``."""
    row = db.one("PROJECT_BY_NAME_OR_ID_FOR_SHARE" if lock else "PROJECT_BY_NAME_OR_ID", (name_or_id, name_or_id))
    if row is None:
        raise NotFoundError(f"project {name_or_id!r} does not exist", code="project_not_found")
    return _project(row)


def admission(db: Db, project: str, digest: str) -> Admission:
    """``core.ports.PolicyStore.admission`` in one statement (``ADMISSION``, each dialect's own):
    the Project by name or ID, the live token with this digest, its subject's latest binding in
    the token's Project when that binding is active."""
    row = db.one("ADMISSION", (project, project, digest))
    proj = _project(row) if row["project_id"] is not None else None
    token = (row["token_project"], row["subject"]) if row["token_project"] is not None else None
    binding = None
    if token is not None and row["role"] is not None and row["binding_active"]:
        binding = RoleBinding(project_id=token[0], subject=token[1], role=row["role"],
                              binding_version=row["binding_version"])
    return Admission(project=proj, token=token, binding=binding)


def latest_binding(db: Db, project_id: str, subject: str) -> RoleBinding | None:
    """The subject's latest RoleBinding if it is active, else None (ADR-0376 §2 step 2)."""
    row = db.one("BINDING_LATEST", (project_id, subject))
    if row is None or not row["active"]:
        return None
    return RoleBinding(project_id=project_id, subject=subject, role=row["role"],
                       binding_version=row["binding_version"])


def check_subject(subject: str) -> None:
    """ValidationError ``subject`` unless 1..128 characters without a control character."""
    if not subject or len(subject) > 128:
        raise ValidationError("subject", "must be 1..128 characters", limit=128)
    check_text("subject", subject)


def bind_role(db: Db, project_id: str, subject: str, role: str | None, now_us: int) -> int:
    """Append bindingVersion+1 for ``subject`` (``role=None`` revokes, keeping the last role);
    returns it. ValidationError for an unknown role or a subject outside 1..128 characters."""
    if role is not None and role not in ROLES:
        raise ValidationError("role", f"{role!r} is not one of {list(ROLES)}")
    check_subject(subject)
    prev = db.one("BINDING_LATEST", (project_id, subject))
    version = (prev["binding_version"] if prev else 0) + 1
    db.run("BINDING_INSERT", (new_id(), project_id, subject, role or (prev["role"] if prev else "viewer"), version,
                              role is not None, now_us))
    return version


def add_token(db: Db, project_id: str, subject: str, digest: str, now_us: int) -> str:
    """Store a bearer token's SHA-256 digest for ``subject``; returns the token ID. A digest
    stored already is ConflictError where the dialect names its duplicate-key error (SQLite);
    PostgreSQL's transaction re-runs on it instead."""
    tid = new_id()
    try:
        db.run("TOKEN_INSERT", (digest, tid, project_id, subject, now_us))
    except db.dialect.duplicate_key:
        raise ConflictError("token digest already stored") from None
    return tid


def revoke_token(db: Db, token_id: str, now_us: int) -> None:
    """Revoke a token by ID (idempotent); NotFoundError ``token_not_found``."""
    if db.run("TOKEN_REVOKE", (now_us, token_id)).rowcount == 0:
        # A mistyped token is still most of a credential: never echoed.
        what = "the token given" if token_id.startswith(TOKEN_PREFIX) else f"token {quote_bounded(token_id)}"
        raise NotFoundError(f"{what} does not exist", code="token_not_found")


def lookup_token(db: Db, digest: str) -> tuple[str, str] | None:
    """(project_id, subject) of a live token digest, else None."""
    row = db.one("TOKEN_LIVE", (digest,))
    return (row["project_id"], row["subject"]) if row else None


def token_id_of(db: Db, digest: str) -> str | None:
    """The ID of the token with this SHA-256 hex digest, else None."""
    row = db.one("TOKEN_ID_OF_DIGEST", (digest,))
    return row["token_id"] if row else None


def list_tokens(db: Db, project_id: str) -> list[TokenInfo]:
    """Tokens of the Project, oldest first (IDs only, never a token)."""
    return [TokenInfo(token_id=r["token_id"], subject=r["subject"], created_at_us=r["created_at_us"],
                      revoked_at_us=r["revoked_at_us"]) for r in db.all("TOKENS_OF_PROJECT", (project_id,))]


def _created_concurrently(name: str) -> ConflictError:
    # The caller already sealed/derived rows with the ID it was handed: it must not land them
    # under another Project's ID; a re-run finds the Project and acts in it.
    return ConflictError(f"project {name!r} was created by another command meanwhile; retry",
                         code="project_created_concurrently")
