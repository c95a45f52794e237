"""The store contract suite: every test here talks to ``core.ports.Store`` only, so any
authority that implements the ports (today SQLite; the cluster's PostgreSQL next) must pass it
unchanged.

Adding an implementation
------------------------
Write one factory and register it in ``STORE_FACTORIES``::

    def postgres_store(tmp_path, clock):
        dsn = create_database(f"qlagent_contract_{os.getpid()}_{uuid4().hex[:8]}")  # a fresh DB
        store = PostgresStore(dsn, "default", clock_us=clock)   # migrated, Project "default"
        return store, lambda: (store.close(), drop_database(dsn))

    STORE_FACTORIES["postgres"] = postgres_store

A factory gets pytest's ``tmp_path`` and ``clock`` (a ``() -> int`` µs callable the test moves
forward: the store must take every time it decides from it) and returns ``(store, close)``:
a store acting in a fresh Project ``default`` whose owner is ``local:cli``, and a callable
that releases everything it created. Every test then runs once per registered factory
(``-k sqlite`` / ``-k postgres`` selects one).
"""

from __future__ import annotations

import pytest

from qlagent.adapters.sqlite.store import SqliteStore


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


STORE_FACTORIES = {"sqlite": sqlite_store}


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
