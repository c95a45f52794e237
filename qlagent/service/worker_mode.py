"""``qlagent serve`` with a ``[worker]`` table: the agent runs as a fleet Worker (issue 11).

Only wiring: the service lock of the state directory, then the Worker built by the composition
root (``bootstrap.build_worker``: control client, inbox, run directories; a bad credential or
CA file is one line naming the field, exit 2) and its loop (``application.fleet_worker``).
Local tasks and schedules are off in this mode: the local store is not opened at all, and the
local HTTP API is not started.
"""

from __future__ import annotations

import os

from .. import bootstrap
from ..core.errors import EXIT_UNAVAILABLE, QlError
from .config import Settings
from .journal import Journal
from .lock import ServiceLock
from .notify import Notifier


def serve_worker(settings: Settings) -> int:
    """Run the Worker until SIGTERM; returns the exit code (0 after a clean drain; 2 for a bad
    credential or CA file; 5 when another service holds the state directory)."""
    w = settings.config.worker
    log = Journal()
    os.makedirs(settings.state_dir, mode=0o700, exist_ok=True)
    lock = ServiceLock(settings.state_dir)
    if not lock.try_acquire():
        log("err", "service.already_running", state_dir=settings.state_dir)
        lock.close()
        return EXIT_UNAVAILABLE
    rt = None
    try:
        rt = bootstrap.build_worker(settings, log, Notifier())
        counts = rt.recover()
        rt.install_signals()
        log("info", "worker.ready", worker=w.worker_id, control=repr(rt.client), slots=w.slots, **counts)
        rt.notify.ready(f"worker slots={w.slots}")
        return rt.run()
    except QlError as e:
        log("err", "service.failed", code=e.code, field=e.field, error=str(e))
        return e.exit_code
    finally:
        if rt is not None:
            rt.inbox.close()
        lock.close()
