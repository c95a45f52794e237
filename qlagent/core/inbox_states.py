"""The Worker's durable inbox (ADR-0021), pure: what one received offer is and may become.

States of one offer (row) and the only moves between them::

    received → barrier → started → completed → acked
    received → completed,  barrier → completed     (it could not start, or a restart found it
                                                     lost; the outcome says which)

- ``received``: the offer is on disk (delivery). Nothing has run.
- ``barrier``: the **crash barrier**, committed and fsync'd BEFORE anything is spawned. After it
  the Worker creates the Attempt's run directory (fsync'd), then spawns. On restart the run
  directory is the evidence: absent → nothing was spawned, spawning now is the first spawn;
  present → a spawn may have happened and the Worker never spawns again (it re-attaches, collects
  the receipt, or reports the run lost). So a Worker killed anywhere between receipt and spawn
  never spawns twice and never forgets the offer (``recovery_action``).
- ``started``: spawn done; the run may be re-attached after a restart.
- ``completed``: the outcome (exit code/signal/reason — never output, command or secret) is kept
  until the control plane acknowledges it; ``acked``: it did, and the row may be pruned.

Identity (ADR-0014 §3, ADR-0021): an offer is idempotent by ``offerId``; the same offerId with
another ExecutionSpec digest (or another Lease) is refused with ``OfferConflict``. Secret values
never enter the inbox: the stored spec is the ExecutionSpec document, which names SecretRefs
only, and its digest must be the spec's own content digest (``canonical.content_digest`` of the
camelCase document, as the control plane computes ``specDigest``), so a document carrying
anything else does not match what the control plane claimed.
"""

from __future__ import annotations

import re

import msgspec

from .canonical import canonical_json, sha256_hex
from .errors import ConflictError, UnavailableError, ValidationError


class InboxState:
    """An inbox row's states (module docstring), plain strings as ``core.states.RunState``.
    ``ALL`` in lifecycle order; ``OPEN``: not yet acknowledged; ``LIVE``: holding one of the
    Worker's slots (its run not ended)."""

    RECEIVED = "received"
    BARRIER = "barrier"
    STARTED = "started"
    COMPLETED = "completed"
    ACKED = "acked"

    ALL = (RECEIVED, BARRIER, STARTED, COMPLETED, ACKED)
    OPEN = frozenset({RECEIVED, BARRIER, STARTED, COMPLETED})
    LIVE = frozenset({RECEIVED, BARRIER, STARTED})


class OutcomeKind:
    """``kind`` of a ``completed`` row's outcome: the run ended (``COMPLETION``, its ACK owed),
    could not start (``START_FAILURE``, its ACK owed), was self-fenced (``FENCED``) or left no
    trace (``LOST``) — the last two send no ACK (the control plane's sweeper ends them)."""

    COMPLETION = "completion"
    START_FAILURE = "start_failure"
    FENCED = "fenced"
    LOST = "lost"


_NEXT = {
    InboxState.RECEIVED: {InboxState.BARRIER, InboxState.COMPLETED},
    InboxState.BARRIER: {InboxState.STARTED, InboxState.COMPLETED},
    InboxState.STARTED: {InboxState.COMPLETED},
    InboxState.COMPLETED: {InboxState.ACKED},
    InboxState.ACKED: set(),
}

# Recovery actions (what the Worker does with an open row after a restart).
SPAWN = "spawn"              # write the barrier if missing, create the run dir, spawn
REATTACH = "reattach"        # the run is alive: watch it again, never spawn
COLLECT = "collect"          # the run ended while the Worker was down: record the receipt
REPORT_LOST = "report_lost"  # a spawn may have happened and left no trace: completed(lost), no spawn
RESEND = "resend"            # completed but not acknowledged: send the completion again

_UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
_HEX64 = re.compile(r"[0-9a-f]{64}")
_TOKEN = re.compile(r"[A-Za-z0-9_-]+")
MIN_LEASE_TOKEN = 32          # characters: ADR-0108 "high-entropy" (≥ 192 bits as URL-safe base64)
MAX_LEASE_TOKEN = 256
MAX_GENERATION = 2**63 - 1    # a PostgreSQL bigint
MAX_OUTCOME_BYTES = 4_096     # one completion outcome (exit code, signal, reason, figures)


