"""TLS for the control plane's HTTP listener (issue 10 §10, docs/worker-protocol.md Transport).

``TlsAcceptor(cert_file, key_file)`` builds a stdlib ``ssl`` server context (TLS 1.2 or newer,
no renegotiation) and wraps each accepted socket so that :class:`qlagent.http.server.HttpServer`
drives it like a plain one: the handshake and every read/write are non-blocking, and the
``ssl`` want-read/want-write conditions become ``BlockingIOError`` for the server loop.
Imported only when ``tls_cert``/``tls_key`` are configured: a router never loads ``ssl``.
"""

from __future__ import annotations

import socket
import ssl

from qlagent.core.errors import ValidationError

_RECV_BYTES = 16384


class TlsConnection:
    """One accepted socket inside TLS; the subset of the socket API the server uses."""

    __slots__ = ("_s",)

    def __init__(self, sock: ssl.SSLSocket) -> None:
        self._s = sock

    def fileno(self) -> int:
        return self._s.fileno()

    def handshake(self) -> str | None:
        """Advance the handshake: None when done, ``"read"``/``"write"`` when it must wait for
        the socket. Raises ssl.SSLError (an OSError) when the peer fails it."""
        try:
            self._s.do_handshake()
        except ssl.SSLWantReadError:
            return "read"
        except ssl.SSLWantWriteError:
            return "write"
        return None

    def recv(self, n: int) -> bytes:
        try:
            data = self._s.recv(n)
            # Decrypted bytes already inside the TLS object never make the socket readable
            # again: take them now.
            while data and self._s.pending():
                data += self._s.recv(self._s.pending())
            return data
        except (ssl.SSLWantReadError, ssl.SSLWantWriteError):
            raise BlockingIOError from None

    def send(self, data) -> int:
        try:
            return self._s.send(data)
        except (ssl.SSLWantReadError, ssl.SSLWantWriteError):
            raise BlockingIOError from None

    def setsockopt(self, *args) -> None:
        self._s.setsockopt(*args)

    def shutdown(self, how: int) -> None:
        self._s.shutdown(how)

    def close(self) -> None:
        self._s.close()


class TlsAcceptor:
    """Server-side TLS from a PEM certificate chain and its private key (``[cluster]``
    ``tls_cert``, ``tls_key``). Raises ValidationError naming ``cluster.tls_cert`` or
    ``cluster.tls_key`` when either cannot be read or they do not load as a pair."""

    def __init__(self, cert_file: str, key_file: str) -> None:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.options |= ssl.OP_NO_RENEGOTIATION
        try:
            ctx.load_cert_chain(cert_file, key_file)
        except FileNotFoundError as e:
            raise ValidationError("cluster.tls_cert" if e.filename in (None, cert_file) else "cluster.tls_key",
                                  f"cannot read {e.filename or cert_file}") from None
        except (ssl.SSLError, OSError) as e:
            raise ValidationError("cluster.tls_key", f"certificate and key do not load as a pair ({e.__class__.__name__})") \
                from None
        self.context = ctx

    def wrap(self, sock: socket.socket) -> TlsConnection:
        """The accepted non-blocking ``sock`` inside TLS; the handshake is left to the loop."""
        return TlsConnection(self.context.wrap_socket(sock, server_side=True, do_handshake_on_connect=False))
