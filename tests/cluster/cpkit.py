"""A control-plane replica's Worker routes for tests: the real HttpServer on loopback (a
thread running its own selectors loop) over the cluster services on the module's PostgreSQL
database, optionally with TLS. The ``[cluster]`` serve role replaces it with ``qlagent serve``.
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import subprocess
from dataclasses import replace

from qlagent.adapters.postgres.join_tokens import PgJoinTokens
from qlagent.adapters.postgres.notify import PgCandidateSignal
from qlagent.cluster.joins import JoinTokens
from qlagent.cluster.logs import LogUpload
from qlagent.cluster.pull import WorkerPull
from qlagent.core.cluster import MAX_CHUNK_BYTES
from qlagent.core.dbclock import DatabaseClock
from qlagent.core.profiles import EDGE, STANDALONE
from httploop import LoopThread
from qlagent.http.routing import Router
from qlagent.http.server import HttpServer
from qlagent.http.wire import HttpLimits
from qlagent.http.worker_routes import WorkerRouteLimits, WorkerRoutes, WorkerServices

BASE = "/api/v3/cluster/workers"


class ControlPlane:
    """``ControlPlane(kit, pg_url)`` serving on 127.0.0.1 at ``.port``; ``tls`` = (cert, key)."""

    def __init__(self, kit, pg_url: str, *, tls: tuple[str, str] | None = None,
                 limits: WorkerRouteLimits = WorkerRouteLimits(), in_flight: int = 64,
                 read_timeout_s: float = 5.0) -> None:
        self.signal = PgCandidateSignal(pg_url)
        clock = DatabaseClock(kit.store.now_us)        # no replica loop here: anchored once
        assert clock.sync()
        services = WorkerServices(registry=kit.registry, acks=kit.acks, logs=LogUpload(kit.logs, EDGE),
                                  pull=WorkerPull(kit.store, kit.secrets, signal=self.signal),
                                  clock=clock, joins=JoinTokens(PgJoinTokens(kit.pool)))
        self.routes = WorkerRoutes(services, limits)
        router = Router()
        self.routes.register(router)
        http_limits = replace(HttpLimits.for_profile(STANDALONE), max_in_flight=in_flight, max_connections=in_flight + 16,
                              max_body_bytes=MAX_CHUNK_BYTES, read_timeout_s=read_timeout_s, idle_timeout_s=60.0,
                              max_requests_per_connection=100_000)
        self.server = HttpServer(http_limits, self.routes.handler(router), error_response=self.routes.error_response)
        acceptor = None
        if tls is not None:
            from qlagent.http.tls import TlsAcceptor
            acceptor = TlsAcceptor(*tls)
        _, self.port = self.server.listen_tcp("127.0.0.1", 0, backlog=128, tls=acceptor)
        self._loop = LoopThread(self.server, 0.2)

    def close(self) -> None:
        self._loop.stop()
        self.routes.close()
        self.signal.close()


class Client:
    """A Worker's view: one keep-alive connection; ``call`` returns (status, headers, body)."""

    def __init__(self, port: int, worker: dict | None = None, ssl_context=None, timeout: float = 40) -> None:
        if ssl_context is None:
            self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
        else:
            self.conn = http.client.HTTPSConnection("localhost", port, timeout=timeout, context=ssl_context)
        self.worker = worker

    def call(self, method: str, path: str, body=None, *, auth: str | None = None, headers: dict | None = None,
             raw: bytes | None = None, content_type: str = "application/json"):
        w = self.worker or {}
        hdrs = {"Content-Type": content_type}
        if auth is None and w:
            auth = f"Worker {w['credential']}"
        if auth:
            hdrs["Authorization"] = auth
        hdrs.update(headers or {})
        data = raw if raw is not None else (json.dumps(body).encode() if body is not None else b"")
        self.conn.request(method, path, body=data, headers=hdrs)
        r = self.conn.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()

    def post(self, route: str, body, worker_id: str | None = None, **kw):
        wid = worker_id or self.worker["worker_id"]
        status, headers, data = self.call("POST", f"{BASE}/{wid}/{route}", body, **kw)
        return status, headers, (json.loads(data) if data else None), data

    def close(self) -> None:
        self.conn.close()


class RawHttp:
    """A minimal keep-alive HTTP/1.1 client over one loopback socket, for many simulated Workers
    on a shared 2-core box: a prebuilt request, one ``sendall``, the answer read by its
    Content-Length (``http.client`` costs about 3× the CPU); a new connection after an answer
    with ``Connection: close``. ``post`` returns (status, body); OSError/ConnectionError when
    the replica is gone."""

    def __init__(self, port: int, timeout: float = 60) -> None:
        self.port, self.timeout = port, timeout
        self.sock = None
        self.buf = b""

    def post(self, path: str, headers: str, body: bytes) -> tuple[int, bytes]:
        if self.sock is None:
            self.sock = socket.create_connection(("127.0.0.1", self.port), timeout=self.timeout)
            self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.buf = b""
        self.sock.sendall(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                          f"{headers}Content-Length: {len(body)}\r\n\r\n".encode() + body)
        while b"\r\n\r\n" not in self.buf:
            self.buf += self._recv()
        head, _, rest = self.buf.partition(b"\r\n\r\n")
        length = int(head.lower().partition(b"content-length:")[2].split(b"\r\n", 1)[0])
        while len(rest) < length:
            rest += self._recv()
        self.buf = rest[length:]
        if b"\r\nconnection: close" in head.lower():
            self.close()
        return int(head[9:12]), rest[:length]

    def _recv(self) -> bytes:
        data = self.sock.recv(65536)
        if not data:
            raise ConnectionError("the replica closed the connection")
        return data

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None


def make_ca(directory: str, name: str) -> tuple[str, str, str]:
    """A throwaway CA and a server certificate for ``localhost``/127.0.0.1 signed by it, made
    with the openssl CLI at test time: (ca.pem, server cert, server key)."""
    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60)
    ca_key, ca = os.path.join(directory, f"{name}-ca.key"), os.path.join(directory, f"{name}-ca.pem")
    key, csr, cert = (os.path.join(directory, f"{name}-server.{ext}") for ext in ("key", "csr", "pem"))
    ext = os.path.join(directory, f"{name}.ext")
    run("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-days", "365",
        "-subj", f"/CN=qlagent test CA {name}", "-keyout", ca_key, "-out", ca)
    run("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-subj", "/CN=localhost",
        "-keyout", key, "-out", csr)
    with open(ext, "w") as f:
        f.write("subjectAltName=DNS:localhost,IP:127.0.0.1\nbasicConstraints=CA:FALSE\n"
                "keyUsage=digitalSignature\nextendedKeyUsage=serverAuth\n")
    run("x509", "-req", "-in", csr, "-CA", ca, "-CAkey", ca_key, "-CAcreateserial", "-days", "365",
        "-extfile", ext, "-out", cert)
    return ca, cert, key
