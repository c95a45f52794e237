"""Cluster records and ports (ADR-0014, ADR-0108, ADR-0109): what the cluster policy
(``qlagent.cluster``) needs from its authority, and what the PostgreSQL adapter
(``qlagent.adapters.postgres``) returns. Pure data and Protocols: no I/O.

Times are integer µs since the Unix epoch, always read from the authority's clock.
Keys (``key()``) are the keyset order the authority pages in; a page's ``next_cursor`` is the key
of its last row when more rows exist (``truncated``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, TypeVar

import msgspec

from .errors import EXIT_USAGE, ConflictError, QlError
from .models import RetryPolicy
from .states import AttemptState, RunState, backoff_ms, retryable

T = TypeVar("T")                 # what a PullUnit's work returns


class ClusterCandidate(msgspec.Struct, frozen=True):
    """A queued Run whose latest Attempt is ``claimed`` by the ``remote_worker`` executor.

    ``executor_type`` is the executor the remote Worker must run (pinned when the Run was
    created, e.g. ``local_process``); ``lease_generation`` is the last one issued (0 = never);
    ``single_instance``: the Task's ``concurrency = "single"`` (claimed only while no other Run
    of the Task is live).
    """

    run_id: str
    attempt_id: str
    project_id: str
    task_id: str
    task_revision: int
    executor_type: str
    version: int
    priority: int
    created_at_us: int
    attempt_created_at_us: int
    lease_generation: int
    single_instance: bool = False

    def key(self) -> tuple:
        return (-self.priority, self.created_at_us, self.attempt_created_at_us, self.attempt_id)


class WorkerSnapshot(msgspec.Struct, frozen=True):
    """One Worker's current Session as the Registry holds it (labels/executors/slots already
    narrowed by the Session hello); ``projects``: the Project IDs of its enrolment, empty for
    every Project."""

    worker_id: str
    session_id: str
    generation: int
    labels: dict[str, str]
    executor_types: tuple[str, ...]
    slots: int
    free_slots: int
    draining: bool = False
    projects: tuple[str, ...] = ()

    def key(self) -> tuple:
        return (self.worker_id,)

    def serves(self, project_id: str) -> bool:
        """May this Worker be offered a Run of ``project_id``?"""
        return not self.projects or project_id in self.projects


class Lease(msgspec.Struct, frozen=True):
    """A committed Run Lease (the recovery authority; ADR-0014 §5). ``token_digest`` is the
    SHA-256 hex of the opaque lease token; the token itself is never stored."""

    attempt_id: str
    run_id: str
    lease_generation: int
    worker_id: str
    session_id: str
    worker_generation: int
    token_digest: str
    state: str                      # active | completed | expired | fenced
    claimed_at_us: int
    expires_at_us: int
    pull_id: str | None = None


class Page(msgspec.Struct, frozen=True):
    """One bounded page from the authority: at most the requested ``limit`` items; ``truncated``
    when more rows follow, then ``next_cursor`` is the last item's key."""

    items: list
    truncated: bool = False
    next_cursor: tuple | None = None


class ClaimStatus:
    """``ClaimOutcome.status`` values."""

    CLAIMED = "claimed"
    WORKER_UNAVAILABLE = "worker_unavailable"
    ATTEMPT_UNAVAILABLE = "attempt_unavailable"


class ClaimOutcome(msgspec.Struct, frozen=True):
    """``claimed`` (with ``lease``); ``worker_unavailable`` (Session replaced/expired/draining or
    no free slot: another Worker may be tried); ``attempt_unavailable`` (leased, cancelled or the
    Run version moved: stop this candidate)."""

    status: str
    reason: str | None = None
    lease: Lease | None = None


class DispatchPlan(msgspec.Struct, frozen=True):
    """What ``PlanSource.prepare`` materialises for one candidate, from the Run's pinned
    Project/Task/revision: a raw ExecutionSpec document and the Task's Placement document."""

    spec: dict
    placement: dict


class AttemptEnd(msgspec.Struct, frozen=True):
    """How an Attempt ended, for the Run's retry decision."""

    attempt_state: str
    attempt_no: int
    retry: RetryPolicy | None
    cancel_requested: bool


class RunDecision(msgspec.Struct, frozen=True):
    """``retry`` → a new claimed Attempt not before ``backoff_ms``; else the Run ends in ``run_state``."""

    retry: bool
    run_state: str
    backoff_ms: int = 0


