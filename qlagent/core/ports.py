"""Ports: every fact the service, the HTTP API, the CLI and the engine read or write, as typed
calls with no driver in sight (ADR-0071 §1; ADR-0014 "only the Repository and transport change").

One store implements every *store* port (today ``adapters.sqlite.store.SqliteStore``; the
cluster's PostgreSQL authority implements the same calls). Rules every implementation keeps,
checked by ``tests/contract/``:

- each call is one transaction (a read sees one snapshot; a write is all or nothing);
- where the store decides time (``created_at_us``, ``ended_at_us`` …) it uses its own clock,
  integer µs since the epoch;
- a busy or unreachable store raises ``UnavailableError`` with code ``store_busy`` /
  ``store_unavailable``; nobody above the adapter sees a driver exception;
- refusals raise the core errors named in each docstring and write nothing.

The process, filesystem, budget and network ports are implemented by ``qlagent.adapters``
(processes, artifacts, budget, netgate) and wired by ``qlagent.bootstrap``.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Iterable
from typing import TYPE_CHECKING, Protocol, TypeVar

from .definitions import PreparedTask
from .dispatch import Candidate, Finish, LaunchCommand, LiveAttempt, Plan, Refusal
from .inbox_states import InboxEntry, InboxOffer, PendingPull
from .models import (
    Admission,
    Attempt,
    ContextRecipe,
    CreatedRun,
    Project,
    RetentionEntry,
    RetryPolicy,
    RoleBinding,
    Run,
    RunEvent,
    ScheduleCursor,
    TaskHead,
    TokenInfo,
)
from .qinglong import QlPanel, Toolset
from .receipt import Receipt, TruncationFact

if TYPE_CHECKING:       # annotations only: a local agent never loads the cluster's records
    from .cluster import (Ack, AckResult, ClusterCandidate, DispatchPlan, Enrolment, LeaseFence, SessionGrant,
                          WorkerInfo)

T = TypeVar("T")

# ---- store ports ---------------------------------------------------------------------------


class TokenPort(Protocol):
    """Authentication reads (HTTP): the two lookups of ADR-0376 §2's Policy fence."""

    def lookup_token(self, digest: str) -> tuple[str, str] | None:
        """(project_id, subject) of a live token with this SHA-256 hex digest, else None."""

    def latest_binding(self, project_id: str, subject: str) -> RoleBinding | None:
        """The subject's latest RoleBinding in the Project if it is active, else None."""


class PolicyStore(TokenPort, Protocol):
    """Projects, RoleBindings (append-only ``bindingVersion``) and API token digests."""

    def ensure_project(self, name: str) -> Project:
        """Project ``name``, created (``local:cli`` its owner) if missing. ValidationError for a bad name."""

    def get_project(self, name_or_id: str) -> Project:
        """NotFoundError(``project_not_found``) if unknown."""

    def admission(self, project: str, digest: str) -> Admission:
        """The Project ``project`` (name or ID), the live token with SHA-256 hex ``digest`` and
        its subject's binding, read together (one statement: the HTTP API's authentication)."""

    def bind_role(self, project_id: str, subject: str, role: str | None) -> int:
        """Append bindingVersion+1 (``role=None`` revokes); returns it. ValidationError for an
        unknown role or a subject outside 1..128 characters."""

    def grant_token(self, project: str, subject: str, role: str, digest: str) -> str:
        """In one transaction: ensure Project ``project`` (name), bind ``role`` unless it is the
        subject's current one, store the token digest. Returns the token ID."""

    def revoke_token(self, *, token_id: str, digest: str | None = None) -> str:
        """Revoke the token with ``digest`` if one has it, else the one with ``token_id``
        (idempotent); returns the revoked token's ID. NotFoundError(``token_not_found``) if
        neither exists."""

    def list_tokens(self, project_id: str) -> list[TokenInfo]:
        """Tokens of the Project, oldest first."""


