"""Worker registry, Worker Pull (ADR-0108) and ACKs (ADR-0109) against the real authority."""

from __future__ import annotations

import msgspec
import pytest

from pgkit import COMMAND_MARK, token
from qlagent.adapters.postgres.dispatch import PgDispatchStore, PgPlanSource
from qlagent.cluster.pull import PullRequest, WorkerPull
from qlagent.cluster.registry import Hello, credential_digest
from qlagent.core.canonical import sha256_hex
from qlagent.core.cluster import HeldLease, WorkerAuthError
from qlagent.core.errors import ConflictError, NotFoundError, UnavailableError, ValidationError
from qlagent.core.ids import new_id
from qlagent.core.profiles import EDGE


def _pull(kit, w, pull_id=None, tok=None, **kw):
    req = PullRequest(session_id=w["session_id"], generation=w["generation"], pull_id=pull_id or new_id(),
                      lease_token=tok or token())
    return kit.pull(**kw).pull(w["worker_id"], w["credential"], req), req


def test_enrolment_stores_only_the_credential_digest(kit):
    worker_id, credential = kit.registry.enroll("edge-1", {"site": "lab"}, ("local_process",), 2)
    assert credential.startswith("qlw_") and len(credential) == 47
    row = kit.sql("SELECT credential_digest, labels, slots FROM workers WHERE worker_id = %s", (worker_id,))
    assert row == [(credential_digest(credential), {"site": "lab"}, 2)]
    dump = str(kit.sql("SELECT * FROM workers"))
    assert credential not in dump and credential[4:] not in dump
    with pytest.raises(ConflictError, match="already enrolled"):
        kit.registry.enroll("edge-1")
    with pytest.raises(ValidationError, match="^slots"):
        kit.registry.enroll("edge-2", slots=257)
    with pytest.raises(WorkerAuthError):
        kit.registry.open_session(worker_id, "qlw_" + "x" * 43)


def test_hello_may_narrow_never_widen_the_enrolment(kit):
    worker_id, cred = kit.registry.enroll("edge-1", {"site": "lab", "arch": "arm64"}, ("local_process",), 4)
    g = kit.registry.open_session(worker_id, cred, Hello(labels={"site": "lab"}, slots=2))
    assert (g.labels, g.slots, g.generation) == ({"site": "lab"}, 2, 1)
    for hello, field in ((Hello(labels={"site": "prod"}), "hello.labels.site"), (Hello(slots=5), "hello.slots"),
                         (Hello(labels={"gpu": "yes"}), "hello.labels.gpu")):
        with pytest.raises(ValidationError) as e:
            kit.registry.open_session(worker_id, cred, hello)
        assert e.value.field == field
    assert kit.one("SELECT generation FROM workers WHERE worker_id = %s", (worker_id,)) == 1   # nothing written


def test_pull_claims_for_this_session_only_and_resolves_secrets_after_the_claim(kit):
    w = kit.worker("edge-1", {"site": "lab"})
    kit.worker("aaa-better", {"site": "lab", "fast": "yes"}, slots=8)   # would win a global Placement
    task = kit.task(placement={"preferred": {"fast": "yes"}}, secrets_={"API_KEY": "api-key"})
    run_id, attempt_id = kit.queue(task)
    answer, req = _pull(kit, w)
    assert answer.status == "offered" and answer.offer.worker_id == w["worker_id"]
    assert answer.offer.secrets == {"API_KEY": b"s3cr3t"} and kit.secrets.calls == 1
    lease = kit.sql("SELECT token_digest, pull_id, session_id FROM run_leases WHERE attempt_id = %s", (attempt_id,))
    assert lease == [(sha256_hex(req.lease_token.encode()), req.pull_id, w["session_id"])]
    assert req.lease_token not in str(kit.sql("SELECT * FROM run_leases")) + str(kit.sql("SELECT * FROM run_events"))
    assert COMMAND_MARK not in repr(answer) and b"s3cr3t" not in repr(answer).encode()
    assert b"s3cr3t" not in str(kit.sql("SELECT * FROM secrets")).encode()      # ciphertext only
    # Nothing claimable left: no secret is decrypted for an unclaimed answer.
    again, _ = _pull(kit, w)
    assert (again.status, again.offer) == ("idle", None) and kit.secrets.calls == 1