def decide_after_attempt(end: AttemptEnd) -> RunDecision:
    """The Run's next state after its Attempt ended (the Task's retry policy decides).

    A cancelled Run never retries; ``lost``/``failed``/``timed_out``/``start_failed`` retry while
    ``attempt_no < retry.max_attempts``; otherwise the Run takes the Attempt's state
    (``start_failed`` → ``failed``).
    """
    if end.cancel_requested:
        return RunDecision(False, RunState.CANCELLED)
    if end.retry and retryable(end.attempt_state) and end.attempt_no < end.retry.max_attempts:
        return RunDecision(True, RunState.QUEUED, backoff_ms(end.retry.backoff_ms, end.attempt_no))
    return RunDecision(False, RunState.FAILED if end.attempt_state == AttemptState.START_FAILED else end.attempt_state)


class QuickStatus:
    """``QuickPull.status`` values."""

    LEASED = "leased"
    NO_OFFER = "no_offer"
    WALK = "walk"


class QuickPull(msgspec.Struct, frozen=True):
    """What ``PullStore.quick_pull`` did: ``leased`` (``candidate`` leased by ``lease``),
    ``no_offer`` (the Pull's answer is idle: ``reason`` draining | no_free_slot, or None: no
    candidate; ``held``: candidates other Pulls hold, asked of a waiting Pull), or ``walk``
    (nothing decided: run the Pull unit, the ADR-0014 walk)."""

    status: str
    reason: str | None = None
    held: bool = False
    candidate: ClusterCandidate | None = None
    lease: Lease | None = None


class PlanSource(Protocol):
    def prepare(self, candidate: ClusterCandidate) -> DispatchPlan | None:
        """The plan of the Run's pinned revision, or None when it cannot be rebuilt."""


class SecretResolver(Protocol):
    def resolve(self, project_id: str, names: list[str]) -> dict[str, bytes]:
        """Plaintext of each SecretRef; raises UnavailableError ``secret_missing`` or
        ``secret_unreadable`` with ``field`` = the Secret's name (never its value)."""


class PullUnit(Protocol):
    """One Worker Pull inside ONE transaction of the authority (ADR-0108): ``worker`` is the
    authenticated Session, its row locked until the unit ends (its free slots counted under that
    lock), ``now_us`` the authority's clock when the unit began. Candidate pages lock the Runs
    they return and skip Runs other units hold (``FOR UPDATE SKIP LOCKED``), so concurrent
    Pulls take different Runs; a claim needs no further check of the Session or the Run."""

    worker: WorkerSnapshot
    now_us: int

    def prior(self) -> tuple[Lease, ClusterCandidate, str] | None:
        """The Lease this unit's pullId already created, its candidate and the Attempt's state."""

    def candidate_page(self, observed_at_us: int, limit: int, after: tuple | None) -> Page:
        """Unheld cluster candidates in ``ClusterCandidate.key()`` order, locked for this unit."""

    def held_elsewhere(self, observed_at_us: int) -> bool:
        """Are candidates visible that this unit's pages did not return (held by concurrent
        units for the moment, or queued since)?"""

    def prepare(self, candidate: ClusterCandidate) -> DispatchPlan | None:
        """``PlanSource.prepare`` read within this unit."""

    def claim(self, candidate: ClusterCandidate, worker: WorkerSnapshot, token_digest: str,
              lease_ttl_us: int, pull_id: str | None = None) -> ClaimOutcome:
        """Lease a candidate of this unit's pages to this unit's Session."""


