"""The store ports on PostgreSQL beyond the shared contract (tests/contract runs that one on
both stores): ADR-0376 §2 Task Start as one SERIALIZABLE transaction under concurrency,
rollback and failure to prove consistency, and the scheduler firing from several replicas."""

from __future__ import annotations

import threading
import uuid
from concurrent.futures import ThreadPoolExecutor

import msgspec
import pytest

from conftest import create_database, db_url, drop_database
from pgkit import token
from qlagent.adapters.postgres.store import WRITE_RETRIES, PgStore
from qlagent.core.cluster import PullRequest
from qlagent.core.definitions import TaskInput, prepare_task
from qlagent.core.errors import FenceRejected, UnavailableError
from qlagent.core.ids import new_id
from qlagent.core.models import LOCAL_SUBJECT
from qlagent.service.scheduler import Scheduler

MUTATION = "0b6f3d3c-5d1e-4f7a-8c2b-9a8b7c6d5e4f"


def prepared(name: str, **kw):
    kw.setdefault("shell", "/bin/sh")
    kw.setdefault("script", f"echo {name}")
    return prepare_task(msgspec.convert({"name": name, **kw}, TaskInput))


@pytest.fixture
def open_store(pg_url, pool):
    """PgStore factory on the module's migrated database, each in its own fresh Project."""
    opened = []
    project = f"p-{new_id()[:8]}"

    def make(**kw):
        s = PgStore(pg_url, project, pool_size=4, **kw)
        opened.append(s)
        return s
    yield make
    for s in opened:
        s.close()


def _sql(pool, query, args=()):
    with pool.connection() as conn:
        cur = conn.execute(query, args)
        return cur.fetchall() if cur.description else []


def _start(store, head, mutation_id=MUTATION, **kw):
    args = dict(project=store.project.project_id, task=head.name, subject=LOCAL_SUBJECT, mutation_id=mutation_id,
                expected_revision=head.revision, expected_digest=head.content_digest)
    return store.task_start(**{**args, **kw})


def _runs(pool, project_id):
    return _sql(pool, "SELECT run_id FROM runs WHERE project_id = %s", (project_id,))


def test_sixteen_concurrent_starts_with_one_mutation_id_on_two_replicas_make_one_run(open_store, pool):
    a, b = open_store(), open_store()
    (head,) = a.add_tasks(a.project.project_id, [prepared("t")])
    barrier = threading.Barrier(16)

    def go(i):
        barrier.wait()
        return _start(a if i % 2 else b, head)
    with ThreadPoolExecutor(16) as ex:
        results = list(ex.map(go, range(16)))
    assert sorted(r.existing for r in results) == [False] + [True] * 15          # one 202, fifteen 200
    assert len({(r.run_id, r.attempt_id, r.event_ids) for r in results}) == 1
    (run,) = _runs(pool, a.project.project_id)
    assert run[0] == results[0].run_id
    assert _sql(pool, "SELECT state, executor_type FROM attempts WHERE run_id = %s", (run[0],)) == \
        [("claimed", "remote_worker")]
    assert [r[0] for r in _sql(pool, "SELECT type FROM run_events WHERE run_id = %s ORDER BY sequence",
                               (run[0],))] == ["run.created", "run.queued"]


def test_concurrent_starts_with_distinct_mutation_ids_all_succeed(open_store, pool):
    """16 callers on two replicas, 64 different starts of one Task: every one is a new Run —
    none exhausts its serialization retries (Run-creating writes queue on one advisory lock
    instead of failing each other's commit on shared index pages)."""
    a, b = open_store(), open_store()
    (head,) = a.add_tasks(a.project.project_id, [prepared("busy", concurrency="parallel")])
    barrier = threading.Barrier(16)

    def go(i):
        barrier.wait()
        return [_start(a if i % 2 else b, head, mutation_id=str(uuid.uuid4())) for _ in range(4)]
    with ThreadPoolExecutor(16) as ex:
        created = [c for batch in ex.map(go, range(16)) for c in batch]
    assert len({c.run_id for c in created}) == 64 and not any(c.existing for c in created)
    assert len(_runs(pool, a.project.project_id)) == 64


