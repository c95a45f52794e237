"""API tokens and role bindings (issue: HTTP auth). Tokens are printed once, stored as SHA-256."""

from __future__ import annotations

from ..adapters.sqlite import policy
from ..core.tokens import new_token, token_digest
from .store import LocalStore, now_us


def create_token(store: LocalStore, project: str, subject: str, role: str) -> str:
    """Bind ``role`` for ``subject`` and mint a token for it; returns the token (shown once)."""
    token = new_token()

    def tx(c):
        proj = policy.ensure_project(c, project, now_us())
        prev = policy.latest_binding(c, proj.project_id, subject)
        if prev is None or prev.role != role:
            policy.bind_role(c, proj.project_id, subject, role, now_us())
        policy.add_token(c, proj.project_id, subject, token_digest(token), now_us())
    store.write(tx)
    return token


def revoke_token(store: LocalStore, token_id: str) -> None:
    store.write(lambda c: policy.revoke_token(c, token_id, now_us()))


def set_role(store: LocalStore, project: str, subject: str, role: str | None) -> int:
    """Append a new bindingVersion (``None`` revokes); returns it."""
    def tx(c):
        proj = policy.get_project(c, project)
        return policy.bind_role(c, proj.project_id, subject, role, now_us())
    return store.write(tx)
