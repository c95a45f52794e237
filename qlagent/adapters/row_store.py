"""``RowStore``: the store-port methods the SQLite and PostgreSQL authorities implement alike
(ADR-0014 "only the Repository and transport change"; ``core.ports``).

Each method is one ``read`` or ``write`` unit of the subclass over the row functions of
``adapters/rows/`` (``policy``, ``definitions``, ``runs``, ``execution``, ``secrets``), which
the subclass hands a ``rows.dialect.Db`` of its connection or cursor. Inside a unit, time is
``_tx_now(conn)`` (µs: the SQLite store's clock, the PostgreSQL store's database clock) and new
Attempts are of ``executor_type``. What really differs — opening, the transactions themselves,
candidate pages — stays in ``sqlite.store`` and ``postgres.store``; where a shared unit differs
by a step (a schedule fire's record, the lock Run creations take) the subclass fills a hook
(``_record_fire``, ``_write_creating_runs``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from ..core.definitions import PreparedTask, check_executor, check_project_name
from ..core.dispatch import Candidate, Finish, LiveAttempt, Plan
from ..core.errors import NotFoundError
from ..core.ids import new_id
from ..core.models import (
    Admission,
    Attempt,
    ContextRecipe,
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
from ..core.receipt import TruncationFact
from ..core.states import AttemptState
from .rows import definitions as defs
from .rows import execution as ex
from .rows import policy, runs, secrets
from .rows.dialect import Db

T = TypeVar("T")
DEFAULT_TIMEOUT_MS = 3_600_000      # timing() of a revision that is gone (recovery only)
DEFAULT_GRACE_MS = 5_000


class _Rollback(Exception):
    """Carries a dry run's result out of the transaction it rolls back."""

    def __init__(self, result) -> None:
        self.result = result


class RowBatch:
    """``core.ports.DefinitionBatch`` on the connection/cursor of one open write transaction."""

    def __init__(self, store: RowStore, conn: Db, now_us: int) -> None:
        self._s, self._c, self._now = store, conn, now_us

    def get_head(self, project_id: str, name_or_id: str) -> TaskHead | None:
        try:
            return defs.get_head(self._c, project_id, name_or_id)
        except NotFoundError:
            return None

    def list_heads(self, project_id: str) -> list[TaskHead]:
        return defs.list_heads(self._c, project_id)

    def add_task(self, project_id: str, prepared: PreparedTask) -> TaskHead:
        check_executor(prepared.definition, self._s.executor_type)
        return defs.add_task(self._c, project_id, prepared, self._now)

    def edit_task(self, project_id: str, name_or_id: str, expected_revision: int, expected_digest: str,
                  prepared: PreparedTask) -> TaskHead:
        check_executor(prepared.definition, self._s.executor_type)
        return defs.edit_task(self._c, project_id, name_or_id, expected_revision, expected_digest, prepared,
                                       self._now)

    def ciphertexts(self, project_id: str, names: list[str]) -> dict[str, bytes]:
        return secrets.ciphertexts(self._c, project_id, names)

    def put_secret(self, project_id: str, name: str, ciphertext: bytes, key_id: str) -> None:
        secrets.put_secret(self._c, project_id, name, ciphertext, key_id, self._now)


