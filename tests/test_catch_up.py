"""Catch-up after downtime is a per-Task choice (issue 12 §5): ``catch_up = "latest" | "none"``
and ``catch_up_within_s``, with a controllable clock as tests/test_schedule.py does; the journal
and the run.created event say ``missed`` (``≥100`` once capped); other dialects' cron
extensions are refused naming the extension."""

from __future__ import annotations

import io
import json
import os
import sqlite3
from datetime import datetime, timezone

import pytest
from qlcli import cli, ok

from qlagent.core.definitions import definition_document, parse_task_file, prepare_task
from qlagent.core.errors import ValidationError
from qlagent.core.schedule import (MAX_MISSED_COUNT, ON_TIME_US, ScheduleError, apply_catch_up,
                                   parse_schedule, parse_schedules, plan_due)

S = 1_000_000
H = 3600 * S


def us(y, mo, d, h=0, mi=0, s=0) -> int:
    return int(datetime(y, mo, d, h, mi, s, tzinfo=timezone.utc).timestamp()) * S


DAILY = parse_schedules(["30 3 * * *"])
# The router went down at 03:00 and came back at 15:00: the 03:30 Run is 11.5 h late.
LAST, BACK = us(2026, 6, 1, 3, 0), us(2026, 6, 1, 15, 0)
DUE = us(2026, 6, 1, 3, 30)


def test_latest_is_the_default_and_runs_the_missed_instant_however_late():
    plan = apply_catch_up(plan_due(DAILY, "UTC", LAST, LAST, BACK), BACK)
    assert (plan.due_us, plan.dropped_us, plan.missed) == (DUE, None, 0)


def test_none_drops_an_instant_missed_during_downtime_and_moves_the_cursor_past_it():
    plan = apply_catch_up(plan_due(DAILY, "UTC", LAST, LAST, BACK), BACK, "none")
    assert (plan.due_us, plan.dropped_us, plan.missed) == (None, DUE, 1)
    assert plan.last_instant_us == BACK and plan.wake_us == us(2026, 6, 2, 3, 30)
    # Next evaluation from the persisted cursor: the dropped instant never comes back.
    again = plan_due(DAILY, "UTC", plan.last_instant_us, plan.observed_wall_us, BACK + 60 * S)
    assert again.due_us is None


@pytest.mark.parametrize("late_us, runs", [(0, True), (ON_TIME_US, True), (ON_TIME_US + 1, False)])
def test_none_still_runs_an_instant_seen_on_time_edge_60_s(late_us, runs):
    now = DUE + late_us
    plan = apply_catch_up(plan_due(DAILY, "UTC", LAST, LAST, now), now, "none")
    assert (plan.due_us == DUE) is runs


@pytest.mark.parametrize("within_s, runs", [(41_400, True), (41_399, False), (3600, False), (86_400, True)])
def test_latest_within_bounds_how_late_the_catch_up_may_be(within_s, runs):
    plan = apply_catch_up(plan_due(DAILY, "UTC", LAST, LAST, BACK), BACK, "latest", within_s * S)
    assert (plan.due_us == DUE) is runs                         # 11.5 h = 41 400 s late


def test_missed_text_says_at_least_when_capped():
    minutely = parse_schedules(["* * * * *"])
    t = us(2026, 6, 1)
    plan = plan_due(minutely, "UTC", t, t, t + 3 * H)
    assert plan.missed == MAX_MISSED_COUNT and plan.missed_text == "≥100"
    plan = plan_due(minutely, "UTC", t, t, t + 5 * 60 * S)
    assert (plan.missed, plan.missed_text) == (4, "4")
    dropped = apply_catch_up(plan_due(minutely, "UTC", t, t, t + 3 * H), t + 3 * H, "none")
    assert dropped.missed_text == "≥100"


# ---- definitions: validated, named, part of the canonical definition --------------------------

def prep(**fields):
    t = {"name": "daily", "schedule": "30 3 * * *", "command": ["/bin/true"], **fields}
    return prepare_task(parse_task_file({"task": [t]})[0], 0)


def test_catch_up_fields_are_validated_naming_the_field():
    with pytest.raises(ValidationError) as e:
        prep(catch_up="sometimes")
    assert e.value.field == "task[0].catch_up" and "latest, none" in str(e.value)
    with pytest.raises(ValidationError) as e:
        prep(catch_up="none", catch_up_within_s=60)
    assert e.value.field == "task[0].catch_up_within_s" and "latest" in str(e.value)
    for bad in (0, 0.5, -5, 366 * 86400 + 1):
        with pytest.raises(ValidationError) as e:
            prep(catch_up_within_s=bad)
        assert e.value.field == "task[0].catch_up_within_s" and "1..31622400 seconds" in str(e.value)
    assert prep(catch_up_within_s=1).definition.catch_up_within_ms == 1000            # edges accepted
    assert prep(catch_up_within_s=366 * 86400).definition.catch_up_within_ms == 366 * 86400 * 1000
    with pytest.raises(ValidationError) as e:
        prep(catch_up=1)
    assert e.value.field == "task[0].catch_up"


def test_a_task_without_the_fields_keeps_its_content_digest():
    base = prep()
    # The digest this definition has on main without catch-up (computed on main at e461f8b).
    assert base.content_digest == "f6154a41007b04079121d7f117fb995730361255ed7f91a5958f66c9cc931afb"
    assert not {"catchUp", "catchUpWithinMs"} & set(definition_document(base.definition))
    assert prep(catch_up="latest").content_digest == base.content_digest      # the default, spelled out
    assert prep(catch_up="none").content_digest != base.content_digest
    assert prep(catch_up_within_s=60).content_digest not in (base.content_digest,
                                                             prep(catch_up="none").content_digest)