def test_a_secret_missing_after_the_claim_fails_the_attempt_releases_the_lease_and_frees_the_worker(kit):
    """ADR-0108: values are decrypted only after the claim, so a Secret missing then fails
    closed: start_failed naming the Secret, the Lease released, the Worker not stuck on 503."""
    w = kit.worker("edge-1")
    run_id, attempt_id = kit.queue(kit.task(secrets_={"TOKEN": "not-stored", "API_KEY": "api-key"}))
    answer, req = _pull(kit, w)
    assert (answer.status, answer.reason, answer.offer) == ("lease_ended", "secret_missing:not-stored", None)
    assert kit.sql("SELECT state FROM run_leases WHERE attempt_id = %s", (attempt_id,)) == [("completed",)]
    assert kit.sql("SELECT a.state, a.failure_reason, r.state FROM attempts a JOIN runs r USING (run_id) "
                   "WHERE a.attempt_id = %s", (attempt_id,)) == [("start_failed", "secret_missing:not-stored",
                                                                  "failed")]
    assert kit.events(run_id)[-2:] == ["attempt.start_failed", "run.failed"]
    assert kit.one("SELECT payload_json->>'reason' FROM run_events WHERE run_id = %s AND type = "
                   "'attempt.start_failed'", (run_id,)) == "secret_missing:not-stored"
    assert b"s3cr3t" not in str(kit.sql("SELECT * FROM run_events")).encode()
    # The same pull retried (its answer lost) ends the same way and writes nothing more.
    events = kit.events(run_id)
    again = kit.pull().pull(w["worker_id"], w["credential"], req)
    assert again.status == "lease_ended" and kit.events(run_id) == events
    # The Worker's one slot is free again: the next Run is offered to it.
    kit.queue(kit.task("plain"))
    assert _pull(kit, w)[0].status == "offered"


def test_a_secret_that_does_not_decrypt_after_the_claim_fails_closed_and_the_retry_policy_decides(kit, tmp_path):
    from qlagent.adapters.secretbox import SecretBox, create_key_file
    w = kit.worker("edge-1")
    pid = kit.project()
    create_key_file(str(tmp_path / "other.key"))               # sealed under a key this replica does not have
    other = SecretBox(str(tmp_path / "other.key"))
    kit.sql("INSERT INTO secrets VALUES (%s, 'rotated', %s, %s, ql_now_us())",
            (pid, other.seal(pid, "rotated", b"0ld-v4lue"), other.key_id))
    run_id, attempt_id = kit.queue(kit.task(secrets_={"OLD": "rotated"}, max_attempts=2))
    answer, _ = _pull(kit, w)
    assert (answer.status, answer.reason) == ("lease_ended", "secret_unreadable:rotated")
    assert kit.one("SELECT count(*) FROM run_leases WHERE state = 'active'") == 0
    assert kit.sql("SELECT failure_reason FROM attempts WHERE attempt_id = %s", (attempt_id,)) == \
        [("secret_unreadable:rotated",)]
    assert kit.one("SELECT state FROM runs WHERE run_id = %s", (run_id,)) == "queued"     # attempt 2 of 2 follows
    assert kit.events(run_id)[-2:] == ["attempt.start_failed", "run.retrying"]
    assert b"0ld-v4lue" not in str(kit.sql("SELECT * FROM run_events")).encode()


