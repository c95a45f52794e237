"""The Worker's durable inbox (ADR-0021, issue 11 §2–3): a real SQLite file, child processes
SIGKILLed between receipt and spawn, caps at their edges, and no secret value on disk."""

from __future__ import annotations

import glob
import json
import os
import signal
import sqlite3
import subprocess
import sys
import uuid

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from qlagent.adapters.sqlite.inbox import FILENAME, SqliteInbox
from qlagent.core.canonical import content_digest
from qlagent.core.errors import EXIT_CONFLICT, EXIT_UNAVAILABLE, EXIT_USAGE, NotFoundError, StoreIntegrityError, \
    UnavailableError, ValidationError
from qlagent.core.inbox_states import (InboxState, COLLECT, REATTACH, REPORT_LOST, RESEND, SPAWN, IllegalInboxTransition,
                                       InboxFull, InboxOffer, OfferConflict, pull_body, recovery_action,
                                       spec_bytes)
from qlagent.core.profiles import EDGE
from kit import wait_until

HERE = os.path.dirname(os.path.abspath(__file__))
SECRET_VALUE = "pl41ntext-never-on-disk-7d1f"


def _token() -> str:
    return "t" * 8 + uuid.uuid4().hex + "x" * 8        # 48 URL-safe characters


def make_offer(argv=("/bin/true",), env=None, **over) -> InboxOffer:
    attempt = str(uuid.uuid4())
    spec = {"attemptId": attempt, "kind": "local_process", "argv": list(argv), "env": dict(env or {}),
            "secretRefs": {"API_TOKEN": "api-token"}, "timeoutMs": 60_000, "logQuotaBytes": 4_194_304}
    fields = dict(offer_id=str(uuid.uuid4()), attempt_id=attempt, session_id=str(uuid.uuid4()), generation=3,
                  lease_generation=1, lease_expires_at_us=1_800_000_000_000_000, lease_token=_token(),
                  spec_digest=content_digest(spec), spec=spec)
    fields.update(over)
    return InboxOffer(**fields)


@pytest.fixture
def inbox(tmp_path):
    box = SqliteInbox.for_profile(str(tmp_path), EDGE)
    yield box
    box.close()


def test_its_own_file_in_the_state_dir_wal_fsynced_and_private(tmp_path, inbox):
    assert inbox.path == str(tmp_path / FILENAME)
    assert os.stat(inbox.path).st_mode & 0o777 == 0o600
    c = sqlite3.connect(inbox.path)
    assert c.execute("PRAGMA journal_mode").fetchone() == ("wal",)
    assert inbox._c.execute("PRAGMA synchronous").fetchone() == (2,)     # FULL: every commit fsync'd
    assert (inbox.max_rows, inbox.max_bytes) == (EDGE.inbox_rows, EDGE.inbox_bytes) == (64, 4_194_304)


def test_receive_is_idempotent_by_offer_id_across_a_restart(tmp_path, inbox):
    offer = make_offer()
    entry, new = inbox.receive(offer)
    assert new and entry.state == "received"
    inbox.close()
    again = SqliteInbox.for_profile(str(tmp_path), EDGE)
    entry2, new2 = again.receive(offer)
    assert not new2 and entry2.offer == offer and entry2.received_at_us == entry.received_at_us
    assert again.usage()[0] == 1
    again.close()


@pytest.mark.parametrize("change, reason", [
    (lambda o: dict(spec={**o.spec, "argv": ["/bin/false"]}, spec_digest=content_digest({**o.spec, "argv": ["/bin/false"]})),
     "spec_digest"),
    (lambda o: dict(lease_token=_token()), "lease"),
    (lambda o: dict(lease_generation=2), "lease"),
])
def test_same_offer_id_with_another_spec_or_lease_is_refused_and_reported(tmp_path, inbox, change, reason):
    offer = make_offer()
    inbox.receive(offer)
    other = msgspec.structs.replace(offer, **change(offer))
    with pytest.raises(OfferConflict) as e:
        inbox.receive(other)
    assert e.value.reason == reason and e.value.exit_code == EXIT_CONFLICT and e.value.field == "offerId"
    assert e.value.to_dict()["code"] == "offer_conflict"
    inbox.close()
    kept = SqliteInbox.for_profile(str(tmp_path), EDGE)
    (entry,) = kept.open_entries()
    assert entry.offer == offer and entry.conflicts == 1          # the first stays; the refusal is on record
    kept.close()


