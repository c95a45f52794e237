"""``qlagent serve``: one selectors main loop that is idle when idle.

It sleeps until the next of: a cron due time, a run deadline or kill escalation, a retry
backoff, the watchdog ping, a shim exit (pidfd), a control-socket poke, an HTTP request, a
netlink event or a signal — no fixed-interval polling. After each wake-up it fires due
schedules, sweeps cancellations, enforces deadlines and calls the dispatcher until it reports
no candidate or a limit. systemd: READY=1 after migrations, capability check and recovery, with
the control socket, the signals and the HTTP surface listening; the schedules (the cron grammar,
the zones, every Task's next fire, the ``@boot`` Runs) are planned right after it, before the
first wait of the loop; WATCHDOG=1 only after a healthy iteration; STOPPING=1 then a bounded
drain on SIGTERM.
"""

from __future__ import annotations

import errno
import os
import selectors
import signal
import time

import msgspec

from .. import bootstrap
from ..core.clock import now_us
from ..core.dispatch import Refusal
from ..core.errors import EXIT_UNAVAILABLE, QlError, UnavailableError
from ..core.states import AttemptState, KillReason, RunState
from . import control
from .config import Settings, parse_listen, resolve, restart_keys, state_space_problem
from .journal import Journal
from .lock import ServiceLock
from .notify import Notifier
from .signals import UNUSED_SIGNALS, SignalWakeup

MAX_PASSES_PER_WAKE = 64           # dispatcher passes after one wake-up (each activates ≤ 1 Run)
# Refusals that leave the Run queued (the next pass would meet the same candidate): stop
# dispatching and re-check later instead of retrying it in a loop.
CAPACITY_REASONS = {"low_space", "artifact_quota_full", "quota_too_large", "unsafe_directory", "artifact_unwritable"}
RECHECK_BLOCKED_US = 10_000_000    # re-try admission this long after a capacity/budget refusal
STORE_RETRY_US = 1_000_000         # while the store takes no writes: one probe write a second
STORE_LOG_EVERY_US = 60_000_000    # ... and one journal line a minute while it lasts
STATE_FULL = "state_full"          # the admission refusals while the state file system is (nearly) full
STORE_UNAVAILABLE = "store_unavailable"   # ... and while the store takes no writes
# The keys a SIGHUP applies at once (service.config.restart_keys' spelling); any other changed
# key is journaled by config.reload_needs_restart until a restart.
LIVE_KEYS = frozenset({"drain_grace_s", "kill_grace_s", "max_concurrent_runs",
                       "retention.keep_per_task", "retention.max_total_bytes"})


def service_running(state_dir: str) -> bool:
    """True if a service holds the state directory's lock."""
    lock = ServiceLock(state_dir)
    try:
        if lock.try_acquire():
            return False
        return True
    finally:
        lock.close()


