"""The join token (issue 26): one line that `qlagent workers enroll NAME --join-token` prints
and `qlagent worker join TOKEN` reads on the router — ``qlj1.`` + unpadded base64url of a small
JSON document: the token's ID (the control plane's record of it), the Worker ID, the control
plane's URLs, its CA certificate (DER, base64; the only CA the Worker will trust), the
Worker's credential and the token's expiry (Unix seconds). It carries the credential: it is
shown once and redeemed once (``cluster.joins``)."""

from __future__ import annotations

import base64

import msgspec

from .errors import ValidationError

PREFIX = "qlj1."
MAX_TOKEN_CHARS = 8192
MIN_TTL_S, MAX_TTL_S = 60, 7 * 86_400


class JoinToken(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    token_id: str = msgspec.field(name="t")
    worker_id: str = msgspec.field(name="w")
    urls: list[str] = msgspec.field(name="u")
    ca_der: str | None = msgspec.field(name="ca")     # base64 (standard) of the CA's DER; None: http only
    credential: str = msgspec.field(name="c")
    expires_at_s: int = msgspec.field(name="x")


def encode_token(token: JoinToken) -> str:
    """The one-line form (module docstring)."""
    return PREFIX + base64.urlsafe_b64encode(msgspec.json.encode(token)).rstrip(b"=").decode("ascii")


def decode_token(text: str) -> JoinToken:
    """The token in ``text`` (surrounding blanks ignored). Raises ValidationError naming
    ``TOKEN`` for anything else: another prefix, a truncated or damaged body, longer than
    ``MAX_TOKEN_CHARS``."""
    text = text.strip()
    if len(text) > MAX_TOKEN_CHARS:
        raise ValidationError("TOKEN", f"{len(text)} characters", limit=MAX_TOKEN_CHARS)
    if not text.startswith(PREFIX):
        raise ValidationError("TOKEN", f"not a join token (it starts with {PREFIX!r}; `qlagent workers enroll NAME "
                                       "--join-token` prints one)")
    body = text[len(PREFIX):]
    try:
        raw = base64.urlsafe_b64decode(body + "=" * (-len(body) % 4))
        return msgspec.json.decode(raw, type=JoinToken)
    except (ValueError, msgspec.DecodeError):      # binascii.Error is a ValueError
        raise ValidationError("TOKEN", "truncated or damaged (copy the whole line)") from None
