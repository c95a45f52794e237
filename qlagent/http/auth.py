"""Bearer tokens and the run/read permission table (issue 5 §2, ADR-0376 §2 Policy fence).

Tokens look like ``qlt_`` + ``secrets.token_urlsafe(32)``; only ``token_digest(token)`` (SHA-256
hex) is stored. The store implements ``core.ports.TokenPort``; this module never touches storage.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Mapping

from qlagent.core.models import ROLES, START_ROLES, RoleBinding
from qlagent.core.tokens import token_digest
from qlagent.http.wire import HttpError

if TYPE_CHECKING:   # ports are annotations only: no Protocol class at run time
    from qlagent.core.ports import TokenPort

_TOKEN_RE = re.compile(r"qlt_[A-Za-z0-9_-]{43}")

READ_ROLES = frozenset(ROLES)
PERMISSIONS: Mapping[str, frozenset[str]] = {
    "run.start": START_ROLES,
    "run.cancel": START_ROLES,
    "task.read": READ_ROLES,
    "run.read": READ_ROLES,
    "log.read": READ_ROLES,
}


class AuthError(HttpError):
    """Authentication/authorisation failure, answered by the server as JSON when a route lets
    it propagate: ``status`` 401 ``unauthorized`` (with ``WWW-Authenticate: Bearer``), 403
    ``permission_denied`` or 404 ``not_found`` (another Project's resources are not revealed)."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(status, code, message,
                         [("WWW-Authenticate", "Bearer")] if status == 401 else None)


@dataclass(frozen=True, slots=True)
class Principal:
    """An authenticated subject with the RoleBinding read at admission; ``binding_version``
    is the Policy fence re-checked inside the Task Start transaction (ADR-0376 §2)."""

    project_id: str
    subject: str
    role: str
    binding_version: int


def parse_bearer(header: str | None) -> str:
    """Token from an ``Authorization: Bearer <token>`` value. Raises AuthError 401 when the
    header is missing, uses another scheme, or the token is not ``qlt_`` + 43 characters."""
    if not header:
        raise AuthError(401, "unauthorized", "missing Authorization: Bearer token")
    scheme, _, token = header.strip().partition(" ")
    if scheme.lower() != "bearer":
        raise AuthError(401, "unauthorized", "Authorization scheme must be Bearer")
    token = token.strip()
    if not _TOKEN_RE.fullmatch(token):
        raise AuthError(401, "unauthorized", "malformed bearer token")
    return token


def allowed(role: str, permission: str) -> bool:
    """True when ``role`` grants ``permission``. Raises KeyError for an unknown permission."""
    return role in PERMISSIONS[permission]


def bearer_digest(headers: Mapping[str, str], permission: str) -> str:
    """SHA-256 hex of the request's bearer token (``parse_bearer``: AuthError 401). KeyError for
    an unknown ``permission``."""
    if permission not in PERMISSIONS:
        raise KeyError(permission)
    return token_digest(parse_bearer(headers.get("authorization")))


def judge(found: tuple[str, str] | None, binding: RoleBinding | None, project_id: str,
          permission: str) -> Principal:
    """The Principal of a live token ``found`` ((project_id, subject), None: unknown or revoked)
    whose subject has ``binding`` (its latest active one in ``project_id``, else None), acting in
    ``project_id``. Raises AuthError: 401 (no such token), 404 (token of another Project, so a
    foreign Project's existence is not confirmed), 403 (no active RoleBinding or its role lacks
    ``permission``), in that order."""
    if found is None:
        raise AuthError(401, "unauthorized", "unknown or revoked token")
    token_project, subject = found
    if token_project != project_id:
        raise AuthError(404, "not_found", "not found in this project")
    if binding is None:
        raise AuthError(403, "permission_denied", f"no active role binding grants {permission}")
    if not allowed(binding.role, permission):
        raise AuthError(403, "permission_denied", f"role {binding.role!r} does not grant {permission}")
    return Principal(project_id, subject, binding.role, binding.binding_version)


def authorize(headers: Mapping[str, str], port: TokenPort, project_id: str, permission: str) -> Principal:
    """Authenticate the request headers and check ``permission`` in ``project_id`` over the
    port's two lookups (the binding read only for a token of ``project_id``). Raises AuthError
    as ``judge``."""
    found = port.lookup_token(bearer_digest(headers, permission))
    binding = port.latest_binding(project_id, found[1]) if found is not None and found[0] == project_id else None
    return judge(found, binding, project_id, permission)
