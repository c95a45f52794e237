"""LocalRunDispatcher through the Engine on a real SQLite file with real shim processes
(issue 3 item 1, ADR-0071 §1, §3, verification 2, 5, 7).

Proves: the keyset order (priority desc, Run created asc, Attempt created asc, Attempt ID asc);
one page per pass (≤ page + 1 rows, one candidate query, no OFFSET, the same SQLite work with
100 or 10,000 queued Runs); at most one activation per pass; a race between two Engines on one
database file never spawns a task twice; a page of single-instance candidates that must wait does
not starve the Runs behind it; results are the small status set; the Engine exposes no
coordinator, shim or candidate read.
"""

from __future__ import annotations

import os
import re
import shutil
import threading

import pytest
from execkit import Bench, task

from qlagent.adapters.sqlite import execution as ex
from qlagent.adapters.sqlite import queries
from qlagent.adapters.rows import definitions as defs
from qlagent.adapters.rows import runs as runs_repo
from qlagent.core.dispatch import DispatchResult
from qlagent.core.profiles import EDGE, STANDALONE
from kit import scratch_dir, wait_until

STATUSES = {"activated", "no_candidate", "more", "unavailable", "launch_failed", "limited"}
REASON = re.compile(r"^[a-z][a-z0-9_:]{0,40}$")


@pytest.fixture
def root():
    d = scratch_dir("qlagent-disp-")
    yield d
    shutil.rmtree(d, ignore_errors=True)


def check_result(r: DispatchResult, page: int) -> DispatchResult:
    """Every pass result is one of the low-cardinality statuses with a short code as reason."""
    assert r.status in STATUSES, r
    assert r.reason is None or REASON.match(r.reason), r
    assert r.rows_read <= page + 1, r
    return r


def bulk_queued(b: Bench, name: str, rows: list[tuple[int, int, int]]) -> list[str]:
    """Insert queued Runs (with their claimed Attempt and events) of Task ``name`` and then set
    (priority, run created µs, attempt created µs) as given. Returns the Run IDs in input order."""
    def tx(c):
        head = defs.get_head(c, b.store.project.project_id, name)
        ids = []
        for prio, created, acreated in rows:
            cr = runs_repo.create_run(c, head=head, origin="manual", trigger_type="cli",
                                      idempotency_key=f"test:{name}:{len(ids)}:{created}:{acreated}",
                                      requested_by="test", now_us=created)
            c.execute("UPDATE runs SET priority = ?, latest_attempt_created_at_us = ? WHERE run_id = ?",
                      (prio, acreated, cr.run_id))
            c.execute("UPDATE attempts SET created_at_us = ? WHERE attempt_id = ?", (acreated, cr.attempt_id))
            ids.append(cr.run_id)
        return ids
    return b.store.write(tx)


def spawn_log(root: str) -> str:
    return os.path.join(root, "spawns.txt")


def recording_task(root: str, name: str, **kw) -> dict:
    """A parallel task that appends its Attempt ID to a file: one line per real exec."""
    return task(name, f'echo "$QL3_ATTEMPT_ID" >> {spawn_log(root)}\n', concurrency="parallel", **kw)


def spawned(root: str) -> list[str]:
    try:
        with open(spawn_log(root)) as f:
            return f.read().split()
    except FileNotFoundError:
        return []


def test_keyset_order_priority_then_created_then_attempt(root):
    b = Bench(os.path.join(root, "s"), profile=STANDALONE, max_concurrent=64)
    b.add(recording_task(root, "t"))
    base = 1_700_000_000_000_000
    # Crafted collisions: equal priority and Run time, equal Attempt time (Attempt ID decides).
    spec = [(0, base + 5, base + 5), (5, base + 9, base + 9), (5, base + 1, base + 7), (5, base + 1, base + 3),
            (-3, base, base), (0, base + 5, base + 5), (0, base + 5, base + 5), (9, base + 100, base + 100),
            (5, base + 1, base + 3), (0, base + 2, base + 8), (0, base + 2, base + 2), (-3, base, base + 1)]
    ids = bulk_queued(b, "t", spec)
    aid = {r: b.run(r).latest_attempt_id for r in ids}
    want = sorted(ids, key=lambda r: (-spec[ids.index(r)][0], spec[ids.index(r)][1], spec[ids.index(r)][2], aid[r]))
    # The store's keyset pages, walked with the cursor, list them in exactly that order.
    walked, after = [], None
    while True:
        page = b.store.read(lambda c, a=after: ex.candidate_page(c, 4, a, 2**62))
        walked += [c.run_id for c in page[:4]]
        if len(page) <= 4:
            break
        after = page[3].key()
    assert walked == want
    # And the dispatcher activates them in that order, one per pass.
    order = []
    for _ in ids:
        r = check_result(b.engine.dispatcher.dispatch_once(), STANDALONE.dispatch_page)
        assert r.status == "activated"
        order.append(r.run_id)
    assert order == want
    assert check_result(b.engine.dispatcher.dispatch_once(), 16).status == "no_candidate"
    b.drive(lambda: all(b.run(r).state == "succeeded" for r in ids))
    assert sorted(spawned(root)) == sorted(aid.values())
    b.close()


