"""Lease adoption at hello (issue 11 restart, docs/worker-protocol.md "Sessions and adoption")
against the real authority: a new Session takes over exactly the Leases its Worker proves and
may keep; everything else of the older Sessions is fenced as before."""

from __future__ import annotations

import msgspec
import pytest

from pgkit import token
from qlagent.cluster.leases import LeaseSweeper
from qlagent.cluster.logs import LogUpload
from qlagent.cluster.pull import PullRequest
from qlagent.cluster.registry import Hello
from qlagent.core.cluster import MAX_ADOPT, AdoptClaim, HeldLease
from qlagent.core.errors import ConflictError, ValidationError
from qlagent.core.ids import new_id
from qlagent.core.profiles import EDGE


def _claim(offer, tok=None) -> AdoptClaim:
    return AdoptClaim(attempt_id=offer.attempt_id, lease_generation=offer.lease_generation,
                      lease_token=tok or offer.lease_token)


def _held(offer) -> HeldLease:
    return HeldLease(attempt_id=offer.attempt_id, lease_generation=offer.lease_generation)


def _reopen(kit, w, *claims):
    grant = kit.registry.open_session(w["worker_id"], w["credential"], Hello(adopt=tuple(claims)))
    return grant, {**w, "session_id": grant.session_id, "generation": grant.generation}


def _ack(kit, w, offer, kind, **facts):
    """An ACK of ``offer``'s Lease under the Session/generation of ``w``."""
    return kit.ack(w, msgspec.structs.replace(offer, session_id=w["session_id"], generation=w["generation"]),
                   kind, **facts)


def _chunk(kit, w, offer, offset, data):
    return LogUpload(kit.logs, EDGE).append(
        w["worker_id"], w["credential"], session_id=w["session_id"], generation=w["generation"],
        attempt_id=offer.attempt_id, lease_generation=offer.lease_generation, lease_token=offer.lease_token,
        offset=offset, data=data)


def _lease(kit, attempt_id):
    return kit.sql("SELECT session_id, worker_generation, state FROM run_leases WHERE attempt_id = %s",
                   (attempt_id,))[0]


def test_a_running_lease_is_adopted_by_the_new_session_and_only_its_new_generation_acts(kit):
    w = kit.worker("edge-1", slots=2)
    run_id, attempt_id = kit.queue(kit.task())
    offer = kit.claim(w)[0]
    kit.ack(w, offer, "starting")
    kit.ack(w, offer, "running")
    expires = kit.one("SELECT expires_at_us FROM run_leases WHERE attempt_id = %s", (attempt_id,))
    grant, w2 = _reopen(kit, w, _claim(offer))
    assert grant.generation == w["generation"] + 1 and grant.refused == ()
    assert [(a.attempt_id, a.lease_generation, a.expires_at_us) for a in grant.adopted] == [(attempt_id, 1, expires)]
    assert _lease(kit, attempt_id) == (grant.session_id, grant.generation, "active")
    assert kit.events(run_id)[-1] == "lease.adopted"
    assert offer.lease_token not in str(kit.sql("SELECT * FROM run_events")) + repr(grant) + repr(Hello(
        adopt=(_claim(offer),)))
    # The old generation is stale; the new one reports, uploads and completes the same Attempt.
    with pytest.raises(ConflictError) as e:
        kit.ack(w, offer, "completion", exit_code=0)
    assert e.value.code == "stale_generation"
    with pytest.raises(ConflictError) as e:
        _chunk(kit, w, offer, 0, b"out\n")
    assert e.value.code == "stale_generation"
    with pytest.raises(ConflictError) as e:
        kit.registry.heartbeat(w["worker_id"], w["credential"], w["session_id"], w["generation"])
    assert e.value.code == "stale_generation"
    # The new Session's heartbeat renews what it adopted and answers the new expiry.
    hb = kit.registry.heartbeat(w["worker_id"], w["credential"], w2["session_id"], w2["generation"], (_held(offer),))
    assert [x.attempt_id for x in hb.leases] == [attempt_id] and hb.leases[0].expires_at_us >= expires
    assert _ack(kit, w2, offer, "running").replay                  # a re-sent ACK is a replay
    assert _chunk(kit, w2, offer, 0, b"out\n").next_offset == 4
    assert _ack(kit, w2, offer, "completion", exit_code=0).run_state == "succeeded"


