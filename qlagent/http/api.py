"""Route functions of the local API (issue 5 §2–§7, ADR-0376): Task Start, reads, log reads,
cancel, health and the OpenAPI document.

Every store access goes through the store ports (``core.ports.Store``) and the application
services the CLI uses (``RunService``, ``request_cancel``, the presenter), so HTTP and CLI share
one semantics and one JSON shape. Route templates equal the OpenAPI document's paths
(``routing.documented_routes()``); :func:`build_router` registers exactly those.

Path ``projectId`` is the Project's name or ID. Authentication comes first (401), then the
Project: a token of another Project, or an unknown Project, answers 404 — never 403 — so a
foreign Project's existence is not revealed (issue 5 §2).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING

from qlagent.application import presenter
from qlagent.application.cancel import request_cancel
from qlagent.application.runs import MAX_LOG_READ, RunService
from qlagent.core import taskstart as ts
from qlagent.core.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from qlagent.core.errors import FenceRejected, NotFoundError, QlError, UnavailableError, ValidationError
from qlagent.core.models import Run
from qlagent.core.names import task_ref_problem
from qlagent.core.states import RunState
from qlagent.http.auth import AuthError, Principal, bearer_digest, judge
from qlagent.http.routing import Router, openapi_document
from qlagent.http.wire import FileRange, HttpError, Request, Response, byte_range, content_range, query_int

if TYPE_CHECKING:   # ports are annotations only: no Protocol class at run time
    from qlagent.core.ports import Store

PREFIX = "/api/v3/projects/{projectId}"
RUN_PAGE_MAX = 100          # items per GET .../runs page (OpenAPI RunPage.maxItems)
RUN_PAGE_DEFAULT = 20
EVENT_PAGE_MAX = 100        # items per GET .../events page
EVENT_PAGE_DEFAULT = 50
LOG_READ_DEFAULT = 65_536   # bytes of a log read without limit or Range


def _bad_query(err: ValidationError) -> HttpError:
    return HttpError(400, "bad_query", err.message, field=err.field or "query")


def _log_answer(size: int, fact, offset: int, length: int, partial: bool) -> tuple[int, list[tuple[str, str]]]:
    """Status and headers of a log read: 200/206, ``X-Qlagent-Log-Size`` (bytes), the
    truncation headers and, for a partial read, ``Content-Range``."""
    headers = [("Content-Type", "application/octet-stream"), ("Accept-Ranges", "bytes"),
               ("X-Qlagent-Log-Size", str(size)),
               ("X-Qlagent-Log-Truncated", "true" if fact else "false")]
    if fact:
        dropped = fact.bytes_dropped
        headers.append(("X-Qlagent-Truncation", f"quota={fact.quota_bytes} kept={fact.bytes_kept} "
                        f"dropped={'unknown' if dropped is None else dropped}"))
        headers.append(("X-Qlagent-Truncation-Reason", fact.reason))
    if partial:
        headers.append(("Content-Range", content_range(offset, length, size)))
    return (206 if partial else 200), headers


class Api:
    """The route functions. ``store``: the agent's store (``core.ports.Store``); ``on_change()``: wake the service
    loop after a new Run or a cancellation intent so it dispatches / stops the tree at once;
    ``ready()``: extra readiness (False while draining); ``store_problem()``: why the store
    takes no writes or no Run may start for lack of room (the state file system full), else None;
    ``admission_problem()``: why queued Runs are held for their log Artifacts, else None;
    ``metrics()``: the Prometheus text of ``GET /metrics`` (None: metrics are off)."""

    def __init__(self, store: Store, on_change: Callable[[], None],
                 ready: Callable[[], bool] = lambda: True, log_chunks=None, clock=None,
                 store_problem: Callable[[], str | None] = lambda: None,
                 metrics: Callable[[], bytes] | None = None,
                 admission_problem: Callable[[], str | None] = lambda: None) -> None:
        self.store = store
        self.admission_problem = admission_problem
        self.metrics_text = metrics
        self.store_problem = store_problem
        self.runs = RunService(store)
        self.on_change = on_change
        self.ready = ready
        # On a control plane the logs are the chunks Workers uploaded to the authority
        # (``read_range(run_id, offset, limit) -> (bytes, size, TruncationFact | None)``).
        self.log_chunks = log_chunks
        # A control-plane replica's ``core.dbclock.DatabaseClock``: /readyz says how far off the
        # database's this host's clock is (it plans in the database's time either way).
        self.clock = clock

    # ---- helpers -----------------------------------------------------------------------------
    def _principal(self, req: Request, project: str, permission: str):
        """Authenticate and authorize ``permission`` in the Project named (or identified) by
        ``project``: the Project, the token and its binding read in one statement
        (``PolicyStore.admission``). Returns (Principal, Project). AuthError 401/403/404."""
        seen = self.store.admission(project, bearer_digest(req.headers, permission))
        proj = seen.project
        # An unknown Project still authenticates first: 401 beats 404 (nothing revealed).
        principal: Principal = judge(seen.token, seen.binding, proj.project_id if proj else "\0" + project,
                                     permission)
        return principal, proj

    def _run(self, project_id: str, run_id: str) -> Run:
        return self.runs.get(run_id, project_id)

    # ---- Task Start (ADR-0376) ---------------------------------------------------------------
    def task_start(self, req: Request, p: dict[str, str]) -> Response:
        """POST .../tasks/{taskId}/runs → 202 accepted / 200 existing (TaskStartResult);
        400 invalid_task_start_request, 404 task_not_found, 409 task_start_fence_rejected
        (reason), 503 task_start_unavailable with Retry-After (ADR-0376 §3), raised from the
        store's UnavailableError (its ``__cause__``: a replica counts it by code)."""
        try:
            principal, proj = self._principal(req, p["projectId"], "run.start")
        except AuthError as e:
            if e.status == 404:
                raise ts.TaskStartError.not_found() from None
            raise
        except UnavailableError as e:    # the store did not answer the principal's reads in time
            raise ts.TaskStartError.unavailable(e) from e
        body = ts.decode_task_start(req.body)   # read only after authentication (ADR-0376 §4)
        try:
            created = self.runs.start(
                p["taskId"], subject=principal.subject, mutation_id=body.mutationId,
                expected_revision=body.expectedRevision, expected_digest=body.expectedContentDigest,
                project=proj.project_id, admitted_project_version=proj.project_version,
                admitted_binding_version=principal.binding_version)
        except FenceRejected as e:
            raise ts.TaskStartError.fence_rejected(e.reason, e.message) from None
        except NotFoundError:
            raise ts.TaskStartError.not_found() from None
        except UnavailableError as e:
            raise ts.TaskStartError.unavailable(e) from e
        result = ts.TaskStartResult.build(
            outcome="existing" if created.existing else "accepted", run_id=created.run_id,
            attempt_id=created.attempt_id, event_ids=tuple(created.event_ids),
            task_revision=created.task_revision, content_digest=created.task_snapshot_ref.rsplit(":", 1)[1],
            state=created.state, created_at_us=created.created_at_us)
        if not created.existing:
            self.on_change()
        headers = [("Location", f"/api/v3/projects/{p['projectId']}/runs/{created.run_id}")]
        return Response.json(result.status, result, headers)

    # ---- reads -------------------------------------------------------------------------------
    def get_task(self, req: Request, p: dict[str, str]) -> Response:
        """GET .../tasks/{taskId}: the current head (revision, contentDigest = the Task Start
        fence, enabled, schedules with their next fire, merged ``nextFires``)."""
        _, proj = self._principal(req, p["projectId"], "task.read")
        head = self.store.get_head(proj.project_id, p["taskId"])
        return Response.json(200, presenter.task_head(head, self.store.now_us()))

    def list_runs(self, req: Request, p: dict[str, str]) -> Response:
        """GET .../runs?task=&state=&limit=&cursor=: keyset page, newest first (RunPage)."""
        _, proj = self._principal(req, p["projectId"], "run.read")
        limit = query_int(req, "limit", RUN_PAGE_DEFAULT, 1, RUN_PAGE_MAX)
        state = req.query.get("state")
        # ``dispatching`` exists on the cluster authority only: the store refuses it elsewhere.
        if state is not None and state not in RunState.ALL_CLUSTER:
            raise HttpError(400, "bad_query", f"state must be one of {', '.join(RunState.ALL_CLUSTER)}",
                            field="state")
        task = req.query.get("task")
        if task is not None and not 1 <= len(task) <= 128:
            raise HttpError(400, "bad_query", "task must be 1..128 characters", field="task")
        cursor = req.query.get("cursor")
        if cursor is not None and not 1 <= len(cursor) <= 256:
            raise HttpError(400, "bad_query", "cursor must be 1..256 characters", field="cursor")
        try:
            runs, nxt = self.runs.list(task=task, state=state, limit=limit, cursor=cursor,
                                       project_id=proj.project_id)
        except ValidationError as e:
            raise _bad_query(e) from None
        return Response.json(200, presenter.page([presenter.run(r) for r in runs], nxt, pages=True))

    def get_run(self, req: Request, p: dict[str, str]) -> Response:
        """GET .../runs/{runId}: the Run with its latest Attempt."""
        _, proj = self._principal(req, p["projectId"], "run.read")
        run = self._run(proj.project_id, p["runId"])
        attempts = self.runs.attempts(run.run_id)
        return Response.json(200, presenter.run(run, attempts[-1] if attempts else None, with_attempt=True))

    def list_events(self, req: Request, p: dict[str, str]) -> Response:
        """GET .../runs/{runId}/events?cursor=&limit=: RunEvents with sequence > cursor, a page
        like every list (RunEventPage); the cursor is the decimal sequence of the last event seen."""
        _, proj = self._principal(req, p["projectId"], "run.read")
        after = query_int(req, "cursor", 0, 0, ts.REVISION_MAX)
        limit = query_int(req, "limit", EVENT_PAGE_DEFAULT, 1, EVENT_PAGE_MAX)
        run = self._run(proj.project_id, p["runId"])
        events = [e for e in self.runs.events(run.run_id) if e.sequence > after]
        page = events[:limit]
        nxt = str(page[-1].sequence) if len(events) > limit else None
        return Response.json(200, presenter.page([presenter.event(e) for e in page], nxt, pages=True))

    def read_log(self, req: Request, p: dict[str, str]) -> Response:
        """GET .../runs/{runId}/log?offset=&limit= (or ``Range``): raw bytes of the latest
        Attempt's log Artifact, at most 1 MiB, streamed from the file (FileRange). Headers:
        ``X-Qlagent-Log-Size`` (bytes in the file), ``X-Qlagent-Log-Truncated`` (true/false) and,
        when truncated, ``X-Qlagent-Truncation`` ``quota=N kept=N dropped=N|unknown`` (bytes) and
        ``X-Qlagent-Truncation-Reason`` (``quota`` or ``write_error: ENOSPC (No space left on
        device)``: core.receipt.TruncationFact)."""
        _, proj = self._principal(req, p["projectId"], "log.read")
        run = self._run(proj.project_id, p["runId"])
        if self.log_chunks is not None:
            return self._read_chunks(req, run.run_id)
        path, fact = self.runs.log_source(run.run_id)
        fd = -1
        size = 0
        if path is not None:
            try:
                fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            except FileNotFoundError:
                raise HttpError(404, "log_not_found", "the log of this run was pruned by retention") from None
            size = os.fstat(fd).st_size
        try:
            cap = MAX_LOG_READ if ("range" in req.headers or "limit" in req.query) else LOG_READ_DEFAULT
            offset, length, partial = byte_range(req, size, cap)
        except HttpError:
            if fd >= 0:
                os.close(fd)
            raise
        status, headers = _log_answer(size, fact, offset, length, partial)
        if fd < 0:
            return Response(status, headers, b"")
        return Response(status, headers, file=FileRange(fd, offset, length))

    def _read_chunks(self, req: Request, run_id: str) -> Response:
        """``read_log`` on the cluster authority: the same answer over the log chunks the Worker
        uploaded (issue 10 §9, ``PgLogStore.read_range``). The size is read first, then the
        range: a log only grows, so the range never reaches past the size announced."""
        _, size, fact = self.log_chunks.read_range(run_id, 0, 0)
        cap = MAX_LOG_READ if ("range" in req.headers or "limit" in req.query) else LOG_READ_DEFAULT
        offset, length, partial = byte_range(req, size, cap)
        data = self.log_chunks.read_range(run_id, offset, length)[0] if length else b""
        status, headers = _log_answer(size, fact, offset, len(data), partial)
        return Response(status, headers, data)

    # ---- cancel ------------------------------------------------------------------------------
    def cancel(self, req: Request, p: dict[str, str]) -> Response:
        """POST .../runs/{runId}/cancel (idempotent, run.cancel): 200 when the Run is terminal
        now (a queued Run is cancelled at once; an ended Run is left as it is), 202 when a live
        Run got the intent and the loop is stopping its process tree (CancelResult); 400
        ``bad_request`` (field ``body``) for a request with a body, which the API takes none of."""
        principal, proj = self._principal(req, p["projectId"], "run.cancel")
        if req.body:
            raise HttpError(400, "bad_request", f"body: this request takes no body ({len(req.body)} bytes sent)",
                            field="body")
        run = request_cancel(self.store, p["runId"], principal.subject, proj.project_id)
        if run.state in RunState.TERMINAL:
            return Response.json(200, {"runId": run.run_id, "state": run.state})
        self.on_change()
        return Response.json(202, {"runId": run.run_id, "state": run.state})

    # ---- health ------------------------------------------------------------------------------
    def healthz(self, req: Request, p: dict[str, str]) -> Response:
        """GET /healthz: 200 while the process answers."""
        return Response.json(200, {"status": "ok"})

    def readyz(self, req: Request, p: dict[str, str]) -> Response:
        """GET /readyz: 200 ``ready`` when the store answers and takes writes, its capability is
        present, no queued Run is held for its log Artifact (``admission``: ``low_space (free N
        bytes, needs M) on PATH``…) and the agent is not draining; else 503 ``not_ready`` with
        the failing check. On a
        replica also ``clock``: ``{offsetS, boundS, skewed}``, this host's clock against the
        database's (informative: the replica plans in the database's time, so a skew does not fail it)."""
        problem = self.store_problem()
        held = self.admission_problem()
        checks = {"store": "ok" if problem is None else problem[:200], "capability": "ok",
                  "admission": "ok" if held is None else held[:200],
                  "service": "ok" if self.ready() else "draining"}
        try:
            self.store.capabilities()
        except UnavailableError as e:
            if e.code in ("store_busy", "store_unavailable"):
                checks["store"] = str(e)[:200]
                checks["capability"] = "unknown"
            else:
                checks["capability"] = str(e)[:200]
        except QlError as e:
            checks["store"] = str(e)[:200]
            checks["capability"] = "unknown"
        ok = all(v == "ok" for v in checks.values())
        body = {"status": "ready" if ok else "not_ready", "checks": checks}
        if self.clock is not None:
            body["clock"] = self.clock.report()
        return Response.json(200 if ok else 503, body, None if ok else [("Retry-After", "1")])

    def metrics(self, req: Request, p: dict[str, str]) -> Response:
        """GET /metrics: Prometheus text exposition 0.0.4, without a token (issue 26 §3); 404
        ``not_found`` unless ``[http] metrics = true``."""
        if self.metrics_text is None:
            raise HttpError(404, "not_found", "metrics are off ([http] metrics = true turns them on)")
        return Response(200, [("Content-Type", METRICS_CONTENT_TYPE)], self.metrics_text())

    def openapi(self, req: Request, p: dict[str, str]) -> Response:
        """GET /api/v3/openapi.json: the shipped OpenAPI 3.1 document."""
        return Response(200, [("Content-Type", "application/json")], openapi_document())