@pytest.mark.parametrize("over, field", [
    (dict(offer_id="not-a-uuid"), "offerId"),
    (dict(offer_id=str(uuid.uuid4()).upper()), "offerId"),
    (dict(attempt_id=""), "attemptId"),
    (dict(generation=0), "generation"),
    (dict(lease_generation=2**63), "leaseGeneration"),
    (dict(lease_expires_at_us=0), "leaseExpiresAtUs"),
    (dict(lease_token="x" * 31), "leaseToken"),
    (dict(lease_token="x" * 257), "leaseToken"),
    (dict(lease_token="x" * 40 + "/"), "leaseToken"),
    (dict(spec_digest="0" * 64), "specDigest"),
    (dict(spec_digest="A" * 64), "specDigest"),
    (dict(spec={"argv": [1.5]}), "spec"),
])
def test_a_bad_offer_names_its_field_and_writes_nothing(inbox, over, field):
    with pytest.raises(ValidationError) as e:
        inbox.receive(make_offer(**over))
    assert e.value.field == field and e.value.exit_code == EXIT_USAGE
    assert inbox.usage() == (0, 0) and inbox.open_entries() == []


def test_secret_values_never_reach_the_inbox_files(tmp_path, inbox):
    # What the control plane sends: a spec naming SecretRefs, the values beside it (ADR-0014 §3).
    offer = make_offer()
    wire_secrets = {"API_TOKEN": SECRET_VALUE}
    inbox.begin_pull(offer.session_id, 3, str(uuid.uuid4()), _token())
    inbox.receive(offer)
    for state in ("barrier", "started"):
        inbox.advance(offer.offer_id, state)
    inbox.advance(offer.offer_id, "completed", {"exitCode": 0})

    # A spec carrying the values is refused, whether as a field of its own or folded into env.
    with pytest.raises(ValidationError) as e:
        spec = {**offer.spec, "secrets": wire_secrets}
        inbox.receive(make_offer(spec=spec, spec_digest=content_digest(spec)))
    assert e.value.field == "spec.secrets"
    with pytest.raises(ValidationError) as e:
        inbox.receive(make_offer(spec={**offer.spec, "env": wire_secrets}))   # digest is the claimed spec's
    assert e.value.field == "specDigest"

    inbox._c.execute("PRAGMA wal_checkpoint(PASSIVE)")
    blobs = b"".join(open(p, "rb").read() for p in glob.glob(str(tmp_path / (FILENAME + "*"))))
    assert b"api-token" in blobs                     # the SecretRef name is kept (the check can see)
    assert SECRET_VALUE.encode() not in blobs


def test_states_move_only_forward_and_the_outcome_is_bounded(inbox):
    offer = make_offer()
    inbox.receive(offer)
    with pytest.raises(IllegalInboxTransition):
        inbox.advance(offer.offer_id, "started")     # never without the barrier
    inbox.advance(offer.offer_id, "barrier")
    with pytest.raises(ValidationError) as e:
        inbox.advance(offer.offer_id, "completed")
    assert e.value.field == "outcome"
    with pytest.raises(ValidationError) as e:
        inbox.advance(offer.offer_id, "completed", {"reason": "x" * 4_096})
    assert e.value.field == "outcome" and e.value.limit == 4_096
    edge = {"reason": "x" * (4_096 - len('{"reason":""}'))}
    assert inbox.advance(offer.offer_id, "completed", edge).outcome == edge      # exactly 4096 bytes
    entry = inbox.advance(offer.offer_id, "acked")
    assert entry.state == "acked" and entry.outcome == edge
    for state in InboxState.ALL:
        with pytest.raises(IllegalInboxTransition):
            inbox.advance(offer.offer_id, state, {"exitCode": 0} if state == "completed" else None)
    assert inbox.open_entries() == []
    with pytest.raises(NotFoundError):
        inbox.advance(str(uuid.uuid4()), "barrier")


