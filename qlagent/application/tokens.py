"""API tokens and role bindings (issue: HTTP auth). Tokens are printed once, stored as SHA-256."""

from __future__ import annotations

from ..adapters.sqlite import policy
from ..core.tokens import new_token, token_digest
from .store import LocalStore, now_us


def create_token(store: LocalStore, project: str, subject: str, role: str) -> tuple[str, str]:
    """Bind ``role`` for ``subject`` and mint a token for it; returns (token, token ID). The
    token is shown once; the ID names it for ``revoke``."""
    token = new_token()

    def tx(c):
        proj = policy.ensure_project(c, project, now_us())
        prev = policy.latest_binding(c, proj.project_id, subject)
        if prev is None or prev.role != role:
            policy.bind_role(c, proj.project_id, subject, role, now_us())
        return policy.add_token(c, proj.project_id, subject, token_digest(token), now_us())
    return token, store.write(tx)


def revoke_token(store: LocalStore, token_or_id: str) -> None:
    """Revoke by token ID or by the token itself (its digest is looked up)."""
    def tx(c):
        row = c.execute("SELECT token_id FROM api_tokens WHERE token_digest = ?", (token_digest(token_or_id),)).fetchone()
        policy.revoke_token(c, row[0] if row else token_or_id, now_us())
    store.write(tx)


def list_tokens(store: LocalStore) -> list[dict]:
    """Tokens of the current Project: ID, subject, created/revoked µs (never a token)."""
    pid = store.project.project_id
    return store.read(lambda c: [
        {"tokenId": r[0], "subject": r[1], "createdAtUs": r[2], "revokedAtUs": r[3]}
        for r in c.execute("SELECT token_id, subject, created_at_us, revoked_at_us FROM api_tokens "
                           "WHERE project_id = ? ORDER BY created_at_us", (pid,))])


def set_role(store: LocalStore, project: str, subject: str, role: str | None) -> int:
    """Append a new bindingVersion (``None`` revokes); returns it."""
    def tx(c):
        proj = policy.get_project(c, project)
        return policy.bind_role(c, proj.project_id, subject, role, now_us())
    return store.write(tx)
