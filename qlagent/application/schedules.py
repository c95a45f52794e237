"""Schedule helpers that need the host: the system time zone and upcoming fire times."""

from __future__ import annotations

import os
import zoneinfo

from ..core.clock import now_us
from ..core.models import TaskDefinition
from ..core.schedule import next_fire, parse_schedule


def system_timezone() -> str:
    """The host's IANA zone name: ``$TZ``, ``/etc/timezone``, the ``/etc/localtime`` link, else UTC.

    OpenWrt keeps a POSIX TZ string in ``/etc/TZ`` rather than a zone name; such hosts
    fall back to UTC unless tasks name their zone.
    """
    candidates = [os.environ.get("TZ", "").lstrip(":")]
    try:
        with open("/etc/timezone") as f:
            candidates.append(f.read().strip())
    except OSError:
        pass
    try:
        link = os.readlink("/etc/localtime")
        if "zoneinfo/" in link:
            candidates.append(link.split("zoneinfo/", 1)[1])
    except OSError:
        pass
    for name in candidates:
        if name:
            try:
                zoneinfo.ZoneInfo(name)
                return name
            except (zoneinfo.ZoneInfoNotFoundError, ValueError):
                continue
    return "UTC"


def upcoming(definition: TaskDefinition, count: int, after_us: int | None = None) -> list[int]:
    """The next ``count`` clock fire instants (µs, UTC) over all of a Task's schedules, merged."""
    tz = definition.timezone or system_timezone()
    cursor = now_us() if after_us is None else after_us
    scheds = [parse_schedule(s) for s in definition.schedules]
    out: list[int] = []
    while len(out) < count:
        nexts = [n for n in (next_fire(s, cursor, tz) for s in scheds) if n is not None]
        if not nexts:
            break
        cursor = min(nexts)
        out.append(cursor)
    return out
