"""A Session's Pulls after its first claim (issue 25 §3): one call of the authority
(``PullStore.quick_pull``) claims the first candidate when this replica has already walked a
Run of the same Task revision, Project and executor for that Session; anything else goes
through the whole ADR-0014 walk. Either way the Worker gets the same offer, and every rule the
walk keeps (Placement, single instance, Project scope, draining, free slots, a retried pullId)
still holds. One ``WorkerPull`` per test, as a replica has one."""

from __future__ import annotations

import msgspec
import pytest

from pgkit import token
from qlagent.cluster.execspec import spec_digest
from qlagent.cluster.pull import PullRequest, WorkerPull
from qlagent.core.canonical import sha256_hex
from qlagent.core.cluster import QuickStatus
from qlagent.core.ids import new_id


class Paths:
    """The real Pull store, counting which path answered each Pull."""

    def __init__(self, store) -> None:
        self.store, self.quick, self.units = store, [], 0

    def __getattr__(self, name):
        return getattr(self.store, name)

    def quick_pull(self, *args):
        got = self.store.quick_pull(*args)
        self.quick.append(got.status)
        return got

    def pull_unit(self, *args):
        self.units += 1
        return self.store.pull_unit(*args)


@pytest.fixture
def puller(kit):
    paths = Paths(kit.store)
    return paths, WorkerPull(paths, kit.secrets)


def _pull(pull, w, pull_id=None, tok=None):
    req = PullRequest(session_id=w["session_id"], generation=w["generation"], pull_id=pull_id or new_id(),
                      lease_token=tok or token())
    return pull.pull(w["worker_id"], w["credential"], req), req


def test_the_next_pull_of_a_session_claims_in_one_call_and_offers_what_the_walk_offers(kit, puller):
    paths, pull = puller
    w = kit.worker("edge-1", {"site": "lab", "fast": "yes"}, slots=4)
    task = kit.task(placement={"preferred": {"fast": "yes"}}, secrets_={"API_KEY": "api-key"})
    (first_run, _), (second_run, second_attempt) = kit.queue(task), kit.queue(task)
    walked, _ = _pull(pull, w)
    assert (walked.status, walked.offer.run_id, paths.units, paths.quick) == ("offered", first_run, 1, [])
    quick, req = _pull(pull, w)
    assert (quick.status, quick.offer.run_id, paths.units, paths.quick) == ("offered", second_run, 1, [QuickStatus.LEASED])
    o = quick.offer
    identities = ("run_id", "attempt_id")
    assert {k: v for k, v in msgspec.structs.asdict(o.spec).items() if k not in identities} == \
        {k: v for k, v in msgspec.structs.asdict(walked.offer.spec).items() if k not in identities}
    assert (o.spec.run_id, o.spec.attempt_id, o.spec_digest) == (second_run, second_attempt, spec_digest(o.spec))
    assert (o.placement_score, o.secrets, o.lease_generation) == (1, {"API_KEY": b"s3cr3t"}, 1)
    assert o.spec.env is not walked.offer.spec.env                    # no offer shares a table with another
    lease = kit.sql("SELECT token_digest, pull_id, session_id, state, expires_at_us - claimed_at_us FROM run_leases"
                    " WHERE attempt_id = %s", (second_attempt,))
    assert lease == [(sha256_hex(req.lease_token.encode()), req.pull_id, w["session_id"], "active", 30_000_000)]
    assert kit.events(second_run) == ["run.created", "run.queued", "run.dispatching"]
    payload = kit.one("SELECT payload_json FROM run_events WHERE run_id = %s AND sequence = 3", (second_run,))
    assert payload == {"attemptId": second_attempt, "workerId": w["worker_id"], "sessionId": w["session_id"],
                       "generation": w["generation"], "leaseGeneration": 1}
    again, _ = _pull(pull, w, req.pull_id, req.lease_token)           # the same Pull retried: the same offer
    assert (again.offer.offer_id, paths.quick[-1]) == (o.offer_id, QuickStatus.WALK)
    assert kit.one("SELECT count(*) FROM run_leases") == 2


