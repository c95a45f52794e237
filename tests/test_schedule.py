"""qlagent.core.schedule: F7 dialect, Debian DST, clock steps, restart idempotency (issue 4 §2)."""

from __future__ import annotations

import functools
import sqlite3
from datetime import datetime, timedelta, timezone
from zoneinfo import ZoneInfo

import pytest
from cronsim import CronSim
from hypothesis import given, settings
from hypothesis import strategies as st

from qlagent.core.schedule import (
    MAX_MISSED_COUNT,
    MAX_SCHEDULE_LINE_BYTES,
    MAX_SCHEDULES_PER_TASK,
    ScheduleError,
    has_boot,
    boot_idempotency_key,
    idempotency_key,
    next_fire,
    parse_schedule,
    parse_schedules,
    plan_due,
    validate_timezone,
)


def prev_fire(schedule, at_or_before_utc_us: int, tz: str | None) -> int | None:
    """The latest fire instant at or before ``at_or_before_utc_us`` (the reverse search
    ``plan_due`` runs), as an oracle of next_fire and plan_due."""
    from qlagent.core.schedule import _items, _merged_prev, _zone
    return _merged_prev(_items(schedule), at_or_before_utc_us, _zone(tz))

S = 1_000_000
MIN = 60 * S
HOUR = 60 * MIN
TASK = "6f1c2b9e-3d4a-4c5b-8e7f-0a1b2c3d4e5f"


def us(y, mo, d, h=0, mi=0, s=0, tz="UTC", fold=0) -> int:
    return int(datetime(y, mo, d, h, mi, s, tzinfo=ZoneInfo(tz), fold=fold).timestamp()) * S


def local(instant_us: int, tz: str) -> str:
    return datetime.fromtimestamp(instant_us / S, ZoneInfo(tz)).isoformat()


def fires(lines, start_us, tz, n):
    schedules = parse_schedules(lines) if isinstance(lines, list) else parse_schedule(lines)
    out, t = [], start_us
    for _ in range(n):
        t = next_fire(schedules, t, tz)
        out.append(local(t, tz))
    return out


def fires_between(lines, start_us, end_us, tz):
    schedules = parse_schedules(lines)
    out, t = [], start_us
    while (t := next_fire(schedules, t, tz)) is not None and t <= end_us:
        out.append(t)
    return out


# --- F7: the dialect -------------------------------------------------------------------------

T0 = us(2026, 1, 1)


def test_f7_minute_list_fires_at_listed_minutes():
    assert fires("9,19,29,39,49,59 * * * *", T0, "UTC", 7) == [
        "2026-01-01T00:09:00+00:00", "2026-01-01T00:19:00+00:00", "2026-01-01T00:29:00+00:00",
        "2026-01-01T00:39:00+00:00", "2026-01-01T00:49:00+00:00", "2026-01-01T00:59:00+00:00",
        "2026-01-01T01:09:00+00:00"]


def test_f7_six_fields_take_seconds_first():
    assert fires("*/10 * * * * *", T0, "UTC", 7) == [
        f"2026-01-01T00:0{m}:{s}+00:00" for m, s in
        (("0", "10"), ("0", "20"), ("0", "30"), ("0", "40"), ("0", "50"), ("1", "00"), ("1", "10"))]
    assert fires("0 */5 * * * *", T0, "UTC", 3) == [
        "2026-01-01T00:05:00+00:00", "2026-01-01T00:10:00+00:00", "2026-01-01T00:15:00+00:00"]
    # "5 10 * * * *" is second 5 of minute 10 of every hour, not minute 5 of hour 10.
    assert fires("5 10 * * * *", T0, "UTC", 2) == [
        "2026-01-01T00:10:05+00:00", "2026-01-01T01:10:05+00:00"]