class DefinitionBatch(Protocol):
    """The writes of one ``DefinitionStore.definition_batch``: all inside ONE transaction, with
    the same rules as the single-call methods (``import qinglong`` uses it)."""

    def get_head(self, project_id: str, name_or_id: str) -> TaskHead | None:
        """The live head, or None."""

    def list_heads(self, project_id: str) -> list[TaskHead]:
        """Live heads of the Project, by name."""

    def add_task(self, project_id: str, prepared: PreparedTask) -> TaskHead:
        """Create at revision 1; ConflictError(``task_exists``)."""

    def edit_task(self, project_id: str, name_or_id: str, expected_revision: int, expected_digest: str,
                  prepared: PreparedTask) -> TaskHead:
        """Fenced edit as ``DefinitionStore.edit_task``."""

    def ciphertexts(self, project_id: str, names: list[str]) -> dict[str, bytes]: ...

    def put_secret(self, project_id: str, name: str, ciphertext: bytes, key_id: str) -> None: ...


class DefinitionStore(Protocol):
    """Task heads and their append-only revisions (ADR-0071 §2: same content idempotent,
    different content ConflictError)."""

    def definition_batch(self, work: Callable[[DefinitionBatch], T], *, dry_run: bool = False) -> T:
        """Run ``work`` in one write transaction and return its result; an exception from it
        writes nothing, and ``dry_run`` rolls everything back even when it succeeds."""

    def add_tasks(self, project_id: str, prepared: list[PreparedTask]) -> list[TaskHead]:
        """Create every Task at revision 1, all or nothing. ConflictError(``task_exists``)."""

    def edit_task(self, project_id: str, name_or_id: str, expected_revision: int, expected_digest: str,
                  prepared: PreparedTask) -> TaskHead:
        """Fenced edit → revision+1. ConflictError(``definition_changed``) on a stale fence; the
        head's own content again is a no-op; ValidationError(``name``) for a rename."""

    def set_enabled(self, project_id: str, name_or_id: str, enabled: bool, actor: str) -> tuple[TaskHead, int]:
        """Enable/disable; disabling cancels the Task's queued Runs. Returns (head, cancelled)."""

    def remove_task(self, project_id: str, name_or_id: str, actor: str) -> tuple[TaskHead, int, int]:
        """Soft-delete; cancel queued Runs, request cancellation of active ones.
        Returns (last head, queued cancelled, active asked to stop)."""

    def get_head(self, project_id: str, name_or_id: str) -> TaskHead:
        """Live head by name or ID. NotFoundError(``task_not_found``)."""

    def list_heads(self, project_id: str | None) -> list[TaskHead]:
        """Live heads of one Project (None: of every Project), by name."""

    def skipped_fires(self, task_id: str) -> int:
        """Schedule fires skipped because a single-instance Run was live."""

    def get_recipe(self, recipe_ref: str) -> ContextRecipe:
        """The context recipe (public values and SecretRef names). NotFoundError(``recipe_not_found``)."""


