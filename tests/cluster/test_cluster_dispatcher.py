"""ADR-0014 "验证要求", one test per bullet, against the real PostgreSQL authority. Where a
bullet is about a port misbehaving (duplicate rows, a cursor that does not advance, a plan that
drifts), a thin wrapper around the real adapter injects exactly that misbehaviour."""

from __future__ import annotations

import msgspec
import pytest

from pgkit import COMMAND_MARK, LEASE_KEY
from qlagent.cluster.dispatcher import ClusterDispatcher, DispatcherBudgets
from qlagent.cluster.execspec import spec_digest
from qlagent.cluster.registry import Hello
from qlagent.core.cluster import Page, WorkerSnapshot
from qlagent.core.errors import ValidationError


class Counting:
    """Delegates to the real store/plan source, counting calls; hooks may alter a result."""

    def __init__(self, inner, **hooks) -> None:
        self.inner, self.hooks, self.calls = inner, hooks, {}

    def __getattr__(self, name):
        fn = getattr(self.inner, name)

        def call(*args, **kw):
            self.calls[name] = self.calls.get(name, 0) + 1
            if name in self.hooks:
                return self.hooks[name](fn, *args, **kw)
            return fn(*args, **kw)
        return call


def test_first_page_empty_means_no_worker_plan_or_claim_call(kit):
    kit.worker("w1")
    store, plans = Counting(kit.store), Counting(kit.plans)
    r = kit.dispatcher(store=store, plans=plans).dispatch_once()
    assert (r.status, r.offer, r.truncated) == ("idle", None, False)
    assert store.calls.get("candidate_page") == 1
    assert store.calls.get("worker_page", 0) == plans.calls.get("prepare", 0) == store.calls.get("claim", 0) == 0


def test_required_and_preferred_placement_picks_the_worker_and_claims_with_its_session(kit):
    kit.worker("a-us", {"region": "us", "disk": "ssd"})
    kit.worker("b-eu-hdd", {"region": "eu", "disk": "hdd"}, slots=4)
    best = kit.worker("c-eu-ssd", {"region": "eu", "disk": "ssd"})
    # A reconnect gives the chosen Worker generation 2: the claim must carry the current record.
    grant = kit.registry.open_session(best["worker_id"], best["credential"], Hello())
    task = kit.task(placement={"required": {"region": "eu"}, "preferred": {"disk": "ssd"}})
    run_id, attempt_id = kit.queue(task)
    r = kit.dispatcher().dispatch_once()
    assert r.status == "offered" and r.reason == "new_claim"
    o = r.offer
    assert (o.worker_id, o.session_id, o.generation, o.placement_score) == (
        best["worker_id"], grant.session_id, 2, 1)
    assert kit.sql("SELECT worker_id, session_id, worker_generation, state FROM run_leases WHERE attempt_id = %s",
                   (attempt_id,)) == [(best["worker_id"], grant.session_id, 2, "active")]
    assert kit.one("SELECT state FROM runs WHERE run_id = %s", (run_id,)) == "dispatching"


def test_placement_without_executor_gets_it_required_and_a_conflict_is_refused(kit):
    kit.worker("w1")
    ok = kit.task("ok", placement={})
    bad = kit.task("bad", placement={"required": {"executor": "docker"}})
    kit.queue(bad, priority=5)
    run_ok, _ = kit.queue(ok)
    r = kit.dispatcher().dispatch_once()
    assert r.status == "offered" and r.offer.run_id == run_ok and r.skipped == 1


def test_cross_page_budgets_bound_candidates_and_workers(kit):
    for i in range(5):
        kit.worker(f"w{i}", {"zone": "a"})
    task = kit.task(placement={"required": {"zone": "nowhere"}})
    for _ in range(7):
        kit.queue(task)
    b = DispatcherBudgets(candidate_page_size=2, candidate_pages=3, worker_page_size=2, worker_pages=2)
    store = Counting(kit.store)
    r = kit.dispatcher(b, store=store).dispatch_once()
    # 3 pages × 2 candidates read, a 4th page would be needed: explicit truncation, not "idle".
    assert (r.status, r.reason, r.truncated, r.candidates_read, r.claim_tries) == (
        "truncated", "candidate_budget", True, 6, 0)
    assert store.calls["candidate_page"] == 3 and store.calls["worker_page"] == 2 and r.workers_read == 4


