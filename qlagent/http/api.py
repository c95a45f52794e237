"""Route functions of the local API (issue 5 §2–§7, ADR-0376): Task Start, reads, log reads,
cancel, health and the OpenAPI document.

Every store access goes through the single operation queue (``LocalStore.read``/``write``) and
the application services the CLI uses (``RunService``, ``request_cancel``), so HTTP and CLI share
one semantics. Route templates equal the OpenAPI document's paths
(``routing.documented_routes()``); :func:`build_router` registers exactly those.

Path ``projectId`` is the Project's name or ID. Authentication comes first (401), then the
Project: a token of another Project, or an unknown Project, answers 404 — never 403 — so a
foreign Project's existence is not revealed (issue 5 §2).
"""

from __future__ import annotations

import os
import sqlite3
from collections.abc import Callable

from qlagent.adapters.sqlite import definitions as defs
from qlagent.adapters.sqlite import migrations, policy
from qlagent.application.cancel import request_cancel
from qlagent.application.runs import MAX_LOG_READ, RunService
from qlagent.application.schedules import system_timezone, upcoming
from qlagent.application.store import LocalStore, now_us
from qlagent.core import taskstart as ts
from qlagent.core.errors import FenceRejected, NotFoundError, QlError, UnavailableError, ValidationError
from qlagent.core.models import Attempt, Run, RunEvent, TaskHead
from qlagent.core.schedule import next_fire, parse_schedule
from qlagent.http.auth import AuthError, Principal, authorize
from qlagent.http.routing import Router, openapi_document
from qlagent.http.server import (
    FileRange,
    HttpError,
    Request,
    Response,
    byte_range,
    content_range,
    query_int,
)

PREFIX = "/api/v3/projects/{projectId}"
RUN_PAGE_MAX = 100          # items per GET .../runs page (OpenAPI RunPage.maxItems)
RUN_PAGE_DEFAULT = 20
EVENT_PAGE_MAX = 100        # items per GET .../events page
EVENT_PAGE_DEFAULT = 50
LOG_READ_DEFAULT = 65_536   # bytes of a log read without limit or Range
NEXT_FIRES = 5              # merged upcoming fire instants on a Task read
RUN_STATES = ("queued", "starting", "running", "succeeded", "failed", "timed_out", "cancelled", "lost")
TERMINAL = frozenset({"succeeded", "failed", "timed_out", "cancelled", "lost"})


class StoreTokens:
    """:class:`qlagent.http.auth.TokenPort` over the local store (one queued read each)."""

    def __init__(self, store: LocalStore) -> None:
        self._store = store

    def lookup_token(self, digest: str) -> tuple[str, str] | None:
        """(project_id, subject) of a live token with this SHA-256 hex digest, else None."""
        return self._store.read(lambda c: policy.lookup_token(c, digest))

    def latest_binding(self, project_id: str, subject: str) -> tuple[str, int] | None:
        """(role, bindingVersion) of the subject's latest active RoleBinding, else None."""
        b = self._store.read(lambda c: policy.latest_binding(c, project_id, subject))
        return None if b is None else (b.role, b.binding_version)


def _time(us: int | None) -> str | None:
    return None if us is None else ts.rfc3339_from_us(us)


def _attempt_json(a: Attempt) -> dict:
    return {"attemptId": a.attempt_id, "attemptNo": a.attempt_no, "state": a.state,
            "executorType": a.executor_type, "exitCode": a.exit_code, "signal": a.exit_signal,
            "bytesKept": a.bytes_kept, "bytesDropped": a.bytes_dropped, "truncated": a.truncated,
            "failureReason": a.failure_reason, "startError": a.start_error,
            "orphansStopped": a.orphans_stopped, "startedAt": _time(a.started_at_us),
            "endedAt": _time(a.ended_at_us)}


def _run_json(r: Run, latest: Attempt | None = None, with_attempt: bool = False) -> dict:
    d = {"runId": r.run_id, "projectId": r.project_id, "taskId": r.task_id, "taskName": r.task_name,
         "state": r.state, "taskRevision": r.task_revision, "taskSnapshotRef": r.task_snapshot_ref,
         "executionOrigin": r.execution_origin, "executionOwner": r.execution_owner,
         "triggerType": r.trigger_type, "requestedBy": r.requested_by, "priority": r.priority,
         "version": r.version, "eventSequence": r.event_sequence, "cancelRequested": r.cancel_requested,
         "exitCode": r.exit_code, "signal": r.exit_signal, "scheduledFor": _time(r.scheduled_for_us),
         "createdAt": _time(r.created_at_us), "updatedAt": _time(r.updated_at_us),
         "endedAt": _time(r.ended_at_us)}
    if with_attempt:
        d["latestAttempt"] = None if latest is None else _attempt_json(latest)
    return d