class RunStore(Protocol):
    """Runs, Attempts and RunEvents as the API and CLI see them."""

    def task_start(self, *, project: str, task: str, subject: str, mutation_id: str, expected_revision: int,
                   expected_digest: str, admitted_project_version: int | None = None,
                   admitted_binding_version: int | None = None) -> CreatedRun:
        """ADR-0376 §2 in one transaction. Idempotency key ``ql3:task-start:v1:{mutationId}``:
        an exact replay returns the persisted identities with ``existing=True``. Raises
        NotFoundError(``task_not_found``), FenceRejected(authorization_changed |
        mutation_conflict | definition_changed | task_disabled | task_not_executable),
        UnavailableError(``task_start_unavailable``) for a corrupt execution revision."""

    def get_run(self, run_id: str, project_id: str | None = None) -> Run:
        """By ID (without ``project_id``: also a unique prefix ≥ 8 chars). NotFoundError(``run_not_found``)."""

    def list_runs(self, project_id: str, *, task_id: str | None = None, state: str | None = None,
                  limit: int = 50, cursor: str | None = None) -> tuple[list[Run], str | None]:
        """Keyset page, newest first (created desc, run_id desc): (Runs, next cursor or None).
        ``limit`` 1..200; ValidationError(limit | state | cursor)."""

    def list_events(self, run_id: str) -> list[RunEvent]:
        """RunEvents by ``sequence`` (1, 2, … without gaps)."""

    def list_attempts(self, run_id: str) -> list[Attempt]:
        """Attempts by ``attempt_no``."""

    def latest_artifact(self, run_id: str) -> tuple[str | None, TruncationFact | None]:
        """(log path of the latest Attempt that has one, its truncation fact). NotFoundError
        (``log_not_found``) if retention pruned a log that had bytes."""

    def request_cancel(self, run_id: str, actor: str, project_id: str | None = None) -> Run:
        """Idempotent: queued → cancelled at once; an active Run gets the intent (its process
        tree is stopped by the coordinator). Returns the Run as it now stands."""

    def queued_count(self) -> int:
        """Runs waiting in ``queued`` (STATUS)."""

    def run_state_counts(self) -> dict[str, int]:
        """``RunState`` value → Runs in that state, every Project (``GET /metrics``); a state
        without a Run is left out."""

    def oldest_queued_us(self) -> int | None:
        """``created_at_us`` (µs) of the oldest queued Run, None when none is queued."""


class ScheduleStore(Protocol):
    """Schedule cursors and the Runs they fire, exactly once per instant."""

    def schedule_cursors(self) -> dict[str, ScheduleCursor]:
        """task_id → cursor, for every Task that has one."""

    def fire_schedule(self, *, project_id: str, task_id: str, idempotency_key: str | None, trigger: str,
                      scheduled_for_us: int | None, actor: str,
                      cursor: tuple[ScheduleCursor | None, ScheduleCursor] | None, missed: str | None = None) -> str:
        """One transaction: compare-and-set the cursor ``(expected, new)`` (None: leave it) and,
        when ``idempotency_key`` is not None, create the Run of that key from the Task's current
        head (``missed``: the coalesced instants, recorded on ``run.created``). Returns ``created``, ``exists`` (the key's Run is there), ``skipped`` (single-instance
        Task with a live Run; counted in ``skipped_fires``), ``gone`` (disabled or removed),
        ``moved`` (the cursor is no longer ``expected``: nothing written), ``cursor`` (no Run
        asked, cursor written) or ``early`` (the store's own clock, which stamps the Run, is
        before ``scheduled_for_us``: nothing written; ADR-0376 §2, the Run's time is the
        server's)."""


class SecretStore(Protocol):
    """Secret ciphertext by (Project, name); plaintext never reaches a store."""

    def put_secret(self, project_id: str, name: str, ciphertext: bytes, key_id: str) -> None: ...

    def secret_names(self, project_id: str) -> list[tuple[str, int]]:
        """(name, updated_at_us), by name."""

    def delete_secret(self, project_id: str, name: str, *, force: bool = False) -> list[str]:
        """Delete; returns the live Tasks still referring to it. Without ``force`` a used Secret
        is ConflictError(``secret_in_use``) naming them; NotFoundError(``secret_not_found``)."""

    def secret_uses(self, project_id: str | None) -> list[tuple[str, str, bool]]:
        """(task name, Secret name, stored?) per SecretRef of each live Task head (every Project
        when None), by task then Secret name."""

    def ciphertexts(self, project_id: str, names: list[str]) -> dict[str, bytes]:
        """Ciphertext of each present name (missing ones are absent)."""

    def legacy_ciphertexts(self, magic: bytes) -> list[tuple[str, str, bytes]]:
        """(project_id, name, ciphertext) of every Secret whose ciphertext starts with ``magic``."""

    def replace_ciphertexts(self, rows: list[tuple[str, str, bytes, bytes]], key_id: str) -> int:
        """In one transaction, for each (project_id, name, old, new): replace ``old`` by ``new``
        where the row still holds ``old``. Returns how many rows were replaced."""