class OfferConflict(ConflictError):
    """The same offerId arrived with another ExecutionSpec digest (``reason="spec_digest"``) or
    another Lease (``reason="lease"``); the first offer stays, nothing of the second is kept."""

    code = "offer_conflict"

    def __init__(self, offer_id: str, reason: str) -> None:
        super().__init__(f"offerId {offer_id}: already received with a different "
                         f"{'ExecutionSpec digest' if reason == 'spec_digest' else 'Lease'}", field="offerId")
        self.reason = reason

    def to_dict(self) -> dict:
        return {**super().to_dict(), "reason": self.reason}


class InboxFull(UnavailableError):
    """The inbox holds its row or byte cap of unacknowledged offers; ``field`` names which."""

    code = "inbox_full"


class IllegalInboxTransition(Exception):
    pass


class InboxOffer(msgspec.Struct, frozen=True, kw_only=True):
    """What the inbox keeps of one ClaimedExecutionOffer: identities, the Lease and the
    secret-free ExecutionSpec document with its digest. Times in µs since the Unix epoch."""

    offer_id: str
    attempt_id: str
    session_id: str
    generation: int
    lease_generation: int
    lease_expires_at_us: int
    lease_token: str
    spec_digest: str
    spec: dict

    def __repr__(self) -> str:          # never the spec or the lease token
        return f"InboxOffer(offer={self.offer_id}, attempt={self.attempt_id})"

    __str__ = __repr__


class InboxEntry(msgspec.Struct, frozen=True, kw_only=True):
    """One row: the offer, its state, its outcome (set from ``completed``), the offerId
    conflicts refused so far (reported, never stored as content) and the ``pull_id`` of the Pull
    that brought it (None for an offer received without one): with the row's Session,
    generation and lease token it rebuilds that Pull's exact body (``pull_body``)."""

    offer: InboxOffer
    state: str
    outcome: dict | None
    received_at_us: int
    updated_at_us: int
    conflicts: int = 0
    pull_id: str | None = None

    def __repr__(self) -> str:
        return f"InboxEntry(offer={self.offer.offer_id}, state={self.state})"


class PendingPull(msgspec.Struct, frozen=True, kw_only=True):
    """The Pull request (ADR-0108) kept before it is sent: a retry after a lost response sends
    ``body`` again byte for byte, so the control plane rebuilds the same answer."""

    session_id: str
    generation: int
    pull_id: str
    lease_token: str
    body: bytes

    def __repr__(self) -> str:
        return f"PendingPull(session={self.session_id}, pull={self.pull_id})"


def check_transition(src: str, dst: str) -> None:
    """Raise IllegalInboxTransition unless ``src → dst`` is one of the moves above."""
    if dst not in _NEXT.get(src, ()):
        raise IllegalInboxTransition(f"inbox {src} → {dst}")


def spec_bytes(spec: dict) -> bytes:
    """The stored form of a spec: its canonical JSON (what the digest is computed over)."""
    return canonical_json(spec)


def check_offer(offer: InboxOffer, max_spec_bytes: int) -> bytes:
    """Validate ``offer`` before anything is written; return the spec's canonical bytes.

    Raises ValidationError naming the field: ``offerId``/``attemptId``/``sessionId`` (lowercase
    UUIDs), ``generation``/``leaseGeneration`` (1..2^63-1), ``leaseExpiresAtUs`` (> 0),
    ``leaseToken`` (32..256 URL-safe characters), ``specDigest`` (64 lowercase hex, equal to the
    spec's own digest), ``spec.secrets`` (secret values are never kept), ``spec`` (over
    ``max_spec_bytes``).
    """
    for field, value in (("offerId", offer.offer_id), ("attemptId", offer.attempt_id),
                         ("sessionId", offer.session_id)):
        if not isinstance(value, str) or not _UUID.fullmatch(value):
            raise ValidationError(field, "must be a lowercase canonical UUID")
    for field, value in (("generation", offer.generation), ("leaseGeneration", offer.lease_generation)):
        _check_generation(field, value)
    if not isinstance(offer.lease_expires_at_us, int) or offer.lease_expires_at_us <= 0:
        raise ValidationError("leaseExpiresAtUs", "must be a positive integer (µs since the epoch)")
    _check_token(offer.lease_token)
    if not isinstance(offer.spec_digest, str) or not _HEX64.fullmatch(offer.spec_digest):
        raise ValidationError("specDigest", "must be 64 lowercase hex characters")
    if not isinstance(offer.spec, dict):
        raise ValidationError("spec", "must be a document")
    if "secrets" in offer.spec:
        raise ValidationError("spec.secrets", "secret values are never kept in the inbox; only secretRefs names")
    try:
        data = spec_bytes(offer.spec)
    except (TypeError, ValueError) as e:
        raise ValidationError("spec", f"not a canonical document: {type(e).__name__}") from None
    if len(data) > max_spec_bytes:
        raise ValidationError("spec", f"{len(data)} bytes is over the inbox byte cap", limit=max_spec_bytes)
    if sha256_hex(data) != offer.spec_digest:
        raise ValidationError("specDigest", "does not match the spec's content digest")
    return data


