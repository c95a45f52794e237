"""The optional HTTP surface of ``qlagent serve`` (issue 5 §1, ADR-0376 §4).

Imported by the service loop only when ``http.listen`` / ``http.unix_socket`` / ``serve
--listen`` is set, so a headless agent loads none of ``qlagent.http``. The server runs on the
loop thread; route functions reach the store through the same single operation queue as the
dispatcher (the store ports).
"""

from __future__ import annotations

import time

import msgspec
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING

from qlagent.core.errors import QlError, UnavailableError, ValidationError
from qlagent.core.linelimit import LineLimit
from qlagent.http.api import Api, build_router
from qlagent.http.server import Deferred, HttpServer, LoopSurface
from qlagent.http.wire import HttpError, HttpLimits, Request, Response

if TYPE_CHECKING:   # ports are annotations only: no Protocol class at run time
    from qlagent.core.ports import Store
    from qlagent.core.settings import Settings

# Config overrides may only stay within these bounds (edge: never above the Profile's own
# 4 in flight / 512-byte body, ADR-0376 §4).
MAX_IN_FLIGHT = 64
MAX_BODY_BYTES = 65_536
MIN_BODY_BYTES = 256           # a Task Start body is ~200 bytes
READ_TIMEOUT_S = (0.5, 60.0)
WORKER_PATHS = "/api/v3/cluster/workers/"
# A replica's accept queue (connections, capped by net.core.somaxconn): a burst of connects from
# a flood must not fill it and drop a probe's or a Worker's SYN (a 1 s, then 3 s retransmit).
CLUSTER_BACKLOG = 1024
WORKER_IDLE_S = 65.0          # keep-alive idle bound on a control plane (s): above the longest heartbeat interval
READY_PATH = "/readyz"
PROBE_PATHS = frozenset({"/healthz", READY_PATH})   # answered without an in-flight slot (README "HTTP API")
AUDIT_LINES = 20              # refusal audit lines per AUDIT_WINDOW_S; beyond, counted and said once
AUDIT_WINDOW_S = 60.0


class AnswerTally:
    """``AnswerTally(then)``: an HttpServer ``on_answer`` hook counting the answers to Task Start
    (``POST …/tasks/{taskId}/runs``) by HTTP status in ``task_starts`` (status text → answers),
    then calling ``then`` (another hook, or None)."""

    def __init__(self, then: Callable[[Request, Response], None] | None) -> None:
        self._then = then
        self.task_starts: dict[str, int] = {}

    def __call__(self, req: Request, resp: Response) -> None:
        if req.method == "POST" and req.path.endswith("/runs") and "/tasks/" in req.path:
            code = str(resp.status)
            self.task_starts[code] = self.task_starts.get(code, 0) + 1
        if self._then is not None:
            self._then(req, resp)


def store_error_hook(count: Callable[[str, str], None]) -> Callable[[str, QlError], None]:
    """A Router ``on_error`` calling ``count(route, code)`` for an error a route answers because
    the store failed: an UnavailableError, or an error raised from one (Task Start's 503
    ``task_start_unavailable``); ``code`` is the UnavailableError's."""
    def on_error(route: str, err: QlError) -> None:
        cause = err if isinstance(err, UnavailableError) else err.__cause__
        if isinstance(cause, UnavailableError):
            count(route, cause.code)
    return on_error


class RefusalAudit:
    """``RefusalAudit(journal)``: an HttpServer ``on_answer`` hook writing one ``http.refused``
    warning per 401/403 answer — peer address, method, route (path, ≤ 200 characters), status,
    reason (the answer's error code); never a header, so never a credential. At most
    ``AUDIT_LINES`` per ``AUDIT_WINDOW_S`` seconds (monotonic): the first line of the next window
    carries ``suppressed=N``, the lines left out meanwhile."""

    def __init__(self, journal: Callable[..., None], clock: Callable[[], float] = time.monotonic) -> None:
        self._journal, self._clock = journal, clock
        self._limit = LineLimit(AUDIT_LINES, AUDIT_WINDOW_S, clock())

    def __call__(self, req: Request, resp: Response) -> None:
        if resp.status not in (401, 403):
            return
        suppressed = self._limit.admit(self._clock())
        if suppressed is None:
            return
        try:
            doc = msgspec.json.decode(resp.body)
            reason = doc.get("error") or doc.get("code") if isinstance(doc, dict) else None
        except msgspec.DecodeError:
            reason = None
        self._journal("warning", "http.refused", peer=req.peer, method=req.method, route=req.path[:200],
                      status=resp.status, reason=str(reason)[:64] if reason else None,
                      suppressed=suppressed or None)


