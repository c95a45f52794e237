"""Domain records (msgspec Structs). Pure data: no I/O, no store access.

Times are integer µs since the Unix epoch; durations in definitions are integer milliseconds.
JSON field names are camelCase (the wire and ``--json`` shape).
"""

from __future__ import annotations

import msgspec

ROLES = ("owner", "admin", "operator", "viewer")
# The local operator: whoever can open the database file owns it (the CLI acts as this subject).
LOCAL_SUBJECT = "local:cli"
# ADR-0376 §2: run.start needs owner/admin/operator; viewers read only.
START_ROLES = frozenset({"owner", "admin", "operator"})


class Base(msgspec.Struct, rename="camel", frozen=True, kw_only=True):
    pass


class Project(Base):
    project_id: str
    name: str
    project_version: int
    active: bool


class RoleBinding(Base):
    """A subject's role in a Project; the latest active bindingVersion wins (ADR-0376 §2)."""

    project_id: str
    subject: str
    role: str
    binding_version: int


class Admission(Base):
    """What authenticating one API request reads (ADR-0376 §2 Policy fence, at admission): the
    Project named by the path (None: unknown), the live token's Project ID and subject (None:
    unknown or revoked) and that subject's latest RoleBinding in the token's Project if it is
    active (else None)."""

    project: Project | None
    token: tuple[str, str] | None
    binding: RoleBinding | None


class RetryPolicy(Base):
    max_attempts: int = 1          # 1 = no retry
    backoff_ms: int = 10_000       # before attempt n+1: backoff_ms * 2**(n-1)


class NetworkRequirement(Base):
    """``none``; ``default_route`` (an IPv4 or IPv6 default route); ``interface`` (named link up)."""

    require: str = "none"
    interface: str | None = None


class ExecutionSpec(Base):
    """Launch spec of one Task revision (ADR-0071 §2).

    ``kind`` is ``local_process`` (absolute, bounded ``argv``) or ``shell`` (``shell`` from the
    allowlist runs ``script`` inline as ``shell -c script``). ``cwd`` None: the task's HOME.
    ``umask`` (4 octal digits, e.g. ``"0027"``) None: the service's umask. ``keep_orphans``:
    leave what the main process left behind running. ``on_lease_loss`` (``kill`` | ``keep``)
    None: ``kill``; what a fleet Worker does with a run whose Run Lease it cannot renew (issue 11
    §6; a local agent has no Lease and ignores it). ``memory_max`` (bytes) None: the Profile's
    default per-run limit (core.profiles.run_memory_limit). The four last are left out of the
    canonical documents while unset, so a Task that does not use them keeps its digests.
    """

    kind: str
    argv: tuple[str, ...] = ()
    shell: str | None = None
    script: str | None = None
    cwd: str | None = "/"
    umask: str | None = None
    keep_orphans: bool = False
    on_lease_loss: str | None = None
    memory_max: int | None = None

    def launch_argv(self) -> list[str]:
        """The argv handed to execve."""
        if self.kind == "shell":
            return [self.shell, "-c", self.script]
        return list(self.argv)


class ContextRecipe(Base):
    """Immutable environment description ``localctx:sha256:<digest>`` (ADR-0071 §2).

    ``public`` holds plain values; ``secret_refs`` maps an environment name to a SecretRef (the
    name of a stored Secret). Secret values never appear here.
    """

    public: dict[str, str]
    secret_refs: dict[str, str]


class PlacementSpec(Base):
    """A Task's Placement (ADR-0014 §2): Worker labels it ``required`` (all must match) and
    ``preferred`` (score = how many match). ``required.executor`` names the executor a Worker
    must offer."""

    required: dict[str, str] = msgspec.field(default_factory=dict)
    preferred: dict[str, str] = msgspec.field(default_factory=dict)


