"""The store contract (docs/ARCHITECTURE.md "Store contract"): what every implementation of the
store ports guarantees, checked through ``core.ports`` only — no SQL, no driver, no file."""

from __future__ import annotations

import pytest
from storekit import prepared

from qlagent.core.errors import ConflictError, FenceRejected, NotFoundError, ValidationError
from qlagent.core.models import LOCAL_SUBJECT, ScheduleCursor
from qlagent.core.schedule import idempotency_key as schedule_key
from qlagent.core.states import AttemptState, RunState
from qlagent.core.dispatch import Finish
from qlagent.core.receipt import TruncationFact
from qlagent.core.tokens import new_token, token_digest

MUTATION = "6f1c2a4e-8b1d-4c3e-9f2a-0123456789ab"


def add(store, *tasks):
    return store.add_tasks(store.project.project_id, list(tasks))


def start(store, head, mutation_id=MUTATION, **kw):
    args = dict(project=store.project.project_id, task=head.name, subject=LOCAL_SUBJECT, mutation_id=mutation_id,
                expected_revision=head.revision, expected_digest=head.content_digest)
    args.update(kw)
    return store.task_start(**args)


# ---- definitions: append-only revisions ------------------------------------------------------

def test_revision_append_is_idempotent_for_the_same_content_and_fenced_otherwise(store, clock):
    pid = store.project.project_id
    (head,) = add(store, prepared("t"))
    assert (head.revision, head.enabled, head.created_at_us) == (1, True, clock.now)
    same = store.edit_task(pid, "t", 1, head.content_digest, prepared("t"))
    assert (same.revision, same.content_digest) == (1, head.content_digest)          # no-op, no revision 2
    clock.advance()
    two = store.edit_task(pid, "t", 1, head.content_digest, prepared("t", script="echo two"))
    assert two.revision == 2 and two.content_digest != head.content_digest and two.updated_at_us == clock.now
    with pytest.raises(ConflictError) as stale:
        store.edit_task(pid, "t", 1, head.content_digest, prepared("t", script="echo three"))
    assert stale.value.code == "definition_changed"
    assert store.get_head(pid, "t").revision == 2                                   # the refusal wrote nothing
    with pytest.raises(ValidationError):
        store.edit_task(pid, "t", 2, two.content_digest, prepared("renamed"))
    with pytest.raises(ConflictError) as exists:
        add(store, prepared("t"))
    assert exists.value.code == "task_exists"


def test_add_tasks_is_all_or_nothing_and_heads_list_by_name(store):
    add(store, prepared("b"), prepared("a"))
    with pytest.raises(ConflictError):
        add(store, prepared("c"), prepared("a"))
    assert [h.name for h in store.list_heads(store.project.project_id)] == ["a", "b"]
    assert [h.name for h in store.list_heads(None)] == ["a", "b"]
    with pytest.raises(NotFoundError) as nf:
        store.get_head(store.project.project_id, "c")
    assert nf.value.code == "task_not_found"


def test_disable_cancels_queued_runs_and_remove_frees_the_name(store):
    pid = store.project.project_id
    (head,) = add(store, prepared("t"))
    created = start(store, head)
    disabled, cancelled = store.set_enabled(pid, "t", False, LOCAL_SUBJECT)
    assert (disabled.enabled, cancelled) == (False, 1)
    assert store.get_run(created.run_id).state == RunState.CANCELLED
    last, queued, active = store.remove_task(pid, "t", LOCAL_SUBJECT)
    assert (last.task_id, queued, active) == (head.task_id, 0, 0)
    assert store.list_heads(pid) == []
    (again,) = add(store, prepared("t"))
    assert again.task_id != head.task_id


# ---- Task Start (ADR-0376 §2) ----------------------------------------------------------------

