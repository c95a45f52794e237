"""A run's shim on the Worker: spawn, watch, exit and receipt (issue 11 §3–4)."""

from __future__ import annotations

import select
import selectors

import msgspec

from ..core.cluster import ExecutionSpec
from ..core.errors import StartError
from ..core.limits import SHIM_START_BOUND_US
from ..core.receipt import QUOTA, start_code, truncation_of
from ..core.inbox_states import InboxState, OutcomeKind
from ..core.states import KillReason
from .job import Job, Owed
from .stops import STOP_TAIL_US


class SpawnDuty:
    """One duty of ``worker.runtime.WorkerRuntime`` (a mixin over the runtime's state: ``jobs``,
    ``inbox``, ``runs``, ``client``, ``session``): the shims, started from the loop's selector
    like the local agent's (``j.shim_start`` until the task was exec'd, then ``j.handle``)."""

    def _spawn(self, j: Job) -> None:
        """Ask for the run's shim; the start goes on from the loop (``_on_start``), which never
        waits for it: the shim's PID, its exec and the ``running`` ACK come as their fds become
        readable."""
        if self.stopping or j.cancel:
            self._start_failed(j, "cancelled" if j.cancel else "worker_stopping")
            return
        if j.secrets is None and j.spec.secret_refs:
            # Secret values are never on disk: after a restart before the spawn they are gone.
            self._start_failed(j, "secrets_unavailable")
            return
        self._bound_log_store(j.spec.log_quota_bytes)
        try:
            self.runs.make_run_dir(j.attempt_id)
            j.shim_start = self.runs.begin(j.spec, j.secrets or {}, self._lease_stop_at(j))
        except StartError as e:
            self._start_error(j, e)
            return
        finally:
            j.secrets = None
        j.start_deadline_us = self.now() + SHIM_START_BOUND_US
        self._watch_start(j)

    def _watch_start(self, j: Job) -> None:
        j.start_fd = j.shim_start.fd
        if j.start_fd is not None:
            self.sel.register(j.start_fd, selectors.EVENT_READ, ("start", j.offer_id))

    def _on_start(self, j: Job, expired: bool = False) -> None:
        """The start's fd is readable, it has none (looked at once a second) or its bound passed
        (``expired``): take in what the shim reported."""
        if j.start_fd is not None:
            self.sel.unregister(j.start_fd)       # before advance, which may close it
            j.start_fd = None
        try:
            h = self.runs.advance(j.attempt_id, j.shim_start, expired)
        except StartError as e:
            j.shim_start = None
            self._start_error(j, e)
            self._send_owed()
            return
        if h is None:
            self._watch_start(j)
            return
        j.shim_start = None
        j.handle = h
        j.deadline_us = self.now() + j.spec.timeout_ms * 1000
        if self.stop_deadline_us is not None:     # the drain began while it started
            j.deadline_us = min(j.deadline_us, self.stop_deadline_us - STOP_TAIL_US)
        j.entry = self.inbox.advance(j.offer_id, InboxState.STARTED)
        if not j.gone:
            j.owed.add(Owed.RUNNING_ACK)
        self.counts["spawned"] += 1
        self._watch(j)
        self.log("info", "worker.run_started", attempt=j.attempt_id, pid=h.pid)
        # What came while it started: a renewal (the shim's lease file), a lost Lease, a cancel.
        self._tell_shim(j)
        if j.fenced and j.kill_reason is None:
            self._stop(j, None)
        elif j.cancel:
            self._stop(j, KillReason.CANCEL)
        self._send_owed()

    def _start_error(self, j: Job, e: StartError) -> None:
        code = start_code(e.message) if e.code == "start" else e.code
        self.log("warning", "worker.start_failed", attempt=j.attempt_id, reason=code, error=e.message)
        self._start_failed(j, code)

    def _within_profile(self, spec: ExecutionSpec) -> ExecutionSpec:
        """The spec as this Worker runs it: a log quota above its Profile's ``log_max_bytes`` is
        cut to it (the truncation fact then names that quota). The inbox keeps the spec as
        offered: its digest is what the control plane signed off."""
        if spec.log_quota_bytes <= self.log_max_bytes:
            return spec
        return msgspec.structs.replace(spec, log_quota_bytes=self.log_max_bytes)

    def _start_failed(self, j: Job, code: str) -> None:
        j.entry = self.inbox.advance(j.offer_id, InboxState.COMPLETED,
                                       {"kind": OutcomeKind.START_FAILURE, "startError": code})
        j.owed.add(Owed.COMPLETION_ACK)
        j.owed.discard(Owed.LOG)

    def _watch(self, j: Job) -> None:
        if j.handle.pidfd is not None:
            self.sel.register(j.handle.pidfd, selectors.EVENT_READ, ("pidfd", j.offer_id))

    def _on_exit(self, j: Job) -> None:
        self._reap(j)
        self._send_owed()

    def _reap(self, j: Job) -> None:
        """The shim ended: its pidfd unwatched, its outcome kept (``_complete``); nothing sent."""
        h = j.handle
        if h.pidfd is not None:
            self.sel.unregister(h.pidfd)
        self.runs.finished(h)
        j.handle = None
        self._complete(j)

    def _exited(self, j: Job) -> bool:
        """Has ``j``'s shim ended (its pidfd readable, else its process gone)? Never waits."""
        h = j.handle
        if h.pidfd is not None:
            return bool(select.select([h.pidfd], [], [], 0)[0])
        return not self.runs.alive(h)

    def _complete(self, j: Job) -> None:
        """The shim ended: its receipt becomes the row's outcome (kept until acknowledged)."""
        receipt, trunc = self.runs.collect(j.attempt_id)
        trunc = truncation_of(receipt, trunc)
        if receipt is None:
            self.runs.kill_orphans(j.attempt_id)
        if receipt is not None and receipt.lease_lost and not j.fenced:
            # The shim fenced it by itself (this Worker was down or late): the Lease is lost.
            j.fence()
            self.counts["fenced"] += 1
            self.log("warning", "worker.lease_lost", attempt=j.attempt_id, action="killed_by_shim")
        if receipt is None or (j.fenced and j.gone):
            # A shim that died without a receipt leaves the ending to the control plane's
            # sweeper; a Lease the control plane already ended takes no more chunks.
            self._close_row(j, {"kind": OutcomeKind.FENCED if j.fenced else OutcomeKind.LOST})
            return
        if j.fenced:
            # Self-fenced before its Lease expired: no completion is sent (the Attempt is
            # re-offered), but the log goes up while the Lease still takes chunks.
            j.entry = self.inbox.advance(j.offer_id, InboxState.COMPLETED, {"kind": OutcomeKind.FENCED})
            return
        if receipt.start_error:
            self._start_failed(j, start_code(receipt.start_error))
        else:
            out = {"kind": OutcomeKind.COMPLETION, "exitCode": receipt.exit_code, "signal": receipt.signal,
                   "killReason": j.kill_reason, "bytesKept": receipt.bytes_kept,
                   "bytesDropped": receipt.bytes_dropped, "peakRssBytes": receipt.peak_rss_bytes,
                   "cpuTimeUs": receipt.cpu_time_us, "truncated": trunc is not None,
                   # Sent only when not the quota: the control plane's default.
                   "truncationReason": trunc.reason if trunc is not None and trunc.reason != QUOTA else None}
            out = {k: v for k, v in out.items() if v is not None}
            j.entry = self.inbox.advance(j.offer_id, InboxState.COMPLETED, out)
            if j.gone:
                j.owed.discard(Owed.COMPLETION_ACK)
            else:
                j.owed.add(Owed.COMPLETION_ACK)
            self.counts["completed"] += 1
            self.log("info", "worker.run_ended", attempt=j.attempt_id, exit=receipt.exit_code,
                     signal=receipt.signal, kill_reason=j.kill_reason, truncated=trunc is not None)
        if j.gone:
            # A run kept (on_lease_loss = "keep") after its Lease was gone owes nothing (nothing
            # more is sent for it): its row closes now, or it would hold an inbox row for ever.
            self._acked(j)