def test_pull_retried_after_a_lost_response_rebuilds_the_identical_answer(kit):
    w = kit.worker("edge-1", slots=2)
    task = kit.task(secrets_={"API_KEY": "api-key"})
    kit.queue(task)
    kit.queue(task)
    first, req = _pull(kit, w)
    # The answer was lost; the Worker sends the very same request again.
    retried = kit.pull().pull(w["worker_id"], w["credential"], req)
    assert msgspec.json.encode(retried) == msgspec.json.encode(first)
    assert kit.one("SELECT count(*) FROM run_leases") == 1              # no second claim
    with pytest.raises(ConflictError) as e:                               # same pullId, another token
        kit.pull().pull(w["worker_id"], w["credential"], msgspec.structs.replace(req, lease_token=token()))
    assert e.value.code == "pull_token_mismatch"
    kit.ack(w, first.offer, "starting")
    # Until the run is reported running the same answer is rebuilt, secret values included (a
    # Worker restarted between its starting ACK and the spawn kept none of them).
    after_starting = kit.pull().pull(w["worker_id"], w["credential"], req).offer
    assert after_starting.lease_expires_at_us >= first.offer.lease_expires_at_us     # the ACK extended it
    assert after_starting == msgspec.structs.replace(first.offer, lease_expires_at_us=after_starting.lease_expires_at_us)
    kit.ack(w, first.offer, "running")
    after_running = kit.pull().pull(w["worker_id"], w["credential"], req)
    assert (after_running.status, after_running.reason, after_running.offer) == ("lease_ended", "attempt_running",
                                                                                 None)


@pytest.mark.parametrize("policy, carried", [(None, "kill"), ("keep", "keep"), ("kill", "kill")])
def test_the_tasks_on_lease_loss_reaches_the_worker_in_the_execution_spec(kit, policy, carried):
    w = kit.worker(f"edge-{policy or 'unset'}")
    kit.queue(kit.task(f"job-{policy or 'unset'}", on_lease_loss=policy))
    answer, _ = _pull(kit, w)
    assert answer.status == "offered" and answer.offer.spec.on_lease_loss == carried


def test_a_pull_skips_runs_another_claimer_holds_and_takes_the_next_at_once(kit):
    w = kit.worker("edge-1", slots=4)
    task = kit.task()
    first, _ = kit.queue(task)
    second, _ = kit.queue(task)
    # Another replica's Pull is between reading the first Run and committing its claim.
    with kit.pool.connection() as other, other.transaction():
        other.execute("SELECT 1 FROM runs WHERE run_id = %s FOR NO KEY UPDATE", (first,))
        answer, _ = _pull(kit, w)
        assert (answer.status, answer.offer.run_id) == ("offered", second)
        nothing, _ = _pull(kit, w)               # the held Run is not waited for, nor claimed twice
        assert (nothing.status, nothing.offer) == ("idle", None)
    answer, _ = _pull(kit, w)                     # released unclaimed: the next Pull takes it
    assert (answer.status, answer.offer.run_id) == ("offered", first)
    assert kit.one("SELECT count(*) FROM run_leases") == 2


def test_plans_come_from_a_bounded_revision_cache_with_each_runs_own_identity(kit):
    w = kit.worker("edge-1", slots=4)
    plans = PgPlanSource(kit.pool, EDGE, revisions=1)          # every other Pull evicts the other Task
    pull = WorkerPull(PgDispatchStore(kit.pool, plans), kit.secrets)
    a, b = kit.task("a", command=["/bin/echo", "a"]), kit.task("b", command=["/bin/echo", "b"])
    runs = [kit.queue(t) for t in (a, b, a, b)]
    offers = [pull.pull(w["worker_id"], w["credential"], PullRequest(
        session_id=w["session_id"], generation=w["generation"], pull_id=new_id(), lease_token=token())).offer
        for _ in runs]
    assert [(o.spec.run_id, o.spec.attempt_id, o.spec.argv[1]) for o in offers] == [
        (r, at, name) for (r, at), name in zip(runs, "abab")]


def test_pull_refuses_a_stale_generation_and_bad_fields(kit):
    w = kit.worker("edge-1")
    kit.registry.open_session(w["worker_id"], w["credential"], Hello())
    with pytest.raises(ConflictError) as e:
        _pull(kit, w)
    assert e.value.code == "stale_generation"
    for change, field in (({"pull_id": "NOT-A-UUID"}, "pullId"), ({"lease_token": "short"}, "leaseToken"),
                          ({"generation": 0}, "generation")):
        req = msgspec.structs.replace(PullRequest(session_id=w["session_id"], generation=w["generation"],
                                                  pull_id=new_id(), lease_token=token()), **change)
        with pytest.raises(ValidationError) as e:
            kit.pull().pull(w["worker_id"], w["credential"], req)
        assert e.value.field == field
    other = kit.worker("edge-2")
    with pytest.raises(WorkerAuthError):            # a credential acts only for its own Worker ID
        kit.pull().pull(w["worker_id"], other["credential"], PullRequest(
            session_id=w["session_id"], generation=2, pull_id=new_id(), lease_token=token()))