class PullStore(Protocol):
    def pull_unit(self, worker_id: str, credential_digest: str, session_id: str, generation: int, pull_id: str,
                  work: Callable[[PullUnit], T]) -> T:
        """Run ``work`` in one transaction over the Worker's current open Session and return its
        result; committed when ``work`` returns, rolled back when it raises. WorkerAuthError,
        ConflictError ``stale_generation`` / ``session_expired`` / ``lease_exists`` (the
        database refused a second active Lease), UnavailableError."""

    def quick_pull(self, worker_id: str, credential_digest: str, session_id: str, generation: int, pull_id: str,
                   token_digest: str, lease_ttl_us: int, claimable: list[str], waiting: bool) -> QuickPull:
        """A Pull's usual case in one call, outside ``pull_unit``: the current open Session,
        free and not draining, and its first candidate claimed when that candidate's key
        ``task:revision:project:executor`` is in ``claimable`` (this Session's Placement and the
        revision's plan were decided before for that key); ``walk`` for anything else (another
        Session or generation, a pullId seen before, another candidate, a claim refused).
        ConflictError ``lease_exists``, UnavailableError."""

    def fail_claimed(self, attempt_id: str, lease_generation: int, reason: str) -> str | None:
        """In its own transaction, after the Pull's unit committed: end an active Lease whose
        Attempt is still ``claimed`` because its offer cannot be built (a Secret missing or
        unreadable): Lease ``completed``, Attempt ``start_failed`` with ``reason``, the retry
        policy decides the Run. Returns the Run's new state, or None when that Lease had already
        ended (nothing written)."""


class WorkerAuthError(QlError):
    """The Worker credential does not name a live, enrolled Worker (or not this Worker ID)."""

    code = "worker_unauthorized"
    exit_code = EXIT_USAGE


class ChunkConflict(ConflictError):
    """A log chunk refused at its offset (``chunk_gap``: beyond the received end;
    ``chunk_mismatch``: the offset holds other bytes). ``next_offset`` (bytes) is where the
    Worker resumes its upload."""

    def __init__(self, message: str, *, code: str, next_offset: int) -> None:
        super().__init__(message, code=code)
        self.next_offset = next_offset


class AckKind:
    """What an ACK reports (docs/worker-protocol.md "ACK"): not a state, the step the Worker
    took; the control plane moves the Attempt by it (``cluster.acks``)."""

    STARTING = "starting"
    RUNNING = "running"
    START_FAILURE = "start_failure"
    COMPLETION = "completion"

    ALL = (STARTING, RUNNING, START_FAILURE, COMPLETION)


class Ack(msgspec.Struct, frozen=True, rename="camel", forbid_unknown_fields=True, kw_only=True):
    """A Worker fact about one leased Attempt (ADR-0109), fenced by Session, generation, lease
    generation and lease token. ``kind``: starting | running | start_failure | completion.
    Completion carries the exit code or signal, why the Worker signalled the task (``kill_reason``,
    a ``core.states.KillReason``), figures (bytes, µs) and, when the log lost bytes for another
    reason than its quota, ``truncation_reason`` (``write_error: ENOSPC (No space left on
    device)``, core.receipt.TruncationFact; absent: the quota)."""

    session_id: str
    generation: int
    attempt_id: str
    lease_generation: int
    lease_token: str
    kind: str
    exit_code: int | None = None
    signal: int | None = None
    kill_reason: str | None = None
    start_error: str | None = None
    bytes_kept: int | None = None
    bytes_dropped: int | None = None
    peak_rss_bytes: int | None = None
    cpu_time_us: int | None = None
    truncation_reason: str | None = None

    def __repr__(self) -> str:
        return f"Ack({self.kind}, attempt={self.attempt_id}, lease={self.lease_generation})"


class AckResult(msgspec.Struct, frozen=True, rename="camel"):
    """States after the ACK; ``replay`` when it had already been applied (nothing changed)."""

    attempt_state: str
    run_state: str
    replay: bool = False


class LeaseFence(msgspec.Struct, frozen=True, kw_only=True):
    """What a Worker presents to act on one Lease (ACKs, log chunks): its Session and
    generation, the Lease's Attempt and generation, and the SHA-256 of its lease token."""

    worker_id: str
    credential_digest: str
    session_id: str
    generation: int
    attempt_id: str
    lease_generation: int
    token_digest: str


# Leases one hello may ask to adopt (docs/worker-protocol.md "Sessions and adoption"): a
# Worker's live runs (≤ its slots, ≤ 256) are what matters; completed-but-unacknowledged rows
# come after them, and the rest of those are let go.
MAX_ADOPT = 64

# Why a Lease named in ``Hello.adopt`` was not adopted (``AdoptRefusal.reason``).
ADOPT_REFUSALS = ("lease_not_found", "lease_token_mismatch", "lease_not_active", "lease_expired", "not_started",
                  "run_cancelled")


