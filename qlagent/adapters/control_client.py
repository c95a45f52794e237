"""HTTP client of a fleet Worker to its control plane (docs/worker-protocol.md, issue 11).

Stdlib ``http.client`` + ``ssl`` only, loaded by Worker mode alone (a local agent never imports
this module). TLS trusts exactly the CA in ``ca_file`` (no system trust store) and checks the
host name; plain ``http://`` is accepted for loopback hosts only. The Worker credential is read
from ``credential_file``, which must be a regular file owned by the agent's user with mode 0600
(``qlw_`` + 43 URL-safe characters); it is sent as ``Authorization: Worker <credential>`` and
never appears in a log line, error or ``repr``.

Two persistent connections: ``rpc`` (hello, heartbeat, ACKs, log chunks; blocking, bounded by
the timeout the caller passes) and ``poll`` (the long-polling Pull, sent and then awaited by the
Worker's selectors loop through ``poll_fileno``). ``control_url`` may name several replicas of
one control plane: both connections use one at a time, and a request that gets no answer at all
(refused, reset, timed out, TLS refused) moves them to the next, in order and round again; the
Worker's loop paces the retries (its backoff), and every Worker request is idempotent, so the
retry on another replica is safe. A Pull refused ``long_polls_full`` (that replica has no
long-poll slot for this Worker) moves them too. Every answer's ``X-Qlagent-Server-Now-Us``
(database clock, µs) is returned with it for lease anchoring (``qlagent.worker.fencing``).

Errors: the documented codes become the typed errors of ``core.control`` carrying
``code``, ``field``, ``status``, ``retry_after_s`` and ``next_offset`` (409 chunk answers);
a refused TLS handshake is ``ControlTlsError`` with one line naming ``ca_file``; anything that
prevents an answer (refused, reset, timeout) is ``ControlUnreachable``.
"""

from __future__ import annotations

import http.client
import os
import re
import select
import socket
import ssl
import stat

import msgspec

from ..core.control import (BY_CODE, Answer, ControlBusy, ControlError, ControlTlsError, ControlUnreachable)
from ..core.cluster import WorkerInfo
from ..core.control_url import parse_control_url
from ..core.errors import ValidationError

CREDENTIAL = re.compile(r"qlw_[A-Za-z0-9_-]{43}")
MAX_CREDENTIAL_FILE_BYTES = 256
MAX_ANSWER_BYTES = 1 << 20          # an offer with its spec is at most a few tens of KiB
DEFAULT_TIMEOUT_S = 10.0
# TLS 1.3 servers send session tickets after the handshake: they make the Pull's socket readable
# before any answer. They are drained right after connecting, and reading an answer never blocks
# the Worker's loop longer than this (a miss is a lost answer: the Pull is retried byte for byte).
TICKET_WAIT_S = 0.1
FINISH_READ_S = 0.5
SERVER_NOW = "X-Qlagent-Server-Now-Us"
API = "/api/v3/cluster/workers"


class _ErrorBody(msgspec.Struct):
    error: str = "control_error"
    field: str | None = None
    message: str = ""
    next_offset: int | None = msgspec.field(default=None, name="nextOffset")


