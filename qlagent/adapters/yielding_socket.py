"""Sockets whose waits are handed to the caller's loop (the fleet Worker's control client).

A request on a blocking socket holds the Worker's selectors loop for its whole timeout when a
replica stops answering (a SIGSTOPped process accepts connections in its backlog and never
answers; a link whose packets vanish). These sockets keep their file descriptor non-blocking:
an operation that would block calls ``idle(fd, write, timeout_s)`` — the Worker's loop serves
its status surface meanwhile and returns once ``fd`` is ready or ``timeout_s`` (s) passed — and
is tried again, until the deadline the last ``settimeout(t)`` set (t seconds from that call, for
every operation after it: one bound for a whole request), then raises ``TimeoutError``. Without
``idle`` they wait in ``select``. ``setblocking(False)`` makes them plain non-blocking sockets
(``BlockingIOError`` / ``ssl.SSLWantReadError`` at once).
"""

from __future__ import annotations

import errno
import os
import select
import socket
import ssl
import time
from collections.abc import Callable

Idle = Callable[[int, bool, float], None]


class _Waits:
    idle: Idle | None = None
    _deadline: float | None = None          # monotonic s; None: plain non-blocking

    def settimeout(self, t: float | None) -> None:
        super().settimeout(0.0)
        self._deadline = None if t == 0.0 else (float("inf") if t is None else time.monotonic() + t)

    def setblocking(self, flag: bool) -> None:
        self.settimeout(None if flag else 0.0)

    def _wait(self, write: bool, e: BaseException) -> None:
        """Wait until the fd is ready (write: writable) or re-raise ``e`` when non-blocking;
        TimeoutError past the deadline."""
        if self._deadline is None:
            raise e
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("timed out")
        fd = self.fileno()
        if self.idle is not None:
            self.idle(fd, write, left)
        elif write:
            select.select([], [fd], [], left)
        else:
            select.select([fd], [], [], left)


class YieldingSocket(_Waits, socket.socket):
    """A TCP socket (module docstring)."""

    def connect(self, address) -> None:
        err = self.connect_ex(address)
        if err not in (0, errno.EINPROGRESS, errno.EALREADY, errno.EWOULDBLOCK):
            raise OSError(err, os.strerror(err))
        while err:
            self._wait(True, BlockingIOError(err, "connect in progress"))
            if select.select([], [self.fileno()], [], 0)[1]:
                err = self.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
                if err:
                    raise OSError(err, os.strerror(err))

    def recv_into(self, buffer, nbytes: int = 0, flags: int = 0) -> int:
        while True:
            try:
                return super().recv_into(buffer, nbytes, flags)
            except BlockingIOError as e:
                self._wait(False, e)

    def recv(self, bufsize: int, flags: int = 0) -> bytes:
        while True:
            try:
                return super().recv(bufsize, flags)
            except BlockingIOError as e:
                self._wait(False, e)

    def send(self, data, flags: int = 0) -> int:
        while True:
            try:
                return super().send(data, flags)
            except BlockingIOError as e:
                self._wait(True, e)

    def sendall(self, data, flags: int = 0) -> None:
        with memoryview(data) as view, view.cast("B") as b:
            sent = 0
            while sent < len(b):
                sent += self.send(b[sent:], flags)


class YieldingSSLSocket(_Waits, ssl.SSLSocket):
    """A TLS socket over a ``YieldingSocket`` (``handshake``)."""

    def _retry(self, op, *args):
        while True:
            try:
                return op(*args)
            except ssl.SSLWantReadError as e:
                self._wait(False, e)
            except ssl.SSLWantWriteError as e:
                self._wait(True, e)

    def do_handshake(self, block: bool = False) -> None:
        # Not SSLSocket.do_handshake: it resets the timeout afterwards, which here is the deadline.
        self._check_connected()
        self._retry(self._sslobj.do_handshake)

    def read(self, len: int = 1024, buffer=None):
        return self._retry(super().read, len, buffer)

    def send(self, data, flags: int = 0) -> int:
        return self._retry(super().send, data, flags)


def dial(host: str, port: int, timeout_s: float, idle: Idle | None) -> YieldingSocket:
    """A TCP connection to ``host:port`` (every address DNS gives, in order) within
    ``timeout_s`` (s), TCP_NODELAY set, waits handed to ``idle``; its deadline then starts
    again with the next ``settimeout``. Raises OSError (TimeoutError past the bound)."""
    last: OSError | None = None
    for family, kind, proto, _, addr in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM):
        sock = YieldingSocket(family, kind, proto)
        sock.idle = idle
        sock.settimeout(timeout_s)
        try:
            sock.connect(addr)
            # Small request/answer exchanges: Nagle + delayed ACK would add ~40 ms to each.
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            return sock
        except OSError as e:
            sock.close()
            last = e
    raise last or OSError(errno.EHOSTUNREACH, f"{host}: no address")


def handshake(ctx: ssl.SSLContext, sock: YieldingSocket, host: str) -> YieldingSSLSocket:
    """TLS over ``sock`` with ``ctx`` (its ``sslsocket_class`` must be ``YieldingSSLSocket``)
    for ``host``, within what is left of ``sock``'s deadline. Raises ssl.SSLError, OSError."""
    deadline, idle = sock._deadline, sock.idle
    tls = ctx.wrap_socket(sock, server_hostname=host, do_handshake_on_connect=False)
    tls.idle, tls._deadline = idle, deadline
    tls.do_handshake()
    return tls
