"""``SqliteStore``: the local authority behind every store port of ``core.ports`` (ADR-0071 §3).

One ``SqliteAuthority`` (one connection, one thread, one operation queue); each method is one
``read`` or one ``BEGIN IMMEDIATE`` ``write`` over the row functions of this package
(``definitions``, ``runs``, ``execution``, ``policy``, ``secrets``). Where the store decides
time it reads its own clock (``clock_us``, µs since the epoch). Opening migrates (the service,
``init``) or refuses a schema that is behind, checks capabilities and resolves the Project this
process acts in.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from ...core import states
from ...core.clock import now_us as wall_us
from ...core.definitions import PreparedTask, check_executor
from ...core.dispatch import Candidate, Finish, LiveAttempt, Plan
from ...core.errors import NotFoundError, QlError, UnavailableError
from ...core.models import (
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
from ...core.receipt import TruncationFact
from . import definitions as defs
from . import execution as ex
from . import migrations, policy
from . import runs as runs_repo
from . import secrets as secret_rows
from .authority import BUSY_TIMEOUT_MS, SqliteAuthority

T = TypeVar("T")
DEFAULT_TIMEOUT_MS = 3_600_000      # timing() of a revision that is gone (recovery only)
DEFAULT_GRACE_MS = 5_000
EXECUTOR = "local_process"          # the only executor of the local authority's Attempts


class _Rollback(Exception):
    """Carries a dry run's result out of the transaction it rolls back."""

    def __init__(self, result) -> None:
        self.result = result


class _Batch:
    """``core.ports.DefinitionBatch`` on the connection of one open write transaction."""

    def __init__(self, conn, now_us: int) -> None:
        self._c, self._now = conn, now_us

    def get_head(self, project_id: str, name_or_id: str) -> TaskHead | None:
        try:
            return defs.get_head(self._c, project_id, name_or_id)
        except NotFoundError:
            return None

    def list_heads(self, project_id: str) -> list[TaskHead]:
        return defs.list_heads(self._c, project_id)

    def add_task(self, project_id: str, prepared: PreparedTask) -> TaskHead:
        check_executor(prepared.definition, EXECUTOR)
        return defs.add_task(self._c, project_id, prepared, self._now)

    def edit_task(self, project_id: str, name_or_id: str, expected_revision: int, expected_digest: str,
                  prepared: PreparedTask) -> TaskHead:
        check_executor(prepared.definition, EXECUTOR)
        return defs.edit_task(self._c, project_id, name_or_id, expected_revision, expected_digest, prepared,
                              self._now)

    def ciphertexts(self, project_id: str, names: list[str]) -> dict[str, bytes]:
        return secret_rows.get_ciphertexts(self._c, project_id, names)

    def put_secret(self, project_id: str, name: str, ciphertext: bytes, key_id: str) -> None:
        secret_rows.put_secret(self._c, project_id, name, ciphertext, key_id, self._now)


