"""The Run/Attempt state machine (pure). Every transition the coordinator makes is checked here.

Run:     queued → starting → running → succeeded | failed | timed_out | cancelled | lost
         queued → cancelled;  queued → failed (its plan can never launch: secret or revision missing);  starting → failed (launch failure);  any live → queued (retry,
         with a new claimed Attempt).
Attempt: claimed → starting → running → succeeded | failed | timed_out | cancelled | lost;
         claimed → cancelled | start_failed;  starting|running → start_failed (the shim could not exec the task).

The cluster's own rows name their states here too (their transitions live in the PostgreSQL
adapter): ``WorkerState``, ``SessionState``, ``LeaseState``. The Worker inbox's states are
``core.inbox_states.InboxState``, what an ACK reports ``core.cluster.AckKind``. Why the agent or
a Worker signalled a task is a ``KillReason``.
"""

from __future__ import annotations

class RunState:
    """A Run's states, as stored and shown (plain strings: a namespace, as supervisor's
    ``states.py``, not an Enum class — cheaper to load on a router).

    ``ALL`` in lifecycle order; ``LIVE``: not ended (may still change); ``ACTIVE``: a process may
    exist; ``TERMINAL``: final."""

    QUEUED = "queued"
    STARTING = "starting"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    TIMED_OUT = "timed_out"
    CANCELLED = "cancelled"
    LOST = "lost"

    # The cluster authority only: a Lease is offered to a Worker (ADR-0014 §5); never stored locally.
    DISPATCHING = "dispatching"

    ALL = (QUEUED, STARTING, RUNNING, SUCCEEDED, FAILED, TIMED_OUT, CANCELLED, LOST)
    ALL_CLUSTER = (QUEUED, DISPATCHING, STARTING, RUNNING, SUCCEEDED, FAILED, TIMED_OUT, CANCELLED, LOST)
    LIVE = frozenset({QUEUED, STARTING, RUNNING})
    LIVE_CLUSTER = LIVE | {DISPATCHING}
    ACTIVE = frozenset({STARTING, RUNNING})
    TERMINAL = frozenset(ALL) - LIVE


class AttemptState:
    """An Attempt's states (see RunState); ``START_FAILED``: the task never ran."""

    CLAIMED = "claimed"
    STARTING = "starting"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    TIMED_OUT = "timed_out"
    CANCELLED = "cancelled"
    LOST = "lost"
    START_FAILED = "start_failed"

    ALL = (CLAIMED, STARTING, RUNNING, SUCCEEDED, FAILED, TIMED_OUT, CANCELLED, LOST, START_FAILED)
    LIVE = frozenset({CLAIMED, STARTING, RUNNING})
    ACTIVE = frozenset({STARTING, RUNNING})
    TERMINAL = frozenset(ALL) - LIVE
    # Attempts a retry policy may follow with a new Attempt (not after a cancel or success).
    RETRYABLE = frozenset({FAILED, TIMED_OUT, LOST, START_FAILED})


class WorkerState:
    """A cluster Worker's states (PostgreSQL ``workers.state``): ``ACTIVE`` gets offers,
    ``DRAINING`` gets none while its Leases run on, ``REMOVED`` has its Sessions closed, its
    Leases fenced and its name freed (``workers drain|resume|rm``)."""

    ACTIVE = "active"
    DRAINING = "draining"
    REMOVED = "removed"

    ALL = (ACTIVE, DRAINING, REMOVED)


class SessionState:
    """A Worker Session's states (``worker_sessions.state``): ``OPEN`` until its TTL passes
    (``EXPIRED``), a new Session of the same Worker replaces it (``REPLACED``) or its Worker is
    removed (``CLOSED``)."""

    OPEN = "open"
    REPLACED = "replaced"
    EXPIRED = "expired"
    CLOSED = "closed"

    ALL = (OPEN, REPLACED, EXPIRED, CLOSED)