def test_one_pass_reads_one_page_and_activates_at_most_one(root):
    b = Bench(os.path.join(root, "s"), profile=EDGE, max_concurrent=4)
    b.add(recording_task(root, "t"))
    ids = bulk_queued(b, "t", [(0, 1_000 + i, 1_000 + i) for i in range(100)])
    traced: list[str] = []
    steps = [0]

    def count(_=None):
        steps[0] += 1
        return 0

    def measure_pass() -> tuple[DispatchResult, int, int]:
        traced.clear()
        steps[0] = 0
        b.store.authority.raw(lambda c: (c.set_trace_callback(traced.append), c.set_progress_handler(count, 1)))
        try:
            r = b.engine.dispatcher.dispatch_once()
        finally:
            b.store.authority.raw(lambda c: (c.set_trace_callback(None), c.set_progress_handler(None, 1)))
        return (check_result(r, EDGE.dispatch_page), sum("runs_dispatch_candidates" in s for s in traced),
                steps[0])

    r100, q100, vm100 = measure_pass()
    assert (r100.status, q100, r100.rows_read) == ("activated", 1, EDGE.dispatch_page + 1)
    cand = [s for s in traced if "runs_dispatch_candidates" in s]
    assert len(cand) == 1 and f"LIMIT {EDGE.dispatch_page + 1}" in cand[0], cand
    assert not any("OFFSET" in s.upper() for s in traced), traced
    # Exactly one Run left the queue in that pass.
    assert sum(b.run(i).state != "queued" for i in ids) == 1

    # 10,000 queued Runs: still one candidate query, page + 1 rows, and the same SQLite work
    # (VM steps) as with 100: the index delivers the order, LIMIT stops the scan.
    bulk_queued(b, "t", [(0, 10_000 + i, 10_000 + i) for i in range(9_900)])
    r10k, q10k, vm10k = measure_pass()
    assert (r10k.status, q10k, r10k.rows_read) == ("activated", 1, EDGE.dispatch_page + 1)
    assert not any("OFFSET" in s.upper() for s in traced)
    assert vm10k < vm100 * 1.5 + 200, (vm100, vm10k)
    plan = b.store.read(lambda c: c.execute("EXPLAIN QUERY PLAN " + queries.CANDIDATES, (0, 5)).fetchall())
    text = " | ".join(str(row[3]) for row in plan)
    assert "runs_dispatch_candidates" in text and "TEMP B-TREE" not in text, text
    queued = b.store.read(lambda c: c.execute("SELECT count(*) FROM runs WHERE state = 'queued'").fetchone()[0])
    assert queued == 10_000 - 2
    b.drive(lambda: b.engine.live_count() == 0, dispatch=False)
    assert len(spawned(root)) == 2
    b.close()


