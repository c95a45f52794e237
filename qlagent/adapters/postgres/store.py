"""``PgStore``: every store port of ``core.ports`` on the cluster authority (ADR-0014 "only the
Repository and transport change"), with the same semantics as ``adapters.sqlite.store`` and
checked by the same contract suite (``tests/contract/``).

Each method is one transaction on a bounded psycopg pool. Writes run SERIALIZABLE — Task Start
as ADR-0376 §2 requires, and the others so that N control-plane replicas writing the same facts
behave as if they took turns (the local store's BEGIN IMMEDIATE). A serialization failure,
deadlock or unique-key race re-runs the whole unit of work a bounded number of times (every
re-run re-reads the facts it fences on, so a lost race ends as ``existing``/``exists``/a fence);
still failing → UnavailableError (``task_start_unavailable`` for Task Start, ``store_busy``
otherwise). A server that cannot be reached → UnavailableError ``store_unavailable``.

Time: the database clock (``ql_now_us()``) unless the caller injects ``clock_us`` (tests).
The methods the SQLite store has alike live in ``adapters.row_store.RowStore`` over the row
functions of ``adapters/rows/`` (handed the cursor as a ``rows.dialect.Db`` of ``POSTGRES``);
this class adds opening, the retried transactions and candidate pages.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

from ...core.canonical import idempotency_key
from ...core.dbclock import SKEW_BOUND_US, DatabaseClock
from ...core.dispatch import Candidate
from ...core.errors import UnavailableError
from ...core.models import CreatedRun, Project
from ..row_store import RowStore
from ..rows import secrets as secret_rows
from ..rows.dialect import Db
from . import migrations
from . import runs as pg_runs
from .connection import autocommit, bounded_wait, deadline, open_pool, pool_wait
from .dialect import POSTGRES
from .execution import candidate_page
from .queries import CLOCK_US, CREATING_RUNS_SETTINGS, IS_STANDBY, NOTIFY

if TYPE_CHECKING:   # annotations only: psycopg loads where a connection is opened
    from psycopg import Connection
    from psycopg_pool import ConnectionPool

T = TypeVar("T")
WRITE_RETRIES = 8                  # whole-transaction re-runs after a serialization failure
RETRY_PAUSE_S = 0.002              # pause before re-run n: n × 1..10 × this (s), jittered so racers part
READY_WAIT_S = 2.0                 # a readiness check waits this long for a pooled connection (s)


class PgStore(RowStore):
    """Implements ``core.ports.Store`` on PostgreSQL.

    ``PgStore(url, project="default", *, migrate=True, create_project=True, clock_us=None,
    pool_size=4, executor_type="remote_worker")``: ``url`` a libpq URL (multi-host with
    ``target_session_attrs=read-write`` accepted); ``project=None`` acts in no Project (only the
    pool is used: ``bootstrap.open_cluster_store``); ``create_project`` as ``SqliteStore``'s
    (True; False: unknown is NotFoundError; ``"on_write"``: created by the first committed
    write); ``migrate`` applies pending migrations under the advisory lock (serve, init), else
    a schema behind this build is UnavailableError ``store_not_migrated``; ``executor_type`` is
    the executor of the Attempts this authority creates (the cluster's Workers take
    ``remote_worker``; the local engine's candidates are ``local_process``). Raises StoreIntegrityError for an unknown/altered migration history,
    UnavailableError when the server is unreachable or a capability is missing.
    """


    def __init__(self, url: str, project: str | None = "default", *, migrate: bool = True,
                 create_project: bool | str = True,
                 clock_us: Callable[[], int] | None = None, pool_size: int = 4,
                 executor_type: str = "remote_worker", pool: ConnectionPool | None = None) -> None:
        self._clock = clock_us
        self.executor_type = executor_type
        with autocommit(url) as conn:
            if migrate:
                self.applied: list[str] = migrations.migrate(conn)
            else:
                self.applied = []
                pending = migrations.verify_history(conn, migrations.known_migrations())
                if pending:
                    raise UnavailableError(f"the cluster database needs {len(pending)} migration(s) from this "
                                           "qlagent; run `qlagent init` or start `qlagent serve`",
                                           code="store_not_migrated")
        self.pool = pool if pool is not None else open_pool(url, pool_size)
        self._own_pool = pool is None
        try:
            self.capabilities()
            # None: no Project at all (the cluster's own records: Workers), none created or read
            self.project: Project | None = None if project is None else self._open_project(project, create_project)
        except BaseException:
            self.close()
            raise

    # ---- transactions --------------------------------------------------------------------------
    def _run(self, fn: Callable, *, write: bool, busy_code: str = "store_busy", creates_runs: bool = False,
             single: bool = False, one_message: bool = False):
        """``fn(cursor)`` in one transaction (see the module docstring); ``single``: a read of one
        statement, run outside a transaction (autocommit: one round trip); ``one_message``: ``fn``
        sends its whole transaction, BEGIN and COMMIT included, as one simple query (a client-side
        binding cursor in autocommit; a query stopped inside its transaction is rolled back
        before the re-run). ``creates_runs``: a write
        that creates Runs (Task Start, schedule fires) is planned without sequential scans,
        waits at most 5 s for a row lock and NOTIFYs no Pull from inside
        (``queries.CREATING_RUNS_SETTINGS``; its caller calls ``_wake_pulls`` after the commit). No lock orders
        such writes across Tasks; under SERIALIZABLE a sequential scan would put a predicate lock
        on the whole table, so that every Run insert of another Task would fail this
        transaction's commit, while an index scan locks only the pages it reads."""
        import psycopg
        from psycopg.rows import dict_row
        if write:
            fn = self._with_pending_project(fn)
        isolation = psycopg.IsolationLevel.SERIALIZABLE if write else psycopg.IsolationLevel.REPEATABLE_READ

        def once(conn: Connection):
            if single or one_message:
                from psycopg import ClientCursor
                from psycopg.pq import TransactionStatus
                conn.autocommit = True
                try:
                    with (ClientCursor(conn, row_factory=dict_row) if one_message
                          else conn.cursor(row_factory=dict_row)) as cur:
                        try:
                            return fn(Db(cur, POSTGRES))
                        except BaseException:
                            if conn.pgconn.transaction_status == TransactionStatus.INERROR:
                                conn.execute("ROLLBACK")
                            raise
                finally:    # the pool's next user expects a transaction per unit
                    _restore(conn, autocommit=False)
            # BEGIN itself names the isolation level: no SET TRANSACTION round trip
            conn.isolation_level, conn.read_only = isolation, not write
            try:
                with conn.transaction(), conn.cursor(row_factory=dict_row) as cur:
                    if creates_runs:
                        cur.execute(CREATING_RUNS_SETTINGS)
                    return fn(Db(cur, POSTGRES))
            finally:    # the pool's other users (dispatch, transitions) begin at its default
                _restore(conn, isolation_level=None, read_only=None)
        result = self._tries(once, write=write, busy_code=busy_code)
        return self._committed(result) if write else result

    def _tries(self, once: Callable, *, write: bool, busy_code: str):
        """``once(connection)`` on a pooled connection within the unit deadline; a write re-run
        on a serialization failure, deadlock or unique-key race (at most ``WRITE_RETRIES``
        times, paused a little longer each time), then UnavailableError ``busy_code``; a lock or
        statement timeout is UnavailableError ``busy_code``, an unreachable server
        ``store_unavailable``."""
        import psycopg
        from psycopg import errors
        for attempt in range(WRITE_RETRIES if write else 1):
            try:
                with self.pool.connection(timeout=pool_wait()) as conn, deadline(conn):
                    return once(conn)
            except (errors.SerializationFailure, errors.DeadlockDetected, errors.UniqueViolation):
                if not write:
                    raise
                time.sleep(RETRY_PAUSE_S * (1 + os.urandom(1)[0] % 10) * (attempt + 1))
            except (errors.LockNotAvailable, errors.QueryCanceled) as e:
                raise UnavailableError(f"cluster database: {str(e).splitlines()[0]}", code=busy_code) from None
            except psycopg.OperationalError as e:      # unreachable, or cut at its deadline
                raise UnavailableError(f"cluster database unavailable: {(str(e).splitlines() or ['no answer'])[0]}",
                                       code="store_unavailable") from None
        raise UnavailableError(f"cluster database: the transaction kept conflicting after {WRITE_RETRIES} tries; "
                               "retry later", code=busy_code)

    def _wake_pulls(self) -> None:
        """NOTIFY the long-polling Pulls of every replica (``notify.CHANNEL``) after a commit
        that created a Run, on its own autocommit statement: the notify lock it takes is held
        for that statement only, not through a Task Start's commit. A database gone meanwhile
        is no error: the Run is committed, and a Pull finds it at its next poll."""
        import psycopg

        from .notify import CHANNEL
        try:
            with self.pool.connection(timeout=pool_wait()) as conn, deadline(conn):
                conn.autocommit = True
                try:
                    conn.execute(NOTIFY, (CHANNEL,))
                finally:    # the pool's next user expects a transaction per unit
                    _restore(conn, autocommit=False)
        except psycopg.OperationalError:
            pass

    def read(self, fn: Callable[..., T]) -> T:
        """``fn(cursor)`` in one read-only snapshot."""
        return self._run(fn, write=False)

    def read_single(self, fn: Callable[..., T]) -> T:
        """``fn(cursor)`` running one statement, outside a transaction (one round trip)."""
        return self._run(fn, write=False, single=True)

    def write(self, fn: Callable[..., T]) -> T:
        """``fn(cursor)`` in one SERIALIZABLE transaction, re-run on serialization failures."""
        return self._run(fn, write=True)

    def _tx_now(self, db: Db) -> int:
        if self._clock is not None:
            return self._clock()
        return db.one("DB_NOW")["now"]

    def close(self) -> None:
        if self._own_pool:
            self.pool.close()

    def now_us(self) -> int:
        return self._clock() if self._clock is not None else self.read(self._tx_now)

    def waiting_at_most(self, seconds: float):
        """A context manager: this thread's store calls inside it wait at most ``seconds`` for a
        pooled connection, then raise UnavailableError (``connection.bounded_wait``)."""
        return bounded_wait(seconds)

    def pool_use(self) -> tuple[int, int, int]:
        """(connections open, in use, requests waiting for one) of the pool, now."""
        s = self.pool.get_stats()
        size = s.get("pool_size", 0)
        return size, size - s.get("pool_available", 0), s.get("requests_waiting", 0)

    def capabilities(self) -> dict[str, int]:
        """The declared capabilities (readiness, ``GET /readyz``). UnavailableError: a required one
        missing, or ``store_unavailable`` when no connection comes within ``READY_WAIT_S`` (the
        database is down: the probe answers 503 promptly, not 500 after the pool's 10 s)."""
        import psycopg
        try:
            with self.pool.connection(timeout=READY_WAIT_S) as conn, deadline(conn, READY_WAIT_S):
                return migrations.check_capabilities(conn)
        except psycopg.OperationalError as e:      # psycopg_pool.PoolTimeout included
            raise UnavailableError(f"cluster database unavailable: {str(e).splitlines()[0]}",
                                   code="store_unavailable") from None

    # ---- RunStore ------------------------------------------------------------------------------
    def task_start(self, *, project: str, task: str, subject: str, mutation_id: str, expected_revision: int,
                   expected_digest: str, admitted_project_version: int | None = None,
                   admitted_binding_version: int | None = None) -> CreatedRun:
        """ADR-0376 §2 in one SERIALIZABLE transaction of one call (``postgres.runs``: the
        database function plans without sequential scans and waits at most 5 s for its Task's
        row), sent with its BEGIN, its COMMIT and the Pulls' wake-up after the commit as ONE
        simple query (client-side binding): one round trip. A serialization failure re-runs it (at
        most ``WRITE_RETRIES`` times), then UnavailableError ``task_start_unavailable`` (HTTP
        503). A store whose Project is still to be created (``create_project="on_write"``)
        creates it in the same transaction: the usual unit, then the wake-up."""
        args = pg_runs.start_args(project=project, task=task, subject=subject, mutation_id=mutation_id,
                                  expected_revision=expected_revision, expected_digest=expected_digest,
                                  admitted_project_version=admitted_project_version,
                                  admitted_binding_version=admitted_binding_version,
                                  now_us=self._clock() if self._clock is not None else None,
                                  executor_type=self.executor_type)
        if self._pending_project is not None:
            created = self._run(lambda c: pg_runs.started(c.one("TASK_START", args), task), write=True,
                                busy_code="task_start_unavailable")
            if not created.existing:
                self._wake_pulls()
            return created
        return self._run(lambda c: pg_runs.start_in_one_message(c, args, project, idempotency_key(mutation_id), task),
                         write=True, busy_code="task_start_unavailable", one_message=True)

    # ---- ScheduleStore hooks (``RowStore.fire_schedule``) ----------------------------------------
    def _record_fire(self, c: Db, task_id: str, scheduled_for_us: int | None, run_id: str, now_us: int) -> None:
        """Across replicas the (Task, instant) row of ``schedule_fires`` and the Run's unique
        idempotency key make one Run per instant."""
        pg_runs.record_fire(c, task_id, scheduled_for_us, run_id, now_us)

    def _write_creating_runs(self, fn: Callable[..., T]) -> T:
        """A fire's unit; its outcome "created" wakes the Pulls after the commit."""
        outcome = self._run(fn, write=True, creates_runs=True)
        if outcome == "created":
            self._wake_pulls()
        return outcome

    # ---- DispatchStore -------------------------------------------------------------------------
    def candidate_page(self, limit: int, after: tuple | None) -> list[Candidate]:
        return self.read(lambda c: candidate_page(c, limit, after, self._tx_now(c), self.executor_type))



def _restore(conn: Connection, **settings) -> None:
    """Set the pooled ``conn``'s session ``settings`` (attributes of psycopg's Connection) back
    after a unit; a connection cut mid-unit (its setters would raise over the unit's own error)
    is closed instead, so the pool never hands it out with the unit's settings."""
    from psycopg.pq import TransactionStatus
    if conn.pgconn.transaction_status != TransactionStatus.IDLE:
        conn.close()
        return
    for name, value in settings.items():
        setattr(conn, name, value)


def diagnose(url: str) -> list[tuple[str, bool, str]]:
    """``qlagent doctor``'s checks of the cluster authority without migrating: (name, ok, detail)
    for reachability (a primary, not a standby), this host's clock against the database's,
    schema history, capability and Secrets a Task
    uses but the store lacks. Never raises for what it inspects."""
    from psycopg.rows import dict_row

    from ...core.errors import QlError
    try:
        with autocommit(url) as conn:
            return _diagnose(conn, dict_row)
    except QlError as e:
        return [("database", False, str(e))]


def _clock_check(conn: Connection) -> tuple[str, bool, str]:
    """This host's clock against the database's (issue 21 §4): not ok beyond ``SKEW_BOUND_US``."""
    clock = DatabaseClock(lambda: conn.execute(CLOCK_US).fetchone()[0])
    if not clock.sync():
        return ("clock", True, "not measured: the database answered too slowly")
    offset = "%+.3f s" % (clock.offset_us / 1e6)
    if clock.skewed:
        return ("clock", False, f"this host's clock is {offset} off the database's (bound ±{SKEW_BOUND_US / 1e6:g} s); "
                                "a replica here plans in the database's time, but fix its time sync")
    return ("clock", True, f"{offset} from the database's (bound ±{SKEW_BOUND_US / 1e6:g} s)")


def _diagnose(conn: Connection, dict_row) -> list[tuple[str, bool, str]]:
    from ...core.errors import QlError
    standby = conn.execute(IS_STANDBY).fetchone()[0]
    out = [("database", not standby, "a standby (read-only): the authority is the primary" if standby
            else "reachable, primary (read-write)")]
    out.append(_clock_check(conn))
    try:
        pending = migrations.verify_history(conn, migrations.known_migrations())
        out.append(("schema", not pending, "up to date" if not pending else f"{len(pending)} migration(s) pending: "
                    + ", ".join(f"{m.version:04d}_{m.name}" for m in pending)))
        caps = migrations.check_capabilities(conn)
        out.append(("capability", True, ", ".join(f"{k}:{v}" for k, v in sorted(caps.items()))))
    except QlError as e:
        out.append(("schema" if len(out) == 1 else "capability", False, str(e)))
        return out
    with conn.cursor(row_factory=dict_row) as cur:
        missing = [(t, n) for t, n, stored in secret_rows.secret_uses(Db(cur, POSTGRES), None) if not stored]
    for task, name in missing:
        out.append(("secrets", False, f"task {task} uses secret {name!r}, which is not set "
                                      f"(`qlagent secret set {name}`); its runs fail secret_missing:{name}"))
    if not missing:
        out.append(("secrets", True, "every secret a task uses is set"))
    return out
