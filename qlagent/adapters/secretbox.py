"""Secrets at rest: AES-256-GCM with a key file outside the database.

The key file (32 random bytes, mode 0600, created by ``qlagent init``) never enters the
database; the database holds only names and ciphertext. Each ciphertext is bound to its
Project and name as associated data, so a row copied under another name does not decrypt.
``cryptography`` is imported lazily: only ``secret set`` and the materialiser pay its RSS.
"""

from __future__ import annotations

import os
import stat

from ..core.canonical import sha256_hex
from ..core.errors import UnavailableError

KEY_BYTES = 32
NONCE_BYTES = 12
MAGIC = b"qlsb1"


def create_key_file(path: str) -> bool:
    """Create the key file (0600, parent 0700) if it is missing; True if created."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), mode=0o700, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except FileExistsError:
        return False
    try:
        os.write(fd, os.urandom(KEY_BYTES))
        os.fsync(fd)
    finally:
        os.close(fd)
    return True


def check_key_file(path: str) -> str | None:
    """Return a problem description for ``doctor`` (missing, symlink, mode, size), or None."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return f"secret key file {path} is missing (run `qlagent init`)"
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISREG(st.st_mode):
        return f"secret key file {path} is not a regular file"
    if st.st_mode & 0o077:
        return f"secret key file {path} has mode {oct(st.st_mode & 0o777)}; expected 0600"
    if st.st_size != KEY_BYTES:
        return f"secret key file {path} is {st.st_size} bytes; expected {KEY_BYTES}"
    return None


class SecretBox:
    """Encrypts and decrypts Secret values with the key in ``key_path``.

    Raises UnavailableError if the key file is missing or unsafe (never a traceback).
    """

    def __init__(self, key_path: str) -> None:
        problem = check_key_file(key_path)
        if problem:
            raise UnavailableError(problem, code="secret_key_unavailable")
        fd = os.open(key_path, os.O_RDONLY | os.O_NOFOLLOW)
        try:
            self._key = os.read(fd, KEY_BYTES)
        finally:
            os.close(fd)
        self.key_id = sha256_hex(b"qlagent-key-id" + self._key)[:16]

    def _aead(self):
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM
        return AESGCM(self._key)

    @staticmethod
    def _aad(project_id: str, name: str) -> bytes:
        return f"{project_id}\x00{name}".encode()

    def seal(self, project_id: str, name: str, plaintext: bytes) -> bytes:
        """Ciphertext ``MAGIC || nonce(12) || AES-GCM(plaintext)``."""
        nonce = os.urandom(NONCE_BYTES)
        return MAGIC + nonce + self._aead().encrypt(nonce, plaintext, self._aad(project_id, name))

    def open(self, project_id: str, name: str, blob: bytes) -> bytes:
        """Plaintext of ``blob``; UnavailableError if it does not authenticate with this key."""
        from cryptography.exceptions import InvalidTag
        if not blob.startswith(MAGIC):
            raise UnavailableError(f"secret {name!r} is not in a known format", code="secret_unreadable")
        nonce, ct = blob[len(MAGIC):len(MAGIC) + NONCE_BYTES], blob[len(MAGIC) + NONCE_BYTES:]
        try:
            return self._aead().decrypt(nonce, ct, self._aad(project_id, name))
        except InvalidTag:
            raise UnavailableError(f"secret {name!r} does not decrypt with this key file",
                                   code="secret_unreadable") from None
