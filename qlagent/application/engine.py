"""The local execution engine: wires store, materialiser, coordinator and dispatcher.

``Engine`` holds the coordinator and the filesystem/process adapters privately and exposes
only ``dispatcher`` (ADR-0071 §1: callers cannot reach the launcher, coordinator or candidate
reads) plus the lifecycle hooks the service loop needs (exits, ticks, recovery, drain).
"""

from __future__ import annotations

import os
import pwd

from ..adapters import processes
from ..adapters.artifacts import ArtifactAllocator, ArtifactExistsError, UnsafeDirectoryError
from ..adapters.sqlite import execution as ex
from ..core.dispatch import Candidate, LaunchCommand, Plan
from ..core.errors import QlError, StartError
from ..core.profiles import Profile
from ..dispatch.dispatcher import LocalRunDispatcher
from ..dispatch.materializer import Materializer
from ..execution.coordinator import LocalExecutionCoordinator, start_code
from .execution_store import SqliteExecutionStore
from .store import LocalStore, now_us

WRAPPER_LINGER_S = 2.0


def baseline_env(uid: int | None = None) -> dict[str, str]:
    """HOME, USER, LOGNAME and SHELL of the run user's passwd entry (the agent's effective uid),
    as cron and systemd give them; {} when the uid has no entry. A recipe value overrides each."""
    try:
        pw = pwd.getpwuid(os.geteuid() if uid is None else uid)
    except KeyError:
        return {}
    return {"HOME": pw.pw_dir or "/", "USER": pw.pw_name, "LOGNAME": pw.pw_name, "SHELL": pw.pw_shell or "/bin/sh"}


class ArtifactAdapter:
    """core.ports.ArtifactPort over adapters.artifacts.ArtifactAllocator."""

    def __init__(self, allocator: ArtifactAllocator) -> None:
        self._a = allocator
        self._admission = None

    def admit(self, quota_bytes: int) -> str | None:
        adm = self._a.admit(quota_bytes)
        self._admission = adm if adm.ok else None
        return adm.reason

    def allocate(self, attempt_id: str) -> str:
        try:
            return self._a.allocate(attempt_id, self._admission)
        except ArtifactExistsError as e:
            raise StartError(e.message, code="artifact_unusable") from None

    def discard(self, path: str) -> None:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


class ProcessAdapter:
    """core.ports.ProcessPort over adapters.processes (launcher wrapper, process trees)."""

    def __init__(self, allocator: ArtifactAllocator, python: str | None = None) -> None:
        self._alloc = allocator
        self._python = python or processes.default_python()
        self._handles: dict[int, processes.WrapperHandle] = {}
        self._known: dict[str, dict] = {}         # attempt → processes seen when first signalled
        self._started: dict[str, float] = {}

    def _run_dir(self, attempt_id: str) -> str:
        return os.path.join(self._alloc.runs_root, attempt_id)

    def spawn(self, cmd: LaunchCommand) -> tuple[int, float]:
        attempt_id = cmd.candidate.attempt_id
        try:
            run_dir = self._alloc.run_dir(attempt_id)
        except UnsafeDirectoryError as e:
            raise StartError(e.message, code="run_dir_unsafe") from None
        spec = {"attempt_id": attempt_id, "argv": list(cmd.argv), "env": cmd.env, "cwd": cmd.cwd,
                "run_dir": run_dir, "artifact_path": cmd.artifact_path, "quota_bytes": cmd.quota_bytes,
                "linger_s": WRAPPER_LINGER_S, "umask": cmd.umask, "grace_s": cmd.grace_ms / 1000,
                "keep_orphans": cmd.keep_orphans}
        program = processes.compiled_shim(self._alloc.runs_root, self._python)
        try:
            h = processes.spawn_wrapper(spec, self._python, program=program)
        except QlError as e:              # spec over its bound, no interpreter
            raise StartError(f"shim: {e.message}", code="shim_failed") from None
        if h.start_error is not None:
            h.popen.wait()                # it writes its receipt and exits at once
            h.close()
            raise StartError(h.start_error, code=start_code(h.start_error))
        self._handles[h.pid] = h
        self._started[attempt_id] = h.create_time
        return h.pid, h.create_time

    def watch(self, pid: int) -> int | None:
        h = self._handles.get(pid)
        if h is not None:
            fd, h.pidfd = h.pidfd, None   # the coordinator owns and closes it from here on
            return fd
        try:
            return os.pidfd_open(pid)
        except (AttributeError, OSError):
            return None

    def alive(self, pid: int, create_time: float) -> bool:
        return processes.process_matches(pid, create_time)

    def reap(self, pid: int) -> None:
        h = self._handles.pop(pid, None)
        if h is not None:
            h.popen.wait()

    def signal_run(self, attempt_id: str, wrapper_pid: int | None, sig: int) -> int:
        try:
            pgid = processes.read_task_pid(self._run_dir(attempt_id))
        except processes.RunFileError:
            pgid = None
        known = self._known.setdefault(attempt_id, {})
        if wrapper_pid is None:
            # The wrapper is gone (died, or a previous agent's run is lost): its tree can no
            # longer be walked, so find the run's processes by their QL3_ATTEMPT_ID.
            known.update(processes.find_by_attempt(attempt_id))
        return len(processes.signal_tree(pgid, wrapper_pid, sig, self._started.get(attempt_id), known))

    def collect(self, attempt_id: str) -> tuple[dict | None, dict | None]:
        run_dir = self._run_dir(attempt_id)
        try:
            return processes.read_receipt(run_dir), processes.read_truncation(run_dir)
        except processes.RunFileError:
            return None, None

    def cleanup(self, attempt_id: str) -> None:
        self._known.pop(attempt_id, None)
        self._started.pop(attempt_id, None)
        processes.remove_run_dir(self._run_dir(attempt_id))