class SqliteStore:
    """Implements ``core.ports.Store`` on one SQLite file.

    ``SqliteStore(path, project="default", *, migrate=True, create_project=True, clock_us=…,
    busy_timeout_ms=5000)``. Only the service and ``init`` migrate; others open with
    ``migrate=False`` and get UnavailableError(``store_not_migrated``) for a schema behind this
    build, so a newer CLI never changes the schema under an older running service. A read-only
    caller passes ``create_project=False``: an unknown Project is NotFoundError, never created.
    Raises StoreIntegrityError for an unknown/altered migration history and UnavailableError if
    the file cannot be opened or a required capability is missing.
    """

    def __init__(self, path: str, project: str = "default", *, migrate: bool = True, create_project: bool = True,
                 clock_us: Callable[[], int] = wall_us, busy_timeout_ms: int = BUSY_TIMEOUT_MS) -> None:
        self._now = clock_us
        self.authority = SqliteAuthority(path, busy_timeout_ms)
        try:
            if migrate:
                self.applied: list[str] = self.authority.raw(migrations.migrate)
            else:
                self.applied = []
                pending = self.authority.raw(lambda c: migrations.verify_history(c, migrations.known_migrations()))
                if pending:
                    raise UnavailableError(
                        f"the store at {path} needs {len(pending)} migration(s) from this qlagent; "
                        "restart the service (it migrates at start) or run `qlagent init`",
                        code="store_not_migrated")
            self.capabilities()
            if create_project:
                self.project: Project = self.ensure_project(project)
            else:
                self.project = self.get_project(project)
        except BaseException:
            self.authority.close()
            raise

    # ---- the authority (adapter-level access: migrations, tests of this package) -----------
    def read(self, fn):
        """Run ``fn(conn)`` on the owner thread outside a transaction."""
        return self.authority.read(fn)

    def write(self, fn):
        """Run ``fn(conn)`` inside BEGIN IMMEDIATE … COMMIT."""
        return self.authority.write(fn)

    def close(self) -> None:
        self.authority.close()

    def now_us(self) -> int:
        return self._now()

    def capabilities(self) -> dict[str, int]:
        return self.authority.read(migrations.check_capabilities)

    # ---- PolicyStore ---------------------------------------------------------------------------
    def ensure_project(self, name: str) -> Project:
        return self.write(lambda c: policy.ensure_project(c, name, self._now()))

    def get_project(self, name_or_id: str) -> Project:
        return self.read(lambda c: policy.get_project(c, name_or_id))

    def lookup_token(self, digest: str) -> tuple[str, str] | None:
        return self.read(lambda c: policy.lookup_token(c, digest))

    def latest_binding(self, project_id: str, subject: str) -> RoleBinding | None:
        return self.read(lambda c: policy.latest_binding(c, project_id, subject))

    def bind_role(self, project_id: str, subject: str, role: str | None) -> int:
        return self.write(lambda c: policy.bind_role(c, project_id, subject, role, self._now()))

    def grant_token(self, project: str, subject: str, role: str, digest: str) -> str:
        def tx(c):
            now = self._now()
            proj = policy.ensure_project(c, project, now)
            prev = policy.latest_binding(c, proj.project_id, subject)
            if prev is None or prev.role != role:
                policy.bind_role(c, proj.project_id, subject, role, now)
            return policy.add_token(c, proj.project_id, subject, digest, now)
        return self.write(tx)

    def revoke_token(self, *, token_id: str, digest: str | None = None) -> None:
        def tx(c):
            found = policy.token_id_of(c, digest) if digest is not None else None
            policy.revoke_token(c, found or token_id, self._now())
        self.write(tx)

    def list_tokens(self, project_id: str) -> list[TokenInfo]:
        return self.read(lambda c: policy.list_tokens(c, project_id))

    # ---- DefinitionStore -----------------------------------------------------------------------
    def add_tasks(self, project_id: str, prepared: list[PreparedTask]) -> list[TaskHead]:
        for p in prepared:
            check_executor(p.definition, EXECUTOR)
        return self.write(lambda c: [defs.add_task(c, project_id, p, self._now()) for p in prepared])

    def edit_task(self, project_id: str, name_or_id: str, expected_revision: int, expected_digest: str,
                  prepared: PreparedTask) -> TaskHead:
        check_executor(prepared.definition, EXECUTOR)
        return self.write(lambda c: defs.edit_task(c, project_id, name_or_id, expected_revision, expected_digest,
                                                   prepared, self._now()))

    def set_enabled(self, project_id: str, name_or_id: str, enabled: bool, actor: str) -> tuple[TaskHead, int]:
        def tx(c):
            now = self._now()
            head = defs.set_enabled(c, project_id, name_or_id, enabled, now)
            n = 0 if enabled else runs_repo.cancel_queued_for_task(c, head.task_id, actor, "task_disabled", now)
            return head, n
        return self.write(tx)

    def remove_task(self, project_id: str, name_or_id: str, actor: str) -> tuple[TaskHead, int, int]:
        def tx(c):
            now = self._now()
            head = defs.remove_task(c, project_id, name_or_id, now)
            queued = runs_repo.cancel_queued_for_task(c, head.task_id, actor, "task_removed", now)
            active = runs_repo.active_run_ids(c, head.task_id)
            for run_id in active:
                ex.request_cancel(c, run_id, actor, now)
            return head, queued, len(active)
        return self.write(tx)

    def definition_batch(self, work: Callable[[_Batch], T], *, dry_run: bool = False) -> T:
        def tx(c):
            result = work(_Batch(c, self._now()))
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

    # ---- RunStore ------------------------------------------------------------------------------
    def task_start(self, *, project: str, task: str, subject: str, mutation_id: str, expected_revision: int,
                   expected_digest: str, admitted_project_version: int | None = None,
                   admitted_binding_version: int | None = None) -> CreatedRun:
        return self.write(lambda c: runs_repo.task_start(
            c, project=project, task=task, subject=subject, mutation_id=mutation_id,
            expected_revision=expected_revision, expected_digest=expected_digest,
            admitted_project_version=admitted_project_version, admitted_binding_version=admitted_binding_version,
            now_us=self._now()))

    def get_run(self, run_id: str, project_id: str | None = None) -> Run:
        return self.read(lambda c: runs_repo.get_run(c, run_id, project_id))

    def list_runs(self, project_id: str, *, task_id: str | None = None, state: str | None = None,
                  limit: int = 50, cursor: str | None = None) -> tuple[list[Run], str | None]:
        return self.read(lambda c: runs_repo.list_runs(c, project_id, task_id=task_id, state=state, limit=limit,
                                                       cursor=cursor))

    def list_events(self, run_id: str) -> list[RunEvent]:
        return self.read(lambda c: runs_repo.list_events(c, run_id))

    def list_attempts(self, run_id: str) -> list[Attempt]:
        return self.read(lambda c: runs_repo.list_attempts(c, run_id))

    def latest_artifact(self, run_id: str) -> tuple[str | None, TruncationFact | None]:
        return self.read(lambda c: runs_repo.latest_artifact(c, run_id))

    def request_cancel(self, run_id: str, actor: str, project_id: str | None = None) -> Run:
        def tx(c):
            run = runs_repo.get_run(c, run_id, project_id)
            ex.request_cancel(c, run.run_id, actor, self._now())
            return runs_repo.get_run(c, run.run_id)
        return self.write(tx)

    def queued_count(self) -> int:
        return self.read(runs_repo.queued_count)

    # ---- ScheduleStore -------------------------------------------------------------------------
    def schedule_cursors(self) -> dict[str, ScheduleCursor]:
        return self.read(runs_repo.schedule_cursors)

    def fire_schedule(self, *, project_id: str, task_id: str, idempotency_key: str | None, trigger: str,
                      scheduled_for_us: int | None, actor: str,
                      cursor: tuple[ScheduleCursor | None, ScheduleCursor] | None, missed: str | None = None) -> str:
        def tx(c):
            if cursor is not None:
                expected, new = cursor
                if runs_repo.schedule_cursor(c, task_id) != expected:
                    return "moved"
                runs_repo.put_schedule_cursor(c, task_id, new)
            if idempotency_key is None:
                return "cursor"
            if runs_repo.run_id_for_key(c, project_id, idempotency_key) is not None:
                return "exists"
            try:     # the head as it is now: a Task edited or disabled since the caller read it wins
                head = defs.get_head(c, project_id, task_id)
            except NotFoundError:
                return "gone"
            if not head.enabled:
                return "gone"
            if head.definition.concurrency == "single" and runs_repo.live_run_count(c, task_id):
                defs.count_skipped_fire(c, task_id)
                return "skipped"
            runs_repo.create_run(c, head=head, origin="schedule", trigger_type=trigger,
                                 idempotency_key=idempotency_key, requested_by=actor, now_us=self._now(),
                                 scheduled_for_us=scheduled_for_us, fences={"missed": missed} if missed else None)
            return "created"
        return self.write(tx)

    # ---- SecretStore ---------------------------------------------------------------------------
    def put_secret(self, project_id: str, name: str, ciphertext: bytes, key_id: str) -> None:
        self.write(lambda c: secret_rows.put_secret(c, project_id, name, ciphertext, key_id, self._now()))

    def secret_names(self, project_id: str) -> list[tuple[str, int]]:
        return self.read(lambda c: secret_rows.list_secret_names(c, project_id))

    def delete_secret(self, project_id: str, name: str, *, force: bool = False) -> list[str]:
        return self.write(lambda c: secret_rows.delete_secret(c, project_id, name, force=force))

    def secret_uses(self, project_id: str | None) -> list[tuple[str, str, bool]]:
        return self.read(lambda c: secret_rows.secret_uses(c, project_id))

    def ciphertexts(self, project_id: str, names: list[str]) -> dict[str, bytes]:
        return self.read(lambda c: secret_rows.get_ciphertexts(c, project_id, names))

    def legacy_ciphertexts(self, magic: bytes) -> list[tuple[str, str, bytes]]:
        return self.read(lambda c: secret_rows.legacy_ciphertexts(c, magic))

    def replace_ciphertexts(self, rows: list[tuple[str, str, bytes, bytes]], key_id: str) -> int:
        return self.write(lambda c: sum(secret_rows.replace_ciphertext(c, pid, name, old, new, key_id)
                                        for pid, name, old, new in rows))

    # ---- DispatchStore -------------------------------------------------------------------------
    def candidate_page(self, limit: int, after: tuple | None) -> list[Candidate]:
        now = self._now()
        return self.read(lambda c: ex.candidate_page(c, limit, after, now))

    def reread(self, c: Candidate) -> bool:
        return self.read(lambda conn: ex.reread_candidate(conn, c))

    def load_plan(self, c: Candidate) -> tuple[Plan | None, str | None]:
        return self.read(lambda conn: ex.load_plan(conn, c.task_id, c.task_revision))

    def fail_unlaunched(self, c: Candidate, reason: str, retry: RetryPolicy | None,
                        start_error: str | None = None) -> None:
        f = Finish(states.AttemptState.START_FAILED, failure_reason=reason, start_error=start_error)
        self.write(lambda conn: ex.finish_attempt(conn, c.run_id, c.attempt_id, f, retry, self._now())
                   if ex.reread_candidate(conn, c) else None)

    def active_count(self) -> int:
        return self.read(ex.active_count)

    def task_active_count(self, task_id: str) -> int:
        return self.read(lambda c: ex.task_active_count(c, task_id))

    # ---- ExecutionStore ------------------------------------------------------------------------
    def claim_starting(self, c: Candidate, artifact_path: str) -> bool:
        return self.write(lambda conn: ex.claim_starting(conn, c, artifact_path, self._now()))

    def mark_running(self, c: Candidate, shim_pid: int, shim_start: float, deadline_us: int) -> None:
        self.write(lambda conn: ex.mark_running(conn, c.run_id, c.attempt_id, shim_pid, shim_start, deadline_us,
                                                self._now()))

    def finish(self, run_id: str, attempt_id: str, f: Finish, truncation: TruncationFact | None,
               retry: RetryPolicy | None) -> str:
        def tx(conn):
            now = self._now()
            if truncation is not None:
                fact = truncation if truncation.bytes_dropped is not None else TruncationFact(
                    quota_bytes=truncation.quota_bytes, bytes_kept=truncation.bytes_kept,
                    bytes_dropped=f.bytes_dropped)
                ex.record_truncation(conn, attempt_id, fact, now)
            return ex.finish_attempt(conn, run_id, attempt_id, f, retry, now)
        return self.write(tx)

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

    def next_backoff_us(self) -> int | None:
        now = self._now()
        return self.read(lambda c: ex.next_backoff_us(c, now))

    def claimed_attempt_ids(self) -> list[str]:
        return self.read(ex.claimed_attempt_ids)

    def retention_entries(self) -> list[RetentionEntry]:
        return self.read(ex.retention_entries)

    def forget_artifacts(self, attempt_ids: list[str]) -> None:
        self.write(lambda c: ex.forget_artifacts(c, attempt_ids))