def _dup_first(fn, *args, **kw):
    page = fn(*args, **kw)
    return Page(page.items[:1] * 2, page.truncated, page.next_cursor)   # same row twice, within the limit


def _stuck_cursor(fn, observed, limit, after):
    page = fn(observed, limit, after)
    return Page(page.items, True, after or page.items[0].key())


def _overflow(fn, observed, limit, after):
    return fn(observed, limit + 1, after)


@pytest.mark.parametrize("hook,reason", [(_dup_first, "candidate_duplicate"),
                                         (_stuck_cursor, "candidate_cursor_not_advancing"),
                                         (_overflow, "candidate_page_overflow")])
def test_duplicate_or_non_advancing_candidate_cursor_fails_closed(kit, hook, reason):
    kit.worker("w1", slots=8)
    task = kit.task()
    for _ in range(4):
        kit.queue(task)
    store = Counting(kit.store, candidate_page=hook)
    b = DispatcherBudgets(candidate_page_size=2)
    d = ClusterDispatcher(store, Counting(kit.plans, prepare=lambda fn, c: None), LEASE_KEY, b)
    r = d.dispatch_once()
    assert (r.status, r.reason, r.offer) == ("refused", reason, None)
    assert store.calls.get("claim", 0) == 0


@pytest.mark.parametrize("hook,reason", [(_dup_first, "worker_duplicate"),
                                         (_stuck_cursor, "worker_cursor_not_advancing")])
def test_duplicate_or_non_advancing_worker_cursor_fails_closed(kit, hook, reason):
    for i in range(3):
        kit.worker(f"w{i}")
    kit.queue(kit.task())
    store = Counting(kit.store, worker_page=hook)
    r = kit.dispatcher(DispatcherBudgets(worker_page_size=2), store=store).dispatch_once()
    assert (r.status, r.reason) == ("refused", reason) and store.calls.get("claim", 0) == 0


def test_capacity_race_tries_the_next_worker(kit):
    full = kit.worker("a-full", {"fast": "yes"})
    other = kit.worker("b-other")
    task = kit.task(placement={"preferred": {"fast": "yes"}})
    kit.queue(task, priority=1)
    run2, _ = kit.queue(task)
    # Worker a's only slot is taken after the snapshot: the snapshot still says it has one.
    first = kit.dispatcher().dispatch_once().offer
    assert first.worker_id == full["worker_id"]
    kit.ack(full, first, "starting")                 # no longer in the recovery window

    def stale_snapshot(fn, *args):
        page = fn(*args)
        return Page([msgspec.structs.replace(w, free_slots=1) for w in page.items], page.truncated, page.next_cursor)
    store = Counting(kit.store, worker_page=stale_snapshot)
    r = kit.dispatcher(store=store).dispatch_once()
    assert r.status == "offered" and r.claim_tries == 2
    assert (r.offer.run_id, r.offer.worker_id) == (run2, other["worker_id"])


def test_ownership_race_stops_the_candidate(kit):
    kit.worker("w1", slots=4)
    kit.worker("w2", slots=4)
    run_id, attempt_id = kit.queue(kit.task())

    def rival_claims_first(fn, c, w, *rest):
        if store.calls["claim"] == 1:      # another replica wins the Attempt before our claim
            assert kit.dispatcher().dispatch_once().status == "offered"
        return fn(c, w, *rest)
    store = Counting(kit.store, claim=rival_claims_first)
    r = kit.dispatcher(store=store).dispatch_once()
    assert (r.status, r.reason, r.claim_tries, r.offer) == ("unmatched", "attempt_unavailable", 1, None)
    assert kit.one("SELECT count(*) FROM run_leases WHERE attempt_id = %s", (attempt_id,)) == 1