class Admission:
    """core.ports.Admission for one service: drain flag, concurrency, budget, task gates."""

    def __init__(self, xstore: SqliteExecutionStore, profile: Profile, max_concurrent: int,
                 budget=None, network=None) -> None:
        self._x = xstore
        self._profile = profile
        self.max_concurrent = max_concurrent
        self.budget = budget              # service.budget.BudgetMeter or None
        self.network = network            # service.netgate.NetworkGate or None
        self.draining = False
        self.last_block: str | None = None
        self.live_roots = lambda: []          # wrappers re-attached after a restart: not our children

    def global_block(self) -> str | None:
        reason = None
        if self.draining:
            reason = "draining"
        elif self._x.active_count() >= self.max_concurrent:
            reason = "concurrency"
        elif self.budget is not None:
            reason = self.budget.block_reason(self.live_roots())
        self.last_block = reason
        return reason

    def run_block(self, c: Candidate, plan: Plan) -> str | None:
        if plan.concurrency == "single" and self._x.task_live_count(c.task_id):
            return "single_instance"
        if plan.network_require != "none":
            if self.network is None:
                return "network_unknown"
            if not self.network.satisfied(plan.network_require, plan.network_interface):
                return "network"
        return None


class Engine:
    """Everything that executes Runs for one process (service or ``run start --wait``)."""

    def __init__(self, store: LocalStore, *, profile: Profile, artifact_dir: str, runs_dir: str, key_file: str,
                 max_concurrent: int, log=lambda *a, **k: None, budget=None, network=None,
                 clock_us=now_us) -> None:
        self._store = store
        self._x = SqliteExecutionStore(store, key_file, clock_us)
        self._alloc = ArtifactAllocator(artifact_dir, profile, runs_root=runs_dir)
        self._procs = ProcessAdapter(self._alloc)
        self._coordinator = LocalExecutionCoordinator(self._x, self._procs, clock_us, log)
        self.admission = Admission(self._x, profile, max_concurrent, budget, network)
        self.admission.live_roots = self.live_pids
        self.dispatcher = LocalRunDispatcher(
            self._x, Materializer(self._x, ArtifactAdapter(self._alloc), self.admission, profile,
                                  baseline=baseline_env(), log=log),
            self._coordinator, self.admission, profile.dispatch_page)
        self._log = log

    # -- lifecycle hooks for the loop -----------------------------------------------------------
    def recover(self) -> dict[str, int]:
        """Restart recovery: stale Artifacts of never-started Attempts, then live Attempts."""
        for aid in self._x.claimed_attempt_ids():
            try:
                os.unlink(self._alloc.artifact_path(aid))
            except FileNotFoundError:
                pass
        counts = self._coordinator.recover()
        return counts

    def pidfds(self) -> dict[int, str]:
        return self._coordinator.pidfds()

    def on_exit(self, attempt_id: str) -> str | None:
        return self._coordinator.on_exit(attempt_id)

    def tick(self) -> None:
        self._coordinator.tick()

    def sweep_cancels(self) -> int:
        return self._coordinator.sweep_cancels()

    def next_wakeup_us(self) -> int | None:
        times = [t for t in (self._coordinator.next_wakeup_us(), self._x.next_backoff_us()) if t is not None]
        return min(times) if times else None

    def live_count(self) -> int:
        return len(self._coordinator.live)

    def live_pids(self) -> list[int]:
        return [lr.wrapper_pid for lr in self._coordinator.live.values()]

    def stop_all(self, reason: str, grace_s: float) -> None:
        self._coordinator.stop_all(reason, int(grace_s * 1_000_000))

    def abandon_all(self) -> None:
        """Stop tracking live Runs at shutdown (their wrappers still write receipts, which the
        next start ingests)."""
        for lr in list(self._coordinator.live.values()):
            if lr.pidfd is not None:
                os.close(lr.pidfd)
        self._coordinator.live.clear()

    def prune(self, keep_per_task: int, max_total_bytes: int) -> int:
        """Retention: delete the oldest ended logs beyond the rule; returns how many."""
        entries = self._store.read(ex.retention_entries)
        removed = self._alloc.prune(keep_per_task, max_total_bytes, entries)
        if removed:
            self._store.write(lambda c: ex.forget_artifacts(c, [r.attempt_id for r in removed]))
        return len(removed)

    @property
    def candidate_queries(self) -> int:
        return self._x.queries
