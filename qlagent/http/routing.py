"""Tiny router: method + path template → ``fn(request, params) -> Response``.

Templates are literal segments and ``{name}`` segments, e.g.
``/api/v3/projects/{projectId}/tasks/{taskId}/runs``. A parameter matches one non-empty path
segment and is percent-decoded (so ``%2F`` never splits a segment). Unknown path → 404
``not_found``; known path, other method → 405 ``method_not_allowed`` with ``Allow``. ``HEAD``
falls back to the ``GET`` route (the server drops the body).
"""

from __future__ import annotations

import urllib.parse
from typing import Callable

from qlagent.http.server import Request, Response, json_error

RouteFn = Callable[[Request, dict[str, str]], Response]


class _Route:
    __slots__ = ("template", "parts", "methods")

    def __init__(self, template: str) -> None:
        self.template = template
        self.parts = _split_template(template)
        self.methods: dict[str, RouteFn] = {}

    def match(self, segments: list[str]) -> dict[str, str] | None:
        if len(segments) != len(self.parts):
            return None
        params: dict[str, str] = {}
        for (is_param, text), seg in zip(self.parts, segments):
            if is_param:
                if not seg:
                    return None
                params[text] = seg
            elif seg != text:
                return None
        return params


def _split_template(template: str) -> list[tuple[bool, str]]:
    if not template.startswith("/"):
        raise ValueError(f"route template must start with '/': {template!r}")
    parts: list[tuple[bool, str]] = []
    for seg in template.split("/")[1:]:
        if seg.startswith("{") and seg.endswith("}"):
            name = seg[1:-1]
            if not name.isidentifier():
                raise ValueError(f"bad parameter name {name!r} in {template!r}")
            parts.append((True, name))
        elif "{" in seg or "}" in seg:
            raise ValueError(f"a parameter must be a whole segment in {template!r}")
        else:
            parts.append((False, seg))
    return parts


class Router:
    """Route table; an instance is the ``handler`` given to :class:`HttpServer`."""

    def __init__(self) -> None:
        self._routes: list[_Route] = []

    def add(self, method: str, template: str, fn: RouteFn) -> None:
        """Register ``fn`` for ``method`` on ``template``. Raises ValueError for a malformed
        template or a duplicate (method, template)."""
        method = method.upper()
        route = next((r for r in self._routes if r.template == template), None)
        if route is None:
            route = _Route(template)
            for other in self._routes:
                if [p[0] or p[1] for p in other.parts] == [p[0] or p[1] for p in route.parts]:
                    raise ValueError(f"{template!r} overlaps {other.template!r}")
            self._routes.append(route)
        if method in route.methods:
            raise ValueError(f"{method} {template} is already registered")
        route.methods[method] = fn

    def routes(self) -> list[tuple[str, str]]:
        """Every registered (method, template), in registration order."""
        return [(m, r.template) for r in self._routes for m in r.methods]

    def __call__(self, request: Request) -> Response:
        segments = request.path.split("/")[1:]
        for route in self._routes:
            raw = route.match(segments)
            if raw is None:
                continue
            fn = route.methods.get(request.method)
            if fn is None and request.method == "HEAD":
                fn = route.methods.get("GET")
            if fn is None:
                allow = sorted(route.methods) + (["HEAD"] if "GET" in route.methods else [])
                return json_error(405, "method_not_allowed",
                                  f"{request.method} is not allowed on {route.template}",
                                  [("Allow", ", ".join(allow))])
            try:
                params = {k: urllib.parse.unquote(v, errors="strict") for k, v in raw.items()}
            except UnicodeDecodeError:
                return json_error(400, "bad_request", "path parameters must be UTF-8")
            return fn(request, params)
        return json_error(404, "not_found", f"no route for {request.path[:200]}")
