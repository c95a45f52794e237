"""``SqliteStore``: the local authority behind every store port of ``core.ports`` (ADR-0071 §3).

One ``SqliteAuthority`` (one connection, one thread, one operation queue); each method is one
``read`` or one ``BEGIN IMMEDIATE`` ``write`` over the row functions of ``adapters/rows/``,
handed the connection as a ``rows.dialect.Db`` of ``SQLITE`` (this package's ``queries``).
Where the store decides time it reads its own clock (``clock_us``, µs since the epoch). Opening
migrates (the service, ``init``) or refuses a schema that is behind, checks capabilities and
resolves the Project this process acts in. The methods the PostgreSQL store has alike live in
``adapters.row_store.RowStore``; this class adds opening, the transactions, Task Start and
candidate pages.
"""

from __future__ import annotations

from collections.abc import Callable

from ...core.clock import now_us as wall_us
from ...core.dispatch import Candidate
from ...core.errors import QlError, UnavailableError
from ...core.models import CreatedRun, Project
from ..row_store import RowStore
from ..rows import runs as runs_repo
from ..rows import secrets as secret_rows
from ..rows.dialect import Db
from . import migrations
from .authority import BUSY_TIMEOUT_MS, SqliteAuthority
from .dialect import SQLITE
from .execution import candidate_page


WAL_CHECKPOINT_PAGES = 64            # checkpoint the WAL past 64 pages (256 KiB), not 1000 (4 MiB)
WAL_LIMIT_BYTES = 262_144            # and truncate it back to at most this after a checkpoint


class SqliteStore(RowStore):
    """Implements ``core.ports.Store`` on one SQLite file.

    ``SqliteStore(path, project="default", *, migrate=True, create_project=True, clock_us=…,
    busy_timeout_ms=5000)``. Only the service and ``init`` migrate; others open with
    ``migrate=False`` and get UnavailableError(``store_not_migrated``) for a schema behind this
    build, so a newer CLI never changes the schema under an older running service. A caller
    that only acts on what a Project holds passes ``create_project=False``: an unknown Project
    is NotFoundError, never created; ``create_project="on_write"`` creates it inside the first
    write transaction that commits (``RowStore._open_project``), so a refused write leaves none.
    Raises StoreIntegrityError for an unknown/altered migration history and UnavailableError if
    the file cannot be opened or a required capability is missing.
    """

    executor_type = "local_process"     # the only executor of the local authority's Attempts

    def __init__(self, path: str, project: str = "default", *, migrate: bool = True,
                 create_project: bool | str = True,
                 clock_us: Callable[[], int] = wall_us, busy_timeout_ms: int = BUSY_TIMEOUT_MS) -> None:
        self._now = clock_us
        self.authority = SqliteAuthority(path, busy_timeout_ms)
        try:
            # A small WAL: SQLite's default lets it grow to 4 MiB before a checkpoint, more than
            # a router's state file system may hold (it then fills it by itself); truncated back
            # after each checkpoint.
            self.authority.raw(lambda c: (c.execute(f"PRAGMA wal_autocheckpoint = {WAL_CHECKPOINT_PAGES}"),
                                          c.execute(f"PRAGMA journal_size_limit = {WAL_LIMIT_BYTES}")))
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
            self.project: Project = self._open_project(project, create_project)
        except BaseException:
            self.authority.close()
            raise

    # ---- the authority (adapter-level access: migrations, tests of this package) -----------
    def read(self, fn):
        """Run ``fn(db)`` (``rows.dialect.Db`` of the connection) on the owner thread outside a transaction."""
        return self.authority.read(lambda c: fn(Db(c, SQLITE)))

    def write(self, fn):
        """Run ``fn(db)`` inside BEGIN IMMEDIATE … COMMIT (the pending Project's creation first)."""
        tx = self._with_pending_project(fn)
        return self._committed(self.authority.write(lambda c: tx(Db(c, SQLITE))))

    def _tx_now(self, conn) -> int:
        return self._now()

    def close(self) -> None:
        self.authority.close()

    def now_us(self) -> int:
        return self._now()

    def capabilities(self) -> dict[str, int]:
        return self.authority.read(migrations.check_capabilities)

    def probe_write(self) -> None:
        """Checkpoint the WAL into the database and truncate it, then one small committed write
        (the ``store_probe`` row): returns once the store takes writes; raises
        UnavailableError(``store_unavailable``: file system full, read-only, I/O error;
        ``store_busy``) while it does not. On a small state file system the WAL is most of what
        fills it (it is checkpointed only past 1000 pages, 4 MiB): truncating it gives that back."""
        now = self._now()
        self.authority.raw(lambda c: c.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall())
        self.authority.write(lambda c: Db(c, SQLITE).run("STORE_PROBE_PUT", (now,)))

    # ---- RunStore ------------------------------------------------------------------------------
    def task_start(self, *, project: str, task: str, subject: str, mutation_id: str, expected_revision: int,
                   expected_digest: str, admitted_project_version: int | None = None,
                   admitted_binding_version: int | None = None) -> CreatedRun:
        return self.write(lambda c: runs_repo.task_start(
            c, project=project, task=task, subject=subject, mutation_id=mutation_id,
            expected_revision=expected_revision, expected_digest=expected_digest,
            admitted_project_version=admitted_project_version, admitted_binding_version=admitted_binding_version,
            now_us=self._now(), executor_type=self.executor_type))

    # ---- DispatchStore -------------------------------------------------------------------------
    def candidate_page(self, limit: int, after: tuple | None) -> list[Candidate]:
        return self.read(lambda c: candidate_page(c, limit, after, self._now()))



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
        uses = auth.read(lambda c: secret_rows.secret_uses(Db(c, SQLITE), None))
        missing = [(t, n) for t, n, stored in uses if not stored]
        for task, name in missing:
            out.append(("secrets", False, f"task {task} uses secret {name!r}, which is not set "
                                          f"(`qlagent secret set {name}`); its runs fail secret_missing:{name}"))
        if not missing:
            out.append(("secrets", True, "every secret a task uses is set"))
    finally:
        auth.close()
    return out
