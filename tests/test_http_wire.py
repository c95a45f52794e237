"""``http.wire`` parses and frames HTTP/1.1 without a socket: bytes in, a Request or an
HttpError carrying its status out (the loop in ``http.server`` only feeds it what it received)."""

from __future__ import annotations

import pytest

from qlagent.core.profiles import EDGE
from qlagent.http.wire import HttpError, HttpLimits, Response, body_length, http_date, parse_head, response_head

LIM = HttpLimits.for_profile(EDGE)
HEAD = b"POST /api/v3/x?limit=5 HTTP/1.1\r\nHost: a\r\nContent-Length: 3\r\n\r\nabc"


def test_a_head_is_a_request_only_once_complete_and_its_body_stays_in_the_buffer():
    head = HEAD[:-3]
    for cut in range(len(head)):
        assert parse_head(bytearray(b"\r\n" + head[:cut]), LIM, "t") is None
    buf = bytearray(b"\r\n" + HEAD)
    req = parse_head(buf, LIM, "t")
    assert (req.method, req.path, req.query, req.headers["host"], req.peer) == (
        "POST", "/api/v3/x", {"limit": "5"}, "a", "t")
    assert body_length(req, LIM) == 3 and bytes(buf) == b"abc"


@pytest.mark.parametrize("raw,status", [
    (b"GET /" + b"a" * 9000 + b" HTTP/1.1\r\n", 414),
    (b"GET / HTTP/1.1\r\nHost: a\r\n" + b"X-A: b\r\n" * 200 + b"\r\n", 431),
    (b"GET / HTTP/1.1\r\n\r\n", 400),                      # HTTP/1.1 without Host
    (b"BREW / HTTP/1.1\r\nHost: a\r\n\r\n", 501),
    (b"GET / HTTP/2.0\r\nHost: a\r\n\r\n", 505),
])
def test_a_bad_head_is_an_http_error_with_its_status(raw, status):
    with pytest.raises(HttpError) as e:
        parse_head(bytearray(raw), LIM, "t")
    assert e.value.status == status


@pytest.mark.parametrize("headers,status", [
    (b"Transfer-Encoding: chunked\r\n", 411), (b"Transfer-Encoding: gzip\r\n", 501),
    (b"Content-Length: 1x\r\n", 400), (b"Content-Length: %d\r\n" % (LIM.max_body_bytes + 1), 413),
])
def test_body_framing_refusals_carry_their_status(headers, status):
    req = parse_head(bytearray(b"POST / HTTP/1.1\r\nHost: a\r\n" + headers + b"\r\n"), LIM, "t")
    with pytest.raises(HttpError) as e:
        body_length(req, LIM)
    assert e.value.status == status


def test_a_response_head_carries_length_date_and_connection_and_refuses_framing_headers():
    head = response_head(Response(200, [("X-A", "b")]), 5, False, http_date(0))
    assert head == (b"HTTP/1.1 200 OK\r\nX-A: b\r\nContent-Length: 5\r\nDate: Thu, 01 Jan 1970 00:00:00 GMT\r\n"
                    b"Connection: keep-alive\r\n\r\n")
    with pytest.raises(ValueError):
        response_head(Response(200, [("Content-Length", "9")]), 5, True, http_date(0))
