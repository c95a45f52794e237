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

    def remove(self, name: str, *, force: bool = False) -> list[str]:
        """Delete ``name``; ConflictError(``secret_in_use``) naming the Tasks that use it unless
        ``force``. Returns the Tasks left referring to it (empty without ``force``)."""
        return self._store.delete_secret(self._store.project.project_id, name, force=force)

    def missing(self) -> list[tuple[str, str]]:
        """(task name, Secret name) of every SecretRef of a live Task whose Secret is not stored."""
        return [(t, n) for t, n, present in self._store.secret_uses(self._store.project.project_id)
                if not present]
