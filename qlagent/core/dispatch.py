"""Records that flow between the dispatcher, the materialiser, the coordinator and the store
(ADR-0071 §3–4). Pure data; secret plaintext only ever sits in ``LaunchCommand.env``, which
lives in the materialiser's and coordinator's call stack and is never persisted or logged."""

from __future__ import annotations

import msgspec

from .models import ContextRecipe, ExecutionSpec, RetryPolicy


class Candidate(msgspec.Struct, frozen=True):
    """One dispatch candidate: identity plus its keyset sort key."""

    run_id: str
    attempt_id: str
    project_id: str
    task_id: str
    task_revision: int
    version: int
    priority: int
    created_at_us: int
    attempt_created_at_us: int

    def key(self) -> tuple:
        return (self.priority, self.created_at_us, self.attempt_created_at_us, self.attempt_id)


class Plan(msgspec.Struct, frozen=True):
    """The pinned, immutable facts a launch needs (no secret values)."""

    execution: ExecutionSpec
    recipe: ContextRecipe
    timeout_ms: int
    grace_ms: int
    retry: RetryPolicy
    concurrency: str
    network_require: str
    network_interface: str | None
    task_name: str


class Finish(msgspec.Struct, frozen=True):
    """What the coordinator learned about an ended Attempt."""

    attempt_state: str                 # from core.states.outcome, or "lost"
    exit_code: int | None = None
    exit_signal: int | None = None
    bytes_kept: int | None = None
    bytes_dropped: int | None = None
    peak_rss_bytes: int | None = None
    cpu_time_us: int | None = None
    failure_reason: str | None = None
    ended_at_us: int | None = None
    start_error: str | None = None       # the reason text (core.errors.StartError), bounded
    orphans_stopped: int | None = None


class LiveAttempt(msgspec.Struct, frozen=True):
    run_id: str
    attempt_id: str
    task_id: str
    task_revision: int
    state: str
    shim_pid: int | None
    shim_start_time: float | None       # psutil create_time, s since the epoch (PID-reuse check)
    deadline_at_us: int | None
    artifact_path: str | None
    cancel_requested: bool


class LaunchCommand(msgspec.Struct, frozen=True):
    """ADR-0071 §4 step 8: everything the coordinator needs to start one Attempt.

    ``env`` is the frozen environment (baseline HOME/USER/LOGNAME/SHELL, recipe values, secret
    plaintext, ``QL3_*`` identity); it must never be logged, persisted or put in an error.
    ``umask`` None: the service's; ``keep_orphans``: see ExecutionSpec. ``memory_max``: the Run's
    memory limit, ``memory_reserve``: what admission holds for it while it lives (bytes;
    core.profiles.run_memory_limit / run_memory_reserve).
    """

    candidate: Candidate
    argv: tuple[str, ...]
    env: dict[str, str]
    cwd: str
    artifact_path: str
    quota_bytes: int
    timeout_ms: int
    grace_ms: int
    retry: RetryPolicy
    umask: int | None = None
    keep_orphans: bool = False
    memory_max: int | None = None
    memory_reserve: int = 0

    def __repr__(self) -> str:      # keep secret values out of any accidental repr/traceback
        return f"LaunchCommand(run={self.candidate.run_id}, attempt={self.candidate.attempt_id})"


class Refusal(msgspec.Struct, frozen=True):
    """Why no log Artifact may be allocated now (ADR-0071 §4 step 6–7), with the figures an
    operator acts on. ``reason``: ``low_space`` (``free_bytes`` on the file system of ``path``
    below ``needed_bytes``: the reserve plus one log), ``artifact_quota_full`` (``free_bytes``
    left of the Profile's total for logs, below ``needed_bytes``: one log), ``quota_too_large``,
    ``artifact_unwritable`` (``error``: the errno name and text). Bytes; no user data."""

    reason: str
    path: str
    free_bytes: int | None = None
    needed_bytes: int | None = None
    error: str | None = None

    def fields(self) -> dict[str, str | int]:
        """The journal's ``key=value`` fields (reason, free_bytes, needed_bytes, path, error)."""
        return {k: v for k, v in (("reason", self.reason), ("free_bytes", self.free_bytes),
                                  ("needed_bytes", self.needed_bytes), ("path", self.path),
                                  ("error", self.error)) if v is not None}

    def text(self) -> str:
        """One line: ``low_space (free N bytes, needs M) on PATH`` or ``REASON on PATH: ERROR``."""
        figures = "" if self.free_bytes is None else f" (free {self.free_bytes} bytes, needs {self.needed_bytes})"
        return f"{self.reason}{figures} on {self.path}" + (f": {self.error}" if self.error else "")


class DispatchResult(msgspec.Struct, frozen=True):
    """Small, low-cardinality outcome of one dispatcher pass (ADR-0071 §3).

    ``status``: ``activated`` | ``no_candidate`` | ``more`` (this page was all skipped; another
    page exists) | ``unavailable`` | ``launch_failed`` | ``limited`` (a global admission limit).
    ``reason`` is a short code (``secret_missing``, ``low_space``, ``concurrency`` …), never text
    that could carry user data. ``rows_read`` is the page size read (≤ page + 1). ``refusal``:
    the figures of an ``unavailable`` pass that the log Artifact's admission refused.
    """

    status: str
    reason: str | None = None
    run_id: str | None = None
    rows_read: int = 0
    skipped: int = 0
    refusal: Refusal | None = None
