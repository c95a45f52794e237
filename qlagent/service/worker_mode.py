"""``qlagent serve`` with a ``[worker]`` table: the agent runs as a fleet Worker (issue 11).

Only wiring: the service lock of the state directory, the CA file check ``config check`` makes
too (``service.preflight``), then the Worker built by the composition root
(``bootstrap.build_worker``: control client, inbox, run directories; a bad credential or CA file
is one line naming the field, exit 2) and its loop (``worker.runtime``).
Local tasks and schedules are off in this mode: the local store is not opened at all. The
local HTTP API cannot be served without it; with ``[http] listen`` / ``unix_socket`` (or ``serve
--listen``) a read-only status surface is served instead (``http.worker_status``: ``/healthz``,
``/readyz``, ``/api/v3/worker``), imported only then.
"""

from __future__ import annotations

import errno
import os
import signal

from .. import bootstrap
from ..core.errors import EXIT_UNAVAILABLE, QlError, UnavailableError
from .config import Settings, parse_listen, restart_keys, resolve
from .journal import Journal
from .lock import ServiceLock
from .notify import Notifier
from .preflight import preflight
from .signals import UNUSED_SIGNALS, SignalWakeup


def serve_worker(settings: Settings, listen: str | None = None, exit_after_s: float | None = None) -> int:
    """Run the Worker until SIGTERM (or ``exit_after_s`` seconds, ``serve --exit-after``, then the
    same drain); returns the exit code (0 after a clean drain; 2 for an ``[http]`` value out of
    bounds; 5 when another service holds the state directory or the status surface cannot
    listen). ``listen``: ``serve --listen``, over ``[http] listen``. Raises ValidationError
    (exit 2) naming ``worker.ca_file``/``worker.credential_file`` before anything is written."""
    w = settings.config.worker
    # The files first, before anything is created or locked: a bad one is the CLI's one line
    # naming the field (exit 2), as `config check` gives it, and leaves nothing behind.
    preflight(settings)
    bootstrap.worker_credential(w)
    log = Journal()
    os.makedirs(settings.state_dir, mode=0o700, exist_ok=True)
    lock = ServiceLock(settings.state_dir)
    if not lock.try_acquire():
        log("err", "service.already_running", state_dir=settings.state_dir)
        lock.close()
        return EXIT_UNAVAILABLE
    rt = None
    try:
        notify = Notifier()
        # A cadence the control plane's Session TTL cannot take is bad config: said before the
        # Worker reports ready or opens a Session (which would fence what it holds). A silent
        # link must not hold the start-up past a quarter of the systemd watchdog interval.
        bootstrap.check_worker_cadence(settings, min(bootstrap.DOCTOR_TIMEOUT_S, notify.watchdog_us / 4e6)
                                       if notify.watchdog_us else bootstrap.DOCTOR_TIMEOUT_S)
        rt = bootstrap.build_worker(settings, log, notify)
        counts = rt.recover()
        _start_status_surface(settings, rt, listen, log)
        rt.reload_config = lambda: _reload_config(settings, log)
        rt.wakeup = SignalWakeup(rt.sel, (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, *UNUSED_SIGNALS), rt.on_signal,
                                 ("signal", None))
        log("info", "worker.ready", worker=w.worker_id, control=",".join(rt.client.urls), slots=w.slots, **counts)
        rt.notify.ready(f"worker slots={w.slots}")
        return rt.run(exit_after_s)
    except QlError as e:
        log("err", "service.failed", code=e.code, field=e.field, error=str(e))
        return e.exit_code
    finally:
        if rt is not None:
            rt.inbox.close()
        lock.close()


def _start_status_surface(settings: Settings, rt, listen: str | None, log) -> None:
    """The read-only status surface on ``listen`` / ``[http]``, attached to the Worker's loop
    (nothing when neither is set). UnavailableError ``listen_failed`` (exit 5) when it cannot bind."""
    cfg = settings.config.http
    listen = listen or (cfg.listen if cfg else None)
    unix = cfg.unix_socket if cfg else None
    if not listen and not unix:
        return
    from ..http.worker_status import WorkerStatusSurface     # imported only when it is on
    surface = WorkerStatusSurface(settings, rt.status)
    bound = None
    try:
        if listen:
            bound = "%s:%d" % surface.listen_tcp(*parse_listen(listen))[:2]
        if unix:
            surface.listen_unix(unix)
    except OSError as e:
        surface.close()
        where = listen if not unix or (listen and bound is None) else unix
        name = errno.errorcode.get(e.errno, str(e.errno)) if e.errno else "error"
        raise UnavailableError(f"cannot listen on {where}: {name} ({e.strerror or e})",
                               code="listen_failed") from None
    rt.attach(surface)
    log("info", "http.listening", address=bound, unix=unix, surface="worker_status")


def _reload_config(settings: Settings, log) -> None:
    """SIGHUP on a Worker: read the configuration again and journal the outcome —
    ``config.reload_failed`` (err, the reason; ``ExecReload``'s ``config check`` fails the
    reload job too), ``config.reloaded`` when nothing changed, or ``config.reload_needs_restart``
    (warning) naming the changed keys (``service.config.restart_keys``): none applies live (the Worker's
    identity, control plane, slots and budget), ``systemctl restart qlagent`` does."""
    try:
        new = resolve(settings.config_path, state_dir=settings.state_dir, profile=settings.profile.name)
    except QlError as e:
        log("err", "config.reload_failed", error=str(e))
        return
    changed = restart_keys(settings, new)
    if changed:
        log("warning", "config.reload_needs_restart", file=settings.config_path, changed=",".join(changed))
    else:
        log("info", "config.reloaded", file=settings.config_path)
