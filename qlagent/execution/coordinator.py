"""LocalExecutionCoordinator: the only owner of Attempt/Run transitions after dispatch.

It starts a shim for a LaunchCommand (after winning the claimed → starting CAS),
consumes completion receipts, follows timeouts (the shim enforces a Run's timeout itself, so
that it holds while no agent runs: ``ProcessPort.begin``; the agent only records it, and
stops a shim's task itself — SIGTERM to the task's process group and every escaped
descendant, SIGKILL after the grace — only for a shim that does not hold its deadline),
carries out cancellation and the shutdown drain, and reconciles every starting/running Attempt
on restart: receipt → ingest; shim alive (PID + start time) → re-attach; a start that provably
never reached its task's exec (``ProcessPort.fence_unstarted``) → ended ``start_failed``
(reason ``agent_restart``) and the Run queued again for a new Attempt; otherwise → ``lost``,
with a ``run.lost`` journal line; then the agent's tasks of any other Attempt are killed
(``ProcessPort.stop_strays``). It has no timer or thread: the service loop asks
``next_wakeup_us()`` and calls ``tick()`` / ``on_exit()``.

Re-queueing only a start that never reached the exec follows ADR-0014's recovery rule ("恢复只覆盖
Attempt 尚为 claimed 的窗口 … 已 ACK starting 后不再重发 ExecutionSpec": a crash is recovered by
sending the start again only while nothing can have come of it; an Attempt that may have run is
never started again by recovery), with the exec, not the ``starting`` record, as the line here.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from ..core.dispatch import Finish, LaunchCommand
from ..core.errors import StartError, UnavailableError
from ..core.limits import SHIM_START_BOUND_US
from ..core.models import RetryPolicy
from ..core.receipt import bounded, start_code, truncation_of
from ..core.states import AttemptState, KillReason, RunState, outcome

if TYPE_CHECKING:   # ports are annotations only: no Protocol class at run time
    from ..core.ports import ExecutionStore, ProcessPort
    from ..core.receipt import Receipt

POLL_WITHOUT_PIDFD_US = 1_000_000     # only where the kernel has no pidfd_open (< 5.3)
# A start that never reached its task's exec is no try of the task: its Run is queued again
# whatever the Task's retry policy, at once (the Attempt after it follows the policy again).
_REQUEUE = RetryPolicy(max_attempts=2**31 - 1, backoff_ms=0)
_NOT_STARTED = "agent: stopped before the shim reached the task's exec; the Run is queued again"


def _mono_us() -> int:
    """The start bound's clock (µs): monotonic, so that a step of the store clock (a router's
    first NTP answer moves it by years) neither ends a start in flight nor extends one."""
    return time.monotonic_ns() // 1000


class TrackedAttempt:
    """In-memory view of one running Attempt (the store stays the authority)."""

    __slots__ = ("run_id", "attempt_id", "task_id", "revision", "shim_pid", "create_time", "pidfd",
                 "deadline_us", "grace_us", "kill_reason", "kill_at_us", "stopped_at_us", "retry",
                 "memory_reserve", "shim_deadline")

    def __init__(self, run_id, attempt_id, task_id, revision, shim_pid, create_time, pidfd, deadline_us,
                 grace_us, retry, memory_reserve=None, shim_deadline=True) -> None:
        self.run_id, self.attempt_id, self.task_id, self.revision = run_id, attempt_id, task_id, revision
        self.shim_pid, self.create_time, self.pidfd = shim_pid, create_time, pidfd
        self.deadline_us, self.grace_us, self.retry = deadline_us, grace_us, retry
        self.memory_reserve: int | None = memory_reserve   # bytes admission holds; None after a re-attach
        self.kill_reason: str | None = None
        self.kill_at_us: int | None = None
        self.stopped_at_us: int | None = None     # when kill_reason was set (store clock, µs)
        self.shim_deadline = shim_deadline        # the shim stops the task at the timeout itself


class StartingAttempt:
    """A claimed Attempt whose shim is starting (``LocalExecutionCoordinator.start``): what
    recording it running needs, never its environment (secrets stay in the spec pipe).
    ``bound_at_us`` (monotonic µs, ``_mono_us``) bounds the start; ``stop`` is (reason, grace µs or None:
    the task's own) once a cancel or the drain came first."""

    __slots__ = ("candidate", "bound_at_us", "timeout_us", "grace_us", "retry", "memory_reserve", "stop")

    def __init__(self, candidate, bound_at_us, timeout_us, grace_us, retry, memory_reserve) -> None:
        self.candidate, self.bound_at_us, self.timeout_us = candidate, bound_at_us, timeout_us
        self.grace_us, self.retry, self.memory_reserve = grace_us, retry, memory_reserve
        self.stop: tuple[str, int | None] | None = None


class LocalExecutionCoordinator:
    def __init__(self, store: ExecutionStore, procs: ProcessPort, clock_us: Callable[[], int],
                 log: Callable[..., None] = lambda *a, **k: None) -> None:
        self._store = store
        self._procs = procs
        self._now = clock_us
        self._log = log
        self.live: dict[str, TrackedAttempt] = {}
        self.starting: dict[str, StartingAttempt] = {}
        # Start failures the store could not record (run ID, attempt ID, Finish, retry policy).
        self.unrecorded: list[tuple] = []

    # ---- start ---------------------------------------------------------------------------
    def start(self, cmd: LaunchCommand) -> tuple[str, str | None]:
        """ADR-0071 §4 step 8. Returns ("activated", None), ("race_lost", None) or
        ("launch_failed", reason code). Spawns at most once per Attempt: the CAS comes first.
        "activated": the claim is committed and the shim asked for; the start goes on from the
        loop (``pidfds``/``on_exit``), which records the Run running only once the shim
        reported the exec. A start failure, now or then, ends the Attempt ``start_failed``
        with its reason (a ``run.start_failed`` RunEvent and a warning), and there is no
        ``run.running`` event."""
        c = cmd.candidate
        if not self._store.claim_starting(c, cmd.artifact_path):
            return "race_lost", None
        try:
            self._procs.begin(cmd)
        except StartError as e:
            self._start_failed(c.run_id, c.attempt_id, e, cmd.retry)
            return "launch_failed", e.code
        self.starting[c.attempt_id] = StartingAttempt(c, _mono_us() + SHIM_START_BOUND_US, cmd.timeout_ms * 1000,
                                                      cmd.grace_ms * 1000, cmd.retry, cmd.memory_reserve)
        return "activated", None

    def _start_failed(self, run_id: str, attempt_id: str, e: StartError, retry) -> str:
        """Record a start that failed; returns the Run state. Raises UnavailableError when the
        store cannot record it yet (``tick`` records it then)."""
        text = bounded(str(e))
        f = Finish(AttemptState.START_FAILED, failure_reason=e.code, start_error=text)
        try:
            state = self._store.finish(run_id, attempt_id, f, None, retry)
        except UnavailableError:
            # Nothing runs; the store cannot say so yet: tick() records it once it can.
            self.unrecorded.append((run_id, attempt_id, f, retry))
            raise
        if e.code != "run_dir_unsafe":     # never remove a directory we refused to use
            self._procs.cleanup(attempt_id)
        self._log("warning", "run.start_failed", run=run_id, attempt=attempt_id, reason=e.code, error=text)
        return state

    def _advance(self, attempt_id: str, expired: bool = False) -> str | None:
        """Take in the news of a start in flight; returns the Run state when it failed (its
        slot is free again), else None."""
        sa = self.starting[attempt_id]
        c = sa.candidate
        try:
            started = self._procs.advance(attempt_id, expired)
        except StartError as e:
            del self.starting[attempt_id]
            return self._start_failed(c.run_id, attempt_id, e, sa.retry)
        if started is None:
            return None
        del self.starting[attempt_id]
        pid, ctime = started
        now = self._now()
        deadline = now + sa.timeout_us
        # Tracked before the write: if the store cannot record it running, the shim's end is
        # still collected (on_exit) and recorded once the store takes writes.
        lr = self.live[attempt_id] = TrackedAttempt(c.run_id, attempt_id, c.task_id, c.task_revision, pid, ctime,
                                                    self._procs.watch(pid), deadline, sa.grace_us, sa.retry,
                                                    sa.memory_reserve)
        self._store.mark_running(c, pid, ctime, deadline)
        self._log("info", "run.started", run=c.run_id, attempt=attempt_id, pid=pid)
        if sa.stop is not None:            # cancelled or drained while it started
            self._stop(lr, sa.stop[0], now, sa.stop[1])
        return None

    # ---- completion ----------------------------------------------------------------------
    def on_exit(self, attempt_id: str) -> str | None:
        """A fd of ``pidfds`` is readable. For a start in flight: its news (see ``start``);
        returns the Run state if the start failed. Otherwise the shim ended: ingest its
        receipt and truncation fact; returns the Run state. Raises UnavailableError when the
        store cannot record it; the Attempt then stays live and its receipt is ingested by a
        later ``tick``."""
        if attempt_id in self.starting:
            return self._advance(attempt_id)
        lr = self.live.pop(attempt_id, None)
        if lr is None:
            return None
        self._procs.reap(lr.shim_pid)
        receipt, trunc = self._procs.collect(attempt_id)
        if receipt is None:
            # Shim died without a receipt: stop whatever it left and call the Attempt lost.
            self._procs.signal_run(attempt_id, None, signal.SIGKILL)
            f = Finish(AttemptState.LOST, failure_reason="shim_died")
        else:
            # A task that had ended before it was stopped (its shim waited for room to write
            # the receipt, a full file system) keeps its own outcome.
            ended_first = lr.stopped_at_us is not None and receipt.ended_at_us is not None \
                and receipt.ended_at_us < lr.stopped_at_us
            f = self._finish_from_receipt(receipt, None if ended_first else lr.kill_reason)
        try:
            retry = lr.retry or self._store.retry_policy(lr.task_id, lr.revision)
            state = self._store.finish(lr.run_id, attempt_id, f, truncation_of(receipt, trunc), retry)
        except UnavailableError:
            # The store takes no writes (its file system is full): the receipt stays in the run
            # directory and tick() offers it again every POLL_WITHOUT_PIDFD_US until it does.
            if lr.pidfd is not None:
                os.close(lr.pidfd)
                lr.pidfd = None
            lr.deadline_us = lr.kill_at_us = None   # it has ended: nothing left to time out or kill
            self.live[attempt_id] = lr
            raise
        self._procs.cleanup(attempt_id)
        if lr.pidfd is not None:
            os.close(lr.pidfd)
        if f.start_error:
            self._log("warning", "run.start_failed", run=lr.run_id, attempt=attempt_id, reason=f.failure_reason,
                      error=f.start_error)
        self._log("info" if state == RunState.SUCCEEDED else "warning", f"run.{state}", run=lr.run_id,
                  exit=f.exit_code, signal=f.exit_signal, orphans=f.orphans_stopped, reason=f.failure_reason,
                  peak_rss=f.peak_rss_bytes if f.failure_reason == "oom_killed" else None)
        return state

    @staticmethod
    def _finish_from_receipt(r: Receipt, kill_reason: str | None) -> Finish:
        error = bounded(r.start_error) if r.start_error is not None else None
        # The shim's own timeout stop counts as the agent's (it may have happened with no agent).
        kill_reason = kill_reason or (KillReason.TIMEOUT if r.deadline_passed else None)
        st = outcome(r.exit_code, r.signal, error, kill_reason)
        # A kill of ours (timeout, cancel) names itself; the kernel's OOM kill is the shim's finding.
        reason = start_code(error) if error else kill_reason or ("oom_killed" if r.oom_killed else None)
        return Finish(st, exit_code=r.exit_code, exit_signal=r.signal, bytes_kept=r.bytes_kept,
                      bytes_dropped=r.bytes_dropped, peak_rss_bytes=r.peak_rss_bytes, cpu_time_us=r.cpu_time_us,
                      ended_at_us=r.ended_at_us, failure_reason=reason,
                      start_error=error, orphans_stopped=r.orphans_stopped)

    # ---- time, cancellation, shutdown ----------------------------------------------------
    def _stop(self, lr: TrackedAttempt, reason: str, now: int, grace_us: int | None = None) -> None:
        if lr.kill_reason is None:
            lr.kill_reason = reason
            lr.stopped_at_us = now
            lr.kill_at_us = now + (lr.grace_us if grace_us is None else grace_us)
            n = self._procs.signal_run(lr.attempt_id, lr.shim_pid, signal.SIGTERM)
            self._log("notice", "run.stopping", run=lr.run_id, reason=reason, signalled=n)

    def tick(self) -> None:
        """Enforce deadlines and SIGKILL escalations that are due; poll exits without pidfd;
        record start failures the store could not take (raises UnavailableError while it cannot)."""
        while self.unrecorded:
            run_id, attempt_id, f, retry = self.unrecorded[0]
            self._store.finish(run_id, attempt_id, f, None, retry)
            self.unrecorded.pop(0)
            if f.failure_reason != "run_dir_unsafe":
                self._procs.cleanup(attempt_id)
            self._log("warning", "run.start_failed", run=run_id, attempt=attempt_id, reason=f.failure_reason,
                      error=f.start_error)
        mono = _mono_us()
        for aid, sa in list(self.starting.items()):
            if mono >= sa.bound_at_us or self._procs.start_fd(aid) is None:
                self._advance(aid, expired=mono >= sa.bound_at_us)
        now = self._now()
        for lr in list(self.live.values()):
            if lr.kill_at_us is not None and now >= lr.kill_at_us:
                self._procs.signal_run(lr.attempt_id, lr.shim_pid, signal.SIGKILL)
                lr.kill_at_us = None
            elif lr.kill_reason is None and lr.deadline_us is not None and now >= lr.deadline_us:
                if lr.shim_deadline:
                    # The shim signalled at its own instant (≤ this one): recorded, not sent again.
                    lr.kill_reason, lr.stopped_at_us = KillReason.TIMEOUT, now
                    self._log("notice", "run.stopping", run=lr.run_id, reason=KillReason.TIMEOUT, by="shim")
                else:
                    self._stop(lr, KillReason.TIMEOUT, now)
            if lr.pidfd is None and not self._procs.alive(lr.shim_pid, lr.create_time):
                self.on_exit(lr.attempt_id)

    def next_wakeup_us(self) -> int | None:
        """The earliest instant ``tick`` has work (deadline, escalation or a pidfd-less poll)."""
        mono = _mono_us()
        times = [self._now() + max(0, sa.bound_at_us - mono) for sa in self.starting.values()]
        if any(self._procs.start_fd(aid) is None for aid in self.starting):
            times.append(self._now() + POLL_WITHOUT_PIDFD_US)
        for lr in self.live.values():
            if lr.kill_at_us is not None:
                times.append(lr.kill_at_us)
            elif lr.kill_reason is None and lr.deadline_us is not None:
                times.append(lr.deadline_us)
            if lr.pidfd is None:
                times.append(self._now() + POLL_WITHOUT_PIDFD_US)
        return min(times) if times else None

    def sweep_cancels(self) -> int:
        """Start stopping every live Run whose cancellation was requested (one still starting
        once its task runs); returns how many."""
        wanted = self._store.cancel_requested()
        now = self._now()
        n = 0
        for aid in wanted:
            sa = self.starting.get(aid)
            if sa is not None and sa.stop is None:
                sa.stop = (KillReason.CANCEL, None)
                n += 1
        for aid in wanted:
            lr = self.live.get(aid)
            if lr is not None and lr.kill_reason is None:
                self._stop(lr, KillReason.CANCEL, now)
                n += 1
        return n

    def stop_all(self, reason: str, grace_us: int) -> None:
        """Shutdown drain's last step: stop every live Run (SIGTERM now, SIGKILL after grace)."""
        now = self._now()
        for sa in self.starting.values():
            if sa.stop is None:
                sa.stop = (reason, grace_us)
        for lr in list(self.live.values()):
            self._stop(lr, reason, now, grace_us)

    def pidfds(self) -> dict[int, str]:
        """fd → attempt ID, for the service loop's selector: each live shim's pidfd and each
        start's fd (``ProcessPort.start_fd``); ``on_exit`` takes the events of both."""
        fds = {lr.pidfd: aid for aid, lr in self.live.items() if lr.pidfd is not None}
        for aid in self.starting:
            fd = self._procs.start_fd(aid)
            if fd is not None:
                fds[fd] = aid
        return fds

    def abandon(self) -> None:
        """Stop following every Run (shutdown): the shims carry on and write their receipts,
        which the next start ingests."""
        for aid in self.starting:
            self._procs.abandon_start(aid)
        self.starting.clear()
        for lr in self.live.values():
            if lr.pidfd is not None:
                os.close(lr.pidfd)
        self.live.clear()

    # ---- restart recovery ----------------------------------------------------------------
    def recover(self) -> dict[str, int]:
        """Reconcile every starting/running Attempt left by a previous agent (see module doc).

        Returns counts ``{"ingested", "reattached", "requeued", "lost", "strays"}`` (requeued: starts
        that never reached the exec, their Runs queued again; strays: processes of Attempts nobody
        accounts for, killed: ``ProcessPort.stop_strays``).
        """
        counts = {"ingested": 0, "reattached": 0, "requeued": 0, AttemptState.LOST: 0}
        cancels = self._store.cancel_requested()
        for la in self._store.live_attempts():
            if la.attempt_id in self.live or la.attempt_id in self.starting:
                continue
            receipt, trunc = self._procs.collect(la.attempt_id)
            alive = la.shim_pid is not None and self._procs.alive(la.shim_pid, la.shim_start_time or 0.0)
            if receipt is not None and not alive:
                f = self._finish_from_receipt(receipt, None)
                self._store.finish(la.run_id, la.attempt_id, f, truncation_of(receipt, trunc),
                                   self._store.retry_policy(la.task_id, la.task_revision))
                if f.start_error:
                    self._log("warning", "run.start_failed", run=la.run_id, attempt=la.attempt_id,
                              reason=f.failure_reason, error=f.start_error)
                self._procs.cleanup(la.attempt_id)
                counts["ingested"] += 1
            elif alive:
                _, grace_ms = self._store.timing(la.task_id, la.task_revision)
                lr = TrackedAttempt(la.run_id, la.attempt_id, la.task_id, la.task_revision, la.shim_pid,
                             la.shim_start_time, self._procs.watch(la.shim_pid), la.deadline_at_us,
                             grace_ms * 1000, None, shim_deadline=self._procs.holds_deadline(la.attempt_id))
                self.live[la.attempt_id] = lr
                if la.attempt_id in cancels:
                    self._stop(lr, KillReason.CANCEL, self._now())
                counts["reattached"] += 1
            elif la.state == AttemptState.STARTING and self._procs.fence_unstarted(la.attempt_id):
                if la.cancel_requested:
                    f, retry = Finish(AttemptState.CANCELLED, failure_reason=KillReason.CANCEL), None
                else:
                    f = Finish(AttemptState.START_FAILED, failure_reason="agent_restart", start_error=_NOT_STARTED)
                    retry = _REQUEUE
                state = self._store.finish(la.run_id, la.attempt_id, f, None, retry)
                self._procs.cleanup(la.attempt_id)
                requeued = state == RunState.QUEUED
                self._log("warning", "run.requeued" if requeued else f"run.{state}", run=la.run_id,
                          attempt=la.attempt_id, reason=f.failure_reason)
                counts["requeued"] += requeued
            else:
                self._procs.signal_run(la.attempt_id, None, signal.SIGKILL)
                state = self._store.finish(la.run_id, la.attempt_id,
                                           Finish(AttemptState.LOST, failure_reason="agent_restart"), None,
                                           self._store.retry_policy(la.task_id, la.task_revision))
                self._procs.cleanup(la.attempt_id)
                self._log("warning", f"run.{state}", run=la.run_id, attempt=la.attempt_id, reason="agent_restart")
                counts[AttemptState.LOST] += 1
        # A task no live Attempt accounts for (the state directory was wiped, or its shim died
        # while no agent watched) would run beside the Run's next Attempt: stopped now.
        accounted = set(self.live) | set(self.starting) | {la.attempt_id for la in self._store.live_attempts()}
        strays = self._procs.stop_strays(_Accounted(accounted, self._store))
        for aid, n in sorted(strays.items()):
            self._log("warning", "run.stray_stopped", attempt=aid, processes=n)
        counts["strays"] = sum(strays.values())
        return counts

    def __repr__(self) -> str:
        return f"LocalExecutionCoordinator(live={len(self.live)}, starting={len(self.starting)})"


class _Accounted:
    """The Attempts restart recovery accounts for: the live ones, and an ended one whose Task
    keeps its orphans (the daemon it left on purpose is no stray). Asked only for the Attempt
    IDs the stray scan finds, so the store is read once per tagged process, not for history."""

    __slots__ = ("_live", "_store")

    def __init__(self, live: set[str], store: ExecutionStore) -> None:
        self._live = live
        self._store = store

    def __contains__(self, attempt_id: object) -> bool:
        return attempt_id in self._live or (isinstance(attempt_id, str) and self._store.keeps_orphans(attempt_id))