def test_race_between_two_engines_spawns_once(root):
    """Two Engines (two authorities, two artifact roots) on one database file, both dispatching
    at once, many times: each Run's task is exec'd exactly once, losers leave no log file."""
    db_dir = os.path.join(root, "db")
    a = Bench(os.path.join(root, "a"), profile=STANDALONE, max_concurrent=64, db_path=os.path.join(db_dir, "q.db"))
    b = Bench(os.path.join(root, "b"), profile=STANDALONE, max_concurrent=64, db_path=os.path.join(db_dir, "q.db"))
    a.add(recording_task(root, "t"))
    ids = bulk_queued(a, "t", [(0, 1_000 + i, 1_000 + i) for i in range(24)])
    results: dict[str, list] = {"a": [], "b": []}
    go = threading.Barrier(2)

    def racer(name, bench):
        go.wait()
        for _ in range(40):
            results[name].append(check_result(bench.engine.dispatcher.dispatch_once(), STANDALONE.dispatch_page))

    ts = [threading.Thread(target=racer, args=(n, x)) for n, x in (("a", a), ("b", b))]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    won = [r.run_id for rs in results.values() for r in rs if r.status == "activated"]
    assert sorted(won) == sorted(ids)           # every Run activated once, by one Engine only
    a.drive(lambda: a.engine.live_count() == 0)
    b.drive(lambda: b.engine.live_count() == 0)
    assert all(a.run(i).state == "succeeded" for i in ids)
    assert len(spawned(root)) == len(ids) and len(set(spawned(root))) == len(ids)
    # A log file exists only for the Engine that won each Run.
    assert len(a.artifacts()) + len(b.artifacts()) == len(ids)
    a.close()
    b.close()


def test_stale_reread_loses_the_claim_and_does_not_spawn(root):
    """The race made deterministic: B reads the candidate, A activates it, B's reread is stale
    (says "still queued"): B's compare-and-set on the version fails, its log file is removed
    and nothing is spawned a second time."""
    db = os.path.join(root, "db", "q.db")
    a = Bench(os.path.join(root, "a"), profile=EDGE, db_path=db)
    b = Bench(os.path.join(root, "b"), profile=EDGE, db_path=db)
    a.add(recording_task(root, "t"))
    (rid,) = bulk_queued(a, "t", [(0, 1_000, 1_000)])
    xb = b.engine.dispatcher._materializer._store     # B's store port, to make its reread stale

    real_reread = xb.reread

    def stale(c):
        assert real_reread(c)                          # B saw it queued …
        assert a.engine.dispatcher.dispatch_once().status == "activated"   # … then A won
        return True                                    # … and B's view is stale
    xb.reread = stale
    r = check_result(b.engine.dispatcher.dispatch_once(), EDGE.dispatch_page)
    assert r.status == "no_candidate" and r.skipped == 1
    assert b.artifacts() == []
    a.drive(lambda: a.run(rid).state == "succeeded")
    assert len(spawned(root)) == 1 and len(a.artifacts()) == 1
    a.close()
    b.close()


def test_single_instance_backlog_is_left_out_of_the_page(root):
    """A single-instance Task with a live Run: its six queued Runs are not candidates at all
    (filtered in the candidate query), so a parallel Task's Run behind them starts at once."""
    b = Bench(os.path.join(root, "s"), profile=EDGE)
    b.add(task("single", "sleep 30\n", concurrency="single"), recording_task(root, "other"))
    first = bulk_queued(b, "single", [(0, 1_000, 1_000)])[0]
    r = b.engine.dispatcher.dispatch_once()
    assert r.status == "activated" and r.run_id == first
    blocked = bulk_queued(b, "single", [(0, 2_000 + i, 2_000 + i) for i in range(6)])
    (behind,) = bulk_queued(b, "other", [(0, 9_000, 9_000)])
    res = check_result(b.engine.dispatcher.dispatch_once(), EDGE.dispatch_page)
    assert (res.status, res.run_id, res.skipped) == ("activated", behind, 0)
    assert all(b.run(i).state == "queued" for i in blocked)
    held = lambda: b.store.read(lambda c: c.execute(  # noqa: E731
        "SELECT count(*) FROM runs WHERE held = 1").fetchone()[0])
    assert held() == 6
    b.drive(lambda: b.run(behind).state == "succeeded")
    from qlagent.application.cancel import request_cancel
    request_cancel(b.store, first, "test")
    assert b.wait_run(first, 10).state == "cancelled"
    # The live Run ended: its Task's queue is released and the oldest held Run starts next.
    assert held() == 0
    res = check_result(b.engine.dispatcher.dispatch_once(), EDGE.dispatch_page)
    assert (res.status, res.run_id) == ("activated", blocked[0])
    assert held() == 5
    request_cancel(b.store, blocked[0], "test")
    b.wait_run(blocked[0], 10)
    b.close()


