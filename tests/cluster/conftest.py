"""Real PostgreSQL for the cluster tests: a fresh database per test module (named after the
branch, the PID and the module), migrated, dropped afterwards. The server is the machine's one
on 127.0.0.1:5432 (trust auth, user postgres; ./tests/run starts it). Unreachable → the tests
FAIL with one line saying so: nothing here is skipped silently."""

from __future__ import annotations

import os
import re
import subprocess

import pytest

ADMIN_URL = os.environ.get("QLAGENT_TEST_PG", "postgresql://postgres@127.0.0.1:5432/postgres")


def _branch() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--abbrev-ref", "HEAD"], capture_output=True, text=True,
                             cwd=os.path.dirname(__file__), timeout=10).stdout.strip()
    except OSError:
        out = ""
    return re.sub(r"[^a-z0-9]", "_", out.lower()) or "qlagent"


def db_url(name: str) -> str:
    return ADMIN_URL.rsplit("/", 1)[0] + "/" + name


def admin():
    import psycopg
    try:
        return psycopg.connect(ADMIN_URL, autocommit=True, connect_timeout=5)
    except psycopg.OperationalError as e:
        pytest.fail(f"PostgreSQL at {ADMIN_URL} is unreachable ({str(e).splitlines()[0]}); "
                    "./tests/run installs and starts it", pytrace=False)


def create_database(tag: str) -> str:
    name = f"qlt_{_branch()}_{os.getpid()}_{re.sub(r'[^a-z0-9]', '_', tag.lower())}"[:63]
    with admin() as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        conn.execute(f'CREATE DATABASE "{name}"')
    return name


def sql(url: str, query: str, args=()) -> list:
    """Run one statement on its own autocommit connection; its rows ([] for none)."""
    import psycopg
    with psycopg.connect(url, autocommit=True, connect_timeout=5) as c:
        cur = c.execute(query, args)
        return cur.fetchall() if cur.description else []


def drop_database(name: str) -> None:
    with admin() as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture(scope="module")
def pg_url(request):
    name = create_database(request.module.__name__.rsplit(".", 1)[-1])
    yield db_url(name)
    drop_database(name)


@pytest.fixture(scope="module")
def pool(pg_url):
    from qlagent.adapters.postgres.connection import autocommit, open_pool
    from qlagent.adapters.postgres.migrations import migrate
    with autocommit(pg_url) as conn:
        migrate(conn)
    p = open_pool(pg_url, 8)
    yield p
    p.close()


_TABLES = ("log_chunks", "run_leases", "worker_sessions", "workers", "truncation_facts", "run_events", "attempts",
           "schedule_fires", "runs", "execution_revisions", "context_recipes", "task_revisions", "tasks", "secrets",
           "api_tokens", "role_bindings", "projects")


@pytest.fixture
def kit(pool):
    """An empty cluster authority (every domain table truncated) and the helpers over it."""
    from pgkit import Kit
    with pool.connection() as conn:
        conn.execute("TRUNCATE " + ", ".join(_TABLES) + " CASCADE")
    return Kit(pool)
