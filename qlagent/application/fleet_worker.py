"""The fleet Worker's loop (issue 11 §1–6; docs/worker-protocol.md "Ordering on the Worker").

One selectors loop, no thread and no busy polling: it sleeps until the next duty (heartbeat,
reconnect, a fencing instant, a timeout, a kill grace) or an event (a shim's pidfd, the Pull's
socket, a signal). Duties, in order, on every pass:

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
   run directory (fsync'd) → spawn the shim → ACK ``running`` (``start_failure`` with the reason
   code when it could not start). Secret values live only in memory from the Pull answer to the
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
name it, with the answer's ``X-Qlagent-Server-Now-Us``. Only a ``starting``/``running`` ACK does
not: the Worker takes it to grant the TTL learnt from its first offer (``leaseExpiresAtUs``
minus the server time) again from the answer's server time; the fencing safety (1 s) covers
the request's own duration.
"""

from __future__ import annotations

import random
import secrets as _secrets
import selectors
import signal
import socket
import time
import uuid
from collections.abc import Callable

import msgspec

from ..core.cluster import (MAX_ADOPT, MAX_HELD, Ack, AckResult, AdoptClaim, ChunkAnswer, ExecutionSpec, Heartbeat,
                            HeartbeatRequest, HeldLease, Hello, PullAnswer, SessionGrant)
from ..core.control import (Answer, AttemptNotFound, ChunkConflict, ControlAuthError, ControlError, ControlPort,
                            ControlTlsError, ControlUnreachable, LeaseGone, PullTokenMismatch, RequestRefused,
                            SessionGone, WorkerRunsPort)
from ..core.errors import QlError, StartError, ValidationError
from ..core.leasefit import KILL_REAP_US          # after SIGKILL: reaping the tree (fencing's kill grace adds it)
from ..core.receipt import start_code
from ..core.inbox_states import (COLLECT, REATTACH, REPORT_LOST, RESEND, SPAWN, InboxEntry, InboxOffer, pull_body,
                                 recovery_action)
from ..worker import backoff, fencing, heartbeat, pacing

CHUNK_BYTES = 262_144
DEFAULT_PULL_WAIT_S = 20
REPLACED_RESET_US = 60_000_000          # a Session kept this long ends the back-off of session_replaced
NOT_READY_LOG_US = 60_000_000           # while stuck (no Session, refused credential), say why this often
CLOCK_LOOK_US = 1_000_000               # a clock that is not set is looked at again this often (local only)
NO_PIDFD_LOOK_US = 1_000_000
# A stop (SIGTERM) ends at most this long after ``drain_grace_s``: runs still live then are
# SIGKILLed at the latest STOP_KILL_US after it, and owed ACKs and chunks are sent until it is
# over. The units grant ``drain_grace_s`` + 10 s (TimeoutStopSec, procd's term_timeout): the
# rest is stop-post's TERM → 5 s → KILL of what is left.
STOP_TAIL_US = 4_000_000
STOP_KILL_US = 2_000_000


def _mono_us() -> int:
    return time.monotonic_ns() // 1_000


class Job:
    """The loop's view of one open inbox row (the inbox stays the authority)."""

    __slots__ = ("entry", "spec", "secrets", "session", "handle", "renewal", "ttl_us", "deadline_us", "kill_reason",
                 "kill_at_us", "fenced", "keep_reported", "cancel", "running_owed", "completion_owed", "uploaded",
                 "log_done", "gone", "refetched", "stop_at_us")

    def __init__(self, entry: InboxEntry, spec: ExecutionSpec, secrets: dict[str, bytes] | None = None) -> None:
        self.entry, self.spec, self.secrets = entry, spec, secrets
        # (Session ID, generation) the Lease is fenced by: the offer's, or the Session that adopted it.
        self.session = (entry.offer.session_id, entry.offer.generation)
        self.handle = None                        # WorkerRunsPort handle of the live shim
        self.renewal: fencing.Renewal | None = None
        # A re-attached run's stop instant read back from its shim's lease file (the Worker's
        # monotonic µs, kept across a restart), until a renewal of this process replaces it.
        self.stop_at_us: int | None = None
        self.ttl_us = 0
        self.deadline_us: int | None = None       # the spec's timeout, Worker monotonic µs
        self.kill_reason: str | None = None       # timeout | cancel | shutdown | None
        self.kill_at_us: int | None = None        # SIGKILL due (after the grace)
        self.fenced = False                       # stopped (or dropped) because the Lease was lost
        self.keep_reported = False
        self.cancel = False
        self.running_owed = False
        self.completion_owed = False
        self.uploaded = 0                         # bytes the control plane acknowledged
        self.log_done = False
        self.gone = False                         # the Lease is gone: nothing more is sent
        self.refetched = False                    # its Pull was sent again for the secret values

    @property
    def attempt_id(self) -> str:
        return self.entry.offer.attempt_id

    @property
    def offer_id(self) -> str:
        return self.entry.offer.offer_id

    @property
    def kill_grace_us(self) -> int:
        return min(self.spec.grace_ms * 1000 + KILL_REAP_US, fencing.MAX_KILL_GRACE_US)

    def __repr__(self) -> str:
        return f"Job(attempt={self.attempt_id}, state={self.entry.state})"


_HELLO_CONFIG = {"labels": "worker.labels", "executorTypes": "worker.executors", "slots": "worker.slots"}


def _config_field(wire_field: str | None) -> str | None:
    """The ``[worker]`` key a refused hello field comes from (``hello.labels.site`` →
    ``worker.labels.site``), or None for any other field."""
    parts = (wire_field or "").split(".")
    if len(parts) < 2 or parts[0] != "hello" or parts[1] not in _HELLO_CONFIG:
        return None
    return ".".join([_HELLO_CONFIG[parts[1]], *parts[2:]])


