"""Self-fencing, timeouts and kills of the Worker's runs (issue 11 §5; ``worker.fencing``)."""

from __future__ import annotations

import signal

from .policy import fencing
from ..core.inbox_states import InboxState, OutcomeKind
from ..core.states import KillReason
from .job import Job, LeaseHold


# A stop (SIGTERM) ends at most this long after ``drain_grace_s``: runs still live then are
# SIGKILLed at the latest STOP_KILL_US after it, and owed ACKs and chunks are sent until it is
# over. The units grant ``drain_grace_s`` + 10 s (TimeoutStopSec, procd's term_timeout): the
# rest is stop-post's TERM → 5 s → KILL of what is left.
STOP_TAIL_US = 4_000_000
STOP_KILL_US = 2_000_000


class StopDuty:
    """One duty of ``worker.runtime.WorkerRuntime`` (a mixin over the runtime's state: ``jobs``,
    ``inbox``, ``runs``, ``client``, ``session``): fencing, timeouts, kills."""

    def _fence_and_time(self, now: int) -> None:
        for j in list(self.jobs.values()):
            if j.shim_start is not None:
                continue                 # decided once it runs (milliseconds; SHIM_START_BOUND_US at most)
            if j.handle is not None:
                if j.kill_at_us is not None and now >= j.kill_at_us:
                    self.runs.signal(j.handle, signal.SIGKILL)
                    j.kill_at_us = None
                if j.kill_reason is None and not j.fenced and j.deadline_us is not None and now >= j.deadline_us:
                    self._stop(j, KillReason.SHUTDOWN if self.stopping else KillReason.TIMEOUT)
            if j.fenced or j.gone or j.entry.state not in InboxState.LIVE:
                continue
            if j.renewal is None and j.stop_at_us is not None:
                # Re-attached after a restart: the instant this run's shim would stop it is
                # the Lease's own (kept across the restart), not the first failed connect.
                if now < j.stop_at_us:
                    continue
                d = fencing.FenceDecision(action=fencing.STOP, stop_at_local_us=j.stop_at_us)
            elif j.renewal is None:
                if j.handle is None or self.session is not None or self.failures["connect"] < self.client.replicas:
                    continue
                # Re-attached after a restart and no replica answered (one failed connect per
                # control_url, so one dead replica of two does not condemn the run): no renewal
                # proves the Lease, so it is treated as lost now.
                d = fencing.FenceDecision(action=fencing.STOP if j.spec.on_lease_loss == "kill" else fencing.KEEP,
                                          stop_at_local_us=now)
            else:
                d = fencing.decide(now, j.renewal, j.spec.on_lease_loss, j.kill_grace_us)
            if d.action == fencing.RUN:
                continue
            if j.handle is not None and self._exited(j):
                # It ended before its fence while a call held the loop: an end, not a loss. Its
                # completion is owed, and accepted while its Lease (named by heartbeats) holds.
                self._reap(j)
                continue
            if j.handle is None:
                # Not spawned yet and the Lease is (about to be) lost: never start it.
                self.log("warning", "worker.lease_lost", attempt=j.attempt_id, action="not_started")
                j.lease = LeaseHold.FENCED_GONE
                self._close_row(j, {"kind": OutcomeKind.FENCED})
            elif d.action == fencing.STOP:
                self.log("warning", "worker.lease_lost", attempt=j.attempt_id, action="kill")
                j.fence()
                self.counts["fenced"] += 1
                self._stop(j, None)
            elif j.lease != LeaseHold.LOST_KEPT:
                self.log("warning", "worker.lease_lost", attempt=j.attempt_id, action="keep")
                j.lease = LeaseHold.LOST_KEPT

    def _stop(self, j: Job, reason: str | None) -> None:
        """SIGTERM the run's tree now, SIGKILL after the spec's grace."""
        if j.kill_reason is None:
            j.kill_reason = reason
        self.runs.signal(j.handle, signal.SIGTERM)
        j.kill_at_us = self.now() + j.spec.grace_ms * 1000
        if self.stop_deadline_us is not None:
            j.kill_at_us = min(j.kill_at_us, self.stop_deadline_us - STOP_TAIL_US + STOP_KILL_US)

    def _stop_at(self, j: Job) -> int | None:
        """When the Worker must begin to stop ``j`` for its Lease (monotonic µs): from its last
        renewal, else (re-attached) the instant its shim's lease file holds, else None."""
        if j.renewal is not None:
            return fencing.stop_at_local_us(j.renewal, j.kill_grace_us)
        return j.stop_at_us

    def _lease_stop_at(self, j: Job) -> int | None:
        """The shim's self-fencing instant for ``j`` (µs): the Worker's own stop instant under
        ``on_lease_loss = "kill"``, None under ``keep`` or before any renewal."""
        if j.spec.on_lease_loss != "kill" or j.renewal is None:
            return None
        return fencing.stop_at_local_us(j.renewal, j.kill_grace_us)

    def _tell_shim(self, j: Job) -> None:
        """A renewal moves the live shim's self-fencing instant (shim "Lease self-fencing"): if
        this Worker dies, the shim stops the run when this Worker would have."""
        stop_at = self._lease_stop_at(j)
        if j.handle is not None and stop_at is not None and not self.runs.set_lease_deadline(j.attempt_id, stop_at):
            self.log("warning", "worker.lease_file_failed", attempt=j.attempt_id)