def test_task_start_accepted_then_existing_on_exact_replay(store, clock):
    (head,) = add(store, prepared("t"))
    clock.advance()
    first = start(store, head)
    assert (first.existing, first.state, first.task_revision, first.created_at_us) == (False, "queued", 1, clock.now)
    assert len(first.event_ids) == 2 and first.task_snapshot_ref == f"qltd:v1:1:{head.content_digest}"
    clock.advance()
    again = start(store, head)
    assert again.existing is True
    assert (again.run_id, again.attempt_id, again.event_ids, again.created_at_us) == \
        (first.run_id, first.attempt_id, first.event_ids, first.created_at_us)
    run = store.get_run(first.run_id)
    assert (run.state, run.trigger_type, run.requested_by, run.version, run.event_sequence) == \
        ("queued", "task_start", LOCAL_SUBJECT, 2, 2)
    assert [a.state for a in store.list_attempts(run.run_id)] == [AttemptState.CLAIMED]


def test_task_start_mutation_reused_for_another_request_is_a_conflict(store):
    (head,) = add(store, prepared("t"))
    start(store, head)
    pid = store.project.project_id
    two = store.edit_task(pid, "t", 1, head.content_digest, prepared("t", script="echo 2"))
    with pytest.raises(FenceRejected) as e:
        start(store, two)                                 # same mutationId, other revision
    assert e.value.reason == "mutation_conflict"


@pytest.mark.parametrize("fence", ["definition_changed", "task_disabled", "authorization_changed",
                                   "binding_version", "project_version"])
def test_task_start_fences_reject_and_write_nothing(store, fence):
    pid = store.project.project_id
    (head,) = add(store, prepared("t"))
    kw, reason = {}, fence
    if fence == "definition_changed":
        kw = {"expected_revision": 1, "expected_digest": "0" * 64}
    elif fence == "task_disabled":
        store.set_enabled(pid, "t", False, LOCAL_SUBJECT)
    elif fence == "authorization_changed":
        store.bind_role(pid, "vera", "viewer")
        kw = {"subject": "vera"}
    elif fence == "binding_version":
        kw, reason = {"admitted_binding_version": 99}, "authorization_changed"
    else:
        kw, reason = {"admitted_project_version": 99}, "authorization_changed"
    with pytest.raises(FenceRejected) as e:
        start(store, head, **kw)
    assert e.value.reason == reason
    assert store.list_runs(pid) == ([], None)


def test_task_start_of_an_unknown_task_is_not_found(store):
    (head,) = add(store, prepared("t"))
    with pytest.raises(NotFoundError) as e:
        start(store, head, task="nope")
    assert e.value.code == "task_not_found"


# ---- dispatch candidates: order and keyset ----------------------------------------------------

def _fire(store, head, instant):
    return store.fire_schedule(project_id=head.project_id, task_id=head.task_id,
                               idempotency_key=schedule_key(head.task_id, instant), trigger="cron",
                               scheduled_for_us=instant, actor="scheduler", cursor=None)


def test_candidate_page_reads_limit_plus_one_in_priority_then_age_order_with_a_keyset_cursor(store, clock):
    heads = add(store, *(prepared(f"p{p}", priority=p, concurrency="parallel") for p in (0, 5, 9)))
    order = []
    for i in range(2):
        for h in heads:                                   # created interleaved: p0, p5, p9, p0, p5, p9
            clock.advance()
            assert _fire(store, h, 1_000 + i) == "created"
            order.append((h.definition.priority, clock.now))
    expected = [c for _, c in sorted(order, key=lambda pc: (-pc[0], pc[1]))]
    page = store.candidate_page(2, None)
    assert [c.created_at_us for c in page] == expected[:3]              # limit + 1: the extra proves more
    rest = store.candidate_page(2, page[1].key())
    assert [c.created_at_us for c in rest] == expected[2:5]
    tail = store.candidate_page(2, rest[1].key())
    assert [c.created_at_us for c in tail] == expected[4:]
    assert store.candidate_page(2, tail[-1].key()) == []


# ---- CAS transitions and the event sequence --------------------------------------------------

