"""HTTP client of a fleet Worker to its control plane (docs/worker-protocol.md, issue 11).

Stdlib ``http.client`` + ``ssl`` only, loaded by Worker mode alone (a local agent never imports
this module). TLS trusts exactly the CA in ``ca_file`` (no system trust store) and checks the
host name; plain ``http://`` is accepted for loopback hosts only. The Worker credential is read
from ``credential_file``, which must be a regular file owned by the agent's user with mode 0600
(``qlw_`` + 43 URL-safe characters); it is sent as ``Authorization: Worker <credential>`` and
never appears in a log line, error or ``repr``.

Two persistent connections: ``rpc`` (hello, heartbeat, ACKs, log chunks; each call bounded by
the timeout the caller passes) and ``poll`` (the long-polling Pull, sent by ``start_pull`` and then awaited by the
Worker's selectors loop on the socket it returns). ``control_url`` may name several replicas of
one control plane: both connections use one at a time, and a request that gets no answer at all
(refused, reset, timed out, TLS refused) moves them to the next, in order and round again; the
Worker's loop paces the retries (its backoff), and every Worker request is idempotent, so the
retry on another replica is safe. A Pull refused ``long_polls_full`` (that replica has no
long-poll slot for this Worker) moves them too. Their sockets are ``adapters.yielding_socket``'s: a call that waits (connect, TLS handshake,
send, answer) hands the wait to ``idle`` (the Worker's loop serves its status surface meanwhile),
so a replica that stops answering holds a call for its timeout, never the process's other duties
that need no answer. Every answer's ``X-Qlagent-Server-Now-Us``
(database clock, µs) is returned with it for lease anchoring (``qlagent.worker.policy.fencing``).

Errors: the documented codes become the typed errors of ``core.control`` carrying
``code``, ``field``, ``status``, ``retry_after_s`` and ``next_offset`` (409 chunk answers);
a refused TLS handshake is ``ControlTlsError`` with one line naming ``ca_file``; anything that
prevents an answer (refused, reset, timeout, DNS) is ``ControlUnreachable`` — also a
certificate "not yet valid"/"expired" while this host's clock is before qlagent's build date
(``build_date_s``; code ``clock_not_set``): the clock is wrong, not the configuration.
"""

from __future__ import annotations

import functools
import http.client
import os
import re
import select
import socket
import ssl
import stat
import time

import msgspec

from ..core.control import (BY_CODE, Answer, ControlBusy, ControlError, ControlTlsError, ControlUnreachable)
from ..core.cluster import (Ack, AckResult, ChunkAnswer, Heartbeat, HeartbeatRequest, Hello, PullAnswer, SessionGrant,
                            WorkerInfo)
from ..core.control_url import parse_control_url
from ..core.errors import ValidationError
from .yielding_socket import Idle, YieldingSSLSocket, dial, handshake

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
# OpenSSL's X509_V_ERR_CERT_NOT_YET_VALID / X509_V_ERR_CERT_HAS_EXPIRED, and the host name /
# IP address mismatches
CERT_NOT_YET_VALID, CERT_HAS_EXPIRED = 9, 10
NAME_MISMATCH = (62, 64)
PROBE_TIMEOUT_S = 2.0
CLOCK_NOT_SET = "clock_not_set"


@functools.cache
def build_date_s() -> float:
    """This qlagent's build date (s since the epoch): the newest modification time of the
    installed package's files. dpkg and opkg unpack them with the times of the build, a source
    checkout gives its last edit. A clock earlier than that is not set (a router without a
    battery-backed clock boots at 1970 until NTP answers)."""
    newest = 0.0
    for root, _dirs, files in os.walk(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))):
        for name in files:
            try:
                newest = max(newest, os.stat(os.path.join(root, name)).st_mtime)
            except OSError:
                continue
    return newest


def clock_plausible() -> bool:
    """Is the wall clock at or after this qlagent's build date (``build_date_s``)?"""
    return time.time() >= build_date_s()


def _pull_path(wait_s: int) -> str:
    return f"/pull?waitS={wait_s}"


def _utc(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))


class _ErrorBody(msgspec.Struct):
    error: str = "control_error"
    field: str | None = None
    message: str = ""
    next_offset: int | None = msgspec.field(default=None, name="nextOffset")


