"""ClaimedExecutionOffer (ADR-0014 §3): the internal capability handed to exactly one Worker
Session after its Run Lease committed.

``offer_id`` is a UUIDv5 in a fixed qlagent namespace over ``"{attemptId}:{leaseGeneration}:
{sessionId}"``: the same Lease always yields the same offerId (a restart, a recovery or a Pull
retried after a lost response), a new Lease generation or another Session never does.
``repr`` shows identities only: the spec, the lease token and secret values stay out of any log.
"""

from __future__ import annotations

import uuid
from hashlib import sha1

OFFER_NAMESPACE = uuid.UUID("4d2b8a8e-1f0c-5a7e-9b61-0c1a7e3f5d20")
_NS = OFFER_NAMESPACE.bytes


def offer_id(attempt_id: str, lease_generation: int, session_id: str) -> str:
    """Stable offerId of one Lease (lowercase canonical UUID): ``str(uuid.uuid5(OFFER_NAMESPACE,
    name))`` (RFC 4122 §4.3) computed without building two ``uuid.UUID`` objects (one per claim)."""
    h = bytearray(sha1(_NS + f"{attempt_id}:{lease_generation}:{session_id}".encode()).digest()[:16])
    h[6] = (h[6] & 0x0F) | 0x50     # version 5
    h[8] = (h[8] & 0x3F) | 0x80     # RFC 4122 variant
    x = h.hex()
    return f"{x[:8]}-{x[8:12]}-{x[12:16]}-{x[16:20]}-{x[20:]}"


