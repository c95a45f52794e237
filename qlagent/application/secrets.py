"""Secret use cases: store encrypted, list names, remove, re-encrypt what an earlier version
stored. Decryption for a launch is ``dispatch.secrets.resolve_secrets`` (the materialiser's step 4)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..core.errors import UnavailableError

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


def migrate_legacy_secrets(store: Store, cipher: CipherFactory, legacy_magic: bytes) -> tuple[int, list[str]]:
    """Re-encrypt every Secret still in an earlier format (ciphertext starting ``legacy_magic``,
    ``qlsb1`` AES-GCM) in today's, in every Project of the store (issue 14: stores migrate on
    upgrade). Returns (rows re-encrypted, one problem line per row left as it was: wrong key
    file, or ``cryptography`` not installed). With no legacy row it opens no cipher. A row
    changed meanwhile (``secret set``) keeps its new value (compare-and-set on the ciphertext)."""
    legacy = store.legacy_ciphertexts(legacy_magic)
    if not legacy:
        return 0, []
    try:
        box = cipher()
    except UnavailableError as e:
        return 0, [str(e)]
    done, problems = [], []
    for project_id, name, old in legacy:
        try:
            done.append((project_id, name, old, box.seal(project_id, name, box.open(project_id, name, old))))
        except UnavailableError as e:
            problems.append(str(e))
    return (store.replace_ciphertexts(done, box.key_id) if done else 0), problems