def limits_for(settings: Settings) -> HttpLimits:
    """HttpLimits of the Profile with ``[http]`` ``max_in_flight`` (1..Profile value on edge,
    else ..64), ``max_body_bytes`` (256..Profile value on edge, else ..65536 bytes) and
    ``read_timeout_s`` (0.5..60 s) applied. Raises ValidationError naming the key and range."""
    profile = settings.profile
    limits = HttpLimits.for_profile(profile)
    cfg = settings.config.http
    if cfg is None:
        return limits
    edge = profile.name == "edge"
    top_flight = profile.http_in_flight if edge else MAX_IN_FLIGHT
    top_body = profile.http_body_bytes if edge else MAX_BODY_BYTES
    if cfg.max_in_flight is not None:
        if not 1 <= cfg.max_in_flight <= top_flight:
            raise ValidationError("http.max_in_flight", f"must be 1..{top_flight} on the {profile.name} profile",
                                  limit=top_flight)
        limits = replace(limits, max_in_flight=cfg.max_in_flight)
    if cfg.max_body_bytes is not None:
        if not MIN_BODY_BYTES <= cfg.max_body_bytes <= top_body:
            raise ValidationError("http.max_body_bytes",
                                  f"must be {MIN_BODY_BYTES}..{top_body} bytes on the {profile.name} profile",
                                  limit=top_body)
        limits = replace(limits, max_body_bytes=cfg.max_body_bytes)
    lo, hi = READ_TIMEOUT_S
    if not lo <= cfg.read_timeout_s <= hi:
        raise ValidationError("http.read_timeout_s", f"must be {lo}..{hi} seconds", limit=hi)
    return replace(limits, read_timeout_s=cfg.read_timeout_s)


class HttpSurface(LoopSurface):
    """``HttpSurface(settings, store, on_change, cluster=None)``: the API server for the loop.

    ``on_change()`` pokes the loop (a new Run to dispatch, a cancellation to carry out).
    ``store_problem()`` (a local agent's loop) says why the store takes no writes or no Run may
    start for lack of room; ``admission_problem()`` why queued Runs are held for their log
    Artifacts (low_space with its figures…); ``/readyz`` answers 503 naming either.
    ``cluster`` (a control-plane replica: ``bootstrap.ClusterServices``) adds the Worker routes
    (:func:`mount_worker_routes`, ``threads`` database threads) and serves the logs from the
    uploaded chunks; the listener then also admits a log chunk's body and holds a Worker's
    keep-alive connection between heartbeats.
    Drive it with ``listen_tcp``/``listen_unix``, ``register(selector)``, ``owns(key)`` +
    ``handle_event(key, mask)``, ``next_timeout_us(now_us)`` and ``tick(now_us)`` each turn,
    ``begin_drain()`` on SIGTERM and ``close()`` at exit. ``journal`` (``service.journal.
    Journal``): every 401/403 answer is audited there (:class:`RefusalAudit`). ``metrics()``
    (``[http] metrics = true``): the ``GET /metrics`` body; None answers that path 404. On a
    replica ``tally`` (:class:`AnswerTally`) counts the Task Start answers by status and
    ``store_error(route, code)`` hears each request answered 503 because the database failed
    (an API route by its function's name, a Worker route as ``WorkerRoutes`` names it). Raises
    ValidationError for an ``[http]`` override out of bounds (see :func:`limits_for`).
    """

    def __init__(self, settings: Settings, store: Store, on_change: Callable[[], None], cluster=None,
                 threads: int = 4, store_problem: Callable[[], str | None] = lambda: None,
                 admission_problem: Callable[[], str | None] = lambda: None,
                 journal: Callable[..., None] | None = None,
                 metrics: Callable[[], bytes] | None = None,
                 store_error: Callable[[str, str], None] = lambda route, code: None) -> None:
        self.draining = False
        self.api = Api(store, on_change, ready=lambda: not self.draining,
                       log_chunks=cluster.log_reader if cluster is not None else None,
                       clock=cluster.clock if cluster is not None else None, store_problem=store_problem,
                       admission_problem=admission_problem,
                       metrics=metrics)
        self.router = build_router(self.api, store_error_hook(store_error) if cluster is not None else None)
        limits = limits_for(settings)
        self.worker_routes = None
        self.tally = None
        audit = RefusalAudit(journal) if journal is not None else None
        if cluster is None:
            self.server = HttpServer(limits, self.router, probe_paths=PROBE_PATHS, on_answer=audit)
        else:   # a control plane: the cluster is loaded only here (never on a local agent)
            from qlagent.core.cluster import MAX_CHUNK_BYTES
            self.tally = audit = AnswerTally(audit)
            self.worker_routes, handler, error_response = mount_worker_routes(
                self.router, cluster, threads, limits.max_body_bytes, store_error)
            # Every Worker route request is in flight while its database work (or long-poll)
            # runs; a Worker keeps its connection between heartbeats (≤ 60 s).
            in_flight = limits.max_in_flight + threads + cluster.config.max_long_polls
            limits = replace(limits, max_body_bytes=max(limits.max_body_bytes, MAX_CHUNK_BYTES),
                             max_in_flight=in_flight, max_connections=max(limits.max_connections, in_flight + 16),
                             idle_timeout_s=max(limits.idle_timeout_s, WORKER_IDLE_S),
                             max_requests_per_connection=max(limits.max_requests_per_connection, 100_000))
            self.server = HttpServer(limits, handler, probe_paths=PROBE_PATHS, error_response=error_response,
                                     on_answer=audit)

    def listen_tcp(self, host: str, port: int, tls=None) -> tuple[str, int]:
        """Bind HOST:PORT (port 0 picks a free one); returns the bound (host, port). ``tls``: a
        ``qlagent.http.tls.TlsAcceptor`` (HTTPS on this listener)."""
        backlog = 16 if self.worker_routes is None else CLUSTER_BACKLOG
        return self.server.listen_tcp(host, port, backlog=backlog, tls=tls)

    def next_timeout_us(self, now_us: int) -> int | None:
        """The next connection deadline as wall-clock µs (the loop's clock), or None. The server
        keeps monotonic seconds; the difference is carried over so clock steps do not matter."""
        mono = time.monotonic()
        deadline = self.server.timeouts(mono)
        return None if deadline is None else now_us + max(0, int((deadline - mono) * 1e6))

    def tick(self, now_us: int) -> None:
        """Expire timed-out connections (408, idle close, stalled writes)."""
        self.server.timeouts(time.monotonic())

    @property
    def connections(self) -> int:
        """Open client connections."""
        return self.server.connections

    def close(self) -> None:
        """Close every connection, then stop the Worker routes' threads."""
        self.server.close()
        if self.worker_routes is not None:
            self.worker_routes.close()


