"""The store contract suite: every test here talks to ``core.ports.Store`` only, so any
authority that implements the ports must pass it unchanged. Registered today: SQLite (a file
per test) and PostgreSQL (the cluster authority: one migrated database per session on the
machine's server at 127.0.0.1:5432, every domain table emptied before each test).

Adding an implementation
------------------------
Write one factory and register it in ``STORE_FACTORIES``. A factory gets pytest's
``tmp_path`` and ``clock`` (a ``() -> int`` µs callable the test moves forward: the store must
take every time it decides from it) and returns ``(store, close)``: a store acting in a fresh
Project ``default`` whose owner is ``local:cli``, and a callable that releases everything it
created. Every test then runs once per registered factory (``-k sqlite`` / ``-k postgres``
selects one).
"""

from __future__ import annotations

import os
import re
import subprocess

import pytest

from qlagent.adapters.sqlite.store import SqliteStore

PG_ADMIN_URL = os.environ.get("QLAGENT_TEST_PG", "postgresql://postgres@127.0.0.1:5432/postgres")


class Clock:
    """A µs clock a test moves explicitly (``advance``); starts at 2026-01-01T00:00:00Z."""

    def __init__(self) -> None:
        self.now = 1_767_225_600_000_000

    def __call__(self) -> int:
        return self.now

    def advance(self, us: int = 1_000) -> int:
        self.now += us
        return self.now


def sqlite_store(tmp_path, clock):
    store = SqliteStore(str(tmp_path / "contract.db"), "default", clock_us=clock, busy_timeout_ms=1_000)
    return store, store.close


class _PgDatabase:
    """One database for the session (named after the branch and the PID), created and migrated
    on first use, dropped at the end; each test starts from empty domain tables."""

    name: str | None = None
    url: str | None = None
    pool = None

    @classmethod
    def fresh(cls) -> str:
        import psycopg
        if cls.url is None:
            branch = subprocess.run(["git", "rev-parse", "--abbrev-ref", "HEAD"], capture_output=True, text=True,
                                    cwd=os.path.dirname(__file__), timeout=10).stdout.strip().lower()
            cls.name = f"qlt_contract_{re.sub(r'[^a-z0-9]', '_', branch) or 'qlagent'}_{os.getpid()}"[:63]
            try:
                admin = psycopg.connect(PG_ADMIN_URL, autocommit=True, connect_timeout=5)
            except psycopg.OperationalError as e:
                pytest.fail(f"PostgreSQL at {PG_ADMIN_URL} is unreachable ({str(e).splitlines()[0]}); "
                            "./tests/run installs and starts it", pytrace=False)
            with admin:
                admin.execute(f'DROP DATABASE IF EXISTS "{cls.name}" WITH (FORCE)')
                admin.execute(f'CREATE DATABASE "{cls.name}"')
            cls.url = PG_ADMIN_URL.rsplit("/", 1)[0] + "/" + cls.name
            from qlagent.adapters.postgres.connection import autocommit
            from qlagent.adapters.postgres.migrations import migrate
            with autocommit(cls.url) as conn:
                migrate(conn)
        with psycopg.connect(cls.url, autocommit=True) as conn:
            tables = [r[0] for r in conn.execute(
                "SELECT tablename FROM pg_tables WHERE schemaname = 'public' "
                "AND tablename NOT IN ('schema_migrations', 'capabilities')")]
            conn.execute("TRUNCATE " + ", ".join(tables) + " CASCADE")
        return cls.url

    @classmethod
    def drop(cls) -> None:
        if cls.name is None:
            return
        import psycopg
        with psycopg.connect(PG_ADMIN_URL, autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{cls.name}" WITH (FORCE)')
        cls.name = cls.url = None


def postgres_store(tmp_path, clock):
    from qlagent.adapters.postgres.store import PgStore
    store = PgStore(_PgDatabase.fresh(), "default", clock_us=clock, pool_size=2)
    return store, store.close


STORE_FACTORIES = {"sqlite": sqlite_store, "postgres": postgres_store}


# A second store on the authority a factory just made, acting in ``project`` with the given
# ``create_project`` (True, False or "on_write"): ``(tmp_path, clock, project, create_project)``.
def sqlite_reopen(tmp_path, clock, project, create_project):
    store = SqliteStore(str(tmp_path / "contract.db"), project, migrate=False, create_project=create_project,
                        clock_us=clock, busy_timeout_ms=1_000)
    return store, store.close


def postgres_reopen(tmp_path, clock, project, create_project):
    from qlagent.adapters.postgres.store import PgStore
    store = PgStore(_PgDatabase.url, project, migrate=False, create_project=create_project, clock_us=clock,
                    pool_size=1)
    return store, store.close


STORE_REOPENERS = {"sqlite": sqlite_reopen, "postgres": postgres_reopen}


@pytest.fixture(scope="session", autouse=True)
def _drop_pg_database():
    yield
    _PgDatabase.drop()


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture(params=sorted(STORE_FACTORIES))
def store(request, tmp_path, clock):
    s, close = STORE_FACTORIES[request.param](tmp_path, clock)
    try:
        yield s
    finally:
        close()


@pytest.fixture
def reopen(request, store, tmp_path, clock):
    """``reopen(project, create_project)``: another store on ``store``'s authority (closed after the test)."""
    which = request.node.callspec.params["store"]
    closers = []

    def open_(project, create_project):
        s, close = STORE_REOPENERS[which](tmp_path, clock, project, create_project)
        closers.append(close)
        return s
    yield open_
    for close in closers:
        close()
