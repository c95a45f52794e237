"""Placement, ExecutionSpec and offer identity rules (pure: no database needed)."""

from __future__ import annotations

import uuid

import msgspec
import pytest

from qlagent.cluster.execspec import spec_digest
from qlagent.cluster.offer import OFFER_NAMESPACE, offer_id
from qlagent.cluster.placement import rank, with_executor
from qlagent.core.canonical import content_digest
from qlagent.core.cluster import ExecutionSpec, WorkerSnapshot
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


@pytest.mark.parametrize("attempt,generation,session", [
    ("att", 1, "sess"), (str(uuid.uuid4()), 2**40, str(uuid.uuid4())), ("\u00e9t\u00e9", 0, "")])
def test_offer_id_is_the_uuid5_of_the_lease_in_the_offer_namespace(attempt, generation, session):
    # A replica of this build and one of an older build (uuid.uuid5) name the same Lease alike.
    assert offer_id(attempt, generation, session) == str(uuid.uuid5(OFFER_NAMESPACE, f"{attempt}:{generation}:{session}"))


@pytest.mark.parametrize("text", ["echo hi", "caf\u00e9", "cafe\u0301", "\u212bngstr\u00f6m", "tab\tquote\"nul\x00"])
def test_spec_digest_is_the_content_digest_of_the_specs_canonical_json(text):
    # ASCII specs take the one-encode path, others the NFC walk: both must give the canonical digest.
    spec = ExecutionSpec(run_id="r", attempt_id="a", project_id="p", task_id="t", task_revision=1,
                         executor_type="local_process", kind="shell", shell="/bin/sh", script=text,
                         env={text: text, "Z": "1", "a": "2"}, timeout_ms=1000, grace_ms=0, log_quota_bytes=1)
    assert spec_digest(spec) == content_digest(msgspec.to_builtins(spec))