def test_task_start_uses_the_database_clock_and_server_identities(open_store, pool):
    s = open_store()
    (head,) = s.add_tasks(s.project.project_id, [prepared("t")])
    before = _sql(pool, "SELECT ql_now_us()")[0][0]
    created = _start(s, head)
    after = _sql(pool, "SELECT ql_now_us()")[0][0]
    assert before <= created.created_at_us <= after
    assert created.task_snapshot_ref == f"qltd:v1:1:{head.content_digest}"
    assert _sql(pool, "SELECT idempotency_key, trigger_type, execution_origin, priority, version, event_sequence "
                      "FROM runs WHERE run_id = %s", (created.run_id,)) == \
        [(f"ql3:task-start:v1:{MUTATION}", "task_start", "manual", 0, 2, 2)]


def test_a_failure_inside_task_start_rolls_everything_back(open_store, pool):
    s = open_store()
    (head,) = s.add_tasks(s.project.project_id, [prepared("t")])
    _sql(pool, "CREATE FUNCTION qlt_refuse_event() RETURNS trigger LANGUAGE plpgsql AS "
               "$$ BEGIN RAISE EXCEPTION 'planted failure'; END $$")
    _sql(pool, "CREATE TRIGGER qlt_refuse_event BEFORE INSERT ON run_events FOR EACH ROW "
               "EXECUTE FUNCTION qlt_refuse_event()")
    try:
        with pytest.raises(Exception, match="planted failure"):
            _start(s, head)
    finally:
        _sql(pool, "DROP TRIGGER qlt_refuse_event ON run_events")
        _sql(pool, "DROP FUNCTION qlt_refuse_event()")
    assert _runs(pool, s.project.project_id) == []                        # no Run, no Attempt, no event
    assert _sql(pool, "SELECT count(*) FROM attempts a JOIN runs r USING (run_id) WHERE r.project_id = %s",
                (s.project.project_id,)) == [(0,)]
    assert _start(s, head).existing is False                             # the same mutationId now succeeds


def test_serialization_failures_are_retried_a_bounded_number_of_times_then_unavailable(open_store, pool):
    s = open_store()
    (head,) = s.add_tasks(s.project.project_id, [prepared("t")])
    _sql(pool, "CREATE FUNCTION qlt_conflict() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
               "RAISE EXCEPTION 'could not serialize' USING ERRCODE = '40001'; END $$")
    _sql(pool, "CREATE TRIGGER qlt_conflict BEFORE INSERT ON runs FOR EACH ROW EXECUTE FUNCTION qlt_conflict()")
    calls = []
    real = s._run

    def counting(fn, **kw):
        return real(lambda cur: (calls.append(1), fn(cur))[1], **kw)
    s._run = counting
    try:
        with pytest.raises(UnavailableError) as e:
            _start(s, head)
    finally:
        _sql(pool, "DROP TRIGGER qlt_conflict ON runs")
        _sql(pool, "DROP FUNCTION qlt_conflict()")
    assert e.value.code == "task_start_unavailable"
    assert len(calls) == WRITE_RETRIES                                   # bounded, then 503
    assert _runs(pool, s.project.project_id) == []


def test_a_connection_cut_inside_a_unit_is_unavailable_and_the_store_goes_on(open_store, pool):
    # The watchdog or the network cuts a unit's connection mid-transaction: the caller gets
    # UnavailableError (a route's 503), not a driver error about the dead connection, and the
    # store's next units run on sound connections.
    import socket
    s = open_store()
    (head,) = s.add_tasks(s.project.project_id, [prepared("t")])

    def cut_then(name):
        def unit(db):
            sock = socket.socket(fileno=db.raw.connection.fileno())
            sock.shutdown(socket.SHUT_RDWR)
            sock.detach()                       # the driver still owns the descriptor
            return db.one(name)
        return unit
    for unit in (s.write, s.read):
        with pytest.raises(UnavailableError) as e:
            unit(cut_then("DB_NOW"))
        assert e.value.code == "store_unavailable"
    assert _start(s, head).existing is False
    assert len(_runs(pool, s.project.project_id)) == 1


