"""API bearer tokens (issue 5 §2): ``qlt_`` + 43 URL-safe characters (256 bits); only the
SHA-256 hex digest is ever stored, so a database copy holds no usable credential.

Minted from ``os.urandom`` (what ``secrets.token_urlsafe`` does) and digested with the
interpreter's built-in SHA-256 (``core.canonical``): ``secrets`` imports hashlib, which loads
OpenSSL (+3.5 MiB RSS) into the agent the first time the HTTP surface starts (issue 14)."""

from __future__ import annotations

import base64
import os

from .canonical import sha256_hex

TOKEN_PREFIX = "qlt_"


def new_token() -> str:
    """A fresh bearer token (shown once by ``qlagent token create``)."""
    return TOKEN_PREFIX + base64.urlsafe_b64encode(os.urandom(32)).rstrip(b"=").decode("ascii")


def token_digest(token: str) -> str:
    """SHA-256 hex of the token's UTF-8 bytes: the only form the store keeps."""
    return sha256_hex(token.encode("utf-8"))