def test_next_fire_is_strictly_after():
    start = us(2026, 1, 1, 0, 9)
    assert fires("9,19,29,39,49,59 * * * *", start, "UTC", 1) == ["2026-01-01T00:19:00+00:00"]
    assert fires("9,19,29,39,49,59 * * * *", start - 1, "UTC", 1) == ["2026-01-01T00:09:00+00:00"]
    assert fires("9,19,29,39,49,59 * * * *", start + 1, "UTC", 1) == ["2026-01-01T00:19:00+00:00"]


@pytest.mark.parametrize("line, field, words", [
    ("30 5/10 * * * ?", "day-of-week", "'?'"),
    ("/6 * * * *", "minute", "no range"),
    ("0 1 2 3 4 5 6", "schedule", "7 fields"),
    ("1 2 3 4", "schedule", "4 fields"),
    ("", "schedule", "empty"),
    ("   \t ", "schedule", "empty"),
    ("60 * * * * *", "second", "second 60 out of range 0-59"),
    ("61 * * * *", "minute", "minute 61 out of range 0-59"),
    ("0 24 * * *", "hour", "hour 24 out of range 0-23"),
    ("0 0 0 * *", "day-of-month", "day-of-month 0 out of range 1-31"),
    ("0 0 32 * *", "day-of-month", "day-of-month 32 out of range 1-31"),
    ("0 0 * 13 *", "month", "month 13 out of range 1-12"),
    ("0 0 * * 8", "day-of-week", "day-of-week 8 out of range 0-7"),
    ("5-2 * * * *", "minute", "reversed"),
    ("*/0 * * * *", "minute", "1-59"),
    ("1,,2 * * * *", "minute", "empty item"),
    ("x * * * *", "minute", "not a number"),
    ("0 0 30 2 *", "day-of-month", "never matches"),
    ("0 0 * * MON#6", "day-of-week", "1-5"),
    ("@fortnightly", "schedule", "unknown"),
])
def test_bad_lines_are_refused_naming_the_field(line, field, words):
    with pytest.raises(ScheduleError) as err:
        parse_schedule(line)
    assert err.value.field == field
    assert words in err.value.detail
    assert str(err.value) == f"{field}: {err.value.detail}"


def test_range_errors_carry_the_limit():
    with pytest.raises(ScheduleError) as err:
        parse_schedule("61 * * * *")
    assert err.value.limit == "0-59"
    assert isinstance(err.value, ValueError)
    assert (err.value.code, err.value.exit_code) == ("invalid_input", 2)
    assert err.value.to_dict() == {"code": "invalid_input", "field": "minute", "limit": "0-59",
                                   "message": "minute: minute 61 out of range 0-59"}


