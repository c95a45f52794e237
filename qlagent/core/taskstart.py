"""Task Start wire contract (ADR-0376 §1, §3): request shape, canonical values, result and errors.

Pure: no I/O. The HTTP route decodes the request body with :func:`decode_task_start`, the store
runs the transaction (ADR-0376 §2) and answers with a :class:`TaskStartResult` or raises a
:class:`TaskStartError`; both serialise to the JSON bodies the OpenAPI document describes.
"""

from __future__ import annotations

import datetime as _dt
import json
import re
from typing import Literal

import msgspec

from qlagent.core.canonical import idempotency_key, snapshot_ref  # noqa: F401  (part of the wire contract)
from qlagent.core.errors import QlError
from qlagent.core.limits import DIGEST_HEX_LEN, REVISION_MAX, REVISION_MIN  # noqa: F401

SCHEMA = "qinglong/task-start@v1"

# ADR-0376 §1: "小写 canonical UUID" — 8-4-4-4-12 lowercase hex, nothing else.
_UUID_RE = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
_DIGEST_RE = re.compile(r"[0-9a-f]{64}")

INVALID_REQUEST = "invalid_task_start_request"
TASK_NOT_FOUND = "task_not_found"
FENCE_REJECTED = "task_start_fence_rejected"
UNAVAILABLE = "task_start_unavailable"

FenceReason = Literal[
    "authorization_changed",
    "definition_changed",
    "task_disabled",
    "task_not_executable",
    "mutation_conflict",
]
FENCE_REASONS: frozenset[str] = frozenset(FenceReason.__args__)  # type: ignore[attr-defined]

# CLI exit codes from docs/ARCHITECTURE.md: 2 bad input, 3 conflict, 4 not found, 5 unavailable.
_EXIT_CODES = {400: 2, 404: 4, 409: 3, 503: 5}