def test_the_pull_request_is_kept_before_sending_and_a_retry_is_byte_identical(tmp_path, inbox):
    session = str(uuid.uuid4())
    first = inbox.begin_pull(session, 3, str(uuid.uuid4()), _token())
    assert json.loads(first.body) == {"generation": 3, "leaseToken": first.lease_token, "pullId": first.pull_id,
                                      "sessionId": session}
    inbox.close()                                    # the response was lost; the Worker restarts
    box = SqliteInbox.for_profile(str(tmp_path), EDGE)
    retry = box.begin_pull(session, 3, str(uuid.uuid4()), _token())
    assert retry.body == first.body and retry == first

    offer = make_offer(session_id=session)
    box.receive(offer, pull_id=first.pull_id)        # the answer ends the kept request in the same commit
    fresh = box.begin_pull(session, 3, str(uuid.uuid4()), _token())
    assert fresh.pull_id != first.pull_id and fresh.lease_token != first.lease_token

    newer = box.begin_pull(session, 4, str(uuid.uuid4()), _token())   # a new Session generation
    assert newer.generation == 4 and newer.pull_id != fresh.pull_id
    box.end_pull(newer.pull_id)
    assert box.begin_pull(session, 4, str(uuid.uuid4()), _token()).pull_id != newer.pull_id
    with pytest.raises(ValidationError) as e:
        box.begin_pull(session, 4, "nope", _token())
    assert e.value.field == "pullId"
    box.close()


def test_the_row_cap_at_its_edge(tmp_path):
    box = SqliteInbox(str(tmp_path / FILENAME), max_rows=3, max_bytes=1_000_000)
    offers = [make_offer() for _ in range(4)]
    for o in offers[:3]:
        box.receive(o)                               # exactly the cap
    with pytest.raises(InboxFull) as e:
        box.receive(offers[3])
    assert (e.value.field, e.value.limit, e.value.exit_code) == ("inboxRows", 3, EXIT_UNAVAILABLE)
    assert box.usage()[0] == 3 and box.get(offers[3].offer_id) is None
    box.advance(offers[0].offer_id, "completed", {"reason": "lost"})
    with pytest.raises(InboxFull):                   # completed but not acknowledged: never dropped
        box.receive(offers[3])
    box.advance(offers[0].offer_id, "acked")
    box.receive(offers[3])                           # the acknowledged row makes room
    assert box.get(offers[0].offer_id) is None and box.usage()[0] == 3
    box.close()


def test_a_kept_orphans_attempt_is_recorded_with_its_ack_outlives_the_row_and_is_bounded(tmp_path, monkeypatch):
    """What the Worker's stray scan spares once a keep_orphans row is pruned: recorded in the
    commit that acknowledges it, kept across a restart, capped oldest first, forgotten on request."""
    import qlagent.adapters.sqlite.inbox as inbox_mod
    monkeypatch.setattr(inbox_mod, "KEPT_ORPHANS_MAX", 2)
    box = SqliteInbox(str(tmp_path / FILENAME), max_rows=1, max_bytes=1_000_000)
    offers = [make_offer() for _ in range(4)]
    for o in offers[:3]:
        box.receive(o)                               # a cap of one row: each prunes the one before
        box.advance(o.offer_id, "completed", {"kind": "completion"})
        with pytest.raises(ValidationError):
            box.advance(o.offer_id, "completed", {"kind": "completion"}, keep_orphans=True)
        box.advance(o.offer_id, "acked", keep_orphans=True)
    box.receive(offers[3])
    box.close()
    box = SqliteInbox(str(tmp_path / FILENAME), max_rows=1, max_bytes=1_000_000)
    assert box.get(offers[1].offer_id) is None
    assert box.kept_orphans() == {offers[1].attempt_id, offers[2].attempt_id}
    box.forget_orphans({offers[1].attempt_id})
    assert box.kept_orphans() == {offers[2].attempt_id}
    box.close()


def test_the_byte_cap_at_its_edge(tmp_path):
    a, b = make_offer(), make_offer(argv=["/bin/echo", "y" * 100])
    size = lambda o: len(msgspec.json.encode(o.spec, order="sorted"))        # noqa: E731
    box = SqliteInbox(str(tmp_path / FILENAME), max_rows=64, max_bytes=size(a) + size(b))
    box.receive(a)
    box.receive(b)                                   # exactly the cap
    assert box.usage() == (2, size(a) + size(b))
    with pytest.raises(InboxFull) as e:
        box.receive(make_offer())
    assert e.value.field == "inboxBytes" and e.value.limit == size(a) + size(b)
    big = make_offer(argv=["/bin/echo", "z" * (size(a) + size(b))])
    with pytest.raises(ValidationError) as e:        # over the cap on its own: bad input
        box.receive(big)
    assert e.value.field == "spec"
    assert box.usage() == (2, size(a) + size(b))
    box.close()