def test_claim_budget_exhaustion_reports_reason_and_truncated(kit):
    for i in range(3):
        kit.worker(f"w{i}")
    kit.queue(kit.task())
    # Every Worker in the snapshot turns out unavailable: the claim budget (2) runs out first.
    store = Counting(kit.store, claim=lambda fn, c, w, *rest: fn(c, msgspec.structs.replace(w, generation=99), *rest))
    r = kit.dispatcher(DispatcherBudgets(claim_tries=2), store=store).dispatch_once()
    assert (r.status, r.reason, r.truncated, r.claim_tries, r.offer) == ("truncated", "claim_budget", True, 2, None)


@pytest.mark.parametrize("change", [{"attemptId": "00000000-0000-4000-8000-000000000000"},
                                    {"taskRevision": 2}, {"argv": ["relative/path"]},
                                    {"env": {"QL3_RUN_ID": "forged"}}, {"timeoutMs": 0}, {"umask": "0999"},
                                    {"umask": "027"}, {"cwd": "relative"}])
def test_invalid_or_mismatched_execution_spec_refused_before_claim(kit, change):
    kit.worker("w1")
    kit.queue(kit.task())

    def tamper(fn, c):
        plan = fn(c)
        return msgspec.structs.replace(plan, spec={**plan.spec, **change})
    store = Counting(kit.store)
    r = kit.dispatcher(store=store, plans=Counting(kit.plans, prepare=tamper)).dispatch_once()
    assert (r.status, r.reason, r.offer) == ("unmatched", "invalid_execution_spec", None)
    assert store.calls.get("claim", 0) == 0
    assert kit.one("SELECT count(*) FROM run_leases") == 0


def test_unclaimed_results_carry_no_offer_and_no_command(kit):
    kit.worker("w1", {"zone": "a"})
    kit.queue(kit.task(placement={"required": {"zone": "b"}}))
    r = kit.dispatcher().dispatch_once()
    assert r.status == "unmatched" and r.reason == "no_matching_worker" and r.offer is None
    for text in (msgspec.json.encode(r).decode(), repr(r), str(msgspec.to_builtins(r))):
        assert COMMAND_MARK not in text and "GREETING" not in text
    kit.worker("w2", {"zone": "b"})
    offered = kit.dispatcher().dispatch_once()
    assert COMMAND_MARK in offered.offer.spec.argv
    assert COMMAND_MARK not in repr(offered) and offered.offer.lease_token not in repr(offered)


def test_execution_spec_is_deep_copied(kit):
    kit.worker("w1")
    kit.queue(kit.task())
    kept = {}

    def keep(fn, c):
        plan = fn(c)
        kept["spec"] = plan.spec
        return plan

    def mutate_after_plan(fn, *args):
        kept["spec"]["argv"].append("--evil")      # the plan source keeps changing its objects
        kept["spec"]["env"]["GREETING"] = "changed"
        return fn(*args)
    d = kit.dispatcher(store=Counting(kit.store, claim=mutate_after_plan), plans=Counting(kit.plans, prepare=keep))
    o = d.dispatch_once().offer
    assert o.spec.argv == (COMMAND_MARK, "hello") and o.spec.env["GREETING"] == "hi"
    assert o.spec_digest == spec_digest(o.spec)


def test_active_lease_recovered_before_new_candidates_with_the_same_offer_id_across_restart(kit):
    kit.worker("w1", slots=2)
    task = kit.task()
    run1, _ = kit.queue(task, priority=1)
    first = kit.dispatcher().dispatch_once().offer
    run2, _ = kit.queue(task, priority=9)            # a more urgent candidate arrives meanwhile
    restarted = kit.dispatcher()                     # a new process: nothing in memory
    store = Counting(kit.store)
    restarted._store = store
    r = restarted.dispatch_once()
    assert (r.status, r.reason, r.candidates_read) == ("offered", "lease_recovery", 0)
    assert r.offer.run_id == run1 and store.calls.get("candidate_page", 0) == 0
    assert (r.offer.offer_id, r.offer.lease_token, r.offer.spec_digest) == (
        first.offer_id, first.lease_token, first.spec_digest)
    nxt = restarted.dispatch_once()                  # recovery walk done: new candidates next
    assert (nxt.reason, nxt.offer.run_id) == ("new_claim", run2)