def test_acks_are_fenced_ordered_and_idempotent(kit):
    w = kit.worker("edge-1")
    run_id, _ = kit.queue(kit.task())
    offer = kit.claim(w)[0]
    with pytest.raises(ConflictError) as e:
        kit.ack(w, offer, "running")
    assert e.value.code == "ack_out_of_order"
    assert kit.ack(w, offer, "starting").replay is False
    assert kit.ack(w, offer, "starting").replay is True          # retried after a lost answer
    assert kit.ack(w, offer, "running").run_state == "running"
    bad = msgspec.structs.replace(offer, lease_token=token())
    with pytest.raises(ConflictError) as e:
        kit.ack(w, bad, "completion", exit_code=0)
    assert e.value.code == "lease_token_mismatch"
    done = kit.ack(w, offer, "completion", exit_code=0, bytes_kept=12, cpu_time_us=5)
    assert (done.attempt_state, done.run_state, done.replay) == ("succeeded", "succeeded", False)
    assert kit.ack(w, offer, "completion", exit_code=0).replay is True
    with pytest.raises(ConflictError) as e:
        kit.ack(w, offer, "completion", exit_code=3)
    assert e.value.code == "ack_conflict"
    assert kit.events(run_id) == ["run.created", "run.queued", "run.dispatching", "run.starting", "run.running",
                                  "attempt.succeeded", "run.succeeded"]
    with pytest.raises(ValidationError) as e:
        kit.ack(w, offer, "completion", exit_code=0, signal=9)
    assert e.value.field == "exitCode"


def test_a_completion_that_dropped_bytes_records_the_truncation_fact(kit):
    """The Worker uploads only the kept bytes, so the cut is known from the completion ACK alone
    (issue 10 §7: completion carries the truncation fact): the quota's, or a failed log write's
    with its ``truncationReason``, which ``run logs`` on any replica reads back."""
    w = kit.worker("edge-1", slots=3)
    task = kit.task()
    for _ in range(3):
        kit.queue(task)
    cut, full, whole = kit.claim(w, 3)
    for offer in (cut, full, whole):
        kit.ack(w, offer, "starting")
    reason = "write_error: ENOSPC (No space left on device)"
    with pytest.raises(ValidationError) as e:
        kit.ack(w, full, "completion", exit_code=0, bytes_kept=901_120, bytes_dropped=5_000,
                truncation_reason="write_error: /var/log/secret\n")
    assert e.value.field == "truncationReason"
    kit.ack(w, cut, "completion", exit_code=0, bytes_kept=4_194_304, bytes_dropped=5_000)
    kit.ack(w, full, "completion", exit_code=0, bytes_kept=901_120, bytes_dropped=3_098_925, truncation_reason=reason)
    kit.ack(w, whole, "completion", exit_code=0, bytes_kept=12, bytes_dropped=0)
    assert sorted(kit.sql("SELECT attempt_id, quota_bytes, bytes_kept, bytes_dropped, reason FROM truncation_facts")) \
        == sorted([(cut.attempt_id, 4_194_304, 4_194_304, 5_000, "quota"),
                   (full.attempt_id, 901_120, 901_120, 3_098_925, reason)])
    kit.ack(w, cut, "completion", exit_code=0, bytes_kept=4_194_304, bytes_dropped=5_000)     # a replay
    assert kit.one("SELECT count(*) FROM truncation_facts") == 2
    _, _, fact = kit.logs.read_range(full.run_id, 0, 16)
    assert (fact.bytes_kept, fact.bytes_dropped, fact.reason) == (901_120, 3_098_925, reason)


