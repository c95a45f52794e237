"""Cron schedules of a Task: parsing, next fire instants and a pure clock-step planner.

Pure: no I/O beyond zoneinfo's tz database, no clock reads. Every instant is an integer count
of µs since the Unix epoch (UTC); the caller reads the wall clock and passes it in.

Dialect (issue 4 §2, field report F7):
- 5 fields ``minute hour day-of-month month day-of-week``;
- 6 fields with the SECONDS FIRST ``second minute hour day-of-month month day-of-week``
  (the qinglong dialect);
- ``@boot`` (one Run after each service start), ``@once`` (manual only, never fires by clock);
- aliases ``@hourly @daily @midnight @weekly @monthly @yearly @annually``.
Lists ``a,b``, ranges ``a-b``, steps ``*/s``, ``a-b/s`` and ``a/s`` (= ``a-max/s``), month and
weekday names, ``L``/``LW`` in day-of-month and ``nL``/``n#k`` in day-of-week are accepted
(cronsim semantics; day-of-month and day-of-week are OR-ed unless one starts with ``*``).
Refused, naming the field: ``?``, a step with no range (``/6``), out-of-range values, empty
items, reversed ranges, a line with other than 5 or 6 fields; other dialects' extensions are
refused naming the extension: ``15W`` ("W (nearest weekday) is not supported"), Jenkins ``H``,
``#``/``L`` outside their fields, ``@reboot`` (write ``@boot``), ``@every``.

DST follows Debian cron (cron(8) "daylight saving time" section): a *fixed-time* schedule
(neither the minute nor the hour field starts with ``*``) is evaluated on the local wall clock;
a local time skipped by a forward change fires once, at the first instant after the gap; a
local time repeated by a backward change fires once, on its first pass. Any other schedule
(``*`` in minute or hour, ``@hourly``) follows the real clock: it fires at every instant whose
local time matches, so an hourly job runs at each real hour on both passes of a repeated hour
and none in a skipped one. The same rule applies to 6-field lines (cronsim alone would skip
a 6-field fixed time in a gap and fire it twice in a repeated hour).
"""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from typing import Iterator, Literal, NamedTuple, Sequence
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from cronsim import CronSim, CronSimError

from .errors import ValidationError

MAX_SCHEDULE_LINE_BYTES = 256
"""Longest accepted schedule line, in UTF-8 bytes."""

MAX_SCHEDULES_PER_TASK = 16
"""Most schedule lines one Task may carry."""

MAX_TIMEZONE_BYTES = 64
"""Longest accepted IANA timezone name, in bytes (the longest real key is 32)."""

MAX_MISSED_COUNT = 100
"""``Plan.missed`` counts skipped instants up to this value; reaching it means "at least"."""

IDEMPOTENCY_PREFIX = "ql3:schedule:v1"

_UTC = timezone.utc
_EPOCH = datetime(1970, 1, 1, tzinfo=_UTC)
_US = timedelta(microseconds=1)
_MINUTE = timedelta(minutes=1)
_SECOND_US = 1_000_000
_NAIVE_EPOCH = datetime(1970, 1, 1)
# Offset changes are found by probing every 6 hours: no zone changes its offset twice
# within 6 hours.
_PROBE_US = 6 * 3600 * _SECOND_US

_ALIASES = {
    "@hourly": "0 * * * *",
    "@daily": "0 0 * * *",
    "@midnight": "0 0 * * *",
    "@weekly": "0 0 * * 0",
    "@monthly": "0 0 1 * *",
    "@yearly": "0 0 1 1 *",
    "@annually": "0 0 1 1 *",
}

_FIELDS_6 = ("second", "minute", "hour", "day-of-month", "month", "day-of-week")
_RANGES = {
    "second": (0, 59),
    "minute": (0, 59),
    "hour": (0, 23),
    "day-of-month": (1, 31),
    "month": (1, 12),
    "day-of-week": (0, 7),
}
_NAMES = {
    "month": {m: i + 1 for i, m in enumerate(
        ("JAN", "FEB", "MAR", "APR", "MAY", "JUN", "JUL", "AUG", "SEP", "OCT", "NOV", "DEC"))},
    "day-of-week": {d: i for i, d in enumerate(("SUN", "MON", "TUE", "WED", "THU", "FRI", "SAT"))},
}