class DispatchStore(Protocol):
    """What one dispatcher pass reads and the few writes it makes (ADR-0071 §3–4)."""

    def candidate_page(self, limit: int, after: tuple | None) -> list[Candidate]:
        """Up to ``limit + 1`` due candidates in keyset order (priority desc, created, attempt
        created, attempt id) strictly after ``after`` (a ``Candidate.key()``), never OFFSET."""

    def reread(self, c: Candidate) -> bool:
        """Is the exact candidate still queued, uncancelled, same version and claimed Attempt?"""

    def load_plan(self, c: Candidate) -> tuple[Plan | None, str | None]:
        """Pinned execution revision + recipe, or (None, ``revision_missing``/``recipe_missing``)."""

    def fail_unlaunched(self, c: Candidate, reason: str, retry: RetryPolicy | None,
                        start_error: str | None = None) -> None:
        """End a candidate that can never launch as it stands (no process): Attempt
        ``start_failed`` with ``reason`` (a code) and ``start_error`` (the bounded text)."""

    def active_count(self) -> int:
        """Runs starting or running (global concurrency); reads only live Runs."""

    def task_active_count(self, task_id: str) -> int:
        """The Task's starting or running Runs (single-instance admission)."""


class ExecutionStore(Protocol):
    """Attempt/Run transitions after dispatch: compare-and-set, one RunEvent each."""

    def claim_starting(self, c: Candidate, artifact_path: str) -> bool:
        """queued → starting (CAS on the candidate's version). False: another pass won; do not spawn."""

    def mark_running(self, c: Candidate, shim_pid: int, shim_start: float, deadline_us: int) -> None:
        """starting → running once the shim exists (its PID and start time identify it)."""

    def finish(self, run_id: str, attempt_id: str, f: Finish, truncation: TruncationFact | None,
               retry: RetryPolicy | None) -> str:
        """End the Attempt (or queue a retry Attempt) and record the truncation fact once.
        Idempotent for an Attempt already terminal. Returns the Run's state."""

    def live_attempts(self) -> list[LiveAttempt]:
        """Attempts starting or running (restart recovery)."""

    def cancel_requested(self) -> set[str]:
        """Attempt IDs of active Runs whose cancellation was requested."""

    def retry_policy(self, task_id: str, revision: int) -> RetryPolicy | None: ...

    def timing(self, task_id: str, revision: int) -> tuple[int, int]:
        """(timeout_ms, grace_ms) of the revision (defaults if it is gone)."""

    def keeps_orphans(self, attempt_id: str) -> bool:
        """True if the Attempt is stored and its Task revision has ``keep_orphans = true``: what
        it left running is meant to outlive it (not a stray for restart recovery)."""

    def next_backoff_us(self) -> int | None:
        """Earliest ``not_before_us`` of a queued retry that is not yet due."""

    def claimed_attempt_ids(self) -> list[str]:
        """Attempts still ``claimed`` (a crash may have left their log file)."""

    def retention_entries(self) -> list[RetentionEntry]:
        """Ended Attempts that still have a log, oldest first."""

    def forget_artifacts(self, attempt_ids: list[str]) -> None:
        """Clear the log path of pruned Artifacts (rows and truncation facts stay)."""


class Store(PolicyStore, DefinitionStore, RunStore, ScheduleStore, SecretStore, DispatchStore, ExecutionStore,
            Protocol):
    """Everything one authority provides. ``project`` is the Project this process acts in."""

    project: Project

    def now_us(self) -> int:
        """The store's clock (µs since the epoch)."""

    def capabilities(self) -> dict[str, int]:
        """Declared store capabilities; UnavailableError if a required one is missing (readiness)."""

    def close(self) -> None: ...


# ---- host ports ----------------------------------------------------------------------------