def read_credential(path: str, owner: bool = True) -> str:
    """The Worker credential in ``path``: a regular file (no symlink) owned by this process's
    user (unless not ``owner``: ``config check`` may run as another user than the service),
    mode 0600 or stricter, holding ``qlw_`` + 43 URL-safe characters (one line).

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
        if owner and st.st_uid != os.geteuid():
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
    Raises ValidationError(field="worker.ca_file") when it cannot be loaded or holds no CA
    certificate (a server's own certificate there would refuse every replica)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)      # verify_mode CERT_REQUIRED, check_hostname on
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        ctx.load_verify_locations(cafile=ca_file)
    except (OSError, ssl.SSLError) as e:
        raise ValidationError("worker.ca_file", f"{ca_file}: not a readable PEM CA ({type(e).__name__})") from None
    if not ctx.cert_store_stats()["x509_ca"]:
        raise ValidationError("worker.ca_file", f"{ca_file}: holds no CA certificate (basicConstraints CA:TRUE); "
                                                "the CA that signed the control plane's certificate goes here, "
                                                "not that certificate")
    return ctx


class ControlClient:
    """One Worker's client; ``worker_id`` is the enrolled Worker's UUID; ``control_url`` one URL
    or a list (module docstring: the next one after a request without an answer). Not
    thread-safe (the Worker's loop owns it). ``idle(fd, write, timeout_s)``, when set, is called
    whenever a call must wait on its socket (``adapters.yielding_socket``). Construction reads and checks the URLs, the
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
        if self._ctx is not None:
            self._ctx.sslsocket_class = YieldingSSLSocket
        self.idle: Idle | None = None
        self._auth = f"Worker {read_credential(credential_file)}"
        self._base = f"{API}/{worker_id}"
        self.timeout_s = timeout_s
        self._rpc: http.client.HTTPConnection | None = None
        self._poll: http.client.HTTPConnection | None = None

    @staticmethod
    def clock_plausible() -> bool:
        """Is this host's wall clock at or after qlagent's build date (``build_date_s``)?"""
        return clock_plausible()

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

    # -- the Worker protocol (docs/worker-protocol.md) ------------------------------------------------
    # Each call waits at most ``timeout_s`` (s; default the client's) and returns the decoded
    # answer with the database clock of its ``X-Qlagent-Server-Now-Us`` (µs since the epoch, None
    # when missing). Raises ControlError (typed by code), msgspec.DecodeError for an answer that
    # is not the documented document.
    def hello(self, hello: Hello, timeout_s: float | None = None) -> tuple[SessionGrant, int | None]:
        """``POST …/sessions``: open a Session (ADR-0108 ``Hello`` → ``SessionGrant``)."""
        return self._typed(self._request("POST", "/sessions", msgspec.json.encode(hello), timeout_s=timeout_s),
                           SessionGrant)

    def heartbeat(self, beat: HeartbeatRequest, timeout_s: float | None = None) -> tuple[Heartbeat, int | None]:
        """``POST …/heartbeat``: renew the Session and the Leases it names."""
        return self._typed(self._request("POST", "/heartbeat", msgspec.json.encode(beat), timeout_s=timeout_s),
                           Heartbeat)

    def ack(self, ack: Ack, timeout_s: float | None = None) -> tuple[AckResult, int | None]:
        """``POST …/acks``: one ACK of an offered Attempt (``starting``, ``running``, …)."""
        return self._typed(self._request("POST", "/acks", msgspec.json.encode(ack), timeout_s=timeout_s), AckResult)

    def pull(self, body: bytes, timeout_s: float | None = None) -> tuple[PullAnswer, int | None]:
        """``POST …/pull?waitS=0`` on the rpc connection: a kept Pull request (``body``, its exact
        bytes) answered at once, without the long poll (ADR-0108: the same offer rebuilt)."""
        return self._typed(self._request("POST", _pull_path(0), body, timeout_s=timeout_s), PullAnswer)

    def upload_chunk(self, *, session_id: str, generation: int, attempt_id: str, lease_generation: int,
                     lease_token: str, offset: int, data: bytes,
                     timeout_s: float | None = None) -> tuple[ChunkAnswer, int | None]:
        """``PUT …/attempts/{attemptId}/log?offset=N``: ``data`` (1..``MAX_CHUNK_BYTES`` bytes)
        at ``offset`` (bytes) of the Attempt's log, under its Lease fence. ChunkConflict names
        the offset the control plane expects (``next_offset``)."""
        headers = {"X-Qlagent-Session": session_id, "X-Qlagent-Generation": str(generation),
                   "X-Qlagent-Lease-Generation": str(lease_generation), "X-Qlagent-Lease-Token": lease_token}
        ans = self._request("PUT", f"/attempts/{attempt_id}/log?offset={offset}", data, "application/octet-stream",
                            headers, timeout_s)
        return self._typed(ans, ChunkAnswer)

    @staticmethod
    def _typed(ans: Answer, kind: type):
        return msgspec.json.decode(ans.body, type=kind), ans.server_now_us

    # -- blocking requests on the rpc connection -------------------------------------------------
    def _request(self, method: str, path: str, body: bytes, content_type: str = "application/json",
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
    def start_pull(self, body: bytes, wait_s: int, timeout_s: float | None = None) -> int:
        """Send a Pull (``body``: the kept request's exact bytes) waiting up to ``wait_s`` (s) on
        the poll connection and return the socket's fileno to wait on; ``finish_pull`` reads the
        answer. Connecting and sending take at most ``timeout_s`` (s; default the client's).
        Raises ControlError."""
        t = max(0.05, timeout_s if timeout_s is not None else self.timeout_s)
        if self._poll is None:
            self._poll = self._connect(t)
        conn = self._poll
        try:
            if conn.sock is not None:
                conn.sock.settimeout(t)
            else:
                conn.timeout = t
                self._open(conn)
                self._drain_tickets(conn.sock)
            self._send(conn, "POST", _pull_path(wait_s), body, "application/json", None)
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

    def finish_pull(self) -> tuple[PullAnswer, int | None]:
        """The Pull's answer (the socket is readable) with its database clock (µs). Raises
        ControlError, msgspec.DecodeError."""
        return self._typed(self._finish_poll(), PullAnswer)

    def _finish_poll(self) -> Answer:
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

    def abort_poll(self, unanswered: bool = False) -> None:
        """Drop the poll connection (a lost answer: the Pull is retried byte-identically); with
        ``unanswered``, move on from its replica like a request without an answer
        (``_transport_error``)."""
        if self._poll is not None:
            if unanswered and self._poll.endpoint == self._at:
                self._at = (self._at + 1) % self.replicas
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

    def _open(self, conn) -> None:
        """Connect ``conn`` (TCP, then TLS for https) within its ``timeout``; waits go to ``idle``."""
        scheme, host, port = self._endpoints[conn.endpoint]
        sock = dial(host, port, conn.timeout, self.idle)
        if scheme == "https":
            try:
                sock = handshake(self._ctx, sock, host)
            except BaseException:
                sock.close()
                raise
        conn.sock = sock

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
        scheme, host, port = self._endpoints[endpoint]
        if endpoint == self._at:
            self._at = (endpoint + 1) % len(self._endpoints)
        return no_answer(e, host, port, scheme, self._ctx)

    # -- doctor ------------------------------------------------------------------------------------
    def describe(self) -> WorkerInfo:
        """``GET /api/v3/cluster/workers/{workerId}`` on the current replica: what the control
        plane knows of this Worker. Read only on the control plane: no Session is opened and no
        Lease touched, so ``qlagent doctor`` may ask while the Worker runs. Raises ControlError
        (``ControlAuthError`` for a credential it does not take; ``status`` 404 from a control
        plane older than the route)."""
        answer = self._request("GET", "", b"")
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
        raise no_answer(e, host, port, scheme, ctx) from None
    finally:
        conn.close()


def _peer_certificate(host: str, port: int, ctx: ssl.SSLContext | None, verify: bool):
    """What ``host:port`` presents, for an error message only: with ``verify`` the decoded
    certificate (chain checked against ``ctx``'s CAs, the host name not), else its DER bytes;
    None when it cannot be had (no second connection is worth more than the first error)."""
    probe = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    probe.check_hostname = False
    try:
        if verify:
            probe.load_verify_locations(cadata=b"".join(ctx.get_ca_certs(binary_form=True)))
        else:
            probe.verify_mode = ssl.CERT_NONE
        with socket.create_connection((host, port), timeout=PROBE_TIMEOUT_S) as raw, \
                probe.wrap_socket(raw, server_hostname=host) as s:
            return s.getpeercert(binary_form=not verify)
    except (OSError, ssl.SSLError, ValueError, AttributeError):
        return None


def _der_validity(der: bytes) -> tuple[str, str] | None:
    """(notBefore, notAfter) of a DER certificate as ISO UTC strings, or None (a bare walk of
    TBSCertificate: version?, serial, signature, issuer, validity; no parser on a router)."""
    def tlv(i):
        tag, n = der[i], der[i + 1]
        i += 2
        if n & 0x80:
            k = n & 0x7F
            n, i = int.from_bytes(der[i:i + k], "big"), i + k
        return tag, i, i + n

    def when(tag, a, b):
        t = der[a:b].decode("ascii")
        if tag == 0x17:                                 # UTCTime YYMMDDHHMMSSZ
            t = ("19" if int(t[:2]) >= 50 else "20") + t
        return f"{t[:4]}-{t[4:6]}-{t[6:8]}T{t[8:10]}:{t[10:12]}:{t[12:14]}Z"
    try:
        _, i, _ = tlv(0)
        _, i, _ = tlv(i)                                # TBSCertificate
        if der[i] == 0xA0:
            i = tlv(i)[2]
        for _ in range(3):                              # serial, signature, issuer
            i = tlv(i)[2]
        _, i, _ = tlv(i)                                # validity
        t1, a1, b1 = tlv(i)
        t2, a2, b2 = tlv(b1)
        return when(t1, a1, b1), when(t2, a2, b2)
    except (IndexError, ValueError, UnicodeDecodeError):
        return None


def no_answer(e: BaseException, host: str, port: int, scheme: str = "https",
              ctx: ssl.SSLContext | None = None) -> ControlError:
    """The typed error for a request to ``host:port`` that got no answer; re-raises what is not
    an error. A refused certificate is ``ControlTlsError`` saying what is wrong: not signed by
    the CA in ``worker.ca_file``; signed by it but naming other hosts (its names, from a second
    handshake with ``ctx``'s CAs; field ``worker.control_url``); outside its dates (the dates
    and this host's clock; a clock before the build date is ``ControlUnreachable``
    ``clock_not_set`` instead). Anything else without an answer is ``ControlUnreachable``."""
    if isinstance(e, ssl.SSLCertVerificationError) and e.verify_code in (CERT_NOT_YET_VALID, CERT_HAS_EXPIRED) \
            and not clock_plausible():
        # Not a configuration error: this host's clock is wrong (no RTC, NTP not answered yet);
        # the same certificate will do once the clock is set.
        what = "not yet valid" if e.verify_code == CERT_NOT_YET_VALID else "expired"
        return ControlUnreachable(f"control plane {host}:{port}: certificate {what} by this host's clock "
                                  f"({_utc(time.time())}), which is before qlagent's build date "
                                  f"({_utc(build_date_s())}): the clock is not set", code=CLOCK_NOT_SET)
    if isinstance(e, ssl.SSLCertVerificationError) and e.verify_code in NAME_MISMATCH:
        cert = _peer_certificate(host, port, ctx, verify=True) if ctx is not None else None
        names = [f"{kind}:{value}" for kind, value in (cert or {}).get("subjectAltName", ())]
        return ControlTlsError(f"control plane {host}:{port}: certificate (signed by the pinned CA) does not name "
                               f"{host}; it names {', '.join(names) or 'other hosts'}: worker.control_url must use "
                               "one of those, or the replica needs a certificate naming it", field="worker.control_url")
    if isinstance(e, ssl.SSLCertVerificationError) and e.verify_code in (CERT_NOT_YET_VALID, CERT_HAS_EXPIRED):
        der = _peer_certificate(host, port, ctx, verify=False)
        dates = _der_validity(der) if der else None
        span = f"valid {dates[0]} .. {dates[1]}" if dates else "outside its validity"
        what = "not yet valid" if e.verify_code == CERT_NOT_YET_VALID else "expired"
        return ControlTlsError(f"control plane {host}:{port}: certificate {what} ({span}; this host's clock: "
                               f"{_utc(time.time())}): the replica needs a current certificate",
                               field="worker.control_url")
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
        if scheme == "http" and isinstance(e, (ConnectionResetError, http.client.RemoteDisconnected,
                                               http.client.BadStatusLine)):
            # A TLS listener resets a plain HTTP request: the likely cause is the URL's scheme.
            what += f"; if {host}:{port} serves TLS, worker.control_url must say https://"
        return ControlUnreachable(f"control plane {host}:{port}: {what}")
    if isinstance(e, Exception):
        return ControlUnreachable(f"control plane {host}:{port}: {type(e).__name__}")
    raise e
