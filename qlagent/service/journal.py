"""One line per event on stderr; ``<N>`` syslog priority prefixes when journald reads us.

journald sets ``JOURNAL_STREAM=dev:ino`` for the stream it attached to stderr; only when that
matches fd 2 do we prefix lines with ``<N>`` so ``journalctl -p`` works. With
``QLAGENT_LOG=syslog`` (the OpenWrt init script sets it) each line goes to syslog itself, as
``daemon.<priority>`` from ``qlagent[PID]``: procd logs an instance's stderr as ``daemon.err``
whatever the line says, so an INFO line would read as an error in ``logread`` (checked against
the real procd by openwrt/gate). Otherwise lines carry a UTC timestamp and a level word. Fields are
``key=value``; callers pass identities and figures only — never secrets or task output.
"""

from __future__ import annotations

import os
import sys
import time

PRIORITIES = {"emerg": 0, "alert": 1, "crit": 2, "err": 3, "warning": 4, "notice": 5, "info": 6, "debug": 7}


def _journald_attached() -> bool:
    js = os.environ.get("JOURNAL_STREAM", "")
    try:
        dev, ino = (int(x) for x in js.split(":"))
        st = os.fstat(2)
    except (ValueError, OSError):
        return False
    return (st.st_dev, st.st_ino) == (dev, ino)


class Journal:
    def __init__(self, stream=None, min_priority: str = "info") -> None:
        self._stream = stream or sys.stderr
        self._prefix = _journald_attached()
        self._min = PRIORITIES[min_priority]
        self._syslog = None
        if stream is None and os.environ.get("QLAGENT_LOG") == "syslog":
            import syslog          # python3-light on OpenWrt

            syslog.openlog("qlagent", syslog.LOG_PID, syslog.LOG_DAEMON)
            self._syslog = syslog

    def __call__(self, priority: str, event: str, **fields) -> None:
        """Write ``event key=value …`` at ``priority`` (a key of PRIORITIES)."""
        p = PRIORITIES[priority]
        if p > self._min:
            return
        kv = " ".join(f"{k}={_fmt(v)}" for k, v in fields.items() if v is not None)
        line = f"{event} {kv}".rstrip()
        if self._syslog is not None:
            self._syslog.syslog(p, line)     # facility daemon (openlog), priority p
            return
        if self._prefix:
            out = f"<{p}>{line}\n"
        else:
            out = f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())} {priority.upper():7} {line}\n"
        try:
            self._stream.write(out)
            self._stream.flush()
        except (OSError, ValueError):
            pass            # a closed stderr must never stop the agent


def _fmt(v) -> str:
    s = str(v)
    if not s or any(ch in s for ch in " =\"\n"):
        return '"' + s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'
    return s
