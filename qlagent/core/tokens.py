"""API bearer tokens (issue 5 §2): ``qlt_`` + 43 URL-safe characters (256 bits); only the
SHA-256 hex digest is ever stored, so a database copy holds no usable credential."""

from __future__ import annotations

import secrets

from .canonical import sha256_hex

TOKEN_PREFIX = "qlt_"


def new_token() -> str:
    """A fresh bearer token (shown once by ``qlagent token create``)."""
    return TOKEN_PREFIX + secrets.token_urlsafe(32)


def token_digest(token: str) -> str:
    """SHA-256 hex of the token's UTF-8 bytes: the only form the store keeps."""
    return sha256_hex(token.encode("utf-8"))
