"""HTTP/1.1 messages without a socket (h11's shape): the server's limits, the request and
response records, the JSON error, and the parser and framer the loop in ``http.server`` drives.

``parse_head(buf, limits, peer)`` takes the bytes received so far and gives the Request once its
head is complete (None before), ``body_length`` its framing, ``response_head`` the bytes a
Response starts with; every refusal is an :class:`HttpError` carrying its status (RFC 9110/9112:
414, 431, 400, 411, 413, 501, 505). No I/O here: a test or another loop feeds it bytes.
"""

from __future__ import annotations

import re
import time
import urllib.parse
from dataclasses import dataclass, field

import msgspec

from qlagent.core.profiles import Profile

_REASONS = {
    100: "Continue", 200: "OK", 201: "Created", 202: "Accepted", 204: "No Content",
    206: "Partial Content", 304: "Not Modified", 400: "Bad Request", 401: "Unauthorized",
    403: "Forbidden", 404: "Not Found", 405: "Method Not Allowed", 408: "Request Timeout",
    409: "Conflict", 411: "Length Required", 413: "Content Too Large", 414: "URI Too Long",
    416: "Range Not Satisfiable", 422: "Unprocessable Content", 431: "Request Header Fields Too Large",
    500: "Internal Server Error", 501: "Not Implemented", 503: "Service Unavailable",
    505: "HTTP Version Not Supported",
}
_TOKEN = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_ORIGIN_FORM = re.compile(rb"/[\x21-\x7e]*")
# RFC 9112 §3.2.2 absolute-form: "http://authority/path?query" (the authority replaces Host).
_ABSOLUTE_FORM = re.compile(rb"[hH][tT][tT][pP][sS]?://([^/?#\x00-\x20\x7f-\xff]+)(/[\x21-\x7e]*)?")
# RFC 9110 §7.2 Host = uri-host [":" port]: reg-name (unreserved / pct-encoded / sub-delims),
# IPv4 or an [IPv6] literal. Empty is allowed only for a URI without authority (never ours).
_HOST = re.compile(r"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9\-._~%!$&'()*+,;=]+)(:[0-9]{0,5})?")
# RFC 9110 §9.1: a method the server does not recognise gets 501, a known one a route may lack 405.
_KNOWN_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "DELETE", "CONNECT", "OPTIONS", "TRACE", "PATCH"})
_CTL = re.compile(rb"[\x00-\x08\x0a-\x1f\x7f]")
# IMF-fixdate names spelled out: email.utils costs ~0.4 MiB RSS and strftime follows the locale.
_DAYS = ("Mon", "Tue", "Wed", "Thu", "Fri", "Sat", "Sun")
_MONTHS = ("Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec")
_FRAMING_HEADERS = frozenset({"content-length", "connection", "transfer-encoding", "date"})