def mount_worker_routes(router, cluster, threads: int, api_body_bytes: int,
                        store_error: Callable[[str, str], None]):
    """Add the Worker routes (docs/worker-protocol.md) over ``cluster`` (``bootstrap.
    ClusterServices``) to ``router``, with ``threads`` database threads and ``[cluster]``
    ``max_long_polls``/``answer_timeout_s``; ``store_error`` as ``WorkerRoutes``'. Returns
    (WorkerRoutes, the server handler, the server's ``error_response``).

    The handler stamps ``X-Qlagent-Server-Now-Us`` (the database clock) on every answer, runs
    the API routes (all but the probes) on the same database threads, ``/readyz`` on its own
    thread (``WorkerRoutes.probe``: ``/healthz`` stays on the loop, answered at once), and keeps their body
    bound at ``api_body_bytes`` (413) although the server admits a log chunk
    (``core.cluster.MAX_CHUNK_BYTES``). The server's own refusals carry both error shapes: the
    Worker protocol's ``error``/``field`` and the API's ``code``."""
    from qlagent.http.worker_routes import WorkerRouteLimits, WorkerRoutes, WorkerServices
    c = cluster.config
    routes = WorkerRoutes(WorkerServices(registry=cluster.registry, pull=cluster.pull, acks=cluster.acks,
                                         logs=cluster.logs, clock=cluster.clock, joins=cluster.joins),
                          WorkerRouteLimits(threads=threads, max_long_polls=c.max_long_polls,
                                            answer_timeout_s=c.answer_timeout_s), store_error)
    routes.register(router)
    inner = routes.handler(router)

    def handle(req: Request) -> Response | Deferred:
        if req.path == READY_PATH:     # reads the database: never on the loop, which answers /healthz
            return routes.probe(lambda: inner(req))
        if req.path.startswith(WORKER_PATHS) or req.path in PROBE_PATHS:
            return inner(req)
        if len(req.body) > api_body_bytes:
            raise HttpError(413, "body_too_large",
                            f"request body is {len(req.body)} bytes; the limit is {api_body_bytes} bytes")
        # API routes make several PostgreSQL round trips (a Task Start ~26 statements): on the
        # database threads, so the loop keeps serving every other connection meanwhile.
        return routes.defer(lambda: inner(req))

    def error_response(status: int, code: str, message: str, headers: list[tuple[str, str]] | None) -> Response:
        resp = routes.error_response(status, code, message, headers)
        resp.body = msgspec.json.encode({"code": code, **msgspec.json.decode(resp.body)})
        return resp

    return routes, handle, error_response