class ScheduleError(ValidationError, ValueError):
    """A schedule line, schedule list or timezone was refused (code ``invalid_input``, exit 2).

    ``field`` names what is wrong (``minute``, ``day-of-week``, ``schedule``, ``schedule[2]``,
    ``schedule[2].hour``, ``timezone``); ``limit`` is the bound broken, when there is one
    (bytes, a count, or a range such as ``"0-59"``); ``message`` is ``"<field>: <detail>"``
    (the ``ValidationError`` convention) and ``detail`` the text without the field.
    """

    def __init__(self, field: str, message: str, limit: int | str | None = None) -> None:
        super().__init__(field, message, limit=limit)
        self.detail = message


class Schedule(NamedTuple):
    """One parsed schedule line.

    ``kind`` is ``"cron"``, ``"boot"`` or ``"once"``. For ``cron``, ``expr`` is the
    classic 5-field expression handed to cronsim, ``seconds`` the sorted seconds of the
    minute it fires at (the 6-field dialect's first field; ``(0,)`` for 5 fields), and ``fixed_time``
    says whether Debian's DST rule applies (see the module docstring); ``source`` is the
    line with its whitespace collapsed to single spaces (what a definition stores).
    """

    kind: Literal["cron", "boot", "once"]
    source: str
    expr: str = ""
    fixed_time: bool = False
    seconds: tuple[int, ...] = ()


class Plan(NamedTuple):
    """What ``plan_due`` decided for one Task at one wall-clock reading.

    - ``due_us``: the scheduled instant (µs, UTC) to create ONE Run for now, or None;
      its idempotency key is ``idempotency_key(task_id, due_us)``.
    - ``missed``: other instants in the same window that get no Run (coalesced into
      ``due_us`` after a clock step or a late wake-up); capped at ``MAX_MISSED_COUNT``.
    - ``last_instant_us``, ``observed_wall_us``: the new cursor to persist, in the same
      transaction as the Run.
    - ``wake_us``: the next wall-clock instant (µs) at which a Run could be due, or None
      when no clock schedule will ever fire again.
    - ``clock_back_us``: how far the wall clock went back since the last call (0 if not).
    - ``dropped_us``: the instant ``apply_catch_up`` refused a Run (too late for the Task's
      catch-up policy), else None; it is then counted in ``missed`` too.
    """

    due_us: int | None
    missed: int
    last_instant_us: int
    observed_wall_us: int
    wake_us: int | None
    clock_back_us: int
    dropped_us: int | None = None

    @property
    def missed_text(self) -> str:
        """``missed`` for the journal and events: ``"≥100"`` once the count reached its cap."""
        return f"≥{MAX_MISSED_COUNT}" if self.missed >= MAX_MISSED_COUNT else str(self.missed)


def _field_error(field: str, message: str, limit: int | str | None = None) -> ScheduleError:
    return ScheduleError(field=field, message=message, limit=limit)


def _check_value(field: str, text: str) -> int:
    lo, hi = _RANGES[field]
    names = _NAMES.get(field, {})
    if text in names:
        return names[text]
    if not text.isascii() or not text.isdigit():
        raise _field_error(field, f"{text!r} is not a number in {field}", f"{lo}-{hi}")
    value = int(text)
    if not lo <= value <= hi:
        raise _field_error(field, f"{field} {value} out of range {lo}-{hi}", f"{lo}-{hi}")
    return value