class Service:
    def __init__(self, settings: Settings, *, listen: str | None = None, exit_after_s: float | None = None,
                 inline_run: str | None = None, inline_timeout_s: float | None = None, clock_us=now_us,
                 overrides: dict | None = None) -> None:
        self.settings = settings
        self._started_with = settings
        # The command line's state_dir and profile (None: not given), which a reload resolves
        # the file with again, as a restart would.
        self._overrides = overrides or {"state_dir": settings.state_dir, "profile": settings.profile.name}
        self.log = Journal(min_priority="info" if inline_run is None else "warning")
        self.notify = Notifier() if inline_run is None else _NoNotify()
        self.inline_run = inline_run
        self._inline_timeout_s = inline_timeout_s
        self.inline_deadline_us: int | None = None
        self._listen = listen
        self._exit_after_s = exit_after_s
        self._now = clock_us
        self.sel = selectors.DefaultSelector()
        self.stop_requested = False
        self.reload_requested = False
        self.poked = True
        self.defs_changed = False          # a CLI/HTTP poke: Task definitions may have changed
        self.draining = False
        self.drain_deadline_us: int | None = None
        self.kill_deadline_us: int | None = None
        self.recheck_us: int | None = None
        self.exit_at_us: int | None = None
        self.http = None
        self.netgate = None
        self.scheduler = None       # the service's, made right after READY=1 (_start_schedules)
        self._signals: list[int] = []
        self._last_extend_us = 0
        self._refusal: str | None = None
        self._refused: dict[str, int] = {}      # reason → dispatch.refused lines (GET /metrics)
        self._held: Refusal | None = None       # the log Artifact's refusal holding Runs now (/readyz)
        # Why the store takes no writes (its file system full, read-only, failing), while it lasts.
        self.store_down: str | None = None
        self.store_retry_us: int | None = None
        self._store_logged_us = 0

    # ---- start-up --------------------------------------------------------------------------
    def _open(self) -> None:
        s = self.settings
        self.store = bootstrap.open_store(s, clock_us=self._now)
        self.budget = bootstrap.budget_meter(s.profile) if self.inline_run is None else None
        max_conc = s.config.max_concurrent_runs or s.profile.max_concurrent_runs
        self.engine = bootstrap.build_engine(s, self.store, max_concurrent=max_conc, budget=self.budget,
                                             clock_us=self._now, log=self.log)
        # `init` (run by the package's postinst) normally did this already; the service does it
        # too so that no resident agent keeps `cryptography` loaded for the old format.
        migrated, problems = bootstrap.migrate_legacy_secrets(s, self.store)
        if migrated:
            self.log("notice", "secrets.migrated", count=migrated)
        for problem in problems:
            self.log("warning", "secrets.migration_failed", error=problem)

    def _start_schedules(self, started_us: int) -> None:
        """The Scheduler over every enabled Task and this start's ``@boot`` Runs: after READY=1,
        since nothing before it needs them (a CLI poke, a signal or an HTTP request waits in the
        selector meanwhile) and they cost the cron grammar, the zones and a next fire per Task."""
        from ..application.schedules import system_timezone
        from .scheduler import Scheduler
        self.scheduler = Scheduler(self.store, system_timezone(), self._now, self.log)
        self.scheduler.reload()
        self.scheduler.fire_boot(started_us)

    def _open_when_room(self) -> dict:
        """Open the store and recover the live Runs (inline too, as it holds the service lock:
        a Run left by an interrupted or timed-out `run start --wait` is ingested, re-attached or
        lost instead of staying live forever). While the state file system is too full for
        that (a router rebooted with its flash full: the open cannot even make the -shm file),
        the service waits for space instead of exiting into a restart loop: store.unavailable
        once a minute, systemd told why with its start timeout extended, a try every second."""
        waited = False
        while True:
            try:
                self._open()
                counts = self.engine.recover()
                if waited:
                    self._store_back(self._now())
                return counts
            except UnavailableError as e:
                problem = state_space_problem(self.settings.state_dir)
                if e.code != "store_unavailable" or problem is None or self.inline_run is not None:
                    raise
                if getattr(self, "store", None) is not None:
                    self.store.close()
                    self.store = None
                now = self._now()
                if not waited or now - self._store_logged_us >= STORE_LOG_EVERY_US:
                    self.log("err", "store.unavailable", error=str(e), state_dir=self.settings.state_dir)
                    self._store_logged_us = now
            waited = True
            self.notify.status(f"waiting for room: {problem}")
            self.notify.extend_timeout(3 * STORE_RETRY_US)
            time.sleep(STORE_RETRY_US / 1e6)

    def _install_signals(self) -> None:
        sigs = [signal.SIGTERM, signal.SIGINT, signal.SIGHUP, *UNUSED_SIGNALS]     # _handle_signals drops the last
        if os.getpid() == 1:
            # PID 1 of a PID namespace (a container): orphans are re-parented here and stay
            # zombies until this process reaps them; SIGCHLD wakes the loop to do it.
            sigs.append(signal.SIGCHLD)
        self._wakeup = SignalWakeup(self.sel, sigs, lambda n: self._signals.append(n), ("signal", None))

    def _network_needed(self) -> bool:
        heads = self.store.list_heads(None)
        return any(h.enabled and h.definition.network.require != "none" for h in heads)

    def _ensure_netgate(self) -> None:
        """Open the gate's netlink socket only once some enabled task needs the network gate."""
        if self.netgate is not None or not self._network_needed():
            return
        self.netgate = bootstrap.network_gate()
        self.engine.admission.network = self.netgate
        self.sel.register(self.netgate.fileno(), selectors.EVENT_READ, ("netlink", None))
        self.log("info", "netgate.started", default_route=self.netgate.satisfied("default_route", None))

    def _start_http(self) -> None:
        cfg = self.settings.config.http
        listen = self._listen or (cfg.listen if cfg else None)
        unix = cfg.unix_socket if cfg else None
        if not listen and not unix:
            return
        from ..http.service import HttpSurface     # the optional surface: imported only when on
        self.http = HttpSurface(self.settings, self.store, on_change=self._poke_self,
                                store_problem=self._store_problem, journal=self.log,
                                admission_problem=self._admission_problem,
                                metrics=self._metrics if cfg is not None and cfg.metrics else None)
        bound = None
        try:
            if listen:
                host, port = parse_listen(listen, "--listen" if self._listen else "http.listen")
                bound = "%s:%d" % self.http.listen_tcp(host, port)[:2]
            if unix:
                self.http.listen_unix(unix)
        except OSError as e:
            # Port in use, address not on this host, no permission: one line, exit 5, no traceback.
            where = listen if not unix or (listen and bound is None) else unix
            name = errno.errorcode.get(e.errno, str(e.errno)) if e.errno else "error"
            raise UnavailableError(f"cannot listen on {where}: {name} ({e.strerror or e})",
                                   code="listen_failed") from None
        self.http.register(self.sel)
        self.log("info", "http.listening", address=bound, unix=unix)

    def _store_problem(self) -> str | None:
        return self.store_down or state_space_problem(self.settings.state_dir)

    def _admission_problem(self) -> str | None:
        """Why queued Runs are held for the log Artifacts (space, quota, an unwritable
        directory), with its figures, while it lasts; else None."""
        return None if self._held is None else self._held.text()

    def _store_failed(self, e: UnavailableError) -> None:
        """A write failed because the store cannot take writes: a condition, not a crash. Runs
        stop being started and the Run ends wait (their receipts stay on disk); the loop stays
        alive (WATCHDOG) and probes once a second; journal once a minute."""
        now = self._now()
        if self.store_down is None or now - self._store_logged_us >= STORE_LOG_EVERY_US:
            self.log("err", "store.unavailable", error=str(e), state_dir=self.settings.state_dir,
                     live=self.engine.live_count())
            self._store_logged_us = now
        self.store_down = str(e)
        self.store_retry_us = now + STORE_RETRY_US
        self._note_refusal(STORE_UNAVAILABLE)
        self.notify.ping_if_due(now)
        self.notify.status(f"no Run starts: {self.store_down}")

    def _store_back(self, now: int) -> None:
        self.log("notice", "store.available", after_s=round((now - self._store_logged_us) / 1e6, 1))
        self.store_down = self.store_retry_us = None
        self.poked = True

    def _poke_self(self) -> None:
        self.poked = self.defs_changed = True

    # ---- main loop ---------------------------------------------------------------------------
    def run(self) -> int:
        lock = ServiceLock(self.settings.state_dir)
        if not lock.try_acquire():
            self.log("err", "service.already_running", state_dir=self.settings.state_dir,
                     hint="a qlagent serve, or a `run start --wait` without a service, holds service.lock")
            lock.close()
            return EXIT_UNAVAILABLE
        try:
            return self._run()
        except QlError as e:
            self.log("err", "service.failed", code=e.code, error=str(e))
            return e.exit_code
        finally:
            lock.close()

    def _run(self) -> int:
        started = self._now()
        counts = self._open_when_room()
        # Inline too: `run cancel` pokes this socket, and Ctrl-C/SIGTERM of the waiting CLI
        # cancels what it launched instead of leaving Runs live with nobody watching them.
        self.ctl = control.bind(self.settings.control_socket)
        self.sel.register(self.ctl, selectors.EVENT_READ, ("control", None))
        self._install_signals()
        if self.inline_run is None:
            self._start_http()
        # Inline too: without the gate a network-gated Run could never start (nor end the wait).
        self._ensure_netgate()
        if self._inline_timeout_s is not None:
            self.inline_deadline_us = started + int(self._inline_timeout_s * 1e6)
        if self._exit_after_s is not None:
            self.exit_at_us = started + int(self._exit_after_s * 1e6)
        self.log("info", "service.ready", profile=self.settings.profile.name, state_dir=self.settings.state_dir,
                 recovered=counts.get("reattached"), ingested=counts.get("ingested"),
                 requeued=counts.get("requeued"), lost=counts.get(AttemptState.LOST),
                 strays=counts.get("strays"))
        # Its STATUS leaves the budget figures to the first iteration's, a moment later: without
        # a cgroup of the service they are a walk of every process on the host.
        self.notify.ready(self._status(budget=False))
        if self.inline_run is None:
            self._start_schedules(started)
        try:
            while True:
                try:
                    self._iteration()
                except UnavailableError as e:
                    if e.code == "store_unavailable":
                        self._store_failed(e)
                        if self._done():
                            break
                        continue
                    # Another process held the store past busy_timeout: this iteration did not
                    # complete (so no WATCHDOG=1 was sent); retry everything on the next one.
                    if e.code != "store_busy":
                        raise
                    self.log("warning", "store.busy", error=str(e))
                    self.poked = True
                    continue
                if self._done():
                    break
        finally:
            self._close()
        self.log("info", "service.stopped")
        return 0

    def _done(self) -> bool:
        if self.inline_run is not None:
            from ..application.runs import RunService    # `run start --wait` only
            if self.inline_deadline_us is not None and self._now() >= self.inline_deadline_us \
                    and not self.engine.starts_in_flight():
                # The wait timed out; a live shim carries on and a service ingests it. Not in
                # mid-start: a shim whose spec never came would leave its Run to end lost.
                return True
            if self.engine.live_count():
                return False   # a Run this process launched (ours or one queued before it) is still live
            return self.draining or \
                RunService(self.store).get(self.inline_run).state not in RunState.LIVE
        return self.draining and self.engine.live_count() == 0

    def _close(self) -> None:
        if self.http is not None:
            self.http.close()
        if self.netgate is not None:
            self.netgate.close()
        try:
            os.unlink(self.settings.control_socket)
        except OSError:
            pass
        signal.set_wakeup_fd(-1)
        self.store.close()

    def _timeout_s(self) -> float | None:
        now = self._now()
        down = self.store_down is not None
        times = [t for t in (
            None if self.draining or down else self._next_fire_us(), self.store_retry_us,
            self.engine.next_wakeup_us(), self.notify.next_ping_us(now), self.drain_deadline_us,
            self.kill_deadline_us, self.recheck_us, self.exit_at_us,
            None if self.inline_deadline_us is None or now >= self.inline_deadline_us else self.inline_deadline_us,
            self.http.next_timeout_us(now) if self.http is not None else None,
            (self._last_extend_us + 5_000_000) if self.draining else None,
        ) if t is not None]
        if self.poked and not down:
            return 0
        if not times:
            return None
        return max(0.0, (min(times) - now) / 1e6)

    def _iteration(self) -> None:
        events = self.sel.select(self._timeout_s())
        http_only = bool(events)
        for key, mask in events:
            if self.http is not None and self.http.owns(key):
                self.http.handle_event(key, mask)
                continue
            http_only = False
            kind, data = key.data
            if kind == "signal":
                self._wakeup.drain()
            elif kind == "control":
                control.drain(self.ctl)
                self.poked = self.defs_changed = True
            elif kind == "pidfd":
                self.sel.unregister(key.fileobj)
                state = self.engine.on_exit(data)
                if state is not None:
                    self._after_run_end()
            elif kind == "netlink":
                if self.netgate.process():
                    self.poked = True
        if http_only and not self._signals and not self.draining and self._timeout_s() != 0:
            # An HTTP request that changed nothing (no poke) and no timer due: skip the dispatcher
            # pass and the budget scan (~3 ms) that would otherwise be paid per request.
            return
        self._handle_signals()
        now = self._now()
        if self.exit_at_us is not None and now >= self.exit_at_us and not self.draining:
            self.stop_requested = True
        if self.stop_requested and not self.draining:
            self._begin_drain(now)
        if self.reload_requested:
            self._reload()
        if self.store_down is None and state_space_problem(self.settings.state_dir) is not None:
            # Much of a small state file system may be the WAL: the probe's checkpoint gives it
            # back before the writes below would fail for room.
            self.store.probe_write()
            problem = state_space_problem(self.settings.state_dir)
            if problem is not None:
                raise UnavailableError(f"store is unavailable ({problem})", code="store_unavailable")
        if self.store_down is not None:
            if now < self.store_retry_us:
                self._wait_for_store(now)
                return
            self.store.probe_write()        # raises while the store still takes no writes
            if state_space_problem(self.settings.state_dir) is not None:
                # A probe row may fit where a Run's writes do not: wait for room, not just a page.
                self.store_retry_us = now + STORE_RETRY_US
                self._wait_for_store(now)
                return
            self._store_back(now)
        poked, self.poked = self.poked, False
        if self.defs_changed and not self.draining:
            # A Task added, edited or re-enabled by the CLI must be scheduled (and gated) now,
            # not only after a SIGHUP.
            self.defs_changed = False
            if self.scheduler is not None:
                self.scheduler.reload()
            self._ensure_netgate()
        if not self.draining and self.inline_run is None:
            nw = self.scheduler.next_wake_us
            if poked or nw is None or now >= nw:
                self.scheduler.fire_due()
        if poked:
            self.engine.sweep_cancels()
        self.engine.tick()
        if self.draining:
            self._drain_step(now)
        elif self._store_problem():
            self._note_refusal(STATE_FULL)      # the space probe of the next wake-up lifts it
            self.recheck_us = now + STORE_RETRY_US
        else:
            self._dispatch(now)
        self._sync_pidfds()
        if self.http is not None:
            self.http.tick(now)
        self.notify.ping_if_due(self._now())       # only reached after a healthy iteration
        self.notify.status(self._status())

    def _wait_for_store(self, now: int) -> None:
        """An iteration while the store takes no writes: HTTP and the drain go on, deadlines and
        kill escalations still hold (``tick``: signals; a receipt it would ingest raises again
        until the store takes writes); nothing is fired or dispatched. A drain that cannot
        record a Run's end leaves it to the next start (its receipt stays)."""
        if self.http is not None:
            self.http.tick(now)
        self.notify.ping_if_due(now)
        if self.draining:
            self._drain_step(now)
        self.engine.tick()
        self._sync_pidfds()

    def _handle_signals(self) -> None:
        sigs, self._signals = self._signals, []
        for s in sigs:
            if s in (signal.SIGTERM, signal.SIGINT):
                self.stop_requested = True
            elif s == signal.SIGHUP:
                self.reload_requested = True
            elif s == signal.SIGCHLD:
                self.engine.reap_orphans()

    def _reload(self) -> None:
        self.reload_requested = False
        self.notify.reloading()
        try:
            new = resolve(self.settings.config_path, **self._overrides)
            # Against the settings started with: a key changed by an earlier reload still waits.
            restart = [k for k in restart_keys(self._started_with, new, LIVE_KEYS)
                       if not (k == "http.listen" and self._listen)]     # --listen wins over the file
            # What needs a restart keeps its running value until then: the Profile (the budget,
            # the quotas) and the paths, store and listeners opened with the old settings.
            self.settings = msgspec.structs.replace(self.settings, config=new.config)
            self.engine.admission.max_concurrent = (new.config.max_concurrent_runs
                                                    or self.settings.profile.max_concurrent_runs)
            if restart:
                self.log("warning", "config.reload_needs_restart", file=new.config_path, changed=",".join(restart))
            else:
                self.log("info", "config.reloaded", file=new.config_path)
        except QlError as e:
            self.log("err", "config.reload_failed", error=str(e))
        n = self.scheduler.reload() if self.scheduler is not None else 0
        self._ensure_netgate()
        self.notify.ready(self._status())    # ends the reload either way; a refusal is in the journal
        self.log("info", "schedule.reloaded", tasks=n)
        self.poked = True

    def _dispatch(self, now: int) -> None:
        self.recheck_us = None
        for _ in range(MAX_PASSES_PER_WAKE):
            r = self.engine.dispatcher.dispatch_once()
            if r.status in ("activated", "launch_failed"):
                # One start per iteration: a pass that activates commits its claim and asks for
                # a shim (tens of ms on a loaded router); HTTP, the watchdog and the other
                # events are served between two, and the next pass follows at once. After
                # launch_failed (that Run has ended with its reason, run.start_failed) too: the
                # Runs behind it must not wait for an unrelated wake-up.
                self.poked = True
                return
            if r.status == "more":
                continue
            if r.status == "unavailable" and r.reason not in CAPACITY_REASONS:
                self.log("warning", "run.unavailable", run=r.run_id, reason=r.reason)
                continue
            refused = None
            if r.status == "unavailable" or (r.status == "limited" and r.reason in ("pids", "memory")):
                refused = r.reason
                self.recheck_us = now + RECHECK_BLOCKED_US
            self._note_refusal(refused, r.refusal)
            break
        else:
            # Passes left (more pages or more Runs): go on next iteration, after other events,
            # instead of sleeping until an unrelated wake-up while Runs wait behind the cursor.
            self.poked = True

    def _note_refusal(self, reason: str | None, refusal: Refusal | None = None) -> None:
        """Log entering and leaving a capacity/budget refusal once each (STATUS shows it while
        it lasts), not at every re-check: a router's log must not fill with the same line. A
        log Artifact's ``refusal`` carries its figures and path into the line and /readyz."""
        self._held = refusal
        if reason == self._refusal:
            return
        if reason is None:
            self.log("notice", "dispatch.admitting", after=self._refusal)
        else:
            self.log("warning", "dispatch.refused", **(refusal.fields() if refusal else {"reason": reason}))
            self._refused[reason] = self._refused.get(reason, 0) + 1
        self._refusal = reason

    def _sync_pidfds(self) -> None:
        """Watch exactly the engine's fds: a start's fd changes as it goes (status pipe, then
        the shim's pidfd) and may be closed between events, its number then reused."""
        wanted = self.engine.pidfds()
        for key in list(self.sel.get_map().values()):
            if key.data[0] == "pidfd" and wanted.get(key.fd) != key.data[1]:
                self.sel.unregister(key.fileobj)
        registered = {k.fileobj for k in self.sel.get_map().values() if k.data[0] == "pidfd"}
        for fd, aid in wanted.items():
            if fd not in registered:
                self.sel.register(fd, selectors.EVENT_READ, ("pidfd", aid))

    def _after_run_end(self) -> None:
        r = self.settings.config.retention
        p = self.settings.profile
        total = r.max_total_bytes or max(p.log_max_bytes, p.artifact_total_bytes - p.log_max_bytes * p.max_concurrent_runs)
        pruned = self.engine.prune(r.keep_per_task, total)
        if pruned:
            self.log("info", "retention.pruned", logs=pruned)
        self.poked = True          # a slot is free: dispatch again

    # ---- drain -----------------------------------------------------------------------------
    def _begin_drain(self, now: int) -> None:
        self.draining = True
        self.engine.admission.draining = True
        # An interrupted `run start --wait` stops its Runs at once; the service gives them a grace.
        grace = self.settings.config.drain_grace_s if self.inline_run is None else 0
        self.drain_deadline_us = now + int(grace * 1e6)
        self.notify.stopping()
        if self.http is not None:
            self.http.begin_drain()     # stop accepting; requests in progress still finish
        self._extend(now)
        self.log("notice", "service.draining", live=self.engine.live_count(), grace_s=grace)

    def _extend(self, now: int) -> None:
        cfg = self.settings.config
        left_us = max(0, (self.drain_deadline_us or now) - now) + int((cfg.kill_grace_s + 5) * 1e6)
        self.notify.extend_timeout(left_us)
        self._last_extend_us = now

    def _drain_step(self, now: int) -> None:
        if self.engine.live_count() == 0:
            return
        if now - self._last_extend_us >= 5_000_000:
            self._extend(now)
        if self.drain_deadline_us is not None and now >= self.drain_deadline_us:
            self.drain_deadline_us = None
            kill_grace = self.settings.config.kill_grace_s
            self.log("notice", "service.drain_expired", cancelling=self.engine.live_count())
            self.engine.stop_all(KillReason.SHUTDOWN, kill_grace)
            self.kill_deadline_us = now + int((kill_grace + 2) * 1e6)
        elif self.kill_deadline_us is not None and now >= self.kill_deadline_us:
            # Everything got SIGKILL; a shim that still has not exited is not worth waiting for.
            self.log("err", "service.drain_abandoned", live=self.engine.live_count())
            self.engine.abandon_all()

    def _metrics(self) -> bytes:
        """``GET /metrics`` of the local agent (issue 26 §3): Runs by state, admission refusals
        by reason (``dispatch.refused`` and ``run.waiting`` lines journaled), the service tree's
        memory (bytes) and tasks against the Profile's budget, log Artifact bytes."""
        from ..core.metrics import COUNTER, GAUGE, Family, render
        counts = self.store.run_state_counts()
        runs = Family("qlagent_runs", GAUGE, "Runs by state, every Project")
        for state in RunState.ALL:
            runs.add(counts.get(state, 0), state=state)
        refused = Family("qlagent_admission_refusals_total", COUNTER,
                         "Admission refusals journaled (dispatch.refused, run.waiting) by reason")
        waits = self.engine.waits()
        for reason in sorted(self._refused.keys() | waits.keys()):
            refused.add(self._refused.get(reason, 0) + waits.get(reason, 0), reason=reason)
        fams = [runs, refused,
                Family("qlagent_runs_live", GAUGE, "Attempts with a process tree now").add(self.engine.live_count()),
                Family("qlagent_artifact_bytes", GAUGE, "Bytes of the log Artifacts kept")
                .add(self.engine.artifact_bytes())]
        if self.budget is not None:
            u = self.budget.recent(0.5, self.engine.live_pids())
            mem, pids = self.budget.limits(u)
            fams += [Family("qlagent_service_memory_bytes", GAUGE,
                            "Anonymous memory of the service tree (cgroup, else PSS sum)").add(u.rss_bytes),
                     Family("qlagent_service_memory_limit_bytes", GAUGE, "Memory budget of the service").add(mem),
                     Family("qlagent_service_pids", GAUGE, "Tasks in the service tree").add(u.pids),
                     Family("qlagent_service_pids_limit", GAUGE, "Task budget of the service").add(pids)]
            if u.oom_kills is not None:
                fams.append(Family("qlagent_service_oom_kills_total", COUNTER,
                                   "OOM kills in the service cgroup").add(u.oom_kills))
        return render(fams)

    def _next_fire_us(self) -> int | None:
        return self.scheduler.next_wake_us if self.scheduler is not None else None

    def _status(self, budget: bool = True) -> str:
        queued = self.store.queued_count()
        nw = self._next_fire_us()
        parts = [f"running={self.engine.live_count()}", f"queued={queued}",
                 "next=" + (time.strftime("%H:%M:%S", time.gmtime(nw / 1e6)) + "Z" if nw else "-")]
        if self.budget is not None and budget:
            u = self.budget.recent(0.5, self.engine.live_pids())
            mem, pids = self.budget.limits(u)
            parts.append(f"mem={u.rss_bytes // 1048576}/{mem // 1048576}MiB pids={u.pids}/{pids}")
            if u.oom_kills:
                parts.append(f"oom_kills={u.oom_kills}")
        block = self.engine.admission.last_block
        if block and block != "draining":
            parts.append(f"blocked={block}")
        if self.draining:
            parts.append("draining")
        return " ".join(parts)


class _NoNotify:
    def ready(self, status): pass
    def status(self, status): pass
    def stopping(self): pass
    def extend_timeout(self, usec): pass
    def reloading(self): pass
    def send(self, *lines): pass
    def next_ping_us(self, now_us): return None
    def ping_if_due(self, now_us): return False


def serve(settings: Settings, args) -> int:
    """Entry of ``qlagent serve``; returns the process exit code (0 after a clean drain). With a
    ``[cluster]`` table this process is a control-plane replica (``service.controlplane``)."""
    if settings.config.cluster is not None:
        from .controlplane import serve_cluster
        return serve_cluster(settings, args)
    return Service(settings, listen=getattr(args, "listen", None), exit_after_s=getattr(args, "exit_after", None),
                   overrides={"state_dir": args.state_dir, "profile": args.profile}).run()
