"""Placement, ExecutionSpec and offer identity rules (pure: no database needed)."""

from __future__ import annotations

import pytest

from qlagent.cluster.offer import offer_id
from qlagent.cluster.placement import rank, with_executor
from qlagent.core.cluster import WorkerSnapshot
from qlagent.core.errors import ValidationError


def _w(worker_id, labels=None, free=1, executors=("local_process",)):
    return WorkerSnapshot(worker_id, f"s-{worker_id}", 1, labels or {}, executors, 4, free)


def test_order_is_score_then_free_slots_then_worker_id():
    p = with_executor({"required": {"os": "linux"}, "preferred": {"disk": "ssd", "net": "fast"}}, "local_process")
    workers = [_w("d", {"os": "linux"}, free=4), _w("c", {"os": "linux", "disk": "ssd"}, free=1),
               _w("b", {"os": "linux", "disk": "ssd"}, free=2), _w("a", {"os": "linux", "disk": "ssd"}, free=2),
               _w("e", {"os": "bsd", "disk": "ssd", "net": "fast"}), _w("f", {"os": "linux"}, free=0),
               _w("g", {"os": "linux", "disk": "ssd", "net": "fast"}, executors=("other",))]
    assert [(s, w.worker_id) for s, w in rank(p, workers)] == [(1, "a"), (1, "b"), (1, "c"), (0, "d")]
    assert [w.worker_id for _, w in rank(p, list(reversed(workers)))] == ["a", "b", "c", "d"]


def test_executor_type_is_added_as_required_and_a_conflict_is_refused():
    assert with_executor({}, "local_process").required == {"executor": "local_process"}
    assert with_executor({"required": {"executor": "local_process"}}, "local_process").required == {
        "executor": "local_process"}
    with pytest.raises(ValidationError) as e:
        with_executor({"required": {"executor": "docker"}}, "local_process")
    assert e.value.field == "placement.required.executor"


@pytest.mark.parametrize("doc,field", [
    ({"required": {f"k{i}": "v" for i in range(33)}}, "placement.required"),
    ({"preferred": {"k": "v" * 129}}, "placement.preferred.k"),
    ({"required": {"k": 1}}, "placement.required.k"),
    ({"anywhere": {}}, "placement")])
def test_placement_limits_name_the_field(doc, field):
    with pytest.raises(ValidationError) as e:
        with_executor(doc, "local_process")
    assert e.value.field == field


def test_placement_limits_at_the_edge_are_accepted():
    p = with_executor({"required": {f"k{i}": "v" * 128 for i in range(31)}}, "local_process")
    assert len(p.required) == 32                  # 31 labels + the executor: at the 32-label limit


def test_offer_id_is_stable_per_lease_and_differs_otherwise():
    a = offer_id("att", 1, "sess")
    assert a == offer_id("att", 1, "sess")
    assert len({a, offer_id("att", 2, "sess"), offer_id("att", 1, "sess2"), offer_id("att2", 1, "sess")}) == 4