# Extensions of other cron dialects that this one does not have: refused naming the extension
# (otherwise "15W" would read as "not a number"). ``LW``, ``L``, ``nL`` and ``n#k`` are
# cronsim's and accepted where they belong.
def _extension(field: str, base: str) -> str | None:
    words = [w for w in base.split("-") if w not in _NAMES.get(field, {})]
    if field == "day-of-month" and base != "LW" and any("W" in w for w in words):
        return "W (nearest weekday) is not supported"
    if any(w == "H" or w.startswith("H(") for w in words):
        return "H (hashed value, Jenkins) is not supported; write a number"
    if field != "day-of-week" and "#" in base:
        return "'#' (nth weekday) is only for day-of-week"
    if field not in ("day-of-month", "day-of-week") and any("L" in w for w in words):
        return "L (last) is only for day-of-month and day-of-week"
    return None


def _refuse_extension(field: str, item: str) -> None:
    text = _extension(field, item.partition("/")[0])
    if text:
        raise _field_error(field, f"{text} ({field} {item!r})")


def _check_field(field: str, text: str) -> None:
    """Refuse the common misreadings with a message naming ``field``; cronsim checks the rest."""
    lo, hi = _RANGES[field]
    for item in text.split(","):
        if item == "":
            raise _field_error(field, f"empty item in {field} {text!r}")
        if "?" in item:
            raise _field_error(field, f"'?' is not supported in {field}; write '*'")
        _refuse_extension(field, item)
        base, slash, step = item.partition("/")
        if slash:
            if base == "":
                raise _field_error(
                    field, f"step '/{step}' has no range in {field}; write '*/{step}'")
            if not step.isascii() or not step.isdigit() or not 1 <= int(step) <= hi:
                raise _field_error(
                    field, f"step {step!r} in {field} must be a number 1-{hi}", f"1-{hi}")
        if base == "*":
            continue
        if field == "day-of-month" and base in ("L", "LW"):
            continue
        if field == "day-of-week" and ("#" in base or (base.endswith("L") and len(base) > 1)):
            day, _, nth = base.rstrip("L").partition("#")
            _check_value(field, day)
            if nth and not (nth.isdigit() and 1 <= int(nth) <= 5):
                raise _field_error(field, f"{base!r}: occurrence after '#' must be 1-5", "1-5")
            continue
        first, dash, last = base.partition("-")
        a = _check_value(field, first)
        if dash:
            b = _check_value(field, last)
            if b < a:
                raise _field_error(field, f"range {base} in {field} is reversed")


def parse_schedule(line: str) -> Schedule:
    """Parse one schedule line (dialect in the module docstring).

    Returns a ``Schedule``. Raises ``ScheduleError`` with ``field`` = the cron field at fault
    (``second``, ``minute``, ``hour``, ``day-of-month``, ``month``, ``day-of-week``) or
    ``schedule`` for the whole line (empty, longer than ``MAX_SCHEDULE_LINE_BYTES`` = 256
    bytes, unknown ``@`` word, not 5 or 6 fields). Source: issue 4 §2, field report F7.
    """
    if not isinstance(line, str):
        raise _field_error("schedule", "must be a string")
    size = len(line.encode("utf-8", "surrogatepass"))
    if size > MAX_SCHEDULE_LINE_BYTES:
        raise _field_error(
            "schedule", f"line is {size} bytes, longer than {MAX_SCHEDULE_LINE_BYTES}",
            MAX_SCHEDULE_LINE_BYTES)
    source = " ".join(line.split())
    if not source:
        raise _field_error("schedule", "empty schedule line")
    if source.startswith("@"):
        word = source.lower()
        if word == "@boot":
            return Schedule(kind="boot", source=word)
        if word == "@once":
            return Schedule(kind="once", source=word)
        if word == "@reboot":
            raise _field_error("schedule", "@reboot is not supported; write @boot (one Run after each service start)")
        if word.startswith("@every"):
            raise _field_error("schedule", "@every (interval) is not supported; write a cron step such as '*/5 * * * *'")
        if word not in _ALIASES:
            raise _field_error(
                "schedule", f"unknown {source!r}; use @boot, @once, "
                + ", ".join(_ALIASES) + " or 5/6 cron fields")
        source = word
        parts = _ALIASES[word].split()
    else:
        parts = source.upper().split()
    if len(parts) == 5:
        parts.insert(0, "0")
    elif len(parts) != 6:
        raise _field_error(
            "schedule", f"{len(parts)} fields; expected 5 (minute hour day-of-month month "
            "day-of-week) or 6 (second first)", "5-6")
    for field, text in zip(_FIELDS_6, parts):
        _check_field(field, text)
    expr = " ".join(parts[1:])
    try:
        CronSim(expr, datetime(2000, 1, 1))
    except CronSimError as exc:
        # cronsim's messages are "Bad <field>"; keep the field it names.
        named = str(exc).removeprefix("Bad ")
        field = named if named in _RANGES else "schedule"
        raise _field_error(field, f"{field} in {source!r} never matches or is malformed") from None
    fixed = not parts[1].startswith("*") and not parts[2].startswith("*")
    return Schedule(kind="cron", source=source, expr=expr, fixed_time=fixed, seconds=_expand_seconds(parts[0]))


