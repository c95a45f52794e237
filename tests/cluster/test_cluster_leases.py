"""Lease sweeper, log chunks and claim races against the real authority."""

from __future__ import annotations

import json
import subprocess
import sys
import threading

import pytest

from pgkit import token
from qlagent.cluster.leases import LeaseSweeper
from qlagent.cluster.logs import LogUpload
from qlagent.cluster.offer import offer_id
from qlagent.core.cluster import MAX_CHUNK_BYTES, PullRequest
from qlagent.core.errors import ConflictError, ValidationError
from qlagent.core.ids import new_id
from qlagent.core.profiles import EDGE


def test_lease_expired_before_starting_requeues_and_reoffers_with_a_new_offer_id(kit):
    w = kit.worker("edge-1")
    run_id, attempt_id = kit.queue(kit.task())
    first = kit.claim(w)[0]
    kit.expire_lease(attempt_id)
    with pytest.raises(ConflictError) as e:             # the Worker is too late
        kit.ack(w, first, "starting")
    assert e.value.code == "lease_expired"
    r = LeaseSweeper(kit.leases, kit.registry).sweep_once()
    assert (r.leases_expired, r.requeued, r.ended) == (1, 1, 0)
    assert kit.sql("SELECT state FROM attempts WHERE run_id = %s", (run_id,)) == [("claimed",)]
    again = kit.claim(w)[0]
    assert (again.attempt_id, again.lease_generation) == (attempt_id, 2)
    assert again.offer_id == offer_id(attempt_id, 2, w["session_id"]) != first.offer_id
    assert kit.events(run_id)[2:] == ["run.dispatching", "run.requeued", "run.dispatching"]
    kit.ack(w, again, "starting")
    with pytest.raises(ConflictError) as e:             # the old Lease stays dead, even as a "replay"
        kit.ack(w, first, "starting")
    assert e.value.code == "lease_not_active"


@pytest.mark.parametrize("max_attempts,run_state,tail", [
    (2, "queued", ["attempt.lost", "run.retrying"]), (1, "lost", ["attempt.lost", "run.lost"])])
def test_lease_expired_after_running_loses_the_attempt_and_retry_decides(kit, max_attempts, run_state, tail):
    w = kit.worker("edge-1")
    run_id, attempt_id = kit.queue(kit.task(max_attempts=max_attempts))
    offer = kit.claim(w)[0]
    kit.ack(w, offer, "starting")
    kit.ack(w, offer, "running")
    kit.expire_lease(attempt_id)
    r = LeaseSweeper(kit.leases, kit.registry).sweep_once()
    assert (r.leases_expired, r.ended if run_state == "lost" else r.requeued) == (1, 1)
    assert kit.one("SELECT state FROM attempts WHERE attempt_id = %s", (attempt_id,)) == "lost"
    assert kit.one("SELECT state FROM runs WHERE run_id = %s", (run_id,)) == run_state
    assert kit.events(run_id)[-2:] == tail


def test_sweeper_is_bounded_and_skips_rows_another_replica_holds(kit):
    w = kit.worker("edge-1", slots=8)
    task = kit.task()
    for _ in range(5):
        kit.queue(task)
    offers = kit.claim(w, 5)
    kit.sql("UPDATE run_leases SET expires_at_us = ql_now_us() - 1")
    locked = sorted(o.attempt_id for o in offers)[0]
    hold = threading.Event()
    done = threading.Event()

    def other_replica():
        with kit.pool.connection() as conn, conn.transaction():
            conn.execute("SELECT 1 FROM run_leases WHERE attempt_id = %s FOR UPDATE", (locked,))
            hold.set()
            done.wait(30)
    t = threading.Thread(target=other_replica)
    t.start()
    hold.wait(30)
    try:
        sweeper = LeaseSweeper(kit.leases, kit.registry, batch=2)
        passes = [sweeper.sweep_once() for _ in range(3)]
    finally:
        done.set()
        t.join()
    assert [p.leases_expired for p in passes] == [2, 2, 0]          # never blocked on the held row
    assert passes[0].truncated and not passes[2].truncated
    assert kit.one("SELECT state FROM run_leases WHERE attempt_id = %s", (locked,)) == "active"
    assert LeaseSweeper(kit.leases, kit.registry).sweep_once().leases_expired == 1
    with pytest.raises(ValidationError, match="cluster.sweep_batch"):
        LeaseSweeper(kit.leases, kit.registry, batch=65)


def _upload(kit, w, offer, offset, data, profile=EDGE):
    return LogUpload(kit.logs, profile).append(
        w["worker_id"], w["credential"], session_id=offer.session_id, generation=offer.generation,
        attempt_id=offer.attempt_id, lease_generation=offer.lease_generation, lease_token=offer.lease_token,
        offset=offset, data=data)


