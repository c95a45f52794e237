"""The bounded HTTP server over real loopback/unix sockets (issue 5 §1, ADR-0376 §4 edge limits)."""

from __future__ import annotations

import contextlib
import hashlib
import http.client
import json
import os
import socket
import stat
import threading
import time
import uuid
from dataclasses import replace

import msgspec
import psutil
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from qlagent.core.errors import ValidationError
from qlagent.core.models import RoleBinding
from qlagent.core.tokens import new_token
from httploop import LoopThread
from kit import wait_until
from qlagent.http.routing import Router
from qlagent.http.server import HttpServer
from qlagent.core.profiles import EDGE, STANDALONE
from qlagent.http.wire import FileRange, HttpError, HttpLimits, Request, Response, byte_range, content_range
from qlagent.service.config import parse_listen

FILE_SIZE = 50 * 1024 * 1024


def _router(files: dict[str, str]) -> Router:
    r = Router()
    r.add("GET", "/hello", lambda req, p: Response.json(200, {"hello": "world"}))
    r.add("POST", "/echo", lambda req, p: Response.json(200, {"len": len(req.body), "body": req.body.decode(errors="replace")}))
    r.add("GET", "/items/{itemId}", lambda req, p: Response.json(200, {"itemId": p["itemId"], "q": req.query}))

    def boom(req: Request, p: dict[str, str]) -> Response:
        raise RuntimeError("secret-detail /etc/qlagent/key")

    def bad_header(req: Request, p: dict[str, str]) -> Response:
        return Response(200, [("X-Evil", "a\r\nSet-Cookie: x=1")], b"")

    def file_range(req: Request, p: dict[str, str]) -> Response:
        fd = os.open(files[req.query.get("name", "big")], os.O_RDONLY)
        return Response(200, [("Content-Type", "application/octet-stream")],
                        file=FileRange(fd, int(req.query["offset"]), int(req.query["length"])))

    def log_read(req: Request, p: dict[str, str]) -> Response:
        fd = os.open(files["log"], os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            offset, length, partial = byte_range(req, size, 1024)
        except HttpError:
            os.close(fd)
            raise
        headers = [("Content-Type", "application/octet-stream"), ("X-Qlagent-Log-Truncated", "true")]
        if partial:
            headers.append(("Content-Range", content_range(offset, length, size)))
        return Response(206 if partial else 200, headers, file=FileRange(fd, offset, length))

    r.add("GET", "/log", log_read)
    r.add("GET", "/raise", lambda req, p: (_ for _ in ()).throw(
        HttpError(409, "conflict_here", "explained", [("X-Why", "test")], field="f")))
    r.add("GET", "/boom", boom)
    r.add("GET", "/bad-header", bad_header)
    r.add("GET", "/framing-header", lambda req, p: Response(200, [("Content-Length", "1")], b"ab"))
    r.add("GET", "/file", file_range)
    return r


@contextlib.contextmanager
def running(limits: HttpLimits, files: dict[str, str] | None = None, unix_path: str | None = None):
    srv = HttpServer(limits, _router(files or {}))
    host, port = srv.listen_tcp("127.0.0.1", 0)
    if unix_path:
        srv.listen_unix(unix_path)
    t = LoopThread(srv, 0.05)
    try:
        yield srv, port
    finally:
        t.stop()
        assert not t.is_alive()


@pytest.fixture
def edge():
    limits = replace(HttpLimits.for_profile(EDGE), read_timeout_s=0.5)
    with running(limits) as (srv, port):
        yield srv, port


def connect(port: int) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    return s


def read_response(sock: socket.socket, method: str = "GET") -> http.client.HTTPResponse:
    resp = http.client.HTTPResponse(sock, method=method)
    resp.begin()
    resp.body = resp.read()  # type: ignore[attr-defined]
    return resp


def raw(port: int, data: bytes) -> http.client.HTTPResponse:
    with connect(port) as s:
        s.sendall(data)
        return read_response(s)


def assert_healthy(srv: HttpServer, port: int) -> None:
    """A fresh request succeeds and nothing stays counted in flight."""
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    c.request("GET", "/hello")
    r = c.getresponse()
    assert (r.status, json.loads(r.read())) == (200, {"hello": "world"})
    c.close()
    wait_until(lambda: srv.in_flight == 0, 5, "no request in flight", step=0.005)


def error_body(resp: http.client.HTTPResponse) -> dict:
    assert resp.getheader("Content-Type") == "application/json"
    body = json.loads(resp.body)  # type: ignore[attr-defined]
    assert set(body) >= {"code", "message"}
    return body


def test_fifth_concurrent_request_gets_503_with_retry_after_and_no_queue(edge):
    srv, port = edge
    held = []
    for i in range(4):  # four requests in flight: head parsed, body still arriving
        s = connect(port)
        s.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\n12345")
        held.append(s)
    wait_until(lambda: srv.in_flight == 4, 5, "four requests in flight", step=0.005)
    busy = raw(port, b"GET /hello HTTP/1.1\r\nHost: x\r\n\r\n")
    assert busy.status == 503
    assert busy.getheader("Retry-After") == "1"
    assert busy.getheader("Connection") == "close"
    assert error_body(busy)["code"] == "server_busy"
    assert "4" in error_body(busy)["message"]
    assert srv.in_flight == 4  # refused, not queued
    for s in held:  # the held requests still complete normally
        s.sendall(b"67890")
        r = read_response(s)
        assert r.status == 200 and json.loads(r.body) == {"len": 10, "body": "1234567890"}
        s.close()
    assert_healthy(srv, port)


def test_body_over_limit_gets_413_before_body_is_read(edge):
    srv, port = edge
    r = raw(port, b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 600\r\n\r\n" + b"a" * 600)
    assert r.status == 413
    body = error_body(r)
    assert body["code"] == "body_too_large" and "512" in body["message"] and "600" in body["message"]
    # Exactly at the limit is accepted.
    r = raw(port, b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 512\r\n\r\n" + b"b" * 512)
    assert r.status == 200 and json.loads(r.body)["len"] == 512
    assert_healthy(srv, port)


def test_chunked_body_is_refused_with_411(edge):
    srv, port = edge
    r = raw(port, b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n")
    assert r.status == 411 and error_body(r)["code"] == "length_required"
    r = raw(port, b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\nContent-Length: 5\r\n\r\nhello")
    assert r.status == 400
    assert_healthy(srv, port)


def test_too_many_or_too_large_headers_get_431(edge):
    srv, port = edge
    many = b"".join(b"X-H%d: v\r\n" % i for i in range(33))
    r = raw(port, b"GET /hello HTTP/1.1\r\nHost: x\r\n" + many + b"\r\n")
    assert r.status == 431 and "32" in error_body(r)["message"]
    ok = b"".join(b"X-H%d: v\r\n" % i for i in range(31))  # + Host = 32
    assert raw(port, b"GET /hello HTTP/1.1\r\nHost: x\r\n" + ok + b"\r\n").status == 200
    big = b"X-Big: " + b"v" * 9000 + b"\r\n"
    r = raw(port, b"GET /hello HTTP/1.1\r\nHost: x\r\n" + big + b"\r\n")
    assert r.status == 431 and "8192" in error_body(r)["message"]
    assert_healthy(srv, port)


def test_long_request_line_gets_414(edge):
    srv, port = edge
    r = raw(port, b"GET /hello?x=" + b"a" * 9000 + b" HTTP/1.1\r\nHost: x\r\n\r\n")
    assert r.status == 414 and error_body(r)["code"] == "request_line_too_long"
    assert_healthy(srv, port)


@pytest.mark.parametrize("line, status", [
    (b"GARBAGE", 400),
    (b"GET /hello", 400),
    (b"GET  /hello HTTP/1.1", 400),
    (b"GET hello HTTP/1.1", 400),
    (b"G(T /hello HTTP/1.1", 400),
    (b"GET /hel\xfflo HTTP/1.1", 400),
    (b"GET /hello HTTP/2.0", 505),
    (b"GET /hello?a=1&a=2 HTTP/1.1", 400),
    (b"GET /hello?%ff=1 HTTP/1.1", 400),
])
def test_malformed_request_line_gets_clean_4xx(edge, line, status):
    srv, port = edge
    r = raw(port, line + b"\r\nHost: x\r\n\r\n")
    assert r.status == status
    assert b"Traceback" not in r.body
    assert_healthy(srv, port)


def test_malformed_header_gets_400(edge):
    srv, port = edge
    for bad in (b"NoColon\r\n", b" folded: x\r\n", b"Bad Name: x\r\n", b"X: a\x01b\r\n",
                b"Content-Length: 1\r\nContent-Length: 2\r\n", b"Content-Length: -1\r\n",
                b"Content-Length: \xb2\r\n"):  # latin-1 superscript two: isdigit() but not int()
        r = raw(port, b"GET /hello HTTP/1.1\r\nHost: x\r\n" + bad + b"\r\n")
        assert r.status == 400, bad
    assert_healthy(srv, port)


def test_slow_client_gets_408_within_the_timeout(edge):
    srv, port = edge
    with connect(port) as s:
        t0 = time.monotonic()
        s.sendall(b"GET /hello HTTP/1.1\r\nHost: x\r\n")  # head never finished
        r = read_response(s)
        elapsed = time.monotonic() - t0
    assert r.status == 408 and error_body(r)["code"] == "request_timeout"
    assert elapsed < 0.5 + 1.5
    with connect(port) as s:  # trickling does not extend the deadline
        t0 = time.monotonic()
        s.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n")
        for _ in range(4):
            time.sleep(0.15)
            with contextlib.suppress(OSError):
                s.sendall(b"x")
        r = read_response(s)
        assert r.status == 408 and time.monotonic() - t0 < 2.0
    assert_healthy(srv, port)


def test_silent_connection_is_closed_without_response(edge):
    srv, port = edge
    with connect(port) as s:
        assert s.recv(100) == b""  # closed after read_timeout, no bytes at all
    assert_healthy(srv, port)


def test_handler_exception_and_bad_header_give_500_without_traceback(edge):
    srv, port = edge
    for path in ("/boom", "/bad-header", "/framing-header"):
        r = raw(port, b"GET " + path.encode() + b" HTTP/1.1\r\nHost: x\r\n\r\n")
        assert r.status == 500
        assert error_body(r) == {"code": "internal_error", "message": "internal error"}
        text = r.body + str(r.headers).encode()
        assert b"Traceback" not in text and b"secret-detail" not in text and b"Set-Cookie" not in text
    assert_healthy(srv, port)


def test_router_404_405_and_path_params(edge):
    srv, port = edge
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    c.request("GET", "/nope")
    r = c.getresponse()
    assert r.status == 404 and json.loads(r.read())["code"] == "not_found"
    c.request("DELETE", "/hello")
    r = c.getresponse()
    assert r.status == 405 and json.loads(r.read())["code"] == "method_not_allowed"
    assert r.getheader("Allow") == "GET, HEAD"
    c.request("GET", "/items/a%20b?x=1&y=")
    r = c.getresponse()
    assert json.loads(r.read()) == {"itemId": "a b", "q": {"x": "1", "y": ""}}
    c.request("HEAD", "/hello")
    r = c.getresponse()
    assert r.status == 200 and r.read() == b"" and int(r.getheader("Content-Length")) > 0
    c.close()


def test_keep_alive_reuses_one_connection_and_is_bounded():
    limits = replace(HttpLimits.for_profile(EDGE), max_requests_per_connection=3)
    with running(limits) as (srv, port):
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
        socks, conn_headers = [], []
        for i in range(3):
            c.request("POST", "/echo", body=b"n%d" % i)
            socks.append(c.sock)
            r = c.getresponse()
            assert json.loads(r.read())["body"] == "n%d" % i
            conn_headers.append(r.getheader("Connection"))
        assert socks[0] is socks[1] is socks[2] and socks[0] is not None
        assert conn_headers == ["keep-alive", "keep-alive", "close"]
        c.close()
        # Pipelined requests in one write are answered in order.
        with connect(port) as s:
            s.sendall(b"GET /items/1 HTTP/1.1\r\nHost: x\r\n\r\nGET /items/2 HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            data = b""
            while chunk := s.recv(65536):
                data += chunk
        first, second = data.split(b"HTTP/1.1 200 OK")[1:]
        assert b'"itemId":"1"' in first and b"keep-alive" in first
        assert b'"itemId":"2"' in second and b"Connection: close" in second
        assert_healthy(srv, port)


def test_deep_pipelining_is_answered_in_order_without_growing_the_stack():
    limits = replace(HttpLimits.for_profile(STANDALONE), max_requests_per_connection=2000)
    with running(limits) as (srv, port):
        with connect(port) as s:
            n = 1500  # far deeper than the recursion limit if each answer nested the next
            s.sendall(b"".join(b"GET /items/%d HTTP/1.1\r\nHost: x\r\n\r\n" % i for i in range(n - 1))
                      + b"GET /items/last HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            data = bytearray()
            while chunk := s.recv(1 << 16):
                data += chunk
        answers = bytes(data).split(b"HTTP/1.1 200 OK")[1:]
        assert len(answers) == n
        assert all(b'"itemId":"%d"' % i in a for i, a in enumerate(answers[:-1]))
        assert b'"itemId":"last"' in answers[-1]
        assert_healthy(srv, port)


def test_connection_limit_refuses_with_503():
    limits = replace(HttpLimits.for_profile(EDGE), max_connections=3, read_timeout_s=2.0)
    with running(limits) as (srv, port):
        idle = [connect(port) for _ in range(3)]
        for s in idle:          # each has a request in flight (its body pending): none can be dropped
            s.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n")
        wait_until(lambda: srv.in_flight >= 3, 5, "three requests in flight", step=0.005)
        time.sleep(0.1)
        r = raw(port, b"GET /hello HTTP/1.1\r\nHost: x\r\n\r\n")
        assert r.status == 503 and error_body(r)["code"] == "too_many_connections"
        assert r.getheader("Retry-After") == "1"
        for s in idle:
            s.close()
        wait_until(lambda: srv.connections == 0, 5, "every connection closed", step=0.005)
        assert_healthy(srv, port)


def test_connection_limit_evicts_the_oldest_connection_that_never_sent_a_request_first():
    limits = replace(HttpLimits.for_profile(EDGE), max_connections=3, read_timeout_s=2.0)
    with running(limits) as (srv, port):
        served = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
        served.request("GET", "/hello")
        assert served.getresponse().read()  # now an idle keep-alive: evicted only after the silent ones
        old, young = connect(port), None
        wait_until(lambda: srv.connections >= 2, 5, "the old silent connection accepted", step=0.005)
        young = connect(port)
        wait_until(lambda: srv.connections >= 3, 5, "the young silent connection accepted", step=0.005)
        assert raw(port, b"GET /hello HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").status == 200
        assert old.recv(10) == b""          # the oldest silent one made room ...
        served.request("GET", "/hello")     # ... not the served keep-alive, not the younger silent one
        assert served.getresponse().status == 200
        young.setblocking(False)
        with pytest.raises(BlockingIOError):
            young.recv(10)
        for s in (old, young, served):
            s.close()


def test_unix_socket_is_0660_and_serves(tmp_path):
    path = str(tmp_path / "api.sock")
    with running(HttpLimits.for_profile(EDGE), unix_path=path) as (srv, port):
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o660
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(5)
            s.connect(path)
            s.sendall(b"GET /items/u HTTP/1.1\r\nHost: x\r\n\r\n")
            r = read_response(s)
            assert r.status == 200 and json.loads(r.body)["itemId"] == "u"
    assert not os.path.exists(path)  # removed on close


def test_unix_socket_refuses_to_replace_a_regular_file(tmp_path):
    path = tmp_path / "not-a-socket"
    path.write_text("keep me")
    srv = HttpServer(HttpLimits.for_profile(EDGE), Router())
    with pytest.raises(FileExistsError, match="not a socket"):
        srv.listen_unix(str(path))
    assert path.read_text() == "keep me"
    srv.close()


def test_limits_validate_their_fields():
    with pytest.raises(ValueError, match="max_in_flight"):
        HttpLimits(max_in_flight=0, max_body_bytes=1, max_connections=1)
    with pytest.raises(ValueError, match="read_timeout_s"):
        HttpLimits(max_in_flight=1, max_body_bytes=1, max_connections=1, read_timeout_s=0)


def test_file_range_of_an_unspliceable_file_falls_back_to_bounded_copies():
    path = "/proc/self/limits"  # sendfile() answers EINVAL for it; pread() works
    with open(path, "rb") as f:
        content = f.read()
    limits = replace(HttpLimits.for_profile(EDGE), send_chunk_bytes=100)  # several chunks
    with running(limits, files={"proc": path}) as (srv, port):
        r = raw(port, b"GET /file?name=proc&offset=7&length=%d HTTP/1.1\r\nHost: x\r\n\r\n" % (len(content) - 10))
        assert r.status == 200 and r.body == content[7:-3]
        assert_healthy(srv, port)


def _sha256_file(path: str, offset: int, length: int) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        f.seek(offset)
        while length:
            chunk = f.read(min(length, 1 << 20))
            h.update(chunk)
            length -= len(chunk)
    return h.hexdigest()


def test_file_range_sends_exact_bytes_without_rss_growing_by_the_file(tmp_path):
    big = str(tmp_path / "big.log")
    block = os.urandom(1 << 20)
    with open(big, "wb") as f:
        for i in range(FILE_SIZE >> 20):
            f.write(bytes([i]) + block[1:])
    offset, length = 1_000_003, 48_000_000
    expected = _sha256_file(big, offset, length)
    proc = psutil.Process()
    with running(HttpLimits.for_profile(EDGE), files={"big": big}) as (srv, port):
        rss_before = proc.memory_info().rss
        with connect(port) as s:
            s.sendall(b"GET /file?offset=%d&length=%d HTTP/1.1\r\nHost: x\r\n\r\n" % (offset, length))
            resp = http.client.HTTPResponse(s, method="GET")
            resp.begin()
            assert resp.status == 200 and int(resp.getheader("Content-Length")) == length
            h, got, rss_peak = hashlib.sha256(), 0, rss_before
            while chunk := resp.read(1 << 16):
                h.update(chunk)
                got += len(chunk)
                if got % (1 << 20) < (1 << 16):  # sample the peak about once per MiB
                    rss_peak = max(rss_peak, proc.memory_info().rss)
        assert got == length and h.hexdigest() == expected
        # Generous: the 48 MB range must never have been held in memory, even briefly.
        assert rss_peak - rss_before < 16 * 1024 * 1024
        assert_healthy(srv, port)
        before_fds = len(os.listdir("/proc/self/fd"))
        # A client that disconnects mid-range does not leak the file descriptor.
        with connect(port) as s:
            s.sendall(b"GET /file?offset=0&length=%d HTTP/1.1\r\nHost: x\r\n\r\n" % FILE_SIZE)
            s.recv(1000)
        wait_until(lambda: srv.connections == 0 and len(os.listdir("/proc/self/fd")) <= before_fds, 5,
                   "the connection closed and its file descriptors released")
        assert_healthy(srv, port)


# -- bearer auth and the permission table over a real route (issue 5 §2) ------------------------

class DictTokens:
    """In-memory TokenPort with the store's semantics (the SQLite one is the lead's)."""

    def __init__(self) -> None:
        self.tokens: dict[str, tuple[str, str]] = {}
        self.bindings: dict[tuple[str, str], tuple[str, int]] = {}

    def lookup_token(self, digest: str) -> tuple[str, str] | None:
        return self.tokens.get(digest)

    def latest_binding(self, project_id: str, subject: str) -> RoleBinding | None:
        b = self.bindings.get((project_id, subject))
        return None if b is None else RoleBinding(project_id=project_id, subject=subject, role=b[0],
                                                  binding_version=b[1])


def test_bearer_auth_and_permissions_over_http():
    from qlagent.http import auth

    port_ = DictTokens()
    tokens = {}
    for subject, role in [("ops", "operator"), ("eve", "viewer"), ("own", "owner"), ("gone", None)]:
        tok = new_token()
        assert tok.startswith("qlt_") and len(tok) == 47 and auth.parse_bearer(f"Bearer {tok}") == tok
        port_.tokens[auth.token_digest(tok)] = ("p1", subject)
        if role:
            port_.bindings[("p1", subject)] = (role, 3)
        tokens[subject] = tok
    other = new_token()
    port_.tokens[auth.token_digest(other)] = ("p2", "ops")
    assert auth.token_digest(tokens["ops"]) == hashlib.sha256(tokens["ops"].encode()).hexdigest()

    def guarded(permission):
        def fn(req, p):  # AuthError propagates: the server answers it as JSON
            who = auth.authorize(req.headers, port_, p["projectId"], permission)
            return Response.json(200, {"subject": who.subject, "role": who.role, "v": who.binding_version})
        return fn

    router = Router()
    router.add("POST", "/api/v3/projects/{projectId}/tasks/{taskId}/runs", guarded("run.start"))
    router.add("GET", "/api/v3/projects/{projectId}/tasks/{taskId}", guarded("task.read"))
    srv = HttpServer(HttpLimits.for_profile(EDGE), router)
    _, port = srv.listen_tcp("127.0.0.1", 0)
    t = LoopThread(srv, 0.05)
    try:
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=5)

        def call(method, project, token=None, scheme="Bearer"):
            hdrs = {"Authorization": f"{scheme} {token}"} if token else {}
            path = f"/api/v3/projects/{project}/tasks/t1" + ("/runs" if method == "POST" else "")
            c.request(method, path, body=b"{}" if method == "POST" else None, headers=hdrs)
            r = c.getresponse()
            return r.status, json.loads(r.read()), r.getheader("WWW-Authenticate")

        assert call("POST", "p1", tokens["ops"])[:2] == (200, {"subject": "ops", "role": "operator", "v": 3})
        assert call("POST", "p1", tokens["own"])[0] == 200
        status, body, www = call("POST", "p1")
        assert (status, body["code"], www) == (401, "unauthorized", "Bearer")
        assert call("POST", "p1", tokens["ops"], scheme="Basic")[0] == 401
        assert call("POST", "p1", "qlt_" + "x" * 43)[0] == 401  # well-formed, unknown
        assert call("POST", "p1", tokens["ops"] + "x")[0] == 401  # malformed
        assert call("POST", "p1", tokens["eve"])[:2][0] == 403  # viewer cannot start
        assert call("GET", "p1", tokens["eve"])[0] == 200  # but can read
        assert call("GET", "p1", tokens["gone"])[1]["code"] == "permission_denied"  # no binding
        assert call("GET", "p1", other)[:2][1]["code"] == "not_found"  # other Project: 404
        assert call("GET", "p1", other)[0] == 404
        del port_.tokens[auth.token_digest(tokens["ops"])]  # revoked
        assert call("POST", "p1", tokens["ops"])[0] == 401
        c.close()
    finally:
        t.stop()
    assert {p: auth.allowed("viewer", p) for p in auth.PERMISSIONS} == {
        "run.start": False, "run.cancel": False, "task.read": True, "run.read": True, "log.read": True}
    assert all(auth.allowed(r, p) for r in ("owner", "admin", "operator") for p in auth.PERMISSIONS)


def test_fd_exhaustion_pauses_accept_instead_of_spinning_and_recovers(caplog):
    import resource

    limits = replace(HttpLimits.for_profile(EDGE), read_timeout_s=5.0)
    with running(limits) as (srv, port):
        c0 = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
        c0.request("GET", "/hello")
        assert c0.getresponse().read()
        spare = [socket.socket() for _ in range(3)]  # client fds exist before the cap
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) - 1, hard))
        try:
            for s in spare:
                s.settimeout(5)
                s.connect(("127.0.0.1", port))  # completes in the kernel backlog
                s.sendall(b"GET /hello HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            time.sleep(0.3)  # the window in which a spinning accept would storm the log
            storms = [r for r in caplog.records if "accept failed" in r.getMessage()]
            assert 1 <= len(storms) <= 2  # paused for 0.5 s, not retried in a busy loop
            c0.request("GET", "/hello")  # open connections are still served
            assert c0.getresponse().status == 200
        finally:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        for s in spare:  # every backlogged client is answered once fds are back
            assert read_response(s).status == 200
            s.close()
        c0.close()
        assert_healthy(srv, port)


def test_log_style_reads_offset_limit_range_and_raw_bytes(tmp_path):
    log = tmp_path / "run.log"
    content = bytes(range(256)) * 10 + b"\xff\xfe not utf-8"  # 2572 bytes
    log.write_bytes(content)
    with running(HttpLimits.for_profile(EDGE), files={"log": str(log)}) as (srv, port):
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=5)

        def get(path, headers=None):
            c.request("GET", path, headers=headers or {})
            r = c.getresponse()
            return r.status, r.read(), r

        status, body, r = get("/log")
        assert status == 200 and body == content[:1024]  # bounded by the 1024-byte limit
        assert r.getheader("X-Qlagent-Log-Truncated") == "true"
        assert get("/log?offset=2560&limit=100")[1] == content[2560:]  # raw, non-UTF-8 intact
        assert get("/log?offset=9999")[:2] == (200, b"")  # past the end: empty, not an error
        status, body, r = get("/log", {"Range": "bytes=10-19"})
        assert (status, body, r.getheader("Content-Range")) == (206, content[10:20], "bytes 10-19/2572")
        status, body, r = get("/log", {"Range": "bytes=-5"})
        assert (status, body, r.getheader("Content-Range")) == (206, content[-5:], "bytes 2567-2571/2572")
        assert get("/log", {"Range": "bytes=2000-"})[1] == content[2000:]
        status, body, r = get("/log", {"Range": "bytes=5000-"})
        assert status == 416 and r.getheader("Content-Range") == "bytes */2572"
        assert json.loads(body)["code"] == "range_not_satisfiable"
        # RFC 9110 §14.2: a valid list of ranges may be ignored (full page), not refused
        for many in ("bytes=0-1,5-6", "bytes=0-1, 3-4", "bytes=-1,0-0"):
            status, body, r = get("/log", {"Range": many})
            assert (status, body, r.getheader("Content-Range")) == (200, content[:1024], None), many
        for bad in ("bytes=5-1", "bytes=0-1,x", "bytes=x-", "bytes=-", "bytes=\u00b2-"):
            status, body, _ = get("/log", {"Range": bad})
            assert status == 400 and json.loads(body)["field"] == "Range", bad
        for q in ("limit=0", "limit=1025", "offset=-1", "offset=x", "limit=%C2%B2"):
            status, body, _ = get("/log?" + q)
            assert status == 400 and json.loads(body)["field"] == q.split("=")[0], q
        status, body, r = get("/raise")
        assert status == 409 and r.getheader("X-Why") == "test"
        assert json.loads(body) == {"code": "conflict_here", "message": "explained", "field": "f"}
        c.close()
        assert_healthy(srv, port)


@pytest.mark.parametrize("text, expected", [
    ("127.0.0.1:8717", ("127.0.0.1", 8717)), ("[::1]:80", ("::1", 80)), ("host:65535", ("host", 65535)),
    ("127.0.0.1:0", ("127.0.0.1", 0)),
])
def test_parse_listen_accepts(text, expected):
    assert parse_listen(text) == expected


@pytest.mark.parametrize("text", ["127.0.0.1", ":80", "h:65536", "h:-1", "h:8x", "", "h:\u00b2", "h:080000"])
def test_parse_listen_rejects_naming_the_key(text):
    with pytest.raises(ValidationError, match=r"http.listen: .* is not HOST:PORT with port 0..65535"):
        parse_listen(text)


# -- fuzz: whatever arrives, the answer is a clean status and the server bug log stays empty -----


_request_line = st.one_of(
    st.sampled_from([b"GET /hello HTTP/1.1", b"POST /echo HTTP/1.1", b"GET /items/%ff HTTP/1.1",
                     b"HEAD /hello HTTP/1.0", b"GET /items/x?a=1&b HTTP/1.1", b"\x00\xff", b""]),
    st.builds(lambda method, target: method + b" " + target + b" HTTP/1.1",
              st.sampled_from([b"GET", b"POST", b"HEAD", b"PUT"]),
              st.one_of(st.binary(max_size=20), st.text(max_size=20).map(lambda t: b"/" + t.encode()))),
    st.binary(max_size=40),
)
_header = st.one_of(
    st.sampled_from([b"Content-Length: 3", b"Content-Length: 99999", b"Transfer-Encoding: chunked",
                     b"Connection: close", b"Expect: 100-continue", b"Host: x", b" folded", b"\x00: \xff"]),
    st.builds(lambda name, value: name + b": " + value,
              st.sampled_from([b"Content-Length", b"Transfer-Encoding", b"Connection", b"Expect",
                               b"Range", b"Host", b"X-A"]),
              st.one_of(st.binary(max_size=12), st.text(max_size=12).map(str.encode))),
    st.binary(max_size=30),
)
_request = st.builds(lambda line, headers, body: line + b"\r\n" + b"".join(h + b"\r\n" for h in headers)
                     + b"\r\n" + body,
                     _request_line, st.lists(_header, max_size=8), st.binary(max_size=16))


@pytest.fixture(scope="module")
def fuzz_server():
    limits = replace(HttpLimits.for_profile(EDGE), read_timeout_s=0.5)
    with running(limits) as (srv, port):
        yield srv, port


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(_request, min_size=1, max_size=3))
def test_fuzzed_requests_get_clean_answers(fuzz_server, caplog, requests):
    srv, port = fuzz_server
    caplog.clear()
    with connect(port) as s:
        s.sendall(b"".join(requests))
        s.shutdown(socket.SHUT_WR)
        data = bytearray()
        with contextlib.suppress(ConnectionResetError):
            while chunk := s.recv(65536):
                data += chunk
    statuses = [int(part[:3]) for part in bytes(data).split(b"HTTP/1.1 ")[1:] if part[:3].isdigit()]
    assert all(st_ in (100, 200, 400, 404, 405, 408, 411, 413, 414, 431, 501, 505) for st_ in statuses), statuses
    assert b"Traceback" not in data
    assert not [r for r in caplog.records if r.levelname == "ERROR"]
    wait_until(lambda: srv.in_flight == 0, 5, "no request in flight", step=0.002)


def test_driven_by_a_foreign_selectors_loop_next_to_other_fds():
    """The agent's own loop: one selector, an HTTP listener plus unrelated fds (here a pipe)."""
    import selectors

    srv = HttpServer(replace(HttpLimits.for_profile(EDGE), read_timeout_s=0.3), _router({}))
    _, port = srv.listen_tcp("127.0.0.1", 0)
    sel = selectors.DefaultSelector()
    r_fd, w_fd = os.pipe()
    sel.register(r_fd, selectors.EVENT_READ, "agent-pipe")
    srv.register(sel)
    results: dict[str, object] = {}

    def client():
        with connect(port) as s:
            s.sendall(b"GET /items/loop HTTP/1.1\r\nHost: x\r\n\r\n")
            results["ok"] = read_response(s).status
        with connect(port) as s:  # a slow client, expired only through timeouts()
            s.sendall(b"GET /hello HTTP/1.1\r\nHost: x\r\n")
            results["slow"] = read_response(s).status
        os.write(w_fd, b"done")

    t = threading.Thread(target=client)
    t.start()
    foreign = []
    try:
        while not foreign:
            deadline = srv.timeouts(time.monotonic())
            timeout = 1.0 if deadline is None else max(0.0, deadline - time.monotonic())
            for key, mask in sel.select(timeout):
                if srv.owns(key):
                    srv.handle_event(key, mask)
                else:
                    foreign.append((key.data, os.read(r_fd, 10)))
    finally:
        t.join(5)
        srv.close()
        sel.close()
        os.close(r_fd)
        os.close(w_fd)
    assert results == {"ok": 200, "slow": 408}
    assert foreign == [("agent-pipe", b"done")]


def test_begin_drain_finishes_in_flight_requests_and_refuses_new_ones():
    import selectors

    srv = HttpServer(HttpLimits.for_profile(EDGE), _router({}))
    _, port = srv.listen_tcp("127.0.0.1", 0)
    sel = selectors.DefaultSelector()
    srv.register(sel)

    def drive(until):
        deadline = time.monotonic() + 5
        while not until() and time.monotonic() < deadline:
            srv.timeouts(time.monotonic())
            for key, mask in sel.select(0.05):
                srv.handle_event(key, mask)
        assert until()

    idle = connect(port)
    idle.sendall(b"GET /hello HTTP/1.1\r\nHost: x\r\n\r\n")
    busy = connect(port)
    busy.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\n\r\nab")
    import select

    drive(lambda: srv.in_flight == 1 and select.select([idle], [], [], 0)[0])
    assert read_response(idle).status == 200
    srv.begin_drain()
    assert idle.recv(10) == b""  # idle keep-alive closed at once
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=1)
    busy.sendall(b"cd")
    result = {}
    def reader():
        result["r"] = read_response(busy)
        busy.close()  # so the server's lingering close ends at once

    t = threading.Thread(target=reader)
    t.start()
    drive(lambda: srv.connections == 0)
    t.join(5)
    r = result["r"]
    assert r.status == 200 and r.getheader("Connection") == "close"
    assert json.loads(r.body) == {"len": 4, "body": "abcd"}
    srv.close()
    sel.close()
    idle.close()


# -- the Task Start wire contract carried over the real server (ADR-0376 §1/§3) ------------------

def test_task_start_wire_errors_and_replay_over_http():
    from qlagent.core import errors, taskstart as ts
    from test_http_api import documented_routes

    created: dict[str, ts.TaskStartResult] = {}

    def start(req: Request, p: dict[str, str]) -> Response:
        body = ts.decode_task_start(req.body)
        if p["taskId"] == "missing":
            raise ts.TaskStartError.not_found()
        if p["taskId"] == "disabled":
            raise errors.FenceRejected("task_disabled", "task start rejected: task_disabled")
        if p["taskId"] == "down":
            raise ts.TaskStartError.unavailable()
        if p["taskId"] == "broken":
            raise errors.QlError("sqlite said something private")
        prior = created.get(body.mutationId)
        if prior is not None:
            if prior.taskRevision != body.expectedRevision:
                raise ts.TaskStartError.fence_rejected("mutation_conflict")
            return Response.json(200, msgspec.structs.replace(prior, outcome="existing"))
        res = ts.TaskStartResult.build(
            outcome="accepted", run_id=str(uuid.uuid4()), attempt_id=str(uuid.uuid4()),
            event_ids=(str(uuid.uuid4()), str(uuid.uuid4())), task_revision=body.expectedRevision,
            content_digest=body.expectedContentDigest, state="queued", created_at_us=1_786_528_800_000_000)
        created[body.mutationId] = res
        return Response.json(res.status, res)

    router = Router()
    for method, template in sorted(documented_routes()):  # the documented table registers cleanly
        router.add(method, template, start if method == "POST" and template.endswith("/runs")
                   else (lambda req, p: Response.json(200, {})))
    assert set(router.routes()) == documented_routes()
    srv = HttpServer(HttpLimits.for_profile(EDGE), router)
    _, port = srv.listen_tcp("127.0.0.1", 0)
    t = LoopThread(srv, 0.05)
    mid = str(uuid.uuid4())
    good = {"schema": ts.SCHEMA, "mutationId": mid, "expectedRevision": 3, "expectedContentDigest": "c" * 64}
    try:
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=5)

        def post(task, doc=None, raw_body=None):
            payload = raw_body if raw_body is not None else json.dumps(doc or good).encode()
            c.request("POST", f"/api/v3/projects/p1/tasks/{task}/runs", body=payload,
                      headers={"Content-Type": "application/json"})
            r = c.getresponse()
            return r.status, json.loads(r.read()), r

        status, first, _ = post("t1")
        assert status == 202 and first["outcome"] == "accepted" and first["taskSnapshotRef"] == "qltd:v1:3:" + "c" * 64
        status, again, _ = post("t1")
        assert status == 200 and again == dict(first, outcome="existing")  # same persisted identities
        status, body, _ = post("t1", dict(good, expectedRevision=4))
        assert (status, body["code"], body["reason"]) == (409, "task_start_fence_rejected", "mutation_conflict")
        status, body, _ = post("t1", dict(good, mutationId=mid.upper()))
        assert (status, body["code"], body["field"]) == (400, "invalid_task_start_request", "mutationId")
        status, body, _ = post("t1", dict(good, runId=mid))
        assert (status, body["field"]) == (400, "runId")
        status, body, _ = post("t1", dict(good, expectedContentDigest="C" * 64))
        assert (status, body["field"]) == (400, "expectedContentDigest")
        status, body, _ = post("t1", raw_body=b'{"schema":"' + b"x" * 580 + b'"}')  # 600 bytes
        assert (status, body["code"]) == (413, "body_too_large")
        status, body, _ = post("missing")
        assert (status, body["code"]) == (404, "task_not_found")
        status, body, _ = post("disabled")
        assert (status, body["code"], body["reason"]) == (409, "task_start_fence_rejected", "task_disabled")
        status, body, r = post("down")
        assert (status, body["code"], r.getheader("Retry-After")) == (503, "task_start_unavailable", "1")
        status, body, _ = post("broken")
        assert (status, body) == (500, {"code": "internal_error", "message": "internal error"})
        assert len(created) == 1  # nothing else was "written"
        c.close()
    finally:
        t.stop()