def _expand_seconds(text: str) -> tuple[int, ...]:
    """The seconds a (validated) seconds field names: ``*``, ``N``, ``A-B``, with ``/STEP``."""
    out: set[int] = set()
    for term in text.split(","):
        base, _, step = term.partition("/")
        if base == "*":
            lo, hi = 0, 59
        elif "-" in base:
            lo, hi = (int(x) for x in base.split("-"))
        else:
            lo = int(base)
            hi = 59 if step else lo
        out.update(range(lo, hi + 1, int(step) if step else 1))
    return tuple(sorted(out))


def _minute_matches(expr: str, minute: datetime) -> bool:
    return next(CronSim(expr, minute - _MINUTE)) == minute


def _cron(schedule: Schedule, start: datetime, reverse: bool = False) -> Iterator[datetime]:
    """Naive local times matching ``schedule``, strictly after ``start`` (strictly before it
    with ``reverse``), at second precision.

    cronsim walks the classic five fields and we add the seconds: Debian 13 ships cronsim
    2.6, which has no seconds field, and this way every cronsim ≥ 2.6 behaves alike (it is
    only ever given minute-aligned times, where its versions agree).
    """
    secs = schedule.seconds if not reverse else tuple(reversed(schedule.seconds))
    minute = start.replace(second=0, microsecond=0)
    if _minute_matches(schedule.expr, minute):
        for sec in secs:
            t = minute + timedelta(seconds=sec)
            if (t < start) if reverse else (t > start):
                yield t
    for m in CronSim(schedule.expr, minute, reverse=reverse):
        for sec in secs:
            yield m + timedelta(seconds=sec)


def parse_schedules(lines: Sequence[str]) -> tuple[Schedule, ...]:
    """Parse all schedule lines of one Task (the task file's ``schedule`` key).

    At most ``MAX_SCHEDULES_PER_TASK`` (16) lines; ``@once`` (manual only) cannot be combined
    with other lines. Raises ``ScheduleError`` with ``field`` ``schedule`` (the list),
    ``schedule[i]`` (a whole line) or ``schedule[i].<cron field>``, i counted from 0.
    """
    if isinstance(lines, str):
        raise _field_error("schedule", "must be a list of lines, not one string")
    if not lines:
        raise _field_error("schedule", "no schedule lines; use '@once' for manual-only tasks")
    if len(lines) > MAX_SCHEDULES_PER_TASK:
        raise _field_error(
            "schedule", f"{len(lines)} schedules, more than {MAX_SCHEDULES_PER_TASK}",
            MAX_SCHEDULES_PER_TASK)
    parsed = []
    for i, line in enumerate(lines):
        try:
            parsed.append(parse_schedule(line))
        except ScheduleError as exc:
            where = f"schedule[{i}]" if exc.field == "schedule" else f"schedule[{i}].{exc.field}"
            raise ScheduleError(field=where, message=exc.detail, limit=exc.limit) from None
    if len(parsed) > 1 and any(s.kind == "once" for s in parsed):
        raise _field_error("schedule", "@once (manual only) cannot be combined with other lines")
    return tuple(parsed)


