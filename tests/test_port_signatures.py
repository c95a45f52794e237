"""The cluster's and the Worker's stores implement their ``core.ports`` protocols: every method a
protocol declares exists on its adapter with the same parameters (names, order, defaults), so a
service typed by the port runs on the adapter bootstrap hands it."""

from __future__ import annotations

import inspect

import pytest

from qlagent.adapters.postgres.dispatch import PgPlanSource
from qlagent.adapters.postgres.join_tokens import PgJoinTokens
from qlagent.adapters.postgres.leases import PgLeaseStore
from qlagent.adapters.postgres.logs import PgLogStore
from qlagent.adapters.postgres.registry import PgWorkerRegistry
from qlagent.adapters.sqlite.inbox import SqliteInbox
from qlagent.core import ports

PAIRS = [(ports.LeaseStore, PgLeaseStore), (ports.WorkerRegistryStore, PgWorkerRegistry),
         (ports.LogChunkStore, PgLogStore), (ports.JoinTokenStore, PgJoinTokens),
         (ports.ClusterPlans, PgPlanSource), (ports.InboxPort, SqliteInbox)]


def _shape(fn) -> list[tuple[str, object]]:
    return [(p.name, p.default) for p in inspect.signature(fn).parameters.values()]


@pytest.mark.parametrize("port, adapter", PAIRS, ids=[p.__name__ for p, _ in PAIRS])
def test_the_adapter_has_every_method_of_its_port_with_the_same_parameters(port, adapter):
    methods = [n for n, v in vars(port).items() if callable(v) and not n.startswith("_")]
    assert methods
    for name in methods:
        assert hasattr(adapter, name), f"{adapter.__name__} lacks {port.__name__}.{name}"
        assert _shape(getattr(adapter, name)) == _shape(getattr(port, name)), f"{adapter.__name__}.{name}"