def test_a_candidate_the_session_has_not_walked_goes_through_the_walk(kit, puller):
    paths, pull = puller
    w = kit.worker("edge-1", slots=4)
    ok = kit.task("ok")
    kit.queue(ok)
    assert _pull(pull, w)[0].status == "offered"
    gpu_run, _ = kit.queue(kit.task("gpu", placement={"required": {"gpu": "yes"}}), priority=5)
    ok_run, _ = kit.queue(ok)
    answer, _ = _pull(pull, w)
    assert (answer.offer.run_id, paths.quick, paths.units) == (ok_run, [QuickStatus.WALK], 2)
    assert kit.sql("SELECT state FROM runs WHERE run_id = %s", (gpu_run,)) == [("queued",)]


def test_a_quick_claim_keeps_a_single_instance_task_to_one_live_run(kit, puller):
    paths, pull = puller
    w = kit.worker("edge-1", slots=4)
    task = kit.task("solo")
    runs = [kit.queue(task)[0] for _ in range(2)]
    kit.sql("UPDATE runs SET single_instance = true")
    assert _pull(pull, w)[0].offer.run_id == runs[0]
    # A Run the holds did not catch (a Task Start that could not see the first one yet).
    kit.sql("UPDATE runs SET held = false WHERE run_id = %s", (runs[1],))
    answer, _ = _pull(pull, w)
    assert (answer.status, answer.reason, paths.quick) == ("unmatched", "attempt_unavailable", [QuickStatus.WALK])
    assert kit.sql("SELECT state, held FROM runs WHERE run_id = %s", (runs[1],)) == [("queued", True)]
    assert kit.one("SELECT count(*) FROM run_leases") == 1


def test_quick_pulls_keep_the_project_scope_the_slots_and_draining(kit, puller):
    paths, pull = puller
    mine = kit.task("mine")
    name = kit.one("SELECT name FROM projects WHERE project_id = %s", (mine["project_id"],))
    kit.project_id = None
    theirs = kit.task("theirs")                                         # another Project's
    worker_id, credential = kit.registry.enroll("edge-1", slots=2, projects=(name,))
    grant = kit.registry.open_session(worker_id, credential)
    w = {"worker_id": worker_id, "credential": credential, "session_id": grant.session_id,
         "generation": grant.generation}
    kit.queue(mine)
    assert _pull(pull, w)[0].status == "offered"
    their_run, _ = kit.queue(theirs, priority=9)
    my_run, _ = kit.queue(mine)
    assert _pull(pull, w)[0].offer.run_id == my_run and paths.quick == [QuickStatus.LEASED]
    kit.queue(mine)
    assert _pull(pull, w)[0].reason == "no_free_slot" and paths.quick[-1] == QuickStatus.NO_OFFER
    kit.sql("UPDATE run_leases SET state = 'completed'")
    kit.registry.drain("edge-1")
    assert _pull(pull, w)[0].reason == "draining" and paths.quick[-1] == QuickStatus.NO_OFFER
    assert kit.sql("SELECT state FROM runs WHERE run_id = %s", (their_run,)) == [("queued",)]


def test_a_waiting_quick_pull_looks_again_while_another_pull_holds_the_candidate(kit, puller, pg_url):
    from qlagent.adapters.postgres.notify import PgCandidateSignal
    paths, _ = puller
    signal = PgCandidateSignal(pg_url)
    try:
        pull = WorkerPull(paths, kit.secrets, signal=signal)
        w = kit.worker("edge-1", slots=4)
        task = kit.task()
        kit.queue(task)
        assert _pull(pull, w)[0].status == "offered"
        run_id, _ = kit.queue(task)
        with kit.pool.connection() as conn:
            conn.execute("SELECT 1 FROM runs WHERE run_id = %s FOR NO KEY UPDATE", (run_id,))
            req = PullRequest(session_id=w["session_id"], generation=w["generation"], pull_id=new_id(),
                              lease_token=token())
            # Held elsewhere for this Pull's first looks: it answers idle only at the end of its wait.
            answer = pull.pull(w["worker_id"], w["credential"], req, wait_s=1)
        assert answer.status == "idle" and paths.quick.count(QuickStatus.NO_OFFER) >= 2
        assert pull.pull(w["worker_id"], w["credential"], PullRequest(
            session_id=w["session_id"], generation=w["generation"], pull_id=new_id(),
            lease_token=token())).offer.run_id == run_id
    finally:
        signal.close()
