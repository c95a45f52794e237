"""Reconnect backoff with full jitter, capped (issue 11 §1).

After the ``failures``-th consecutive failed connect, the Worker waits a delay drawn uniformly
between ``floor_s`` and ``min(cap_s, base_s · 2^(failures-1))`` ("full jitter"): a fleet that lost
its control plane at the same instant spreads its reconnects over the whole window instead of
arriving in waves, and the cap bounds how long a Worker stays away once the control plane is
back. The small floor keeps a Worker from spinning when the draw is near zero.
"""

from __future__ import annotations

DEFAULT_BASE_S = 1.0
DEFAULT_CAP_S = 60.0
DEFAULT_FLOOR_S = 0.1


def ceiling_s(failures: int, base_s: float = DEFAULT_BASE_S, cap_s: float = DEFAULT_CAP_S) -> float:
    """Upper end of the window after ``failures`` (≥ 1) consecutive failures, in seconds."""
    if failures < 1:
        raise ValueError("failures: at least 1")
    # 2**62 · base is far past any cap: stop doubling there so the float never overflows.
    return min(cap_s, base_s * 2.0 ** min(failures - 1, 62))


def reconnect_delay_s(failures: int, rand: float, base_s: float = DEFAULT_BASE_S, cap_s: float = DEFAULT_CAP_S,
                      floor_s: float = DEFAULT_FLOOR_S) -> float:
    """Seconds to wait before the next connect. ``rand`` is a uniform draw in [0, 1) from the
    caller (``random.random()``); the result lies in [floor_s, ceiling_s(failures)].

    Raises ValueError for ``failures`` < 1 or ``rand`` outside [0, 1).
    """
    if not 0.0 <= rand < 1.0:
        raise ValueError("rand: a draw in [0, 1)")
    top = ceiling_s(failures, base_s, cap_s)
    return floor_s + rand * (top - floor_s) if top > floor_s else floor_s
