"""TLS for the control plane's HTTP listener (issue 10 §10, docs/worker-protocol.md Transport).

``TlsAcceptor(cert_file, key_file)`` builds a stdlib ``ssl`` server context (TLS 1.2 or newer,
no renegotiation; TLS 1.2 only with the AEAD suites of ``TLS12_CIPHERS``, TLS 1.3 as OpenSSL has it) and wraps each accepted socket so that :class:`qlagent.http.server.HttpServer`
drives it like a plain one: the handshake and every read/write are non-blocking, and the
``ssl`` want-read/want-write conditions become ``BlockingIOError`` for the server loop.
Imported only when ``tls_cert``/``tls_key`` are configured: a router never loads ``ssl``.
"""

from __future__ import annotations

import socket
import ssl

from qlagent.core.errors import ValidationError

_RECV_BYTES = 16384
# TLS 1.2: forward secrecy and AEAD only (no CBC-mode suite, e.g. ECDHE-ECDSA-AES128-SHA256).
TLS12_CIPHERS = "ECDHE+AESGCM:ECDHE+CHACHA20"
MAX_PEM_BYTES = 1_048_576    # a certificate chain or key is a few KiB: refuse anything this large


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


class _Encrypted(Exception):
    """The key file asked for a passphrase (the replica has none to give)."""


def _no_passphrase() -> bytes:
    raise _Encrypted


def _read(field: str, path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read(MAX_PEM_BYTES + 1)
    except OSError as e:
        raise ValidationError(field, f"cannot read {path} ({e.strerror or e.__class__.__name__})") from None


class TlsAcceptor:
    """Server-side TLS from a PEM certificate chain and its private key (``[cluster]``
    ``tls_cert``, ``tls_key``). Raises ValidationError naming the file at fault: ``cluster.tls_cert``
    when it cannot be read or holds no PEM certificate, ``cluster.tls_key`` when it cannot be read,
    is not an unencrypted PEM private key, or is not the certificate's key."""

    def __init__(self, cert_file: str, key_file: str) -> None:
        cert, key = _read("cluster.tls_cert", cert_file), _read("cluster.tls_key", key_file)
        for field, path, data in (("cluster.tls_cert", cert_file, cert), ("cluster.tls_key", key_file, key)):
            if len(data) > MAX_PEM_BYTES:
                raise ValidationError(field, f"{path} is over {MAX_PEM_BYTES} bytes", limit=MAX_PEM_BYTES)
        try:    # load_cert_chain says only "PEM lib" for either file: judge the certificate alone first
            ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_verify_locations(cadata=cert.decode("ascii"))
        except (UnicodeDecodeError, ssl.SSLError):
            raise ValidationError("cluster.tls_cert", f"{cert_file} holds no PEM certificate") from None
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.options |= ssl.OP_NO_RENEGOTIATION
        ctx.set_ciphers(TLS12_CIPHERS)
        try:
            ctx.load_cert_chain(cert_file, key_file, password=_no_passphrase)
        except _Encrypted:
            raise ValidationError("cluster.tls_key", f"{key_file} is encrypted; give the key without a passphrase") \
                from None
        except ssl.SSLError as e:
            if e.reason == "KEY_VALUES_MISMATCH":
                raise ValidationError("cluster.tls_key", f"{key_file} and cluster.tls_cert {cert_file} are not a "
                                                         "pair (the key is not the certificate's)") from None
            raise ValidationError("cluster.tls_key", f"{key_file} holds no PEM private key") from None
        except OSError as e:    # changed between the read above and this one
            raise ValidationError("cluster.tls_key", f"cannot read {key_file} ({e.strerror or e})") from None
        self.context = ctx

    def wrap(self, sock: socket.socket) -> TlsConnection:
        """The accepted non-blocking ``sock`` inside TLS; the handshake is left to the loop."""
        return TlsConnection(self.context.wrap_socket(sock, server_side=True, do_handshake_on_connect=False))