def test_log_chunks_are_idempotent_per_offset(kit):
    w = kit.worker("edge-1")
    kit.queue(kit.task())
    offer = kit.claim(w)[0]
    assert _upload(kit, w, offer, 0, b"hello ").next_offset == 6
    assert _upload(kit, w, offer, 0, b"hello ").next_offset == 6      # retried after a lost answer
    for offset, data, code in ((0, b"HELLO ", "chunk_mismatch"), (9, b"x", "chunk_gap"),
                               (2, b"llo ", "chunk_mismatch")):
        with pytest.raises(ConflictError) as e:
            _upload(kit, w, offer, offset, data)
        assert e.value.code == code
    assert _upload(kit, w, offer, 6, b"world\n").next_offset == 12
    assert kit.logs.read(offer.attempt_id, 0, 100) == b"hello world\n"
    assert kit.logs.read(offer.attempt_id, 3, 5) == b"lo wo"
    with pytest.raises(ValidationError) as e:
        _upload(kit, w, offer, 12, b"x" * (MAX_CHUNK_BYTES + 1))
    assert e.value.field == "data"


def test_log_chunks_capped_at_the_profile_quota_with_a_truncation_fact(kit):
    w = kit.worker("edge-1")
    kit.queue(kit.task())
    offer = kit.claim(w)[0]
    chunk = b"y" * MAX_CHUNK_BYTES
    n = EDGE.log_max_bytes // MAX_CHUNK_BYTES
    for i in range(n):
        assert _upload(kit, w, offer, i * MAX_CHUNK_BYTES, chunk).truncated is False
    over = _upload(kit, w, offer, n * MAX_CHUNK_BYTES, b"z" * 10)       # the first bytes past the quota
    assert (over.next_offset, over.truncated) == (EDGE.log_max_bytes + 10, True)
    assert _upload(kit, w, offer, n * MAX_CHUNK_BYTES, b"z" * 10).truncated is True   # idempotent
    assert kit.one("SELECT sum(length(data)) FROM log_chunks") == EDGE.log_max_bytes
    assert kit.sql("SELECT quota_bytes, bytes_kept FROM truncation_facts") == [(EDGE.log_max_bytes,
                                                                                EDGE.log_max_bytes)]


def test_concurrent_pulls_for_one_candidate_make_exactly_one_lease(kit):
    workers = [kit.worker(f"w{i:02d}") for i in range(16)]
    _, attempt_id = kit.queue(kit.task())
    barrier = threading.Barrier(len(workers))
    results = []

    def pull(w):
        barrier.wait()
        results.append(kit.pull().pull(w["worker_id"], w["credential"], PullRequest(
            session_id=w["session_id"], generation=w["generation"], pull_id=new_id(), lease_token=token())).status)
    threads = [threading.Thread(target=pull, args=(w,)) for w in workers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results).count("offered") == 1 and len(results) == 16
    assert kit.one("SELECT count(*) FROM run_leases WHERE attempt_id = %s", (attempt_id,)) == 1


PULLER = """
import json, sys, secrets
from qlagent.adapters.postgres.connection import open_pool
from qlagent.adapters.postgres.dispatch import PgDispatchStore, PgPlanSource
from qlagent.cluster.pull import PullRequest, WorkerPull
from qlagent.core.ids import new_id
from qlagent.core.profiles import EDGE
url, workers = sys.argv[1], json.loads(sys.argv[2])
pool = open_pool(url, 2)
pull = WorkerPull(PgDispatchStore(pool, PgPlanSource(pool, EDGE)), None)
idle = 0
while idle < 3:
    got = False
    for w in workers:
        a = pull.pull(w["worker_id"], w["credential"], PullRequest(session_id=w["session_id"],
                      generation=w["generation"], pull_id=new_id(), lease_token=secrets.token_urlsafe(32)))
        if a.status == "offered":
            print(a.offer.attempt_id, flush=True)
            got = True
    idle = 0 if got else idle + 1
"""


def test_pullers_in_four_processes_claim_every_run_exactly_once_even_when_one_is_killed(kit, pg_url):
    runs = 160
    task = kit.task()
    for _ in range(runs):
        kit.queue(task)
    workers = [kit.worker(f"w{i:02d}", slots=runs) for i in range(8)]
    procs = [subprocess.Popen([sys.executable, "-c", PULLER, pg_url, json.dumps(workers[i::4])],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(4)]
    victim = procs[0]
    for _ in range(5):                      # SIGKILL one puller in the middle of its claiming
        assert victim.stdout.readline()
    victim.kill()
    victim.wait(30)
    claimed = []
    for p in procs[1:]:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        claimed += out.split()
    assert len(claimed) == len(set(claimed))                            # 0 double claims among survivors
    # Checked from the database: every Run leased exactly once, none lost with the killed puller.
    assert kit.one("SELECT count(*) FROM run_leases") == runs
    assert kit.one("SELECT count(DISTINCT attempt_id) FROM run_leases WHERE state = 'active'") == runs
    assert kit.one("SELECT count(*) FROM runs WHERE state <> 'dispatching'") == 0