class SecretCipher(Protocol):
    """Authenticated encryption of Secret values, bound to (Project, name) (``adapters.secretbox``)."""

    key_id: str

    def seal(self, project_id: str, name: str, plaintext: bytes) -> bytes: ...

    def open(self, project_id: str, name: str, blob: bytes) -> bytes:
        """UnavailableError if the blob was not sealed by this key for this (Project, name)."""


CipherFactory = Callable[[], SecretCipher]


class ArtifactPort(Protocol):
    """Log Artifacts on the filesystem (``adapters.artifacts``)."""

    def used_bytes(self) -> int:
        """Bytes of every log Artifact under the root (``GET /metrics``)."""

    def admit(self, quota_bytes: int) -> Refusal | None:
        """None if one full log fits above the reserve and within the total quota, else the
        refusal with its figures (core.dispatch.Refusal)."""

    def allocate(self, attempt_id: str) -> str:
        """Create the private log file. Raises errors.StartError (code artifact_unusable) when
        something is already at its path: the dispatcher is the only allocator of an Attempt's
        path and recovery removes its own leftovers, so this is never a race, and the Run
        could never start. UnavailableError (code artifact_unwritable, ``field`` the log's path,
        the message the errno name and text) when the file system takes no new file
        (read-only, out of inodes or space, no permission); (code unsafe_directory) for a
        symlinked or foreign directory."""

    def discard(self, path: str) -> None:
        """Remove a log file this pass created but could not use."""

    def discard_attempt(self, attempt_id: str) -> None:
        """Remove the (deterministic) log file of an Attempt that never started, if present."""

    def prune(self, keep_per_task: int, max_total_bytes: int, entries: list[RetentionEntry]) -> list[str]:
        """Delete the oldest logs beyond the rule; returns the Attempt IDs whose log went."""

    def make_room(self, quota_bytes: int, entries: list[RetentionEntry]) -> tuple[list[str], int]:
        """When ``admit(quota_bytes)`` is refused for space or the total quota, delete the oldest
        ended logs (never a live one nor the newest of a Task) until it would be granted, or
        none if that cannot be reached; returns (the Attempt IDs whose log went, bytes freed)."""


class ProcessPort(Protocol):
    """Shim processes (``adapters.processes``): one shim per Attempt, in its own session."""

    def begin(self, cmd: LaunchCommand) -> None:
        """Start the shim of ``cmd``'s Attempt in its own session without waiting for it: the
        start goes on in ``advance``. The shim holds the Run's timeout (``cmd.timeout_ms`` from
        the task's exec, on the monotonic clock, whether an agent watches or not: SIGTERM, SIGKILL
        after ``cmd.grace_ms``, its receipt's ``deadline_passed``). Raises errors.StartError with
        the reason when nothing could be started (the run directory remains)."""

    def holds_deadline(self, attempt_id: str) -> bool:
        """Does the Attempt's shim stop its task at the Run's timeout itself (see ``begin``)?
        False for a shim an older agent started (the agent then stops it at the deadline)."""

    def fence_unstarted(self, attempt_id: str) -> bool:
        """Restart recovery of an Attempt left ``starting`` with no receipt: True when its task
        provably never reached its exec and never will (no trace of a shim in its run directory,
        which is then removed, so that a shim still on its way fails before the exec); False
        when it may have run."""

    def start_fd(self, attempt_id: str) -> int | None:
        """The fd that becomes readable when the Attempt's start in flight has news for
        ``advance`` (the loop's selector watches it; it may change after each ``advance``);
        None: nothing to watch, call ``advance`` about every second."""

    def advance(self, attempt_id: str, expired: bool = False) -> tuple[int, float] | None:
        """Take in the start's news without waiting: None while it goes on, (pid, create_time)
        once the task was exec'd. Raises errors.StartError with the reason when it was not;
        by then nothing of the Run is left running (the run directory remains). ``expired``
        (the start's bound, ``core.limits.SHIM_START_BOUND_US``, passed) ends it: a shim that has
        not reported its task's exec by then is killed and the start fails."""

    def abandon_start(self, attempt_id: str) -> None:
        """Stop following a start in flight (shutdown): its shim carries on, restart recovery
        finds its receipt."""

    def watch(self, pid: int) -> int | None:
        """A pidfd that becomes readable when ``pid`` exits, or None where pidfds are missing."""

    def alive(self, pid: int, create_time: float) -> bool:
        """Is this exact process (PID-reuse safe) still running?"""

    def reap(self, pid: int) -> None:
        """Collect the exit status if ``pid`` is our child (no zombie)."""

    def signal_run(self, attempt_id: str, shim_pid: int | None, sig: int) -> int:
        """Signal the task's process group and every descendant of the shim (never the shim
        itself); returns how many processes were signalled."""

    def reap_orphans(self) -> int:
        """Reap this process's exited children that are not shims it waits for itself: as PID 1
        of a PID namespace every orphan there is re-parented to the agent (a ``keep_orphans``
        daemon, whatever ``nsenter`` left), and only its parent can clear the zombie. Returns how
        many were reaped."""

    def stop_strays(self, known: Container[str]) -> dict[str, int]:
        """SIGKILL this agent's tasks (tagged QL3_AGENT_KEY, found even when its state directory
        was wiped) of Attempts not in ``known``; returns {attempt ID: processes killed}."""

    def collect(self, attempt_id: str) -> tuple[Receipt | None, TruncationFact | None]:
        """(completion receipt, truncation fact) left by the shim, or None for each."""

    def cleanup(self, attempt_id: str) -> None:
        """Remove the run directory once its facts are in the store."""