def _event_json(e: RunEvent) -> dict:
    return {"eventId": e.event_id, "runId": e.run_id, "sequence": e.sequence, "type": e.type,
            "actor": e.actor, "createdAt": _time(e.created_at_us), "payload": e.payload}


def _head_json(h: TaskHead, now: int) -> dict:
    d = h.definition
    tz = d.timezone or system_timezone()
    schedules = []
    for line in d.schedules:
        nxt = next_fire(parse_schedule(line), now, tz) if h.enabled else None
        schedules.append({"cron": line, "timezone": tz, "nextFireAt": _time(nxt)})
    fires = upcoming(d, NEXT_FIRES, now) if h.enabled else []
    return {"projectId": h.project_id, "taskId": h.task_id, "name": h.name, "revision": h.revision,
            "contentDigest": h.content_digest, "taskSnapshotRef": ts.snapshot_ref(h.revision, h.content_digest),
            "enabled": h.enabled, "schedules": schedules, "nextFires": [_time(t) for t in fires],
            "updatedAt": _time(h.updated_at_us)}


def _bad_query(err: ValidationError) -> HttpError:
    return HttpError(400, "bad_query", err.message, field=err.field or "query")


class Api:
    """The route functions. ``store``: the agent's LocalStore; ``on_change()``: wake the service
    loop after a new Run or a cancellation intent so it dispatches / stops the tree at once;
    ``ready()``: extra readiness (False while draining)."""

    def __init__(self, store: LocalStore, on_change: Callable[[], None],
                 ready: Callable[[], bool] = lambda: True) -> None:
        self.store = store
        self.runs = RunService(store)
        self.tokens = StoreTokens(store)
        self.on_change = on_change
        self.ready = ready

    # ---- helpers -----------------------------------------------------------------------------
    def _principal(self, req: Request, project: str, permission: str):
        """Authenticate and authorize ``permission`` in the Project named (or identified) by
        ``project``. Returns (Principal, Project). AuthError 401/403/404."""
        try:
            proj = self.store.read(lambda c: policy.get_project(c, project))
        except NotFoundError:
            proj = None
        # An unknown Project still authenticates first: 401 beats 404 (nothing revealed).
        principal: Principal = authorize(req.headers, self.tokens,
                                         proj.project_id if proj else "\0" + project, permission)
        return principal, proj

    def _run(self, project_id: str, run_id: str) -> Run:
        return self.runs.get(run_id, project_id)

    # ---- Task Start (ADR-0376) ---------------------------------------------------------------
    def task_start(self, req: Request, p: dict[str, str]) -> Response:
        """POST .../tasks/{taskId}/runs → 202 accepted / 200 existing (TaskStartResult);
        400 invalid_task_start_request, 404 task_not_found, 409 task_start_fence_rejected
        (reason), 503 task_start_unavailable with Retry-After (ADR-0376 §3)."""
        try:
            principal, proj = self._principal(req, p["projectId"], "run.start")
        except AuthError as e:
            if e.status == 404:
                raise ts.TaskStartError.not_found() from None
            raise
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
        except (UnavailableError, sqlite3.Error):
            raise ts.TaskStartError.unavailable() from None
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
        head = self.store.read(lambda c: defs.get_head(c, proj.project_id, p["taskId"]))
        return Response.json(200, _head_json(head, now_us()))

    def list_runs(self, req: Request, p: dict[str, str]) -> Response:
        """GET .../runs?task=&state=&limit=&cursor=: keyset page, newest first (RunPage)."""
        _, proj = self._principal(req, p["projectId"], "run.read")
        limit = query_int(req, "limit", RUN_PAGE_DEFAULT, 1, RUN_PAGE_MAX)
        state = req.query.get("state")
        if state is not None and state not in RUN_STATES:
            raise HttpError(400, "bad_query", f"state must be one of {', '.join(RUN_STATES)}", field="state")
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
        return Response.json(200, {"items": [_run_json(r) for r in runs], "nextCursor": nxt})

    def get_run(self, req: Request, p: dict[str, str]) -> Response:
        """GET .../runs/{runId}: the Run with its latest Attempt."""
        _, proj = self._principal(req, p["projectId"], "run.read")
        run = self._run(proj.project_id, p["runId"])
        attempts = self.runs.attempts(run.run_id)
        return Response.json(200, _run_json(run, attempts[-1] if attempts else None, with_attempt=True))

    def list_events(self, req: Request, p: dict[str, str]) -> Response:
        """GET .../runs/{runId}/events?after=&limit=: RunEvents with sequence > after."""
        _, proj = self._principal(req, p["projectId"], "run.read")
        after = query_int(req, "after", 0, 0, ts.REVISION_MAX)
        limit = query_int(req, "limit", EVENT_PAGE_DEFAULT, 1, EVENT_PAGE_MAX)
        run = self._run(proj.project_id, p["runId"])
        events = [e for e in self.runs.events(run.run_id) if e.sequence > after]
        page = events[:limit]
        nxt = page[-1].sequence if len(events) > limit else None
        return Response.json(200, {"items": [_event_json(e) for e in page], "nextAfter": nxt})

    def read_log(self, req: Request, p: dict[str, str]) -> Response:
        """GET .../runs/{runId}/log?offset=&limit= (or ``Range``): raw bytes of the latest
        Attempt's log Artifact, at most 1 MiB, streamed from the file (FileRange). Headers:
        ``X-Qlagent-Log-Size`` (bytes in the file), ``X-Qlagent-Log-Truncated`` (true/false) and,
        when truncated, ``X-Qlagent-Truncation`` ``quota=N kept=N dropped=N|unknown`` (bytes)."""
        _, proj = self._principal(req, p["projectId"], "log.read")
        run = self._run(proj.project_id, p["runId"])
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
        headers = [("Content-Type", "application/octet-stream"), ("Accept-Ranges", "bytes"),
                   ("X-Qlagent-Log-Size", str(size)),
                   ("X-Qlagent-Log-Truncated", "true" if fact else "false")]
        if fact:
            dropped = fact["bytesDropped"]
            headers.append(("X-Qlagent-Truncation", f"quota={fact['quotaBytes']} kept={fact['bytesKept']} "
                            f"dropped={'unknown' if dropped is None else dropped}"))
        status = 200
        if partial:
            status = 206
            headers.append(("Content-Range", content_range(offset, length, size)))
        if fd < 0:
            return Response(status, headers, b"")
        return Response(status, headers, file=FileRange(fd, offset, length))

    # ---- cancel ------------------------------------------------------------------------------
    def cancel(self, req: Request, p: dict[str, str]) -> Response:
        """POST .../runs/{runId}/cancel (idempotent, run.cancel): 200 when the Run is terminal
        now (a queued Run is cancelled at once; an ended Run is left as it is), 202 when a live
        Run got the intent and the loop is stopping its process tree (CancelResult)."""
        principal, proj = self._principal(req, p["projectId"], "run.cancel")
        run = request_cancel(self.store, p["runId"], principal.subject, proj.project_id)
        if run.state in TERMINAL:
            return Response.json(200, {"runId": run.run_id, "state": run.state})
        self.on_change()
        return Response.json(202, {"runId": run.run_id, "state": run.state})

    # ---- health ------------------------------------------------------------------------------
    def healthz(self, req: Request, p: dict[str, str]) -> Response:
        """GET /healthz: 200 while the process answers."""
        return Response.json(200, {"status": "ok"})

    def readyz(self, req: Request, p: dict[str, str]) -> Response:
        """GET /readyz: 200 ``ready`` when the store answers and its capability is present and the
        agent is not draining; else 503 ``not_ready`` with the failing check."""
        checks = {"store": "ok", "capability": "ok", "service": "ok" if self.ready() else "draining"}
        try:
            self.store.read(migrations.check_capabilities)
        except UnavailableError as e:
            checks["capability"] = str(e)[:200]
        except (QlError, sqlite3.Error) as e:
            checks["store"] = str(e)[:200]
            checks["capability"] = "unknown"
        ok = all(v == "ok" for v in checks.values())
        return Response.json(200 if ok else 503, {"status": "ready" if ok else "not_ready", "checks": checks},
                             None if ok else [("Retry-After", "1")])

    def openapi(self, req: Request, p: dict[str, str]) -> Response:
        """GET /api/v3/openapi.json: the shipped OpenAPI 3.1 document."""
        return Response(200, [("Content-Type", "application/json")], openapi_document())


