"""ExecutionSpec: what a Worker needs to launch one Attempt (ADR-0014 §2 step 5, §3).

``sanitize(raw, candidate)`` is the only way the dispatcher turns a plan's raw document into a
spec: explicit deep copy (the plan source may keep mutating its own objects), unknown fields
stripped, the shared domain validation of a local launch (``core.definitions``: absolute
bounded argv or allowlisted shell, POSIX env names, ``QL3_*`` reserved, kernel string limits),
then an identity check against the persisted candidate (runId, attemptId, projectId, taskId,
taskRevision, executorType). ``spec_digest`` is the SHA-256 of its canonical JSON. The spec
holds the command and environment: it never goes into a log, event, error or unclaimed result.
"""

from __future__ import annotations

import copy

import msgspec

from ..core import limits as L
from ..core.canonical import content_digest
from ..core.cluster import WORKER_EXECUTORS, ClusterCandidate
from ..core.definitions import TaskInput, prepare_execution, prepare_recipe
from ..core.errors import ValidationError
from ..core.profiles import STANDALONE

MAX_GRACE_MS = 300_000


class ExecutionSpec(msgspec.Struct, frozen=True, rename="camel", kw_only=True):
    run_id: str
    attempt_id: str
    project_id: str
    task_id: str
    task_revision: int
    executor_type: str                 # what the Worker runs, e.g. local_process
    kind: str                          # local_process (argv) | shell (shell -c script)
    argv: tuple[str, ...] = ()
    shell: str | None = None
    script: str | None = None
    cwd: str | None = None             # None: the task user's HOME (as a local launch)
    umask: str | None = None           # 4 octal digits; None: the Worker service's umask
    keep_orphans: bool = False
    env: dict[str, str] = {}
    secret_refs: dict[str, str] = {}   # environment name → Secret name; values resolved after the claim
    timeout_ms: int
    grace_ms: int
    log_quota_bytes: int

    def __repr__(self) -> str:         # never the command or environment
        return f"ExecutionSpec(attempt={self.attempt_id})"


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
        spec = msgspec.convert(copy.deepcopy(raw), ExecutionSpec)
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
    for attr, name in _IDENTITY:
        if getattr(spec, attr) != getattr(candidate, attr):
            raise ValidationError(f"{p}{name}", "does not match the persisted candidate")
    return spec


def spec_digest(spec: ExecutionSpec) -> str:
    """Lowercase hex SHA-256 of the spec's canonical JSON (ADR-0014 §3)."""
    return content_digest(msgspec.to_builtins(spec))
