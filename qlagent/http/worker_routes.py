"""The Worker routes of a control-plane replica (docs/worker-protocol.md; ADR-0108 Pull,
ADR-0109 ACKs, issue 10 §3/§6/§7/§9/§10) over the cluster services.

Six routes under ``/api/v3/cluster/workers/{workerId}``: ``GET`` itself (the Worker's name, state,
generation and enrolment; read only, for ``qlagent doctor``), ``POST sessions`` (201 SessionGrant),
``POST heartbeat``, ``POST pull?waitS=N``, ``POST acks`` and
``PUT attempts/{attemptId}/log?offset=N``. On the loop thread a route only checks what needs no
database: the credential kind (``Authorization: Worker qlw_…``; an API token is 401), the body
(JSON ≤ 16 KiB, a Session hello ≤ 64 KiB → else 413, unknown or mistyped fields → 400 naming
the field; a log chunk 1..262,144 bytes) and the path; the service call then runs on a bounded
thread pool and the answer comes back through :class:`qlagent.http.server.Deferred`, so the
selectors loop never waits on PostgreSQL. A Pull with ``waitS`` > 0 holds one of
``max_long_polls`` slots on its own pool, so long-polls never starve the other routes, and one
Worker holds at most ``MAX_LONG_POLLS_PER_WORKER`` of them, so no Worker starves the others;
beyond either bound the Pull is 503 ``long_polls_full`` + ``Retry-After`` (the Worker pulls from
its next replica, or waits that long).

Errors are ``{"error", "field", "message"}`` with the documented status; a credential the
database does not know for this ``workerId`` is 401, one issued to another Worker is 403
``worker_mismatch`` (the services authenticate before any write, so nothing is written).
Every answer carries ``X-Qlagent-Server-Now-Us``: the database clock (µs since the epoch),
the replica's ``core.dbclock.DatabaseClock`` (read from PostgreSQL by the replica's duty thread and
carried forward on the monotonic clock between reads). Control plane only: nothing here is
imported on a router.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import msgspec

from qlagent.cluster.acks import AckService
from qlagent.cluster.joins import JoinTokens
from qlagent.cluster.logs import LogUpload
from qlagent.cluster.pull import MAX_WAIT_S, WorkerPull
from qlagent.cluster.registry import WorkerRegistry, check_uuid
from qlagent.core.cluster import MAX_CHUNK_BYTES, Ack, ChunkConflict, HeartbeatRequest, Hello, PullRequest, WorkerAuthError
from qlagent.core.dbclock import DatabaseClock
from qlagent.core.errors import ConflictError, NotFoundError, QlError, UnavailableError, ValidationError
from qlagent.http.routing import Router
from qlagent.http.server import Deferred
from qlagent.http.wire import HttpError, Request, Response

log = logging.getLogger("qlagent.http")

PREFIX = "/api/v3/cluster/workers/{workerId}"
MAX_JSON_BYTES = 16_384
# A hello may name up to MAX_ADOPT Leases (≤ ~360 bytes each with a 256-character token) beside
# 32 labels: it gets a larger body than the other routes.
MAX_HELLO_BYTES = 65_536
SERVER_NOW = "X-Qlagent-Server-Now-Us"
_CREDENTIAL = re.compile(r"qlw_[A-Za-z0-9_-]{43}")
_MSGSPEC_FIELD = re.compile(r"field `([^`]{1,64})")
_MSGSPEC_PATH = re.compile(r" - at `\$\.?([^`]{0,128})`")
# A Worker process long-polls on one connection; a restarted one may overlap the Pull its
# previous process left parked. More than that is a misbehaving (or compromised) Worker.
MAX_LONG_POLLS_PER_WORKER = 2
# Readiness checks (each at most ~4 s on a dead database) queued on their one thread; a probe
# beyond them is answered 503 at once rather than left to grow the queue.
MAX_PROBES_QUEUED = 4
# Store codes answered under the protocol's name (docs/worker-protocol.md "Errors").
_CONFLICT_CODES = {"lease_expired": "lease_ended"}


@dataclass(frozen=True, slots=True)
class WorkerRouteLimits:
    """``threads``: pool for every route but long-polls (1..64); ``max_long_polls``: Pulls
    waiting at once (1..256, 503 beyond); ``answer_timeout_s``: longest a route's database work
    may take before the connection is answered 503 (a long-poll adds its ``waitS``)."""

    threads: int = 4
    max_long_polls: int = 32
    answer_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if not 1 <= self.threads <= 64:
            raise ValidationError("cluster.threads", f"{self.threads} outside 1..64", limit=64)
        if not 1 <= self.max_long_polls <= 256:
            raise ValidationError("cluster.max_long_polls", f"{self.max_long_polls} outside 1..256", limit=256)
        if not 1 <= self.answer_timeout_s <= 300:
            raise ValidationError("cluster.answer_timeout_s", f"{self.answer_timeout_s} outside 1..300", limit=300)


@dataclass(frozen=True, slots=True)
class WorkerServices:
    """The cluster services the routes call (wired over the PostgreSQL adapters)."""

    registry: WorkerRegistry
    pull: WorkerPull
    acks: AckService
    logs: LogUpload
    clock: DatabaseClock
    joins: JoinTokens


class JoinRequest(msgspec.Struct, forbid_unknown_fields=True):
    tokenId: str


class WorkerError(HttpError):
    """A protocol error answer: ``{"error": code, "field": name|null, "message": text}`` plus
    ``extra`` members (``nextOffset`` of a chunk conflict)."""

    def __init__(self, status: int, code: str, message: str, field: str | None = None,
                 headers: list[tuple[str, str]] | None = None, **extra) -> None:
        super().__init__(status, code, message, headers)
        self.field = field
        self.body_extra = extra
        self.now_us: Callable[[], int] | None = None

    def response(self) -> Response:
        body = {"error": self.code, "field": self.field, "message": self.message, **self.body_extra}
        headers = list(self.headers or [])
        if self.now_us is not None:
            headers.append((SERVER_NOW, str(self.now_us())))
        return Response.json(self.status, body, headers)


def _unavailable(message: str) -> WorkerError:
    return WorkerError(503, "cluster_unavailable", message, headers=[("Retry-After", "1")])


def _polls_full(message: str) -> WorkerError:
    return WorkerError(503, "long_polls_full", message, headers=[("Retry-After", "1")])


def _unauthenticated(message: str) -> WorkerError:
    return WorkerError(401, "worker_unauthenticated", message, headers=[("WWW-Authenticate", "Worker")])


def _field_of(err: msgspec.MsgspecError) -> str:
    """The wire name of the field a msgspec decode error is about (``body`` for the whole)."""
    text = str(err)
    path = _MSGSPEC_PATH.search(text)
    name = _MSGSPEC_FIELD.search(text)
    # msgspec spells a map value or array item ``[...]``: the field is the map/array itself.
    parts = [p for p in ((path.group(1).replace("[...]", "") if path else ""), (name.group(1) if name else "")) if p]
    return ".".join(parts) or "body"


def _decimal_header(req: Request, name: str) -> int:
    raw = req.headers.get(name.lower())
    if raw is None or not raw.isascii() or not raw.isdigit() or len(raw) > 19:
        raise WorkerError(400, "invalid_request", f"{name} must be a decimal integer", name)
    return int(raw)


class WorkerRoutes:
    """The six Worker routes over ``services``; :meth:`register` adds them to a Router,
    :meth:`handler` wraps a Router so that every answer (a 404 too) carries the server clock,
    :meth:`error_response` is the HttpServer's own error shape. :meth:`close` stops the pools.
    ``store_error(route, code)`` hears each request answered 503 because the database failed
    (route: ``describe``, ``join``, ``sessions``, ``heartbeat``, ``pull``, ``acks``,
    ``log_chunk``; code: the UnavailableError's), from the route threads."""

    def __init__(self, services: WorkerServices, limits: WorkerRouteLimits = WorkerRouteLimits(),
                 store_error: Callable[[str, str], None] = lambda route, code: None) -> None:
        self._s, self._limits = services, limits
        self._store_error = store_error
        self._pool = ThreadPoolExecutor(limits.threads, thread_name_prefix="qlagent-cp")
        self._polls = ThreadPoolExecutor(limits.max_long_polls, thread_name_prefix="qlagent-cp-poll")
        self._poll_slots = threading.BoundedSemaphore(limits.max_long_polls)
        self._polls_lock = threading.Lock()
        self._polls_by_worker: dict[str, int] = {}     # only Workers holding a slot: ≤ max_long_polls keys
        # Readiness reads the database: its own thread, so neither the loop (which answers
        # /healthz) nor route threads held by a frozen database delay it.
        self._probes = ThreadPoolExecutor(1, thread_name_prefix="qlagent-cp-probe")
        self._probe_slots = threading.BoundedSemaphore(MAX_PROBES_QUEUED)

    def register(self, router: Router) -> None:
        def bad(where: str, field: str, message: str) -> WorkerError:      # the protocol's 400 shape
            return WorkerError(400, "invalid_request", message, field)
        router.add("GET", PREFIX, self._describe, bad)
        router.add("POST", PREFIX + "/sessions", self._sessions, bad)
        router.add("POST", PREFIX + "/heartbeat", self._heartbeat, bad)
        router.add("POST", PREFIX + "/pull", self._pull, bad)
        router.add("POST", PREFIX + "/acks", self._acks, bad)
        router.add("PUT", PREFIX + "/attempts/{attemptId}/log", self._log, bad)
        router.add("POST", PREFIX + "/join", self._join, bad)

    def handler(self, router: Router) -> Callable[[Request], Response | Deferred]:
        """``router`` as an HttpServer handler whose immediate answers carry the server clock."""
        def handle(req: Request) -> Response | Deferred:
            try:
                resp = router(req)
            except WorkerError as e:
                e.now_us = self._s.clock.now_us
                raise
            if isinstance(resp, Response) and not any(n == SERVER_NOW for n, _ in resp.headers):
                resp.headers.append((SERVER_NOW, str(self._s.clock.now_us())))
            return resp
        return handle

    def error_response(self, status: int, code: str, message: str,
                       headers: list[tuple[str, str]] | None) -> Response:
        """The server's own refusals (413 before the body, 503 busy, 408) in the protocol shape."""
        e = WorkerError(status, code, message, headers=headers)
        e.now_us = self._s.clock.now_us
        return e.response()

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._polls.shutdown(wait=True, cancel_futures=True)
        self._probes.shutdown(wait=True, cancel_futures=True)

    # -- routes (loop thread: no database) ----------------------------------------------------
    def _describe(self, req: Request, params: dict[str, str]) -> Deferred:
        """``GET …/workers/{workerId}``: the Worker's name, state, generation and enrolment; read
        only (``qlagent doctor`` on the Worker asks it without disturbing the running Session)."""
        worker_id, credential = self._who(req, params)
        if req.query:
            raise WorkerError(400, "invalid_request", "unknown query parameter", sorted(req.query)[0][:64])
        return self._submit(lambda: Response.json(200, self._s.registry.describe(worker_id, credential)),
                            worker_id, credential, "describe")

    def _join(self, req: Request, params: dict[str, str]) -> Deferred:
        """``POST …/workers/{workerId}/join`` ``{"tokenId"}`` (issue 26, ``qlagent worker join``):
        redeem the join token once; 200 ``{"workerId", "name"}``; 409 ``join_token_used`` /
        ``join_token_expired``, 404 ``join_token_not_found``, 401 for a removed Worker."""
        worker_id, credential = self._who(req, params)
        body = self._json(req, JoinRequest)

        def work() -> Response:
            self._s.joins.redeem(worker_id, credential, body.tokenId)
            info = self._s.registry.describe(worker_id, credential)
            return Response.json(200, {"workerId": info.worker_id, "name": info.name})
        return self._submit(work, worker_id, credential, "join")

    def _sessions(self, req: Request, params: dict[str, str]) -> Deferred:
        worker_id, credential = self._who(req, params)
        hello = self._json(req, Hello, MAX_HELLO_BYTES)
        return self._submit(lambda: Response.json(201, self._s.registry.open_session(worker_id, credential, hello)),
                            worker_id, credential, "sessions")

    def _heartbeat(self, req: Request, params: dict[str, str]) -> Deferred:
        worker_id, credential = self._who(req, params)
        hb = self._json(req, HeartbeatRequest)
        return self._submit(lambda: Response.json(200, self._s.registry.heartbeat(
            worker_id, credential, hb.session_id, hb.generation, hb.leases, hb.renew_until_us)),
            worker_id, credential, "heartbeat")

    def _pull(self, req: Request, params: dict[str, str]) -> Deferred:
        worker_id, credential = self._who(req, params)
        unknown = set(req.query) - {"waitS"}
        if unknown:
            raise WorkerError(400, "invalid_request", "unknown query parameter", sorted(unknown)[0][:64])
        raw = req.query.get("waitS", "0")
        if not raw.isascii() or not raw.isdigit() or len(raw) > 2 or int(raw) > MAX_WAIT_S:
            raise WorkerError(400, "invalid_request", f"waitS must be an integer 0..{MAX_WAIT_S}", "waitS")
        wait_s = int(raw)
        body = self._json(req, PullRequest)
        work = lambda: Response.json(200, self._s.pull.pull(worker_id, credential, body, wait_s))  # noqa: E731
        if not wait_s:
            return self._submit(work, worker_id, credential, "pull")
        release = self._take_poll_slot(worker_id)
        try:
            return self._submit(work, worker_id, credential, "pull", pool=self._polls, wait_s=wait_s,
                                release=release)
        except BaseException:
            release()
            raise

    def polls_waiting(self) -> int:
        """Pulls long-polling on this replica now."""
        with self._polls_lock:
            return sum(self._polls_by_worker.values())

    def _take_poll_slot(self, worker_id: str) -> Callable[[], None]:
        """One long-poll slot for ``worker_id``; returns its release. Raises WorkerError 503
        ``long_polls_full`` when the Worker already holds ``MAX_LONG_POLLS_PER_WORKER`` or every
        slot is taken."""
        with self._polls_lock:
            held = self._polls_by_worker.get(worker_id, 0)
            if held >= MAX_LONG_POLLS_PER_WORKER:
                raise _polls_full(f"this Worker already waits in {held} Pulls on this replica (at most "
                                  f"{MAX_LONG_POLLS_PER_WORKER}); wait for their answers")
            if not self._poll_slots.acquire(blocking=False):
                raise _polls_full(f"all {self._limits.max_long_polls} long-poll slots of this replica are taken; "
                                  "pull from another replica or retry after 1 s")
            self._polls_by_worker[worker_id] = held + 1

        def release() -> None:
            with self._polls_lock:
                left = self._polls_by_worker.pop(worker_id) - 1
                if left:
                    self._polls_by_worker[worker_id] = left
            self._poll_slots.release()
        return release

    def _acks(self, req: Request, params: dict[str, str]) -> Deferred:
        worker_id, credential = self._who(req, params)
        ack = self._json(req, Ack)
        return self._submit(lambda: Response.json(200, self._s.acks.ack(worker_id, credential, ack)),
                            worker_id, credential, "acks")

    def _log(self, req: Request, params: dict[str, str]) -> Deferred:
        worker_id, credential = self._who(req, params)
        attempt_id = self._uuid("attemptId", params["attemptId"])
        if set(req.query) - {"offset"}:
            raise WorkerError(400, "invalid_request", "unknown query parameter",
                              sorted(set(req.query) - {"offset"})[0][:64])
        raw = req.query.get("offset")
        if raw is None or not raw.isascii() or not raw.isdigit() or len(raw) > 19:
            raise WorkerError(400, "invalid_request", "offset must be a decimal integer", "offset")
        self._content_type(req, "application/octet-stream")
        if len(req.body) > MAX_CHUNK_BYTES:
            raise WorkerError(413, "body_too_large", f"a log chunk is at most {MAX_CHUNK_BYTES} bytes")
        fence = {"session_id": req.headers.get("x-qlagent-session", ""),
                 "generation": _decimal_header(req, "X-Qlagent-Generation"),
                 "lease_generation": _decimal_header(req, "X-Qlagent-Lease-Generation"),
                 "lease_token": req.headers.get("x-qlagent-lease-token", "")}
        offset, data = int(raw), req.body
        return self._submit(lambda: Response.json(200, self._s.logs.append(
            worker_id, credential, attempt_id=attempt_id, offset=offset, data=data, **fence)),
            worker_id, credential, "log_chunk")

    # -- checks -----------------------------------------------------------------------------
    @staticmethod
    def _who(req: Request, params: dict[str, str]) -> tuple[str, str]:
        """(workerId, credential): 401 unless ``Authorization: Worker qlw_…`` (an API token is
        another kind), 400 for a workerId that is not a canonical UUID."""
        scheme, _, credential = req.headers.get("authorization", "").strip().partition(" ")
        if scheme.lower() != "worker":
            raise _unauthenticated("Worker routes take Authorization: Worker <credential>")
        credential = credential.strip()
        if not _CREDENTIAL.fullmatch(credential):
            raise _unauthenticated("not a Worker credential")
        return WorkerRoutes._uuid("workerId", params["workerId"]), credential

    @staticmethod
    def _uuid(field: str, value: str) -> str:
        try:
            return check_uuid(field, value)
        except ValidationError as e:
            raise WorkerError(400, "invalid_request", e.message, field) from None

    @staticmethod
    def _content_type(req: Request, expected: str) -> None:
        if req.headers.get("content-type", "").partition(";")[0].strip().lower() != expected:
            raise WorkerError(400, "invalid_request", f"Content-Type must be {expected}", "Content-Type")

    @staticmethod
    def _json(req: Request, type_, limit: int = MAX_JSON_BYTES):
        WorkerRoutes._content_type(req, "application/json")
        if len(req.body) > limit:
            raise WorkerError(413, "body_too_large",
                              f"request body is {len(req.body)} bytes; the limit is {limit} bytes")
        try:
            return msgspec.json.decode(req.body, type=type_)
        except msgspec.ValidationError as e:
            raise WorkerError(400, "invalid_request", str(e).partition(" - at ")[0][:200], _field_of(e)) from None
        except msgspec.DecodeError:
            raise WorkerError(400, "invalid_request", "body is not a JSON document", "body") from None

    # -- pool side --------------------------------------------------------------------------
    def _submit(self, work: Callable[[], Response], worker_id: str, credential: str, route: str, *,
                pool: ThreadPoolExecutor | None = None, wait_s: int = 0,
                release: Callable[[], None] | None = None) -> Deferred:
        d = Deferred(self._limits.answer_timeout_s + wait_s)

        def run() -> None:
            try:
                resp = work()
                resp.headers.append((SERVER_NOW, str(self._s.clock.now_us())))
                d.resolve(resp)
            except BaseException as e:  # noqa: BLE001 - every outcome must reach the client
                d.resolve(self._refusal(e, worker_id, credential, route))
            finally:
                if release is not None:
                    release()
        try:
            (pool or self._pool).submit(run)
        except RuntimeError:          # pools shut down: the replica is stopping
            raise _unavailable("the control plane is stopping") from None
        return d

    def defer(self, work: Callable[[], Response]) -> Deferred:
        """Run ``work`` (an API route with its own error answers) on the database threads; the
        answer comes within ``answer_timeout_s`` (else the server's 503). Raises HttpError 503
        ``unavailable`` once the pools are shut down."""
        return self._plain(self._pool, work, "unavailable")

    def probe(self, work: Callable[[], Response]) -> Deferred:
        """Run ``work`` (a probe that reads the database: ``GET /readyz``) on the probe thread,
        at most ``MAX_PROBES_QUEUED`` at once; the answer comes within ``answer_timeout_s``.
        Raises HttpError 503 ``not_ready`` beyond that many, or once the pools are shut down."""
        if not self._probe_slots.acquire(blocking=False):
            raise HttpError(503, "not_ready", f"{MAX_PROBES_QUEUED} readiness checks already waiting",
                            [("Retry-After", "1")])
        return self._plain(self._probes, work, "not_ready", self._probe_slots.release)

    def _plain(self, pool: ThreadPoolExecutor, work: Callable[[], Response], code: str,
               done: Callable[[], None] = lambda: None) -> Deferred:
        """``work`` on ``pool``, its answer or error as it is (no Worker refusal mapping);
        ``done`` once it ran or could not be queued."""
        d = Deferred(self._limits.answer_timeout_s)

        def run() -> None:
            try:
                d.resolve(work())
            except BaseException as e:  # noqa: BLE001 - every outcome must reach the client
                d.resolve(e)
            finally:
                done()
        try:
            pool.submit(run)
        except RuntimeError:          # pools shut down: the replica is stopping
            done()
            raise HttpError(503, code, "the control plane is stopping", [("Retry-After", "1")]) from None
        return d

    def _refusal(self, err: BaseException, worker_id: str, credential: str, route: str) -> HttpError:
        e = self._map(err, worker_id, credential, route)
        e.now_us = self._s.clock.now_us
        return e

    def _map(self, err: BaseException, worker_id: str, credential: str, route: str) -> WorkerError:
        if isinstance(err, WorkerError):
            return err
        if isinstance(err, WorkerAuthError):
            try:
                owner = self._s.registry.credential_owner(credential)
            except QlError as e:
                self._store_error(route, e.code)
                return _unavailable("cluster database unavailable; retry later")
            if owner is not None and owner != worker_id:
                return WorkerError(403, "worker_mismatch", "this credential belongs to another Worker")
            return _unauthenticated("unknown Worker credential for this workerId")
        if isinstance(err, ValidationError):
            return WorkerError(400, "invalid_request", err.message, err.field)
        if isinstance(err, NotFoundError):
            return WorkerError(404, err.code if err.code == "join_token_not_found" else "attempt_not_found",
                               err.message)
        if isinstance(err, ChunkConflict):
            return WorkerError(409, err.code, err.message, nextOffset=err.next_offset)
        if isinstance(err, ConflictError):
            return WorkerError(409, _CONFLICT_CODES.get(err.code, err.code), err.message)
        if isinstance(err, UnavailableError):
            self._store_error(route, err.code)
            return _unavailable(err.message)
        log.error("worker route failed: %s", err.__class__.__name__, exc_info=err)
        return WorkerError(500, "internal_error", "internal error")
