"""Secret use cases: store encrypted, list names, remove. Decryption for a launch is
``dispatch.secrets.resolve_secrets`` (the materialiser's step 4)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:   # ports are annotations only: no Protocol class at run time
    from ..core.ports import CipherFactory, Store



class SecretService:
    """Over the store's SecretStore port and a SecretCipher (``bootstrap.cipher_factory``)."""

    def __init__(self, store: Store, cipher: CipherFactory) -> None:
        self._store = store
        self._cipher = cipher

    def set(self, name: str, value: bytes) -> None:
        """Encrypt and store; only ciphertext reaches the store."""
        box = self._cipher()
        pid = self._store.project.project_id
        self._store.put_secret(pid, name, box.seal(pid, name, value), box.key_id)

    def names(self) -> list[tuple[str, int]]:
        """(name, updated_at_us), by name; never a value."""
        return self._store.secret_names(self._store.project.project_id)

    def remove(self, name: str) -> None:
        """NotFoundError(``secret_not_found``)."""
        self._store.delete_secret(self._store.project.project_id, name)
