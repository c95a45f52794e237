"""``qlagent serve`` with a ``[cluster]`` table: one control-plane replica (issue 10 "Shape").

Several replicas run side by side on one PostgreSQL authority with no leader of their own;
every state change is a transaction there. One selectors loop, idle when idle, wakes for: an
HTTP request, the scheduler's next due instant, the lease sweeper's cadence
(``[cluster] sweep_interval_s``; the same pass reports queued Runs no enrolled Worker can
match), the definition reload (other replicas and CLIs change Tasks
without poking this process), or a signal. It runs no local engine: Runs are executed by
Workers that Pull them.

Start-up: first what needs no database (``service.preflight``, which ``config check`` runs too:
``[cluster]`` pool size against the route threads, ``bootstrap.check_replica_pool``; the TLS
certificate and key, ``http.tls``), so a bad value is one line naming the field with nothing
written; then migrations under the advisory lock (``PgStore``), capability check (readiness),
the cluster services (``bootstrap.ClusterServices``) and the HTTP surface: the existing routes
on PostgreSQL, the Worker routes (``http.service.mount_worker_routes``), HTTPS when
``tls_cert``/``tls_key`` are set.
SIGTERM/SIGINT: stop accepting, answer every long-polling Pull at once (idle), finish requests in
progress, exit 0. SIGHUP: re-read the Task heads at once.

Two threads. The loop thread answers HTTP (the probes at once; every route that needs the
database hands it to the route threads) and signals, and never talks to PostgreSQL itself. The
duty thread runs the loop duties that do: the scheduler, the sweeper and placement report, the
Task-head reload and the database clock read with it. A frozen or unreachable database thus
holds at most the duty thread, never ``/healthz``.

Database outage: the duties wait at most ``DUTY_WAIT_S`` for a pooled connection (the route
threads may hold the others) and, after a failure, pause for a back-off doubling from
``BACKOFF_MIN_US`` to ``BACKOFF_MAX_US`` instead of retrying every wake-up. The journal gets one
``store.unavailable`` line when an outage starts and one ``store.available`` when a duty succeeds
again; psycopg_pool's own log lines are silenced in favour of these.
"""

from __future__ import annotations

import errno
import logging
import os
import selectors
import signal
import socket
import threading
import time

from .. import bootstrap
from ..application.schedules import system_timezone
from ..core.clock import now_us
from ..core.dbclock import SKEW_BOUND_US
from ..core.errors import QlError, UnavailableError
from ..core.settings import Settings
from ..core.states import RunState
from .config import parse_listen
from .journal import Journal
from .notify import Notifier
from .preflight import preflight
from .scheduler import Scheduler
from .signals import UNUSED_SIGNALS, SignalWakeup

RELOAD_INTERVAL_US = 10_000_000    # re-read Task heads this often (s × 1e6): peers change them silently
MAX_SWEEPS_PER_WAKE = 4            # sweeper passes after one wake-up while a pass reports a full batch
DUTY_WAIT_S = 1.0                  # a loop duty waits this long for a pooled connection, then pauses
BACKOFF_MIN_US = 500_000           # first pause of the loop's duties after a database failure (µs)
BACKOFF_MAX_US = 8_000_000         # the pause doubles up to this (µs)
SKEW_LOG_INTERVAL_S = 300          # a clock still skewed is journalled again after this (s)