def test_stale_generation_ack_is_refused_with_a_distinct_reason(kit):
    w = kit.worker("edge-1")
    kit.queue(kit.task())
    offer = kit.claim(w)[0]
    kit.ack(w, offer, "starting")
    kit.registry.open_session(w["worker_id"], w["credential"], Hello())       # the Worker restarted
    with pytest.raises(ConflictError) as e:
        kit.ack(w, offer, "running")
    assert e.value.code == "stale_generation"
    with pytest.raises(ConflictError) as e:     # the generation is judged before the Lease is looked up
        kit.ack(w, msgspec.structs.replace(offer, lease_generation=5), "running")
    assert e.value.code == "stale_generation"


def test_start_failure_and_retry_policy(kit):
    w = kit.worker("edge-1")
    run_id, first_attempt = kit.queue(kit.task(max_attempts=2))
    offer = kit.claim(w)[0]
    r = kit.ack(w, offer, "start_failure", start_error="exec_failed")
    assert (r.attempt_state, r.run_state) == ("start_failed", "queued")
    nxt = kit.claim(w)[0]
    assert nxt.run_id == run_id and nxt.attempt_id != first_attempt and nxt.lease_generation == 1
    kit.ack(w, nxt, "starting")
    assert kit.ack(w, nxt, "completion", exit_code=1).run_state == "failed"   # 2 of 2 attempts used


def test_heartbeat_renews_running_leases_and_carries_cancel_intents(kit):
    w = kit.worker("edge-1", slots=2)
    task = kit.task()
    run_a, _ = kit.queue(task)
    kit.queue(task)
    a, b = kit.claim(w, 2)
    kit.ack(w, a, "starting")
    kit.sql("UPDATE runs SET cancel_requested_at_us = ql_now_us() WHERE run_id = %s", (b.run_id,))
    before = dict(kit.sql("SELECT attempt_id, expires_at_us FROM run_leases"))
    hb = kit.registry.heartbeat(w["worker_id"], w["credential"], w["session_id"], w["generation"],
                                (HeldLease(attempt_id=a.attempt_id, lease_generation=a.lease_generation),))
    after = dict(kit.sql("SELECT attempt_id, expires_at_us FROM run_leases"))
    assert hb.cancel == [b.attempt_id]
    assert after[a.attempt_id] >= before[a.attempt_id] and after[b.attempt_id] == before[b.attempt_id]
    kit.sql("UPDATE worker_sessions SET expires_at_us = ql_now_us() - 1")
    with pytest.raises(ConflictError) as e:
        kit.registry.heartbeat(w["worker_id"], w["credential"], w["session_id"], w["generation"])
    assert e.value.code == "session_expired"
    assert kit.registry.expire_sessions(8) == 1
    assert [r["state"] for r in kit.registry_store.workers(10)] == ["offline"]


def test_drain_stops_new_claims_and_remove_fences_leases(kit):
    w = kit.worker("edge-1", slots=2)
    task = kit.task()
    run_a, _ = kit.queue(task)
    kit.queue(task)
    a = kit.claim(w)[0]
    kit.ack(w, a, "starting")
    kit.registry.drain("edge-1")
    assert [r["state"] for r in kit.registry_store.workers(10)] == ["draining"]
    assert _pull(kit, w)[0].reason == "draining"
    kit.registry.remove("edge-1")
    assert kit.one("SELECT state FROM run_leases WHERE attempt_id = %s", (a.attempt_id,)) == "fenced"
    assert kit.one("SELECT state FROM runs WHERE run_id = %s", (run_a,)) == "lost"
    with pytest.raises(NotFoundError):
        kit.registry.remove("edge-1")
    kit.registry.enroll("edge-1")                     # the name is free again


