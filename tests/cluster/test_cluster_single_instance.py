"""`concurrency = "single"` (the default) on the cluster authority: one live Run per Task across
Workers and replicas, and a queued Run held behind it is offered once that Run ends.

The Worker ACK and sweeper paths release the holds a Task Start wrote while a Run was live,
so a Task's queue drains after a burst of Task Starts; and no two Workers lease two Runs of one
single-instance Task at once.
"""

from __future__ import annotations

import threading

import pytest
from psycopg.rows import dict_row

from pgkit import token
from qlagent.adapters.postgres.runs import set_holds
from qlagent.cluster.leases import LeaseSweeper
from qlagent.cluster.pull import PullRequest
from qlagent.core.ids import new_id


def _queue_single(kit, task: dict) -> str:
    """A queued single-instance Run, holds recomputed in the same transaction (as ``create_run``)."""
    run_id, _ = kit.queue(task)
    with kit.pool.connection() as conn, conn.cursor(row_factory=dict_row) as cur:
        cur.execute("UPDATE runs SET single_instance = true WHERE run_id = %s", (run_id,))
        set_holds(cur, task["task_id"])
    return run_id


def _pull(kit, w):
    req = PullRequest(session_id=w["session_id"], generation=w["generation"], pull_id=new_id(), lease_token=token())
    return kit.pull().pull(w["worker_id"], w["credential"], req)


def _state(kit, run_id: str) -> tuple[str, bool]:
    return kit.sql("SELECT state, held FROM runs WHERE run_id = %s", (run_id,))[0]


def test_a_run_held_behind_a_live_one_is_offered_once_that_run_completes(kit):
    w = kit.worker("edge-1", slots=2)
    task = kit.task("solo")
    first = _queue_single(kit, task)
    offer = _pull(kit, w).offer
    assert offer.run_id == first
    kit.ack(w, offer, "starting")
    kit.ack(w, offer, "running")
    second = _queue_single(kit, task)                      # a Task Start while the first runs
    assert _state(kit, second) == ("queued", True)
    assert _pull(kit, w).status == "idle"                   # held: not offered beside the first
    kit.ack(w, offer, "completion", exit_code=0)
    assert _state(kit, second) == ("queued", False)
    assert _pull(kit, w).offer.run_id == second


def test_a_run_held_behind_a_lost_or_requeued_one_is_released(kit):
    w = kit.worker("edge-1", slots=2)
    task = kit.task("solo")
    first = _queue_single(kit, task)
    offer = _pull(kit, w).offer
    second = _queue_single(kit, task)
    assert _state(kit, second) == ("queued", True)
    # The first's Lease expires before its starting ACK: it is queued again, and the Task is
    # free, so both are candidates again; exactly one is then leased.
    kit.expire_lease(offer.attempt_id)
    assert LeaseSweeper(kit.leases, kit.registry).sweep_once().requeued == 1
    assert _state(kit, second) == ("queued", False) and _state(kit, first) == ("queued", False)
    again = _pull(kit, w).offer
    assert again.run_id == first                            # the older Run first
    assert _state(kit, second) == ("queued", True)
    kit.ack(w, again, "starting")
    kit.ack(w, again, "running")
    kit.expire_lease(again.attempt_id)                      # the Worker went silent: the Attempt is lost
    LeaseSweeper(kit.leases, kit.registry).sweep_once()
    assert _state(kit, first) == ("lost", False)
    assert _pull(kit, w).offer.run_id == second


