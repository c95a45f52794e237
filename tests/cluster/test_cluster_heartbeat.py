"""Heartbeats renew only the Leases the Worker names as still held (issue 11 §6; the heartbeat
row of docs/worker-protocol.md), against the real authority: a run the Worker self-fenced or
dropped is not named, so its Lease runs out and the sweeper ends its Attempt ``lost``."""

from __future__ import annotations

import pytest

from cpkit import Client, ControlPlane
from qlagent.cluster.leases import LeaseSweeper
from qlagent.core.cluster import MAX_HELD, HeldLease
from qlagent.core.errors import ConflictError, ValidationError
from qlagent.core.ids import new_id

def _held(offer) -> HeldLease:
    return HeldLease(attempt_id=offer.attempt_id, lease_generation=offer.lease_generation)


def _beat(kit, w, *held):
    return kit.registry.heartbeat(w["worker_id"], w["credential"], w["session_id"], w["generation"], tuple(held))


def _expiry(kit, attempt_id) -> int:
    return kit.one("SELECT expires_at_us FROM run_leases WHERE attempt_id = %s AND state = 'active'", (attempt_id,))


def _running(kit, w, name, max_attempts=1):
    run_id, _ = kit.queue(kit.task(name, max_attempts=max_attempts))
    offer = kit.claim(w)[0]
    kit.ack(w, offer, "starting")
    kit.ack(w, offer, "running")
    return run_id, offer


def test_only_named_leases_are_renewed_and_an_unnamed_one_runs_out_lost(kit):
    w = kit.worker("edge-1", slots=2)
    kept_run, kept = _running(kit, w, "kept")
    dropped_run, dropped = _running(kit, w, "dropped", max_attempts=2)
    # Both Leases have 2 s left; the Worker still holds only ``kept`` (it self-fenced ``dropped``).
    kit.sql("UPDATE run_leases SET expires_at_us = ql_now_us() + 2000000")
    before = _expiry(kit, dropped.attempt_id)
    hb = _beat(kit, w, _held(kept))
    assert [x.attempt_id for x in hb.leases] == [kept.attempt_id]
    assert hb.leases[0].expires_at_us == _expiry(kit, kept.attempt_id) >= kit.one("SELECT ql_now_us()") + 29_000_000
    assert _expiry(kit, dropped.attempt_id) == before
    # Three seconds pass for both Leases (the database clock moves past the unnamed one's expiry).
    kit.sql("UPDATE run_leases SET expires_at_us = expires_at_us - 3000000 WHERE state = 'active'")
    r = LeaseSweeper(kit.leases, kit.registry).sweep_once()
    assert (r.leases_expired, r.requeued) == (1, 1)
    assert kit.sql("SELECT attempt_id, state FROM run_leases ORDER BY state") == [
        (kept.attempt_id, "active"), (dropped.attempt_id, "expired")]
    assert kit.one("SELECT state FROM attempts WHERE attempt_id = %s", (dropped.attempt_id,)) == "lost"
    assert kit.one("SELECT state FROM runs WHERE run_id = %s", (dropped_run,)) == "queued"
    assert kit.events(dropped_run)[-2:] == ["attempt.lost", "run.retrying"]
    assert kit.one("SELECT state FROM runs WHERE run_id = %s", (kept_run,)) == "running"
    # The retry is a new Attempt offered again; the lost one is never renewed again, even if named.
    again = kit.claim(w)[0]
    assert again.run_id == dropped_run and again.attempt_id != dropped.attempt_id
    assert [x.attempt_id for x in _beat(kit, w, _held(kept), _held(dropped)).leases] == [kept.attempt_id]


def test_a_named_lease_of_another_session_or_generation_renews_nothing(kit):
    workers = [kit.worker("edge-1"), kit.worker("edge-2")]
    kit.queue(kit.task())
    offer = kit.claim(workers[0])[0]
    owner, other = sorted(workers, key=lambda w: w["worker_id"] != offer.worker_id)
    kit.ack(owner, offer, "starting")
    kit.ack(owner, offer, "running")
    before = _expiry(kit, offer.attempt_id)
    assert _beat(kit, other, _held(offer)).leases == []                 # another Worker's Session
    stale_gen = HeldLease(attempt_id=offer.attempt_id, lease_generation=offer.lease_generation + 1)
    assert _beat(kit, owner, stale_gen).leases == []                    # not the Lease's generation
    assert _expiry(kit, offer.attempt_id) == before
    assert [x.attempt_id for x in _beat(kit, owner, _held(offer)).leases] == [offer.attempt_id]


def test_the_named_list_is_bounded_at_64_and_a_bad_one_writes_nothing(kit):
    w = kit.worker("edge-1")
    _, offer = _running(kit, w, "job")
    filler = [HeldLease(attempt_id=new_id(), lease_generation=1) for _ in range(MAX_HELD - 1)]
    hb = _beat(kit, w, *filler, _held(offer))                           # 64: taken
    assert [x.attempt_id for x in hb.leases] == [offer.attempt_id]
    state = kit.sql("SELECT * FROM worker_sessions") + kit.sql("SELECT * FROM run_leases")
    for held, field in (([*filler, _held(offer), HeldLease(attempt_id=new_id(), lease_generation=1)], "leases"),
                        ([_held(offer), _held(offer)], "leases"),
                        ([HeldLease(attempt_id="not-a-uuid", lease_generation=1)], "leases[0].attemptId"),
                        ([_held(offer), HeldLease(attempt_id=new_id(), lease_generation=0)],
                         "leases[1].leaseGeneration")):
        with pytest.raises(ValidationError) as e:
            _beat(kit, w, *held)
        assert e.value.field == field
        assert kit.sql("SELECT * FROM worker_sessions") + kit.sql("SELECT * FROM run_leases") == state


def test_the_heartbeat_route_takes_64_names_and_refuses_65_naming_the_field(kit, pg_url):
    w = kit.worker("edge-1")
    _, offer = _running(kit, w, "job")
    cp = ControlPlane(kit, pg_url)
    try:
        c = Client(cp.port, w)
        names = [{"attemptId": new_id(), "leaseGeneration": 1} for _ in range(MAX_HELD - 1)]
        names.append({"attemptId": offer.attempt_id, "leaseGeneration": offer.lease_generation})
        body = {"sessionId": w["session_id"], "generation": w["generation"], "leases": names}
        status, _, hb, _ = c.post("heartbeat", body)
        assert status == 200 and [x["attemptId"] for x in hb["leases"]] == [offer.attempt_id], hb
        state = kit.sql("SELECT * FROM worker_sessions") + kit.sql("SELECT * FROM run_leases")
        status, _, err, _ = c.post("heartbeat", {**body, "leases": names + [{"attemptId": new_id(),
                                                                            "leaseGeneration": 1}]})
        assert (status, err["error"], err["field"]) == (400, "invalid_request", "leases"), err
        assert kit.sql("SELECT * FROM worker_sessions") + kit.sql("SELECT * FROM run_leases") == state
        c.close()
    finally:
        cp.close()


def test_a_stale_generation_heartbeat_renews_no_named_lease(kit):
    w = kit.worker("edge-1")
    _, offer = _running(kit, w, "job")
    before = _expiry(kit, offer.attempt_id)
    stale = {**w, "generation": w["generation"] + 1}
    with pytest.raises(ConflictError) as e:
        _beat(kit, stale, _held(offer))
    assert e.value.code == "stale_generation" and _expiry(kit, offer.attempt_id) == before