class Usage(Protocol):
    """One reading of the service tree (``adapters.budget.Usage``): bytes and counts; the
    kernel-only figures are None without a cgroup of the service's own."""
    rss_bytes: int
    pids: int
    current_bytes: int | None
    peak_bytes: int | None
    oom_kills: int | None
    memory_max: int | None
    pids_max: int | None
    source: str


class BudgetPort(Protocol):
    """The service tree's memory and PID use (``adapters.budget``: cgroup or psutil)."""

    def block_reason(self, extra_roots: list[int]) -> str | None:
        """``pids`` or ``memory`` when one more Run would pass the Profile budget, else None."""

    def recent(self, max_age_s: float, extra_roots: list[int]) -> Usage:
        """Figures measured within ``max_age_s`` s, else fresh ones (bytes, count)."""

    def limits(self, u: Usage) -> tuple[int, int]:
        """(memory bytes, PIDs) the tree may use: the Profile's, or the kernel's where lower."""


class PanelSource(Protocol):
    """A qinglong 2.x data directory, read-only (``adapters.qinglong``)."""

    def read_panel(self, path: str, scripts_dir: str | None) -> QlPanel:
        """The panel's crons, Envs and config.sh. ValidationError (not 2.x, corrupt, unreadable)
        or UnavailableError (its database is locked or kept changing)."""

    def readable_files(self, paths: frozenset[str]) -> frozenset[str]:
        """Those of ``paths`` this user can read."""

    def find_tools(self) -> Toolset:
        """The interpreters present on the task PATH."""


class NetworkPort(Protocol):
    """Network conditions for gated Runs (``adapters.netgate``, netlink)."""

    def satisfied(self, require: str, interface: str | None) -> bool:
        """``default_route``: an IPv4/IPv6 default route exists; ``interface``: that link is up."""

    def fileno(self) -> int:
        """A descriptor readable when conditions may have changed."""

    def process(self) -> bool:
        """Consume pending events; True if a condition changed."""

    def close(self) -> None: ...


