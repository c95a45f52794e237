"""The cluster's and the Worker's adapters implement their ports (``core.ports``; the Pull's in
``core.cluster``, the Worker client's in ``core.control``): every method a protocol declares
exists on its adapter with the same parameters (names, order, defaults), so a service typed by
the port runs on the adapter bootstrap hands it."""

from __future__ import annotations

import inspect

import pytest

from qlagent.adapters.control_client import ControlClient
from qlagent.adapters.postgres.credentials import PgCredentials
from qlagent.adapters.postgres.dispatch import PgDispatchStore, PgPlanSource
from qlagent.adapters.postgres.join_tokens import PgJoinTokens
from qlagent.adapters.postgres.leases import PgLeaseStore
from qlagent.adapters.postgres.logs import PgLogStore
from qlagent.adapters.postgres.notify import PgCandidateSignal
from qlagent.adapters.postgres.registry import PgWorkerRegistry
from qlagent.adapters.postgres.secrets import PgSecretResolver
from qlagent.adapters.sqlite.inbox import SqliteInbox
from qlagent.cluster.placement import LeaseFitPlans
from qlagent.core import cluster, control, ports

PAIRS = [(ports.LeaseStore, PgLeaseStore), (ports.WorkerRegistryStore, PgWorkerRegistry),
         (ports.LogChunkStore, PgLogStore), (ports.JoinTokenStore, PgJoinTokens),
         (ports.CredentialStore, PgCredentials), (ports.ClusterPlans, PgPlanSource),
         (ports.ClusterPlans, LeaseFitPlans), (ports.InboxPort, SqliteInbox),
         (cluster.PullStore, PgDispatchStore), (cluster.PlanSource, LeaseFitPlans),
         (cluster.SecretResolver, PgSecretResolver), (cluster.CandidateSignal, PgCandidateSignal),
         (control.ControlPort, ControlClient)]


def _shape(fn) -> list[tuple[str, object]]:
    """(name, default) of each parameter a caller passes (``self`` left out: a staticmethod
    implements a method as well)."""
    return [(p.name, p.default) for p in inspect.signature(fn).parameters.values() if p.name != "self"]


@pytest.mark.parametrize("port, adapter", PAIRS, ids=[f"{p.__name__}-{a.__name__}" for p, a in PAIRS])
def test_the_adapter_has_every_method_of_its_port_with_the_same_parameters(port, adapter):
    methods = [n for n, v in vars(port).items() if callable(v) and not n.startswith("_")]
    assert methods
    for name in methods:
        assert hasattr(adapter, name), f"{adapter.__name__} lacks {port.__name__}.{name}"
        assert _shape(getattr(adapter, name)) == _shape(getattr(port, name)), f"{adapter.__name__}.{name}"
