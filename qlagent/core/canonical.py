"""Canonical JSON and content digests (ADR-0071 §2, DESIGN.md "contentDigest").

Rule: objects with keys sorted by code point, no insignificant whitespace, UTF-8, every string
(keys and values) NFC-normalised, integers as integers, floats refused (callers normalise
durations to integer milliseconds first), booleans and null as JSON literals. Two definitions
that differ only in key order, whitespace or Unicode normal form get the same digest.
"""

from __future__ import annotations

import unicodedata

import msgspec

# The interpreter's built-in SHA-256 rather than hashlib: hashlib loads OpenSSL's libcrypto,
# about 4 MiB of resident memory the agent never otherwise needs (bench/README.md, idle RSS).
try:
    from _sha2 import sha256          # CPython ≥ 3.12
except ImportError:
    try:
        from _sha256 import sha256    # CPython 3.11
    except ImportError:
        from hashlib import sha256

_encoder = msgspec.json.Encoder(order="sorted")


def _normalise(value):
    if isinstance(value, str):
        return unicodedata.normalize("NFC", value)
    if isinstance(value, bool) or value is None or isinstance(value, int):
        return value
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            nk = unicodedata.normalize("NFC", k)
            if nk in out:
                raise ValueError(f"key {k!r} collides with another key after NFC normalisation")
            out[nk] = _normalise(v)
        return out
    if isinstance(value, (list, tuple)):
        return [_normalise(v) for v in value]
    raise TypeError(f"canonical JSON refuses {type(value).__name__}")


def canonical_json(value) -> bytes:
    """Encode ``value`` (dict/list/str/int/bool/None) as canonical JSON bytes.

    Raises TypeError for floats or other types, ValueError for keys that collide under NFC.
    """
    return _encoder.encode(_normalise(value))


def sha256_hex(data: bytes) -> str:
    """Lowercase hex SHA-256 of ``data`` (64 characters)."""
    return sha256(data).hexdigest()


def content_digest(value) -> str:
    """contentDigest of a canonical document: ``sha256_hex(canonical_json(value))``."""
    return sha256_hex(canonical_json(value))


def snapshot_ref(revision: int, digest: str) -> str:
    """Task snapshot ref pinned on every Run: ``qltd:v1:{revision}:{contentDigest}`` (ADR-0376 §2)."""
    return f"qltd:v1:{revision}:{digest}"


def idempotency_key(mutation_id: str) -> str:
    """Project-scoped idempotency key of a Task Start (ADR-0376 §2): ``ql3:task-start:v1:{id}``."""
    return f"ql3:task-start:v1:{mutation_id}"


def recipe_ref(digest: str) -> str:
    """Context recipe identity ``localctx:sha256:<digest>`` (ADR-0071 §2)."""
    return f"localctx:sha256:{digest}"