def diagnose(path: str) -> list[tuple[str, bool, str]]:
    """``qlagent doctor``'s store checks on ``path`` without migrating: (name, ok, detail) for
    schema history, capability, ``PRAGMA integrity_check`` and Secrets a Task uses but the store
    lacks. Never raises for what it inspects."""
    out: list[tuple[str, bool, str]] = []
    auth = SqliteAuthority(path)
    try:
        try:
            pending = auth.raw(lambda c: migrations.verify_history(c, migrations.known_migrations()))
            out.append(("schema", not pending, "up to date" if not pending else
                        f"{len(pending)} migration(s) pending: "
                        + ", ".join(f"{m.version:04d}_{m.name}" for m in pending)))
        except QlError as e:
            out.append(("schema", False, str(e)))
        try:
            caps = auth.read(migrations.check_capabilities)
            out.append(("capability", True, ", ".join(f"{k}:{v}" for k, v in sorted(caps.items()))))
        except QlError as e:
            out.append(("capability", False, str(e)))
        res = auth.read(lambda c: [r[0] for r in c.execute("PRAGMA integrity_check")])
        out.append(("integrity", res == ["ok"], "; ".join(res[:5])))
        missing = [(t, n) for t, n, stored in auth.read(lambda c: secret_rows.secret_uses(c, None)) if not stored]
        for task, name in missing:
            out.append(("secrets", False, f"task {task} uses secret {name!r}, which is not set "
                                          f"(`qlagent secret set {name}`); its runs fail secret_missing:{name}"))
        if not missing:
            out.append(("secrets", True, "every secret a task uses is set"))
    finally:
        auth.close()
    return out