def _recovery_of(kit):
    return kit.dispatcher().dispatch_once()


def test_recovery_refused_after_cancel_session_replacement_or_expiry(kit):
    w = kit.worker("w1", slots=3)
    task = kit.task()
    runs = [kit.queue(task) for _ in range(3)]
    offers = kit.claim(3)
    assert sorted(o.run_id for o in offers) == sorted(r for r, _ in runs)
    by_run = {o.run_id: o for o in offers}
    cancelled, expired, _ = (r for r, _ in runs)
    kit.sql("UPDATE runs SET cancel_requested_at_us = ql_now_us() WHERE run_id = %s", (cancelled,))
    kit.expire_lease(by_run[expired].attempt_id)
    recovered = _recovery_of(kit)
    assert recovered.reason == "lease_recovery" and recovered.offer.run_id not in (cancelled, expired)
    # Session replacement: the Worker reconnects; no Lease of the old Session is offered again.
    kit.registry.open_session(w["worker_id"], w["credential"], Hello())
    r = _recovery_of(kit)
    assert r.recovery_read == 0 and r.reason != "lease_recovery"
    assert kit.one("SELECT count(*) FROM run_leases WHERE state = 'active' AND session_id = %s",
                   (w["session_id"],)) == 0


def test_recovery_plan_missing_drift_duplicate_cursor_and_page_budget_fail_closed(kit):
    kit.worker("w1", slots=4)
    task = kit.task()
    for _ in range(3):
        kit.queue(task)
    kit.claim(3)
    drift = Counting(kit.plans, prepare=lambda fn, c: msgspec.structs.replace(
        fn(c), spec={**fn(c).spec, "taskRevision": 7}))
    cases = [({"plans": Counting(kit.plans, prepare=lambda fn, c: None)}, "recovery_plan_missing"),
             ({"plans": drift}, "recovery_plan_drift"),
             ({"store": Counting(kit.store, recovery_page=_dup_first)}, "recovery_duplicate"),
             ({"store": Counting(kit.store, recovery_page=_stuck_cursor)}, "recovery_cursor_not_advancing")]
    for kwargs, reason in cases:
        r = kit.dispatcher(DispatcherBudgets(recovery_page_size=2), **kwargs).dispatch_once()
        assert (r.status, r.reason, r.offer) == ("refused", reason, None), reason
    d = kit.dispatcher(DispatcherBudgets(recovery_page_size=1, recovery_pages=2))
    got = [d.dispatch_once() for _ in range(3)]
    assert [g.reason for g in got] == ["lease_recovery", "lease_recovery", "recovery_budget"]
    assert got[2].truncated and got[2].offer is None


@pytest.mark.parametrize("field,value,ok", [
    ("candidate_page_size", 64, True), ("candidate_page_size", 65, False),
    ("recovery_pages", 16, True), ("recovery_pages", 17, False),
    ("worker_pages", 8, True), ("worker_pages", 9, False),     # 8 per page × 9 pages > 64 Workers
    ("claim_tries", 64, True), ("claim_tries", 65, False), ("recovery_page_size", 0, False)])
def test_budget_over_a_ceiling_is_refused_at_construction(kit, field, value, ok):
    b = DispatcherBudgets(**{field: value})
    if ok:
        kit.dispatcher(b)
        return
    with pytest.raises(ValidationError) as e:
        kit.dispatcher(b)
    assert e.value.field == f"cluster.dispatcher.{field}"


def test_worker_snapshot_record_is_what_the_claim_uses(kit):
    """The claim uses the Registry record (Session, generation), never a caller-made identity."""
    w = kit.worker("w1")
    _, attempt_id = kit.queue(kit.task())
    forged = WorkerSnapshot(w["worker_id"], "00000000-0000-4000-8000-000000000000", w["generation"], {},
                            ("local_process",), 1, 1)
    c = kit.store.candidate_page(kit.store.now_us(), 8, None).items[0]
    assert kit.store.claim(c, forged, "0" * 64, 30_000_000).status == "worker_unavailable"
    assert kit.one("SELECT count(*) FROM run_leases WHERE attempt_id = %s", (attempt_id,)) == 0
