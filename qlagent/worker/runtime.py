"""The fleet Worker's loop (issue 11 §1–6; docs/worker-protocol.md "Ordering on the Worker").

One selectors loop, no thread and no busy polling: it sleeps until the next duty (heartbeat,
reconnect, a fencing instant, a timeout, a kill grace) or an event (a shim's start or pidfd, the
Pull's socket, a signal). Duties, in order, on every pass:

1. **Session**: with none (every process start, or the Session was lost), open a new one when
   the backoff (``worker.backoff``, full jitter, capped) allows: ``Hello`` → ``SessionGrant``.
   The hello asks the new Session to adopt the Leases of the rows the Worker still holds
   (``_adopt_claims``: started runs, re-attached or not yet collected, then completions or log
   chunks still owed, then received rows); the control plane re-binds the ones it may keep to the new generation,
   and everything else of the older Sessions is fenced. An adopted row goes on under the new
   Session (owed ACKs and chunks re-sent with its fence); a refused or unnamed one is
   self-fenced (``on_lease_loss``) and what it owed is dropped.
2. **Heartbeat** every ``heartbeat_interval_s`` with jitter (``worker.heartbeat``). It names the
   Leases of this Session the Worker still holds (``_held``: started runs not self-fenced, then
   completions still owed) and the control plane renews exactly those; a run that was
   self-fenced or dropped is left out, so its Lease runs out and the control plane ends the
   Attempt ``lost`` instead of keeping it ``running`` for ever (issue 11 §6). The answer gives
   each renewed Lease its expiry (``worker.fencing.Renewal`` anchored at the send time) and names
   the Attempts whose cancel was requested: their whole process tree is stopped.
3. **Offers** (inbox rows in receipt order): ACK ``starting`` → crash barrier (inbox, fsync'd) →
   run directory (fsync'd) → the shim asked for, its start followed from the selector (no wait
   on a child) → ACK ``running`` once its task was exec'd (``start_failure`` with the reason code
   when it could not start). Secret values live only in memory from the Pull answer to the
   spawn. A restart loses them: before spawning a row it holds under an adopted Lease, the
   Worker sends the Pull that brought it again (pullId and lease token from the row, the
   adopting Session's fence) and the control plane rebuilds the same offer, secret values
   included, while the Attempt is not yet ``running`` (ADR-0108); otherwise the row fails to
   start (``secrets_unavailable``).
4. **Completion** from the shim's receipt → ACK ``completion`` → log chunks (≤ 256 KiB,
   offset-addressed) until the control plane holds every kept byte → row ``acked`` → run
   directory (and its Artifact) removed. Chunks also go up during a run once a whole chunk is
   there. Anything unanswered stays owed and is re-sent (idempotently) after a reconnect or a
   restart.
5. **Self-fencing** (``worker.fencing``): a run whose Lease could not be renewed in time is stopped
   (``on_lease_loss = "kill"``, the spec's; default) or kept and reported (``"keep"``). Under
   ``kill`` each renewal also moves the shim's own self-fencing instant (its lease file): a run
   whose Worker died is stopped by its shim at the instant the Worker would have stopped it, and
   a restarted Worker that re-attached it keeps that instant until it renews the Lease. A run
   with no renewal and no lease file (``keep``) is reported at once when no replica answers.
   A stopped run's log is kept and uploaded while the Lease takes chunks; a log the control
   plane no longer takes is cut with a journaled fact (``worker.log_truncated``), never deleted
   unsent.
6. **Pull** (long-poll, own connection) only while a slot is free, the inbox has room and the
   Session is open; the request (pullId + fresh lease token) is kept in the inbox before it is
   sent, so a retry after a lost answer is byte-identical.

Lease expiry: an offer, a heartbeat answer (each renewed Lease) and an adopting SessionGrant
name it, with the answer's server time (the database clock the client returns with it). Only a
``starting``/``running`` ACK does not: the Worker takes it to grant the TTL learnt from its first offer (``leaseExpiresAtUs``
minus the server time) again from the answer's server time; the fencing safety (1 s) covers
the request's own duration.
"""