def test_router_refuses_bad_or_ambiguous_templates():
    r = Router()
    r.add("GET", "/a/{x}/b", lambda req, p: Response(204))
    for method, template, match in [
        ("GET", "a/b", "must start with '/'"),
        ("GET", "/a/{1x}", "bad parameter name"),
        ("GET", "/a/x{y}", "whole segment"),
        ("GET", "/a/{y}/b", "overlaps"),
        ("get", "/a/{x}/b", "already registered"),
    ]:
        with pytest.raises(ValueError, match=match):
            r.add(method, template, lambda req, p: Response(204))
    r.add("POST", "/a/{x}/b", lambda req, p: Response(204))
    assert r.routes() == [("GET", "/a/{x}/b"), ("POST", "/a/{x}/b")]


def test_refusal_audit_writes_at_most_its_lines_a_window_and_then_says_how_many_it_left_out():
    from qlagent.http.wire import Request, Response, json_error
    from qlagent.http.service import AUDIT_LINES, AUDIT_WINDOW_S, RefusalAudit
    lines, now = [], [100.0]
    audit = RefusalAudit(lambda priority, event, **fields: lines.append((priority, event, fields)),
                         clock=lambda: now[0])
    req = Request("GET", "/api/v3/x", "/api/v3/x", {}, {"authorization": "Bearer qlt_secret"}, b"", "10.0.0.9:5555")
    audit(req, Response.json(200, {}))                       # not a refusal: nothing
    for _ in range(AUDIT_LINES + 5):
        audit(req, json_error(401, "unauthorized", "unknown or revoked token"))
    assert len(lines) == AUDIT_LINES
    assert lines[0] == ("warning", "http.refused", {"peer": "10.0.0.9:5555", "method": "GET", "route": "/api/v3/x",
                                                    "status": 401, "reason": "unauthorized", "suppressed": None})
    now[0] += AUDIT_WINDOW_S
    audit(req, Response.json(403, {"error": "worker_mismatch", "field": None, "message": "…"}))
    assert lines[-1][2]["suppressed"] == 5 and lines[-1][2]["reason"] == "worker_mismatch"
    assert "qlt_secret" not in repr(lines)
