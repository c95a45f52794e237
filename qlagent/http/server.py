"""Bounded HTTP/1.1 server on ``selectors``, driven by the agent's single main loop.

Stdlib only (``selectors``, ``socket``, ``os.sendfile``) plus msgspec for JSON; see
bench/results/http.md for the RSS measurement that ruled out h11. Every resource is bounded by
:class:`HttpLimits` (ADR-0376 §4: edge keeps 4 requests in flight and 512-byte mutation bodies):

* a request is *in flight* from the moment its head is parsed until its response is fully
  written; the next request beyond ``max_in_flight`` is answered ``503`` with ``Retry-After: 1``
  at once (never queued);
* request line > ``max_request_line_bytes`` → 414; header block > ``max_header_bytes`` or more
  than ``max_header_count`` fields → 431; ``Content-Length`` > ``max_body_bytes`` → 413 before
  any body byte is read; ``Transfer-Encoding: chunked`` → 411, any other → 400;
* a request not fully received ``read_timeout_s`` after its first byte → 408 and close: this is
  also the longest an unauthenticated peer can hold an in-flight slot (auth is checked once the
  body is in);
* health probes (``probe_paths``, e.g. ``GET /healthz``, ``/readyz`` without a body) are
  answered without an in-flight slot, so peers holding every slot never make them 503;
* more than ``max_connections`` sockets: the connection whose loss costs least is closed to
  make room for the newcomer — first a lingering close or the oldest of those that never sent a
  byte (on TLS: not even a ClientHello), then the oldest that sent some but never completed a
  request (a handshake under way or done, a trickled head: nothing proves such a peer is
  anyone), then the longest-idle keep-alive, then a probe answer still being written;
  only when every connection has a request in flight is the new one answered 503 and closed.
  So a flood of connections that never finish their handshake costs each of them its slot
  within ``max_connections`` newer arrivals, and a probe or a Worker always gets in;
* a TLS handshake not done ``handshake_timeout_s`` after the accept → close (its own bound,
  shorter than a request's: a peer that has proven nothing holds nothing for long).

RFC 9110/9112 conformance: HTTP/1.1 without a valid single ``Host`` → 400; absolute-form
targets accepted (their authority replaces Host); ``100 Continue`` only to HTTP/1.1;
``Connection`` read as a token list; an unknown method or transfer coding → 501.

The handler is synchronous and runs on the loop thread; it may raise :class:`HttpError` for a
JSON error answer. Any other exception in it becomes a generic 500 JSON body (the traceback goes to the ``qlagent.http`` logger only, never to the client).
A handler that must wait (a database call, a long-poll) returns a :class:`Deferred` instead:
the connection is parked (not read, not expired before the Deferred's own bound) while another
thread computes the answer, and the loop resumes it when :meth:`Deferred.resolve` wakes it
through a socketpair; the loop itself never blocks.

TLS (control plane, issue 10 §10): ``listen_tcp(..., tls=...)`` with a ``qlagent.http.tls``
acceptor wraps each accepted socket and runs the handshake non-blocking in this loop, bounded
by ``handshake_timeout_s``; ``ssl`` is imported only there, never on a router.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import selectors
import socket
import stat
import threading
import time
import urllib.parse
from dataclasses import dataclass, field
from typing import Callable

import msgspec

from qlagent.core.profiles import EDGE, STANDALONE, Profile

log = logging.getLogger("qlagent.http")

_REASONS = {
    100: "Continue", 200: "OK", 201: "Created", 202: "Accepted", 204: "No Content",
    206: "Partial Content", 304: "Not Modified", 400: "Bad Request", 401: "Unauthorized",
    403: "Forbidden", 404: "Not Found", 405: "Method Not Allowed", 408: "Request Timeout",
    409: "Conflict", 411: "Length Required", 413: "Content Too Large", 414: "URI Too Long",
    416: "Range Not Satisfiable", 422: "Unprocessable Content", 431: "Request Header Fields Too Large",
    500: "Internal Server Error", 501: "Not Implemented", 503: "Service Unavailable",
    505: "HTTP Version Not Supported",
}
_TOKEN = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_ORIGIN_FORM = re.compile(rb"/[\x21-\x7e]*")
# RFC 9112 §3.2.2 absolute-form: "http://authority/path?query" (the authority replaces Host).
_ABSOLUTE_FORM = re.compile(rb"[hH][tT][tT][pP][sS]?://([^/?#\x00-\x20\x7f-\xff]+)(/[\x21-\x7e]*)?")
# RFC 9110 §7.2 Host = uri-host [":" port]: reg-name (unreserved / pct-encoded / sub-delims),
# IPv4 or an [IPv6] literal. Empty is allowed only for a URI without authority (never ours).
_HOST = re.compile(r"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9\-._~%!$&'()*+,;=]+)(:[0-9]{0,5})?")
# RFC 9110 §9.1: a method the server does not recognise gets 501, a known one a route may lack 405.
_KNOWN_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "DELETE", "CONNECT", "OPTIONS", "TRACE", "PATCH"})
_CTL = re.compile(rb"[\x00-\x08\x0a-\x1f\x7f]")
# IMF-fixdate names spelled out: email.utils costs ~0.4 MiB RSS and strftime follows the locale.
_DAYS = ("Mon", "Tue", "Wed", "Thu", "Fri", "Sat", "Sun")
_MONTHS = ("Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec")
_RECV_BYTES = 16384
_FRAMING_HEADERS = frozenset({"content-length", "connection", "transfer-encoding", "date"})
_LINGER_S = 1.0
_LINGER_BYTES = 65536
_ACCEPTS_PER_EVENT = 16
_ACCEPT_PAUSE_S = 0.5


@dataclass(frozen=True, slots=True)
class HttpLimits:
    """Bounds of one :class:`HttpServer`. Sizes in bytes, durations in seconds.

    ``max_in_flight``: requests between head parsed and response written (503 beyond).
    ``max_body_bytes``: request body bound (413 beyond). ``max_request_line_bytes`` (414),
    ``max_header_bytes`` / ``max_header_count`` (431), ``max_query_params`` (400).
    ``read_timeout_s``: whole request from its first byte (408); also how long a new connection
    (after its TLS handshake) may stay silent. ``handshake_timeout_s``: a TLS handshake from the
    accept (close). ``idle_timeout_s``: keep-alive
    idle before a silent close. ``write_timeout_s``: without send progress before abort.
    ``max_requests_per_connection``: keep-alive bound. ``max_connections``: open sockets.
    ``send_chunk_bytes``: largest single write of a file range.
    """

    max_in_flight: int
    max_body_bytes: int
    max_connections: int
    max_request_line_bytes: int = 8192
    max_header_bytes: int = 8192
    max_header_count: int = 32
    max_query_params: int = 16
    read_timeout_s: float = 5.0
    handshake_timeout_s: float = 3.0
    idle_timeout_s: float = 5.0
    write_timeout_s: float = 10.0
    max_requests_per_connection: int = 100
    send_chunk_bytes: int = 65536

    def __post_init__(self) -> None:
        for name in ("max_in_flight", "max_body_bytes", "max_connections", "max_request_line_bytes",
                     "max_header_bytes", "max_header_count", "max_query_params",
                     "max_requests_per_connection", "send_chunk_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"HttpLimits.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("read_timeout_s", "handshake_timeout_s", "idle_timeout_s", "write_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"HttpLimits.{name} must be > 0 seconds, got {getattr(self, name)}")

    @classmethod
    def for_profile(cls, profile: Profile) -> HttpLimits:
        """Limits of a core Profile: its ``http_in_flight`` and ``http_body_bytes`` (ADR-0376 §4),
        with connections and header bounds scaled to it (edge: 16 connections, 8 KiB / 32
        headers; other profiles: 64 connections, 16 KiB / 64 headers)."""
        if profile.name == "edge":
            return cls(max_in_flight=profile.http_in_flight, max_body_bytes=profile.http_body_bytes,
                       max_connections=16, max_requests_per_connection=32)
        return cls(max_in_flight=profile.http_in_flight, max_body_bytes=profile.http_body_bytes,
                   max_connections=64, max_header_bytes=16384, max_header_count=64,
                   max_query_params=32)

    @classmethod
    def edge(cls) -> HttpLimits:
        """Edge profile (ADR-0376 §4): 4 in flight, 512-byte bodies, 16 connections."""
        return cls.for_profile(EDGE)

    @classmethod
    def standalone(cls) -> HttpLimits:
        """Standalone profile: in flight and body bound from core.profiles, 64 connections."""
        return cls.for_profile(STANDALONE)


@dataclass(slots=True)
class Request:
    """One parsed request. ``path``: raw (still percent-encoded) path without the query;
    ``query``: decoded parameters (duplicates refused); ``headers``: lower-cased names, repeated
    fields joined with ``", "``; ``body``: exactly Content-Length bytes; ``peer``: ``host:port``
    or ``unix``."""

    method: str
    target: str
    path: str
    query: dict[str, str]
    headers: dict[str, str]
    body: bytes
    peer: str
    version: str = "HTTP/1.1"


@dataclass(slots=True)
class FileRange:
    """``length`` bytes of the open file ``fd`` from ``offset``, sent with ``os.sendfile`` in
    chunks of at most ``HttpLimits.send_chunk_bytes`` (``pread`` + ``send`` of such chunks when
    the file cannot be spliced). The server owns ``fd`` once the response
    is returned and closes it when the response ends (sent or aborted)."""

    fd: int
    offset: int
    length: int

    def __post_init__(self) -> None:
        if self.offset < 0 or self.length < 0:
            raise ValueError("FileRange offset and length must be >= 0")


@dataclass(slots=True)
class Response:
    """``status`` with ``headers`` (name, value) and either ``body`` bytes or a ``file`` range.
    The server adds Content-Length, Date and Connection; a handler that sets one of those (or
    Transfer-Encoding, or a header with CR/LF) gets a logged 500 instead."""

    status: int
    headers: list[tuple[str, str]] = field(default_factory=list)
    body: bytes = b""
    file: FileRange | None = None

    @classmethod
    def json(cls, status: int, payload: object, headers: list[tuple[str, str]] | None = None) -> Response:
        """JSON response; ``payload`` is anything msgspec encodes (Struct, dict, list, ...)."""
        hdrs = [("Content-Type", "application/json")]
        if headers:
            hdrs.extend(headers)
        return cls(status, hdrs, msgspec.json.encode(payload))


def json_error(status: int, code: str, message: str, headers: list[tuple[str, str]] | None = None,
               **extra: str) -> Response:
    """Error response with body ``{"code", "message", **extra}`` (the shape of every error)."""
    body: dict[str, str] = {"code": code, "message": message}
    body.update(extra)
    return Response.json(status, body, headers)


class Deferred:
    """A response another thread supplies later. ``timeout_s``: the longest the connection
    waits for it (then 503 and the late answer is dropped). :meth:`resolve` may be called from
    any thread, once (later calls are ignored) with a :class:`Response`, an :class:`HttpError`
    or any other exception (answered as a generic 500)."""

    __slots__ = ("timeout_s", "_lock", "_result", "_notify")

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._result: object = None
        self._notify: Callable[[Deferred], None] | None = None

    def resolve(self, result: object) -> None:
        with self._lock:
            if self._result is not None:
                return
            self._result = result
            notify = self._notify
        if notify is not None:
            notify(self)

    def _watch(self, notify: Callable[[Deferred], None]) -> None:
        with self._lock:
            self._notify = notify
            done = self._result is not None
        if done:
            notify(self)


class HttpError(Exception):
    """Raise from a handler (or a helper it calls) to answer a JSON error: ``status``, stable
    ``code``, ``message`` naming the field and the limit, extra body members (e.g.
    ``field="limit"``) and extra ``headers``. The server turns it into :func:`json_error`."""

    def __init__(self, status: int, code: str, message: str,
                 headers: list[tuple[str, str]] | None = None, **extra: str) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.headers = headers
        self.extra = extra

    def response(self) -> Response:
        """The JSON error response for this error."""
        return json_error(self.status, self.code, self.message, self.headers, **self.extra)


def _decimal(text: str) -> bool:
    # str.isdigit() alone accepts "²" and other Unicode digits that int() then refuses.
    return text.isascii() and text.isdigit()


def _tokens(value: str) -> set[str]:
    """A comma-separated token list (``Connection``, ``Transfer-Encoding``), lower-cased."""
    return {t.strip(" \t").lower() for t in value.split(",") if t.strip(" \t")}


def query_int(request: Request, name: str, default: int, minimum: int, maximum: int) -> int:
    """Integer query parameter ``name`` in ``minimum..maximum`` (``default`` when absent).
    Raises HttpError 400 ``bad_query`` naming the parameter and its range."""
    raw = request.query.get(name)
    if raw is None:
        return default
    if not _decimal(raw) or len(raw) > 19 or not minimum <= int(raw) <= maximum:
        raise HttpError(400, "bad_query", f"{name} must be an integer in {minimum}..{maximum}",
                        field=name)
    return int(raw)


def byte_range(request: Request, size: int, max_length: int) -> tuple[int, int, bool]:
    """The slice of a ``size``-byte file a read asks for, bounded by ``max_length`` bytes.

    ``Range: bytes=a-b`` / ``bytes=a-`` / ``bytes=-n`` (one range) wins over the ``offset`` /
    ``limit`` query parameters (defaults 0 and ``max_length``); a Range of another unit, a
    valid list of several ranges, or any Range with ``If-Range`` (no validators are ever sent, so it cannot match), is ignored.
    Returns ``(offset, length, partial)``; ``partial`` means answer 206 with
    :func:`content_range`. Raises HttpError 400 ``bad_query``/``bad_range`` for malformed input and 416 ``range_not_satisfiable`` (with
    ``Content-Range: bytes */size``) for a Range starting at or beyond ``size``. An offset at or
    beyond the end via the query gives length 0 (a tail reader polls that way).
    """
    header = request.headers.get("range")
    unit, _, spec = (header or "").partition("=")
    specs = [one.strip().partition("-") for one in spec.split(",")]
    for first, dash, last in specs:
        if not dash or not (first or last) or not (_decimal(first) or not first) \
                or not (_decimal(last) or not last):
            bad = True
            break
    else:
        bad = False
    # RFC 9110 §14.2: a Range with a unit we do not know is ignored, and so is a valid list of
    # several ranges (no multipart/byteranges here); §13.1.5: so is a Range under an If-Range,
    # which can never match since no validator (ETag, Last-Modified) is sent.
    if header is None or unit.strip().lower() != "bytes" or "if-range" in request.headers \
            or (len(specs) > 1 and not bad):
        offset = query_int(request, "offset", 0, 0, 2**62)
        limit = query_int(request, "limit", max_length, 1, max_length)
        start = min(offset, size)
        return start, min(limit, size - start), False
    if bad:
        raise HttpError(400, "bad_range", "Range must be bytes=a-b, bytes=a- or bytes=-n",
                        field="Range")
    first, _, last = specs[0]
    if first:
        start = int(first)
        end = min(int(last), size - 1) if last else size - 1
        if last and int(last) < start:
            raise HttpError(400, "bad_range", "Range end is before its start", field="Range")
    else:
        start, end = max(0, size - int(last)), size - 1
    if start >= size:
        raise HttpError(416, "range_not_satisfiable", f"Range starts beyond the {size} bytes",
                        [("Content-Range", f"bytes */{size}")])
    return start, min(end - start + 1, max_length), True


def content_range(offset: int, length: int, size: int) -> str:
    """``Content-Range`` value of a 206 answer: ``bytes a-b/size``."""
    return f"bytes {offset}-{offset + length - 1}/{size}"


def _has_bytes(sock: socket.socket) -> bool:
    """Has the (non-blocking) peer sent anything yet? Peeked: nothing is consumed."""
    try:
        return bool(sock.recv(1, socket.MSG_PEEK))
    except (BlockingIOError, InterruptedError):
        return False


# Connection states.
_HEAD, _BODY, _WRITE, _LINGER = "head", "body", "write", "linger"
_HANDSHAKE, _DEFER = "handshake", "defer"


class _Listener:
    __slots__ = ("sock", "unix", "tls")

    def __init__(self, sock: socket.socket, unix: bool, tls=None) -> None:
        self.sock = sock
        self.unix = unix
        self.tls = tls


class _Waker:
    """The socketpair through which another thread's :meth:`Deferred.resolve` wakes the loop."""

    __slots__ = ("r", "w", "done")

    def __init__(self) -> None:
        self.r, self.w = socket.socketpair()
        self.r.setblocking(False)
        self.w.setblocking(False)
        self.done: list[tuple[_Conn, Deferred]] = []


