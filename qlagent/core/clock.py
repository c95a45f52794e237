"""The wall clock every layer reads: integer µs since the Unix epoch (ARCHITECTURE.md
"Conventions"). Reading the clock is not I/O; injecting another ``() -> int`` (tests, a store
that decides time) is how a caller controls it."""

from __future__ import annotations

import time


def now_us() -> int:
    """Wall-clock time in µs since the Unix epoch."""
    return time.time_ns() // 1000