def build_router(api: Api) -> Router:
    """The Router serving exactly the documented routes (see ``routing.documented_routes``)."""
    r = Router()
    r.add("POST", PREFIX + "/tasks/{taskId}/runs", api.task_start)
    r.add("GET", PREFIX + "/tasks/{taskId}", api.get_task)
    r.add("GET", PREFIX + "/runs", api.list_runs)
    r.add("GET", PREFIX + "/runs/{runId}", api.get_run)
    r.add("GET", PREFIX + "/runs/{runId}/events", api.list_events)
    r.add("GET", PREFIX + "/runs/{runId}/log", api.read_log)
    r.add("POST", PREFIX + "/runs/{runId}/cancel", api.cancel)
    r.add("GET", "/healthz", api.healthz)
    r.add("GET", "/readyz", api.readyz)
    r.add("GET", "/api/v3/openapi.json", api.openapi)
    return r


def handler(router: Router) -> Callable[[Request], Response]:
    """Wrap ``router`` so a SQLite failure outside Task Start (locked, I/O) answers 503
    ``unavailable`` with Retry-After instead of a 500."""
    def handle(req: Request) -> Response:
        try:
            return router(req)
        except sqlite3.Error:
            return Response.json(503, {"code": "unavailable", "message": "store is busy; retry later"},
                                 [("Retry-After", "1")])
    return handle

