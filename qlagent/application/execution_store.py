"""The SQLite authority seen through the dispatcher's and coordinator's ports.

Every call is one operation on the single authority queue; writes are BEGIN IMMEDIATE.
"""

from __future__ import annotations

from ..adapters.sqlite import execution as ex
from ..core.dispatch import Candidate, Finish, LiveAttempt, Plan
from ..core.models import RetryPolicy
from .secrets import resolve_secrets
from .store import LocalStore, now_us


class SqliteExecutionStore:
    """Implements core.ports.DispatchStore and core.ports.ExecutionStore."""

    def __init__(self, store: LocalStore, key_file: str, clock_us=now_us) -> None:
        self._s = store
        self._key_file = key_file
        self._now = clock_us
        self.queries = 0          # candidate reads, for paging tests and STATUS

    # DispatchStore
    def candidate_page(self, limit: int, after: tuple | None) -> list[Candidate]:
        self.queries += 1
        now = self._now()
        return self._s.read(lambda c: ex.candidate_page(c, limit, after, now))

    def reread(self, c: Candidate) -> bool:
        return self._s.read(lambda conn: ex.reread_candidate(conn, c))

    def load_plan(self, c: Candidate) -> tuple[Plan | None, str | None]:
        return self._s.read(lambda conn: ex.load_plan(conn, c.task_id, c.task_revision))

    def resolve_secrets(self, project_id: str, names: list[str]) -> dict[str, bytes]:
        return self._s.read(lambda conn: resolve_secrets(conn, self._key_file, project_id, names))

    def fail_unlaunched(self, c: Candidate, reason: str, retry: RetryPolicy | None,
                        start_error: str | None = None) -> None:
        f = Finish("start_failed", failure_reason=reason, start_error=start_error)
        self._s.write(lambda conn: ex.finish_attempt(conn, c.run_id, c.attempt_id, f, retry, self._now())
                      if ex.reread_candidate(conn, c) else None)

    # ExecutionStore
    def claim_starting(self, c: Candidate, artifact_path: str) -> bool:
        return self._s.write(lambda conn: ex.claim_starting(conn, c, artifact_path, self._now()))

    def mark_running(self, c: Candidate, wrapper_pid: int, wrapper_start: float, deadline_us: int) -> None:
        self._s.write(lambda conn: ex.mark_running(conn, c.run_id, c.attempt_id, wrapper_pid, wrapper_start,
                                                   deadline_us, self._now()))

    def set_task_pgid(self, attempt_id: str, pgid: int) -> None:
        self._s.write(lambda conn: ex.set_task_pgid(conn, attempt_id, pgid))

    def finish(self, run_id: str, attempt_id: str, f: Finish, truncation: dict | None,
               retry: RetryPolicy | None) -> str:
        def tx(conn):
            now = self._now()
            if truncation is not None:
                ex.record_truncation(conn, attempt_id, truncation["quota_bytes"], truncation["bytes_kept"],
                                     f.bytes_dropped, now)
            return ex.finish_attempt(conn, run_id, attempt_id, f, retry, now)
        return self._s.write(tx)

    def live_attempts(self) -> list[LiveAttempt]:
        return self._s.read(ex.live_attempts)

    def cancel_requested(self) -> set[str]:
        return {a.attempt_id for a in self._s.read(ex.live_attempts) if a.cancel_requested}

    def retry_policy(self, task_id: str, revision: int) -> RetryPolicy | None:
        plan, _ = self._s.read(lambda conn: ex.load_plan(conn, task_id, revision))
        return plan.retry if plan else None

    def timing(self, task_id: str, revision: int) -> tuple[int, int]:
        plan, _ = self._s.read(lambda conn: ex.load_plan(conn, task_id, revision))
        return (plan.timeout_ms, plan.grace_ms) if plan else (3_600_000, 5_000)

    # service helpers
    def active_count(self) -> int:
        return self._s.read(ex.active_count)

    def task_live_count(self, task_id: str) -> int:
        return self._s.read(lambda conn: ex.task_live_count(conn, task_id))

    def next_backoff_us(self) -> int | None:
        now = self._now()
        return self._s.read(lambda conn: ex.next_backoff_us(conn, now))

    def claimed_attempt_ids(self) -> list[str]:
        return self._s.read(ex.claimed_attempt_ids)