def test_missing_or_corrupt_execution_revision_fails_closed(open_store, pool):
    s = open_store()
    pid = s.project.project_id
    (head,) = s.add_tasks(pid, [prepared("t")])
    _sql(pool, "ALTER TABLE execution_revisions DISABLE TRIGGER execution_revisions_append_only")
    try:
        _sql(pool, "UPDATE execution_revisions SET spec_json = spec_json || ' ' WHERE task_id = %s", (head.task_id,))
        with pytest.raises(UnavailableError) as corrupt:
            _start(s, head)
        _sql(pool, "DELETE FROM execution_revisions WHERE task_id = %s", (head.task_id,))
        with pytest.raises(FenceRejected) as missing:
            _start(s, head)
    finally:
        _sql(pool, "ALTER TABLE execution_revisions ENABLE TRIGGER execution_revisions_append_only")
    assert corrupt.value.code == "task_start_unavailable"
    assert missing.value.reason == "task_not_executable"
    assert _runs(pool, pid) == []


def test_three_scheduler_replicas_make_exactly_one_run_per_instant(open_store, pool):
    """Every replica may fire: each runs the same (pure) policy on its own PgStore; the
    (Task, instant) key leaves one Run per instant whichever replica wins."""
    class Clock:
        now = 1_767_225_600_000_000 + 1_000_000          # 2026-01-01T00:00:01Z

    clock = Clock()
    replicas = [open_store(clock_us=lambda: clock.now) for _ in range(3)]
    pid = replicas[0].project.project_id
    replicas[0].add_tasks(pid, [prepared("every5", schedule="*/5 * * * *", concurrency="parallel"),
                                prepared("every10", schedule="*/10 * * * *", concurrency="parallel")])
    schedulers = [Scheduler(r, "UTC", lambda: clock.now) for r in replicas]
    for sc in schedulers:
        sc.reload()
    barrier = threading.Barrier(3)
    minutes = 60_000_000

    def replica(sc):
        created = 0
        for _ in range(12):
            barrier.wait()
            created += sc.fire_due()
            barrier.wait()
            if sc is schedulers[0]:
                clock.now += 5 * minutes
        return created
    with ThreadPoolExecutor(3) as ex:
        created = list(ex.map(replica, schedulers))
    rows = _sql(pool, "SELECT t.name, r.scheduled_for_us, count(*) FROM runs r JOIN tasks t USING (task_id) "
                      "WHERE r.project_id = %s GROUP BY 1, 2 ORDER BY 1, 2", (pid,))
    assert all(n == 1 for _, _, n in rows)                               # never two Runs for one instant
    by_task = {name: [at for n, at, _ in rows if n == name] for name in ("every5", "every10")}
    assert len(by_task["every5"]) == 11 and len(by_task["every10"]) == 5  # 00:05…00:55, 00:10…00:50
    assert sum(created) == len(rows)
    assert _sql(pool, "SELECT count(*) FROM schedule_fires f JOIN tasks t USING (task_id) WHERE t.project_id = %s",
                (pid,)) == [(len(rows),)]


@pytest.fixture
def own_db_stores():
    """PgStore factory on a database of this test alone (a scheduler reads every Project's Tasks)."""
    name, opened = create_database("sched_bound"), []

    def make(**kw):
        opened.append(PgStore(db_url(name), pool_size=2, **kw))
        return opened[-1]
    yield make
    for s in opened:
        s.close()
    drop_database(name)