def validate_timezone(name: str) -> str:
    """Return ``name`` if it is a loadable IANA timezone key (e.g. ``Europe/Berlin``).

    Raises ``ScheduleError(field="timezone")`` for a non-string, an empty or over-long name
    (``MAX_TIMEZONE_BYTES`` = 64), a path (absolute, ``..``), a leap-second ``right/`` zone
    or an unknown key.
    """
    if not isinstance(name, str) or not name:
        raise _field_error("timezone", "must be a non-empty IANA name such as 'Europe/Berlin'")
    if len(name.encode("utf-8", "surrogatepass")) > MAX_TIMEZONE_BYTES:
        raise _field_error(
            "timezone", f"longer than {MAX_TIMEZONE_BYTES} bytes", MAX_TIMEZONE_BYTES)
    if name.startswith("right/"):
        # "right/" zones count leap seconds, which Python's datetime does not.
        raise _field_error("timezone", f"{name!r} counts leap seconds; use {name[6:]!r}")
    try:
        ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError, OSError):
        raise _field_error("timezone", f"unknown IANA timezone {name!r}") from None
    return name


def _zone(tz: str | None) -> ZoneInfo:
    return ZoneInfo(validate_timezone("UTC" if tz is None else tz))


def _from_us(us: int) -> datetime:
    return _EPOCH + timedelta(microseconds=us)


def _to_us(dt: datetime) -> int:
    return (dt - _EPOCH) // _US


def _local_to_us(naive: datetime, zone: ZoneInfo) -> int:
    """Debian mapping of a local wall time: first pass if repeated, gap end if skipped."""
    first = naive.replace(tzinfo=zone, fold=0)
    us = _to_us(first)
    if _from_us(us).astimezone(zone).replace(tzinfo=None) == naive:
        return us
    # In a gap: fold=1 reads it with the offset after the change (an instant before the
    # change), fold=0 with the offset before it (an instant after). The change lies between;
    # find its first second.
    lo = _to_us(naive.replace(tzinfo=zone, fold=1)) // _SECOND_US
    hi = us // _SECOND_US
    before = _from_us(lo * _SECOND_US).astimezone(zone).utcoffset()
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if _from_us(mid * _SECOND_US).astimezone(zone).utcoffset() == before:
            lo = mid
        else:
            hi = mid
    return hi * _SECOND_US


def _naive(us: int) -> datetime:
    return _NAIVE_EPOCH + timedelta(microseconds=us)


def _naive_us(dt: datetime) -> int:
    return (dt - _NAIVE_EPOCH) // _US


def _offset_us(zone: ZoneInfo, us: int) -> int:
    return _from_us(us).astimezone(zone).utcoffset() // _US


def _change_after(zone: ZoneInfo, start: int, end: int, offset: int) -> int | None:
    """First instant in (start, end] whose UTC offset is not ``offset`` (that of ``start``)."""
    lo = start
    while lo < end:
        hi = min(lo + _PROBE_US, end)
        if _offset_us(zone, hi) != offset:
            while hi - lo > 1:
                mid = (lo + hi) // 2
                if _offset_us(zone, mid) == offset:
                    lo = mid
                else:
                    hi = mid
            return hi
        lo = hi
    return None


def _change_before(zone: ZoneInfo, start: int, end: int, offset: int) -> int | None:
    """Last instant in [start, end) whose UTC offset is not ``offset`` (that of ``end``)."""
    hi = end
    while hi > start:
        lo = max(hi - _PROBE_US, start)
        if _offset_us(zone, lo) != offset:
            while hi - lo > 1:
                mid = (lo + hi) // 2
                if _offset_us(zone, mid) == offset:
                    hi = mid
                else:
                    lo = mid
            return lo
        hi = lo
    return None