class TaskDefinition(Base, omit_defaults=True):
    """One revision of a Task: everything its contentDigest covers.

    ``catch_up`` (``latest`` | ``none``) and ``catch_up_within_ms`` decide whether an instant
    missed while the agent was down still gets its one Run (core.schedule.apply_catch_up).
    They are left out of the canonical document while at their defaults, so a Task that does
    not set them keeps the contentDigest it had before they existed.
    """

    name: str
    description: str
    schedules: tuple[str, ...]
    timezone: str | None
    timeout_ms: int
    grace_ms: int
    concurrency: str               # "single" (default) or "parallel"
    retry: RetryPolicy
    labels: dict[str, str]
    network: NetworkRequirement
    priority: int
    execution: ExecutionSpec
    recipe_ref: str
    catch_up: str = "latest"
    catch_up_within_ms: int | None = None
    # Cluster fields, also out of the canonical document while unset: where a Worker may run it
    # and which executor runs its Attempts (None: the authority's own, local_process locally,
    # remote_worker on the cluster).
    placement: PlacementSpec | None = None
    executor: str | None = None


class TaskHead(Base):
    """The current head of a Task as reads return it."""

    task_id: str
    project_id: str
    name: str
    revision: int
    content_digest: str
    enabled: bool
    definition: TaskDefinition
    created_at_us: int
    updated_at_us: int


class Run(Base):
    run_id: str
    project_id: str
    task_id: str
    task_name: str
    task_revision: int
    task_snapshot_ref: str
    state: str
    priority: int
    execution_origin: str
    execution_owner: str
    trigger_type: str
    requested_by: str
    scheduled_for_us: int | None
    version: int
    event_sequence: int
    cancel_requested: bool
    latest_attempt_id: str | None
    exit_code: int | None
    exit_signal: int | None
    created_at_us: int
    updated_at_us: int
    ended_at_us: int | None
    held: bool = False          # queued behind a live Run of its single-instance Task


class Attempt(Base):
    attempt_id: str
    run_id: str
    attempt_no: int
    state: str
    executor_type: str
    exit_code: int | None
    exit_signal: int | None
    bytes_kept: int | None
    bytes_dropped: int | None
    truncated: bool
    peak_rss_bytes: int | None
    cpu_time_us: int | None
    failure_reason: str | None
    created_at_us: int
    started_at_us: int | None
    ended_at_us: int | None
    start_error: str | None = None       # why the task could not start: paths and errno names
    orphans_stopped: int | None = None   # processes left by the main one, stopped at its exit
    truncation_reason: str | None = None  # the truncation fact's reason (core.receipt), None: not truncated
    worker_id: str | None = None         # the Worker that leased it (cluster); None on a local agent
    worker_name: str | None = None       # that Worker's name; None once it is removed


class CreatedRun(msgspec.Struct, frozen=True, rename="camel"):
    """Identities of a Run as created, or as persisted on an exact replay (``existing=True``)."""

    run_id: str
    attempt_id: str
    event_ids: tuple[str, ...]
    task_revision: int
    task_snapshot_ref: str
    state: str
    created_at_us: int
    existing: bool = False


class TokenInfo(Base):
    """An API token as listed (never the token: only its ID). Times µs; ``revoked_at_us`` None
    while the token is live."""

    token_id: str
    subject: str
    created_at_us: int
    revoked_at_us: int | None


class ScheduleCursor(Base):
    """A Task's schedule cursor: the last clock instant handled and the wall time observed then
    (µs), so a restart neither fires twice nor misses a due instant (core.schedule.plan_due)."""

    last_instant_us: int | None
    observed_wall_us: int | None


class RetentionEntry(Base):
    """An ended Attempt whose log Artifact still exists (retention input). ``ended_at_us`` µs."""

    attempt_id: str
    task_id: str
    artifact_path: str
    ended_at_us: int


class RunEvent(Base):
    """Append-only, per-Run sequence. Payloads hold digests, fences and figures, never command,
    environment, SecretRef or output."""

    run_id: str
    sequence: int
    event_id: str
    type: str
    actor: str
    payload: dict
    created_at_us: int
