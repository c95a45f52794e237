"""A journal line limiter: at most N lines of one kind per window, the rest counted.

A condition that repeats (refused requests, a credential the control plane no longer takes)
would otherwise fill the journal with one line per retry. Pure: the caller passes its clock.
"""

from __future__ import annotations


class LineLimit:
    """At most ``lines`` lines per ``window`` (in the unit of the caller's monotonic clock: s,
    µs). ``admit(now)`` (that clock) returns
    None when the line is to be left out (it is counted), else how many were left out since the
    last admitted line (0: none), to be said on this one (``suppressed=N``). A window starts at
    construction and again at the first line after it ended."""

    def __init__(self, lines: int, window: float, now: float) -> None:
        self.lines, self.window = lines, window
        self._window, self._count, self._suppressed = now, 0, 0

    def admit(self, now: float) -> int | None:
        if now - self._window >= self.window:
            self._window, self._count = now, 0
        if self._count >= self.lines:
            self._suppressed += 1
            return None
        self._count += 1
        suppressed, self._suppressed = self._suppressed, 0
        return suppressed
