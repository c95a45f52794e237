"""systemd notification protocol (sd_notify) and the watchdog cadence.

A no-op without ``NOTIFY_SOCKET``. ``WATCHDOG=1`` is due every ``WATCHDOG_USEC / 2`` and is sent
only by the main loop after a healthy iteration; ``WATCHDOG_PID``, when set, must be ours.
Reload (``Type=notify-reload``, systemd ≥ 253): ``RELOADING=1`` with ``MONOTONIC_USEC`` on
SIGHUP, then ``READY=1`` once the configuration is applied or refused.
"""

from __future__ import annotations

import os
import time


class Notifier:
    def __init__(self) -> None:
        self.enabled = bool(os.environ.get("NOTIFY_SOCKET"))
        self._n = None
        if self.enabled:
            import sdnotify
            self._n = sdnotify.SystemdNotifier()
        wd = os.environ.get("WATCHDOG_USEC")
        wpid = os.environ.get("WATCHDOG_PID")
        self.watchdog_us: int | None = None
        if self.enabled and wd and wd.isdigit() and int(wd) > 0 and (not wpid or wpid == str(os.getpid())):
            self.watchdog_us = int(wd)
        self._last_ping_us: int | None = None
        self._status = None

    def send(self, *lines: str) -> None:
        if self._n is not None:
            self._n.notify("\n".join(lines))

    def ready(self, status: str) -> None:
        self._status = status
        self.send("READY=1", f"STATUS={status}")

    def status(self, status: str) -> None:
        """Send STATUS= only when it changed (one line, no secrets)."""
        if status != self._status:
            self._status = status
            self.send(f"STATUS={status}")

    def stopping(self) -> None:
        self.send("STOPPING=1", "STATUS=draining")

    def extend_timeout(self, usec: int) -> None:
        self.send(f"EXTEND_TIMEOUT_USEC={usec}")

    def reloading(self) -> None:
        """RELOADING=1 stamped with CLOCK_MONOTONIC in µs: systemd ends a notify-reload only on a
        RELOADING=1 whose MONOTONIC_USEC is not older than its own reload request (sd_notify(3))."""
        self._status = "reloading"
        self.send("RELOADING=1", f"MONOTONIC_USEC={time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000}",
                  "STATUS=reloading")

    def next_ping_us(self, now_us: int) -> int | None:
        """When the next WATCHDOG=1 is due (half of WATCHDOG_USEC after the last), or None."""
        if self.watchdog_us is None:
            return None
        if self._last_ping_us is None:
            return now_us
        return self._last_ping_us + self.watchdog_us // 2

    def ping_if_due(self, now_us: int) -> bool:
        due = self.next_ping_us(now_us)
        if due is None or now_us < due:
            return False
        self.send("WATCHDOG=1")
        self._last_ping_us = now_us
        return True
