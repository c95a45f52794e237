"""Tiny router: method + path template → ``fn(request, params) -> Response``.

Templates are literal segments and ``{name}`` segments, e.g.
``/api/v3/projects/{projectId}/tasks/{taskId}/runs``. A parameter matches one non-empty path
segment and is percent-decoded (so ``%2F`` never splits a segment). A parameter that is not
UTF-8, or a parameter or query value holding NUL (``%00``: no store takes it, PostgreSQL text
refuses it), is answered 400 before the route runs (see :func:`bad_parameter`). Unknown path → 404
``not_found``; known path, other method → 405 ``method_not_allowed`` with ``Allow``. ``HEAD``
falls back to the ``GET`` route (the server drops the body).

A route may raise any ``core.errors.QlError`` (store and contract errors): it is answered as
JSON ``err.to_dict()`` with :func:`status_for` (``Retry-After: 1`` on 503); an internal error
(exit code 1) answers a generic 500 and is logged, never echoed.
"""

from __future__ import annotations

import functools
import logging
import os
import urllib.parse
from typing import Callable

from qlagent.core.errors import QlError
from qlagent.http.wire import HttpError, Request, Response, json_error

log = logging.getLogger("qlagent.http")

# CLI exit code → HTTP status (docs/ARCHITECTURE.md conventions).
_STATUS_BY_EXIT = {2: 400, 3: 409, 4: 404, 5: 503}

RouteFn = Callable[[Request, dict[str, str]], Response]
# (where: "path" | "query", field, message) -> the error to answer (a QlError or an HttpError).
BadParamFn = Callable[[str, str, str], Exception]


def bad_parameter(where: str, field: str, message: str) -> Exception:
    """The default refusal of a malformed path parameter (400 ``bad_request``) or query value
    (400 ``bad_query``), naming it in ``field``."""
    return HttpError(400, "bad_request" if where == "path" else "bad_query", message, field=field)


class _Spec:
    """What a route takes besides its template: ``query`` the query keys (None: any, the route
    checks them itself), ``path_checks`` parameter name → ``fn(value) -> problem | None``."""
    __slots__ = ("bad", "query", "path_checks")

    def __init__(self, bad: BadParamFn, query: frozenset[str] | None, path_checks: dict) -> None:
        self.bad, self.query, self.path_checks = bad, query, path_checks


def _check_params(raw: dict[str, str], query: dict[str, str], spec: _Spec) -> dict[str, str]:
    """The percent-decoded path parameters; raises ``spec.bad(...)`` for one that is not UTF-8,
    holds NUL or fails the route's check of it, for a query key or value holding NUL, or for a
    query key the route does not take. Checked here, once for every route, so the SQLite agent
    and a PostgreSQL replica refuse alike before any store call (and before a body is read)."""
    bad = spec.bad
    params: dict[str, str] = {}
    for name, value in raw.items():
        try:
            params[name] = urllib.parse.unquote(value, errors="strict")
        except UnicodeDecodeError:
            raise bad("path", name, f"path parameter {name} is not UTF-8") from None
        if "\0" in params[name]:
            raise bad("path", name, f"path parameter {name} contains NUL (%00)")
        check = spec.path_checks.get(name)
        problem = check(params[name]) if check is not None else None
        if problem is not None:
            raise bad("path", name, f"path parameter {name} {problem}")
    for key, value in query.items():
        if "\0" in key:
            raise bad("query", "query", "a query parameter name contains NUL (%00)")
        if "\0" in value:
            raise bad("query", key, f"query parameter {key} contains NUL (%00)")
        if spec.query is not None and key not in spec.query:
            shown = key[:64]
            takes = ", ".join(sorted(spec.query)) or "none"
            raise bad("query", shown, f"unknown query parameter {shown!r} (this route takes: {takes})")
    return params


class _Route:
    __slots__ = ("template", "parts", "methods")

    def __init__(self, template: str) -> None:
        self.template = template
        self.parts = _split_template(template)
        self.methods: dict[str, tuple[RouteFn, _Spec]] = {}

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
    """Route table; an instance is the ``handler`` given to :class:`HttpServer`.
    ``on_error(name, err)`` hears every QlError a route raised before it is answered (``name``:
    the route function's ``__name__``)."""

    def __init__(self, on_error: Callable[[str, QlError], None] | None = None) -> None:
        self._routes: list[_Route] = []
        self._on_error = on_error

    def add(self, method: str, template: str, fn: RouteFn, bad_param: BadParamFn = bad_parameter, *,
            query: tuple[str, ...] | None = None, path_checks: dict | None = None) -> None:
        """Register ``fn`` for ``method`` on ``template``; ``bad_param`` builds the route's
        refusal of a malformed parameter (default :func:`bad_parameter`; a route with its own
        invalid-request code gives its own); ``query``: the only query keys it takes (None: the
        route checks them); ``path_checks``: parameter name → ``fn(value)`` returning why the
        value is refused (a phrase after the parameter's name) or None. Raises ValueError for a
        malformed template or a duplicate (method, template)."""
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
        route.methods[method] = (fn, _Spec(bad_param, None if query is None else frozenset(query),
                                           path_checks or {}))

    def routes(self) -> list[tuple[str, str]]:
        """Every registered (method, template), in registration order."""
        return [(m, r.template) for r in self._routes for m in r.methods]

    def __call__(self, request: Request) -> Response:
        segments = request.path.split("/")[1:]
        for route in self._routes:
            raw = route.match(segments)
            if raw is None:
                continue
            entry = route.methods.get(request.method)
            if entry is None and request.method == "HEAD":
                entry = route.methods.get("GET")
            if entry is None:
                allow = sorted(route.methods) + (["HEAD"] if "GET" in route.methods else [])
                return json_error(405, "method_not_allowed",
                                  f"{request.method} is not allowed on {route.template}",
                                  [("Allow", ", ".join(allow))])
            fn, spec = entry
            try:
                return fn(request, _check_params(raw, request.query, spec))
            except QlError as err:
                if self._on_error is not None:
                    self._on_error(fn.__name__, err)
                return error_response(err)
        return json_error(404, "not_found", f"no route for {request.path[:200]}")


def status_for(err: QlError) -> int:
    """HTTP status of a core error: its own ``status`` (TaskStartError) or by exit code —
    2→400, 3→409, 4→404, 5→503, anything else 500."""
    status = getattr(err, "status", None)
    return status if isinstance(status, int) else _STATUS_BY_EXIT.get(err.exit_code, 500)


def error_response(err: QlError) -> Response:
    """JSON answer for a core error (see :func:`status_for`); 500s carry no detail."""
    status = status_for(err)
    if status >= 500 and status != 503:
        log.error("route failed: %s (%s)", err.code, err)
        return json_error(500, "internal_error", "internal error")
    headers = [("Retry-After", "1")] if status == 503 else None
    return Response.json(status, err.to_dict(), headers)


@functools.cache
def openapi_document() -> bytes:
    """The OpenAPI 3.1 document shipped as package data (served at ``/api/v3/openapi.json``); a
    plain file next to this module, read with os (importlib.resources costs the agent ~1 MiB)."""
    with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "openapi.json"), "rb") as f:
        return f.read()