def test_blocked_page_does_not_starve_runs_behind_it(root):
    """Edge page = 4. Six network-gated Runs wait (no gate answers here) ahead of an ungated
    Run: passes walk past the blocked page with the keyset cursor and start it."""
    b = Bench(os.path.join(root, "s"), profile=EDGE)
    b.add(task("gated", "true\n", concurrency="parallel", network="default_route"),
          recording_task(root, "other"))
    blocked = bulk_queued(b, "gated", [(0, 2_000 + i, 2_000 + i) for i in range(6)])
    (behind,) = bulk_queued(b, "other", [(0, 9_000, 9_000)])
    seen = []
    for _ in range(4):
        res = check_result(b.engine.dispatcher.dispatch_once(), EDGE.dispatch_page)
        seen.append(res.status)
        if res.status == "activated":
            break
    assert seen == ["more", "activated"], seen
    assert res.run_id == behind
    assert all(b.run(i).state == "queued" for i in blocked)
    b.drive(lambda: b.run(behind).state == "succeeded")
    b.close()


def test_launch_failure_is_reported_once_not_retried_in_a_loop(root):
    b = Bench(os.path.join(root, "s"), profile=EDGE)
    b.add(recording_task(root, "t"))
    rid = b.start("t")
    b.engine._coordinator._procs._python = os.path.join(root, "no-such-python")    # the shim cannot start
    r = check_result(b.engine.dispatcher.dispatch_once(), EDGE.dispatch_page)
    assert (r.status, r.run_id) == ("launch_failed", rid)
    assert r.reason == "shim_failed"          # a real errno in the text, never an invented one
    run = b.run(rid)
    assert run.state == "failed"
    (a,) = b.attempts(rid)
    assert a.failure_reason == r.reason
    assert a.start_error == f"shim: python {os.path.join(root, 'no-such-python')}: cannot start the shim: " \
                            "ENOENT (No such file or directory)"
    assert check_result(b.engine.dispatcher.dispatch_once(), EDGE.dispatch_page).status == "no_candidate"
    assert spawned(root) == []
    b.close()


def test_global_limit_is_a_limited_result(root):
    b = Bench(os.path.join(root, "s"), profile=EDGE, max_concurrent=1)
    b.add(task("slow", "sleep 30\n", concurrency="parallel"))
    r1, r2 = b.start("slow"), b.start("slow")
    assert b.engine.dispatcher.dispatch_once().status == "activated"
    r = check_result(b.engine.dispatcher.dispatch_once(), EDGE.dispatch_page)
    assert (r.status, r.reason, r.rows_read) == ("limited", "concurrency", 0)
    assert b.run(r2).state == "queued"
    from qlagent.application.cancel import request_cancel
    request_cancel(b.store, r1, "test")
    request_cancel(b.store, r2, "test")
    b.drive(lambda: b.engine.live_count() == 0)
    b.close()


def test_engine_exposes_no_coordinator_shim_or_candidate_read(root):
    """ADR-0071 verification 7: walk every public attribute of the Engine (two levels deep):
    nothing reachable is the coordinator, the process adapter, the store port or the raw store
    (whose read() would reach the candidate query), and no method
    named like a launch or candidate read is reachable without an underscore."""
    b = Bench(os.path.join(root, "s"))
    from qlagent.adapters.processes import ShimProcesses
    from qlagent.adapters.sqlite.authority import SqliteAuthority
    from qlagent.adapters.sqlite.store import SqliteStore
    from qlagent.execution.coordinator import LocalExecutionCoordinator
    forbidden_types = (LocalExecutionCoordinator, ShimProcesses, SqliteStore, SqliteAuthority)
    forbidden_names = {"candidate_page", "reread", "load_plan", "claim_starting", "spawn", "start", "launch",
                       "coordinator", "shim", "materializer", "resolve_secrets"}

    def public(obj):
        return [n for n in dir(obj) if not n.startswith("_")]

    reached = []
    for n in public(b.engine):
        v = getattr(b.engine, n)
        reached.append((n, v))
        if n in ("dispatcher", "admission"):
            reached += [(f"{n}.{m}", getattr(v, m)) for m in public(v)]
    for path, v in reached:
        assert not isinstance(v, forbidden_types), path
        assert path.rsplit(".", 1)[-1] not in forbidden_names, path
    assert public(b.engine.dispatcher) == ["dispatch_once"]
    b.close()


