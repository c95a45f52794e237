"""One time source for a cluster (issue 21 §4): a control-plane replica plans in the database's
time, not its own wall clock.

Leases, sweeps and every stored instant already come from the authority (``ql_now_us()``); the
scheduler's "is this instant due?" must too, or a replica whose clock runs ahead fires early and
the others see the schedule cursors it wrote as a clock that stepped back. ``DatabaseClock``
anchors the database's time to this process's monotonic clock at each ``sync()`` (one read of the
database clock, its round trip bounded) and extrapolates with the monotonic clock in between, so
a step of the local wall clock changes nothing. ``offset_us`` (local wall clock − database; +60 s:
this host's clock runs 60 s ahead) is what the replica reports about its own clock.

Two readings of it. ``now_us`` is the best estimate (the reading placed at the middle of its
round trip, error ≤ RTT/2 either way): what a Worker is told the server's time is.
``reached_us`` is a time the database's clock has certainly reached: the reading was taken
before the round trip ended, so it is placed at that end, and the time since is counted at the
slowest rate within ``MAX_DRIFT_PPM``. A replica plans its schedule fires on ``reached_us``: a
Run is stamped with the database's time (ADR-0376 §2: the Run's time is the server's; a
cluster scheduler fires each (Task, instant) once, ADR-0014 and its cluster note ADR-0108, on
the database's clock), so an instant planned on the estimate could be fired up to RTT/2 before
the database reached it. The store refuses such a fire anyway (``ScheduleStore.fire_schedule``
``early``); planning on ``reached_us`` keeps that refusal for a database clock that stepped back.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from .clock import now_us as wall_now_us

MAX_RTT_US = 1_000_000          # a reading whose round trip took longer is not used (error ≤ RTT/2)
SKEW_BOUND_US = 2_000_000       # a local clock further than this from the database's is reported
MAX_DRIFT_PPM = 1_000           # the monotonic clock's rate against the database's, at most (as a Worker's fence)


class DatabaseClock:
    """``DatabaseClock(read_db_us)``: ``read_db_us()`` returns the database's time (µs since the
    epoch; may raise, e.g. UnavailableError, which ``sync`` lets through). ``now_us()`` is the
    database's time as of the last good ``sync`` plus the monotonic time since; ``reached_us()``
    a database time already reached (see the module docstring); before any sync, both are the
    local wall clock."""

    def __init__(self, read_db_us: Callable[[], int], wall_us: Callable[[], int] = wall_now_us,
                 mono_ns: Callable[[], int] = time.monotonic_ns) -> None:
        self._read = read_db_us
        self._wall = wall_us
        self._mono = mono_ns
        self._anchor: tuple[int, int] | None = None     # (database µs, monotonic ns) of one instant
        self._reached: tuple[int, int] | None = None    # (database µs, monotonic ns) it was certainly reached by
        self.offset_us: int | None = None                # local wall clock − database (µs), last good sync

    def sync(self) -> bool:
        """Read the database clock once; True when the reading was used (round trip ≤
        ``MAX_RTT_US``), False when it was too slow to trust (the previous anchor stays)."""
        m0, w0 = self._mono(), self._wall()
        db = self._read()
        m1, w1 = self._mono(), self._wall()
        rtt = (m1 - m0) // 1000
        if rtt > MAX_RTT_US:
            return False
        self._anchor = (db, (m0 + m1) // 2)
        self._reached = (db, m1)
        self.offset_us = (w0 + w1) // 2 - db
        return True

    def now_us(self) -> int:
        """The database's time now (µs since the epoch), extrapolated from the last sync."""
        if self._anchor is None:
            return self._wall()
        db, mono = self._anchor
        return db + (self._mono() - mono) // 1000

    def reached_us(self) -> int:
        """A time the database's clock has reached by now (µs since the epoch; never ahead of
        it while the clock rates differ by at most ``MAX_DRIFT_PPM`` and the database's clock
        does not step back), from the last sync; behind ``now_us()`` by up to RTT/2 plus
        ``MAX_DRIFT_PPM`` of the time since."""
        if self._reached is None:
            return self._wall()
        db, mono = self._reached
        elapsed = (self._mono() - mono) // 1000
        return db + elapsed - elapsed * MAX_DRIFT_PPM // 1_000_000

    @property
    def skewed(self) -> bool:
        """True when the last good sync found the local clock more than ``SKEW_BOUND_US`` off."""
        return self.offset_us is not None and abs(self.offset_us) > SKEW_BOUND_US

    def report(self) -> dict:
        """``{"offsetS": float | None, "boundS": float, "skewed": bool}``: the local clock's
        offset from the database's (s, local − database: positive = ahead; None before a sync) and the bound."""
        return {"offsetS": None if self.offset_us is None else round(self.offset_us / 1e6, 3),
                "boundS": SKEW_BOUND_US / 1e6, "skewed": self.skewed}