@dataclass(frozen=True, slots=True)
class HttpLimits:
    """Bounds of one :class:`HttpServer`. Sizes in bytes, durations in seconds.

    ``max_in_flight``: requests between head parsed and response written (503 beyond).
    ``max_body_bytes``: request body bound (413 beyond). ``max_request_line_bytes`` (414),
    ``max_header_bytes`` / ``max_header_count`` (431), ``max_query_params`` (400).
    ``read_timeout_s``: whole request from its first byte (408); also how long a new connection
    (after its TLS handshake) may stay silent. ``handshake_timeout_s``: a TLS handshake from the
    accept (close). ``idle_timeout_s``: keep-alive
    idle before a silent close. ``write_timeout_s``: without send progress before abort.
    ``max_requests_per_connection``: keep-alive bound. ``max_connections``: open sockets.
    ``send_chunk_bytes``: largest single write of a file range.
    """

    max_in_flight: int
    max_body_bytes: int
    max_connections: int
    max_request_line_bytes: int = 8192
    max_header_bytes: int = 8192
    max_header_count: int = 32
    max_query_params: int = 16
    read_timeout_s: float = 5.0
    handshake_timeout_s: float = 3.0
    idle_timeout_s: float = 5.0
    write_timeout_s: float = 10.0
    max_requests_per_connection: int = 100
    send_chunk_bytes: int = 65536

    def __post_init__(self) -> None:
        for name in ("max_in_flight", "max_body_bytes", "max_connections", "max_request_line_bytes",
                     "max_header_bytes", "max_header_count", "max_query_params",
                     "max_requests_per_connection", "send_chunk_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"HttpLimits.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("read_timeout_s", "handshake_timeout_s", "idle_timeout_s", "write_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"HttpLimits.{name} must be > 0 seconds, got {getattr(self, name)}")

    @classmethod
    def for_profile(cls, profile: Profile) -> HttpLimits:
        """Limits of a core Profile: its ``http_in_flight`` and ``http_body_bytes`` (ADR-0376 §4),
        with connections and header bounds scaled to it (edge: 16 connections, 8 KiB / 32
        headers; other profiles: 64 connections, 16 KiB / 64 headers)."""
        if profile.name == "edge":
            return cls(max_in_flight=profile.http_in_flight, max_body_bytes=profile.http_body_bytes,
                       max_connections=16, max_requests_per_connection=32)
        return cls(max_in_flight=profile.http_in_flight, max_body_bytes=profile.http_body_bytes,
                   max_connections=64, max_header_bytes=16384, max_header_count=64,
                   max_query_params=32)


@dataclass(slots=True)
class Request:
    """One parsed request. ``path``: raw (still percent-encoded) path without the query;
    ``query``: decoded parameters (duplicates refused); ``headers``: lower-cased names, repeated
    fields joined with ``", "``; ``body``: exactly Content-Length bytes; ``peer``: ``host:port``
    or ``unix``."""

    method: str
    target: str
    path: str
    query: dict[str, str]
    headers: dict[str, str]
    body: bytes
    peer: str
    version: str = "HTTP/1.1"


@dataclass(slots=True)
class FileRange:
    """``length`` bytes of the open file ``fd`` from ``offset``, sent with ``os.sendfile`` in
    chunks of at most ``HttpLimits.send_chunk_bytes`` (``pread`` + ``send`` of such chunks when
    the file cannot be spliced). The server owns ``fd`` once the response
    is returned and closes it when the response ends (sent or aborted)."""

    fd: int
    offset: int
    length: int

    def __post_init__(self) -> None:
        if self.offset < 0 or self.length < 0:
            raise ValueError("FileRange offset and length must be >= 0")


@dataclass(slots=True)
class Response:
    """``status`` with ``headers`` (name, value) and either ``body`` bytes or a ``file`` range.
    The server adds Content-Length, Date and Connection; a handler that sets one of those (or
    Transfer-Encoding, or a header with CR/LF) gets a logged 500 instead."""

    status: int
    headers: list[tuple[str, str]] = field(default_factory=list)
    body: bytes = b""
    file: FileRange | None = None

    @classmethod
    def json(cls, status: int, payload: object, headers: list[tuple[str, str]] | None = None) -> Response:
        """JSON response; ``payload`` is anything msgspec encodes (Struct, dict, list, ...)."""
        hdrs = [("Content-Type", "application/json")]
        if headers:
            hdrs.extend(headers)
        return cls(status, hdrs, msgspec.json.encode(payload))


def json_error(status: int, code: str, message: str, headers: list[tuple[str, str]] | None = None,
               **extra: str) -> Response:
    """Error response with body ``{"code", "message", **extra}`` (the shape of every error)."""
    body: dict[str, str] = {"code": code, "message": message}
    body.update(extra)
    return Response.json(status, body, headers)


class HttpError(Exception):
    """Raise from a handler (or a helper it calls) to answer a JSON error: ``status``, stable
    ``code``, ``message`` naming the field and the limit, extra body members (e.g.
    ``field="limit"``) and extra ``headers``. The server turns it into :func:`json_error`."""

    def __init__(self, status: int, code: str, message: str,
                 headers: list[tuple[str, str]] | None = None, **extra: str) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.headers = headers
        self.extra = extra

    def response(self) -> Response:
        """The JSON error response for this error."""
        return json_error(self.status, self.code, self.message, self.headers, **self.extra)


def _decimal(text: str) -> bool:
    # str.isdigit() alone accepts "²" and other Unicode digits that int() then refuses.
    return text.isascii() and text.isdigit()


def tokens(value: str) -> set[str]:
    """A comma-separated token list (``Connection``, ``Transfer-Encoding``), lower-cased."""
    return {t.strip(" \t").lower() for t in value.split(",") if t.strip(" \t")}


def query_int(request: Request, name: str, default: int, minimum: int, maximum: int) -> int:
    """Integer query parameter ``name`` in ``minimum..maximum`` (``default`` when absent).
    Raises HttpError 400 ``bad_query`` naming the parameter and its range."""
    raw = request.query.get(name)
    if raw is None:
        return default
    if not _decimal(raw) or len(raw) > 19 or not minimum <= int(raw) <= maximum:
        raise HttpError(400, "bad_query", f"{name} must be an integer in {minimum}..{maximum}",
                        field=name)
    return int(raw)


def byte_range(request: Request, size: int, max_length: int) -> tuple[int, int, bool]:
    """The slice of a ``size``-byte file a read asks for, bounded by ``max_length`` bytes.

    ``Range: bytes=a-b`` / ``bytes=a-`` / ``bytes=-n`` (one range) wins over the ``offset`` /
    ``limit`` query parameters (defaults 0 and ``max_length``); a Range of another unit, a
    valid list of several ranges, or any Range with ``If-Range`` (no validators are ever sent, so it cannot match), is ignored.
    Returns ``(offset, length, partial)``; ``partial`` means answer 206 with
    :func:`content_range`. Raises HttpError 400 ``bad_query``/``bad_range`` for malformed input and 416 ``range_not_satisfiable`` (with
    ``Content-Range: bytes */size``) for a Range starting at or beyond ``size``. An offset at or
    beyond the end via the query gives length 0 (a tail reader polls that way).
    """
    header = request.headers.get("range")
    unit, _, spec = (header or "").partition("=")
    specs = [one.strip().partition("-") for one in spec.split(",")]
    for first, dash, last in specs:
        if not dash or not (first or last) or not (_decimal(first) or not first) \
                or not (_decimal(last) or not last):
            bad = True
            break
    else:
        bad = False
    # RFC 9110 §14.2: a Range with a unit we do not know is ignored, and so is a valid list of
    # several ranges (no multipart/byteranges here); §13.1.5: so is a Range under an If-Range,
    # which can never match since no validator (ETag, Last-Modified) is sent.
    if header is None or unit.strip().lower() != "bytes" or "if-range" in request.headers \
            or (len(specs) > 1 and not bad):
        offset = query_int(request, "offset", 0, 0, 2**62)
        limit = query_int(request, "limit", max_length, 1, max_length)
        start = min(offset, size)
        return start, min(limit, size - start), False
    if bad:
        raise HttpError(400, "bad_range", "Range must be bytes=a-b, bytes=a- or bytes=-n",
                        field="Range")
    first, _, last = specs[0]
    if first:
        start = int(first)
        end = min(int(last), size - 1) if last else size - 1
        if last and int(last) < start:
            raise HttpError(400, "bad_range", "Range end is before its start", field="Range")
    else:
        start, end = max(0, size - int(last)), size - 1
    if start >= size:
        raise HttpError(416, "range_not_satisfiable", f"Range starts beyond the {size} bytes",
                        [("Content-Range", f"bytes */{size}")])
    return start, min(end - start + 1, max_length), True


def content_range(offset: int, length: int, size: int) -> str:
    """``Content-Range`` value of a 206 answer: ``bytes a-b/size``."""
    return f"bytes {offset}-{offset + length - 1}/{size}"


def parse_head(buf: bytearray, limits: HttpLimits, peer: str) -> Request | None:
    """The request whose head starts ``buf`` (``peer``: ``host:port`` or ``unix``), or None
    while the head is incomplete. Empty lines before a request line are dropped (RFC 9112 §2.2);
    a complete head is removed from ``buf`` through its blank line, the body stays there and the
    Request's ``body`` is empty. Raises HttpError: 414 request line over
    ``max_request_line_bytes``; 431 header block over ``max_header_bytes`` or more than
    ``max_header_count`` fields; 400 malformed line, field, query, Host or authority (RFC 9112
    §3.2: HTTP/1.1 needs exactly one valid Host; an absolute-form target's authority replaces
    it); 501 unknown method; 505 a version other than HTTP/1.0 and HTTP/1.1."""
    while buf[:2] == b"\r\n":
        del buf[:2]
    if not buf:
        return None
    line_end = buf.find(b"\r\n", 0, limits.max_request_line_bytes + 2)
    if line_end < 0:
        if len(buf) > limits.max_request_line_bytes:
            raise HttpError(414, "request_line_too_long",
                            f"request line exceeds {limits.max_request_line_bytes} bytes")
        return None
    head_end = buf.find(b"\r\n\r\n", line_end)
    if head_end < 0:
        if len(buf) - line_end - 2 > limits.max_header_bytes:
            raise HttpError(431, "headers_too_large", f"header block exceeds {limits.max_header_bytes} bytes")
        return None
    if head_end - line_end > limits.max_header_bytes:
        raise HttpError(431, "headers_too_large", f"header block exceeds {limits.max_header_bytes} bytes")
    line = bytes(buf[:line_end])
    block = bytes(buf[line_end + 2: head_end + 2])
    del buf[: head_end + 4]
    req, authority = _request_line(line, peer, limits)
    req.headers = _headers(block, limits)
    _check_host(req, authority)
    return req


def body_length(req: Request, limits: HttpLimits) -> int:
    """The body's length in bytes, from ``Content-Length`` (0 without one). Raises HttpError:
    400 both Transfer-Encoding and Content-Length, or a Content-Length that is not a decimal
    integer; 411 a chunked body (Content-Length is required); 501 any other transfer coding
    (RFC 9112 §6.1); 413 over ``max_body_bytes``, before any body byte is read."""
    te = req.headers.get("transfer-encoding")
    cl = req.headers.get("content-length")
    if te is not None:
        if cl is not None:
            raise HttpError(400, "bad_request", "both Transfer-Encoding and Content-Length")
        if "chunked" in tokens(te):
            raise HttpError(411, "length_required", "chunked request bodies are not accepted; send Content-Length")
        raise HttpError(501, "not_implemented", "unsupported Transfer-Encoding; send Content-Length")
    length = 0
    if cl is not None:
        if not _decimal(cl) or len(cl) > 19:
            raise HttpError(400, "bad_request", "Content-Length must be a decimal integer")
        length = int(cl)
    if length > limits.max_body_bytes:
        raise HttpError(413, "body_too_large",
                        f"request body is {length} bytes; the limit is {limits.max_body_bytes} bytes")
    return length


def response_head(resp: Response, length: int, close: bool, date: str) -> bytes:
    """The status line and header block of ``resp`` with ``length`` body bytes: its headers,
    then ``Content-Length``, ``Date`` (``date``, see :func:`http_date`) and ``Connection``.
    Raises ValueError for a header with CR/LF or one the server sets (``_FRAMING_HEADERS``)."""
    reason = _REASONS.get(resp.status, "Unknown")
    lines = [f"HTTP/1.1 {resp.status} {reason}"]
    for name, value in resp.headers:
        if "\r" in name or "\n" in name or "\r" in value or "\n" in value:
            raise ValueError(f"CR/LF in response header {name!r}")
        if name.lower() in _FRAMING_HEADERS:
            raise ValueError(f"response header {name!r} is set by the server")
        lines.append(f"{name}: {value}")
    lines.append(f"Content-Length: {length}")
    lines.append(f"Date: {date}")
    lines.append("Connection: close" if close else "Connection: keep-alive")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def http_date(now: int) -> str:
    """``now`` (seconds since the epoch) as an IMF-fixdate (RFC 9110 §5.6.7)."""
    t = time.gmtime(now)
    return (f"{_DAYS[t.tm_wday]}, {t.tm_mday:02d} {_MONTHS[t.tm_mon - 1]} "
            f"{t.tm_year} {t.tm_hour:02d}:{t.tm_min:02d}:{t.tm_sec:02d} GMT")


def _request_line(line: bytes, peer: str, limits: HttpLimits) -> tuple[Request, str | None]:
    """The request (headers still empty) and an absolute-form target's authority or None."""
    parts = line.split(b" ")
    if len(parts) != 3 or not _TOKEN.fullmatch(parts[0]):
        raise HttpError(400, "bad_request", "malformed request line")
    method, target, version = parts
    if version not in (b"HTTP/1.1", b"HTTP/1.0"):
        if version.startswith(b"HTTP/") and len(version) == 8:
            raise HttpError(505, "http_version_not_supported", "only HTTP/1.0 and HTTP/1.1")
        raise HttpError(400, "bad_request", "malformed request line")
    authority = None
    absolute = _ABSOLUTE_FORM.fullmatch(target)
    if absolute:
        authority = absolute.group(1).decode("ascii")
        target = absolute.group(2) or b"/"
    if not _ORIGIN_FORM.fullmatch(target):
        raise HttpError(400, "bad_request", "request target must be an origin-form ASCII path")
    if method.decode("ascii") not in _KNOWN_METHODS:
        raise HttpError(501, "not_implemented", f"method {method.decode('ascii')[:32]} is not implemented")
    target_s = target.decode("ascii")
    path, _, query = target_s.partition("?")
    if "#" in target_s:
        raise HttpError(400, "bad_request", "request target must not carry a fragment")
    return Request(method.decode("ascii"), target_s, path, _query(query, limits), {}, b"",
                   peer, version.decode("ascii")), authority


def _query(query: str, limits: HttpLimits) -> dict[str, str]:
    if not query:
        return {}
    try:
        pairs = urllib.parse.parse_qsl(query, keep_blank_values=True, strict_parsing=True,
                                       errors="strict", max_num_fields=limits.max_query_params)
    except (ValueError, UnicodeDecodeError):
        raise HttpError(400, "bad_query", f"query must be key=value pairs of UTF-8, at most "
                                          f"{limits.max_query_params} parameters") from None
    out: dict[str, str] = {}
    for key, value in pairs:
        if key in out:
            raise HttpError(400, "bad_query", f"query parameter {key!r} appears more than once")
        out[key] = value
    return out


def _headers(block: bytes, limits: HttpLimits) -> dict[str, str]:
    lines = block.split(b"\r\n")[:-1] if block else []
    if len(lines) > limits.max_header_count:
        raise HttpError(431, "too_many_headers", f"more than {limits.max_header_count} header fields")
    headers: dict[str, str] = {}
    for raw in lines:
        name, sep, value = raw.partition(b":")
        if not sep or not _TOKEN.fullmatch(name):
            raise HttpError(400, "bad_request", "malformed header field")
        if _CTL.search(value):
            raise HttpError(400, "bad_request", "control character in a header value")
        text = value.strip(b" \t").decode("latin-1")
        key = name.decode("ascii").lower()
        if key in headers:
            if key == "content-length" and headers[key] != text:
                raise HttpError(400, "bad_request", "conflicting Content-Length fields")
            if key in ("content-length", "host", "authorization"):
                if key != "content-length":
                    raise HttpError(400, "bad_request", f"{key} appears more than once")
                continue
            headers[key] = headers[key] + ", " + text
        else:
            headers[key] = text
    return headers


def _check_host(req: Request, authority: str | None) -> None:
    if authority is not None:
        if not _HOST.fullmatch(authority):
            raise HttpError(400, "bad_request", "invalid authority in the request target")
        req.headers["host"] = authority
        return
    host = req.headers.get("host")
    if host is None:
        if req.version == "HTTP/1.1":
            raise HttpError(400, "bad_request", "HTTP/1.1 request without Host (RFC 9112 §3.2)")
        return
    if not _HOST.fullmatch(host):
        raise HttpError(400, "bad_request", "invalid Host header (RFC 9112 §3.2)")