from __future__ import annotations

import random
import select
import selectors
import signal
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from ..core.cluster import Hello
from ..core.control import ControlPort, ControlUnreachable, WorkerRunsPort
from ..core.inbox_states import InboxState
from ..core.linelimit import LineLimit
from .job import Job, LeaseHold
from .logs import LogDuty
from .pull import DEFAULT_PULL_WAIT_S, PullDuty
from .recovery import RecoveryDuty
from .sends import SendDuty
from .session import NOT_READY_LOG_US, SessionDuty
from .spawn import SpawnDuty
from .stops import STOP_TAIL_US, StopDuty

if TYPE_CHECKING:       # annotations only: the Worker never loads the store ports
    from ..core.ports import InboxPort

CLOCK_LOOK_US = 1_000_000               # a clock that is not set is looked at again this often (local only)
NO_PIDFD_LOOK_US = 1_000_000


def _mono_us() -> int:
    return time.monotonic_ns() // 1_000


class WorkerRuntime(RecoveryDuty, SessionDuty, StopDuty, PullDuty, SendDuty, SpawnDuty, LogDuty):
    """The Worker over its control client (``core.control.ControlPort``), inbox
    (``core.ports.InboxPort``) and local runs (``core.control.WorkerRunsPort``).

    ``hello`` narrows the enrolment (labels, executors, slots); ``slots`` bounds live runs;
    ``heartbeat_s`` the cadence; ``pull_wait_s`` the long-poll (0..30 s); ``drain_grace_s`` how
    long live runs may go on after SIGTERM before they are stopped (kill reason ``shutdown``);
    ``log_store_bytes`` bounds the logs not yet uploaded, ``log_max_bytes`` (the Worker's Profile)
    one run's log: a spec's larger ``logQuotaBytes`` (a replica of a larger Profile) is cut to it.
    """

    def __init__(self, client: ControlPort, inbox: InboxPort, runs: WorkerRunsPort, *, worker_id: str, hello: Hello, slots: int,
                 heartbeat_s: float = 5.0, pull_wait_s: int = DEFAULT_PULL_WAIT_S, drain_grace_s: float = 20.0,
                 log_store_bytes: int = 64 * 1_048_576, log_max_bytes: int = 4 * 1_048_576,
                 log=lambda *a, **k: None, notify=None, rand=random.random, mono_us=_mono_us) -> None:
        self.client, self.inbox, self.runs = client, inbox, runs
        self.worker_id, self.hello, self.slots = worker_id, hello, slots
        self.heartbeat_s, self.pull_wait_s, self.drain_grace_us = heartbeat_s, pull_wait_s, int(drain_grace_s * 1e6)
        self.log, self.rand, self.now = log, rand, mono_us
        self.notify = notify                            # service.notify.Notifier (watchdog) or None
        self.sel = selectors.DefaultSelector()
        client.idle = self._idle
        self.log_store_bytes, self.log_max_bytes = log_store_bytes, log_max_bytes
        self.session: tuple[str, int] | None = None
        # Consecutive failures per duty (connect, heartbeat, send, pull): each backs off on its own,
        # so chunks refused with 503 do not hold back Pulls or heartbeats.
        self.failures = {"connect": 0, "heartbeat": 0, "send": 0, "pull": 0}
        self.replaced = 0                   # Sessions lost to a newer one in a row (another process)
        self.session_opened_us = 0
        self.unreachable = False                        # the last failure had no answer at all
        self.connected_once = False
        self.tls_refusals = 0                           # start-up connects refused by TLS in a row
        self.clock_offset_us: int | None = None         # database clock − monotonic µs, low estimate
        # Why the Worker is not ready ((code, one line)): the last hello that failed while it has
        # no Session, or a credential refused (401/403) even with one. None once a hello or
        # heartbeat is answered.
        self.blocked: tuple[str, str] | None = None
        self.next_blocked_log_us = 0
        # Refused credentials repeat with every retry: their lines are said once a minute.
        self.auth_lines = LineLimit(1, NOT_READY_LOG_US, mono_us())
        self.session_until_us: int | None = None        # when the Session runs out unrenewed (local µs, early)
        self.clock_wait = False                         # a hello failed on a clock that is not set
        self.next_connect_us = 0
        self.next_beat_us = 0
        self.next_send_us = 0                           # owed sends wait here after a failure
        self.jobs: dict[str, Job] = {}                  # offerId → Job
        self.pull: tuple[str, int] | None = None        # (pullId, fd) in flight
        self.pull_sent_us = 0
        self.next_pull_us = 0
        self.ttl_us = 0
        self.stopping = False
        self.exit_at_us: int | None = None          # serve --exit-after
        self.stop_deadline_us: int | None = None
        self._signals: list[tuple[int, int]] = []     # (signal, arrival monotonic µs)
        self.wakeup = None          # service.signals.SignalWakeup: drained when its key is ready
        self.counts = {"spawned": 0, "reattached": 0, "completed": 0, "fenced": 0, "pulls": 0, "sessions": 0}
        self.heartbeat_rtt_us: int | None = None        # the last answered heartbeat's round trip
        self.surface = None                             # the local HTTP status surface, if any
        # SIGHUP: the service reads the configuration again and journals what it found
        # (``service.worker_mode``); None: nothing to read.
        self.reload_config: Callable[[], None] | None = None

    def attach(self, surface) -> None:
        """Serve ``surface`` (``http.worker_status.WorkerStatusSurface``) from this loop: its keys
        are handed to ``handle_event``, its deadlines bound the select, SIGTERM drains it."""
        self.surface = surface
        surface.register(self.sel)

    def status(self) -> dict:
        """The Worker's status (the local ``GET /api/v3/worker``): ``workerId``, ``control``
        (the control-plane URLs it tries, in order), ``session`` ({sessionId, generation} or None while
        connecting), ``draining``, ``slots``, ``freeSlots``, ``liveRuns`` (spawned, not ended),
        ``inbox`` ({rows, bytes, maxRows, maxBytes, open}: rows and spec bytes kept, their caps,
        rows not yet acknowledged), ``logStore`` ({bytes, maxBytes}: logs not yet uploaded, a
        live run at its quota), ``heartbeatRttS`` (the last answered heartbeat's round trip, s;
        None before one), ``counts`` (since start: spawned, reattached, completed, fenced — runs
        this Worker self-fenced —, pulls, sessions — Sessions opened), ``blocked`` (None, or {code, error}: why it cannot work — the last failed
        hello while it has no Session, a credential the control plane refuses). Never a
        credential, lease token, command or environment."""
        live = sum(1 for j in self.jobs.values() if j.entry.state in InboxState.LIVE)
        rows, used = self.inbox.usage()
        sid_gen = self.session
        if self.session_until_us is not None and self.now() >= self.session_until_us:
            sid_gen = None              # no renewal came in time: the control plane has ended it
        return {"workerId": self.worker_id, "control": list(self.client.urls),
                "session": None if sid_gen is None else {"sessionId": sid_gen[0], "generation": sid_gen[1]},
                "draining": self.stopping, "slots": self.slots, "freeSlots": max(0, self.slots - live),
                "liveRuns": sum(1 for j in self.jobs.values() if j.handle is not None),
                "inbox": {"rows": rows, "bytes": used, "maxRows": self.inbox.max_rows,
                          "maxBytes": self.inbox.max_bytes, "open": len(self.jobs)},
                "logStore": {"bytes": self.log_store_used(), "maxBytes": self.log_store_bytes},
                "heartbeatRttS": None if self.heartbeat_rtt_us is None else self.heartbeat_rtt_us / 1e6,
                "counts": dict(self.counts),
                "blocked": None if self.blocked is None else {"code": self.blocked[0], "error": self.blocked[1]}}

    # ---- the loop ---------------------------------------------------------------------------------
    def _idle(self, fd: int, write: bool, timeout_s: float) -> None:
        """The control client's wait on ``fd`` (``core.control.ControlPort.idle``): returns once
        it is ready (``write``: writable) or ``timeout_s`` (s) passed, serving the status surface
        meanwhile, so a replica that stops answering never silences /healthz, /readyz or /metrics.
        Signals are only recorded (handled once the call is over). The other keys (exits, shim
        starts, the Pull) are set aside for the wait: their handlers send to the control plane,
        which is busy; they are handled when the call, bounded by ``_limit_s``, is over."""
        if self.surface is None:
            select.select([], [fd], [], timeout_s) if write else select.select([fd], [], [], timeout_s)
            return
        aside = [k for k in self.sel.get_map().values() if not self.surface.owns(k) and k.data != ("signal", None)]
        for k in aside:
            self.sel.unregister(k.fileobj)
        self.sel.register(fd, selectors.EVENT_WRITE if write else selectors.EVENT_READ, ("call", None))
        end = self.now() + int(timeout_s * 1e6)
        try:
            while (left_us := end - self.now()) > 0:
                http_s = self.surface.next_timeout_s()
                events = self.sel.select(left_us / 1e6 if http_s is None else min(left_us / 1e6, http_s))
                if any(key.data == ("call", None) for key, _ in events):
                    return
                for key, mask in events:
                    if self.surface.owns(key):
                        self.surface.handle_event(key, mask)
                    else:
                        self.wakeup.drain()
                if self.notify is not None:
                    self.notify.ping_if_due(self.now())
        finally:
            self.sel.unregister(fd)
            for k in aside:
                self.sel.register(k.fileobj, k.events, k.data)

    def on_signal(self, signum: int) -> None:
        """A signal's handler (SIGTERM, SIGINT, SIGHUP, and the unused ones the loop drops;
        ``wakeup`` wakes the loop with key ``("signal", None)``): only recorded, handled by the loop. The arrival time counts: a
        request blocked on a dead link may hold the loop for its whole timeout before the signal
        is handled, and the stop must still fit the unit's TimeoutStopSec measured from the
        signal."""
        self._signals.append((signum, self.now()))

    def run(self, exit_after_s: float | None = None) -> int:
        """Run until SIGTERM/SIGINT (or ``exit_after_s`` seconds, ``serve --exit-after``: the
        same drain) and the drain are done; returns the exit code (0)."""
        if exit_after_s is not None:
            self.exit_at_us = self.now() + int(exit_after_s * 1e6)
        while not self._finished():
            self.iteration()
        self.client.close()
        if self.surface is not None:
            self.surface.close()
        return 0

    def iteration(self) -> None:
        timeout = self._timeout_s()
        for key, mask in self.sel.select(timeout):
            if self.surface is not None and self.surface.owns(key):
                self.surface.handle_event(key, mask)
                continue
            kind, ref = key.data
            if kind == "signal":
                self.wakeup.drain()
            elif kind == "pidfd":
                job = self.jobs.get(ref)
                if job is not None and job.handle is not None:
                    self._on_exit(job)
            elif kind == "start":
                job = self.jobs.get(ref)
                if job is not None and job.shim_start is not None:
                    self._on_start(job)
            elif kind == "pull":
                self._finish_pull()
        self._handle_signals()
        if self.exit_at_us is not None and self.now() >= self.exit_at_us:
            self._begin_drain()
        self.tick()
        if self.notify is not None:
            self.notify.ping_if_due(self.now())

    def tick(self) -> None:
        """One pass over the duties (module docstring)."""
        now = self.now()
        if self.clock_wait and self.client.clock_plausible():
            # The clock was set (NTP): the hello goes now, not after the back-off.
            self.clock_wait = False
            self.failures["connect"], self.next_connect_us = 0, now
        if self.session is None and not self.stopping and now >= self.next_connect_us:
            self._connect()
            self._handle_signals()
        if self.session is not None and now >= self.next_beat_us:
            self._heartbeat()
            # A SIGTERM that came while the call waited on a dead link: the calls that follow
            # are bounded by the stop it begins, not by their full timeout each.
            self._handle_signals()
        self._fence_and_time(self.now())
        for job in list(self.jobs.values()):
            if job.shim_start is not None and (job.start_fd is None or self.now() >= job.start_deadline_us):
                self._on_start(job, expired=self.now() >= job.start_deadline_us)
            elif job.handle is not None and job.handle.pidfd is None and not self.runs.alive(job.handle):
                self._on_exit(job)
        if self.session is not None and self.now() >= self.next_send_us:
            self._send_owed()
            self._handle_signals()
        if self.pull is not None and self.client.poll_pending():
            self._finish_pull()
        if self.pull is not None and self.now() >= self._pull_deadline_us():
            # No answer within the long poll and a call's bound: that replica stopped
            # answering; the kept request goes to the next one.
            self._drop_pull(moved=True)
            self._fail(ControlUnreachable("the Pull got no answer"), "pull")
        self._maybe_pull()

    def _finished(self) -> bool:
        if not self.stopping:
            return False
        live = any(j.live for j in self.jobs.values())
        owed = self.session is not None and any(self._owes(j) for j in self.jobs.values())
        return (not live and not owed) or (self.stop_deadline_us is not None and self.now() >= self.stop_deadline_us
                                          and not live)

    def _timeout_s(self) -> float | None:
        now = self.now()
        times = [self.next_connect_us if self.session is None and not self.stopping else None,
                 now + CLOCK_LOOK_US if self.clock_wait else None,
                 self.next_beat_us if self.session is not None else None,
                 self.stop_deadline_us, self.notify.next_ping_us(now) if self.notify is not None else None,
                 self.exit_at_us if not self.stopping else None]
        if self.session is not None and any(self._owes(j) for j in self.jobs.values()):
            times.append(self.next_send_us)
        if self.pull is None and self._can_pull():
            times.append(self.next_pull_us)
        if self.pull is not None:
            times.append(self._pull_deadline_us())
        for j in self.jobs.values():
            if j.shim_start is not None:
                times.append(j.start_deadline_us if j.start_fd is not None else now + NO_PIDFD_LOOK_US)
            if j.handle is None:
                continue
            times += [j.deadline_us if j.kill_reason is None else None, j.kill_at_us]
            if j.handle.pidfd is None:
                times.append(now + NO_PIDFD_LOOK_US)
            if j.lease == LeaseHold.HELD:
                times.append(self._stop_at(j))
        times = [t for t in times if t is not None]
        http_s = self.surface.next_timeout_s() if self.surface is not None else None
        if http_s is not None:
            times.append(now + int(http_s * 1e6))
        if not times:
            return None
        return max(0.0, (min(times) - now) / 1e6)

    def _handle_signals(self) -> None:
        while self._signals:
            sig, at_us = self._signals.pop(0)
            if sig in (signal.SIGTERM, signal.SIGINT):
                self._begin_drain(at_us)
            elif sig == signal.SIGHUP and not self.stopping:
                self._reload()

    def _reload(self) -> None:
        """SIGHUP (``systemctl reload``, ``Type=notify-reload``): RELOADING=1, the configuration
        read again by ``reload_config``, READY=1 — without READY=1 the reload job would hang until
        systemd's timeout. Nothing changes live: a Worker's identity, control plane and slots
        take a restart (``reload_config`` journals which changed)."""
        if self.notify is not None:
            self.notify.reloading()
        if self.reload_config is not None:
            self.reload_config()
        if self.notify is not None:
            self.notify.ready(f"worker slots={self.slots}")

    def _begin_drain(self, at_us: int | None = None) -> None:
        """SIGTERM/SIGINT (arrived at ``at_us``) or ``--exit-after``: no new Pulls; live runs
        get ``drain_grace_s`` from then."""
        if self.stopping:
            return
        self.stopping = True
        if self.notify is not None:
            self.notify.stopping()
        now = self.now() if at_us is None else at_us
        self.stop_deadline_us = now + self.drain_grace_us + STOP_TAIL_US
        for j in self.jobs.values():
            if j.handle is not None and j.kill_reason is None:
                j.deadline_us = min(j.deadline_us or now, now + self.drain_grace_us)
        if self.pull is not None:
            self._drop_pull()
        if self.surface is not None:
            self.surface.begin_drain()
        self.log("info", "worker.draining", live=sum(j.handle is not None for j in self.jobs.values()))