def test_line_length_is_bounded():
    ok = "0" + ",0" * ((MAX_SCHEDULE_LINE_BYTES - 9) // 2) + " * * * *"
    assert len(ok) <= MAX_SCHEDULE_LINE_BYTES
    parse_schedule(ok)
    long = "0" + ",0" * 200 + " * * * *"
    with pytest.raises(ScheduleError) as err:
        parse_schedule(long)
    assert (err.value.field, err.value.limit) == ("schedule", MAX_SCHEDULE_LINE_BYTES)
    assert "256" in err.value.detail


def test_schedules_per_task_are_bounded_and_errors_say_which_line():
    lines = [f"{i} * * * *" for i in range(MAX_SCHEDULES_PER_TASK)]
    assert len(parse_schedules(lines)) == MAX_SCHEDULES_PER_TASK
    with pytest.raises(ScheduleError) as err:
        parse_schedules(lines + ["59 * * * *"])
    assert (err.value.field, err.value.limit) == ("schedule", MAX_SCHEDULES_PER_TASK)
    with pytest.raises(ScheduleError) as err:
        parse_schedules(["0 * * * *", "0 0 * * 9"])
    assert err.value.field == "schedule[1].day-of-week"
    assert str(err.value) == "schedule[1].day-of-week: day-of-week 9 out of range 0-7"
    with pytest.raises(ScheduleError) as err:
        parse_schedules(["0 * * * *", "1 2 3 4 5 6 7"])
    assert err.value.field == "schedule[1]"
    for bad in ("0 * * * *", []):
        with pytest.raises(ScheduleError) as err:
            parse_schedules(bad)
        assert err.value.field == "schedule"


def test_aliases_expand_to_cron():
    start = us(2026, 1, 1, 0, 0, 1)  # a Thursday
    assert fires("@hourly", start, "UTC", 1) == ["2026-01-01T01:00:00+00:00"]
    assert fires("@daily", start, "UTC", 1) == ["2026-01-02T00:00:00+00:00"]
    assert fires("@midnight", start, "UTC", 1) == ["2026-01-02T00:00:00+00:00"]
    assert fires("@weekly", start, "UTC", 1) == ["2026-01-04T00:00:00+00:00"]
    assert fires("@monthly", start, "UTC", 1) == ["2026-02-01T00:00:00+00:00"]
    assert fires("@yearly", start, "UTC", 1) == ["2027-01-01T00:00:00+00:00"]
    assert fires("@ANNUALLY", start, "UTC", 1) == ["2027-01-01T00:00:00+00:00"]


def test_names_and_specials_follow_cronsim():
    start = us(2026, 1, 1)
    assert fires("0 12 * JAN MON-FRI", start, "UTC", 2) == [
        "2026-01-01T12:00:00+00:00", "2026-01-02T12:00:00+00:00"]
    assert fires("0 0 L * *", start, "UTC", 2) == [
        "2026-01-31T00:00:00+00:00", "2026-02-28T00:00:00+00:00"]
    assert fires("0 0 * * 5L", start, "UTC", 1) == ["2026-01-30T00:00:00+00:00"]
    assert fires("0 0 * * MON#2", start, "UTC", 1) == ["2026-01-12T00:00:00+00:00"]
    assert fires("5/20 0 * * *", start, "UTC", 3) == [
        "2026-01-01T00:05:00+00:00", "2026-01-01T00:25:00+00:00", "2026-01-01T00:45:00+00:00"]


def test_boot_and_once_never_fire_by_clock():
    boot = parse_schedules(["@boot"])
    once = parse_schedules(["@once"])
    assert has_boot(boot) and not has_boot(once)
    assert parse_schedule(" @BOOT ") == boot[0] and parse_schedule("@Daily").source == "@daily"
    assert next_fire(boot, T0, "UTC") is None
    assert prev_fire(once, T0, "UTC") is None
    plan = plan_due(boot, "UTC", T0, T0, T0 + 10 * HOUR)
    assert (plan.due_us, plan.wake_us, plan.missed) == (None, None, 0)
    # @boot alongside a cron line: the cron line still fires by clock.
    mixed = parse_schedules(["@boot", "0 * * * *"])
    assert has_boot(mixed)
    assert next_fire(mixed, T0, "UTC") == T0 + HOUR
    with pytest.raises(ScheduleError) as err:
        parse_schedules(["@once", "0 * * * *"])
    assert err.value.field == "schedule"


def test_keys():
    assert idempotency_key(TASK, 1764403200000000) == f"ql3:schedule:v1:{TASK}:1764403200000000"
    assert boot_idempotency_key(TASK, 17) == f"ql3:schedule:v1:{TASK}:boot:17"


# --- several schedules per task ---------------------------------------------------------------

def test_several_lines_merge_and_a_shared_instant_is_one():
    got = fires_between(["0 * * * *", "0 */2 * * *", "30 1 * * *"], T0, T0 + 3 * HOUR, "UTC")
    assert [local(t, "UTC")[11:16] for t in got] == ["01:00", "01:30", "02:00", "03:00"]
    plan = plan_due(parse_schedules(["0 * * * *", "0 */2 * * *"]), "UTC",
                    T0 + HOUR + 1, T0 + HOUR + 1, T0 + 2 * HOUR + 5)
    assert (plan.due_us, plan.missed) == (T0 + 2 * HOUR, 0)


# --- timezones --------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["Europe/Berlin", "America/New_York", "UTC", "Asia/Kolkata"])
def test_valid_timezones(name):
    assert validate_timezone(name) == name


@pytest.mark.parametrize("name", [
    "", "Mars/Olympus_Mons", "../../etc/passwd", "/etc/localtime", "Europe/" + "x" * 80, 5, None,
    "Europe/Berlin\x00", "right/Europe/Berlin"])
def test_bad_timezones_name_the_field(name):
    with pytest.raises(ScheduleError) as err:
        validate_timezone(name)
    assert err.value.field == "timezone"


def test_next_fire_refuses_unknown_zone():
    with pytest.raises(ScheduleError) as err:
        next_fire(parse_schedule("0 * * * *"), T0, "Nowhere/Land")
    assert err.value.field == "timezone"


def test_zone_shifts_the_instant():
    s = parse_schedule("0 9 * * *")
    assert next_fire(s, T0, "Asia/Kolkata") == us(2026, 1, 1, 3, 30)
    assert next_fire(s, T0, None) == us(2026, 1, 1, 9)


# --- DST: Debian cron semantics ---------------------------------------------------------------

@pytest.mark.parametrize("tz, day", [("Europe/Berlin", 29), ("America/New_York", 8)])
def test_daily_0230_in_spring_gap_fires_once_at_gap_end(tz, day):
    start = us(2026, 3, day - 1, 12, tz=tz)
    for line in ("30 2 * * *", "0 30 2 * * *"):
        got = fires(line, start, tz, 3)
        off = "+02:00" if tz == "Europe/Berlin" else "-04:00"
        assert got == [f"2026-03-{day:02d}T03:00:00{off}", f"2026-03-{day + 1:02d}T02:30:00{off}",
                       f"2026-03-{day + 2:02d}T02:30:00{off}"], line


@pytest.mark.parametrize("tz, day, line, first_pass", [
    ("Europe/Berlin", (10, 25), "30 2 * * *", "2026-10-25T02:30:00+02:00"),
    ("Europe/Berlin", (10, 25), "0 30 2 * * *", "2026-10-25T02:30:00+02:00"),
    ("America/New_York", (11, 1), "30 1 * * *", "2026-11-01T01:30:00-04:00"),
])
def test_daily_job_in_repeated_hour_fires_once(tz, day, line, first_pass):
    mo, d = day
    start = us(2026, mo, d, tz=tz) - 12 * HOUR
    end = start + 48 * HOUR
    got = [local(t, tz) for t in fires_between([line], start, end, tz)]
    assert got[0] == first_pass
    assert len(got) == 2  # the DST day and the next day, nothing twice
    # Starting inside the second pass, the first-pass instant is behind: next is tomorrow.
    h = int(first_pass[11:13])
    second_pass_after = us(2026, mo, d, h, 10, tz=tz, fold=1)
    assert local(next_fire(parse_schedule(line), second_pass_after, tz), tz)[:10] == \
        f"2026-{mo:02d}-{d + 1:02d}"


def test_five_field_dst_agrees_with_cronsim_debian_mode_for_a_year():
    # cronsim implements Debian's rule for 5-field fixed-time lines; our 6-field lines
    # must behave the same (cronsim alone skips / doubles them).
    for tz in ("Europe/Berlin", "America/New_York", "Australia/Lord_Howe"):
        zone = ZoneInfo(tz)
        for line in ("30 2 * * *", "15 1,2 * * *", "0 2 * * SUN"):
            it = CronSim(line, datetime(2026, 1, 1, tzinfo=zone))
            want = [int(next(it).timestamp()) * S for _ in range(400)]
            ours = fires_between(["0 " + line], us(2026, 1, 1, tz=tz), want[-1], tz)
            assert ours == want, (tz, line)


@pytest.mark.parametrize("tz, spring, autumn", [
    ("Europe/Berlin", (3, 29), (10, 25)), ("America/New_York", (3, 8), (11, 1))])
def test_hourly_job_follows_the_real_clock(tz, spring, autumn):
    zone = ZoneInfo(tz)

    def day_fires(mo, d):
        start = int(datetime(2026, mo, d, tzinfo=zone).timestamp()) * S - 1
        end = int(datetime(2026, mo, d + 1, tzinfo=zone).timestamp()) * S - 1
        return [local(t, tz)[11:] for t in fires_between(["0 * * * *"], start, end, tz)]

    short = day_fires(*spring)
    assert len(short) == 23
    assert [h[:2] for h in short[:4]] == ["00", "01", "03", "04"]
    long = day_fires(*autumn)
    assert len(long) == 25
    h = 2 if tz == "Europe/Berlin" else 1
    repeated = [x for x in long if x.startswith(f"0{h}:00")]
    assert len(repeated) == 2 and repeated[0] != repeated[1]  # both passes, two offsets


@functools.lru_cache(maxsize=None)
def _transitions(tz: str, year: int = 2026) -> tuple[int, ...]:
    zone = ZoneInfo(tz)
    t = us(year, 1, 1)
    out = []
    prev = datetime.fromtimestamp(t / S, zone).utcoffset()
    while t < us(year + 1, 1, 1):
        t += 30 * MIN
        off = datetime.fromtimestamp(t / S, zone).utcoffset()
        if off != prev:
            out.append(t)
        prev = off
    return tuple(out)


def _oracle(minutes: set[int], hours: set[int], fixed: bool, zone, start_us, end_us):
    """Every real minute in (start, end]: Debian's rule written out independently."""
    out = []
    t = start_us - start_us % MIN + MIN
    prev_wall = datetime.fromtimestamp((t - MIN) / S, timezone.utc).astimezone(zone)
    while t <= end_us:
        wall = datetime.fromtimestamp(t / S, timezone.utc).astimezone(zone)
        hit = wall.minute in minutes and wall.hour in hours
        if fixed:
            hit = hit and wall.fold == 0
            naive_prev, naive = prev_wall.replace(tzinfo=None), wall.replace(tzinfo=None)
            skipped = naive_prev + timedelta(minutes=1)
            while skipped < naive:  # local minutes that never happened: fire at the gap end
                hit = hit or (skipped.minute in minutes and skipped.hour in hours)
                skipped += timedelta(minutes=1)
        if hit:
            out.append(t)
        prev_wall = wall
        t += MIN
    return out


def _spec(values: list[int], star: bool, step: int, hi: int) -> tuple[str, set[int]]:
    if star:
        return f"*/{step}", set(range(0, hi + 1, step))
    return ",".join(map(str, sorted(set(values)))), set(values)


@settings(max_examples=40, deadline=None)
@given(
    tz=st.sampled_from(["Europe/Berlin", "America/New_York", "Australia/Lord_Howe"]),
    which=st.integers(0, 1),
    offset_h=st.integers(-30, 6),
    mins=st.lists(st.integers(0, 59), min_size=1, max_size=4),
    hrs=st.lists(st.integers(0, 23), min_size=1, max_size=3),
    mstar=st.booleans(), hstar=st.booleans(),
    mstep=st.sampled_from([1, 15, 30]), hstep=st.sampled_from([1, 2, 5]),
)
def test_dst_matches_an_independent_oracle(tz, which, offset_h, mins, hrs, mstar, hstar,
                                           mstep, hstep):
    mspec, mset = _spec(mins, mstar, mstep, 59)
    hspec, hset = _spec(hrs, hstar, hstep, 23)
    start = _transitions(tz)[which] + offset_h * HOUR + 7 * S
    end = start + 36 * HOUR
    want = _oracle(mset, hset, not mstar and not hstar, ZoneInfo(tz), start, end)
    assert fires_between([f"{mspec} {hspec} * * *"], start, end, tz) == want


@settings(max_examples=60, deadline=None)
@given(
    tz=st.sampled_from(["UTC", "Europe/Berlin", "America/New_York", "Australia/Lord_Howe"]),
    line=st.sampled_from(["30 2 * * *", "0 * * * *", "*/10 * * * * *", "0 30 1 * * *",
                          "9,19,29,39,49,59 * * * *", "0 0 L * *", "15 1,2,3 * * *"]),
    delta=st.integers(-2 * 24 * HOUR, 2 * 24 * HOUR),
    which=st.integers(0, 1),
)
def test_prev_and_next_bracket_any_instant(tz, line, delta, which):
    t = (_transitions(tz)[which] if tz != "UTC" else us(2026, 3, 29)) + delta
    s = parse_schedule(line)
    p, n = prev_fire(s, t, tz), next_fire(s, t, tz)
    assert p <= t < n
    # No instant lies strictly between p and n, seen from either side.
    assert next_fire(s, p, tz) == n and prev_fire(s, n - 1, tz) == p
    assert next_fire(s, n - 1, tz) == n and prev_fire(s, n, tz) == n


# --- clock steps: the planner with an injectable clock ----------------------------------------

class Clock:
    """Injectable wall clock driving plan_due the way the service loop does."""

    def __init__(self, schedules, tz, now_us):
        self.schedules, self.tz, self.now = schedules, tz, now_us
        self.cursor = (None, None)
        self.runs: list[int] = []

    def tick(self):
        plan = plan_due(self.schedules, self.tz, *self.cursor, self.now)
        self.cursor = (plan.last_instant_us, plan.observed_wall_us)
        if plan.due_us is not None:
            self.runs.append(plan.due_us)
        return plan


def test_first_start_does_not_fire_the_past():
    c = Clock(parse_schedules(["* * * * *"]), "UTC", us(2026, 5, 1, 10, 0, 30))
    plan = c.tick()
    assert plan.due_us is None and plan.missed == 0
    assert plan.wake_us == us(2026, 5, 1, 10, 1)
    assert plan.last_instant_us == c.now


def test_an_awake_loop_fires_every_instant_once():
    c = Clock(parse_schedules(["*/15 * * * * *", "0 * * * * *"]), "Europe/Berlin",
              us(2026, 3, 29, 0, 59, 30, tz="Europe/Berlin"))
    plan = c.tick()
    for _ in range(20):
        c.now = plan.wake_us + 1234  # the loop wakes a little late
        plan = c.tick()
        assert plan.missed == 0
    assert c.runs == [c.runs[0] + i * 15 * S for i in range(20)]


@pytest.mark.parametrize("line, missed", [("0 * * * *", 2), ("*/5 * * * *", 35),
                                          ("* * * * * *", MAX_MISSED_COUNT)])
def test_forward_jump_gives_exactly_one_catch_up(line, missed):
    c = Clock(parse_schedules([line]), "UTC", us(2026, 5, 1, 9, 59, 58))
    c.tick()
    c.now += 3 * HOUR  # a router got its time from NTP
    plan = c.tick()
    assert len(c.runs) == 1
    assert plan.missed == missed
    assert c.runs[0] == prev_fire(c.schedules, c.now, "UTC")  # the latest missed instant
    c.now += 1
    assert c.tick().due_us is None and len(c.runs) == 1


def test_backward_jump_repeats_nothing_then_resumes():
    c = Clock(parse_schedules(["* * * * *"]), "UTC", us(2026, 5, 1, 9, 58, 30))
    plan = c.tick()
    for _ in range(3):  # wakes at 09:59, 10:00, 10:01
        c.now = plan.wake_us + 200_000
        plan = c.tick()
    fired_before = list(c.runs)
    assert fired_before[-1] == us(2026, 5, 1, 10, 1)
    c.now -= HOUR  # clock steps back 1 h to 09:01:00.2
    plan = c.tick()
    assert plan.due_us is None and plan.clock_back_us == HOUR
    assert plan.wake_us == us(2026, 5, 1, 10, 2)
    while c.now < us(2026, 5, 1, 10, 5):
        c.now += 20 * S
        c.tick()
    assert c.runs == fired_before + [us(2026, 5, 1, 10, m) for m in (2, 3, 4, 5)]
    assert len(set(c.runs)) == len(c.runs)


def test_restart_during_a_due_minute_creates_the_run_once():
    db = sqlite3.connect(":memory:")
    db.execute("CREATE TABLE runs (project_id TEXT, idempotency_key TEXT, "
               "UNIQUE(project_id, idempotency_key))")
    schedules = parse_schedules(["* * * * *"])
    persisted = (us(2026, 5, 1, 9, 59, 59), us(2026, 5, 1, 9, 59, 59))

    def loop_iteration(cursor, now, commit_cursor):
        plan = plan_due(schedules, "UTC", *cursor, now)
        if plan.due_us is not None:
            db.execute("INSERT OR IGNORE INTO runs VALUES ('p', ?)",
                       (idempotency_key(TASK, plan.due_us),))
        return (plan.last_instant_us, plan.observed_wall_us) if commit_cursor else cursor

    # First process: creates the 10:00 Run, dies before the cursor is saved.
    persisted = loop_iteration(persisted, us(2026, 5, 1, 10, 0, 0) + 300_000, False)
    # Restarted process, same minute, same cursor: same key, nothing new.
    persisted = loop_iteration(persisted, us(2026, 5, 1, 10, 0, 40), True)
    # A second loop (or call) with the moved cursor: nothing either.
    loop_iteration(persisted, us(2026, 5, 1, 10, 0, 50), True)
    keys = [k for (k,) in db.execute("SELECT idempotency_key FROM runs")]
    assert keys == [idempotency_key(TASK, us(2026, 5, 1, 10))]


def test_same_cursor_same_plan():
    s = parse_schedules(["*/10 * * * * *"])
    a = plan_due(s, "Europe/Berlin", 1_000 * S, 1_000 * S, 1_025 * S + 7)
    b = plan_due(s, "Europe/Berlin", 1_000 * S, 1_000 * S, 1_025 * S + 7)
    assert a == b and a.due_us == 1_020 * S and a.missed == 1
    c = plan_due(s, "Europe/Berlin", a.last_instant_us, a.observed_wall_us, 1_025 * S + 8)
    assert c.due_us is None


steps = st.lists(st.one_of(
    st.integers(1, 90 * S),                      # normal progress
    st.integers(HOUR, 3 * 24 * HOUR),            # forward step
    st.integers(-3 * HOUR, -1),                  # backward step
), min_size=1, max_size=25)


@settings(max_examples=80, deadline=None)
@given(
    tz=st.sampled_from(["UTC", "Europe/Berlin", "America/New_York"]),
    lines=st.lists(st.sampled_from(["* * * * *", "30 2 * * *", "0 * * * *", "*/20 * * * * *",
                                    "0 30 1 * * *", "7,8 9 * * *"]), min_size=1, max_size=3),
    start=st.integers(us(2026, 3, 6), us(2026, 11, 3)),
    moves=steps,
)
def test_planner_never_repeats_and_fires_at_most_one_per_call(tz, lines, start, moves):
    schedules = parse_schedules(lines)
    c = Clock(schedules, tz, start)
    c.tick()
    for move in moves:
        before = c.cursor[0]
        c.now += move
        n_runs = len(c.runs)
        plan = c.tick()
        assert len(c.runs) - n_runs <= 1
        if plan.due_us is not None:
            assert before < plan.due_us <= c.now
            assert prev_fire(schedules, plan.due_us, tz) == plan.due_us  # a real instant
            assert prev_fire(schedules, c.now, tz) == plan.due_us        # the latest one
        elif c.now > before:
            assert next_fire(schedules, before, tz) > c.now              # nothing was due
        assert plan.last_instant_us >= before
        assert plan.wake_us > plan.last_instant_us
    assert c.runs == sorted(set(c.runs))


def test_one_schedule_or_a_list_is_the_same():
    one = parse_schedule("*/20 * * * * *")
    assert plan_due(one, "UTC", T0, T0, T0 + 45 * S) == plan_due([one], "UTC", T0, T0, T0 + 45 * S)
    assert next_fire(one, T0, "UTC") == next_fire((one,), T0, "UTC") == T0 + 20 * S
