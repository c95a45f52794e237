"""Placeholder until the scheduler branch lands (replaced wholesale by the `sched` branch)."""

from __future__ import annotations

import zoneinfo

from cronsim import CronSim, CronSimError
from datetime import datetime, timezone


class ScheduleError(ValueError):
    def __init__(self, field: str, message: str, limit=None):
        super().__init__(message)
        self.field = field
        self.limit = limit


class Schedule:
    def __init__(self, text: str):
        self.source = text


def parse_schedule(line: str) -> Schedule:
    text = " ".join(line.split())
    if text in ("@boot", "@once"):
        return Schedule(text)
    parts = text.split()
    if len(parts) not in (5, 6):
        raise ScheduleError("fields", f"{len(parts)} fields; expected 5 or 6 (seconds first)")
    try:
        CronSim(text, datetime(2020, 1, 1, tzinfo=timezone.utc))
    except CronSimError as e:
        raise ScheduleError("expression", str(e)) from None
    return Schedule(text)


def validate_timezone(name: str) -> str:
    try:
        zoneinfo.ZoneInfo(name)
    except Exception:
        raise ScheduleError("timezone", f"unknown IANA time zone {name!r}") from None
    return name


def next_fire(schedule: Schedule, after_utc_us: int, tz: str | None):
    if schedule.source.startswith("@"):
        return None
    z = zoneinfo.ZoneInfo(tz) if tz else timezone.utc
    start = datetime.fromtimestamp(after_utc_us / 1e6, z)
    it = CronSim(schedule.source, start)
    return int(next(it).timestamp() * 1e6)