class TaskStartRequest(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """Body of ``POST /api/v3/projects/{projectId}/tasks/{taskId}/runs`` (ADR-0376 §1).

    Exactly four fields; the caller supplies fences only, never identities, time, command,
    environment, placement or SecretRefs.
    """

    schema: str
    mutationId: str
    expectedRevision: int
    expectedContentDigest: str


class TaskStartError(QlError):
    """A Task Start failure with its HTTP status and stable code (ADR-0376 §3).

    Attributes: ``status`` (400/404/409/503), ``code`` (one of the four codes), ``field`` (the
    request field at fault, 400 only), ``reason`` (409 only, one of :data:`FENCE_REASONS`),
    ``message`` (human text naming the field and the limit), ``exit_code`` (CLI convention).
    """

    def __init__(
        self,
        status: int,
        code: str,
        message: str,
        *,
        field: str | None = None,
        reason: str | None = None,
    ) -> None:
        super().__init__(message, field=field, code=code)
        self.status = status
        self.reason = reason
        self.exit_code = _EXIT_CODES.get(status, 1)

    def to_dict(self) -> dict[str, object]:
        """The JSON error body: ``{"code", "message"}`` plus ``field`` / ``reason`` when set."""
        body: dict[str, object] = {"code": self.code, "message": self.message}
        if self.field is not None:
            body["field"] = self.field
        if self.reason is not None:
            body["reason"] = self.reason
        return body

    @classmethod
    def invalid(cls, field: str | None, message: str) -> TaskStartError:
        """400 ``invalid_task_start_request`` naming ``field`` (None: the body as a whole)."""
        return cls(400, INVALID_REQUEST, message, field=field)

    @classmethod
    def not_found(cls) -> TaskStartError:
        """404 ``task_not_found``: no such Task, or it belongs to another Project."""
        return cls(404, TASK_NOT_FOUND, "task not found in this project")

    @classmethod
    def fence_rejected(cls, reason: str, message: str | None = None) -> TaskStartError:
        """409 ``task_start_fence_rejected`` with ``reason`` from :data:`FENCE_REASONS`.

        Raises ValueError for any other reason, so a typo cannot reach the wire.
        """
        if reason not in FENCE_REASONS:
            raise ValueError(f"unknown fence reason {reason!r}")
        return cls(409, FENCE_REJECTED, message or f"task start rejected: {reason}", reason=reason)

    @classmethod
    def unavailable(cls, cause: QlError | None = None) -> TaskStartError:
        """503 ``task_start_unavailable``: store, clock or execution revision cannot be trusted;
        the message names ``cause`` (its code and line, as the read routes answer it) when given."""
        why = f" ({cause.code}: {cause})" if cause is not None else ""
        return cls(503, UNAVAILABLE, f"task start is unavailable{why}; retry later")


def _check_values(doc: dict[str, object]) -> None:
    """Field rules in declaration order; ``doc`` holds exactly the four fields."""
    if doc["schema"] != SCHEMA:
        raise TaskStartError.invalid("schema", f"schema must be exactly {SCHEMA!r}")
    mid = doc["mutationId"]
    if not isinstance(mid, str) or not _UUID_RE.fullmatch(mid):
        raise TaskStartError.invalid(
            "mutationId",
            "mutationId must be a lowercase canonical UUID "
            "(8-4-4-4-12 lowercase hex digits, no braces)",
        )
    rev = doc["expectedRevision"]
    if type(rev) is not int:  # bool is an int subclass; JSON true must not pass
        raise TaskStartError.invalid(
            "expectedRevision",
            f"expectedRevision must be a JSON integer (int), got {type(rev).__name__}",
        )
    if not REVISION_MIN <= rev <= REVISION_MAX:
        raise TaskStartError.invalid(
            "expectedRevision",
            f"expectedRevision must be an integer in {REVISION_MIN}..{REVISION_MAX}",
        )
    digest = doc["expectedContentDigest"]
    if not isinstance(digest, str) or not _DIGEST_RE.fullmatch(digest):
        raise TaskStartError.invalid(
            "expectedContentDigest",
            f"expectedContentDigest must be exactly {DIGEST_HEX_LEN} lowercase hex characters",
        )


def _object_pairs(pairs: list[tuple[str, object]]) -> dict[str, object]:
    seen: dict[str, object] = {}
    for key, value in pairs:
        if key in seen:
            raise TaskStartError.invalid(key[:64], f"field {key[:64]!r} appears more than once")
        seen[key] = value
    return seen


def _diagnose(body: bytes) -> TaskStartError:
    """Name the offending field of a body msgspec refused (its message quotes names
    ambiguously, so the document is re-read field by field)."""
    try:
        doc = json.loads(body, object_pairs_hook=_object_pairs)
    except TaskStartError as exc:
        return exc
    except (ValueError, RecursionError) as exc:
        return TaskStartError.invalid(None, f"body is not valid UTF-8 JSON: {exc}")
    if not isinstance(doc, dict):
        return TaskStartError.invalid(None, "body must be a JSON object")
    fields = TaskStartRequest.__struct_fields__
    for key in doc:
        if key not in fields:
            return TaskStartError.invalid(
                key[:64], f"unknown field {key[:64]!r}; allowed fields are {', '.join(fields)}"
            )
    for key in fields:
        if key not in doc:
            return TaskStartError.invalid(key, f"missing required field {key!r}")
    for key in ("schema", "mutationId", "expectedContentDigest"):
        if not isinstance(doc[key], str):
            return TaskStartError.invalid(key, f"{key} must be a JSON string")
    try:
        _check_values(doc)
    except TaskStartError as exc:
        return exc
    return TaskStartError.invalid(None, "body does not match qinglong/task-start@v1")


def decode_task_start(body: bytes) -> TaskStartRequest:
    """Decode and validate a Task Start body (ADR-0376 §1).

    ``body``: the raw request bytes (the server bounds their size). Returns the validated
    request. Raises :class:`TaskStartError` 400 ``invalid_task_start_request`` naming the field
    and the rule for: malformed JSON or non-UTF-8, a non-object, a missing or unknown field,
    a duplicated key, a wrong type (bool, float or string for the revision), a wrong schema,
    a non-canonical mutationId, a revision outside 1..2147483647, or a digest that is not 64
    lowercase hex characters. Raises TypeError when ``body`` is not bytes.
    """
    if not isinstance(body, (bytes, bytearray, memoryview)):
        raise TypeError("body must be bytes")
    body = bytes(body)
    try:
        req = msgspec.json.decode(body, type=TaskStartRequest, strict=True)
    except msgspec.ValidationError:
        raise _diagnose(body) from None
    except msgspec.DecodeError as exc:
        raise TaskStartError.invalid(None, f"body is not valid UTF-8 JSON: {exc}") from None
    _check_values(msgspec.structs.asdict(req))
    # msgspec keeps the last of duplicated keys; a fenced mutation must be unambiguous.
    json.loads(body, object_pairs_hook=_object_pairs)
    return req


def rfc3339_from_us(us: int) -> str:
    """Render µs since the Unix epoch as RFC 3339 UTC with microseconds, e.g.
    ``2026-08-12T10:00:00.000001Z``."""
    t = _dt.datetime(1970, 1, 1, tzinfo=_dt.timezone.utc) + _dt.timedelta(microseconds=us)
    return t.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class TaskStartResult(msgspec.Struct, frozen=True):
    """Bounded low-sensitivity result of a Task Start (ADR-0376 §2/§3).

    ``outcome`` is ``accepted`` (HTTP 202, new Run) or ``existing`` (HTTP 200, exact replay:
    the persisted identities, never freshly generated ones). ``eventIds`` are the
    ``run.created`` and ``run.queued`` RunEvent IDs in sequence order. ``state`` is the Run state
    as persisted (``queued`` at creation). ``createdAt``: RFC 3339 UTC of the database time.
    """

    outcome: Literal["accepted", "existing"]
    runId: str
    attemptId: str
    eventIds: tuple[str, str]
    taskRevision: int
    taskSnapshotRef: str
    state: str
    createdAt: str

    @property
    def status(self) -> int:
        """HTTP status: 202 for ``accepted``, 200 for ``existing``."""
        return 202 if self.outcome == "accepted" else 200

    @classmethod
    def build(
        cls,
        *,
        outcome: Literal["accepted", "existing"],
        run_id: str,
        attempt_id: str,
        event_ids: tuple[str, str],
        task_revision: int,
        content_digest: str,
        state: str,
        created_at_us: int,
    ) -> TaskStartResult:
        """Build a result from store values (µs time, revision and digest of the pinned head)."""
        return cls(
            outcome=outcome,
            runId=run_id,
            attemptId=attempt_id,
            eventIds=event_ids,
            taskRevision=task_revision,
            taskSnapshotRef=snapshot_ref(task_revision, content_digest),
            state=state,
            createdAt=rfc3339_from_us(created_at_us),
        )
