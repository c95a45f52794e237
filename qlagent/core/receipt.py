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
    quota_bytes: int | None = None        # the log quota the shim was given (bytes)
    write_error: str | None = None        # the first failed log write: errno name and text, e.g.
                                          # "ENOSPC (No space left on device)"; bytes after it dropped


def start_code(start_error: str) -> str:
    """The Attempt failure reason (a code) for a shim's start_error text."""
    return _START_CODES.get(start_error.split(" ", 1)[0], "shim_failed")


def bounded(text: str) -> str:
    """A start-failure reason cut to limits.MAX_START_ERROR characters."""
    return text if len(text) <= L.MAX_START_ERROR else text[:L.MAX_START_ERROR - 3] + "..."


# Why a log lost bytes (``TruncationFact.reason``): the quota, or a failed write of the Artifact,
# "write_error: <errno name> (<text>)" — an errno and its text, never a path or user output.
QUOTA = "quota"
WRITE_ERROR = "write_error"
MAX_REASON = 160                        # characters of a reason (the stores' CHECK)


class TruncationFact(msgspec.Struct, frozen=True, rename="camel"):
    """The log lost bytes (``truncated.json``, write-once, at the moment it happened, or the
    receipt's figures when that file could not be written): ``quota_bytes`` the quota,
    ``bytes_kept`` what the Artifact holds, ``bytes_dropped`` what was discarded (None until
    the receipt tells the final figure), ``reason`` why: ``QUOTA`` or ``write_error: ENOSPC
    (No space left on device)`` (``write_error_reason``). Bytes throughout."""

    quota_bytes: int
    bytes_kept: int
    bytes_dropped: int | None = None
    reason: str = QUOTA


def write_error_reason(error: str) -> str:
    """The truncation reason of a failed Artifact write, ``error`` its errno name and text;
    cut to MAX_REASON characters."""
    text = f"{WRITE_ERROR}: {error}"
    return text if len(text) <= MAX_REASON else text[:MAX_REASON - 3] + "..."


def truncation_of(receipt: Receipt | None, fact: TruncationFact | None) -> TruncationFact | None:
    """The truncation fact of an ended run: the shim's ``truncated.json`` (``fact``) when it
    was written, else — the file system it would sit on was full — the receipt's own figures
    when it dropped bytes (its ``write_error`` as the reason, else the quota; the quota is the
    bytes kept when an older receipt does not name it). None: nothing was dropped."""
    if fact is not None or receipt is None or receipt.bytes_dropped <= 0:
        return fact
    return TruncationFact(quota_bytes=receipt.bytes_kept if receipt.quota_bytes is None else receipt.quota_bytes,
                          bytes_kept=receipt.bytes_kept, bytes_dropped=receipt.bytes_dropped,
                          reason=QUOTA if receipt.write_error is None else write_error_reason(receipt.write_error))


class _ShimTruncation(msgspec.Struct, frozen=True):
    quota_bytes: int
    bytes_kept: int
    reason: str = QUOTA                 # absent from a fact an older shim wrote


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
    """Decode the shim's ``truncated.json`` (``{"quota_bytes","bytes_kept","reason"}``: integers
    ≥ 0, ``QUOTA`` or ``write_error: …`` of at most MAX_REASON characters); raises RunFileError
    naming ``truncated.json.<field>``."""
    t = _decode(raw, _decoder(_ShimTruncation), "truncated.json")
    for name in ("quota_bytes", "bytes_kept"):
        if getattr(t, name) < 0:
            raise RunFileError(f"truncated.json.{name}", "must be an integer >= 0")
    if t.reason != QUOTA and not (t.reason.startswith(WRITE_ERROR + ": ") and len(t.reason) <= MAX_REASON):
        raise RunFileError("truncated.json.reason", f"must be {QUOTA!r} or '{WRITE_ERROR}: ...' "
                           f"(at most {MAX_REASON} characters)")
    return TruncationFact(quota_bytes=t.quota_bytes, bytes_kept=t.bytes_kept, reason=t.reason)


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
