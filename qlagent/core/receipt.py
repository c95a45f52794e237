"""What the shim leaves in its run directory, decoded into typed facts (ARCHITECTURE.md "Shim
contract"). The shim itself is stdlib-only and writes plain JSON; the agent decodes it here
with msgspec, so a missing or mistyped field is refused in one place.
"""

from __future__ import annotations

import functools

import msgspec

from . import limits as L
from .errors import FACT_LIMIT_BYTES, RunFileError

# A receipt's start_error begins with what could not be used (adapters/shim/main.py).
_START_CODES = {"cwd": "cwd_unusable", "exec": "exec_failed", "artifact_path": "artifact_unusable"}


class Receipt(msgspec.Struct, frozen=True, forbid_unknown_fields=False):
    """The completion receipt (``receipt.json``). Times are µs since the epoch, sizes bytes.

    ``start_error`` is set when the task never ran (exec failed, unusable spec); ``exit_code``
    and ``signal`` are exclusive (a task killed by a signal has no exit code).
    """

    attempt_id: str
    exit_code: int | None
    signal: int | None
    start_error: str | None
    started_at_us: int | None
    ended_at_us: int | None
    bytes_total: int
    bytes_kept: int
    bytes_dropped: int
    peak_rss_bytes: int | None
    cpu_time_us: int | None
    orphans_stopped: int | None = None    # absent from a receipt an older shim wrote
    lease_lost: bool = False              # the shim stopped the run: its Worker did not renew the Lease
    deadline_passed: bool = False         # the shim stopped the run: the Run's timeout (deadline file) was up
    oom_killed: bool = False              # SIGKILLed while its memory cgroup's oom_kill count rose


def start_code(start_error: str) -> str:
    """The Attempt failure reason (a code) for a shim's start_error text."""
    return _START_CODES.get(start_error.split(" ", 1)[0], "shim_failed")


def bounded(text: str) -> str:
    """A start-failure reason cut to limits.MAX_START_ERROR characters."""
    return text if len(text) <= L.MAX_START_ERROR else text[:L.MAX_START_ERROR - 3] + "..."


class TruncationFact(msgspec.Struct, frozen=True, rename="camel"):
    """The log quota was hit (``truncated.json``, write-once, at the moment it happened):
    ``quota_bytes`` the quota, ``bytes_kept`` what the Artifact holds, ``bytes_dropped`` what was
    discarded (None until the receipt tells the final figure). Bytes throughout."""

    quota_bytes: int
    bytes_kept: int
    bytes_dropped: int | None = None


class _ShimTruncation(msgspec.Struct, frozen=True):
    quota_bytes: int
    bytes_kept: int


@functools.cache
def _decoder(kind: type) -> msgspec.json.Decoder:
    return msgspec.json.Decoder(kind)      # built at the first Run end, not at start-up


def _field_of(err: msgspec.ValidationError) -> str | None:
    """The top-level field a msgspec error is about, or None (the document itself is wrong)."""
    msg = str(err)
    at = msg.rsplit("- at `$.", 1)
    if len(at) == 2:
        return at[1].rstrip("`").split(".")[0].split("[")[0]
    if msg.startswith("Object missing required field"):
        return msg.split("`")[1]
    return None


def decode_receipt(raw: bytes) -> Receipt:
    """Decode ``receipt.json``; raises RunFileError naming ``receipt.json.<field>``."""
    return _decode(raw, _decoder(Receipt), "receipt.json")


def decode_truncation(raw: bytes) -> TruncationFact:
    """Decode the shim's ``truncated.json`` (``{"quota_bytes","bytes_kept"}``, integers ≥ 0);
    raises RunFileError naming ``truncated.json.<field>``."""
    t = _decode(raw, _decoder(_ShimTruncation), "truncated.json")
    for name in ("quota_bytes", "bytes_kept"):
        if getattr(t, name) < 0:
            raise RunFileError(f"truncated.json.{name}", "must be an integer >= 0")
    return TruncationFact(quota_bytes=t.quota_bytes, bytes_kept=t.bytes_kept)


def _decode(raw: bytes, dec: msgspec.json.Decoder, name: str):
    if len(raw) > FACT_LIMIT_BYTES:
        raise RunFileError(name, f"larger than {FACT_LIMIT_BYTES} bytes")
    try:
        return dec.decode(raw)
    except msgspec.ValidationError as e:
        field = _field_of(e)
        if field is None:
            raise RunFileError(name, "must be a JSON object") from None
        if str(e).startswith("Object missing required field"):
            raise RunFileError(f"{name}.{field}", "missing") from None
        raise RunFileError(f"{name}.{field}", str(e).split(" - at ")[0]) from None
    except msgspec.DecodeError as e:
        raise RunFileError(name, f"not valid JSON ({e})") from None
