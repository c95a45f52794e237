"""ADR-0014 "验证要求" for the candidate walk a Worker Pull runs (``cluster.dispatcher.
CandidateClaimer``), against the real PostgreSQL authority. Where a bullet is about a port
misbehaving (duplicate rows, a cursor that does not advance, a plan that drifts), a thin wrapper
around the real Pull unit injects exactly that misbehaviour."""

from __future__ import annotations

import msgspec
import pytest

from pgkit import COMMAND_MARK, token
from qlagent.cluster.dispatcher import DispatcherBudgets
from qlagent.cluster.execspec import spec_digest
from qlagent.cluster.pull import WorkerPull
from qlagent.core.cluster import Page, PullRequest
from qlagent.core.errors import ValidationError
from qlagent.core.ids import new_id


class Counting:
    """Delegates to the real object, counting method calls; hooks may alter a result."""

    def __init__(self, inner, **hooks) -> None:
        self.inner, self.hooks, self.calls = inner, hooks, {}

    def __getattr__(self, name):
        fn = getattr(self.inner, name)
        if not callable(fn):
            return fn

        def call(*args, **kw):
            self.calls[name] = self.calls.get(name, 0) + 1
            if name in self.hooks:
                return self.hooks[name](fn, *args, **kw)
            return fn(*args, **kw)
        return call


class HookedUnits:
    """The real Pull store whose Pull units are wrapped in ``Counting(unit, **hooks)``."""

    def __init__(self, store, **hooks) -> None:
        self.store, self.hooks, self.units = store, hooks, []

    def __getattr__(self, name):
        return getattr(self.store, name)

    def pull_unit(self, *args):
        *rest, work = args

        def hooked(unit):
            self.units.append(Counting(unit, **self.hooks))
            return work(self.units[-1])
        return self.store.pull_unit(*rest, hooked)

    def calls(self, name: str) -> int:
        return sum(u.calls.get(name, 0) for u in self.units)


def pull(kit, w, store=None, budgets: DispatcherBudgets = DispatcherBudgets()):
    req = PullRequest(session_id=w["session_id"], generation=w["generation"], pull_id=new_id(), lease_token=token())
    return WorkerPull(store or kit.store, kit.secrets, budgets).pull(w["worker_id"], w["credential"], req)


def test_no_candidate_means_no_plan_and_no_claim(kit):
    w = kit.worker("w1")
    store = HookedUnits(kit.store)
    a = pull(kit, w, store)
    assert (a.status, a.offer) == ("idle", None)
    assert store.calls("candidate_page") == 1 and store.calls("prepare") == store.calls("claim") == 0


def test_placement_without_executor_gets_it_required_and_a_conflict_is_skipped(kit):
    w = kit.worker("w1")
    kit.queue(kit.task("bad", placement={"required": {"executor": "docker"}}), priority=5)
    run_ok, _ = kit.queue(kit.task("ok", placement={}))
    a = pull(kit, w)
    assert a.status == "offered" and a.offer.run_id == run_ok


def test_the_candidate_budget_bounds_the_walk_and_says_so(kit):
    w = kit.worker("w1", {"zone": "a"})
    task = kit.task(placement={"required": {"zone": "nowhere"}})
    for _ in range(7):
        kit.queue(task)
    store = HookedUnits(kit.store)
    a = pull(kit, w, store, DispatcherBudgets(candidate_page_size=2, candidate_pages=3))
    # 3 pages × 2 candidates read, a 4th page would be needed: explicit truncation, not "idle".
    assert (a.status, a.reason, a.offer) == ("truncated", "candidate_budget", None)
    assert store.calls("candidate_page") == 3 and store.calls("claim") == 0


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
    w = kit.worker("w1", slots=8)
    task = kit.task()
    for _ in range(4):
        kit.queue(task)
    store = HookedUnits(kit.store, candidate_page=hook, prepare=lambda fn, c: None)
    a = pull(kit, w, store, DispatcherBudgets(candidate_page_size=2))
    assert (a.status, a.reason, a.offer) == ("refused", reason, None)
    assert store.calls("claim") == 0 and kit.one("SELECT count(*) FROM run_leases") == 0


@pytest.mark.parametrize("change", [{"attemptId": "00000000-0000-4000-8000-000000000000"},
                                    {"taskRevision": 2}, {"argv": ["relative/path"]},
                                    {"env": {"QL3_RUN_ID": "forged"}}, {"timeoutMs": 0}, {"umask": "0999"},
                                    {"umask": "027"}, {"cwd": "relative"}])
def test_invalid_or_mismatched_execution_spec_refused_before_claim(kit, change):
    w = kit.worker("w1")
    kit.queue(kit.task())

    def tamper(fn, c):
        plan = fn(c)
        return msgspec.structs.replace(plan, spec={**plan.spec, **change})
    store = HookedUnits(kit.store, prepare=tamper)
    a = pull(kit, w, store)
    assert (a.status, a.reason, a.offer) == ("unmatched", "invalid_execution_spec", None)
    assert store.calls("claim") == 0 and kit.one("SELECT count(*) FROM run_leases") == 0


def test_unclaimed_answers_carry_no_command(kit):
    w = kit.worker("w1", {"zone": "a"})
    kit.queue(kit.task(placement={"required": {"zone": "b"}}))
    a = pull(kit, w)
    assert (a.status, a.reason, a.offer) == ("unmatched", "no_matching_worker", None)
    for text in (msgspec.json.encode(a).decode(), repr(a), str(msgspec.to_builtins(a))):
        assert COMMAND_MARK not in text and "GREETING" not in text


def test_execution_spec_is_deep_copied(kit):
    w = kit.worker("w1")
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
    o = pull(kit, w, HookedUnits(kit.store, prepare=keep, claim=mutate_after_plan)).offer
    assert o.spec.argv == (COMMAND_MARK, "hello") and o.spec.env["GREETING"] == "hi"
    assert o.spec_digest == spec_digest(o.spec)


@pytest.mark.parametrize("field,value,ok", [
    ("candidate_page_size", 64, True), ("candidate_page_size", 65, False), ("candidate_page_size", 0, False),
    ("candidate_pages", 16, True), ("candidate_pages", 17, False),
    ("claim_tries", 64, True), ("claim_tries", 65, False)])
def test_budget_over_a_ceiling_is_refused_at_construction(kit, field, value, ok):
    b = DispatcherBudgets(**{field: value})
    if ok:
        WorkerPull(kit.store, kit.secrets, b)
        return
    with pytest.raises(ValidationError) as e:
        WorkerPull(kit.store, kit.secrets, b)
    assert e.value.field == f"cluster.dispatcher.{field}"