# ---- unsupported cron extensions are refused naming the extension ----------------------------

@pytest.mark.parametrize("line, field, words", [
    ("0 0 15W * *", "day-of-month", "W (nearest weekday) is not supported"),
    ("0 0 W * *", "day-of-month", "W (nearest weekday) is not supported"),
    ("H 0 * * *", "minute", "H (hashed value, Jenkins) is not supported"),
    ("H/5 * * * *", "minute", "H (hashed value, Jenkins) is not supported"),
    ("0 0 1#2 * *", "day-of-month", "'#' (nth weekday) is only for day-of-week"),
    ("0 L * * *", "hour", "L (last) is only for day-of-month and day-of-week"),
    ("@reboot", "schedule", "write @boot"),
    ("@every 5m", "schedule", "@every (interval) is not supported"),
])
def test_unsupported_cron_extensions_are_refused_naming_them(line, field, words):
    with pytest.raises(ScheduleError) as e:
        parse_schedule(line)
    assert e.value.field == field and words in str(e.value)


@pytest.mark.parametrize("line", ["0 0 LW * *", "0 0 L * *", "0 0 * * 5L", "0 0 * * 5#2", "0 0 * JUL *",
                                  "0 0 * * THU", "0 0 * * WED", "0 0 * JAN-JUL MON-FRI"])
def test_the_dialects_own_l_hash_and_names_still_parse(line):
    assert parse_schedule(line).kind == "cron"


def test_task_add_refuses_15w_with_one_line(state, workdir):
    f = os.path.join(workdir, "w.toml")
    with open(f, "w") as fh:
        fh.write('[[task]]\nname = "w"\nschedule = "0 9 15W * *"\ncommand = ["/bin/true"]\n')
    p = cli(state, "task", "add", "-f", f)
    lines = p.stderr.decode().strip().splitlines()
    assert p.returncode == 2 and len(lines) == 1
    assert "task[0].schedule[0].day-of-month" in lines[0] and "W (nearest weekday) is not supported" in lines[0]


# ---- through the store: the scheduler, its journal and the run.created event ------------------

def _scheduler_fire(state, now_us: int, journal: io.StringIO) -> int:
    from qlagent.adapters.sqlite.store import SqliteStore
    from qlagent.service.journal import Journal
    from qlagent.service.scheduler import Scheduler
    store = SqliteStore(os.path.join(state, "qlagent.db"), "default", clock_us=lambda: now_us)
    try:
        s = Scheduler(store, "UTC", lambda: now_us, Journal(journal))
        s.reload()
        return s.fire_due()
    finally:
        store.close()


def _add(state, workdir, text):
    f = os.path.join(workdir, "tasks.toml")
    with open(f, "w") as fh:
        fh.write(text)
    ok(state, "task", "add", "-f", f)


def _created_payloads(state):
    with sqlite3.connect(os.path.join(state, "qlagent.db")) as c:
        return [(json.loads(r[0]), r[1]) for r in c.execute(
            "SELECT e.payload_json, t.name FROM run_events e JOIN runs r ON r.run_id = e.run_id "
            "JOIN tasks t ON t.task_id = r.task_id WHERE e.type = 'run.created' ORDER BY e.created_at_us")]


def test_downtime_through_the_store_none_latest_and_capped_missed(state, workdir):
    _add(state, workdir, '''
[[task]]
name = "nightly-none"
schedule = "30 3 * * *"
catch_up = "none"
concurrency = "parallel"
command = ["/bin/true"]

[[task]]
name = "nightly-bounded"
schedule = "30 3 * * *"
catch_up_within_s = 3600
concurrency = "parallel"
command = ["/bin/true"]

[[task]]
name = "nightly-latest"
schedule = "30 3 * * *"
concurrency = "parallel"      # its first Run stays queued here: no service runs it
command = ["/bin/true"]

[[task]]
name = "minutely"
schedule = "* * * * *"
concurrency = "parallel"
command = ["/bin/true"]
''')
    journal = io.StringIO()
    assert _scheduler_fire(state, LAST, journal) == 0            # cursors start at 03:00
    assert _scheduler_fire(state, BACK, journal) == 2             # 15:00: latest + minutely only
    got = {name: p for p, name in _created_payloads(state)}
    assert set(got) == {"nightly-latest", "minutely"}
    assert got["nightly-latest"]["scheduledForUs"] == DUE and "missed" not in got["nightly-latest"]
    assert got["minutely"]["missed"] == "≥100"                   # 719 missed minutes, capped at 100
    text = journal.getvalue()
    assert "schedule.coalesced task=minutely missed=≥100" in text
    assert "schedule.missed task=nightly-none catch_up=none late_s=41400 missed=1" in text
    assert "schedule.missed task=nightly-bounded catch_up=latest late_s=41400 missed=1" in text
    # Nothing dropped comes back later; the next night runs for everyone.
    assert _scheduler_fire(state, BACK + 60 * S, journal) == 1     # minutely's next minute only
    assert _scheduler_fire(state, us(2026, 6, 2, 3, 30), journal) == 4
    p = cli(state, "task", "show", "nightly-bounded")
    assert b"catch up      latest within 3600 s" in p.stdout