def test_claim_is_compare_and_set_and_finish_is_idempotent(store, clock):
    (head,) = add(store, prepared("t"))
    run_id = start(store, head).run_id
    (c,) = store.candidate_page(4, None)
    assert store.reread(c)
    plan, missing = store.load_plan(c)
    assert missing is None and plan.task_name == "t" and plan.execution.shell == "/bin/sh"
    assert store.claim_starting(c, "/var/log/x.log") is True
    assert store.claim_starting(c, "/var/log/x.log") is False          # the stale candidate lost
    assert not store.reread(c) and store.candidate_page(4, None) == []
    assert store.active_count() == 1 and store.task_active_count(head.task_id) == 1
    clock.advance()
    store.mark_running(c, 4242, 1.5, clock.now + 10_000_000)
    (live,) = store.live_attempts()
    assert (live.attempt_id, live.state, live.shim_pid, live.deadline_at_us) == \
        (c.attempt_id, "running", 4242, clock.now + 10_000_000)
    clock.advance()
    fact = TruncationFact(quota_bytes=10, bytes_kept=10)
    done = Finish(AttemptState.SUCCEEDED, exit_code=0, bytes_kept=10, bytes_dropped=5, ended_at_us=clock.now)
    assert store.finish(run_id, c.attempt_id, done, fact, None) == RunState.SUCCEEDED
    assert store.finish(run_id, c.attempt_id, Finish(AttemptState.FAILED), None, None) == RunState.SUCCEEDED
    run = store.get_run(run_id)
    assert (run.state, run.exit_code, run.ended_at_us) == ("succeeded", 0, clock.now)
    (attempt,) = store.list_attempts(run_id)
    assert (attempt.state, attempt.truncated, attempt.bytes_dropped) == ("succeeded", True, 5)
    assert attempt.truncation_reason == "quota"
    assert store.latest_artifact(run_id) == ("/var/log/x.log", TruncationFact(10, 10, 5, "quota"))
    assert store.active_count() == 0 and store.live_attempts() == []


def test_a_log_cut_by_a_failed_write_keeps_its_reason_and_the_first_fact(store, clock):
    """A full file system cut the log (core.receipt.truncation_of): the fact names the write
    error wherever it is read back, and a later fact cannot replace it (write-once)."""
    (head,) = add(store, prepared("t"))
    run_id = start(store, head).run_id
    (c,) = store.candidate_page(4, None)
    store.claim_starting(c, "/var/log/x.log")
    store.mark_running(c, 4242, 1.5, clock.now + 10_000_000)
    reason = "write_error: ENOSPC (No space left on device)"
    fact = TruncationFact(quota_bytes=4194304, bytes_kept=901120, reason=reason)
    done = Finish(AttemptState.SUCCEEDED, exit_code=0, bytes_kept=901120, bytes_dropped=3098925, ended_at_us=clock.now)
    store.finish(run_id, c.attempt_id, done, fact, None)
    store.finish(run_id, c.attempt_id, done, TruncationFact(4194304, 4194304, 1), None)
    (attempt,) = store.list_attempts(run_id)
    assert (attempt.truncated, attempt.truncation_reason, attempt.bytes_dropped) == (True, reason, 3098925)
    assert store.latest_artifact(run_id) == ("/var/log/x.log", TruncationFact(4194304, 901120, 3098925, reason))


def test_events_have_a_gapless_sequence_per_run(store):
    (head,) = add(store, prepared("t"))
    run_id = start(store, head).run_id
    (c,) = store.candidate_page(4, None)
    store.claim_starting(c, "/var/log/x.log")
    store.mark_running(c, 4242, 1.5, 10**16)
    store.request_cancel(run_id, "alice")
    store.request_cancel(run_id, "alice")                                # idempotent: one intent
    assert store.cancel_requested() == {c.attempt_id}
    store.finish(run_id, c.attempt_id, Finish(AttemptState.CANCELLED, exit_code=None, exit_signal=15), None, None)
    events = store.list_events(run_id)
    assert [e.sequence for e in events] == list(range(1, len(events) + 1))
    assert [e.type for e in events] == ["run.created", "run.queued", "run.starting", "run.running",
                                        "run.cancel_requested", "run.cancelled"]
    assert store.get_run(run_id).event_sequence == len(events)
    assert len({e.event_id for e in events}) == len(events)