def check_pull(session_id: str, generation: int, pull_id: str, lease_token: str) -> None:
    """Validate the fields of a Pull request; raises ValidationError naming ``sessionId``,
    ``pullId`` (lowercase UUIDs), ``generation`` or ``leaseToken`` (rules as ``check_offer``)."""
    for field, value in (("sessionId", session_id), ("pullId", pull_id)):
        if not isinstance(value, str) or not _UUID.fullmatch(value):
            raise ValidationError(field, "must be a lowercase canonical UUID")
    _check_generation("generation", generation)
    _check_token(lease_token)


def _check_generation(field: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= MAX_GENERATION:
        raise ValidationError(field, "must be an integer in 1..", limit=MAX_GENERATION)


def _check_token(tok: str) -> None:
    if (not isinstance(tok, str) or not MIN_LEASE_TOKEN <= len(tok) <= MAX_LEASE_TOKEN
            or not _TOKEN.fullmatch(tok)):
        raise ValidationError("leaseToken", f"must be {MIN_LEASE_TOKEN}..{MAX_LEASE_TOKEN} URL-safe characters",
                              limit=MAX_LEASE_TOKEN)


def check_outcome(outcome: dict) -> bytes:
    """Canonical bytes of a completion outcome; ValidationError(field="outcome") if it is not a
    canonical document or is over ``MAX_OUTCOME_BYTES``."""
    if not isinstance(outcome, dict):
        raise ValidationError("outcome", "must be a document")
    try:
        data = canonical_json(outcome)
    except (TypeError, ValueError) as e:
        raise ValidationError("outcome", f"not a canonical document: {type(e).__name__}") from None
    if len(data) > MAX_OUTCOME_BYTES:
        raise ValidationError("outcome", f"{len(data)} bytes is over the limit", limit=MAX_OUTCOME_BYTES)
    return data


def same_offer(a: InboxOffer, b: InboxOffer) -> str | None:
    """None if ``b`` is a retry of ``a`` (same offerId); else the conflict reason."""
    if a.spec_digest != b.spec_digest:
        return "spec_digest"
    if (a.attempt_id, a.session_id, a.generation, a.lease_generation, a.lease_token) != (
            b.attempt_id, b.session_id, b.generation, b.lease_generation, b.lease_token):
        return "lease"
    return None


def recovery_action(state: str, *, run_dir_exists: bool, alive: bool, receipt: bool) -> str | None:
    """What a restarted Worker does with one row (see the module docstring), given the evidence
    on disk: the Attempt's run directory, a live run (PID-reuse safe check), a completion receipt.

    ``None`` for ``acked`` (nothing to do). Raises ValueError for an unknown state.
    """
    if state not in _NEXT:
        raise ValueError(f"unknown inbox state {state!r}")
    if state == InboxState.ACKED:
        return None
    if state == InboxState.COMPLETED:
        return RESEND
    if state == InboxState.RECEIVED or (state == InboxState.BARRIER and not run_dir_exists):
        return SPAWN
    if alive:
        return REATTACH
    if receipt:
        return COLLECT
    return REPORT_LOST


def pull_body(session_id: str, generation: int, pull_id: str, lease_token: str) -> bytes:
    """Canonical JSON of a Pull request (ADR-0108 fields ``sessionId``, ``generation``,
    ``pullId``, ``leaseToken``): the exact bytes kept and re-sent."""
    return canonical_json({"sessionId": session_id, "generation": generation, "pullId": pull_id,
                           "leaseToken": lease_token})
