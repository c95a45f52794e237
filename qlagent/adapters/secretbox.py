"""Secrets at rest: XChaCha20-Poly1305 (libsodium, through PyNaCl) with a key file outside the
database.

The key file (32 random bytes, mode 0600, created by ``qlagent init``) never enters the
database; the database holds only names and ciphertext. Each ciphertext is bound to its
Project and name as associated data, so a row copied under another name does not decrypt.

Ciphertext formats, told apart by a 5-byte magic:

- ``qlsb2`` (written): ``MAGIC || nonce(24) || XChaCha20-Poly1305-IETF(plaintext) || tag(16)``;
  random 24-byte nonces never repeat in practice. PyNaCl costs +2 MiB RSS once loaded.
- ``qlsb1`` (read only, to migrate): ``MAGIC || nonce(12) || AES-256-GCM(plaintext) || tag(16)``,
  what qlagent wrote before issue 14. Opening it imports ``cryptography`` (+7.7 MiB RSS that
  never leaves the process; bench/README.md), which is why ``qlagent init`` and the service start re-encrypt
  such rows (``application.secrets.migrate_legacy_secrets``): a resident agent reads qlsb2 only.
"""

from __future__ import annotations

import os
import stat

from ..core.canonical import sha256_hex
from ..core.errors import UnavailableError

KEY_BYTES = 32
MAGIC = b"qlsb2"
NONCE_BYTES = 24
TAG_BYTES = 16
LEGACY_MAGIC = b"qlsb1"
LEGACY_NONCE_BYTES = 12


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

    @staticmethod
    def _aad(project_id: str, name: str) -> bytes:
        return f"{project_id}\x00{name}".encode()

    def seal(self, project_id: str, name: str, plaintext: bytes) -> bytes:
        """Ciphertext ``qlsb2 || nonce(24) || XChaCha20-Poly1305(plaintext) || tag(16)``."""
        from nacl.bindings import crypto_aead_xchacha20poly1305_ietf_encrypt as encrypt
        nonce = os.urandom(NONCE_BYTES)
        return MAGIC + nonce + encrypt(plaintext, self._aad(project_id, name), nonce, self._key)

    def open(self, project_id: str, name: str, blob: bytes) -> bytes:
        """Plaintext of ``blob`` (either format); UnavailableError if it does not authenticate
        with this key, or if it is ``qlsb1`` and ``cryptography`` is not installed."""
        blob = bytes(blob)
        shortest = (len(MAGIC) + NONCE_BYTES if blob.startswith(MAGIC) else len(LEGACY_MAGIC) + LEGACY_NONCE_BYTES)
        if len(blob) < shortest + TAG_BYTES:
            raise UnavailableError(f"secret {name!r} is truncated", code="secret_unreadable")
        if blob.startswith(MAGIC):
            from nacl.bindings import crypto_aead_xchacha20poly1305_ietf_decrypt as decrypt
            from nacl.exceptions import CryptoError
            nonce, ct = blob[len(MAGIC):len(MAGIC) + NONCE_BYTES], blob[len(MAGIC) + NONCE_BYTES:]
            try:
                return decrypt(ct, self._aad(project_id, name), nonce, self._key)
            except CryptoError:
                raise self._wrong_key(name) from None
        if blob.startswith(LEGACY_MAGIC):
            return self._open_legacy(project_id, name, blob)
        raise UnavailableError(f"secret {name!r} is not in a known format", code="secret_unreadable")

    def _open_legacy(self, project_id: str, name: str, blob: bytes) -> bytes:
        try:
            from cryptography.exceptions import InvalidTag
            from cryptography.hazmat.primitives.ciphers.aead import AESGCM
        except ImportError:
            raise UnavailableError(
                f"secret {name!r} is in the AES-GCM format of earlier qlagent versions and cryptography is not "
                "installed: install python3-cryptography once and run `qlagent init` to re-encrypt it, "
                "or set the secret again", code="secret_unreadable", field=name) from None
        start = len(LEGACY_MAGIC)
        nonce, ct = blob[start:start + LEGACY_NONCE_BYTES], blob[start + LEGACY_NONCE_BYTES:]
        try:
            return AESGCM(self._key).decrypt(nonce, ct, self._aad(project_id, name))
        except InvalidTag:
            raise self._wrong_key(name) from None

    @staticmethod
    def _wrong_key(name: str) -> UnavailableError:
        return UnavailableError(f"secret {name!r} does not decrypt with this key file", code="secret_unreadable")
