"""Deferred answers of the selectors HTTP server: a handler hands its answer to another thread,
the loop keeps serving other connections, resumes the parked one when the answer arrives (then
its pipelined requests in order), and answers 503 when the Deferred's bound passes first."""

from __future__ import annotations

import http.client
import socket
import threading
from dataclasses import replace

from httploop import LoopThread
from qlagent.http.routing import Router
from qlagent.http.server import Deferred, HttpServer
from qlagent.core.profiles import EDGE
from qlagent.http.wire import HttpError, HttpLimits, Response
from kit import wait_until


def _server(release: threading.Event):
    r = Router()

    def slow(req, p):
        d = Deferred(timeout_s=10)
        threading.Thread(target=lambda: (release.wait(10), d.resolve(Response.json(200, {"slow": True})))).start()
        return d

    def refused(req, p):
        d = Deferred(timeout_s=10)
        threading.Thread(target=lambda: d.resolve(HttpError(409, "late_conflict", "refused later"))).start()
        return d

    def never(req, p):
        return Deferred(timeout_s=0.5)

    r.add("GET", "/slow", slow)
    r.add("GET", "/refused", refused)
    r.add("GET", "/never", never)
    r.add("GET", "/fast", lambda req, p: Response.json(200, {"fast": True}))
    srv = HttpServer(replace(HttpLimits.for_profile(EDGE), read_timeout_s=2.0), r)
    _, port = srv.listen_tcp("127.0.0.1", 0)
    t = LoopThread(srv, 0.05)
    return srv, port, t


def test_a_parked_connection_does_not_block_the_loop_and_resumes_with_its_pipeline():
    release = threading.Event()
    srv, port, t = _server(release)
    try:
        slow = socket.create_connection(("127.0.0.1", port), timeout=5)
        # Two pipelined requests: the second waits for the first's deferred answer.
        slow.sendall(b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\nGET /fast HTTP/1.1\r\nHost: x\r\n\r\n")
        wait_until(lambda: srv.in_flight == 1, 5.0)
        other = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
        other.request("GET", "/fast")
        assert other.getresponse().read() == b'{"fast":true}'      # served while /slow is parked
        other.request("GET", "/refused")
        resp = other.getresponse()
        assert (resp.status, resp.read()) == (409, b'{"code":"late_conflict","message":"refused later"}')
        release.set()
        raw = b""
        while raw.count(b"HTTP/1.1 200 OK") < 2 or not raw.endswith(b'{"fast":true}'):
            chunk = slow.recv(65536)
            assert chunk, raw
            raw += chunk
        # Both answers, in request order, on the same connection.
        assert raw.index(b'{"slow":true}') < raw.index(b'{"fast":true}')
        # The client may read an answer before the loop thread books its end: poll, bounded.
        wait_until(lambda: srv.in_flight == 0, 5.0)
    finally:
        t.stop()


def test_a_deferred_past_its_bound_is_answered_503_and_its_slot_freed():
    srv, port, t = _server(threading.Event())
    try:
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
        c.request("GET", "/never")
        resp = c.getresponse()
        assert (resp.status, resp.getheader("Retry-After")) == (503, "1")
        resp.read()
        wait_until(lambda: srv.in_flight == 0, 5.0)
    finally:
        t.stop()
