"""``qlagent serve`` with a ``[worker]`` table: the agent runs as a fleet Worker (issue 11).

Only wiring: the service lock of the state directory, the control client (credential and CA
checked before anything starts: a bad one is one line naming the field, exit 2), the durable
inbox (``<state dir>/inbox.sqlite3``), the Worker's run directories (``<state dir>/worker-runs``)
and the loop (``application.fleet_worker``). Local tasks and schedules are off in this mode: the
local store is not opened at all, and the local HTTP API is not started.
"""

from __future__ import annotations

import os

from ..adapters.control_client import ControlClient
from ..adapters.sqlite.inbox import SqliteInbox
from ..adapters.worker_runs import WorkerRuns
from ..application.fleet_worker import WorkerRuntime
from ..core.cluster import Hello
from ..core.errors import EXIT_UNAVAILABLE, QlError
from .config import Settings
from .journal import Journal
from .lock import ServiceLock
from .notify import Notifier

RUNS_DIRNAME = "worker-runs"


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
    inbox = None
    try:
        client = ControlClient(w.control_url, w.worker_id, w.credential_file, w.ca_file)
        inbox = SqliteInbox.for_profile(settings.state_dir, settings.profile)
        runs = WorkerRuns(os.path.join(settings.state_dir, RUNS_DIRNAME))
        rt = WorkerRuntime(client, inbox, runs, worker_id=w.worker_id,
                           hello=Hello(labels=dict(w.labels), executor_types=tuple(w.executors), slots=w.slots),
                           slots=w.slots, heartbeat_s=w.heartbeat_interval_s, pull_wait_s=w.pull_wait_s,
                           drain_grace_s=settings.config.drain_grace_s,
                           log_store_bytes=w.log_store_bytes or settings.profile.artifact_total_bytes, log=log,
                           notify=Notifier())
        counts = rt.recover()
        rt.install_signals()
        log("info", "worker.ready", worker=w.worker_id, control=repr(client), slots=w.slots, **counts)
        rt.notify.ready(f"worker slots={w.slots}")
        return rt.run()
    except QlError as e:
        log("err", "service.failed", code=e.code, field=e.field, error=str(e))
        return e.exit_code
    finally:
        if inbox is not None:
            inbox.close()
        lock.close()