class InboxPort(Protocol):
    """The Worker's durable inbox (ADR-0021; states and rules in ``core.inbox_states``;
    ``adapters.sqlite.inbox.SqliteInbox``). Every method commits durably (fsync) before it
    returns; nothing of a refused call is written. ``max_rows``/``max_bytes``: its caps (rows,
    spec bytes) from the Profile."""

    max_rows: int
    max_bytes: int

    def begin_pull(self, session_id: str, generation: int, pull_id: str, lease_token: str) -> PendingPull:
        """The Pull request to send: the kept one if it belongs to this Session and generation
        (a retry, byte-identical), else the fresh ``pull_id``/``lease_token`` kept first."""

    def end_pull(self, pull_id: str) -> None:
        """Forget the kept Pull request after its answer arrived (idle, refused or offered)."""

    def receive(self, offer: InboxOffer, pull_id: str | None = None) -> tuple[InboxEntry, bool]:
        """Keep ``offer`` in state ``received`` with its ``pull_id`` (and end that Pull) in one
        commit; returns (entry, True) for a new offer, (existing entry, False) for a retry of the
        same offer.
        Raises ValidationError, OfferConflict (recorded on the kept row), InboxFull."""

    def advance(self, offer_id: str, state: str, outcome: dict | None = None, *,
                keep_orphans: bool = False) -> InboxEntry:
        """Move one row to ``state`` (``outcome`` required for ``completed``). ``keep_orphans``
        (only with ``acked``): the row's Attempt joins ``kept_orphans()`` in the same commit.
        Raises NotFoundError, IllegalInboxTransition, ValidationError (outcome over the byte
        cap, ``keep_orphans`` with another state)."""

    def get(self, offer_id: str) -> InboxEntry | None: ...

    def open_entries(self) -> list[InboxEntry]:
        """Rows not yet acknowledged, in receipt order (what a restarted Worker recovers)."""

    def kept_orphans(self) -> set[str]:
        """Attempt IDs whose acknowledged run left processes on purpose (``keepOrphans``): the
        stray scan spares them. Bounded (oldest dropped first); outlives the rows' pruning."""

    def forget_orphans(self, attempt_ids: Iterable[str]) -> None:
        """Drop these Attempt IDs from ``kept_orphans()`` (no process carries them any more)."""

    def usage(self) -> tuple[int, int]:
        """(rows, bytes) counted against the Profile's inbox caps."""

    def close(self) -> None: ...


# ---- cluster ports (the PostgreSQL authority: ``adapters.postgres``) --------------------------
# Each call is one transaction of the authority, on its clock (µs since the epoch); a fence
# (``core.cluster.LeaseFence``) that no longer holds raises ConflictError (stale_generation,
# lease_token_mismatch, lease_not_active, lease_expired) and writes nothing.


class LeaseStore(Protocol):
    """Run Leases: ACKs and the expiry sweep (``adapters.postgres.leases.PgLeaseStore``)."""

    def apply_ack(self, fence: LeaseFence, ack: Ack, target: str, lease_ttl_us: int) -> AckResult:
        """Move the Attempt to ``target`` (an ``AttemptState``) under ``fence``; a starting/running
        ACK extends the Lease to at least now + ``lease_ttl_us``. ConflictError also
        ack_out_of_order, ack_conflict (another terminal state was recorded)."""

    def sweep_expired(self, limit: int) -> list[tuple[str, str]]:
        """End up to ``limit`` active Leases past their expiry; (Attempt ID, the Run's new
        ``RunState``) of each."""

    def release_holds(self, limit: int) -> int:
        """Release up to ``limit`` held queued Runs whose Task no Run occupies any more; how many."""