def test_the_files_stay_small_over_many_offers(tmp_path):
    box = SqliteInbox(str(tmp_path / FILENAME), max_rows=4, max_bytes=65_536)
    for _ in range(200):
        o = make_offer(argv=["/bin/echo", "p" * 8_000])
        box.receive(o)
        for state in ("barrier", "started"):
            box.advance(o.offer_id, state)
        box.advance(o.offer_id, "completed", {"exitCode": 0})
        box.advance(o.offer_id, "acked")
    assert box.usage()[0] == 4
    total = sum(os.path.getsize(p) for p in glob.glob(str(tmp_path / (FILENAME + "*"))))
    # 200 × 8 KB specs went through; the files hold the kept rows plus the WAL limit (256 KiB).
    assert total < 524_288, total
    box.close()


def test_the_offer_keeps_the_pull_that_brought_it_so_the_same_body_can_be_sent_again(tmp_path, inbox):
    session = str(uuid.uuid4())
    pending = inbox.begin_pull(session, 3, str(uuid.uuid4()), _token())
    offer = make_offer(session_id=session, lease_token=pending.lease_token)
    inbox.receive(offer, pull_id=pending.pull_id)
    inbox.close()                                    # restart
    box = SqliteInbox.for_profile(str(tmp_path), EDGE)
    (entry,) = box.open_entries()
    assert entry.pull_id == pending.pull_id
    o = entry.offer
    assert pull_body(o.session_id, o.generation, entry.pull_id, o.lease_token) == pending.body
    box.close()


# The inbox DDL as builds before its migration files wrote it in place: version 1, then the
# steps that made version 2 and version 3 of the same file.
OLD_V1_DDL = """
CREATE TABLE offers (
    seq                 INTEGER PRIMARY KEY AUTOINCREMENT,
    offer_id            TEXT NOT NULL UNIQUE,
    attempt_id          TEXT NOT NULL,
    session_id          TEXT NOT NULL,
    generation          INTEGER NOT NULL,
    lease_generation    INTEGER NOT NULL,
    lease_expires_at_us INTEGER NOT NULL,
    lease_token         TEXT NOT NULL,
    spec_digest         TEXT NOT NULL,
    spec_json           BLOB NOT NULL,
    spec_bytes          INTEGER NOT NULL,
    state               TEXT NOT NULL CHECK (state IN ('received','barrier','started','completed','acked')),
    outcome_json        BLOB,
    received_at_us      INTEGER NOT NULL,
    updated_at_us       INTEGER NOT NULL,
    conflicts           INTEGER NOT NULL DEFAULT 0,
    last_conflict_digest TEXT,
    last_conflict_at_us INTEGER
);
CREATE INDEX offers_state ON offers (state, seq);
CREATE TABLE pending_pull (
    one           INTEGER PRIMARY KEY CHECK (one = 1),
    session_id    TEXT NOT NULL,
    generation    INTEGER NOT NULL,
    pull_id       TEXT NOT NULL,
    lease_token   TEXT NOT NULL,
    body          BLOB NOT NULL,
    created_at_us INTEGER NOT NULL
);
"""
OLD_V1_TO_V2 = "ALTER TABLE offers ADD COLUMN pull_id TEXT;"
OLD_V2_TO_V3 = "CREATE TABLE kept_orphans (attempt_id TEXT PRIMARY KEY, kept_at_us INTEGER NOT NULL);"


def old_inbox_file(path: str, version: int, offer: InboxOffer) -> None:
    """An inbox file of schema ``version`` as an older build left it, holding ``offer`` (received)."""
    c = sqlite3.connect(path)
    c.executescript(OLD_V1_DDL + (OLD_V1_TO_V2 if version >= 2 else "") + (OLD_V2_TO_V3 if version >= 3 else "")
                    + f"PRAGMA user_version={version};")
    c.execute("INSERT INTO offers (offer_id, attempt_id, session_id, generation, lease_generation, "
              "lease_expires_at_us, lease_token, spec_digest, spec_json, spec_bytes, state, received_at_us, "
              "updated_at_us) VALUES (?,?,?,?,?,?,?,?,?,?,'received',1,1)",
              (offer.offer_id, offer.attempt_id, offer.session_id, offer.generation, offer.lease_generation,
               offer.lease_expires_at_us, offer.lease_token, offer.spec_digest, spec_bytes(offer.spec),
               len(spec_bytes(offer.spec))))
    if version >= 3:
        c.execute("INSERT INTO kept_orphans VALUES ('kept-attempt', 1)")
    c.commit()
    c.close()