class RowStore:
    """Base of ``SqliteStore`` and ``PgStore``: a subclass provides ``read(fn)``/``write(fn)``
    (``fn(db)`` in one read-only / write transaction, ``db`` a ``rows.dialect.Db``),
    ``_tx_now(db)``, ``executor_type`` and ``task_start``/``candidate_page`` (and may run single-statement
    reads outside a transaction: ``read_single``). Errors are those of the row functions
    (NotFoundError, ConflictError, ValidationError …) and of the subclass's transactions
    (UnavailableError)."""

    executor_type: str
    # Opened with create_project="on_write" for a Project not stored yet: ``project`` (ID handed
    # out already) is inserted by the first write transaction, so a refused write leaves none.
    _pending_project: Project | None = None

    def _open_project(self, name: str, create_project: bool | str) -> Project:
        """The Project the store acts in (``SqliteStore``/``PgStore`` ``create_project``): True
        creates ``name`` now, False raises NotFoundError for an unknown one, ``"on_write"``
        returns an unstored Project (fresh ID, version 1) that the first successful write
        transaction creates. ValidationError for a malformed unknown name, before any write."""
        if create_project is True:
            return self.ensure_project(name)
        try:
            return self.get_project(name)
        except NotFoundError:
            check_project_name(name)        # a malformed name is bad input, not "not found"
            if create_project != "on_write":
                raise
        self._pending_project = Project(project_id=new_id(), name=name, project_version=1, active=True)
        return self._pending_project

    def _with_pending_project(self, fn: Callable[..., T]) -> Callable[..., T]:
        """``fn`` preceded, in its transaction, by the creation of the pending Project if any."""
        pending = self._pending_project
        if pending is None:
            return fn

        def tx(c):
            policy.ensure_project(c, pending.name, self._tx_now(c), pending.project_id)
            return fn(c)
        return tx

    def _committed(self, result: T) -> T:
        """After a write transaction committed: the pending Project (if any) is stored now."""
        self._pending_project = None
        return result

    def read_single(self, fn: Callable[..., T]) -> T:
        """``read(fn)`` for an ``fn`` that runs ONE statement: a statement reads one snapshot of
        its own, so a store may run it outside any transaction (``PgStore``: one round trip)."""
        return self.read(fn)

    # ---- PolicyStore ---------------------------------------------------------------------------
    def ensure_project(self, name: str) -> Project:
        return self.write(lambda c: policy.ensure_project(c, name, self._tx_now(c)))

    def get_project(self, name_or_id: str) -> Project:
        return self.read_single(lambda c: policy.get_project(c, name_or_id))

    def admission(self, project: str, digest: str) -> Admission:
        return self.read_single(lambda c: policy.admission(c, project, digest))

    def lookup_token(self, digest: str) -> tuple[str, str] | None:
        return self.read_single(lambda c: policy.lookup_token(c, digest))

    def latest_binding(self, project_id: str, subject: str) -> RoleBinding | None:
        return self.read_single(lambda c: policy.latest_binding(c, project_id, subject))

    def bind_role(self, project_id: str, subject: str, role: str | None) -> int:
        return self.write(lambda c: policy.bind_role(c, project_id, subject, role, self._tx_now(c)))

    def grant_token(self, project: str, subject: str, role: str, digest: str) -> str:
        policy.check_subject(subject)

        def tx(c):
            now = self._tx_now(c)
            proj = policy.ensure_project(c, project, now)
            prev = policy.latest_binding(c, proj.project_id, subject)
            if prev is None or prev.role != role:
                policy.bind_role(c, proj.project_id, subject, role, now)
            return policy.add_token(c, proj.project_id, subject, digest, now)
        return self.write(tx)

    def revoke_token(self, *, token_id: str, digest: str | None = None) -> str:
        def tx(c):
            found = policy.token_id_of(c, digest) if digest is not None else None
            policy.revoke_token(c, found or token_id, self._tx_now(c))
            return found or token_id
        return self.write(tx)

    def list_tokens(self, project_id: str) -> list[TokenInfo]:
        return self.read(lambda c: policy.list_tokens(c, project_id))

    # ---- DefinitionStore -----------------------------------------------------------------------
    def add_tasks(self, project_id: str, prepared: list[PreparedTask]) -> list[TaskHead]:
        for p in prepared:
            check_executor(p.definition, self.executor_type)

        def tx(c):
            now = self._tx_now(c)
            return [defs.add_task(c, project_id, p, now) for p in prepared]
        return self.write(tx)

    def edit_task(self, project_id: str, name_or_id: str, expected_revision: int, expected_digest: str,
                  prepared: PreparedTask) -> TaskHead:
        check_executor(prepared.definition, self.executor_type)
        return self.write(lambda c: defs.edit_task(c, project_id, name_or_id, expected_revision,
                                                         expected_digest, prepared, self._tx_now(c)))

    def set_enabled(self, project_id: str, name_or_id: str, enabled: bool, actor: str) -> tuple[TaskHead, int]:
        def tx(c):
            now = self._tx_now(c)
            head = defs.set_enabled(c, project_id, name_or_id, enabled, now)
            n = 0 if enabled else runs.cancel_queued_for_task(c, head.task_id, actor, "task_disabled", now)
            return head, n
        return self.write(tx)

    def remove_task(self, project_id: str, name_or_id: str, actor: str) -> tuple[TaskHead, int, int]:
        def tx(c):
            now = self._tx_now(c)
            head = defs.remove_task(c, project_id, name_or_id, now)
            queued = runs.cancel_queued_for_task(c, head.task_id, actor, "task_removed", now)
            active = runs.active_run_ids(c, head.task_id)
            for run_id in active:
                ex.request_cancel(c, run_id, actor, now)
            return head, queued, len(active)
        return self.write(tx)

    def definition_batch(self, work: Callable[[RowBatch], T], *, dry_run: bool = False) -> T:
        def tx(c):
            result = work(RowBatch(self, c, self._tx_now(c)))
            if dry_run:
                raise _Rollback(result)
            return result
        try:
            return self.write(tx)
        except _Rollback as done:
            return done.result

    def get_head(self, project_id: str, name_or_id: str) -> TaskHead:
        return self.read(lambda c: defs.get_head(c, project_id, name_or_id))

    def list_heads(self, project_id: str | None) -> list[TaskHead]:
        return self.read(lambda c: defs.list_heads(c, project_id))

    def skipped_fires(self, task_id: str) -> int:
        return self.read(lambda c: defs.skipped_fires(c, task_id))

    def get_recipe(self, recipe_ref: str) -> ContextRecipe:
        return self.read(lambda c: defs.get_recipe(c, recipe_ref))

    # ---- RunStore (Task Start is the subclass's) -----------------------------------------------
    def get_run(self, run_id: str, project_id: str | None = None) -> Run:
        return self.read(lambda c: runs.get_run(c, run_id, project_id))

    def list_runs(self, project_id: str, *, task_id: str | None = None, state: str | None = None,
                  limit: int = 50, cursor: str | None = None) -> tuple[list[Run], str | None]:
        return self.read(lambda c: runs.list_runs(c, project_id, task_id=task_id, state=state, limit=limit,
                                                        cursor=cursor))

    def list_events(self, run_id: str) -> list[RunEvent]:
        return self.read(lambda c: runs.list_events(c, run_id))

    def list_attempts(self, run_id: str) -> list[Attempt]:
        return self.read(lambda c: runs.list_attempts(c, run_id))

    def latest_artifact(self, run_id: str) -> tuple[str | None, TruncationFact | None]:
        return self.read(lambda c: runs.latest_artifact(c, run_id))

    def request_cancel(self, run_id: str, actor: str, project_id: str | None = None) -> Run:
        def tx(c):
            run = runs.get_run(c, run_id, project_id)
            ex.request_cancel(c, run.run_id, actor, self._tx_now(c))
            return runs.get_run(c, run.run_id)
        return self.write(tx)

    def queued_count(self) -> int:
        return self.read(runs.queued_count)

    def run_state_counts(self) -> dict[str, int]:
        return self.read(runs.state_counts)

    def oldest_queued_us(self) -> int | None:
        return self.read(runs.oldest_queued_us)

    # ---- ScheduleStore -------------------------------------------------------------------------
    def fire_schedule(self, *, project_id: str, task_id: str, idempotency_key: str | None, trigger: str,
                      scheduled_for_us: int | None, actor: str,
                      cursor: tuple[ScheduleCursor | None, ScheduleCursor] | None, missed: str | None = None) -> str:
        """As ``core.ports.ScheduleStore``, in one write transaction: "early" (the store's clock
        has not reached ``scheduled_for_us``: nothing written), "moved" (the cursor is not
        ``cursor[0]`` any more: another writer fired), "cursor" (cursor only), "exists" (the
        idempotency key has its Run), "gone" (Task removed or disabled), "skipped" (a single-
        instance Task's Run is live) or "created"."""
        def tx(c):
            now = self._tx_now(c)
            # The Run's creation time is the authority's (ADR-0376 §2), and the caller planned on
            # its own reading of that clock, which may run ahead: the instant is decided here.
            if scheduled_for_us is not None and now < scheduled_for_us:
                return "early"
            if cursor is not None:
                expected, new = cursor
                if runs.schedule_cursor(c, task_id) != expected:
                    return "moved"
                runs.put_schedule_cursor(c, task_id, new)
            if idempotency_key is None:
                return "cursor"
            # The key is read only on the way to "gone"/"skipped" (it comes first); a Run's insert
            # decides it otherwise, so a fire reads no shared index page before it writes.
            try:     # the head as it is now: a Task edited or disabled since the caller read it wins
                head = defs.get_head(c, project_id, task_id)
            except NotFoundError:
                head = None
            if head is None or not head.enabled:
                return "exists" if runs.run_id_for_key(c, project_id, idempotency_key) is not None else "gone"
            if head.definition.concurrency == "single" and runs.live_run_count(c, task_id):
                if runs.run_id_for_key(c, project_id, idempotency_key) is not None:
                    return "exists"
                defs.count_skipped_fire(c, task_id)
                return "skipped"
            created = runs.create_run(c, head=head, origin="schedule", trigger_type=trigger,
                                      idempotency_key=idempotency_key, requested_by=actor, now_us=now,
                                      executor_type=self.executor_type, scheduled_for_us=scheduled_for_us,
                                      fences={"missed": missed} if missed else None)
            if created is None:
                return "exists"
            if trigger == "cron":
                self._record_fire(c, task_id, scheduled_for_us, created.run_id, now)
            return "created"
        return self.write(tx) if idempotency_key is None else self._write_creating_runs(tx)

    def _record_fire(self, c: Db, task_id: str, scheduled_for_us: int | None, run_id: str, now_us: int) -> None:
        """Hook: mark the (Task, instant) fired. One SQLite authority needs nothing beyond the
        Run's idempotency key; replicas on PostgreSQL record it (``PgStore``)."""

    def _write_creating_runs(self, fn: Callable[..., T]) -> T:
        """Hook: ``write(fn)`` for a unit that creates Runs (``PgStore`` keeps those on index scans)."""
        return self.write(fn)

    def schedule_cursors(self) -> dict[str, ScheduleCursor]:
        return self.read(runs.schedule_cursors)

    # ---- SecretStore ---------------------------------------------------------------------------
    def put_secret(self, project_id: str, name: str, ciphertext: bytes, key_id: str) -> None:
        self.write(lambda c: secrets.put_secret(c, project_id, name, ciphertext, key_id, self._tx_now(c)))

    def secret_names(self, project_id: str) -> list[tuple[str, int]]:
        return self.read(lambda c: secrets.secret_names(c, project_id))

    def delete_secret(self, project_id: str, name: str, *, force: bool = False) -> list[str]:
        return self.write(lambda c: secrets.delete_secret(c, project_id, name, force=force))

    def secret_uses(self, project_id: str | None) -> list[tuple[str, str, bool]]:
        return self.read(lambda c: secrets.secret_uses(c, project_id))

    def ciphertexts(self, project_id: str, names: list[str]) -> dict[str, bytes]:
        return self.read(lambda c: secrets.ciphertexts(c, project_id, names))

    def legacy_ciphertexts(self, magic: bytes) -> list[tuple[str, str, bytes]]:
        return self.read(lambda c: secrets.legacy_ciphertexts(c, magic))

    def replace_ciphertexts(self, rows: list[tuple[str, str, bytes, bytes]], key_id: str) -> int:
        return self.write(lambda c: sum(secrets.replace_ciphertext(c, pid, name, old, new, key_id)
                                        for pid, name, old, new in rows))

    # ---- DispatchStore (candidate pages are the subclass's) ------------------------------------
    def reread(self, c: Candidate) -> bool:
        return self.read(lambda conn: ex.reread_candidate(conn, c))

    def load_plan(self, c: Candidate) -> tuple[Plan | None, str | None]:
        return self.read(lambda conn: ex.load_plan(conn, c.task_id, c.task_revision))

    def active_count(self) -> int:
        return self.read(ex.active_count)

    def task_active_count(self, task_id: str) -> int:
        return self.read(lambda c: ex.task_active_count(c, task_id))

    def fail_unlaunched(self, c: Candidate, reason: str, retry: RetryPolicy | None,
                        start_error: str | None = None) -> None:
        f = Finish(AttemptState.START_FAILED, failure_reason=reason, start_error=start_error)
        self.write(lambda conn: ex.finish_attempt(conn, c.run_id, c.attempt_id, f, retry, self._tx_now(conn),
                                                  self.executor_type) if ex.reread_candidate(conn, c) else None)

    # ---- ExecutionStore ------------------------------------------------------------------------
    def claim_starting(self, c: Candidate, artifact_path: str) -> bool:
        try:
            return self.write(lambda conn: ex.claim_starting(conn, c, artifact_path, self._tx_now(conn)))
        except ex.AttemptNotClaimed:
            return False

    def finish(self, run_id: str, attempt_id: str, f: Finish, truncation: TruncationFact | None,
               retry: RetryPolicy | None) -> str:
        def tx(conn):
            now = self._tx_now(conn)
            if truncation is not None:
                fact = truncation if truncation.bytes_dropped is not None else TruncationFact(
                    quota_bytes=truncation.quota_bytes, bytes_kept=truncation.bytes_kept,
                    bytes_dropped=f.bytes_dropped, reason=truncation.reason)
                ex.record_truncation(conn, attempt_id, fact, now)
            return ex.finish_attempt(conn, run_id, attempt_id, f, retry, now, self.executor_type)
        return self.write(tx)

    def mark_running(self, c: Candidate, shim_pid: int, shim_start: float, deadline_us: int) -> None:
        self.write(lambda conn: ex.mark_running(conn, c.run_id, c.attempt_id, shim_pid, shim_start,
                                                      deadline_us, self._tx_now(conn)))

    def live_attempts(self) -> list[LiveAttempt]:
        return self.read(ex.live_attempts)

    def cancel_requested(self) -> set[str]:
        return {a.attempt_id for a in self.read(ex.live_attempts) if a.cancel_requested}

    def retry_policy(self, task_id: str, revision: int) -> RetryPolicy | None:
        plan, _ = self.read(lambda c: ex.load_plan(c, task_id, revision))
        return plan.retry if plan else None

    def timing(self, task_id: str, revision: int) -> tuple[int, int]:
        plan, _ = self.read(lambda c: ex.load_plan(c, task_id, revision))
        return (plan.timeout_ms, plan.grace_ms) if plan else (DEFAULT_TIMEOUT_MS, DEFAULT_GRACE_MS)

    def keeps_orphans(self, attempt_id: str) -> bool:
        where = self.read(lambda c: ex.attempt_revision(c, attempt_id))
        if where is None:
            return False
        plan, _ = self.read(lambda c: ex.load_plan(c, *where))
        return plan is not None and plan.execution.keep_orphans

    def next_backoff_us(self) -> int | None:
        return self.read(lambda c: ex.next_backoff_us(c, self._tx_now(c)))

    def claimed_attempt_ids(self) -> list[str]:
        return self.read(ex.claimed_attempt_ids)

    def retention_entries(self) -> list[RetentionEntry]:
        return self.read(ex.retention_entries)

    def forget_artifacts(self, attempt_ids: list[str]) -> None:
        self.write(lambda c: ex.forget_artifacts(c, attempt_ids))
