"""ClaimedExecutionOffer (ADR-0014 §3): the internal capability handed to exactly one Worker
Session after its Run Lease committed.

``offer_id`` is a UUIDv5 in a fixed qlagent namespace over ``"{attemptId}:{leaseGeneration}:
{sessionId}"``: the same Lease always yields the same offerId (a restart, a recovery or a Pull
retried after a lost response), a new Lease generation or another Session never does.
``repr`` shows identities only: the spec, the lease token and secret values stay out of any log.
"""

from __future__ import annotations

import uuid

import msgspec

from .execspec import ExecutionSpec

OFFER_NAMESPACE = uuid.UUID("4d2b8a8e-1f0c-5a7e-9b61-0c1a7e3f5d20")


def offer_id(attempt_id: str, lease_generation: int, session_id: str) -> str:
    """Stable offerId of one Lease (lowercase canonical UUID)."""
    return str(uuid.uuid5(OFFER_NAMESPACE, f"{attempt_id}:{lease_generation}:{session_id}"))


class ClaimedExecutionOffer(msgspec.Struct, frozen=True, rename="camel", kw_only=True):
    offer_id: str
    source: str                       # new_claim | lease_recovery
    run_id: str
    attempt_id: str
    project_id: str
    task_id: str
    task_revision: int
    worker_id: str
    session_id: str
    generation: int
    lease_generation: int
    lease_expires_at_us: int
    lease_token: str
    spec_digest: str
    spec: ExecutionSpec
    placement_score: int | None = None     # new claims only; a recovery does not recompute it
    secrets: dict[str, bytes] = {}         # environment name → plaintext, resolved after the claim

    def __repr__(self) -> str:
        return (f"ClaimedExecutionOffer(offer={self.offer_id}, attempt={self.attempt_id}, "
                f"worker={self.worker_id}, source={self.source})")

    __str__ = __repr__