def test_heartbeat_answers_each_renewed_lease_expiry(kit):
    w = kit.worker("edge-1", slots=2)
    kit.queue(kit.task())
    kit.queue(kit.task("other"))
    started, claimed = kit.claim(w, 2)
    kit.ack(w, started, "starting")
    # A claimed Attempt's Lease is not renewed even when named: only started ones are.
    hb = kit.registry.heartbeat(w["worker_id"], w["credential"], w["session_id"], w["generation"],
                                (_held(started), _held(claimed)))
    stored = kit.one("SELECT expires_at_us FROM run_leases WHERE attempt_id = %s", (started.attempt_id,))
    assert [(x.attempt_id, x.expires_at_us) for x in hb.leases] == [(started.attempt_id, stored)]


def test_a_completed_lease_is_adopted_so_its_log_upload_can_finish(kit):
    w = kit.worker("edge-1")
    run_id, attempt_id = kit.queue(kit.task())
    offer = kit.claim(w)[0]
    for kind in ("starting", "running"):
        kit.ack(w, offer, kind)
    kit.ack(w, offer, "completion", exit_code=0)
    # A completed Lease's expiry does not matter.
    kit.sql("UPDATE run_leases SET expires_at_us = ql_now_us() - 1 WHERE attempt_id = %s", (attempt_id,))
    grant, w2 = _reopen(kit, w, _claim(offer))
    assert [a.attempt_id for a in grant.adopted] == [attempt_id]
    assert _chunk(kit, w2, offer, 0, b"tail\n").next_offset == 5
    assert _ack(kit, w2, offer, "completion", exit_code=0).replay
    assert kit.one("SELECT state FROM runs WHERE run_id = %s", (run_id,)) == "succeeded"


@pytest.mark.parametrize("case, reason, after", [
    ("expired", "lease_expired", "fenced"),
    ("wrong_token", "lease_token_mismatch", "fenced"),
    ("cancelled", "run_cancelled", "fenced"),
    ("claimed", "not_started", "fenced"),
    ("ended", "lease_not_active", "expired"),
    ("unknown", "lease_not_found", "fenced"),
])
def test_a_refused_adoption_rebinds_nothing_and_the_lease_is_fenced_as_before(kit, case, reason, after):
    w = kit.worker("edge-1")
    run_id, attempt_id = kit.queue(kit.task())
    offer = kit.claim(w)[0]
    if case != "claimed":
        kit.ack(w, offer, "starting")
    claim = _claim(offer)
    if case == "expired":
        kit.expire_lease(attempt_id)
    elif case == "wrong_token":
        claim = _claim(offer, token())
    elif case == "cancelled":
        kit.sql("UPDATE runs SET cancel_requested_at_us = ql_now_us() WHERE run_id = %s", (run_id,))
    elif case == "ended":
        kit.expire_lease(attempt_id)
        LeaseSweeper(kit.leases, kit.registry).sweep_once()
    elif case == "unknown":
        claim = AdoptClaim(attempt_id=new_id(), lease_generation=1, lease_token=offer.lease_token)
    grant, _ = _reopen(kit, w, claim)
    assert grant.adopted == () and [(r.attempt_id, r.reason) for r in grant.refused] == [(claim.attempt_id, reason)]
    assert "lease.adopted" not in kit.events(run_id)
    session, generation, state = _lease(kit, attempt_id)
    assert (session, generation, state) == (w["session_id"], w["generation"], after)
    # As with no adoption at all: claimed → queued again for a new offer; started → lost (retry decides).
    expected = {"claimed": ("claimed", "queued"), "cancelled": ("lost", "cancelled")}.get(case, ("lost", "lost"))
    assert kit.sql("SELECT a.state, r.state FROM attempts a JOIN runs r ON r.run_id = a.run_id"
                   " WHERE a.attempt_id = %s", (attempt_id,)) == [expected]


