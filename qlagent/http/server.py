"""Bounded HTTP/1.1 server on ``selectors``, driven by the agent's single main loop.

This module is the loop's side: sockets, TLS handshakes, in-flight slots, timeouts, eviction,
parked (``Deferred``) answers and writing. The bytes' side — parsing a request head, its body's
framing, a response's head, the records and the limits — is ``http.wire``, which has no socket.

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
import selectors
import socket
import stat
import threading
import time
from typing import Callable

from qlagent.http.wire import (FileRange, HttpError, HttpLimits, Request, Response, body_length, http_date, json_error,
                               parse_head, response_head, tokens)

log = logging.getLogger("qlagent.http")

_RECV_BYTES = 16384
_LINGER_S = 1.0
_LINGER_BYTES = 65536
_ACCEPTS_PER_EVENT = 16
_ACCEPT_PAUSE_S = 0.5


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
    ``time.monotonic()`` seconds, or None). Not thread-safe: every call from the
    loop's thread.
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
        self._stopping = False
        self._date_cache = (0, "")

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
            sock.send(response_head(resp, len(resp.body), True, self._date()) + resp.body)
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
        req = parse_head(conn.buf, self.limits, conn.peer)
        if req is None:
            if not conn.buf:
                conn.started = False     # only empty lines so far: no request has begun
            return False
        self._admit(conn, req, body_length(req, self.limits))
        return True

    def _admit(self, conn: _Conn, req: Request, length: int) -> None:
        """Take an in-flight slot for ``req`` (a probe needs none; 503 beyond ``max_in_flight``)
        and wait for its ``length`` body bytes; ``100 Continue`` only to HTTP/1.1 (RFC 9110 §10.1.1)."""
        lim = self.limits
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
            or "close" in tokens(req.headers.get("connection", ""))
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
            head = response_head(resp, length, close, self._date())
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

    def _date(self) -> str:
        now = int(time.time())
        if self._date_cache[0] != now:
            self._date_cache = (now, http_date(now))
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
