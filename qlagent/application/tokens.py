"""API tokens and role bindings (issue 5 §2). A token is printed once; the store keeps only its
SHA-256 digest, so a database copy holds no usable credential."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..core.models import TokenInfo
from ..core.tokens import new_token, token_digest

if TYPE_CHECKING:   # ports are annotations only: no Protocol class at run time
    from ..core.ports import PolicyStore, Store


def create_token(store: PolicyStore, project: str, subject: str, role: str) -> tuple[str, str]:
    """Bind ``role`` for ``subject`` in Project ``project`` (name; created if missing) and mint a
    token for it; returns (token, token ID). The ID names it for ``revoke``."""
    token = new_token()
    return token, store.grant_token(project, subject, role, token_digest(token))


def revoke_token(store: PolicyStore, token_or_id: str) -> str:
    """Revoke by token ID or by the token itself (its digest is looked up); returns the token
    ID, which is what may be shown. NotFoundError."""
    return store.revoke_token(token_id=token_or_id, digest=token_digest(token_or_id))


def list_tokens(store: Store) -> list[TokenInfo]:
    """Tokens of the store's Project (IDs and subjects, never a token)."""
    return store.list_tokens(store.project.project_id)


def set_role(store: Store, subject: str, role: str | None) -> int:
    """Append a new bindingVersion (``None`` revokes) in the store's Project; returns it."""
    return store.bind_role(store.project.project_id, subject, role)