def test_a_scheduler_pass_is_bounded_and_carries_the_rest_to_the_next_pass(own_db_stores):
    """Issue 10 "bounded work per pass": with 4 writes per pass, 4 due Tasks fit one pass, a
    fifth is carried (counted, next pass due at once) and fired by the next pass; two replicas
    firing that same instant together still leave exactly one Run per (Task, instant)."""
    class Clock:
        now = 1_767_225_600_000_000 + 1_000_000          # 2026-01-01T00:00:01Z

    clock, minutes = Clock(), 60_000_000
    a, b = own_db_stores(clock_us=lambda: clock.now), own_db_stores(clock_us=lambda: clock.now)
    pool = a.pool
    pid = a.project.project_id
    a.add_tasks(pid, [prepared(f"t{i}", schedule="*/5 * * * *", concurrency="parallel") for i in range(4)]
                + [prepared("t4", schedule="*/10 * * * *", concurrency="parallel")])
    journal: list[tuple] = []
    sa = Scheduler(a, "UTC", lambda: clock.now, lambda *e, **f: journal.append((e[1], f)), max_writes=4)
    sb = Scheduler(b, "UTC", lambda: clock.now, max_writes=4)
    for sc in (sa, sb):
        sc.reload()

    def cursors() -> int:
        return _sql(pool, "SELECT count(*) FROM schedule_cursors c JOIN tasks t USING (task_id) "
                          "WHERE t.project_id = %s", (pid,))[0][0]

    def runs_at(instant: int) -> list:
        return _sql(pool, "SELECT t.name, count(*) FROM runs r JOIN tasks t USING (task_id) WHERE r.project_id = %s"
                          " AND r.scheduled_for_us = %s GROUP BY 1 ORDER BY 1", (pid, instant))

    # First look: five cursors to write, four per pass.
    assert (sa.fire_due(), sa.carried, sa.next_wake_us, cursors()) == (0, 1, clock.now, 4)
    assert journal == [("schedule.carried", {"tasks": 1, "writes": 4})]
    assert (sa.fire_due(), sa.carried, cursors()) == (0, 0, 5)
    sb.fire_due()
    # 00:05: four due Tasks, at the limit: one pass fires them all and carries nothing.
    clock.now += 5 * minutes
    at5 = clock.now - 1_000_000
    assert (sa.fire_due(), sa.carried) == (4, 0) and sa.next_wake_us > clock.now
    assert runs_at(at5) == [(f"t{i}", 1) for i in range(4)]
    # 00:10: five due Tasks, one over: both replicas fire the same instant at once.
    clock.now += 5 * minutes
    at10 = clock.now - 1_000_000
    barrier = threading.Barrier(2)

    def replica(sc):
        barrier.wait()
        first = (sc.fire_due(), sc.carried, sc.next_wake_us)
        passes = 1
        while sc.carried and passes < 4:
            sc.fire_due()
            passes += 1
        return first, sc.carried
    with ThreadPoolExecutor(2) as ex:
        results = list(ex.map(replica, (sa, sb)))
    for (created, carried, wake), left in results:
        assert created <= 4 and carried >= 1 and wake == clock.now and left == 0
    assert runs_at(at10) == [(f"t{i}", 1) for i in range(5)]        # one Run per (Task, instant)
    assert _sql(pool, "SELECT count(*) FROM schedule_fires f JOIN tasks t USING (task_id) "
                      "WHERE t.project_id = %s AND f.instant_us = %s", (pid, at10)) == [(5,)]


def test_a_run_started_through_the_store_ports_is_placed_claimed_and_completed_by_a_worker(kit, pg_url):
    """End to end on one authority: PgStore's Task Start (the port the HTTP API and CLI use)
    creates what a Worker's Pull claims; the Task's Placement decides which Worker may take it."""
    store = PgStore(pg_url, f"p-{new_id()[:8]}", pool_size=2)
    try:
        (head,) = store.add_tasks(store.project.project_id, [prepared(
            "placed", placement={"required": {"site": "lab"}, "preferred": {"arch": "arm64"}})])
        created = _start(store, head)
        mars = kit.worker("mars-1", {"site": "mars"})
        answer = kit.pull().pull(mars["worker_id"], mars["credential"], PullRequest(
            session_id=mars["session_id"], generation=mars["generation"], pull_id=new_id(), lease_token=token()))
        assert (answer.status, answer.reason) == ("unmatched", "no_matching_worker")   # required site = lab
        arm = kit.worker("lab-arm", {"site": "lab", "arch": "arm64"})
        (offer,) = kit.claim(arm)
        assert (offer.run_id, offer.attempt_id, offer.worker_id) == (created.run_id, created.attempt_id,
                                                                     arm["worker_id"])
        for kind, facts in (("starting", {}), ("running", {}), ("completion", {"exit_code": 0, "bytes_kept": 3})):
            kit.ack(arm, offer, kind, **facts)
        run = store.get_run(created.run_id)
        assert (run.state, run.exit_code) == ("succeeded", 0)
        types = [e.type for e in store.list_events(created.run_id)]
        assert types[:3] == ["run.created", "run.queued", "run.dispatching"] and types[-1] == "run.succeeded"
        assert [e.sequence for e in store.list_events(created.run_id)] == list(range(1, len(types) + 1))
    finally:
        store.close()