@pytest.mark.parametrize("queued", [8, 40])
def test_workers_pulling_at_once_never_lease_two_runs_of_one_single_instance_task(kit, queued):
    # 8 Runs fit one Pull's candidate page; 40 spread over several Pulls' pages, each locked by
    # its Pull while the winner holds the others (the holds must not wait on those locks: a
    # deadlock with the Pulls queued on the Task's row).
    workers = [kit.worker(f"w{i}") for i in range(8)]
    task = kit.task("solo")
    runs = {_queue_single(kit, task) for _ in range(queued)}    # none live yet: none held
    assert all(not _state(kit, r)[1] for r in runs)
    barrier = threading.Barrier(len(workers))
    answers, errors = [], []

    def pull(w):
        barrier.wait()
        try:
            answers.append(_pull(kit, w))
        except Exception as e:       # noqa: BLE001 - a deadlock or any refusal is the failure
            errors.append(repr(e))
    threads = [threading.Thread(target=pull, args=(w,)) for w in workers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    offered = [a.offer.run_id for a in answers if a.status == "offered"]
    assert len(answers) == 8 and len(offered) == 1, [(a.status, a.reason) for a in answers]
    assert kit.one("SELECT count(*) FROM runs WHERE task_id = %s AND state = 'dispatching'", (task["task_id"],)) == 1
    # What is still a candidate is refused by the claim's guard and held by the Pull that tried it.
    for _ in range(3):
        assert _pull(kit, workers[0]).status != "offered"
    assert kit.one("SELECT count(*) FROM runs WHERE task_id = %s AND held", (task["task_id"],)) == queued - 1


def test_parallel_tasks_are_not_held_or_serialised(kit):
    w = kit.worker("edge-1", slots=4)
    task = kit.task("many")
    runs = [kit.queue(task)[0] for _ in range(3)]            # single_instance false: concurrency parallel
    assert {_pull(kit, w).offer.run_id for _ in range(3)} == set(runs)


def test_the_sweeper_releases_a_hold_no_live_run_justifies(kit):
    # What a concurrent Task Start may leave (it saw the ending Run still live), and what an
    # earlier build left in the authority: held Runs of a Task nothing occupies.
    w = kit.worker("edge-1")
    task = kit.task("solo")
    stuck = [_queue_single(kit, task) for _ in range(3)]
    kit.sql("UPDATE runs SET held = true WHERE task_id = %s", (task["task_id"],))
    assert _pull(kit, w).status == "idle"
    r = LeaseSweeper(kit.leases, kit.registry, batch=2).sweep_once()
    assert (r.holds_released, r.truncated) == (2, True)       # bounded; the rest in the next pass
    assert LeaseSweeper(kit.leases, kit.registry, batch=2).sweep_once().holds_released == 1
    assert _pull(kit, w).offer.run_id == stuck[0]
    # Once a Run occupies the Task, the pass leaves the others' holds alone.
    assert [_state(kit, r)[1] for r in stuck[1:]] == [True, True]
    assert LeaseSweeper(kit.leases, kit.registry).sweep_once().holds_released == 0


def test_a_waiting_pull_is_woken_when_the_held_run_is_released(kit, pg_url):
    # A released Run is offered at once, not when a Worker's long-poll runs out: the NOTIFY
    # fires for a Run released from its hold as for one entering queued.
    from qlagent.adapters.postgres.notify import PgCandidateSignal
    w, other = kit.worker("edge-1"), kit.worker("edge-2")
    task = kit.task("solo")
    _queue_single(kit, task)
    live = _pull(kit, w).offer
    kit.ack(w, live, "starting")
    kit.ack(w, live, "running")
    waiting = _queue_single(kit, task)
    signal = PgCandidateSignal(pg_url)
    try:
        out: dict = {}
        req = PullRequest(session_id=other["session_id"], generation=other["generation"], pull_id=new_id(),
                          lease_token=token())
        t = threading.Thread(target=lambda: out.update(a=kit.pull(signal=signal).pull(
            other["worker_id"], other["credential"], req, wait_s=30)))
        seq = signal.seq()
        t.start()
        kit.ack(w, live, "completion", exit_code=0)     # the Task is free: the held Run is released
        assert signal.wait(seq, 10), "no NOTIFY when the held Run was released"
        t.join(10)
        assert not t.is_alive() and out["a"].offer.run_id == waiting
    finally:
        signal.close()

