"""Secret use cases: store encrypted, list names, remove, resolve for one materialisation, and
re-encrypt what an earlier version stored."""

from __future__ import annotations

from ..adapters.secretbox import LEGACY_MAGIC, SecretBox
from ..adapters.sqlite import secrets as rows
from ..core.errors import UnavailableError
from .store import LocalStore, now_us


class SecretService:
    def __init__(self, store: LocalStore, key_file: str) -> None:
        self._store = store
        self._key_file = key_file

    def set(self, name: str, value: bytes) -> None:
        """Encrypt and store; only ciphertext reaches the database."""
        box = SecretBox(self._key_file)
        pid = self._store.project.project_id
        blob = box.seal(pid, name, value)
        self._store.write(lambda c: rows.put_secret(c, pid, name, blob, box.key_id, now_us()))

    def names(self) -> list[tuple[str, int]]:
        pid = self._store.project.project_id
        return self._store.read(lambda c: rows.list_secret_names(c, pid))

    def remove(self, name: str, *, force: bool = False) -> list[str]:
        """Delete ``name``; ConflictError naming the Tasks that use it unless ``force``.
        Returns the Tasks left referring to it (empty without ``force``)."""
        pid = self._store.project.project_id
        return self._store.write(lambda c: rows.delete_secret(c, pid, name, force=force))

    def missing(self) -> list[tuple[str, str]]:
        """(task name, Secret name) of every SecretRef of a live Task whose Secret is not stored."""
        pid = self._store.project.project_id
        return [(t, n) for t, n, present in self._store.read(lambda c: rows.secret_uses(c, pid)) if not present]


def resolve_secrets(conn, key_file: str, project_id: str, names: list[str]) -> dict[str, bytes]:
    """Decrypt the de-duplicated SecretRefs ``names`` for one launch (ADR-0071 §4 step 4).

    Raises UnavailableError(code="secret_missing", field=the name) naming the first missing Secret; the
    plaintext returned must live only in the caller's stack.
    """
    wanted = sorted(set(names))
    blobs = rows.get_ciphertexts(conn, project_id, wanted)
    missing = [n for n in wanted if n not in blobs]
    if missing:
        raise UnavailableError(f"secret {missing[0]!r} is not set", code="secret_missing", field=missing[0])
    if not wanted:
        return {}
    box = SecretBox(key_file)
    return {n: box.open(project_id, n, blobs[n]) for n in wanted}


def migrate_legacy_secrets(store: LocalStore, key_file: str) -> tuple[int, list[str]]:
    """Re-encrypt every Secret still in the ``qlsb1`` (AES-GCM) format in today's format, in
    every Project of the store (issue 14: existing stores migrate on upgrade).

    Returns (rows re-encrypted, one problem line per row left as it was: wrong key file, or
    ``cryptography`` not installed). With no legacy row it reads neither the key file nor any
    crypto library. A row changed meanwhile (``secret set``) is left to its new value.
    """
    legacy = store.read(lambda c: rows.legacy_ciphertexts(c, LEGACY_MAGIC))
    if not legacy:
        return 0, []
    try:
        box = SecretBox(key_file)
    except UnavailableError as e:
        return 0, [str(e)]
    done, problems = [], []
    for project_id, name, old in legacy:
        try:
            done.append((project_id, name, old, box.seal(project_id, name, box.open(project_id, name, old))))
        except UnavailableError as e:
            problems.append(str(e))

    def write(c) -> int:
        return sum(rows.replace_ciphertext(c, pid, name, old, new, box.key_id) for pid, name, old, new in done)
    return (store.write(write) if done else 0), problems
