"""The optional HTTP surface of ``qlagent serve`` (issue 5 §1, ADR-0376 §4).

Imported by the service loop only when ``http.listen`` / ``http.unix_socket`` / ``serve
--listen`` is set, so a headless agent loads none of ``qlagent.http``. The server runs on the
loop thread; route functions reach the store through the same single operation queue as the
dispatcher (the store ports).
"""

from __future__ import annotations

import selectors
import time
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING

from qlagent.core.errors import ValidationError
from qlagent.http.api import Api, build_router
from qlagent.http.server import HttpLimits, HttpServer

if TYPE_CHECKING:   # ports are annotations only: no Protocol class at run time
    from qlagent.core.ports import Store

# Config overrides may only stay within these bounds (edge: never above the Profile's own
# 4 in flight / 512-byte body, ADR-0376 §4).
MAX_IN_FLIGHT = 64
MAX_BODY_BYTES = 65_536
MIN_BODY_BYTES = 256           # a Task Start body is ~200 bytes
READ_TIMEOUT_S = (0.5, 60.0)
PROBE_PATHS = frozenset({"/healthz", "/readyz"})   # answered without an in-flight slot (README "HTTP API")


def limits_for(settings) -> HttpLimits:
    """HttpLimits of the Profile with ``[http]`` ``max_in_flight`` (1..Profile value on edge,
    else ..64), ``max_body_bytes`` (256..Profile value on edge, else ..65536 bytes) and
    ``read_timeout_s`` (0.5..60 s) applied. Raises ValidationError naming the key and range."""
    profile = settings.profile
    limits = HttpLimits.for_profile(profile)
    cfg = settings.config.http
    if cfg is None:
        return limits
    edge = profile.name == "edge"
    top_flight = profile.http_in_flight if edge else MAX_IN_FLIGHT
    top_body = profile.http_body_bytes if edge else MAX_BODY_BYTES
    if cfg.max_in_flight is not None:
        if not 1 <= cfg.max_in_flight <= top_flight:
            raise ValidationError("http.max_in_flight", f"must be 1..{top_flight} on the {profile.name} profile",
                                  limit=top_flight)
        limits = replace(limits, max_in_flight=cfg.max_in_flight)
    if cfg.max_body_bytes is not None:
        if not MIN_BODY_BYTES <= cfg.max_body_bytes <= top_body:
            raise ValidationError("http.max_body_bytes",
                                  f"must be {MIN_BODY_BYTES}..{top_body} bytes on the {profile.name} profile",
                                  limit=top_body)
        limits = replace(limits, max_body_bytes=cfg.max_body_bytes)
    lo, hi = READ_TIMEOUT_S
    if not lo <= cfg.read_timeout_s <= hi:
        raise ValidationError("http.read_timeout_s", f"must be {lo}..{hi} seconds", limit=hi)
    return replace(limits, read_timeout_s=cfg.read_timeout_s)


class HttpSurface:
    """``HttpSurface(settings, store, on_change)``: the API server for the loop.

    ``on_change()`` pokes the loop (a new Run to dispatch, a cancellation to carry out).
    Drive it with ``listen_tcp``/``listen_unix``, ``register(selector)``, ``owns(key)`` +
    ``handle_event(key, mask)``, ``next_timeout_us(now_us)`` and ``tick(now_us)`` each turn,
    ``begin_drain()`` on SIGTERM and ``close()`` at exit. Raises ValidationError for an
    ``[http]`` override out of bounds (see :func:`limits_for`).
    """

    def __init__(self, settings, store: Store, on_change: Callable[[], None]) -> None:
        self.draining = False
        self.api = Api(store, on_change, ready=lambda: not self.draining)
        self.router = build_router(self.api)
        self.server = HttpServer(limits_for(settings), self.router, probe_paths=PROBE_PATHS)

    def listen_tcp(self, host: str, port: int) -> tuple[str, int]:
        """Bind HOST:PORT (port 0 picks a free one); returns the bound (host, port)."""
        return self.server.listen_tcp(host, port)

    def listen_unix(self, path: str) -> str:
        """Bind a unix stream socket at ``path`` (mode 0660); returns the path."""
        return self.server.listen_unix(path)

    def register(self, selector: selectors.BaseSelector) -> None:
        self.server.register(selector)

    def owns(self, key: selectors.SelectorKey) -> bool:
        return self.server.owns(key)

    def handle_event(self, key: selectors.SelectorKey, mask: int) -> None:
        self.server.handle_event(key, mask)

    def next_timeout_us(self, now_us: int) -> int | None:
        """The next connection deadline as wall-clock µs (the loop's clock), or None. The server
        keeps monotonic seconds; the difference is carried over so clock steps do not matter."""
        mono = time.monotonic()
        deadline = self.server.timeouts(mono)
        return None if deadline is None else now_us + max(0, int((deadline - mono) * 1e6))

    def tick(self, now_us: int) -> None:
        """Expire timed-out connections (408, idle close, stalled writes)."""
        self.server.timeouts(time.monotonic())

    @property
    def connections(self) -> int:
        """Open client connections."""
        return self.server.connections

    def begin_drain(self) -> None:
        """SIGTERM: stop accepting, finish requests in progress; /readyz answers 503."""
        self.draining = True
        self.server.begin_drain()

    def close(self) -> None:
        self.server.close()
