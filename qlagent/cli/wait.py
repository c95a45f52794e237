"""``run start --wait``: wait for a Run to end, through the service or on our own.

With a service running (it holds the state directory's lock), or with ``[cluster]`` (Workers
run it), the CLI only watches the store.
Without one, the CLI runs the same engine in-process until the Run ends — the store stays the
single authority either way.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from .. import bootstrap
from ..application.runs import RunService
from ..core.errors import UnavailableError
from ..core.models import Run
from ..core.states import RunState
from ..service.main import Service, service_running

if TYPE_CHECKING:   # ports are annotations only: no Protocol class at run time
    from ..core.ports import Store
    from ..core.settings import Settings

POLL_S = 0.2   # the CLI's own wait; the agent itself never polls


def wait_for_run(settings: Settings, store: Store, run_id: str, timeout_s: float | None) -> Run:
    """Block until ``run_id`` is terminal; returns it. UnavailableError (exit 5, ``wait_timeout``)
    when ``timeout_s`` (s) passes first: the Run is not cancelled — without a service its shim
    carries on alone and the next agent start ingests its receipt (README "Exit codes")."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    # On the cluster authority Workers run it: the CLI only watches, as with a local service.
    if settings.config.cluster is None and not service_running(settings.state_dir):
        store.close()       # the inline engine opens its own authority on the same file
        Service(settings, inline_run=run_id, inline_timeout_s=timeout_s).run()
        reopened = bootstrap.open_store(settings)
        try:
            run = RunService(reopened).get(run_id)
        finally:
            reopened.close()
        if run.state in RunState.LIVE:
            after = "" if timeout_s is None else f" after {timeout_s:g} s"
            fate = ("it stays queued for the next `qlagent serve` or `run start --wait`" if run.state == RunState.QUEUED
                    else "it keeps running with no service watching it; the next `qlagent serve` or "
                         "`run start --wait` records its end")
            raise UnavailableError(f"run {run_id} still {run.state}{after}; {fate} (or `qlagent run cancel` it)",
                                   code="wait_timeout")
        return run
    svc = RunService(store)
    while True:
        run = svc.get(run_id)
        if run.state in RunState.TERMINAL:      # not "not live": a cluster Run may be ``dispatching``
            return run
        if deadline is not None and time.monotonic() >= deadline:
            raise UnavailableError(f"run {run_id} still {run.state} after {timeout_s:g} s; it keeps running "
                                   "under the service", code="wait_timeout")
        time.sleep(POLL_S)