def test_keyset_cursor_seeks_instead_of_scanning_to_the_cursor(root):
    """A page deep in a 10,000-Run backlog costs the same SQLite work as the first pages: the
    cursor is an index seek, not a scan from the first queued Run (an OFFSET in disguise)."""
    b = Bench(os.path.join(root, "s"))
    b.add(recording_task(root, "t"))
    bulk_queued(b, "t", [(i % 3, 1_000 + i, 1_000 + i // 2) for i in range(10_000)])
    keys = b.store.read(lambda c: [tuple(r) for r in c.execute(
        "SELECT priority, created_at_us, latest_attempt_created_at_us, latest_attempt_id FROM runs "
        "ORDER BY priority DESC, created_at_us, latest_attempt_created_at_us, latest_attempt_id")])
    cost = {}
    for pos in (10, 3_330, 6_000, 9_000):
        steps = [0]

        def count(s=steps):
            s[0] += 1
            return 0
        b.store.authority.raw(lambda c: c.set_progress_handler(count, 1))
        try:
            page = b.store.read(lambda c, k=keys[pos]: ex.candidate_page(c, 4, k, 2**62))
        finally:
            b.store.authority.raw(lambda c: c.set_progress_handler(None, 1))
        assert [c.key() for c in page] == keys[pos + 1:pos + 6]     # the right rows, in order
        cost[pos] = steps[0]
    assert max(cost.values()) < 2 * cost[10] + 100, cost
    b.close()


def test_recovery_ingests_a_receipt_of_an_attempt_left_starting(root):
    """The agent died after the claim (Attempt `starting`) but before it recorded the shim;
    the shim ran and left its receipt. The next agent ingests it — it must not refuse the
    transition and crash at start-up (a restart loop under systemd)."""
    b = Bench(os.path.join(root, "s"), profile=EDGE)
    b.add(recording_task(root, "t"))
    rid = b.start("t")
    assert b.engine.dispatcher.dispatch_once().status == "activated"
    b.drive(lambda: b.run(rid).state == "running", dispatch=False)     # the shim has its spec
    aid = b.attempts(rid)[0].attempt_id
    receipt = os.path.join(b.runs_dir, aid, "receipt.json")
    wait_until(lambda: os.path.exists(receipt), 10, receipt)
    b.engine.abandon_all()                         # this agent "dies" without ingesting
    b.store.write(lambda c: (c.execute("UPDATE runs SET state = 'starting' WHERE run_id = ?", (rid,)),
                             c.execute("UPDATE attempts SET state = 'starting', shim_pid = NULL "
                                       "WHERE attempt_id = ?", (aid,))))
    counts = b.engine.recover()                    # the next agent's start-up
    assert counts["ingested"] == 1
    run = b.run(rid)
    assert (run.state, run.exit_code) == ("succeeded", 0)
    b.close()


def test_admission_reserves_each_live_runs_memory_not_only_what_it_uses_now(root):
    """Edge leaves 80 MiB to Runs. A live Run of a Task with memory_max 56M holds 56 MiB even
    while it uses almost nothing: a second Task's Run that states 48M waits (memory_reserved)
    until the first ends; one stating nothing (20 MiB: 80 / 4 Runs) starts beside it at once."""
    b = Bench(os.path.join(root, "s"), profile=EDGE)
    b.add(task("big", "sleep 30\n", memory_max="56M"), task("also-big", "true\n", memory_max="48M"),
          task("small", "true\n"))
    big = b.start("big")
    assert b.engine.dispatcher.dispatch_once().run_id == big
    waits = b.start("also-big")
    res = b.engine.dispatcher.dispatch_once()
    assert res.status != "activated" and b.run(waits).state == "queued"
    small = b.start("small")
    b.drive(lambda: b.run(small).state == "succeeded")
    assert b.run(waits).state == "queued"
    from qlagent.application.cancel import request_cancel
    request_cancel(b.store, big, "test")
    assert b.wait_run(big, 10).state == "cancelled"
    assert b.wait_run(waits, 10).state == "succeeded"
    b.close()
