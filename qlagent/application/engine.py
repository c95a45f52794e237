"""The local execution engine: wiring of dispatcher, materialiser, coordinator and admission
over ports (ADR-0071 §1); ``bootstrap.build_engine`` hands it the process, artifact and cipher
implementations.

``Engine`` keeps the coordinator private and exposes only ``dispatcher`` (callers cannot reach
the shim, the coordinator or candidate reads) plus the lifecycle hooks the service loop needs
(exits, ticks, recovery, drain, retention).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from ..core.profiles import Profile
from ..dispatch.admission import Admission
from ..dispatch.dispatcher import LocalRunDispatcher
from ..dispatch.materializer import Materializer
from ..execution.coordinator import LocalExecutionCoordinator

if TYPE_CHECKING:   # ports are annotations only: no Protocol class at run time
    from ..core.dispatch import Refusal
    from ..core.ports import ArtifactPort, BudgetPort, CipherFactory, ProcessPort, Store


class Engine:
    """Everything that executes Runs for one process (service or ``run start --wait``)."""

    def __init__(self, store: Store, *, procs: ProcessPort, artifacts: ArtifactPort, cipher: CipherFactory,
                 profile: Profile, max_concurrent: int, budget: BudgetPort | None,
                 clock_us: Callable[[], int], baseline: dict[str, str] | None = None,
                 log=lambda *a, **k: None) -> None:
        self._store = store
        self._log = log
        self._artifacts = artifacts
        self._procs = procs
        self._coordinator = LocalExecutionCoordinator(store, procs, clock_us, log)
        self.admission = Admission(store, max_concurrent, budget, None, self.live_pids, profile, self.live_reserves)
        self._materializer = Materializer(store, store, cipher, artifacts, self.admission, profile,
                                          baseline=baseline, log=log, make_room=self._make_room)
        self.dispatcher = LocalRunDispatcher(store, self._materializer, self._coordinator, self.admission,
                                             profile.dispatch_page)

    def waits(self) -> dict[str, int]:
        """Reason → Runs journaled as ``run.waiting`` (held back by admission) since start."""
        return self._materializer.waits

    def artifact_bytes(self) -> int:
        """Bytes of every log Artifact under the artifact root."""
        return self._artifacts.used_bytes()

    # -- lifecycle hooks for the loop -----------------------------------------------------------
    def recover(self) -> dict[str, int]:
        """Restart recovery: stale Artifacts of never-started Attempts, then live Attempts."""
        for aid in self._store.claimed_attempt_ids():
            self._artifacts.discard_attempt(aid)
        return self._coordinator.recover()

    def pidfds(self) -> dict[int, str]:
        """fd → attempt ID to watch (shims' pidfds, starts in flight); events go to ``on_exit``."""
        return self._coordinator.pidfds()

    def on_exit(self, attempt_id: str) -> str | None:
        return self._coordinator.on_exit(attempt_id)

    def tick(self) -> None:
        self._coordinator.tick()

    def sweep_cancels(self) -> int:
        return self._coordinator.sweep_cancels()

    def next_wakeup_us(self) -> int | None:
        times = [t for t in (self._coordinator.next_wakeup_us(), self._store.next_backoff_us()) if t is not None]
        return min(times) if times else None

    def reap_orphans(self) -> int:
        """As PID 1 of a PID namespace: reap re-parented orphans (``ProcessPort.reap_orphans``)."""
        return self._procs.reap_orphans()

    def live_count(self) -> int:
        """Runs this process follows: running, or their shim still starting."""
        return len(self._coordinator.live) + len(self._coordinator.starting)

    def live_pids(self) -> list[int]:
        return [lr.shim_pid for lr in self._coordinator.live.values()]

    def live_reserves(self) -> list[int | None]:
        """Memory admission holds for each live Run, a starting one included (bytes; None:
        re-attached after a restart)."""
        return [r.memory_reserve for r in (*self._coordinator.live.values(), *self._coordinator.starting.values())]

    def starts_in_flight(self) -> int:
        """Runs whose shim is starting (the claim is committed, the exec not reported yet)."""
        return len(self._coordinator.starting)

    def stop_all(self, reason: str, grace_s: float) -> None:
        self._coordinator.stop_all(reason, int(grace_s * 1_000_000))

    def abandon_all(self) -> None:
        """Stop tracking live Runs at shutdown (their shims still write receipts, which the
        next start ingests)."""
        self._coordinator.abandon()

    def _make_room(self, quota_bytes: int, refusal: Refusal) -> None:
        """Before ``refusal`` (space or the logs' total quota) holds a Run: the agent's own oldest
        ended logs go (ArtifactPort.make_room), journaled with what they gave back."""
        removed, freed = self._artifacts.make_room(quota_bytes, self._store.retention_entries())
        if removed:
            self._store.forget_artifacts(removed)
            self._log("notice", "retention.pruned", logs=len(removed), bytes=freed, reason=refusal.reason,
                      free_bytes=refusal.free_bytes, needed_bytes=refusal.needed_bytes, path=refusal.path,
                      attempts=",".join(removed))

    def prune(self, keep_per_task: int, max_total_bytes: int) -> int:
        """Retention: delete the oldest ended logs beyond the rule; returns how many."""
        removed = self._artifacts.prune(keep_per_task, max_total_bytes, self._store.retention_entries())
        if removed:
            self._store.forget_artifacts(removed)
        return len(removed)