def _next_one(schedule: Schedule, after_us: int, zone: ZoneInfo) -> int | None:
    try:
        if schedule.fixed_time:
            it = _cron(schedule, _from_us(after_us).astimezone(zone).replace(tzinfo=None))
            while True:
                us = _local_to_us(next(it), zone)
                # Candidates on the first pass of a repeated hour may lie before `after`.
                if us > after_us:
                    return us
        # Real-clock schedules: between two offset changes local time is UTC + a constant,
        # so match naive local time segment by segment. (cronsim's own zone-aware stepping
        # adds whole hours in UTC and misses matches in zones with 30-minute DST.)
        start = bound = after_us
        offset = _offset_us(zone, after_us)
        while True:
            found = _naive_us(next(_cron(schedule, _naive(bound + offset)))) - offset
            change = _change_after(zone, start, found, offset)
            if change is None:
                return found
            start, bound, offset = change, change - 1, _offset_us(zone, change)
    except (StopIteration, OverflowError):
        return None


def _prev_one(schedule: Schedule, at_us: int, zone: ZoneInfo) -> int | None:
    try:
        if schedule.fixed_time:
            now = _from_us(at_us - at_us % _SECOND_US + _SECOND_US).astimezone(zone)
            # On the second pass of a repeated hour, local times up to the end of the
            # repeated span map (first pass) to instants before `at_us`.
            start = now.replace(tzinfo=None) + (now.replace(fold=0).utcoffset() - now.utcoffset())
            it = _cron(schedule, start, reverse=True)
            while True:
                us = _local_to_us(next(it), zone)
                if us <= at_us:
                    return us
        end = bound = at_us
        offset = _offset_us(zone, at_us)
        while True:
            local = bound + offset
            top = _naive(local - local % _SECOND_US + _SECOND_US)
            found = _naive_us(next(_cron(schedule, top, reverse=True))) - offset
            change = _change_before(zone, found, end, offset)
            if change is None:
                return found
            end = bound = change
            offset = _offset_us(zone, change)
    except (StopIteration, OverflowError):
        return None


def _items(schedules: Schedule | Sequence[Schedule]) -> Sequence[Schedule]:
    # A Schedule is itself a tuple: never iterate its fields as if they were schedules.
    return (schedules,) if isinstance(schedules, Schedule) else schedules


def _merged_next(items: Sequence[Schedule], after_us: int, zone: ZoneInfo) -> int | None:
    fires = [f for s in items if s.kind == "cron"
             if (f := _next_one(s, after_us, zone)) is not None]
    return min(fires) if fires else None


def _merged_prev(items: Sequence[Schedule], at_us: int, zone: ZoneInfo) -> int | None:
    fires = [f for s in items if s.kind == "cron"
             if (f := _prev_one(s, at_us, zone)) is not None]
    return max(fires) if fires else None


def next_fire(schedule: Schedule | Sequence[Schedule], after_utc_us: int,
              tz: str | None) -> int | None:
    """Next fire instant strictly after ``after_utc_us``, in µs since the epoch (UTC).

    ``schedule`` is one ``Schedule`` or several (merged: the earliest of them). ``tz`` is an
    IANA key; None means UTC — the caller resolves a Task without a zone to the system zone
    name before calling. DST per Debian cron (module docstring). ``@boot``/``@once`` never
    fire by clock. Returns None if nothing fires in the next 50 years. Raises
    ``ScheduleError(field="timezone")`` for an unknown zone.
    """
    return _merged_next(_items(schedule), after_utc_us, _zone(tz))