class LeaseState:
    """A Run Lease's states (``run_leases.state``, ADR-0014): ``ACTIVE`` while its Worker holds
    it, ``COMPLETED`` once the completion ACK arrived (its log may still go up), ended by the
    sweeper (``EXPIRED``) or by fencing its Session (``FENCED``); ``ENDED``: a Lease that answers
    nothing more."""

    ACTIVE = "active"
    COMPLETED = "completed"
    EXPIRED = "expired"
    FENCED = "fenced"

    ALL = (ACTIVE, COMPLETED, EXPIRED, FENCED)
    ENDED = frozenset({EXPIRED, FENCED})


class KillReason:
    """Why the agent or a Worker signalled a task's process tree (a Worker's ACK
    ``killReason``): its deadline passed (``TIMEOUT``), a cancel was requested (``CANCEL``), the
    agent is shutting down (``SHUTDOWN``). The Attempt then ends ``timed_out`` or ``cancelled``
    whatever its exit status (``outcome``)."""

    TIMEOUT = "timeout"
    CANCEL = "cancel"
    SHUTDOWN = "shutdown"

    ALL = (TIMEOUT, CANCEL, SHUTDOWN)


_R, _A = RunState, AttemptState
_RUN = {
    _R.QUEUED: {_R.STARTING, _R.CANCELLED, _R.FAILED},
    # starting → a terminal state: the agent died between the claim and recording the shim,
    # and recovery finds the shim's receipt.
    _R.STARTING: {_R.RUNNING, _R.SUCCEEDED, _R.FAILED, _R.TIMED_OUT, _R.QUEUED, _R.CANCELLED, _R.LOST},
    _R.RUNNING: {_R.SUCCEEDED, _R.FAILED, _R.TIMED_OUT, _R.CANCELLED, _R.LOST, _R.QUEUED},
}
_ATTEMPT = {
    _A.CLAIMED: {_A.STARTING, _A.CANCELLED, _A.START_FAILED},
    _A.STARTING: {_A.RUNNING, _A.SUCCEEDED, _A.FAILED, _A.TIMED_OUT, _A.START_FAILED, _A.LOST, _A.CANCELLED},
    _A.RUNNING: {_A.SUCCEEDED, _A.FAILED, _A.TIMED_OUT, _A.CANCELLED, _A.LOST, _A.START_FAILED},
}


class IllegalTransition(Exception):
    pass


def check_run(src: str, dst: str) -> None:
    """Raise IllegalTransition unless Run ``src → dst`` is allowed."""
    if dst not in _RUN.get(src, ()):
        raise IllegalTransition(f"run {src} → {dst}")


def check_attempt(src: str, dst: str) -> None:
    """Raise IllegalTransition unless Attempt ``src → dst`` is allowed."""
    if dst not in _ATTEMPT.get(src, ()):
        raise IllegalTransition(f"attempt {src} → {dst}")


def outcome(exit_code: int | None, signal: int | None, start_error: str | None, kill_reason: str | None) -> str:
    """Terminal Attempt state from a completion receipt and why the agent signalled (if it did).

    ``kill_reason`` is a ``KillReason``: a task the agent stopped ends ``timed_out``/``cancelled``
    whatever its exit status; otherwise exit 0 → succeeded.
    """
    if start_error is not None:
        return AttemptState.START_FAILED
    if kill_reason == KillReason.TIMEOUT:
        return AttemptState.TIMED_OUT
    if kill_reason in (KillReason.CANCEL, KillReason.SHUTDOWN):
        return AttemptState.CANCELLED
    return AttemptState.SUCCEEDED if exit_code == 0 and signal is None else AttemptState.FAILED


def retryable(attempt_state: str) -> bool:
    """Attempts that a retry policy may follow with a new Attempt (not after a cancel or success)."""
    return attempt_state in AttemptState.RETRYABLE


def backoff_ms(base_ms: int, attempt_no: int) -> int:
    """Delay before attempt ``attempt_no + 1``: ``base * 2**(attempt_no-1)``, capped at 1 day."""
    return min(base_ms * (2 ** max(0, attempt_no - 1)), 86_400_000)
