"""Worker ACKs (ADR-0109): starting, running, start-failure and completion of one leased
Attempt, each fenced by the Worker credential, Session, generation, lease generation and lease
token, idempotent on retry (a replay answers the recorded states). A generation older than the
Worker's current one is refused with the distinct code ``stale_generation``.
"""

from __future__ import annotations

import re

from ..core.canonical import sha256_hex
from ..core.cluster import Ack, AckKind, AckResult, LeaseFence
from ..core.errors import ValidationError
from ..core.leasefit import check_lease_ttl
from ..core.ports import LeaseStore
from ..core.receipt import MAX_REASON, QUOTA, WRITE_ERROR
from ..core.states import AttemptState, KillReason, outcome
from .registry import check_generation, check_token, check_uuid, credential_digest

START_ERROR = re.compile(r"^[a-z][a-z0-9_]{0,63}\Z")
# A completion's truncation reason (core.receipt): the quota or an errno of the failed log write.
TRUNCATION_REASON = re.compile(rf"^({QUOTA}|{WRITE_ERROR}: [\x20-\x7e]{{1,{MAX_REASON - len(WRITE_ERROR) - 2}}})\Z")
# Completion figures: (Ack attribute, wire name an error names; docs/worker-protocol.md "Errors").
FIGURES = (("bytes_kept", "bytesKept"), ("bytes_dropped", "bytesDropped"), ("peak_rss_bytes", "peakRssBytes"),
           ("cpu_time_us", "cpuTimeUs"))


def lease_fence(worker_id: str, credential: str, session_id: str, generation: int, attempt_id: str,
                lease_generation: int, lease_token: str) -> LeaseFence:
    """A validated fence; ValidationError names the field, WorkerAuthError for a bad credential."""
    return LeaseFence(worker_id=check_uuid("workerId", worker_id), credential_digest=credential_digest(credential),
                      session_id=check_uuid("sessionId", session_id),
                      generation=check_generation("generation", generation),
                      attempt_id=check_uuid("attemptId", attempt_id),
                      lease_generation=check_generation("leaseGeneration", lease_generation),
                      token_digest=sha256_hex(check_token("leaseToken", lease_token).encode()))


def _figure(field: str, value, hi: int = 2**62) -> None:
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= hi):
        raise ValidationError(field, f"must be an integer 0..{hi}", limit=hi)


def target_state(ack: Ack) -> str:
    """The Attempt state an ACK asks for; ValidationError naming the first bad field."""
    if ack.kind not in AckKind.ALL:
        raise ValidationError("kind", f"{ack.kind!r} is not one of {list(AckKind.ALL)}")
    if ack.kind == AckKind.STARTING:
        return AttemptState.STARTING
    if ack.kind == AckKind.RUNNING:
        return AttemptState.RUNNING
    if ack.kind == AckKind.START_FAILURE:
        if not isinstance(ack.start_error, str) or not START_ERROR.match(ack.start_error):
            raise ValidationError("startError", "must be a short code [a-z][a-z0-9_]{0,63}", limit=64)
        return AttemptState.START_FAILED
    if (ack.exit_code is None) == (ack.signal is None):
        raise ValidationError("exitCode", "give exactly one of exitCode and signal")
    _figure("exitCode", ack.exit_code, 255)
    if ack.signal is not None and not (isinstance(ack.signal, int) and 1 <= ack.signal <= 64):
        raise ValidationError("signal", "must be 1..64", limit=64)
    if ack.kill_reason is not None and ack.kill_reason not in KillReason.ALL:
        raise ValidationError("killReason", f"must be one of {list(KillReason.ALL)}")
    for attr, wire in FIGURES:
        _figure(wire, getattr(ack, attr))
    if ack.truncation_reason is not None and not (isinstance(ack.truncation_reason, str)
                                                   and TRUNCATION_REASON.match(ack.truncation_reason)):
        raise ValidationError("truncationReason", f"must be {QUOTA!r} or '{WRITE_ERROR}: ' and printable ASCII, "
                              f"at most {MAX_REASON} characters", limit=MAX_REASON)
    return outcome(ack.exit_code, ack.signal, None, ack.kill_reason)


class AckService:
    """ACKs over the Lease store (``core.ports.LeaseStore``). ``lease_ttl_s``: a starting/running
    ACK extends the Lease to at least now + this."""

    def __init__(self, store: LeaseStore, lease_ttl_s: int = 30) -> None:
        check_lease_ttl("cluster.lease_ttl_s", lease_ttl_s)
        self._store, self._ttl_us = store, lease_ttl_s * 1_000_000

    def ack(self, worker_id: str, credential: str, ack: Ack) -> AckResult:
        """Apply one ACK. Raises ValidationError (bad field), WorkerAuthError, NotFoundError
        (lease_not_found) or ConflictError (stale_generation, lease_token_mismatch,
        lease_not_active, lease_expired, ack_out_of_order, ack_conflict)."""
        fence = lease_fence(worker_id, credential, ack.session_id, ack.generation, ack.attempt_id,
                            ack.lease_generation, ack.lease_token)
        return self._store.apply_ack(fence, ack, target_state(ack), self._ttl_us)