def history(box: SqliteInbox) -> list[tuple[int, str]]:
    return [tuple(r) for r in box._c.execute("SELECT version, name FROM schema_migrations ORDER BY version")]


NEW_HISTORY = [(1, "offers"), (2, "offer_pull_id"), (3, "kept_orphans")]


@pytest.mark.parametrize("version", [1, 2, 3])
def test_an_inbox_file_of_an_older_build_upgrades_and_keeps_its_rows(tmp_path, version):
    path = str(tmp_path / FILENAME)
    offer = make_offer()
    old_inbox_file(path, version, offer)
    box = SqliteInbox(path, max_rows=4, max_bytes=65_536)
    (entry,) = box.open_entries()
    assert entry.offer == offer and entry.pull_id is None
    assert box.kept_orphans() == ({"kept-attempt"} if version >= 3 else set())
    assert box._c.execute("PRAGMA user_version").fetchone()[0] == 3 and history(box) == NEW_HISTORY
    box.close()
    box = SqliteInbox(path, max_rows=4, max_bytes=65_536)      # opened again: nothing left to apply
    assert history(box) == NEW_HISTORY and [e.offer for e in box.open_entries()] == [offer]
    box.close()


def test_a_new_inbox_file_is_made_by_its_migrations(tmp_path):
    box = SqliteInbox(str(tmp_path / FILENAME), max_rows=1, max_bytes=1)
    assert box._c.execute("PRAGMA user_version").fetchone()[0] == 3 and history(box) == NEW_HISTORY
    assert "pull_id" in [r[1] for r in box._c.execute("PRAGMA table_info(offers)")]
    box.close()


def test_a_file_of_an_unknown_schema_version_is_refused(tmp_path):
    path = str(tmp_path / FILENAME)
    SqliteInbox(path, max_rows=1, max_bytes=1).close()
    c = sqlite3.connect(path)
    c.execute("PRAGMA user_version=7")
    c.close()
    with pytest.raises(StoreIntegrityError):
        SqliteInbox(path, max_rows=1, max_bytes=1)


def test_a_symlinked_inbox_file_is_refused_with_one_line(tmp_path):
    target = tmp_path / "elsewhere"
    target.write_bytes(b"")
    (tmp_path / FILENAME).symlink_to(target)
    with pytest.raises(UnavailableError) as e:
        SqliteInbox(str(tmp_path / FILENAME), max_rows=1, max_bytes=1)
    assert "\n" not in str(e.value) and FILENAME in str(e.value)
    assert target.read_bytes() == b""                 # nothing written through the link


@pytest.mark.parametrize("rows, size", [(0, 1), (1, 0)])
def test_caps_below_one_are_refused(tmp_path, rows, size):
    with pytest.raises(ValidationError):
        SqliteInbox(str(tmp_path / FILENAME), max_rows=rows, max_bytes=size)


def test_recovery_action_for_every_state_and_evidence():
    for alive in (False, True):
        for receipt in (False, True):
            for run_dir in (False, True):
                ev = dict(run_dir_exists=run_dir, alive=alive, receipt=receipt)
                assert recovery_action("received", **ev) == SPAWN
                assert recovery_action("completed", **ev) == RESEND
                assert recovery_action("acked", **ev) is None
                expect = REATTACH if alive else COLLECT if receipt else REPORT_LOST
                assert recovery_action("started", **ev) == expect
                assert recovery_action("barrier", **ev) == (expect if run_dir else SPAWN)
    with pytest.raises(ValueError):
        recovery_action("queued", run_dir_exists=False, alive=False, receipt=False)


# ---------------------------------------------------------------- SIGKILL between receipt and spawn

TASK = ('echo "$$" >> "$SPAWNS"; sleep 1; echo 0 > "$RUN_DIR/receipt.tmp" && '
        'mv "$RUN_DIR/receipt.tmp" "$RUN_DIR/receipt"')


def _worker(state_dir, offer_path, pause_at) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, os.path.join(HERE, "inboxkit.py"), state_dir, offer_path, pause_at],
                            stdout=subprocess.PIPE, text=True)


def _crash_setup(tmp_path):
    spawns = tmp_path / "spawns.txt"
    offer = make_offer(argv=["/bin/sh", "-c", TASK], env={"SPAWNS": str(spawns)})
    offer_path = tmp_path / "offer.json"
    offer_path.write_bytes(msgspec.json.encode(offer))
    state = tmp_path / "state"
    state.mkdir()
    return offer, str(state), str(offer_path), spawns


