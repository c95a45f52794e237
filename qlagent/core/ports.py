"""Ports: what the dispatcher and the coordinator need from the outside world (ADR-0071 §1).

Adapters (SQLite, filesystem, processes) implement these; the application wires them. The
dispatcher and coordinator see nothing else — no connection, no path, no Popen.
"""

from __future__ import annotations

from typing import Protocol

from .dispatch import Candidate, Finish, LaunchCommand, LiveAttempt, Plan
from .models import RetryPolicy


class DispatchStore(Protocol):
    def candidate_page(self, limit: int, after: tuple | None) -> list[Candidate]:
        """Up to ``limit + 1`` candidates in keyset order after ``after``."""

    def reread(self, c: Candidate) -> bool:
        """Is the exact candidate still queued with the same version and claimed Attempt?"""

    def load_plan(self, c: Candidate) -> tuple[Plan | None, str | None]:
        """Pinned execution revision + recipe, or (None, ``revision_missing``/``recipe_missing``)."""

    def resolve_secrets(self, project_id: str, names: list[str]) -> dict[str, bytes]:
        """Plaintext of each de-duplicated SecretRef; raises UnavailableError(secret_missing …)."""

    def fail_unlaunched(self, c: Candidate, reason: str, retry: RetryPolicy | None,
                        start_error: str | None = None) -> None:
        """End a candidate that can never launch as it stands (no process): Attempt
        ``start_failed`` with ``reason`` (a code) and ``start_error`` (the bounded text)."""


class ArtifactPort(Protocol):
    def admit(self, quota_bytes: int) -> str | None:
        """None if one full log fits above the reserve and within the total quota, else a reason."""

    def allocate(self, attempt_id: str) -> str:
        """Create the private log file. Raises errors.StartError (code artifact_unusable) when
        something is already at its path: the dispatcher is the only allocator of an Attempt's
        path and recovery removes its own leftovers, so this is never a race, and the Run
        could never start."""

    def discard(self, path: str) -> None:
        """Remove a log file this pass created but could not use."""


class Admission(Protocol):
    def global_block(self) -> str | None:
        """A reason no Run may start now (draining, concurrency, pids, memory), or None."""

    def run_block(self, c: Candidate, plan: Plan) -> str | None:
        """A reason this Run must wait (single_instance, network), or None."""


class ExecutionStore(Protocol):
    def claim_starting(self, c: Candidate, artifact_path: str) -> bool: ...
    def mark_running(self, c: Candidate, wrapper_pid: int, wrapper_start: float, deadline_us: int) -> None: ...
    def set_task_pgid(self, attempt_id: str, pgid: int) -> None: ...
    def finish(self, run_id: str, attempt_id: str, f: Finish, truncation: dict | None,
               retry: RetryPolicy | None) -> str: ...
    def live_attempts(self) -> list[LiveAttempt]: ...
    def cancel_requested(self) -> set[str]:
        """Attempt IDs of live Runs whose cancellation was requested."""
    def retry_policy(self, task_id: str, revision: int) -> RetryPolicy | None: ...
    def timing(self, task_id: str, revision: int) -> tuple[int, int]: ...


class ProcessPort(Protocol):
    """Launcher wrapper processes (``adapters.processes``)."""

    def spawn(self, cmd: LaunchCommand) -> tuple[int, float]:
        """Start the launcher in its own session and wait for its start status; returns
        (pid, create_time) once the task was exec'd. Raises errors.StartError with the reason
        when it was not (nothing of the Run is left running; the run directory remains)."""

    def watch(self, pid: int) -> int | None:
        """A pidfd that becomes readable when ``pid`` exits, or None where pidfds are missing."""

    def alive(self, pid: int, create_time: float) -> bool:
        """Is this exact process (PID-reuse safe) still running?"""

    def reap(self, pid: int) -> None:
        """Collect the exit status if ``pid`` is our child (no zombie)."""

    def signal_run(self, attempt_id: str, wrapper_pid: int | None, sig: int) -> int:
        """Signal the task's process group and every descendant of the wrapper (never the
        wrapper itself); returns how many processes were signalled."""

    def collect(self, attempt_id: str) -> tuple[dict | None, dict | None]:
        """(completion receipt, truncation fact) left by the wrapper, or None for each."""

    def cleanup(self, attempt_id: str) -> None:
        """Remove the run directory once its facts are in the store."""


from .inbox_states import InboxEntry, InboxOffer, PendingPull  # noqa: E402  (kept beside its port)


class InboxPort(Protocol):
    """The Worker's durable inbox (ADR-0021; states and rules in ``core.inbox_states``). Every
    method commits durably (fsync) before it returns; nothing of a refused call is written."""

    def begin_pull(self, session_id: str, generation: int, pull_id: str, lease_token: str) -> PendingPull:
        """The Pull request to send: the kept one if it belongs to this Session and generation
        (a retry, byte-identical), else the fresh ``pull_id``/``lease_token`` kept first."""

    def end_pull(self, pull_id: str) -> None:
        """Forget the kept Pull request after its answer arrived (idle, refused or offered)."""

    def receive(self, offer: InboxOffer, pull_id: str | None = None) -> tuple[InboxEntry, bool]:
        """Keep ``offer`` in state ``received`` (and end ``pull_id``) in one commit; returns
        (entry, True) for a new offer, (existing entry, False) for a retry of the same offer.
        Raises ValidationError, OfferConflict (recorded on the kept row), InboxFull."""

    def advance(self, offer_id: str, state: str, outcome: dict | None = None) -> InboxEntry:
        """Move one row to ``state`` (``outcome`` required for ``completed``). Raises
        NotFoundError, IllegalInboxTransition, ValidationError (outcome over the byte cap)."""

    def get(self, offer_id: str) -> InboxEntry | None: ...

    def open_entries(self) -> list[InboxEntry]:
        """Rows not yet acknowledged, in receipt order (what a restarted Worker recovers)."""

    def usage(self) -> tuple[int, int]:
        """(rows, bytes) counted against the Profile's inbox caps."""