class AdoptedLease(msgspec.Struct, frozen=True, rename="camel"):
    """A Lease re-bound to the new Session/generation; ``expires_at_us`` its expiry (µs,
    database clock), unchanged by the adoption."""

    attempt_id: str
    lease_generation: int
    expires_at_us: int


class AdoptRefusal(msgspec.Struct, frozen=True, rename="camel"):
    """A Lease the hello named but the new Session did not adopt (``reason``: one of
    ``ADOPT_REFUSALS``); the Worker self-fences it and drops what it owed for it."""

    attempt_id: str
    lease_generation: int
    reason: str


class SessionGrant(msgspec.Struct, frozen=True, rename="camel"):
    """An opened Session: labels/executors/slots as narrowed by the hello; expiry in µs; the
    Leases of ``Hello.adopt`` adopted or refused (together: every one named, Attempt ID order)."""

    worker_id: str
    session_id: str
    generation: int
    labels: dict[str, str]
    executor_types: tuple[str, ...]
    slots: int
    expires_at_us: int
    adopted: tuple[AdoptedLease, ...] = ()
    refused: tuple[AdoptRefusal, ...] = ()


class Enrolment(msgspec.Struct, frozen=True):
    worker_id: str
    name: str
    labels: dict[str, str]
    executor_types: tuple[str, ...]
    slots: int
    state: str                      # active | draining | removed


class WorkerInfo(msgspec.Struct, frozen=True, rename="camel"):
    """``GET /api/v3/cluster/workers/{workerId}`` (read-only, docs/worker-protocol.md): what the
    control plane knows of the Worker whose credential asks: its name, state (``active`` /
    ``draining``), current generation (of its last Session; 0 before any) and enrolment."""

    worker_id: str
    name: str
    state: str                      # active | draining
    generation: int
    labels: dict[str, str]
    executor_types: tuple[str, ...]
    slots: int
    # The replica's Session TTL (s): a Worker checks its heartbeat cadence against it before
    # it opens a Session. None from a replica older than the field.
    session_ttl_s: int | None = None


class CandidateSignal(Protocol):
    def seq(self) -> int:
        """The current wake-up number (take it before reading candidates)."""

    def wait(self, seq: int, timeout_s: float) -> bool:
        """Block until a candidate may have appeared after ``seq``, or ``timeout_s`` (s)."""


# ---- Worker protocol bodies (docs/worker-protocol.md). Plain Structs kept in core so that a
# fleet Worker decodes them without importing the control plane (``qlagent.cluster``).

class AdoptClaim(msgspec.Struct, frozen=True, rename="camel", forbid_unknown_fields=True, kw_only=True):
    """A Lease a restarted Worker still holds and proves with its token (sent over TLS only,
    never logged: ``repr`` leaves it out)."""

    attempt_id: str
    lease_generation: int
    lease_token: str

    def __repr__(self) -> str:
        return f"AdoptClaim(attempt={self.attempt_id}, lease={self.lease_generation})"

    __str__ = __repr__


_HELLO_CONFIG = {"labels": "worker.labels", "executorTypes": "worker.executors", "slots": "worker.slots"}


def hello_config_field(wire_field: str | None) -> str | None:
    """The ``[worker]`` key a refused hello field comes from (``hello.labels.site`` →
    ``worker.labels.site``), or None for any other field."""
    parts = (wire_field or "").split(".")
    if len(parts) < 2 or parts[0] != "hello" or parts[1] not in _HELLO_CONFIG:
        return None
    return ".".join([_HELLO_CONFIG[parts[1]], *parts[2:]])


class Hello(msgspec.Struct, frozen=True, rename="camel", forbid_unknown_fields=True, kw_only=True):
    """What a Worker announces when it opens a Session; None keeps the enrolment's value.
    ``adopt`` (≤ ``MAX_ADOPT``): the Leases of older Sessions it asks the new one to take over."""

    labels: dict[str, str] | None = None
    executor_types: tuple[str, ...] | None = None
    slots: int | None = None
    adopt: tuple[AdoptClaim, ...] = ()


# Leases one heartbeat may name (docs/worker-protocol.md, heartbeat row): a Worker's live runs
# (≤ its slots, ≤ 64 by the Profile) come first, then completions still owed.
MAX_HELD = 64


class HeldLease(msgspec.Struct, frozen=True, rename="camel", forbid_unknown_fields=True, kw_only=True):
    """A Lease a Worker still holds and asks a heartbeat to renew (no token: the Session and
    generation of the heartbeat are the fence, and only Leases of that Session are renewed)."""

    attempt_id: str
    lease_generation: int