class WorkerRuntime:
    """The Worker over its control client (``core.control.ControlPort``), inbox
    (``core.ports.InboxPort``) and local runs (``core.control.WorkerRunsPort``).

    ``hello`` narrows the enrolment (labels, executors, slots); ``slots`` bounds live runs;
    ``heartbeat_s`` the cadence; ``pull_wait_s`` the long-poll (0..30 s); ``drain_grace_s`` how
    long live runs may go on after SIGTERM before they are stopped (kill reason ``shutdown``);
    ``log_store_bytes`` bounds the logs not yet uploaded, ``log_max_bytes`` (the Worker's Profile)
    one run's log: a spec's larger ``logQuotaBytes`` (a replica of a larger Profile) is cut to it.
    """

    def __init__(self, client: ControlPort, inbox, runs: WorkerRunsPort, *, worker_id: str, hello: Hello, slots: int,
                 heartbeat_s: float = 5.0, pull_wait_s: int = DEFAULT_PULL_WAIT_S, drain_grace_s: float = 20.0,
                 log_store_bytes: int = 64 * 1_048_576, log_max_bytes: int = 4 * 1_048_576,
                 log=lambda *a, **k: None, notify=None, rand=random.random, mono_us=_mono_us) -> None:
        self.client, self.inbox, self.runs = client, inbox, runs
        self.worker_id, self.hello, self.slots = worker_id, hello, slots
        self.heartbeat_s, self.pull_wait_s, self.drain_grace_us = heartbeat_s, pull_wait_s, int(drain_grace_s * 1e6)
        self.log, self.rand, self.now = log, rand, mono_us
        self.notify = notify                            # service.notify.Notifier (watchdog) or None
        self.sel = selectors.DefaultSelector()
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
        self._wake_r = self._wake_w = None
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
        live = sum(1 for j in self.jobs.values() if j.entry.state in ("received", "barrier", "started"))
        rows, used = self.inbox.usage()
        sid_gen = self.session
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

    # ---- start -----------------------------------------------------------------------------------
    def recover(self) -> dict[str, int]:
        """ADR-0021 restart: every open inbox row by ``recovery_action``; never a second spawn."""
        counts = {"reattached": 0, "collected": 0, "lost": 0, "resend": 0, "pending": 0, "strays": 0}
        for entry in self.inbox.open_entries():
            spec = msgspec.convert(entry.offer.spec, ExecutionSpec)
            job = Job(entry, self._within_profile(spec))
            aid = job.attempt_id
            h = self.runs.reattach(aid) if self.runs.exists(aid) else None
            action = recovery_action(entry.state, run_dir_exists=self.runs.exists(aid), alive=h is not None,
                                     receipt=self.runs.has_receipt(aid))
            if action == SPAWN:
                counts["pending"] += 1
            elif action == REATTACH:
                if entry.state == "barrier":
                    job.entry = self.inbox.advance(job.offer_id, "started")
                job.handle, job.running_owed = h, True
                job.deadline_us = self._deadline(job, h.create_time)
                if job.spec.on_lease_loss == "kill":
                    job.stop_at_us = self.runs.lease_deadline(aid)
                self._watch(job)
                counts["reattached"] += 1
            elif action == COLLECT:
                self._complete(job)
                counts["collected"] += 1
            elif action == REPORT_LOST:
                # No ACK says "lost": the control plane's sweeper ends the Lease and the Attempt.
                # A task may still run without a shim this Worker can re-attach (killed between
                # the spawn and writing the shim's identity): it is stopped, so the Attempt the
                # control plane offers again never runs beside it.
                self.runs.kill_orphans(aid)
                self.log("warning", "worker.run_lost", attempt=aid)
                self._close_row(job, {"kind": "lost"})
                counts["lost"] += 1
                continue
            elif action == RESEND:
                job.completion_owed = entry.outcome.get("kind") in ("completion", "start_failure")
                job.log_done = entry.outcome.get("kind") not in ("completion", "fenced")
                counts["resend"] += 1
            if job.entry.state != "acked":     # _complete closes a fenced or receipt-less run
                self.jobs[job.offer_id] = job
        # Tasks of Attempts the inbox does not list (its state directory was wiped, a shim died
        # unseen) would run beside the copy the control plane offers again: stopped first. What
        # a keep_orphans run left on purpose (a VPN, a watchdog) is known, not a stray; an entry
        # no process carries any more is forgotten, so the table holds only live leftovers.
        kept, seen = self.inbox.kept_orphans(), set()
        strays = self.runs.stop_strays({j.attempt_id for j in self.jobs.values()} | kept, seen)
        self.inbox.forget_orphans(kept - seen)
        for aid, n in sorted(strays.items()):
            self.log("warning", "worker.stray_stopped", attempt=aid, processes=n)
        counts["strays"] = sum(strays.values())
        self.counts["reattached"] = counts["reattached"]
        return counts

    def _deadline(self, job: Job, started_epoch_s: float) -> int:
        elapsed_us = max(0, int((time.time() - started_epoch_s) * 1e6))
        return self.now() - elapsed_us + job.spec.timeout_ms * 1000

    # ---- the loop ---------------------------------------------------------------------------------
    def install_signals(self) -> None:
        r, w = socket.socketpair()
        r.setblocking(False)
        w.setblocking(False)
        self._wake_r, self._wake_w = r, w
        signal.set_wakeup_fd(w.fileno(), warn_on_full_buffer=False)
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            # The arrival time counts: a request blocked on a dead link may hold the loop for
            # its whole timeout before the signal is handled, and the stop must still fit the
            # unit's TimeoutStopSec measured from the signal.
            signal.signal(sig, lambda n, f: self._signals.append((n, self.now())))
        self.sel.register(r, selectors.EVENT_READ, ("signal", None))

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
                try:
                    while self._wake_r.recv(64):
                        pass
                except BlockingIOError:
                    pass
            elif kind == "pidfd":
                job = self.jobs.get(ref)
                if job is not None and job.handle is not None:
                    self._on_exit(job)
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
            if job.handle is not None and job.handle.pidfd is None and not self.runs.alive(job.handle):
                self._on_exit(job)
        if self.session is not None and self.now() >= self.next_send_us:
            self._send_owed()
            self._handle_signals()
        if self.pull is not None and self.client.poll_pending():
            self._finish_pull()
        self._maybe_pull()

    def _finished(self) -> bool:
        if not self.stopping:
            return False
        live = any(j.handle is not None for j in self.jobs.values())
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
        for j in self.jobs.values():
            if j.handle is None:
                continue
            times += [j.deadline_us if j.kill_reason is None else None, j.kill_at_us]
            if j.handle.pidfd is None:
                times.append(now + NO_PIDFD_LOOK_US)
            if not j.fenced and not j.keep_reported:
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

    # ---- Session ----------------------------------------------------------------------------------
    def _fail(self, e: ControlError, what: str, delay: float | None = None) -> None:
        self.failures[what] += 1
        self.unreachable = isinstance(e, ControlUnreachable)
        if delay is None:
            delay = backoff.reconnect_delay_s(self.failures[what], self.rand())
            if e.retry_after_s:
                delay = max(delay, min(e.retry_after_s, backoff.DEFAULT_CAP_S))
            setattr(self, f"next_{what}_us", self.now() + int(delay * 1e6))
        level = "err" if isinstance(e, (ControlTlsError, ControlAuthError)) else "warning"
        self.log(level, f"worker.{what}_failed", code=e.code, error=str(e), retry_s=round(delay, 3))

    def _rpc(self, method: str, path: str, body: bytes, content_type: str = "application/json",
             headers: dict | None = None) -> tuple[Answer, int]:
        """One request; its timeout never runs past the next fencing instant (a blocked call
        must not make a run outlive its Lease) nor a quarter of the systemd watchdog interval.
        Returns (answer, local send time µs)."""
        sent = self.now()
        ans = self.client.request(method, path, body, content_type, headers, timeout_s=self._limit_s(sent))
        if ans.server_now_us is not None:
            # Database clock minus this one, from the answer's arrival: never later than the
            # truth (the database read its clock before the answer left).
            self.clock_offset_us = ans.server_now_us - self.now()
        if self.unreachable:
            # The control plane answers again: what waited for the link goes now.
            self.unreachable = False
            self.failures = dict.fromkeys(self.failures, 0)
            self.next_send_us = self.next_pull_us = 0
        return ans, sent

    def _limit_s(self, sent: int) -> float:
        """How long a request sent at ``sent`` (µs) is waited for (s; ``_rpc``)."""
        limit = self.client.timeout_s
        if self.stop_deadline_us is not None:
            limit = min(limit, (self.stop_deadline_us - sent) / 1e6)      # a stop fits the unit's timeout
        if self.notify is not None and self.notify.watchdog_us:
            # A call blocked on a dead link must not starve the watchdog: ping if due, and wait
            # at most a quarter of WATCHDOG_USEC (pings are due every half).
            self.notify.ping_if_due(sent)
            limit = min(limit, self.notify.watchdog_us / 4e6)
        for j in self.jobs.values():
            if j.handle is not None and not j.fenced and j.kill_reason is None and self._stop_at(j) is not None:
                limit = min(limit, (self._stop_at(j) - sent) / 1e6)
        return max(0.2, limit)

    def _connect(self) -> None:
        try:
            hello = msgspec.structs.replace(self.hello, adopt=tuple(self._adopt_claims()))
            ans, sent = self._rpc("POST", "/sessions", msgspec.json.encode(hello))
            grant = msgspec.json.decode(ans.body, type=SessionGrant)
            if not self.connected_once and ans.server_now_us is not None:
                self._check_cadence(grant.expires_at_us - ans.server_now_us)
            self.session = (grant.session_id, grant.generation)
            self.counts["sessions"] += 1
            self.session_opened_us = self.now()
            self.connected_once = True
            self._unblocked()
            self.failures["connect"] = 0
            self.next_beat_us = self.now() + self._beat_delay_us()
            self.next_send_us = self.next_pull_us = 0
            self.log("info", "worker.session_opened", session=grant.session_id, generation=grant.generation,
                     slots=grant.slots, adopted=len(grant.adopted), refused=len(grant.refused))
            self._take_over(grant, ans, sent)
            if grant.adopted:
                # An adopted Lease keeps the expiry it had: after a restart late in the Lease, less
                # than the fencing margin plus one interval may be left. Renew it in this pass.
                self.next_beat_us = 0
        except ControlError as e:
            self.session = None
            if isinstance(e, ControlTlsError) and not self.connected_once:
                # Every replica in a row refusing TLS at start-up is bad config (a wrong ca_file):
                # one line, exit 2. One of several (a certificate being rotated, a port without
                # TLS) is passed over like an unreachable one.
                self.tls_refusals += 1
                if self.tls_refusals >= self.client.replicas:
                    raise
            else:
                self.tls_refusals = 0
            field = _config_field(e.field) if isinstance(e, RequestRefused) else None
            if field is not None and not self.connected_once:
                # [worker] labels/executors/slots wider than the enrolment: the same hello would be
                # refused for ever, so it is bad config (one line naming the key, exit 2).
                why = e.message.rsplit(": ", 1)[-1]
                raise ValidationError(field, f"{why}; `qlagent workers enroll` decides what a Worker may claim") from None
            self._fail(e, "connect")
            self.clock_wait = e.code == "clock_not_set"
            self._block(e)
        except msgspec.DecodeError:
            self.session = None
            self._fail(ControlUnreachable("unreadable SessionGrant"), "connect")

    def _block(self, e: ControlError) -> None:
        """The Worker cannot work for ``e`` (no Session, or its credential refused): /readyz says
        so, and the journal once a minute while it lasts (``worker.not_ready``)."""
        self.blocked = (e.code, str(e))
        now = self.now()
        if now >= self.next_blocked_log_us:
            self.next_blocked_log_us = now + NOT_READY_LOG_US
            level = "err" if isinstance(e, (ControlTlsError, ControlAuthError)) else "warning"
            self.log(level, "worker.not_ready", code=e.code, error=str(e))

    def _unblocked(self) -> None:
        if self.blocked is not None:
            self.log("info", "worker.unblocked", was=self.blocked[0])
        self.blocked, self.next_blocked_log_us = None, 0

    def _adopt_claims(self) -> list[AdoptClaim]:
        """The Leases a new Session is asked to adopt (at most ``MAX_ADOPT``): rows whose run was
        started (barrier/started: re-attached, to be collected or spawned after an applied
        ``starting`` ACK) first, then completed rows still owing their completion or log chunks,
        then ``received`` rows: one whose ``starting`` ACK the control plane applied (its answer
        lost) is adopted and goes on (ACK replayed, barrier, spawn; never ``lost``); one still
        claimed is refused ``not_started`` and re-offered, as if it had not been named. A run
        being stopped for its Lease is not named; once it ended, its row is (its log still owed)."""
        held = [j for j in self.jobs.values() if not j.gone and (not j.fenced or j.entry.state == "completed")]
        rows = [j for j in held if j.entry.state in ("barrier", "started")]
        rows += [j for j in held if j.entry.state == "completed"]
        rows += [j for j in held if j.entry.state == "received"]
        return [AdoptClaim(attempt_id=j.attempt_id, lease_generation=j.entry.offer.lease_generation,
                           lease_token=j.entry.offer.lease_token) for j in rows[:MAX_ADOPT]]

    def _take_over(self, grant: SessionGrant, ans: Answer, sent: int) -> None:
        """Rows of older Sessions after a hello: an adopted Lease goes on under the new Session
        (its fencing deadline from the Lease's expiry); a refused or unnamed one is gone."""
        adopted = {(a.attempt_id, a.lease_generation): a for a in grant.adopted}
        refused = {r.attempt_id: r.reason for r in grant.refused}
        for j in list(self.jobs.values()):
            if j.gone or j.session == self.session:
                continue
            a = adopted.get((j.attempt_id, j.entry.offer.lease_generation))
            if a is None:
                self._lease_gone(j, refused.get(j.attempt_id, "not_adopted"))
                continue
            j.session, j.keep_reported = self.session, False      # a kept run is under a valid Lease again
            if ans.server_now_us is not None:
                j.renewal = fencing.Renewal(sent_local_us=sent, server_now_us=ans.server_now_us,
                                            expires_at_us=a.expires_at_us)
                self._tell_shim(j)
            self.log("info", "worker.lease_adopted", attempt=j.attempt_id, generation=grant.generation)

    def _check_cadence(self, ttl_us: int) -> None:
        """At start-up, the first Session's TTL (the control plane's Session and Lease TTLs are
        one table; the Lease's is learnt only with an offer) must fit ``MIN_BEATS_PER_TTL``
        heartbeats after the fencing margin of a run with no grace, or every run would be
        stopped before its first renewal: one line naming the key, exit 2 (worker.heartbeat
        ``check_cadence``). A Task's own grace is the control plane's to check (core.leasefit)."""
        try:
            heartbeat.check_cadence(self.heartbeat_s, ttl_us / 1e6, fencing.margin_us(ttl_us, KILL_REAP_US) / 1e6)
        except ValidationError as e:
            raise ValidationError("worker.heartbeat_interval_s",
                                  f"{self.heartbeat_s:g} s cannot renew a {ttl_us / 1e6:.1f} s Session/Lease in time "
                                  f"(at most {max(e.limit, 0):.3f} s: {e.args[0].split(': ', 1)[-1]})",
                                  limit=e.limit) from None

    def _beat_delay_us(self) -> int:
        return int(heartbeat.heartbeat_delay_s(self.heartbeat_s, self.rand()) * 1e6)

    def _held(self) -> list[HeldLease]:
        """The Leases of the current Session a heartbeat asks to renew (at most ``MAX_HELD``):
        rows whose run was started (barrier/started) and not self-fenced, a ``keep`` run
        included (it goes on, so its Lease should too), then completed rows whose completion or
        start failure the control plane has not acknowledged yet (their Lease must stay active for it to be
        accepted). Not named: fenced or gone rows (the run was stopped or dropped: its Lease
        must run out), ``received`` rows (the Attempt is still ``claimed``; the control plane
        renews only started Attempts), rows owing only log chunks (their Lease is completed)."""
        rows = [j for j in self.jobs.values() if not j.gone and not j.fenced and j.session == self.session]
        held = [j for j in rows if j.entry.state in ("barrier", "started")]
        held += [j for j in rows if j.entry.state == "completed" and j.completion_owed]
        return [HeldLease(attempt_id=j.attempt_id, lease_generation=j.entry.offer.lease_generation)
                for j in held[:MAX_HELD]]

    def _heartbeat(self) -> None:
        sid, gen = self.session
        until = None
        if self.clock_offset_us is not None:
            # The database-clock instant this Worker stops waiting for the answer (early, never
            # late): applied after it, the heartbeat would renew Leases of runs it may have
            # stopped meanwhile, so the control plane refuses it (heartbeat_late).
            now = self.now()
            until = now + int(self._limit_s(now) * 1e6) + self.clock_offset_us
        body = msgspec.json.encode(HeartbeatRequest(session_id=sid, generation=gen, leases=tuple(self._held()),
                                                    renew_until_us=until))
        try:
            ans, sent = self._rpc("POST", "/heartbeat", body)
            hb = msgspec.json.decode(ans.body, type=Heartbeat)
        except SessionGone as e:
            self.log("warning", "worker.session_gone", code=e.code)
            self._lose_session(e.code)
            return
        except ControlError as e:
            # No answer is not a lost Session: keep it (its Leases stay ours while they are
            # valid; fencing decides when they are not) and beat again at the usual cadence,
            # never later, or the Session would expire while the link is only slow.
            delay_us = self._beat_delay_us()
            self.next_beat_us = self.now() + delay_us
            self._fail(e, "heartbeat", delay_us / 1e6)
            if isinstance(e, ControlAuthError):
                self._block(e)
            return
        except msgspec.DecodeError:
            return
        self.heartbeat_rtt_us = self.now() - sent
        self.next_beat_us = self.now() + self._beat_delay_us()
        self.failures["heartbeat"] = 0
        self._unblocked()
        if self.replaced and self.now() - self.session_opened_us >= REPLACED_RESET_US:
            self.replaced = 0               # ours for a while: the other process is gone
        renewed = {x.attempt_id: x.expires_at_us for x in hb.leases}
        if ans.server_now_us is not None and not self.ttl_us:
            # A restarted Worker has seen no offer yet: a renewed Lease's span (else the
            # Session's) stands in for the Lease TTL its ACKs renew.
            self.ttl_us = max(0, min(renewed.values(), default=hb.expires_at_us) - ans.server_now_us)
        for j in self.jobs.values():
            # The heartbeat renewed these Leases of this Session to the expiry it answers.
            expires = renewed.get(j.attempt_id)
            if expires is not None and j.session == (sid, gen) and not j.gone and ans.server_now_us is not None:
                j.renewal = fencing.Renewal(sent_local_us=sent, server_now_us=ans.server_now_us,
                                            expires_at_us=expires)
                self._tell_shim(j)
        for aid in hb.cancel:
            for j in self.jobs.values():
                if j.attempt_id == aid and not j.cancel:
                    j.cancel = True
                    self.log("info", "worker.cancel", attempt=aid)
                    if j.handle is not None:
                        self._stop(j, "cancel")

    def _ttl(self, j: Job) -> int:
        return j.ttl_us or self.ttl_us

    def _lose_session(self, code: str) -> None:
        self.session = None
        if self.pull is not None:
            self._drop_pull()
        if code == "stale_generation":
            # Only a newer Session of this Worker makes ours stale, and this process opened none:
            # another process holds the same credential. Reconnecting at once would fence its
            # runs and it ours, in a loop of hellos; back off and say so.
            self.replaced += 1
            delay = backoff.reconnect_delay_s(self.replaced, self.rand())
            self.next_connect_us = self.now() + int(delay * 1e6)
            self.log("err", "worker.session_replaced", replaced=self.replaced, retry_s=round(delay, 3),
                     hint="another process uses this Worker's credential")

    # ---- fencing, timeouts, kills ------------------------------------------------------------------
    def _fence_and_time(self, now: int) -> None:
        for j in list(self.jobs.values()):
            if j.handle is not None:
                if j.kill_at_us is not None and now >= j.kill_at_us:
                    self.runs.signal(j.handle, signal.SIGKILL)
                    j.kill_at_us = None
                if j.kill_reason is None and not j.fenced and j.deadline_us is not None and now >= j.deadline_us:
                    self._stop(j, "shutdown" if self.stopping else "timeout")
            if j.fenced or j.gone or j.entry.state not in ("received", "barrier", "started"):
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
            if j.handle is None:
                # Not spawned yet and the Lease is (about to be) lost: never start it.
                self.log("warning", "worker.lease_lost", attempt=j.attempt_id, action="not_started")
                j.fenced = j.gone = True
                self._close_row(j, {"kind": "fenced"})
            elif d.action == fencing.STOP:
                self.log("warning", "worker.lease_lost", attempt=j.attempt_id, action="kill")
                j.fenced = True
                self.counts["fenced"] += 1
                self._stop(j, None)
            elif not j.keep_reported:
                self.log("warning", "worker.lease_lost", attempt=j.attempt_id, action="keep")
                j.keep_reported = True

    def _stop(self, j: Job, reason: str | None) -> None:
        """SIGTERM the run's tree now, SIGKILL after the spec's grace."""
        if j.kill_reason is None:
            j.kill_reason = reason
        self.runs.signal(j.handle, signal.SIGTERM)
        j.kill_at_us = self.now() + j.spec.grace_ms * 1000
        if self.stop_deadline_us is not None:
            j.kill_at_us = min(j.kill_at_us, self.stop_deadline_us - STOP_TAIL_US + STOP_KILL_US)

    # ---- offers ----------------------------------------------------------------------------------
    def _can_pull(self) -> bool:
        if self.session is None or self.stopping:
            return False
        live = sum(1 for j in self.jobs.values() if j.entry.state in ("received", "barrier", "started"))
        # Room in the inbox = rows not yet acknowledged (``jobs``): acknowledged rows are pruned
        # when the next offer is received, so counting them would stop the Pulls for good once
        # the cap's worth of offers had been acknowledged.
        return live < self.slots and len(self.jobs) < self.inbox.max_rows

    def _maybe_pull(self) -> None:
        if self.pull is not None or not self._can_pull() or self.now() < self.next_pull_us:
            return
        sid, gen = self.session
        pending = self.inbox.begin_pull(sid, gen, str(uuid.uuid4()), _secrets.token_urlsafe(32))
        try:
            self.pull_sent_us = self.now()
            fd = self.client.start_poll(f"/pull?waitS={self.pull_wait_s}", pending.body, self.pull_wait_s)
        except ControlError as e:
            self._pull_error(e, pending.pull_id)
            return
        self.pull = (pending.pull_id, fd)
        self.counts["pulls"] += 1
        self.sel.register(fd, selectors.EVENT_READ, ("pull", None))

    def _drop_pull(self) -> None:
        pull_id, fd = self.pull
        self.pull = None
        try:
            self.sel.unregister(fd)
        except (KeyError, ValueError):
            pass
        self.client.abort_poll()

    def _finish_pull(self) -> None:
        if self.pull is None:
            return
        pull_id, fd = self.pull
        self.pull = None
        self.sel.unregister(fd)
        try:
            ans = self.client.finish_poll()
            answer = msgspec.json.decode(ans.body, type=PullAnswer)
        except ControlError as e:
            self._pull_error(e, pull_id)
            return
        except msgspec.DecodeError:
            self.inbox.end_pull(pull_id)
            self.log("err", "worker.pull_refused", reason="unreadable_answer")
            return
        self.failures["pull"] = 0
        if answer.status != "offered" or answer.offer is None:
            self.inbox.end_pull(pull_id)
            if answer.status not in ("idle", "unmatched"):
                self.log("warning", "worker.pull_answer", status=answer.status, reason=answer.reason)
                self.next_pull_us = self.now() + 1_000_000
            else:
                self.next_pull_us = pacing.next_pull_after_idle_us(self.pull_sent_us, self.pull_wait_s, answer.reason)
            return
        self._receive(answer, ans, pull_id)

    def _pull_error(self, e: ControlError, pull_id: str) -> None:
        if isinstance(e, PullTokenMismatch):
            self.inbox.end_pull(pull_id)
            return
        if isinstance(e, RequestRefused):
            self.inbox.end_pull(pull_id)
            self.log("err", "worker.pull_refused", code=e.code, field=e.field)
            self.next_pull_us = self.now() + 5_000_000
            return
        if isinstance(e, SessionGone):
            self._lose_session(e.code)
            self.log("warning", "worker.session_gone", code=e.code)
            return
        # The answer was lost: the kept request is sent again, byte for byte, after a pause.
        self.client.abort_poll()
        self._fail(e, "pull")

    def _receive(self, answer: PullAnswer, ans: Answer, pull_id: str) -> None:
        o = answer.offer
        sid, gen = self.session
        if o.worker_id != self.worker_id or (o.session_id, o.generation) != (sid, gen) \
                or o.spec.attempt_id != o.attempt_id:
            self.inbox.end_pull(pull_id)
            self.log("err", "worker.offer_refused", offer=o.offer_id, reason="identity")
            return
        spec_doc = msgspec.to_builtins(o.spec)
        offer = InboxOffer(offer_id=o.offer_id, attempt_id=o.attempt_id, session_id=o.session_id,
                           generation=o.generation, lease_generation=o.lease_generation,
                           lease_expires_at_us=o.lease_expires_at_us, lease_token=o.lease_token,
                           spec_digest=o.spec_digest, spec=spec_doc)
        try:
            entry, new = self.inbox.receive(offer, pull_id)
        except QlError as e:              # offer_conflict, inbox_full, a bad field: reported, not kept
            self.inbox.end_pull(pull_id)
            self.log("err", "worker.offer_refused", offer=o.offer_id, code=e.code, field=e.field)
            return
        if not new and o.offer_id in self.jobs:
            return
        job = Job(entry, self._within_profile(o.spec), dict(o.secrets))
        if ans.server_now_us is not None:
            job.ttl_us = max(0, o.lease_expires_at_us - ans.server_now_us)
            self.ttl_us = self.ttl_us or job.ttl_us
            job.renewal = fencing.Renewal(sent_local_us=self.pull_sent_us, server_now_us=ans.server_now_us,
                                          expires_at_us=o.lease_expires_at_us)
        self.jobs[o.offer_id] = job
        self.log("info", "worker.offer", offer=o.offer_id, attempt=o.attempt_id, source=o.source)
        self._send_owed()

    # ---- owed sends: ACKs, chunks ------------------------------------------------------------------
    def _owes(self, j: Job) -> bool:
        if j.gone:
            return False
        return (j.entry.state == "received" or j.running_owed or j.completion_owed
                or (j.entry.state == "completed" and not j.log_done)
                or (j.handle is not None and self.runs.log_size(j.attempt_id) - j.uploaded >= CHUNK_BYTES))

    def _ack(self, j: Job, kind: str, **fields) -> AckResult:
        o = j.entry.offer
        ack = Ack(session_id=j.session[0], generation=j.session[1], attempt_id=o.attempt_id,
                  lease_generation=o.lease_generation, lease_token=o.lease_token, kind=kind, **fields)
        ans, sent = self._rpc("POST", "/acks", msgspec.json.encode(ack))
        if kind in ("starting", "running") and ans.server_now_us is not None and self._ttl(j):
            # A starting/running ACK extends the Lease to at least now + TTL.
            j.renewal = fencing.Renewal(sent_local_us=sent, server_now_us=ans.server_now_us,
                                        expires_at_us=ans.server_now_us + self._ttl(j))
            self._tell_shim(j)
        return msgspec.json.decode(ans.body, type=AckResult)

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

    def _send_owed(self) -> None:
        for j in list(self.jobs.values()):
            if self.session is None:
                return
            try:
                self._advance(j)
                self.failures["send"] = 0
            except (LeaseGone, AttemptNotFound) as e:
                self._lease_gone(j, e.code)
            except SessionGone as e:
                if j.session != self.session:
                    # An older Session's Lease: the control plane fenced it when this Session opened.
                    self._lease_gone(j, e.code)
                else:
                    self.log("warning", "worker.session_gone", code=e.code)
                    self._lose_session(e.code)
                    return
            except RequestRefused as e:
                self.log("err", "worker.ack_refused", attempt=j.attempt_id, code=e.code, field=e.field)
                self._lease_gone(j, e.code)
            except ControlError as e:
                self._fail(e, "send")
                if isinstance(e, ControlUnreachable):
                    return              # no link: the others would fail the same way
                # An answered refusal (503 for a chunk…) holds back this Attempt only.
            except msgspec.DecodeError:
                self._fail(ControlUnreachable("unreadable answer"), "send")
                return

    def _lease_gone(self, j: Job, code: str) -> None:
        """The control plane no longer knows this Lease: self-fence by on_lease_loss, drop what was owed."""
        if j.entry.state == "acked":
            return                      # already closed (by the recovery or another path): nothing left
        self.log("warning", "worker.lease_gone", attempt=j.attempt_id, code=code)
        j.gone = True
        j.running_owed = j.completion_owed = False
        if j.handle is not None:
            if j.spec.on_lease_loss == "kill" and j.kill_reason is None and not j.fenced:
                j.fenced = True
                self._stop(j, None)
            return                      # its exit closes the row
        if j.entry.state in ("received", "barrier"):
            self._close_row(j, {"kind": "fenced"})
        elif j.entry.state == "completed":
            self._acked(j)

    def _advance(self, j: Job) -> None:
        st = j.entry.state
        if st == "received":
            if j.fenced or j.gone:
                return
            self._ack(j, "starting")
            j.entry = self.inbox.advance(j.offer_id, "barrier")      # the crash barrier, fsync'd
            st = "barrier"
        if st == "barrier" and j.handle is None and not self.runs.exists(j.attempt_id):
            if j.secrets is None and j.spec.secret_refs and j.entry.pull_id is not None and not j.refetched:
                self._refetch_secrets(j)
            self._spawn(j)
        if j.running_owed:
            self._ack(j, "running")
            j.running_owed = False
        if j.handle is not None and not j.gone:
            self._upload(j, final=False)
        if j.completion_owed:
            out = j.entry.outcome
            if out["kind"] == "start_failure":
                self._ack(j, "start_failure", start_error=out["startError"])
            else:
                self._ack(j, "completion", **{k: out.get(c) for k, c in _ACK_FIELDS})
            j.completion_owed = False
        if j.entry.state == "completed" and not j.gone:
            if not j.log_done:
                self._upload(j, final=True)
            if j.log_done:
                self._acked(j)

    def _refetch_secrets(self, j: Job) -> None:
        """ADR-0108 rebuild after a restart (secret values are never kept): the Pull that brought
        ``j``, its pullId and lease token from the row, sent under the Session that holds the
        Lease now (the offer's, or the one that adopted it). While the Lease is active and the
        Attempt not yet ``running``, the control plane answers the same offer, secret values
        included. Any other answer leaves them missing (the spawn then fails
        ``secrets_unavailable``). Transport errors and a lost Session propagate to
        ``_send_owed``, which retries later."""
        o = j.entry.offer
        body = pull_body(j.session[0], j.session[1], j.entry.pull_id, o.lease_token)
        try:
            ans, sent = self._rpc("POST", "/pull?waitS=0", body)
            answer = msgspec.json.decode(ans.body, type=PullAnswer)
        except (PullTokenMismatch, RequestRefused) as e:
            j.refetched = True
            self.log("warning", "worker.secrets_refetch_refused", attempt=j.attempt_id, code=e.code)
            return
        j.refetched = True
        got = answer.offer
        if answer.status != "offered" or got is None or (got.attempt_id, got.lease_generation, got.lease_token,
                                                         got.spec_digest) != (o.attempt_id, o.lease_generation,
                                                                              o.lease_token, o.spec_digest):
            self.log("warning", "worker.secrets_refetch_failed", attempt=j.attempt_id, status=answer.status,
                     reason=answer.reason)
            return
        j.secrets = dict(got.secrets)
        self.log("info", "worker.secrets_refetched", attempt=j.attempt_id)

    def _spawn(self, j: Job) -> None:
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
            h = self.runs.spawn(j.spec, j.secrets or {}, self._lease_stop_at(j))
        except StartError as e:
            j.secrets = None
            code = start_code(e.message) if e.code == "start" else e.code
            self.log("warning", "worker.start_failed", attempt=j.attempt_id, reason=code, error=e.message)
            self._start_failed(j, code)
            return
        j.secrets = None
        j.handle = h
        j.deadline_us = self.now() + j.spec.timeout_ms * 1000
        j.entry = self.inbox.advance(j.offer_id, "started")
        j.running_owed = True
        self.counts["spawned"] += 1
        self._watch(j)
        self.log("info", "worker.run_started", attempt=j.attempt_id, pid=h.pid)

    def _within_profile(self, spec: ExecutionSpec) -> ExecutionSpec:
        """The spec as this Worker runs it: a log quota above its Profile's ``log_max_bytes`` is
        cut to it (the truncation fact then names that quota). The inbox keeps the spec as
        offered: its digest is what the control plane signed off."""
        if spec.log_quota_bytes <= self.log_max_bytes:
            return spec
        return msgspec.structs.replace(spec, log_quota_bytes=self.log_max_bytes)

    def log_store_used(self) -> int:
        """Bytes of the logs not yet uploaded, a live run counted at its quota."""
        return sum(j.spec.log_quota_bytes if j.handle is not None else self.runs.log_size(j.attempt_id)
                   for j in self.jobs.values() if not j.log_done)

    def _bound_log_store(self, need: int) -> None:
        """Issue 11 §5: a partition must not fill the flash. Before a spawn, the Artifacts not yet
        uploaded (a live run counted at its quota) plus ``need`` bytes must fit ``log_store_bytes``;
        otherwise the oldest completed runs' bytes the control plane does not hold yet are cut,
        each cut recorded (``worker.log_truncated``: attempt, bytes dropped, bytes the control
        plane keeps)."""
        over = self.log_store_used() + need - self.log_store_bytes
        for j in list(self.jobs.values()):
            if over <= 0:
                return
            if j.entry.state == "completed" and not j.log_done:
                freed = self.runs.truncate_log(j.attempt_id, max(j.uploaded, self.runs.log_size(j.attempt_id) - over))
                if freed:
                    over -= freed
                    self.log("warning", "worker.log_truncated", attempt=j.attempt_id, bytes_dropped=freed,
                             bytes_kept=self.runs.log_size(j.attempt_id))

    def _start_failed(self, j: Job, code: str) -> None:
        j.entry = self.inbox.advance(j.offer_id, "completed", {"kind": "start_failure", "startError": code})
        j.completion_owed, j.log_done = True, True

    def _watch(self, j: Job) -> None:
        if j.handle.pidfd is not None:
            self.sel.register(j.handle.pidfd, selectors.EVENT_READ, ("pidfd", j.offer_id))

    def _on_exit(self, j: Job) -> None:
        h = j.handle
        if h.pidfd is not None:
            self.sel.unregister(h.pidfd)
        self.runs.finished(h)
        j.handle = None
        self._complete(j)
        self._send_owed()

    def _complete(self, j: Job) -> None:
        """The shim ended: its receipt becomes the row's outcome (kept until acknowledged)."""
        receipt, trunc = self.runs.collect(j.attempt_id)
        if receipt is None:
            self.runs.kill_orphans(j.attempt_id)
        if receipt is not None and receipt.lease_lost and not j.fenced:
            # The shim fenced it by itself (this Worker was down or late): the Lease is lost.
            j.fenced = True
            self.counts["fenced"] += 1
            self.log("warning", "worker.lease_lost", attempt=j.attempt_id, action="killed_by_shim")
        if receipt is None or (j.fenced and j.gone):
            # A shim that died without a receipt leaves the ending to the control plane's
            # sweeper; a Lease the control plane already ended takes no more chunks.
            self._close_row(j, {"kind": "fenced" if j.fenced else "lost"})
            return
        if j.fenced:
            # Self-fenced before its Lease expired: no completion is sent (the Attempt is
            # re-offered), but the log goes up while the Lease still takes chunks.
            j.entry = self.inbox.advance(j.offer_id, "completed", {"kind": "fenced"})
            return
        if receipt.start_error:
            self._start_failed(j, start_code(receipt.start_error))
        else:
            out = {"kind": "completion", "exitCode": receipt.exit_code, "signal": receipt.signal,
                   "killReason": j.kill_reason, "bytesKept": receipt.bytes_kept,
                   "bytesDropped": receipt.bytes_dropped, "peakRssBytes": receipt.peak_rss_bytes,
                   "cpuTimeUs": receipt.cpu_time_us, "truncated": trunc is not None}
            out = {k: v for k, v in out.items() if v is not None}
            j.entry = self.inbox.advance(j.offer_id, "completed", out)
            j.completion_owed = not j.gone
            self.counts["completed"] += 1
            self.log("info", "worker.run_ended", attempt=j.attempt_id, exit=receipt.exit_code,
                     signal=receipt.signal, kill_reason=j.kill_reason, truncated=trunc is not None)
        if j.gone:
            # A run kept (on_lease_loss = "keep") after its Lease was gone owes nothing (nothing
            # more is sent for it): its row closes now, or it would hold an inbox row for ever.
            self._acked(j)

    def _upload(self, j: Job, final: bool) -> None:
        """Log chunks from ``j.uploaded``; while running only whole chunks (bounded), at the end
        everything. ``log_done`` once the control plane holds every byte of the Artifact."""
        o = j.entry.offer
        headers = {"X-Qlagent-Session": j.session[0], "X-Qlagent-Generation": str(j.session[1]),
                   "X-Qlagent-Lease-Generation": str(o.lease_generation), "X-Qlagent-Lease-Token": o.lease_token}
        size = self.runs.log_size(j.attempt_id)
        while size - j.uploaded >= (1 if final else CHUNK_BYTES):
            data = self.runs.read_log(j.attempt_id, j.uploaded, CHUNK_BYTES)
            if not data:
                break
            try:
                ans, _ = self._rpc("PUT", f"/attempts/{j.attempt_id}/log?offset={j.uploaded}", data,
                                   "application/octet-stream", headers)
                j.uploaded = msgspec.json.decode(ans.body, type=ChunkAnswer).next_offset
            except ChunkConflict as e:
                if e.next_offset is None:
                    raise
                j.uploaded = e.next_offset      # resume where the control plane says it is
            if not final:
                break                           # one chunk per pass while the run goes on
        if final and j.uploaded >= size:
            j.log_done = True

    def _acked(self, j: Job) -> None:
        """Close ``j``'s row (completed → acked), remove its run directory, forget the Job.
        Idempotent: two legitimate paths can both end one row (after a restart the recovery
        closes a run its shim fenced, then the hello that did not adopt its Lease declares it
        gone), so a row already acked is only forgotten again. Any other move the inbox does
        not allow still raises IllegalInboxTransition."""
        if j.entry.state != "acked":
            # A run that ended (not fenced or lost: those leave nothing on purpose) with
            # keep_orphans may leave processes that must outlive this row: recorded with the ack.
            keep = j.spec.keep_orphans and (j.entry.outcome or {}).get("kind") == "completion"
            j.entry = self.inbox.advance(j.offer_id, "acked", keep_orphans=keep)
            unsent = self.runs.log_size(j.attempt_id) - j.uploaded
            if not j.log_done and unsent > 0:
                # The control plane no longer takes this Lease's chunks: the log is cut where it
                # stands there, and the cut recorded (never deleted unsent without a word).
                self.log("warning", "worker.log_truncated", attempt=j.attempt_id, bytes_dropped=unsent,
                         bytes_kept=j.uploaded, reason="lease_gone")
            self.runs.prune(j.attempt_id)
        self.jobs.pop(j.offer_id, None)

    def _close_row(self, j: Job, outcome: dict) -> None:
        """End a row that owes nothing more (lost, fenced): completed → acked, run dir removed;
        a row already acked stays as it is (``_acked``)."""
        if j.entry.state not in ("completed", "acked"):
            j.entry = self.inbox.advance(j.offer_id, "completed", outcome)
        self._acked(j)


_ACK_FIELDS = (("exit_code", "exitCode"), ("signal", "signal"), ("kill_reason", "killReason"),
               ("bytes_kept", "bytesKept"), ("bytes_dropped", "bytesDropped"), ("peak_rss_bytes", "peakRssBytes"),
               ("cpu_time_us", "cpuTimeUs"))