@pytest.mark.parametrize("step", ["receipt", "barrier", "spawn"])
def test_a_worker_killed_between_receipt_and_spawn_spawns_exactly_once(tmp_path, step):
    offer, state, offer_path, spawns = _crash_setup(tmp_path)
    w = _worker(state, offer_path, step)
    assert w.stdout.readline() == f"{step}\n"        # that step is durable; kill now
    w.kill()
    w.wait()
    box = SqliteInbox(os.path.join(state, FILENAME), max_rows=8, max_bytes=65_536)
    assert box.get(offer.offer_id).state == {"receipt": "received"}.get(step, "barrier")   # never forgotten
    box.close()

    again = _worker(state, offer_path, "never")
    out, _ = again.communicate(timeout=60)
    assert json.loads(out) == {"state": "completed", "outcome": {"exitCode": 0}}
    assert len(spawns.read_text().splitlines()) == 1

    third = _worker(state, offer_path, "never")      # a further restart does nothing again
    assert json.loads(third.communicate(timeout=60)[0])["state"] == "completed"
    assert len(spawns.read_text().splitlines()) == 1


def test_a_run_gone_without_a_receipt_is_reported_lost_not_spawned_again(tmp_path):
    offer, state, offer_path, spawns = _crash_setup(tmp_path)
    w = _worker(state, offer_path, "spawn")
    assert w.stdout.readline() == "spawn\n"
    task = int(open(os.path.join(state, "runs", offer.attempt_id, "task.pid")).read())
    wait_until(lambda: spawns.exists() and spawns.read_text(), 30, "the task's start", step=0.01)
    w.kill()
    os.killpg(task, signal.SIGKILL)                  # the run died with the Worker (e.g. a reboot)
    w.wait()
    out, _ = _worker(state, offer_path, "never").communicate(timeout=60)
    assert json.loads(out) == {"state": "completed", "outcome": {"reason": "lost"}}
    assert len(spawns.read_text().splitlines()) == 1


# ---------------------------------------------------------------- property: any order of events

_POOL = [make_offer(argv=["/bin/echo", "n" * (40 * i)]) for i in range(5)]
# Rivals: the same offerIds with another spec — each must be refused while the first is kept.
_RIVALS = [msgspec.structs.replace(o, spec={**o.spec, "cwd": "/tmp"},
                                   spec_digest=content_digest({**o.spec, "cwd": "/tmp"})) for o in _POOL]
_FORWARD = {"received": "barrier", "barrier": "started", "started": "completed", "completed": "acked"}


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.sampled_from(["receive", "rival", "advance", "restart"]), st.integers(0, 4)),
                max_size=25))
def test_any_sequence_keeps_one_first_version_per_offer_id_within_the_caps(tmp_path_factory, ops):
    path = str(tmp_path_factory.mktemp("inbox") / FILENAME)
    caps = dict(max_rows=3, max_bytes=sum(len(msgspec.json.encode(o.spec)) for o in _POOL[2:]))
    box = SqliteInbox(path, **caps)
    model: dict[str, str] = {}                       # offerId → state, as the inbox must have it
    for op, i in ops:
        oid = _POOL[i].offer_id
        if op == "restart":
            box.close()
            box = SqliteInbox(path, **caps)
        elif op == "receive":
            try:
                _, new = box.receive(_POOL[i])
                assert new == (oid not in model)
                model.setdefault(oid, "received")
            except InboxFull:
                assert oid not in model
        elif op == "rival":
            if oid in model:
                with pytest.raises(OfferConflict):
                    box.receive(_RIVALS[i])
        elif oid in model and model[oid] in _FORWARD:
            nxt = _FORWARD[model[oid]]
            box.advance(oid, nxt, {"exitCode": 0} if nxt == "completed" else None)
            model[oid] = nxt
        rows, used = box.usage()
        assert rows <= caps["max_rows"] and used <= caps["max_bytes"]
        for kept_id, state in list(model.items()):
            entry = box.get(kept_id)
            if entry is None:                        # only acknowledged rows are ever pruned
                assert state == "acked"
                del model[kept_id]
            else:
                assert entry.state == state and entry.offer == next(o for o in _POOL if o.offer_id == kept_id)
    box.close()
