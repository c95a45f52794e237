"""The local HTTP surface of a fleet Worker (issue 11: "the local HTTP API stays optional"): read-only.

A Worker has no local store (Tasks, Runs and API tokens live on the control plane), so the local
agent's routes (``http.api``) cannot be served here. With ``[http] listen`` / ``unix_socket`` (or
``serve --listen``) in Worker mode this surface answers instead:

- ``GET /healthz``: 200 ``{"status": "ok"}`` while the process answers;
- ``GET /readyz``: 200 ``{"status": "ready", "checks": …}`` while a Session is open, nothing
  blocks the Worker and it is not draining; else 503 ``not_ready`` with the failing check and
  ``Retry-After: 1``. ``checks.control`` names what blocks it (``code: one line``: the last
  failed hello — a clock that is not set, no replica answering — or a credential refused);
- ``GET /api/v3/worker``: 200, the Worker's status document (``WorkerRuntime.status``: Worker ID,
  control plane, Session and generation, slots and free slots, live runs, inbox depth and caps);
- ``GET /metrics`` (only with ``[http] metrics = true``, else 404): the same figures in the
  Prometheus text format (:func:`worker_metrics`).

Any other path is 404 ``not_found``, another method on these 405. No API token is asked for:
nothing here changes the Worker and nothing shown is secret (never the credential, a lease token,
a command or an environment); bind it to loopback or a unix socket like the local API.

The same bounded server as the local API (``http.server.HttpServer``, the Profile's limits and
``[http]`` overrides via ``http.service.limits_for``), driven by the Worker's selectors loop:
``register(selector)``, ``owns(key)`` + ``handle_event(key, mask)``, ``next_timeout_s()``,
``begin_drain()`` on SIGTERM, ``close()``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from qlagent.core.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from qlagent.core.metrics import COUNTER, GAUGE, Family, render
from qlagent.http.routing import Router
from qlagent.http.server import HttpServer, LoopSurface
from qlagent.http.wire import Request, Response
from qlagent.http.service import PROBE_PATHS, limits_for

if TYPE_CHECKING:
    from qlagent.core.settings import Settings

STATUS_PATH = "/api/v3/worker"


def worker_metrics(st: dict) -> bytes:
    """The Prometheus text of a Worker's status document ``st`` (``WorkerRuntime.status``):
    slots and free slots, live runs, inbox rows/bytes and caps, log store bytes and cap, the
    last heartbeat's round trip (s; left out before one), whether a Session is open, and the
    counters since start — runs spawned, completed, self-fenced, Pulls, Sessions opened and
    reconnects (Sessions opened after the first)."""
    def gauge(name: str, help: str, value) -> Family:
        return Family(name, GAUGE, help).add(value)

    def counter(name: str, help: str, value) -> Family:
        return Family(name, COUNTER, help).add(value)

    c, inbox, logs = st["counts"], st["inbox"], st["logStore"]
    fams = [gauge("qlagent_worker_slots", "Runs this Worker may run at once", st["slots"]),
            gauge("qlagent_worker_free_slots", "Slots free now", st["freeSlots"]),
            gauge("qlagent_worker_live_runs", "Runs with a process now", st["liveRuns"]),
            gauge("qlagent_worker_session_open", "1 while a Session is open", int(st["session"] is not None)),
            gauge("qlagent_worker_inbox_rows", "Inbox rows kept", inbox["rows"]),
            gauge("qlagent_worker_inbox_max_rows", "Inbox rows at most", inbox["maxRows"]),
            gauge("qlagent_worker_inbox_bytes", "Bytes of the inbox rows' specs", inbox["bytes"]),
            gauge("qlagent_worker_inbox_max_bytes", "Inbox spec bytes at most", inbox["maxBytes"]),
            gauge("qlagent_worker_log_store_bytes", "Log bytes not yet uploaded (live runs at their quota)",
                  logs["bytes"]),
            gauge("qlagent_worker_log_store_max_bytes", "Log bytes not yet uploaded at most", logs["maxBytes"]),
            counter("qlagent_worker_runs_spawned_total", "Runs spawned", c["spawned"]),
            counter("qlagent_worker_runs_completed_total", "Runs completed", c["completed"]),
            counter("qlagent_worker_self_fences_total", "Runs stopped by this Worker's own fencing", c["fenced"]),
            counter("qlagent_worker_pulls_total", "Pulls sent", c["pulls"]),
            counter("qlagent_worker_sessions_total", "Sessions opened", c["sessions"]),
            counter("qlagent_worker_reconnects_total", "Sessions opened after the first", max(0, c["sessions"] - 1))]
    if st["heartbeatRttS"] is not None:
        fams.append(gauge("qlagent_worker_heartbeat_rtt_seconds", "Round trip of the last answered heartbeat",
                          st["heartbeatRttS"]))
    return render(fams)


class WorkerStatusSurface(LoopSurface):
    """``WorkerStatusSurface(settings, status)``: ``status()`` returns the Worker's status document
    (a dict with at least ``session``, None while no Session is open, and ``draining``). Raises
    ValidationError for an ``[http]`` override out of bounds."""

    def __init__(self, settings: Settings, status: Callable[[], dict]) -> None:
        self._status = status
        self.draining = False
        r = Router()
        r.add("GET", "/healthz", lambda req, p: Response.json(200, {"status": "ok"}))
        r.add("GET", "/readyz", self._readyz)
        r.add("GET", STATUS_PATH, lambda req, p: Response.json(200, self._status()))
        if settings.config.http is not None and settings.config.http.metrics:
            r.add("GET", "/metrics", lambda req, p: Response(200, [("Content-Type", METRICS_CONTENT_TYPE)],
                                                             worker_metrics(self._status())))
        self.server = HttpServer(limits_for(settings), r, probe_paths=PROBE_PATHS)

    def _readyz(self, req: Request, p: dict[str, str]) -> Response:
        st = self._status()
        blocked = st["blocked"]
        checks = {"session": "ok" if st["session"] is not None else "connecting",
                  "control": "ok" if blocked is None else f"{blocked['code']}: {blocked['error']}",
                  "service": "draining" if self.draining or st["draining"] else "ok"}
        ok = all(v == "ok" for v in checks.values())
        return Response.json(200 if ok else 503, {"status": "ready" if ok else "not_ready", "checks": checks},
                             None if ok else [("Retry-After", "1")])

    def listen_tcp(self, host: str, port: int) -> tuple[str, int]:
        """Bind HOST:PORT (0 picks a free port); the bound (host, port). Raises OSError."""
        return self.server.listen_tcp(host, port)

    def next_timeout_s(self) -> float | None:
        """Expire timed-out connections; seconds until the next connection deadline, or None."""
        mono = time.monotonic()
        deadline = self.server.timeouts(mono)
        return None if deadline is None else max(0.0, deadline - mono)

    def close(self) -> None:
        self.server.close()