def test_retry_queues_a_new_attempt_after_the_backoff(store, clock):
    (head,) = add(store, prepared("t", retry={"max_attempts": 2, "backoff_s": 1}))
    run_id = start(store, head).run_id
    (c,) = store.candidate_page(4, None)
    store.claim_starting(c, "/var/log/x.log")
    plan, _ = store.load_plan(c)
    state = store.finish(run_id, c.attempt_id, Finish(AttemptState.FAILED, exit_code=1), None, plan.retry)
    assert state == RunState.QUEUED
    assert store.next_backoff_us() == clock.now + 1_000_000 and store.candidate_page(4, None) == []
    clock.advance(1_000_000)
    (again,) = store.candidate_page(4, None)
    assert again.run_id == run_id and again.attempt_id != c.attempt_id
    assert [a.attempt_no for a in store.list_attempts(run_id)] == [1, 2]


def test_run_list_is_a_keyset_page_newest_first(store, clock):
    (head,) = add(store, prepared("t", concurrency="parallel"))
    ids = []
    for i in range(5):
        clock.advance()
        ids.append(start(store, head, mutation_id=f"6f1c2a4e-8b1d-4c3e-9f2a-01234567890{i}").run_id)
    pid = store.project.project_id
    seen, cursor = [], None
    while True:
        page, cursor = store.list_runs(pid, limit=2, cursor=cursor)
        seen += [r.run_id for r in page]
        if cursor is None:
            break
    assert seen == ids[::-1]
    assert [r.run_id for r in store.list_runs(pid, task_id=head.task_id, state="queued", limit=50)[0]] == ids[::-1]
    with pytest.raises(ValidationError):
        store.list_runs(pid, limit=0)


# ---- schedule cursors --------------------------------------------------------------------------

def test_schedule_fire_is_idempotent_per_instant_and_the_cursor_is_compare_and_set(store, clock):
    (head,) = add(store, prepared("t", schedule="*/5 * * * *"))
    c1 = ScheduleCursor(last_instant_us=300_000_000, observed_wall_us=clock.now)
    key = schedule_key(head.task_id, 300_000_000)
    args = dict(project_id=head.project_id, task_id=head.task_id, idempotency_key=key, trigger="cron",
                scheduled_for_us=300_000_000, actor="scheduler")
    assert store.fire_schedule(**args, cursor=(None, c1)) == "created"
    assert store.fire_schedule(**args, cursor=(None, c1)) == "moved"       # another loop already moved it
    assert store.fire_schedule(**args, cursor=None) == "exists"            # one Run per instant
    assert store.schedule_cursors() == {head.task_id: c1}
    c2 = ScheduleCursor(last_instant_us=600_000_000, observed_wall_us=clock.advance())
    assert store.fire_schedule(**{**args, "idempotency_key": None}, cursor=(c1, c2)) == "cursor"
    assert store.schedule_cursors()[head.task_id] == c2
    (run,) = store.list_runs(head.project_id)[0]
    assert (run.trigger_type, run.scheduled_for_us, run.requested_by) == ("cron", 300_000_000, "scheduler")


def test_a_fire_for_an_instant_the_stores_clock_has_not_reached_writes_nothing(store, clock):
    """A Run is stamped with the store's time (ADR-0376 §2); a caller whose own clock runs ahead
    asks too soon: ``early``, neither the Run nor the cursor written, until the store's clock is there."""
    (head,) = add(store, prepared("t", schedule="* * * * * *"))
    instant = clock.now + 1_000
    cursor = (None, ScheduleCursor(last_instant_us=instant, observed_wall_us=instant))
    args = dict(project_id=head.project_id, task_id=head.task_id, idempotency_key=schedule_key(head.task_id, instant),
                trigger="cron", scheduled_for_us=instant, actor="scheduler", cursor=cursor)
    assert store.fire_schedule(**args) == "early"
    assert (store.list_runs(head.project_id)[0], store.schedule_cursors()) == ([], {})
    clock.advance(1_000)
    assert store.fire_schedule(**args) == "created"
    (run,) = store.list_runs(head.project_id)[0]
    assert run.scheduled_for_us == run.created_at_us == instant


def test_a_single_instance_fire_is_skipped_and_counted_while_a_run_is_live(store):
    (head,) = add(store, prepared("t", schedule="*/5 * * * *"))
    assert _fire(store, head, 300_000_000) == "created"
    assert _fire(store, head, 600_000_000) == "skipped"
    assert store.skipped_fires(head.task_id) == 1
    store.set_enabled(head.project_id, "t", False, LOCAL_SUBJECT)
    assert _fire(store, head, 900_000_000) == "gone"


