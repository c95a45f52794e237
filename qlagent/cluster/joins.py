"""Join tokens (issue 26): the control plane's record of each one-line token
(``core.jointoken``) it issues — issued for a Worker with a lifetime, redeemed once by the
Worker whose credential it carries, refused when used, expired or for a removed Worker."""

from __future__ import annotations

from ..core.errors import ValidationError
from ..core.ids import new_id
from ..core.jointoken import MAX_TTL_S, MIN_TTL_S
from ..core.ports import JoinTokenStore
from .registry import check_uuid, credential_digest


class JoinTokens:
    """Join-token policy over a ``core.ports.JoinTokenStore``."""

    def __init__(self, store: JoinTokenStore) -> None:
        self._store = store

    def issue(self, worker_id: str, ttl_s: int) -> tuple[str, int]:
        """(token ID, expiry in µs of the database clock) of a new token for ``worker_id``
        valid ``ttl_s`` seconds (60..604800; ValidationError naming ``--token-ttl``)."""
        if not MIN_TTL_S <= ttl_s <= MAX_TTL_S:
            raise ValidationError("--token-ttl", f"{ttl_s} s is outside {MIN_TTL_S}..{MAX_TTL_S} s",
                                  limit=f"{MIN_TTL_S}..{MAX_TTL_S}")
        token_id = new_id()
        return token_id, self._store.issue(token_id, check_uuid("workerId", worker_id), ttl_s * 1_000_000)

    def redeem(self, worker_id: str, credential: str, token_id: str) -> None:
        """Use the token once. WorkerAuthError unless ``credential`` is this live Worker's;
        ValidationError naming ``tokenId``; NotFoundError ``join_token_not_found``;
        ConflictError ``join_token_used`` / ``join_token_expired``."""
        self._store.redeem(check_uuid("tokenId", token_id), check_uuid("workerId", worker_id),
                           credential_digest(credential))
