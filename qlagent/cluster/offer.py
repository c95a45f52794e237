"""ClaimedExecutionOffer (ADR-0014 §3): the internal capability handed to exactly one Worker
Session after its Run Lease committed.

``offer_id`` is a UUIDv5 in a fixed qlagent namespace over ``"{attemptId}:{leaseGeneration}:
{sessionId}"``: the same Lease always yields the same offerId (a restart, a recovery or a Pull
retried after a lost response), a new Lease generation or another Session never does.
``repr`` shows identities only: the spec, the lease token and secret values stay out of any log.
"""

from __future__ import annotations

import uuid

from ..core.cluster import ClaimedExecutionOffer, ExecutionSpec  # noqa: F401  (the wire Struct, re-exported)

OFFER_NAMESPACE = uuid.UUID("4d2b8a8e-1f0c-5a7e-9b61-0c1a7e3f5d20")


def offer_id(attempt_id: str, lease_generation: int, session_id: str) -> str:
    """Stable offerId of one Lease (lowercase canonical UUID)."""
    return str(uuid.uuid5(OFFER_NAMESPACE, f"{attempt_id}:{lease_generation}:{session_id}"))