class HeartbeatRequest(msgspec.Struct, frozen=True, rename="camel", forbid_unknown_fields=True, kw_only=True):
    """Body of ``POST …/heartbeat``: the Session being renewed, its generation, and ``leases``
    (≤ ``MAX_HELD``): the Leases of this Session the Worker still holds. Only those are renewed;
    a Lease of the Session left out (its run self-fenced, dropped or never started) runs out and
    the lease sweeper ends it (issue 11 §6)."""

    session_id: str
    generation: int
    leases: tuple[HeldLease, ...] = ()
    # Database clock µs after which the Worker no longer waits for the answer (its estimate,
    # early-biased); a heartbeat the control plane would apply later is refused, nothing renewed.
    # None: no limit (a Worker older than the field).
    renew_until_us: int | None = None


class LeaseExpiry(msgspec.Struct, frozen=True, rename="camel"):
    """One Lease a heartbeat renewed and its new expiry (µs, database clock)."""

    attempt_id: str
    expires_at_us: int


class Heartbeat(msgspec.Struct, frozen=True, rename="camel"):
    """A renewed Session: its new expiry (µs, database clock), the Attempt IDs whose cancel
    was requested and each renewed Lease's expiry (the Worker's fencing deadline follows it)."""

    expires_at_us: int
    cancel: list[str]
    leases: list[LeaseExpiry] = []


class PullRequest(msgspec.Struct, frozen=True, rename="camel", forbid_unknown_fields=True, kw_only=True):
    session_id: str
    generation: int
    pull_id: str
    lease_token: str

    def __repr__(self) -> str:
        return f"PullRequest(session={self.session_id}, pull={self.pull_id})"


class ExecutionSpec(msgspec.Struct, frozen=True, rename="camel", kw_only=True):
    """What a Worker needs to launch one Attempt (ADR-0014 §2 step 5, §3); built and validated
    by ``cluster.execspec.sanitize``. Holds the command and environment: never logged."""

    run_id: str
    attempt_id: str
    project_id: str
    task_id: str
    task_revision: int
    # The Task's name at that revision (QL3_TASK_NAME, as a local launch); "" from a replica
    # older than the field.
    task_name: str = ""
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
    on_lease_loss: str = "kill"        # kill | keep: what the Worker does when it cannot renew the Lease

    def __repr__(self) -> str:         # never the command or environment
        return f"ExecutionSpec(attempt={self.attempt_id})"


class ClaimedExecutionOffer(msgspec.Struct, frozen=True, rename="camel", kw_only=True):
    """ADR-0014 §3: the capability handed to exactly one Worker Session after its Run Lease
    committed (``cluster.offer``). ``repr`` shows identities only."""

    offer_id: str
    source: str                       # new_claim | lease_recovery
    run_id: str
    attempt_id: str
    project_id: str
    task_id: str
    task_revision: int
    worker_id: str
    session_id: str
    generation: int
    lease_generation: int
    lease_expires_at_us: int
    lease_token: str
    spec_digest: str
    spec: ExecutionSpec
    placement_score: int | None = None     # new claims only; a recovery does not recompute it
    secrets: dict[str, bytes] = {}         # environment name → plaintext, resolved after the claim

    def __repr__(self) -> str:
        return (f"ClaimedExecutionOffer(offer={self.offer_id}, attempt={self.attempt_id}, "
                f"worker={self.worker_id}, source={self.source})")

    __str__ = __repr__


class PullAnswer(msgspec.Struct, frozen=True, rename="camel", kw_only=True):
    """``status``: offered | idle | unmatched | truncated | refused | lease_ended. Only
    ``offered`` carries an offer; the others a short ``reason``."""

    status: str
    reason: str | None = None
    offer: ClaimedExecutionOffer | None = None


# One log chunk (issue 10 §9): the Worker sends whole chunks of this size while a run goes on,
# and the control plane refuses a larger one.
MAX_CHUNK_BYTES = 262_144


class ChunkAnswer(msgspec.Struct, frozen=True, rename="camel"):
    """A log chunk's answer: the next offset the control plane expects (bytes) and whether the
    quota truncated what it keeps."""

    next_offset: int
    truncated: bool