def test_another_workers_lease_is_refused_and_left_untouched(kit):
    other = kit.worker("edge-2")
    run_id, attempt_id = kit.queue(kit.task())
    offer = kit.claim(other)[0]
    kit.ack(other, offer, "starting")
    before = (kit.sql("SELECT * FROM run_leases"), kit.events(run_id))
    w = kit.worker("edge-1")
    grant, _ = _reopen(kit, w, _claim(offer))
    assert grant.adopted == () and [r.reason for r in grant.refused] == ["lease_not_found"]
    assert (kit.sql("SELECT * FROM run_leases"), kit.events(run_id)) == before


@pytest.mark.parametrize("mutate, field", [
    (lambda c: (c,) * 2, "hello.adopt"),
    (lambda c: tuple(AdoptClaim(attempt_id=new_id(), lease_generation=1, lease_token=c.lease_token)
                     for _ in range(MAX_ADOPT + 1)), "hello.adopt"),
    (lambda c: (AdoptClaim(attempt_id=c.attempt_id, lease_generation=1, lease_token="short"),),
     "hello.adopt[0].leaseToken"),
    (lambda c: (AdoptClaim(attempt_id="NOT-A-UUID", lease_generation=1, lease_token=c.lease_token),),
     "hello.adopt[0].attemptId"),
    (lambda c: (AdoptClaim(attempt_id=c.attempt_id, lease_generation=0, lease_token=c.lease_token),),
     "hello.adopt[0].leaseGeneration"),
])
def test_a_bad_adopt_list_is_refused_naming_the_field_and_nothing_is_written(kit, mutate, field):
    w = kit.worker("edge-1")
    kit.queue(kit.task())
    offer = kit.claim(w)[0]
    kit.ack(w, offer, "starting")
    before = (kit.sql("SELECT * FROM run_leases"), kit.sql("SELECT * FROM worker_sessions ORDER BY session_id"),
              kit.sql("SELECT count(*) FROM run_events"))
    with pytest.raises(ValidationError) as e:
        kit.registry.open_session(w["worker_id"], w["credential"], Hello(adopt=mutate(_claim(offer))))
    assert e.value.field == field and offer.lease_token not in str(e.value)
    assert (kit.sql("SELECT * FROM run_leases"), kit.sql("SELECT * FROM worker_sessions ORDER BY session_id"),
            kit.sql("SELECT count(*) FROM run_events")) == before


def test_the_adopting_session_gets_the_offer_with_its_secrets_again_by_the_same_pull_id_and_token(kit):
    # A Worker restarted between its starting ACK and the spawn: its new Session adopts the
    # Lease, and the Pull that brought the offer, under the new Session, answers it again.
    w = kit.worker("edge-1")
    kit.queue(kit.task(secrets_={"API_KEY": "api-key"}))
    req = PullRequest(session_id=w["session_id"], generation=w["generation"], pull_id=new_id(), lease_token=token())
    first = kit.pull().pull(w["worker_id"], w["credential"], req)
    kit.ack(w, first.offer, "starting")
    grant, w2 = _reopen(kit, w, _claim(first.offer))
    assert [a.attempt_id for a in grant.adopted] == [first.offer.attempt_id]
    again = kit.pull().pull(w["worker_id"], w["credential"], msgspec.structs.replace(
        req, session_id=w2["session_id"], generation=w2["generation"]))
    assert again.status == "offered" and again.offer.secrets == {"API_KEY": b"s3cr3t"}
    assert (again.offer.attempt_id, again.offer.lease_generation, again.offer.spec_digest, again.offer.session_id) == (
        first.offer.attempt_id, first.offer.lease_generation, first.offer.spec_digest, w2["session_id"])
    assert kit.one("SELECT count(*) FROM run_leases") == 1                  # no second claim
    with pytest.raises(ConflictError) as e:                                  # the old Session is gone
        kit.pull().pull(w["worker_id"], w["credential"], req)
    assert e.value.code == "stale_generation"
