"""The bounded lease sweeper (issue 10 §8): one explicit pass, no timer of its own.

Each pass marks at most ``batch`` Sessions past their expiry offline, then ends at most
``batch`` Leases past their expiry (database clock, ``FOR UPDATE SKIP LOCKED`` so replicas
sweeping together never block or double-process a Lease). A Lease expired before the Worker's
starting ACK puts its Run back in the queue for a new offer (the Attempt stays ``claimed``; the
next claim takes lease generation + 1); after ``starting``/``running`` the Attempt is ``lost``
and the Task's retry policy decides. Every transition appends RunEvents. A Lease runs out when
its Worker's heartbeats stop, or when they go on without naming it (the Worker self-fenced or
dropped that run: ``WorkerRegistry.heartbeat`` renews only the Leases named). Last, at most
``batch`` held single-instance Runs whose Task no live Run occupies any more are released
(a hold a concurrent Task Start wrote while that Run was ending).
"""

from __future__ import annotations

import msgspec

from ..core.errors import ValidationError
from ..core.ports import LeaseStore, WorkerRegistryStore
from ..core.states import RunState

MAX_BATCH = 64


class SweepResult(msgspec.Struct, frozen=True):
    """Counts of one pass; ``truncated`` when a batch was full (more may be due)."""

    sessions_expired: int
    leases_expired: int
    requeued: int
    ended: int
    truncated: bool
    holds_released: int = 0


class LeaseSweeper:
    """Over the Lease store and the Worker registry's (``core.ports.LeaseStore``,
    ``core.ports.WorkerRegistryStore``);
    ``batch`` 1..64 Sessions and Leases per pass (ValidationError otherwise)."""

    def __init__(self, leases: LeaseStore, registry: WorkerRegistryStore, batch: int = 32) -> None:
        if not isinstance(batch, int) or not 1 <= batch <= MAX_BATCH:
            raise ValidationError("cluster.sweep_batch", f"{batch!r} outside 1..{MAX_BATCH}", limit=MAX_BATCH)
        self._leases, self._registry, self._batch = leases, registry, batch

    def sweep_once(self) -> SweepResult:
        """One bounded pass (see the module docstring)."""
        sessions = self._registry.expire_sessions(self._batch)
        ended = self._leases.sweep_expired(self._batch)
        released = self._leases.release_holds(self._batch)
        requeued = sum(1 for _, run_state in ended if run_state == RunState.QUEUED)
        return SweepResult(sessions, len(ended), requeued, len(ended) - requeued,
                           sessions == self._batch or len(ended) == self._batch or released == self._batch,
                           released)