def test_long_poll_is_woken_by_notify_when_a_candidate_appears(kit, pg_url):
    import threading
    import time

    from qlagent.adapters.postgres.notify import PgCandidateSignal
    w = kit.worker("edge-1")
    task = kit.task()
    signal = PgCandidateSignal(pg_url)
    try:
        pull = kit.pull(signal=signal)
        req = PullRequest(session_id=w["session_id"], generation=w["generation"], pull_id=new_id(),
                          lease_token=token())
        quiet = pull.pull(w["worker_id"], w["credential"], req, wait_s=0.3)
        assert (quiet.status, quiet.offer) == ("idle", None)          # nothing arrived: idle after the wait
        threading.Timer(0.5, lambda: kit.queue(task)).start()
        started = time.monotonic()
        answer = pull.pull(w["worker_id"], w["credential"], req, wait_s=20)
        assert answer.status == "offered"
        assert time.monotonic() - started < 10          # woken by the NOTIFY, not by the end of the wait
        with pytest.raises(ValidationError) as e:
            pull.pull(w["worker_id"], w["credential"], req, wait_s=31)
        assert e.value.field == "waitS"
    finally:
        signal.close()


@pytest.mark.parametrize("looks", [1, 6])      # 6: held past a few quick looks (a loaded machine)
def test_a_waiting_pull_takes_a_run_another_pull_held_and_released_without_a_notify(kit, pg_url, looks):
    import threading

    from qlagent.adapters.postgres.notify import PgCandidateSignal
    w = kit.worker("edge-1")
    run_id, _ = kit.queue(kit.task())
    signal = PgCandidateSignal(pg_url)
    held, release = threading.Event(), threading.Event()

    def other_pull() -> None:       # another Worker's Pull: reads the Run, does not match, lets it go
        with kit.pool.connection() as conn, conn.transaction():
            conn.execute("SELECT 1 FROM runs WHERE run_id = %s FOR NO KEY UPDATE", (run_id,))
            held.set()
            release.wait(10)
    seen_by = []

    class ReleaseAfterLooks:        # the other Pull lets go once this one skipped its Run `looks` times
        def pull_unit(self, *args):
            work = args[-1]

            def seen(unit):
                answer, held_elsewhere = work(unit)
                seen_by.append(answer.status)
                if len(seen_by) >= looks:
                    release.set()
                return answer, held_elsewhere
            return kit.store.pull_unit(*args[:-1], seen)
    t = threading.Thread(target=other_pull)
    t.start()
    try:
        assert held.wait(10)
        req = PullRequest(session_id=w["session_id"], generation=w["generation"], pull_id=new_id(),
                          lease_token=token())
        # No NOTIFY follows the release (the Run was queued before): without looking again the
        # Pull would sleep through its whole wait and answer idle.
        answer = WorkerPull(ReleaseAfterLooks(), kit.secrets, signal=signal).pull(
            w["worker_id"], w["credential"], req, wait_s=20)
        assert (answer.status, answer.offer.run_id) == ("offered", run_id)
        assert seen_by == ["idle"] * looks + ["offered"]           # it looked until the Run was let go
    finally:
        release.set()
        t.join(10)
        signal.close()


@pytest.mark.parametrize("kind,facts,field", [
    ("finished", {}, "kind"), ("start_failure", {"start_error": "Bad Code!"}, "startError"),
    ("completion", {}, "exitCode"), ("completion", {"exit_code": 256}, "exitCode"),
    ("completion", {"signal": 65}, "signal"), ("completion", {"exit_code": 0, "kill_reason": "oom"}, "killReason"),
    ("completion", {"exit_code": 0, "bytes_kept": -1}, "bytesKept")])
def test_bad_ack_names_the_field_and_writes_nothing(kit, kind, facts, field):
    w = kit.worker("edge-1")
    run_id, _ = kit.queue(kit.task())
    offer = kit.claim(w)[0]
    kit.ack(w, offer, "starting")
    before = kit.sql("SELECT state, version, event_sequence FROM runs WHERE run_id = %s", (run_id,))
    with pytest.raises(ValidationError) as e:
        kit.ack(w, offer, kind, **facts)
    assert e.value.field == field
    assert kit.sql("SELECT state, version, event_sequence FROM runs WHERE run_id = %s", (run_id,)) == before
    assert kit.ack(w, offer, "completion", exit_code=255).attempt_state == "failed"     # 255: the edge