class _Conn:
    __slots__ = ("sock", "peer", "buf", "state", "deadline", "in_flight", "served", "request",
                 "body_needed", "out", "file", "copy_file", "close_after", "registered_mask",
                 "started", "tls", "deferred", "since")

    def __init__(self, sock: socket.socket, peer: str, now: float, first_byte_timeout: float) -> None:
        self.sock = sock
        self.peer = peer
        self.buf = bytearray()
        self.state = _HEAD
        self.deadline = now + first_byte_timeout
        self.since = now          # start of what it waits for now (accept, idle, write): eviction age
        self.started = False  # first byte of the current request seen
        self.in_flight = False
        self.served = 0
        self.request: Request | None = None
        self.body_needed = 0
        self.out = memoryview(b"")
        self.file: FileRange | None = None
        self.copy_file = False  # sendfile refused this file: pread + send instead
        self.close_after = False
        self.registered_mask = 0
        self.tls = False          # sendfile would bypass TLS: file ranges are copied instead
        self.deferred: Deferred | None = None


class HttpServer:
    """Bounded HTTP/1.1 server: ``HttpServer(limits, handler, probe_paths)``; ``handler(Request)
    -> Response``. ``probe_paths``: paths whose bodiless GET/HEAD never needs an in-flight slot.
    ``on_answer(request, response)``: called with every handler answer before it is sent.

    Drive it from one selectors loop: ``listen_tcp`` / ``listen_unix``, then
    ``register(selector)``; for each ready key with :meth:`owns` true call
    :meth:`handle_event`; call :meth:`timeouts` each turn (it returns the next deadline in
    ``time.monotonic()`` seconds, or None). :meth:`serve_forever` does all of that for tests.
    Not thread-safe except :meth:`stop`.
    """

    def __init__(self, limits: HttpLimits, handler: Callable[[Request], Response | Deferred],
                 probe_paths: frozenset[str] = frozenset(),
                 error_response: Callable[[int, str, str, list[tuple[str, str]] | None], Response] | None = None,
                 on_answer: Callable[[Request, Response], None] | None = None) -> None:
        self.limits = limits
        self.handler = handler
        self.probe_paths = probe_paths
        # Sees every handler answer (immediate or deferred) on the loop thread before it is
        # sent, e.g. to audit refusals; it must not raise.
        self._on_answer = on_answer
        # The server's own error answers (413, 503, 408 …): ``error_response(status, code,
        # message, headers)``; default :func:`json_error` (a protocol may fix another shape).
        self._error = error_response or (lambda status, code, message, headers: json_error(
            status, code, message, headers))
        self._waker: _Waker | None = None
        self._listeners: list[_Listener] = []
        self._paused: list[tuple[float, _Listener]] = []
        self._conns: set[_Conn] = set()
        self._in_flight = 0
        self._selector: selectors.BaseSelector | None = None
        self._wake_r: socket.socket | None = None
        self._wake_w: socket.socket | None = None
        self._stopping = False
        self._date_cache = (0, "")
        self.ready = threading.Event()

    # -- listeners -----------------------------------------------------------------------
    def listen_tcp(self, host: str, port: int, backlog: int = 16, tls=None) -> tuple[str, int]:
        """Listen on ``host:port`` (port 0 picks one); returns the bound (host, port).
        ``tls``: a ``qlagent.http.tls.TlsAcceptor`` to serve HTTPS only on this listener.
        Raises OSError (e.g. EADDRINUSE) unchanged."""
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
            sock.listen(backlog)
            sock.setblocking(False)
        except BaseException:
            sock.close()
            raise
        self._add_listener(_Listener(sock, unix=False, tls=tls))
        addr = sock.getsockname()
        return addr[0], addr[1]

    def listen_unix(self, path: str, backlog: int = 16) -> str:
        """Listen on a unix socket at ``path`` with mode 0660. A stale socket file is replaced;
        any other existing file raises FileExistsError naming the path."""
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            pass
        else:
            if not stat.S_ISSOCK(st.st_mode):
                raise FileExistsError(errno.EEXIST, "exists and is not a socket", path)
            os.unlink(path)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(path)
            # Nobody can connect before listen(), so chmod here leaves no window.
            os.chmod(path, 0o660)
            sock.listen(backlog)
            sock.setblocking(False)
        except BaseException:
            sock.close()
            raise
        self._add_listener(_Listener(sock, unix=True))
        return path

    def _add_listener(self, lst: _Listener) -> None:
        self._listeners.append(lst)
        if self._selector is not None:
            self._selector.register(lst.sock, selectors.EVENT_READ, (self, lst))

    # -- loop integration --------------------------------------------------------------------
    def register(self, selector: selectors.BaseSelector) -> None:
        """Register the listeners (and later every connection) with ``selector``."""
        self._selector = selector
        for lst in self._listeners:
            selector.register(lst.sock, selectors.EVENT_READ, (self, lst))
        if self._waker is not None:
            selector.register(self._waker.r, selectors.EVENT_READ, (self, self._waker))

    def owns(self, key: selectors.SelectorKey) -> bool:
        """True when ``key`` was registered by this server."""
        return isinstance(key.data, tuple) and len(key.data) == 2 and key.data[0] is self

    def handle_event(self, key: selectors.SelectorKey, mask: int) -> None:
        """Handle one ready key of this server; never raises for client misbehaviour."""
        target = key.data[1]
        if isinstance(target, _Listener):
            self._accept(target)
            return
        if isinstance(target, _Waker):
            self._resume()
            return
        conn: _Conn = target
        if conn not in self._conns:
            return
        try:
            if conn.state == _HANDSHAKE:
                conn.started = True      # the peer has sent something (or closed)
                self._handshake(conn)
            elif mask & selectors.EVENT_READ and conn.state in (_HEAD, _BODY, _LINGER):
                self._on_readable(conn)
            elif mask & selectors.EVENT_WRITE and conn.state == _WRITE:
                self._flush(conn)
                self._advance(conn)  # pipelined requests that waited for this response
        except OSError:
            self._close(conn)
        except Exception:  # a server bug must cost one connection, never the agent's loop
            log.exception("http connection %s failed", conn.peer)
            self._close(conn)

    def timeouts(self, now: float) -> float | None:
        """Expire connections whose deadline (monotonic seconds) passed: a partial request gets
        408 and close, an idle keep-alive closes silently, a stalled write aborts. Returns the
        earliest remaining deadline, or None when nothing is pending. A listener paused after
        a failed accept (EMFILE) is re-armed here."""
        earliest: float | None = None
        for until, lst in list(self._paused):
            if until <= now:
                self._paused.remove((until, lst))
                if self._selector is not None and lst in self._listeners:
                    self._selector.register(lst.sock, selectors.EVENT_READ, (self, lst))
            elif earliest is None or until < earliest:
                earliest = until
        for conn in list(self._conns):
            if conn.deadline <= now:
                self._expire(conn, now)
            if conn in self._conns and (earliest is None or conn.deadline < earliest):
                earliest = conn.deadline
        return earliest

    @property
    def in_flight(self) -> int:
        """Requests currently in flight (head parsed, response not yet written)."""
        return self._in_flight

    @property
    def connections(self) -> int:
        """Open client connections."""
        return len(self._conns)

    def serve_forever(self, poll_s: float = 0.5) -> None:
        """Run a private selectors loop until :meth:`stop`; closes everything on return."""
        sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        sel.register(self._wake_r, selectors.EVENT_READ, None)
        self.register(sel)
        self.ready.set()
        try:
            while not self._stopping:
                deadline = self.timeouts(time.monotonic())
                timeout = poll_s if deadline is None else max(0.0, min(poll_s, deadline - time.monotonic()))
                for key, mask in sel.select(timeout):
                    if key.data is None:
                        self._wake_r.recv(64)
                    elif self.owns(key):
                        self.handle_event(key, mask)
        finally:
            self.close()
            sel.close()
            self._wake_r.close()
            self._wake_w.close()

    def begin_drain(self) -> None:
        """Start a graceful stop (SIGTERM): close the listeners, close idle keep-alive
        connections, and answer every request still in progress with ``Connection: close``.
        Keep driving the loop until :attr:`connections` is 0 or the drain deadline passes,
        then call :meth:`close`."""
        self._stopping = True
        self._close_listeners()
        for conn in list(self._conns):
            if conn.state == _HEAD and not conn.started:
                self._close(conn)

    def stop(self) -> None:
        """Ask :meth:`serve_forever` to return (callable from any thread)."""
        self._stopping = True
        if self._wake_w is not None:
            try:
                self._wake_w.send(b"x")
            except OSError:
                pass

    def close(self) -> None:
        """Close every connection and listener (a unix socket file is removed)."""
        for conn in list(self._conns):
            self._close(conn)
        self._close_listeners()
        if self._waker is not None:
            self._unregister(self._waker.r)
            self._waker.r.close()
            self._waker.w.close()
            self._waker = None

    def _close_listeners(self) -> None:
        for lst in self._listeners:
            path = lst.sock.getsockname() if lst.unix else None
            self._unregister(lst.sock)
            lst.sock.close()
            if path:
                try:
                    os.unlink(path)
                except OSError:
                    pass
        self._listeners.clear()
        self._paused.clear()

    # -- accept ------------------------------------------------------------------------------
    def _accept(self, lst: _Listener) -> None:
        for _ in range(_ACCEPTS_PER_EVENT):
            try:
                sock, addr = lst.sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                # EMFILE and friends: a level-triggered listener would spin, so pause it briefly
                # and keep serving the open connections.
                log.warning("accept failed, pausing the listener for %g s: %s", _ACCEPT_PAUSE_S, exc)
                self._unregister(lst.sock)
                self._paused.append((time.monotonic() + _ACCEPT_PAUSE_S, lst))
                return
            try:
                sock.setblocking(False)
                if len(self._conns) >= self.limits.max_connections and not self._evict():
                    if lst.tls is not None:   # a plaintext 503 means nothing to a TLS client
                        sock.close()
                    else:
                        self._refuse(sock)
                    continue
                if not lst.unix:
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                heard = False
                if lst.tls is not None:
                    heard = _has_bytes(sock)        # its ClientHello already came with the connect
                    sock = lst.tls.wrap(sock)
            except OSError:  # the peer reset before we looked at it
                sock.close()
                continue
            peer = "unix" if lst.unix else f"{addr[0]}:{addr[1]}"
            conn = _Conn(sock, peer, time.monotonic(), self.limits.read_timeout_s)
            self._conns.add(conn)
            if lst.tls is not None:
                conn.tls = True
                conn.started = heard
                conn.deadline = conn.since + self.limits.handshake_timeout_s
                conn.state = _HANDSHAKE
                self._handshake(conn)
            else:
                self._watch(conn, selectors.EVENT_READ)

    def _evict(self) -> bool:
        """Close the connection whose loss costs least (module docstring); False when every
        connection has a request in flight."""
        victim, best = None, None
        for conn in self._conns:
            if conn.in_flight:
                continue
            # Never completed a request, so proven nothing: the silent ones first (not a byte,
            # on TLS not even a ClientHello), then those that sent bytes or finished their TLS
            # handshake (a client about to send its request).
            if conn.state == _LINGER:
                rank = 0        # answered already
            elif conn.state == _HANDSHAKE:
                rank = 1 if conn.started else 0
            elif conn.state == _HEAD and not conn.served:
                rank = 1 if conn.started or conn.tls else 0
            elif conn.state == _HEAD:
                rank = 2        # served before: its client reconnects if it needs to
            elif conn.state == _WRITE:
                rank = 3        # a probe's answer (it holds no slot) being written
            else:
                continue
            if best is None or (rank, conn.since) < best:
                victim, best = conn, (rank, conn.since)
        if victim is None:
            return False
        self._close(victim)
        return True

    def _handshake(self, conn: _Conn) -> None:
        try:
            want = conn.sock.handshake()
        except OSError:      # ssl.SSLError included: wrong CA, plaintext, protocol too old
            self._close(conn)
            return
        if want is not None:
            self._watch(conn, selectors.EVENT_WRITE if want == "write" else selectors.EVENT_READ)
            return
        conn.state = _HEAD
        conn.started = False     # from here: the first byte of its request
        conn.deadline = time.monotonic() + self.limits.read_timeout_s
        self._watch(conn, selectors.EVENT_READ)
        # Request bytes that arrived with the handshake may already sit decrypted in the TLS
        # object, where the selector cannot see them.
        self._on_readable(conn)

    def _refuse(self, sock: socket.socket) -> None:
        resp = self._error(503, "too_many_connections",
                           f"at most {self.limits.max_connections} connections; retry after 1 s",
                           [("Retry-After", "1")])
        try:
            sock.send(self._head_bytes(resp, len(resp.body), close=True) + resp.body)
            sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        sock.close()

    # -- reading -------------------------------------------------------------------------------
    def _on_readable(self, conn: _Conn) -> None:
        try:
            data = conn.sock.recv(_RECV_BYTES)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._close(conn)
            return
        if conn.state == _LINGER:
            conn.body_needed -= len(data)
            if not data or conn.body_needed <= 0:
                self._close(conn)
            return
        if not data:
            self._close(conn)
            return
        if not conn.started:
            conn.started = True
            conn.deadline = time.monotonic() + self.limits.read_timeout_s
        conn.buf += data
        self._advance(conn)

    def _advance(self, conn: _Conn) -> None:
        """Answer every complete request buffered, in order, until one is incomplete or its
        response blocks. A loop, not recursion: pipelining must not deepen the stack."""
        while conn in self._conns and conn.state in (_HEAD, _BODY) and conn.buf:
            if not conn.started:
                conn.started = True
                conn.deadline = time.monotonic() + self.limits.read_timeout_s
            try:
                if conn.state == _HEAD and not self._parse_head(conn):
                    return
                if len(conn.buf) < conn.body_needed:
                    return
                req = conn.request
                assert req is not None
                req.body = bytes(conn.buf[: conn.body_needed])
                del conn.buf[: conn.body_needed]
                self._dispatch(conn, req)
            except HttpError as exc:
                self._fail(conn, exc.status, exc.code, exc.message)

    def _parse_head(self, conn: _Conn) -> bool:
        lim = self.limits
        buf = conn.buf
        # RFC 9112 §2.2: ignore empty lines before a request line.
        while buf[:2] == b"\r\n":
            del buf[:2]
        if not buf:
            conn.started = False
            return False
        line_end = buf.find(b"\r\n", 0, lim.max_request_line_bytes + 2)
        if line_end < 0:
            if len(buf) > lim.max_request_line_bytes:
                raise HttpError(414, "request_line_too_long",
                                 f"request line exceeds {lim.max_request_line_bytes} bytes")
            return False
        head_end = buf.find(b"\r\n\r\n", line_end)
        if head_end < 0:
            if len(buf) - line_end - 2 > lim.max_header_bytes:
                raise HttpError(431, "headers_too_large",
                                 f"header block exceeds {lim.max_header_bytes} bytes")
            return False
        if head_end - line_end > lim.max_header_bytes:
            raise HttpError(431, "headers_too_large",
                             f"header block exceeds {lim.max_header_bytes} bytes")
        line = bytes(buf[:line_end])
        block = bytes(buf[line_end + 2: head_end + 2])
        del buf[: head_end + 4]
        req, authority = self._parse_request_line(line, conn.peer)
        req.headers = self._parse_headers(block)
        self._check_host(req, authority)
        self._check_framing(conn, req)
        return True

    def _parse_request_line(self, line: bytes, peer: str) -> tuple[Request, str | None]:
        """The request (headers still empty) and an absolute-form target's authority or None."""
        parts = line.split(b" ")
        if len(parts) != 3 or not _TOKEN.fullmatch(parts[0]):
            raise HttpError(400, "bad_request", "malformed request line")
        method, target, version = parts
        if version not in (b"HTTP/1.1", b"HTTP/1.0"):
            if version.startswith(b"HTTP/") and len(version) == 8:
                raise HttpError(505, "http_version_not_supported", "only HTTP/1.0 and HTTP/1.1")
            raise HttpError(400, "bad_request", "malformed request line")
        authority = None
        absolute = _ABSOLUTE_FORM.fullmatch(target)
        if absolute:
            authority = absolute.group(1).decode("ascii")
            target = absolute.group(2) or b"/"
        if not _ORIGIN_FORM.fullmatch(target):
            raise HttpError(400, "bad_request", "request target must be an origin-form ASCII path")
        if method.decode("ascii") not in _KNOWN_METHODS:
            raise HttpError(501, "not_implemented", f"method {method.decode('ascii')[:32]} is not implemented")
        target_s = target.decode("ascii")
        path, _, query = target_s.partition("?")
        if "#" in target_s:
            raise HttpError(400, "bad_request", "request target must not carry a fragment")
        return Request(method.decode("ascii"), target_s, path, self._parse_query(query), {}, b"",
                       peer, version.decode("ascii")), authority

    def _parse_query(self, query: str) -> dict[str, str]:
        if not query:
            return {}
        try:
            pairs = urllib.parse.parse_qsl(query, keep_blank_values=True, strict_parsing=True,
                                           errors="strict", max_num_fields=self.limits.max_query_params)
        except (ValueError, UnicodeDecodeError):
            raise HttpError(400, "bad_query",
                             f"query must be key=value pairs of UTF-8, at most "
                             f"{self.limits.max_query_params} parameters") from None
        out: dict[str, str] = {}
        for key, value in pairs:
            if key in out:
                raise HttpError(400, "bad_query", f"query parameter {key!r} appears more than once")
            out[key] = value
        return out

    def _parse_headers(self, block: bytes) -> dict[str, str]:
        lines = block.split(b"\r\n")[:-1] if block else []
        if len(lines) > self.limits.max_header_count:
            raise HttpError(431, "too_many_headers",
                             f"more than {self.limits.max_header_count} header fields")
        headers: dict[str, str] = {}
        for raw in lines:
            name, sep, value = raw.partition(b":")
            if not sep or not _TOKEN.fullmatch(name):
                raise HttpError(400, "bad_request", "malformed header field")
            if _CTL.search(value):
                raise HttpError(400, "bad_request", "control character in a header value")
            text = value.strip(b" \t").decode("latin-1")
            key = name.decode("ascii").lower()
            if key in headers:
                if key == "content-length" and headers[key] != text:
                    raise HttpError(400, "bad_request", "conflicting Content-Length fields")
                if key in ("content-length", "host", "authorization"):
                    if key != "content-length":
                        raise HttpError(400, "bad_request", f"{key} appears more than once")
                    continue
                headers[key] = headers[key] + ", " + text
            else:
                headers[key] = text
        return headers

    @staticmethod
    def _check_host(req: Request, authority: str | None) -> None:
        """RFC 9112 §3.2: HTTP/1.1 needs exactly one valid Host (400 otherwise); an
        absolute-form target's authority replaces it (§3.2.2)."""
        if authority is not None:
            if not _HOST.fullmatch(authority):
                raise HttpError(400, "bad_request", "invalid authority in the request target")
            req.headers["host"] = authority
            return
        host = req.headers.get("host")
        if host is None:
            if req.version == "HTTP/1.1":
                raise HttpError(400, "bad_request", "HTTP/1.1 request without Host (RFC 9112 §3.2)")
            return
        if not _HOST.fullmatch(host):
            raise HttpError(400, "bad_request", "invalid Host header (RFC 9112 §3.2)")

    def _check_framing(self, conn: _Conn, req: Request) -> None:
        lim = self.limits
        te = req.headers.get("transfer-encoding")
        cl = req.headers.get("content-length")
        if te is not None:
            if cl is not None:
                raise HttpError(400, "bad_request", "both Transfer-Encoding and Content-Length")
            if "chunked" in _tokens(te):
                raise HttpError(411, "length_required",
                                 "chunked request bodies are not accepted; send Content-Length")
            # RFC 9112 §6.1: a transfer coding the server does not understand is 501.
            raise HttpError(501, "not_implemented", "unsupported Transfer-Encoding; send Content-Length")
        length = 0
        if cl is not None:
            if not _decimal(cl) or len(cl) > 19:
                raise HttpError(400, "bad_request", "Content-Length must be a decimal integer")
            length = int(cl)
        if length > lim.max_body_bytes:
            raise HttpError(413, "body_too_large",
                             f"request body is {length} bytes; the limit is {lim.max_body_bytes} bytes")
        probe = length == 0 and req.method in ("GET", "HEAD") and req.path in self.probe_paths
        if not probe:     # a probe is answered at once from this head: it needs no slot
            if self._in_flight >= lim.max_in_flight:
                raise HttpError(503, "server_busy",
                                 f"at most {lim.max_in_flight} requests in flight; retry after 1 s")
            self._in_flight += 1
            conn.in_flight = True
        conn.request = req
        conn.body_needed = length
        conn.state = _BODY
        # RFC 9110 §10.1.1: never send a 1xx to an HTTP/1.0 client.
        if length and req.version == "HTTP/1.1" and req.headers.get("expect", "").lower() == "100-continue" \
                and len(conn.buf) < length:
            try:  # interim line is tiny; the socket buffer is empty at this point
                conn.sock.send(b"HTTP/1.1 100 Continue\r\n\r\n")
            except OSError:
                pass

    # -- dispatch and writing ------------------------------------------------------------------
    def _dispatch(self, conn: _Conn, req: Request) -> None:
        try:
            resp = self.handler(req)
            if isinstance(resp, Deferred):
                self._defer(conn, resp)
                return
            if not isinstance(resp, Response):
                raise TypeError(f"handler returned {type(resp).__name__}, not Response")
        except HttpError as exc:
            resp = exc.response()
        except Exception:
            log.exception("handler failed for %s %s", req.method, req.path)
            resp = json_error(500, "internal_error", "internal error")
        self._answer(conn, req, resp)

    def _defer(self, conn: _Conn, d: Deferred) -> None:
        """Park the connection until ``d`` resolves (or its bound passes)."""
        if self._waker is None:
            self._waker = _Waker()
            if self._selector is not None:
                self._selector.register(self._waker.r, selectors.EVENT_READ, (self, self._waker))
        waker = self._waker
        conn.state = _DEFER
        conn.deferred = d
        conn.deadline = time.monotonic() + d.timeout_s
        if conn.registered_mask:     # a parked socket must not make a level-triggered loop spin
            self._unregister(conn.sock)
            conn.registered_mask = 0

        def notify(done: Deferred, conn: _Conn = conn) -> None:
            waker.done.append((conn, done))       # list.append is atomic under the GIL
            try:
                waker.w.send(b"x")
            except OSError:      # buffer full: the loop is already due to wake
                pass
        d._watch(notify)

    def _resume(self) -> None:
        """Answer every parked connection whose Deferred resolved (loop thread)."""
        waker = self._waker
        assert waker is not None
        try:
            while waker.r.recv(4096):
                pass
        except (BlockingIOError, InterruptedError):
            pass
        while waker.done:
            conn, d = waker.done.pop(0)
            if conn not in self._conns or conn.deferred is not d or conn.request is None:
                continue       # closed, or already answered 503 at its bound
            conn.deferred = None
            result = d._result
            if isinstance(result, Response):
                resp = result
            elif isinstance(result, HttpError):
                resp = result.response()
            else:
                log.error("deferred handler failed for %s %s: %r", conn.request.method, conn.request.path, result)
                resp = json_error(500, "internal_error", "internal error")
            try:
                self._answer(conn, conn.request, resp)
                self._advance(conn)  # pipelined requests that waited for this answer
            except OSError:
                self._close(conn)

    def _answer(self, conn: _Conn, req: Request, resp: Response) -> None:
        if self._on_answer is not None:
            self._on_answer(req, resp)
        conn.served += 1
        close = (
            req.version == "HTTP/1.0"
            or "close" in _tokens(req.headers.get("connection", ""))
            or conn.served >= self.limits.max_requests_per_connection
            or self._stopping
        )
        self._respond(conn, resp, close=close, head_only=req.method == "HEAD")

    def _fail(self, conn: _Conn, status: int, code: str, message: str) -> None:
        headers = [("Retry-After", "1")] if status == 503 else None
        self._respond(conn, self._error(status, code, message, headers), close=True, head_only=False)

    def _respond(self, conn: _Conn, resp: Response, *, close: bool, head_only: bool) -> None:
        if resp.file is not None:
            length = resp.file.length
            body = b""
        else:
            length = len(resp.body)
            body = resp.body
        try:
            head = self._head_bytes(resp, length, close)
        except ValueError:
            log.exception("handler produced an invalid header")
            if resp.file is not None:
                os.close(resp.file.fd)
            self._respond(conn, json_error(500, "internal_error", "internal error"),
                          close=close, head_only=head_only)
            return
        if head_only:
            body = b""
            if resp.file is not None:
                os.close(resp.file.fd)
                resp = Response(resp.status, resp.headers)
        conn.out = memoryview(head + body)
        conn.file = resp.file if resp.file is not None and resp.file.length > 0 else None
        if resp.file is not None and conn.file is None:
            os.close(resp.file.fd)
        conn.copy_file = conn.tls
        conn.close_after = close
        conn.state = _WRITE
        conn.since = time.monotonic()
        conn.deadline = conn.since + self.limits.write_timeout_s
        self._flush(conn)

    def _head_bytes(self, resp: Response, length: int, close: bool) -> bytes:
        reason = _REASONS.get(resp.status, "Unknown")
        lines = [f"HTTP/1.1 {resp.status} {reason}"]
        for name, value in resp.headers:
            if "\r" in name or "\n" in name or "\r" in value or "\n" in value:
                raise ValueError(f"CR/LF in response header {name!r}")
            if name.lower() in _FRAMING_HEADERS:
                raise ValueError(f"response header {name!r} is set by the server")
            lines.append(f"{name}: {value}")
        lines.append(f"Content-Length: {length}")
        lines.append(f"Date: {self._date()}")
        lines.append("Connection: close" if close else "Connection: keep-alive")
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")

    def _date(self) -> str:
        now = int(time.time())
        if self._date_cache[0] != now:
            t = time.gmtime(now)
            self._date_cache = (now, f"{_DAYS[t.tm_wday]}, {t.tm_mday:02d} {_MONTHS[t.tm_mon - 1]} "
                                     f"{t.tm_year} {t.tm_hour:02d}:{t.tm_min:02d}:{t.tm_sec:02d} GMT")
        return self._date_cache[1]

    def _flush(self, conn: _Conn) -> None:
        progressed = False
        try:
            while conn.out:
                n = conn.sock.send(conn.out)
                conn.out = conn.out[n:]
                progressed = True
            while conn.file is not None:
                f = conn.file
                count = min(f.length, self.limits.send_chunk_bytes)
                if conn.copy_file:
                    chunk = os.pread(f.fd, count, f.offset)
                    n = conn.sock.send(chunk) if chunk else 0
                else:
                    try:
                        n = os.sendfile(conn.sock.fileno(), f.fd, f.offset, count)
                    except OSError as exc:
                        if exc.errno not in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
                            raise
                        # procfs and some FUSE files cannot be spliced: copy bounded chunks.
                        conn.copy_file = True
                        continue
                if n == 0:  # file shrank under us: the promised length cannot be kept
                    log.warning("file range ended early; aborting response to %s", conn.peer)
                    self._close(conn)
                    return
                f.offset += n
                f.length -= n
                progressed = True
                if f.length == 0:
                    os.close(f.fd)
                    conn.file = None
        except (BlockingIOError, InterruptedError):
            if progressed:
                conn.deadline = time.monotonic() + self.limits.write_timeout_s
            self._watch(conn, selectors.EVENT_WRITE)
            return
        except OSError:
            self._close(conn)
            return
        self._finish(conn)

    def _finish(self, conn: _Conn) -> None:
        if conn.in_flight:
            conn.in_flight = False
            self._in_flight -= 1
        conn.request = None
        if conn.close_after:
            self._linger(conn)
            return
        conn.state = _HEAD
        conn.started = False
        conn.since = time.monotonic()
        conn.deadline = conn.since + self.limits.idle_timeout_s
        self._watch(conn, selectors.EVENT_READ)

    def _linger(self, conn: _Conn) -> None:
        # Half-close and drain what the client still sends, so the kernel does not answer
        # unread bytes with RST and destroy the response before the client reads it.
        try:
            conn.sock.shutdown(socket.SHUT_WR)
        except OSError:
            self._close(conn)
            return
        conn.state = _LINGER
        conn.buf = bytearray()
        conn.body_needed = _LINGER_BYTES
        conn.deadline = time.monotonic() + _LINGER_S
        self._watch(conn, selectors.EVENT_READ)

    def _expire(self, conn: _Conn, now: float) -> None:
        if conn.state == _DEFER:
            conn.deferred = None
            conn.state = _BODY
            self._fail(conn, 503, "unavailable", "no answer in time; retry later")
        elif conn.state == _HEAD and not conn.started:
            self._close(conn)
        elif conn.state in (_HEAD, _BODY):
            self._fail(conn, 408, "request_timeout",
                       f"request not received within {self.limits.read_timeout_s:g} s")
            if conn in self._conns and conn.state == _WRITE:
                # A client too slow to read its 408 does not get more time.
                conn.deadline = now + min(1.0, self.limits.write_timeout_s)
        else:
            self._close(conn)

    # -- bookkeeping ---------------------------------------------------------------------------
    def _watch(self, conn: _Conn, mask: int) -> None:
        if self._selector is None or conn.registered_mask == mask:
            return
        if conn.registered_mask:
            self._selector.modify(conn.sock, mask, (self, conn))
        else:
            self._selector.register(conn.sock, mask, (self, conn))
        conn.registered_mask = mask

    def _unregister(self, sock: socket.socket) -> None:
        if self._selector is not None:
            try:
                self._selector.unregister(sock)
            except (KeyError, ValueError):
                pass

    def _close(self, conn: _Conn) -> None:
        if conn not in self._conns:
            return
        self._conns.discard(conn)
        if conn.in_flight:
            conn.in_flight = False
            self._in_flight -= 1
        if conn.file is not None:
            os.close(conn.file.fd)
            conn.file = None
        if conn.registered_mask:
            self._unregister(conn.sock)
            conn.registered_mask = 0
        conn.sock.close()


class LoopSurface:
    """What an HTTP surface driven by its owner's selectors loop shares (the local API, the
    control plane's, the Worker's status surface): ``self.server`` (an :class:`HttpServer`)
    registered on the loop, its events, and the SIGTERM drain (``draining`` makes /readyz 503)."""

    server: HttpServer
    draining: bool = False

    def listen_unix(self, path: str) -> str:
        """Bind a unix stream socket at ``path`` (mode 0660); returns the path. Raises OSError."""
        return self.server.listen_unix(path)

    def register(self, selector: selectors.BaseSelector) -> None:
        self.server.register(selector)

    def owns(self, key: selectors.SelectorKey) -> bool:
        return self.server.owns(key)

    def handle_event(self, key: selectors.SelectorKey, mask: int) -> None:
        self.server.handle_event(key, mask)

    def begin_drain(self) -> None:
        """SIGTERM: stop accepting, finish requests in progress; /readyz answers 503."""
        self.draining = True
        self.server.begin_drain()
