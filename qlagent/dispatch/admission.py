"""Admission policy of one agent (ADR-0071 §3–4): may a Run start now, and may this one?

Global blocks, in order: ``draining`` (shutdown), ``concurrency`` (the limit of active Runs),
then the Profile budget (``pids``/``memory`` from BudgetPort). Per-Run blocks:
``single_instance`` (the Task has an active Run), ``memory_reserved`` (the memory reserved for the live
Runs plus this one's would pass the Profile's share for runs: core.profiles), ``network_unknown``
(no gate yet) or ``network`` (the gate says the condition does not hold).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from ..core.dispatch import Candidate, Plan
from ..core.profiles import Profile, run_memory_reserve, run_memory_share

if TYPE_CHECKING:   # ports are annotations only: no Protocol class at run time
    from ..core.ports import BudgetPort, DispatchStore, NetworkPort


class Admission:
    """``draining``, ``max_concurrent`` and ``network`` are set by the service as it runs;
    ``last_block`` is the latest global block (STATUS)."""

    def __init__(self, store: DispatchStore, max_concurrent: int, budget: BudgetPort | None,
                 network: NetworkPort | None, live_roots: Callable[[], list[int]], profile: Profile,
                 live_reserves: Callable[[], list[int | None]]) -> None:
        self._store = store
        self._profile = profile
        self._live_reserves = live_reserves   # bytes held per live Run; None: re-attached, not known
        self.max_concurrent = max_concurrent
        self.budget = budget
        self.network = network
        self.draining = False
        self.last_block: str | None = None
        self._live_roots = live_roots       # shims re-attached after a restart: not our children

    def global_block(self) -> str | None:
        """A reason no Run may start now, or None."""
        reason = None
        if self.draining:
            reason = "draining"
        elif self._store.active_count() >= self.max_concurrent:
            reason = "concurrency"
        elif self.budget is not None:
            reason = self.budget.block_reason(self._live_roots())
        self.last_block = reason
        return reason

    def run_block(self, c: Candidate, plan: Plan) -> str | None:
        """A reason this Run must wait, or None."""
        if plan.concurrency == "single" and self._store.task_active_count(c.task_id):
            return "single_instance"
        default = run_memory_reserve(self._profile, None)
        held = sum(default if r is None else r for r in self._live_reserves())
        if held + run_memory_reserve(self._profile, plan.execution.memory_max) > run_memory_share(self._profile):
            return "memory_reserved"
        if plan.network_require != "none":
            if self.network is None:
                return "network_unknown"
            if not self.network.satisfied(plan.network_require, plan.network_interface):
                return "network"
        return None
