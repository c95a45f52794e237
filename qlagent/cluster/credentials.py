"""``workers rotate-credential NAME`` (issue 26): a lost or leaked Worker credential is replaced
for the same Worker ID — the router's ``worker_id`` stays, only its credential file changes,
and the old credential is refused from the next request on."""

from __future__ import annotations

from ..core.ports import CredentialStore
from .registry import check_name, credential_digest, new_credential


def rotate_credential(store: CredentialStore, name: str) -> tuple[str, str]:
    """(Worker ID, new credential) of the live Worker ``name``; the credential is shown once
    (only its SHA-256 is stored). ValidationError for a name no Worker can have, NotFoundError
    ``worker_not_found``."""
    credential = new_credential()
    return store.replace(check_name(name), credential_digest(credential)), credential
