"""ExecutionSpec: what a Worker needs to launch one Attempt (ADR-0014 §2 step 5, §3).

``sanitize(raw, candidate)`` is the only way the dispatcher turns a plan's raw document into a
spec: explicit deep copy through the document's JSON text (the plan source may keep mutating
its own objects), unknown fields stripped, the shared domain validation of a local launch
(``core.definitions``: absolute bounded argv or allowlisted shell, POSIX env names, ``QL3_*``
reserved, kernel string limits), then an identity check against the persisted candidate (runId, attemptId, projectId, taskId,
taskRevision, executorType). ``spec_digest`` is the SHA-256 of its canonical JSON. The spec
holds the command and environment: it never goes into a log, event, error or unclaimed result.
"""

from __future__ import annotations

import msgspec

from ..core import limits as L
from ..core.canonical import content_digest, sha256_hex
from ..core.cluster import ClusterCandidate, ExecutionSpec
from ..core.executors import WORKER_EXECUTORS
from ..core.definitions import TASK_NAME, TaskInput, prepare_execution, prepare_recipe
from ..core.errors import ValidationError
from ..core.profiles import STANDALONE

MAX_GRACE_MS = 300_000


_IDENTITY = (("run_id", "runId"), ("attempt_id", "attemptId"), ("project_id", "projectId"),
             ("task_id", "taskId"), ("task_revision", "taskRevision"), ("executor_type", "executorType"))


def sanitize(raw: dict, candidate: ClusterCandidate) -> ExecutionSpec:
    """Deep-copied, stripped, validated, identity-checked ExecutionSpec.

    Raises ValidationError(field="executionSpec.<field>") naming the first problem; the message
    names the field and the limit, never the value of a command or environment entry.
    """
    if not isinstance(raw, dict):
        raise ValidationError("executionSpec", "must be a document")
    try:
        # The explicit deep copy: the spec is decoded from the document's own JSON text, so it
        # shares no object with the plan source (a few µs where copy.deepcopy took tens).
        text = msgspec.json.encode(raw)
    except (TypeError, msgspec.EncodeError):
        raise ValidationError("executionSpec", "must be a JSON document") from None
    try:
        spec = msgspec.json.decode(text, type=ExecutionSpec)
    except msgspec.ValidationError as e:
        # msgspec says "Expected `int`, got `str` - at `$.timeoutMs`": types and path, no values.
        message, _, path = str(e).partition(" - at ")
        raise ValidationError("executionSpec" + path.strip("`")[1:], message) from None
    p = "executionSpec."
    if spec.kind == "local_process" and (spec.shell is not None or spec.script is not None):
        raise ValidationError(f"{p}kind", "local_process takes argv, not shell + script")
    t = TaskInput(name="spec", command=list(spec.argv) if spec.kind == "local_process" else None,
                  shell=spec.shell if spec.kind == "shell" else None,
                  script=spec.script if spec.kind == "shell" else None, cwd=spec.cwd, umask=spec.umask,
                  keep_orphans=spec.keep_orphans)
    if spec.kind not in ("local_process", "shell"):
        raise ValidationError(f"{p}kind", f"{spec.kind!r} is not local_process or shell")
    launch = prepare_execution(p, t)
    if launch.umask != spec.umask:
        raise ValidationError(f"{p}umask", "must be 4 octal digits, e.g. \"0027\"")
    prepare_recipe(p, {k: v for k, v in spec.env.items()}, dict(spec.secret_refs))
    if spec.executor_type not in WORKER_EXECUTORS:
        raise ValidationError(f"{p}executorType", f"{spec.executor_type!r} is not one of {list(WORKER_EXECUTORS)}")
    if not 1_000 <= spec.timeout_ms <= L.MAX_TIMEOUT_S * 1000:
        raise ValidationError(f"{p}timeoutMs", "outside 1000..", limit=L.MAX_TIMEOUT_S * 1000)
    if not 0 <= spec.grace_ms <= MAX_GRACE_MS:
        raise ValidationError(f"{p}graceMs", "outside 0..", limit=MAX_GRACE_MS)
    if not 1 <= spec.log_quota_bytes <= STANDALONE.log_max_bytes:
        raise ValidationError(f"{p}logQuotaBytes", "outside 1..", limit=STANDALONE.log_max_bytes)
    if len(spec.task_name) > L.MAX_TASK_NAME or (spec.task_name and not TASK_NAME.match(spec.task_name)):
        raise ValidationError(f"{p}taskName", f"must be 1..{L.MAX_TASK_NAME} of [a-z0-9._-]", limit=L.MAX_TASK_NAME)
    if spec.on_lease_loss not in ("kill", "keep"):
        raise ValidationError(f"{p}onLeaseLoss", "must be \"kill\" or \"keep\"")
    for attr, name in _IDENTITY:
        if getattr(spec, attr) != getattr(candidate, attr):
            raise ValidationError(f"{p}{name}", "does not match the persisted candidate")
    return spec


_SORTED = msgspec.json.Encoder(order="sorted")


def spec_digest(spec: ExecutionSpec) -> str:
    """Lowercase hex SHA-256 of the spec's canonical JSON (ADR-0014 §3, ``core.canonical``)."""
    text = _SORTED.encode(spec)
    if text.isascii():
        # The Struct's fields hold no float, so its key-sorted encoding is the canonical JSON
        # whenever every string is ASCII (NFC changes no ASCII string, so no two keys collide):
        # one encode per claim instead of a walk normalising every string.
        return sha256_hex(text)
    return content_digest(msgspec.to_builtins(spec))