class ControlPlane:
    """One replica. ``run()`` returns the exit code (0 after SIGTERM, the QlError's otherwise)."""

    def __init__(self, settings: Settings, *, listen: str | None = None, exit_after_s: float | None = None) -> None:
        self.settings = settings
        self.cluster = settings.config.cluster
        self.log = Journal(min_priority="info")
        self.notify = Notifier()
        self._listen = listen
        self._exit_after_s = exit_after_s
        self.sel = selectors.DefaultSelector()
        self._stop = self._hup = False
        self.http = None
        self.services = None
        self.store = None
        self._backoff_us = 0               # 0: the authority answered last time
        self._outage_since = None          # _now() of the first failure of this outage
        self._resume_at = 0                # no duty before this instant (µs) while backing off
        self._now = now_us                 # the loop's clock: the database's once measured (_check_clock)
        self._skew_logged_at = None        # monotonic s of the last clock.skewed line, None: clock agrees
        self._name = f"{socket.gethostname()}/{os.getpid()}"
        self._duty_thread: threading.Thread | None = None
        self._poke = threading.Event()     # wakes the duty thread: SIGHUP, stopping
        self._duty_error: BaseException | None = None
        self._duty_wake, self._duty_done = socket.socketpair()   # the duty thread failed: wakes the loop
        # Since start, for GET /metrics: sweeper passes, what they expired, database failures
        # by (loop duty or route, code) — counted by the duty thread and the route threads.
        self._sweeps = self._leases_expired = self._sessions_expired = 0
        self._store_errors: dict[tuple[str, str], int] = {}
        self._store_errors_lock = threading.Lock()

    def run(self) -> int:
        try:
            return self._run()
        except QlError as e:
            self.log("err", "service.failed", code=e.code, field=e.field, error=str(e))
            return e.exit_code
        finally:
            self._close()

    def _run(self) -> int:
        threads, tls = preflight(self.settings)      # no database yet: the same checks as config check
        # psycopg_pool logs every failed reconnect unformatted on stderr (the journal); the
        # store.unavailable / store.available lines below say the same once per outage.
        logging.getLogger("psycopg.pool").setLevel(logging.CRITICAL)
        self.store = bootstrap.open_store(self.settings, replica=self._name)   # migrates under the advisory lock
        if self.store.applied:
            self.log("info", "store.migrated", applied=",".join(self.store.applied))
        self.services = bootstrap.ClusterServices(self.settings, self.store, self.log)
        # One time source for the cluster: the scheduler plans in the database's time, as Leases
        # and sweeps already do, so a replica with a wrong clock neither fires early nor makes its
        # peers see a clock stepping back. It plans on a time the database has certainly reached,
        # not on the estimate: a Run is stamped by the database (core.dbclock).
        self.clock = self.services.clock
        self._check_clock()
        self._now = self.clock.reached_us
        self.scheduler = Scheduler(self.store, system_timezone(), self._now, self.log)
        self._install_signals()
        self.sel.register(self._duty_wake, selectors.EVENT_READ, "duties")
        self._start_http(threads, tls)
        exit_at = None if self._exit_after_s is None else self._now() + int(self._exit_after_s * 1e6)
        self._duty_thread = threading.Thread(target=self._duties, name="qlagent-loop-duties", daemon=True)
        self._duty_thread.start()
        self.log("info", "service.ready", role="control-plane", profile=self.settings.profile.name)
        self.notify.ready("control plane ready")
        while not self._stop:
            now = self._now()
            if exit_at is not None and now >= exit_at:
                break
            wake = [t for t in (exit_at, self.http.next_timeout_us(now) if self.http else None,
                                self.notify.next_ping_us(now)) if t is not None]
            timeout = None if not wake else max(0.0, (min(wake) - self._now()) / 1e6)
            for key, mask in self.sel.select(timeout):
                if self.http is not None and self.http.owns(key):
                    self.http.handle_event(key, mask)
                elif key.data == "signal":
                    self._wakeup.drain()
                    self._poke.set()
                elif key.data == "duties":         # the duty thread ended: it failed
                    raise self._duty_error
            if self.http is not None:
                self.http.tick(self._now())
            self.notify.ping_if_due(self._now())
        self._stop = True
        self._poke.set()
        self.notify.stopping()
        self.services.stop_waiting()
        self._drain_http()
        self._end_duties()
        self.log("info", "service.stopped", role="control-plane")
        return 0

    def _duties(self) -> None:
        """The duty thread: scheduler, Task-head reload (with the clock read), sweeper and
        placement report, each when due and not backing off, then asleep until the next one is
        due or ``_poke`` (a signal) wakes it; returns once ``_stop`` is set. A failure other
        than the database's unavailability (``_guarded``) is kept in ``_duty_error`` and the
        loop thread woken to raise it."""
        try:
            next_sweep = next_reload = self._now()  # the first pass loads the Task heads and sweeps
            while True:
                self._poke.clear()             # before the check: a later set() ends the wait below
                if self._stop:
                    return
                now = self._now()
                due = self.scheduler.next_wake_us
                if self._hup:                  # SIGHUP: re-read the Task heads now
                    self._hup, next_reload = False, now
                if now >= next_reload and self._may_run():
                    if self._guarded("task_reload", self._reload) is not None:
                        due = now              # a Task may have been added: plan from the new heads
                    next_reload = now + RELOAD_INTERVAL_US
                if due is not None and now >= due and self._may_run():
                    self._guarded("scheduler", self._fire_due)
                if now >= next_sweep and self._may_run():
                    self._sweep()
                    next_sweep = now + int(self.cluster.sweep_interval_s * 1e6)
                duties = [t for t in (self.scheduler.next_wake_us, next_sweep, next_reload) if t is not None]
                if self._backing_off():
                    duties = [max(min(duties), self._resume_at)]
                self._poke.wait(max(0.0, (min(duties) - self._now()) / 1e6))
        except BaseException as e:  # noqa: BLE001 - the loop thread raises it: the replica stops as before
            self._duty_error = e
            self._duty_done.send(b"x")

    def _sweep(self) -> None:
        """Lease sweeper passes while each reports a full batch (at most ``MAX_SWEEPS_PER_WAKE``),
        then as many placement report batches."""
        for _ in range(MAX_SWEEPS_PER_WAKE):
            result = self._guarded("sweeper", self.services.sweeper.sweep_once)
            if result is not None:
                self._sweeps += 1
                self._leases_expired += result.leases_expired
                self._sessions_expired += result.sessions_expired
            if result is not None and result.holds_released:
                self.log("info", "runs.holds_released", count=result.holds_released)
            if result is None or not result.truncated or not self._may_run():
                break
        for _ in range(MAX_SWEEPS_PER_WAKE):
            if not self._may_run():
                break
            checked = self._guarded("placement_report",
                                    lambda: self.services.placement_report.report(self.cluster.sweep_batch))
            if checked is None or checked[0] < self.cluster.sweep_batch:
                break

    def _end_duties(self) -> None:
        """Wait for the duty thread to finish its pass (one unit of work: the store's bound, 10 s
        on a frozen database), so the store closes under no query."""
        if self._duty_thread is not None:
            self._duty_thread.join()

    def _fire_due(self) -> int:
        """One scheduler pass; a fire the database refused as early (its clock is behind this
        replica's reading of it: it stepped back) measures the clock again, so the pass due
        again at that instant waits for it instead of asking again at once."""
        created = self.scheduler.fire_due()
        if self.scheduler.clock_ahead:
            self._check_clock()
        return created

    def _reload(self) -> int:
        """Measure this host's clock against the database's, then re-read the Task heads."""
        self._check_clock()
        return self.scheduler.reload()

    def _check_clock(self) -> None:
        """Re-anchor the loop's clock to the database's. A local clock more than
        ``SKEW_BOUND_US`` off is journalled ``clock.skewed`` naming this replica and the offset
        (at most every ``SKEW_LOG_INTERVAL_S``), ``clock.agreed`` once it is back within."""
        if not self.clock.sync():
            return
        offset = "%+.1f" % (self.clock.offset_us / 1e6)
        mono = time.monotonic()
        if self.clock.skewed:
            if self._skew_logged_at is None or mono - self._skew_logged_at >= SKEW_LOG_INTERVAL_S:
                self.log("warning", "clock.skewed", replica=self._name, offset_s=offset,
                         bound_s=SKEW_BOUND_US / 1e6, effect="this replica plans in the database's time; fix its clock")
                self._skew_logged_at = mono
        elif self._skew_logged_at is not None:
            self.log("notice", "clock.agreed", replica=self._name, offset_s=offset)
            self._skew_logged_at = None

    def _backing_off(self) -> bool:
        """True while the loop's database duties pause after a failure."""
        return self._now() < self._resume_at

    def _may_run(self) -> bool:
        """True when a duty may start now: not stopping, not backing off."""
        return not self._stop and not self._backing_off()

    def _store_error(self, source: str, code: str) -> None:
        """Count one database failure of a loop duty or a request (``source``) by error code."""
        with self._store_errors_lock:
            self._store_errors[source, code] = self._store_errors.get((source, code), 0) + 1

    def _guarded(self, duty: str, fn):
        """One pass of the loop duty ``duty`` (its name in ``qlagent_store_errors_total``),
        waiting at most ``DUTY_WAIT_S`` for a connection; None when the authority is busy or
        unreachable (no pass is half-done: each write is one transaction). A failure pauses
        every duty for the back-off (doubling 0.5 s → 8 s) and logs ``store.unavailable`` once
        per outage; the first success after it logs
        ``store.available`` with the outage's length."""
        try:
            with self.store.waiting_at_most(DUTY_WAIT_S):
                result = fn()
        except UnavailableError as e:
            now = self._now()
            self._store_error(duty, e.code)
            if self._outage_since is None:
                self._outage_since = now
                self.log("warning", "store.unavailable", code=e.code, error=str(e))
            self._backoff_us = min(BACKOFF_MAX_US, max(BACKOFF_MIN_US, 2 * self._backoff_us))
            self._resume_at = now + self._backoff_us
            return None
        if self._outage_since is not None:
            self.log("notice", "store.available", down_s="%.1f" % ((self._now() - self._outage_since) / 1e6))
            self._outage_since = None
        self._backoff_us = self._resume_at = 0
        return result

    def _metrics(self) -> bytes:
        """``GET /metrics`` of this replica (issue 26 §3), on a database thread: Runs by state
        and the queue (every Project, from the database), the oldest queued Run's age (s, by
        the database's clock), Task Start answers by HTTP status, Pulls answered with an offer,
        Pulls long-polling, sweeper passes and the Run Leases and Sessions they expired, the
        pool (as the scrape arrives, before it takes a connection), database failures by loop
        duty or route and error code — the counters since this replica started."""
        from ..core.metrics import COUNTER, GAUGE, Family, render
        # The pool as the scrape finds it: read after the scrape's own queries, it would show
        # only what outlived the wait of a scrape that came while requests were queueing.
        size, in_use, waiting = self.store.pool_use()
        counts = self.store.run_state_counts()
        oldest = self.store.oldest_queued_us()
        runs = Family("qlagent_runs", GAUGE, "Runs by state, every Project")
        for state in RunState.ALL_CLUSTER:
            runs.add(counts.get(state, 0), state=state)
        starts = Family("qlagent_task_starts_total", COUNTER, "Task Start answers of this replica by HTTP status")
        for code, n in sorted(self.http.tally.task_starts.items()):
            starts.add(n, code=code)
        errors = Family("qlagent_store_errors_total", COUNTER,
                        "Database failures of a loop duty or a request answered 503, by source and error code")
        with self._store_errors_lock:
            failed = sorted(self._store_errors.items())
        for (source, code), n in failed:
            errors.add(n, source=source, code=code)
        age = 0.0 if oldest is None else max(0, self.services.now_us() - oldest) / 1e6
        return render([
            runs, starts,
            Family("qlagent_queue_depth", GAUGE, "Runs queued").add(counts.get(RunState.QUEUED, 0)),
            Family("qlagent_queue_oldest_age_seconds", GAUGE, "Age of the oldest queued Run (0: none)").add(age),
            Family("qlagent_offers_total", COUNTER, "Pulls this replica answered with a claimed Attempt")
            .add(self.services.pull.offers),
            Family("qlagent_pulls_waiting", GAUGE, "Pulls long-polling on this replica")
            .add(self.http.worker_routes.polls_waiting()),
            Family("qlagent_sweeper_passes_total", COUNTER, "Lease sweeper passes").add(self._sweeps),
            Family("qlagent_lease_expiries_total", COUNTER, "Run Leases expired by the sweeper: their Worker went "
                   "silent or stopped naming them (self-fenced)").add(self._leases_expired),
            Family("qlagent_session_expiries_total", COUNTER, "Worker Sessions expired by the sweeper")
            .add(self._sessions_expired),
            Family("qlagent_pool_connections", GAUGE, "Database connections open").add(size),
            Family("qlagent_pool_in_use", GAUGE, "Database connections in use").add(in_use),
            Family("qlagent_pool_waiting", GAUGE, "Requests waiting for a database connection").add(waiting),
            errors])

    def _install_signals(self) -> None:
        self._wakeup = SignalWakeup(self.sel, (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, *UNUSED_SIGNALS),
                                    self._on_signal, "signal")

    def _on_signal(self, n: int) -> None:
        if n == signal.SIGHUP:
            self._hup = True
        elif n in (signal.SIGTERM, signal.SIGINT):
            self._stop = True

    def _start_http(self, threads: int, tls) -> None:
        cfg = self.settings.config.http
        listen = self._listen or (cfg.listen if cfg else None)
        if not listen:
            self.log("warning", "http.off", reason="no [http] listen or --listen: Workers cannot reach this replica")
            return
        from ..http.service import HttpSurface
        self.http = HttpSurface(self.settings, self.store, on_change=lambda: None, cluster=self.services,
                                threads=threads, journal=self.log,
                                metrics=self._metrics if cfg is not None and cfg.metrics else None,
                                store_error=self._store_error)
        host, port = parse_listen(listen, "--listen" if self._listen else "http.listen")
        try:
            bound = self.http.listen_tcp(host, port, tls=tls)
        except OSError as e:
            name = errno.errorcode.get(e.errno, str(e.errno)) if e.errno else "error"
            raise UnavailableError(f"cannot listen on {listen}: {name} ({e.strerror or e})",
                                   code="listen_failed") from None
        self.http.register(self.sel)
        self.log("info", "http.listening", address="%s:%d" % bound[:2], tls="on" if tls else "off")
        if tls:
            unnamed = bootstrap.tls_names_warning(self.settings.config.cluster.tls_cert, host)
            if unnamed is not None:
                # Workers check the host name: none of them could use this address.
                self.log("warning", "http.tls_names", **unnamed)

    def _drain_http(self) -> None:
        """Stop accepting; finish requests in progress for at most ``drain_grace_s``."""
        if self.http is None:
            return
        self.http.begin_drain()
        deadline = time.monotonic() + self.settings.config.drain_grace_s
        while self.http.connections and time.monotonic() < deadline:
            for key, mask in self.sel.select(0.1):
                if self.http.owns(key):
                    self.http.handle_event(key, mask)
            self.http.tick(self._now())

    def _close(self) -> None:
        self._stop = True
        self._poke.set()
        self._end_duties()
        if self.http is not None:
            self.http.close()
        if self.services is not None:
            self.services.close()
        if self.store is not None:
            self.store.close()
        self._duty_wake.close()
        self._duty_done.close()
        signal.set_wakeup_fd(-1)


def serve_cluster(settings: Settings, args) -> int:
    """Entry of ``qlagent serve`` when the configuration has ``[cluster]``."""
    return ControlPlane(settings, listen=getattr(args, "listen", None),
                        exit_after_s=getattr(args, "exit_after", None)).run()