def build_router(api: Api, on_error: Callable[[str, QlError], None] | None = None) -> Router:
    """The Router serving exactly the documented routes (see ``routing.documented_routes``);
    ``on_error`` as :class:`Router`'s."""
    r = Router(on_error)
    task = {"taskId": task_ref_problem}
    # Task Start answers every malformed request with its own code (ADR-0376 §3).
    r.add("POST", PREFIX + "/tasks/{taskId}/runs", api.task_start,
          bad_param=lambda where, field, message: ts.TaskStartError.invalid(field, message), query=(),
          path_checks=task)
    r.add("GET", PREFIX + "/tasks/{taskId}", api.get_task, query=(), path_checks=task)
    r.add("GET", PREFIX + "/runs", api.list_runs, query=("task", "state", "limit", "cursor"))
    r.add("GET", PREFIX + "/runs/{runId}", api.get_run, query=())
    r.add("GET", PREFIX + "/runs/{runId}/events", api.list_events, query=("cursor", "limit"))
    r.add("GET", PREFIX + "/runs/{runId}/log", api.read_log, query=("offset", "limit"))
    r.add("POST", PREFIX + "/runs/{runId}/cancel", api.cancel, query=())
    r.add("GET", "/healthz", api.healthz)
    r.add("GET", "/readyz", api.readyz)
    r.add("GET", "/api/v3/openapi.json", api.openapi)
    r.add("GET", "/metrics", api.metrics)
    return r
