"""When the next Pull may go after one answered without an offer (ADR-0108 long-poll; issue 11 §2).

A long-poll that ran its ``pull_wait_s`` out may be followed at once: the control plane did the
waiting. An answer that came sooner — a drained Worker (``draining``), ``no_free_slot``, or every
idle answer when ``pull_wait_s`` is 0 — must not turn the Worker's loop into a stream of Pulls
(a drained Worker sent ~170 a second before this rule). So the next Pull waits until the
long-poll would have ended, and never comes less than ``MIN_PULL_INTERVAL_S`` after the last
one was sent. ``no_free_slot`` waits only that minimum: the control plane's count of the
Worker's slots catches up as soon as its last ACK is applied.
"""

from __future__ import annotations

MIN_PULL_INTERVAL_S = 1.0


def next_pull_after_idle_us(sent_us: int, pull_wait_s: float, reason: str | None) -> int:
    """The earliest instant (Worker monotonic µs) of the next Pull after the one sent at
    ``sent_us`` was answered ``idle``/``unmatched`` with ``reason`` (None, ``draining``,
    ``no_free_slot`` …); ``pull_wait_s`` is the long-poll the Worker asks for (seconds)."""
    wait_s = MIN_PULL_INTERVAL_S if reason == "no_free_slot" else max(MIN_PULL_INTERVAL_S, pull_wait_s)
    return sent_us + int(wait_s * 1_000_000)