class WorkerRegistryStore(Protocol):
    """Workers and their Sessions (``adapters.postgres.registry.PgWorkerRegistry``); policy and
    validation are ``cluster.registry.WorkerRegistry``'s. ``credential_digest``: SHA-256 hex of
    the Worker credential (WorkerAuthError when it proves no live Worker)."""

    def enroll(self, name: str, labels: dict[str, str], executor_types: tuple[str, ...], slots: int,
               credential_digest: str, projects: tuple[str, ...] = ()) -> str:
        """A new Worker scoped to ``projects`` (none: every Project); its Worker ID.
        NotFoundError project_not_found, ConflictError worker_exists."""

    def enrolment(self, worker_id: str, credential_digest: str) -> Enrolment:
        """What the enrolment allows this Worker."""

    def describe(self, worker_id: str, credential_digest: str) -> WorkerInfo:
        """The Worker as the control plane knows it; read only."""

    def worker_for_credential(self, credential_digest: str) -> str | None:
        """The live Worker ID holding this credential, else None."""

    def open_session(self, worker_id: str, credential_digest: str, labels: dict[str, str],
                     executor_types: tuple[str, ...], slots: int, ttl_us: int,
                     adopt: list[tuple[str, int, str]] = ()) -> SessionGrant:
        """A new Session (generation + 1) adopting the qualifying Leases of ``adopt`` ((Attempt
        ID, lease generation, token digest)); every older Session closes, its other Leases fenced."""

    def heartbeat(self, worker_id: str, credential_digest: str, session_id: str, generation: int,
                  held: list[tuple[str, int]], session_ttl_us: int, lease_ttl_us: int,
                  renew_until_us: int | None = None) -> tuple[int, list[str], list[tuple[str, int]]]:
        """Extend the Session and the Leases ``held`` names ((Attempt ID, lease generation));
        (Session expiry µs, Attempt IDs whose cancel was requested, (Attempt ID, new Lease
        expiry µs) of each renewed Lease). ConflictError stale_generation, session_expired,
        heartbeat_late (``renew_until_us`` passed)."""

    def set_state(self, name: str, state: str) -> str:
        """``state``: a ``core.states.WorkerState`` (``DRAINING``, ``ACTIVE`` or ``REMOVED``); the
        Worker ID. NotFoundError for no live Worker."""

    def expire_sessions(self, limit: int) -> int:
        """Mark up to ``limit`` open Sessions past their expiry offline; how many."""

    def workers(self, limit: int, after: str | None = None) -> list[dict]:
        """Up to ``limit`` live Workers in name order (after the name ``after``)."""


class LogChunkStore(Protocol):
    """Uploaded Attempt logs (``adapters.postgres.logs.PgLogStore``)."""

    def append(self, fence: LeaseFence, offset: int, data: bytes, quota_bytes: int) -> tuple[int, bool]:
        """``data`` at byte ``offset``; (next expected offset, truncated). Bytes past
        ``quota_bytes`` advance the offset but are not kept. ConflictError also chunk_gap,
        chunk_mismatch."""


class JoinTokenStore(Protocol):
    """Join tokens (``adapters.postgres.join_tokens.PgJoinTokens``); policy and validation are
    ``cluster.joins.JoinTokens``'. Times in µs of the database clock."""

    def issue(self, token_id: str, worker_id: str, ttl_us: int) -> int:
        """Record a token for ``worker_id`` valid ``ttl_us`` µs from now; its expiry (µs)."""

    def redeem(self, token_id: str, worker_id: str, credential_digest: str) -> None:
        """Mark the token used. WorkerAuthError unless the credential is this live Worker's;
        NotFoundError join_token_not_found; ConflictError join_token_used, join_token_expired
        (nothing written)."""


class CredentialStore(Protocol):
    """Worker credentials re-issued (``adapters.postgres.credentials.PgCredentials``); policy is
    ``cluster.credentials.rotate_credential``'s."""

    def replace(self, name: str, credential_digest: str) -> str:
        """Store ``credential_digest`` (SHA-256 hex) for the live Worker ``name``: its Worker ID;
        its old credential fails from the next request on. NotFoundError ``worker_not_found``."""


class ClusterPlans(Protocol):
    """The plans of cluster candidates (``adapters.postgres.dispatch.PgPlanSource``)."""

    def prepare(self, candidate: ClusterCandidate) -> DispatchPlan | None:
        """The plan of the Run's pinned revision, or None when it cannot be built."""

    def prepare_with(self, tx, candidate: ClusterCandidate) -> DispatchPlan | None:
        """The same inside the caller's open transaction ``tx`` (the adapter's own handle)."""