# ---- tokens and role bindings ------------------------------------------------------------------

def test_token_and_role_lookups(store, clock):
    tok = new_token()
    tid = store.grant_token("default", "alice", "operator", token_digest(tok))
    pid = store.project.project_id
    assert store.lookup_token(token_digest(tok)) == (pid, "alice")
    b = store.latest_binding(pid, "alice")
    assert (b.role, b.binding_version) == ("operator", 1)
    store.grant_token("default", "alice", "operator", token_digest(new_token()))
    assert store.latest_binding(pid, "alice").binding_version == 1     # same role: no new binding
    assert store.bind_role(pid, "alice", "viewer") == 2
    assert store.latest_binding(pid, "alice").role == "viewer"
    assert store.bind_role(pid, "alice", None) == 3
    assert store.latest_binding(pid, "alice") is None                 # revoked
    infos = store.list_tokens(pid)
    assert [t.token_id for t in infos][0] == tid and all(t.revoked_at_us is None for t in infos)
    clock.advance()
    store.revoke_token(token_id="unused", digest=token_digest(tok))
    store.revoke_token(token_id=tid)                                  # idempotent
    assert store.lookup_token(token_digest(tok)) is None
    assert [t.revoked_at_us for t in store.list_tokens(pid) if t.token_id == tid] == [clock.now]
    with pytest.raises(NotFoundError):
        store.revoke_token(token_id="no-such-token")
    with pytest.raises(ValidationError):
        store.bind_role(pid, "bob", "emperor")
    assert store.ensure_project("other").project_id != pid
    assert store.get_project("other").name == "other"


def test_an_unknown_project_is_created_only_by_a_committed_write_when_asked(store, reopen):
    # A CLI command refused after opening the store must leave no Project (README: a refused
    # command writes nothing), so a defining command's Project comes with its own write.
    def names():
        return [n for n in ("default", "p1") if _known(store, n) is not None]

    with pytest.raises(NotFoundError, match="project 'p1' does not exist"):
        reopen("p1", False)
    s = reopen("p1", "on_write")
    pid = s.project.project_id
    assert names() == ["default"]                       # handed out, not stored
    with pytest.raises(ValidationError):
        s.bind_role(pid, "bob", "emperor")              # refused inside the transaction
    with pytest.raises(ValidationError):
        s.grant_token("p1", "", "viewer", token_digest(new_token()))
    assert names() == ["default"]
    s.put_secret(pid, "a", b"\x01cipher-a", "k1")       # the first committed write creates it
    assert store.get_project("p1").project_id == pid and s.secret_names(pid)[0][0] == "a"
    assert s.bind_role(pid, "bob", "viewer") == 1       # later writes find it stored
    assert reopen("p1", False).project.project_id == pid
    # Created meanwhile under another ID: the write is refused, never lands in the other Project.
    late = reopen("p2", "on_write")
    other = store.ensure_project("p2")
    with pytest.raises(ConflictError):
        late.put_secret(late.project.project_id, "a", b"\x01c", "k1")
    assert store.secret_names(other.project_id) == []
    with pytest.raises(ValidationError):
        reopen("no such", "on_write")


def _known(store, name):
    try:
        return store.get_project(name)
    except NotFoundError:
        return None


def test_secret_rows_hold_ciphertext_by_project_and_name(store, clock):
    pid = store.project.project_id
    store.put_secret(pid, "b", b"\x01cipher-b", "k1")
    store.put_secret(pid, "a", b"\x01cipher-a", "k1")
    assert store.secret_names(pid) == [("a", clock.now), ("b", clock.now)]
    assert store.ciphertexts(pid, ["a", "zz"]) == {"a": b"\x01cipher-a"}
    store.delete_secret(pid, "a")
    with pytest.raises(NotFoundError):
        store.delete_secret(pid, "a")


def test_capabilities_and_clock(store, clock):
    assert store.capabilities()
    assert store.now_us() == clock.now