def read_credential(path: str) -> str:
    """The Worker credential in ``path``: a regular file (no symlink) owned by this process's
    user, mode 0600 or stricter, holding ``qlw_`` + 43 URL-safe characters (one line).

    Raises ValidationError(field="worker.credential_file") naming the rule broken (the
    credential itself is never quoted)."""
    field = "worker.credential_file"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as e:
        raise ValidationError(field, f"{path}: cannot be read ({e.strerror})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValidationError(field, f"{path}: not a regular file")
        if st.st_uid != os.geteuid():
            raise ValidationError(field, f"{path}: owned by uid {st.st_uid}, must be the agent's (uid {os.geteuid()})")
        if st.st_mode & 0o177:
            raise ValidationError(field, f"{path}: mode {stat.S_IMODE(st.st_mode):04o}, must be 0600")
        raw = os.read(fd, MAX_CREDENTIAL_FILE_BYTES + 1)
    finally:
        os.close(fd)
    text = raw.decode("ascii", "replace").strip()
    if len(raw) > MAX_CREDENTIAL_FILE_BYTES or not CREDENTIAL.fullmatch(text):
        raise ValidationError(field, f"{path}: not a Worker credential (qlw_ + 43 URL-safe characters, "
                                     "from `qlagent workers enroll`)")
    return text


def tls_context(ca_file: str) -> ssl.SSLContext:
    """A client context trusting only ``ca_file`` (PEM), TLS ≥ 1.2, host names checked.
    Raises ValidationError(field="worker.ca_file") when it cannot be loaded."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)      # verify_mode CERT_REQUIRED, check_hostname on
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        ctx.load_verify_locations(cafile=ca_file)
    except (OSError, ssl.SSLError) as e:
        raise ValidationError("worker.ca_file", f"{ca_file}: not a readable PEM CA ({type(e).__name__})") from None
    return ctx


class ControlClient:
    """One Worker's client; ``worker_id`` is the enrolled Worker's UUID; ``control_url`` one URL
    or a list (module docstring: the next one after a request without an answer). Not
    thread-safe (the Worker's loop owns it). Construction reads and checks the URLs, the
    credential and the CA (raises ValidationError naming the field); nothing is connected until
    the first request."""

    def __init__(self, control_url: str | list[str], worker_id: str, credential_file: str, ca_file: str | None,
                 timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        urls = [control_url] if isinstance(control_url, str) else list(control_url)
        if not urls:
            raise ValidationError("worker.control_url", "at least one URL")
        self._endpoints = [parse_control_url(u) for u in urls]
        self.replicas = len(self._endpoints)
        self.urls = tuple(f"{scheme}://{host}:{port}" for scheme, host, port in self._endpoints)
        self._at = 0
        https = any(scheme == "https" for scheme, _, _ in self._endpoints)
        if https and not ca_file:
            raise ValidationError("worker.ca_file", "required with an https:// control_url")
        self._ctx = tls_context(ca_file) if https else None
        self._auth = f"Worker {read_credential(credential_file)}"
        self._base = f"{API}/{worker_id}"
        self.timeout_s = timeout_s
        self._rpc: http.client.HTTPConnection | None = None
        self._poll: http.client.HTTPConnection | None = None

    def __repr__(self) -> str:
        scheme, host, port = self._endpoints[self._at]
        return f"ControlClient({scheme}://{host}:{port})"

    def _connect(self, timeout_s: float) -> http.client.HTTPConnection:
        """A connection to the current replica; it remembers which one (``endpoint``)."""
        scheme, host, port = self._endpoints[self._at]
        if scheme == "https":
            conn = http.client.HTTPSConnection(host, port, timeout=timeout_s, context=self._ctx)
        else:
            conn = http.client.HTTPConnection(host, port, timeout=timeout_s)
        conn.endpoint = self._at
        return conn

    def close(self) -> None:
        for c in (self._rpc, self._poll):
            if c is not None:
                c.close()
        self._rpc = self._poll = None

    # -- blocking requests on the rpc connection -------------------------------------------------
    def request(self, method: str, path: str, body: bytes, content_type: str = "application/json",
                headers: dict[str, str] | None = None, timeout_s: float | None = None) -> Answer:
        """Send one request under this Worker's route (``path`` after ``/workers/{id}``) and
        wait at most ``timeout_s`` (default the client's) for its answer. Raises ControlError."""
        t = max(0.05, timeout_s if timeout_s is not None else self.timeout_s)
        for attempt in (1, 2):
            if self._rpc is None:
                self._rpc = self._connect(t)
            conn = self._rpc
            reused = conn.sock is not None
            try:
                if reused:
                    conn.sock.settimeout(t)
                else:
                    conn.timeout = t
                self._send(conn, method, path, body, content_type, headers)
                return self._answer(conn.getresponse())
            except ControlError:
                raise
            except BaseException as e:
                self._rpc = None
                conn.close()
                # A kept-alive connection the server closed meanwhile: every Worker request is
                # idempotent, so it is sent once more on a fresh connection.
                if attempt == 1 and reused and isinstance(e, (http.client.RemoteDisconnected, BrokenPipeError,
                                                              ConnectionResetError)):
                    continue
                raise self._transport_error(e, conn.endpoint) from None

    # -- the long-polling Pull on its own connection ---------------------------------------------
    def start_poll(self, path: str, body: bytes, wait_s: float) -> int:
        """Send a Pull (``path`` e.g. ``/pull?waitS=20``) on the poll connection and return the
        socket's fileno to wait on; ``finish_poll`` reads the answer. Raises ControlError."""
        if self._poll is None:
            self._poll = self._connect(self.timeout_s)
        conn = self._poll
        try:
            if conn.sock is not None:
                conn.sock.settimeout(self.timeout_s)
            else:
                self._open(conn)
                self._drain_tickets(conn.sock)
            self._send(conn, "POST", path, body, "application/json", None)
            # The answer may take wait_s; reading it must not hang past that plus the timeout.
            conn.sock.settimeout(wait_s + self.timeout_s)
            return conn.sock.fileno()
        except BaseException as e:
            self.abort_poll()
            raise self._transport_error(e, conn.endpoint) from None

    def poll_pending(self) -> bool:
        """True when TLS already holds decrypted bytes of the answer (select would not wake)."""
        s = self._poll.sock if self._poll is not None else None
        return isinstance(s, ssl.SSLSocket) and s.pending() > 0

    def finish_poll(self) -> Answer:
        """The Pull's answer (the socket is readable). Raises ControlError."""
        conn = self._poll
        if conn is None:
            raise ControlUnreachable("no Pull in flight")
        try:
            conn.sock.settimeout(FINISH_READ_S)
            return self._answer(conn.getresponse())
        except ControlError as e:
            if e.code == "long_polls_full" and conn.endpoint == self._at and self.replicas > 1:
                self._at = (self._at + 1) % self.replicas      # no slot there: the next Pull asks the next one
            raise
        except BaseException as e:
            self.abort_poll()
            raise self._transport_error(e, conn.endpoint) from None

    @staticmethod
    def _drain_tickets(sock) -> None:
        if not isinstance(sock, ssl.SSLSocket):
            return
        sock.setblocking(False)
        try:
            for _ in range(4):              # OpenSSL servers send two tickets, maybe in two records
                if not select.select([sock], [], [], TICKET_WAIT_S)[0]:
                    return
                try:
                    sock.recv(1)            # no request was sent: nothing but tickets can be there
                except ssl.SSLWantReadError:
                    continue
        finally:
            sock.settimeout(DEFAULT_TIMEOUT_S)

    def abort_poll(self) -> None:
        """Drop the poll connection (a lost answer: the Pull is retried byte-identically)."""
        if self._poll is not None:
            self._poll.close()
            self._poll = None

    # -- helpers -----------------------------------------------------------------------------------
    def _send(self, conn, method, path, body, content_type, headers) -> None:
        h = {"Authorization": self._auth, "Content-Type": content_type, "Content-Length": str(len(body)),
             "Connection": "keep-alive"}
        if headers:
            h.update(headers)
        if conn.sock is None:
            self._open(conn)
        conn.request(method, self._base + path, body=body, headers=h)

    @staticmethod
    def _open(conn) -> None:
        conn.connect()
        # Small request/answer exchanges: Nagle + delayed ACK would add ~40 ms to each.
        conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def _answer(self, resp: http.client.HTTPResponse) -> Answer:
        data = resp.read(MAX_ANSWER_BYTES + 1)
        if len(data) > MAX_ANSWER_BYTES:
            raise ControlError("answer larger than the limit", code="answer_too_large", status=resp.status)
        now = resp.getheader(SERVER_NOW)
        try:
            server_now = int(now) if now is not None else None
        except ValueError:
            server_now = None
        if 200 <= resp.status < 300:
            return Answer(resp.status, data, server_now)
        try:
            err = msgspec.json.decode(data, type=_ErrorBody)
        except msgspec.DecodeError:
            err = _ErrorBody(error=f"http_{resp.status}", message="")
        cls = BY_CODE.get(err.error, ControlBusy if resp.status >= 500 else ControlError)
        retry = resp.getheader("Retry-After")
        try:
            retry_s = float(retry) if retry is not None else None
        except ValueError:
            retry_s = None
        # The message is the control plane's (it never carries a command, secret or token).
        raise cls(f"{resp.status} {err.error}: {err.message[:200]}", code=err.error, field=err.field,
                  status=resp.status, retry_after_s=retry_s, next_offset=err.next_offset)

    def _transport_error(self, e: BaseException, endpoint: int) -> ControlError:
        """The typed error for a request to replica ``endpoint`` that got no answer. The next
        connection goes to the replica after it, unless the other connection already moved on
        (both failing on one dead replica move once, not twice)."""
        _, host, port = self._endpoints[endpoint]
        if endpoint == self._at:
            self._at = (endpoint + 1) % len(self._endpoints)
        return no_answer(e, host, port)

    # -- doctor ------------------------------------------------------------------------------------
    def describe(self) -> WorkerInfo:
        """``GET /api/v3/cluster/workers/{workerId}`` on the current replica: what the control
        plane knows of this Worker. Read only on the control plane: no Session is opened and no
        Lease touched, so ``qlagent doctor`` may ask while the Worker runs. Raises ControlError
        (``ControlAuthError`` for a credential it does not take; ``status`` 404 from a control
        plane older than the route)."""
        answer = self.request("GET", "", b"")
        try:
            return msgspec.json.decode(answer.body, type=WorkerInfo)
        except msgspec.DecodeError:
            raise ControlError("the answer is not a Worker description", code="bad_answer",
                               status=answer.status) from None


def healthz(url: str, ctx: ssl.SSLContext | None, timeout_s: float = DEFAULT_TIMEOUT_S) -> int:
    """``GET /healthz`` on the replica at ``url`` (TCP, TLS trusting only ``ctx``'s CA, HTTP),
    for ``qlagent doctor``; its status. Needs no credential. Raises ValidationError for a bad URL,
    ``ControlTlsError``/``ControlUnreachable`` when no answer comes."""
    scheme, host, port = parse_control_url(url)
    if scheme == "https":
        conn = http.client.HTTPSConnection(host, port, timeout=timeout_s, context=ctx)
    else:
        conn = http.client.HTTPConnection(host, port, timeout=timeout_s)
    try:
        conn.request("GET", "/healthz", headers={"Connection": "close"})
        resp = conn.getresponse()
        resp.read(MAX_ANSWER_BYTES)
        return resp.status
    except BaseException as e:
        raise no_answer(e, host, port) from None
    finally:
        conn.close()


def no_answer(e: BaseException, host: str, port: int) -> ControlError:
    """The typed error for a request to ``host:port`` that got no answer (``ControlTlsError``
    naming ``worker.ca_file``, else ``ControlUnreachable``); re-raises what is not an error."""
    if isinstance(e, ssl.SSLCertVerificationError):
        return ControlTlsError(f"control plane {host}:{port}: certificate refused "
                               f"({e.verify_message}); worker.ca_file must hold the CA that signed it",
                               field="worker.ca_file")
    if isinstance(e, (ssl.SSLEOFError, ssl.SSLZeroReturnError, ssl.SSLSyscallError)) \
            or (isinstance(e, ssl.SSLError) and e.reason is None):
        # The peer closed mid-handshake (a replica shutting down, a cut link): no answer, not a
        # wrong CA — a Worker starting then must retry, not exit as for bad config.
        return ControlUnreachable(f"control plane {host}:{port}: connection closed during the TLS handshake")
    if isinstance(e, ssl.SSLError):
        # Not a certificate refusal: the peer does not speak TLS as expected (a plain HTTP port,
        # a proxy): the URL is the thing to look at, not the CA.
        return ControlTlsError(f"control plane {host}:{port}: TLS failed ({e.reason}); is it a TLS "
                               "replica's address?", field="worker.control_url")
    if isinstance(e, (OSError, http.client.HTTPException)):
        what = "timed out" if isinstance(e, (socket.timeout, TimeoutError)) else type(e).__name__
        if isinstance(e, OSError) and e.strerror and what != "timed out":
            what += f" ({e.strerror})"
        return ControlUnreachable(f"control plane {host}:{port}: {what}")
    if isinstance(e, Exception):
        return ControlUnreachable(f"control plane {host}:{port}: {type(e).__name__}")
    raise e