def plan_due(schedules: Schedule | Sequence[Schedule], tz: str | None, last_instant_us: int | None,
             observed_wall_us: int | None, now_us: int) -> Plan:
    """Decide which scheduled instant of ONE Task gets a Run at wall-clock ``now_us`` (µs).

    The cursor (``last_instant_us``, ``observed_wall_us``) is what the previous call returned
    (None, None on a Task's first evaluation). Rules (issue 4 §2):
    - every instant <= ``last_instant_us`` is done: it is never returned again, so a backward
      clock step repeats nothing and the Task resumes once the clock passes the cursor;
    - of the instants in (``last_instant_us``, ``now_us``] only the LATEST gets a Run, the
      others are counted in ``missed``: a forward step gives at most one catch-up Run;
    - with no cursor, past instants are not fired: evaluation starts at ``now_us``;
    - an instant matched by several lines is one instant.
    Calling again with the same cursor and clock returns the same ``due_us`` (so the same
    idempotency key); calling with the returned cursor returns no Run for that instant.
    Raises ``ScheduleError(field="timezone")`` for an unknown zone.
    """
    zone = _zone(tz)
    schedules = _items(schedules)
    last = now_us if last_instant_us is None else last_instant_us
    clock_back = 0 if observed_wall_us is None else max(0, observed_wall_us - now_us)
    due = None
    missed = 0
    upcoming = _merged_next(schedules, last, zone)
    while upcoming is not None and upcoming <= now_us:
        if due is not None:
            missed += 1
        due = upcoming
        if missed == MAX_MISSED_COUNT:
            # A long forward step: jump to the latest instant instead of walking to it.
            due = _merged_prev(schedules, now_us, zone)
            upcoming = _merged_next(schedules, now_us, zone)
            break
        upcoming = _merged_next(schedules, due, zone)
    return Plan(
        due_us=due,
        missed=missed,
        last_instant_us=max(last, now_us),
        observed_wall_us=now_us,
        wake_us=upcoming,
        clock_back_us=clock_back,
    )


ON_TIME_US = 60 * _SECOND_US
"""``catch_up = "none"``: an instant is still run when the agent sees it at most this late (a
wake-up delayed by a busy loop or a clock slew), never after downtime."""


def apply_catch_up(plan: Plan, now_us: int, catch_up: str = "latest", within_us: int | None = None) -> Plan:
    """Apply a Task's catch-up policy to ``plan`` (from ``plan_due``) at ``now_us`` (µs).

    ``latest`` (the default, like systemd ``Persistent=true`` or anacron): the latest missed
    instant gets one Run however late, or only if it is at most ``within_us`` late when that
    is set (``catch_up_within_s``). ``none`` (like systemd's default ``Persistent=false``): an
    instant more than ``ON_TIME_US`` (60 s) late gets no Run. A refused instant becomes
    ``dropped_us``, is counted in ``missed``, and the cursor still moves past it (so it is
    never fired later). Pure; source: issue 12 §5.
    """
    if plan.due_us is None:
        return plan
    limit = ON_TIME_US if catch_up == "none" else within_us
    if limit is None or now_us - plan.due_us <= limit:
        return plan
    return plan._replace(due_us=None, dropped_us=plan.due_us, missed=min(plan.missed + 1, MAX_MISSED_COUNT))


def has_boot(schedules: Sequence[Schedule]) -> bool:
    """True if the Task has an ``@boot`` line: one Run after each service start (F6)."""
    return any(s.kind == "boot" for s in schedules)


def idempotency_key(task_id: str, instant_us: int) -> str:
    """Idempotency key of the scheduled Run of ``task_id`` at ``instant_us`` (µs, UTC).

    ``ql3:schedule:v1:<task_id>:<instant_us>``; the store's UNIQUE(project_id,
    idempotency_key) makes a restart or a second loop create that Run once.
    """
    return f"{IDEMPOTENCY_PREFIX}:{task_id}:{int(instant_us)}"


def boot_idempotency_key(task_id: str, service_started_us: int) -> str:
    """Idempotency key of the ``@boot`` Run of ``task_id`` for the service start at
    ``service_started_us`` (µs): ``ql3:schedule:v1:<task_id>:boot:<service_started_us>``."""
    return f"{IDEMPOTENCY_PREFIX}:{task_id}:boot:{int(service_started_us)}"
