"""Heartbeat cadence with bounded jitter (issue 11 §1, ADR-0109 heartbeats renew Leases).

Each heartbeat waits ``interval_s · (1 - jitter · rand)``: never LATER than the interval (so the
Lease arithmetic below holds for every draw) and never earlier than ``(1 - jitter) · interval``
(so a fleet does not beat in lockstep and does not flood the control plane either).

A heartbeat renews the Session and the Leases of its running Attempts. ``check_cadence`` refuses
an interval that leaves fewer than ``MIN_BEATS_PER_TTL`` beats inside the Lease TTL once the
self-fencing margin is taken off: two consecutive lost heartbeats must not cost a healthy run.
"""

from __future__ import annotations

from ...core.errors import ValidationError

MAX_JITTER = 0.5
DEFAULT_JITTER = 0.2
MIN_BEATS_PER_TTL = 3
MIN_INTERVAL_S = 1.0


def heartbeat_delay_s(interval_s: float, rand: float, jitter: float = DEFAULT_JITTER) -> float:
    """Seconds until the next heartbeat, in [(1 - jitter) · interval_s, interval_s].

    ``rand`` is a uniform draw in [0, 1). Raises ValueError for ``rand`` outside it or
    ``jitter`` outside [0, 0.5].
    """
    if not 0.0 <= rand < 1.0:
        raise ValueError("rand: a draw in [0, 1)")
    if not 0.0 <= jitter <= MAX_JITTER:
        raise ValueError(f"jitter: 0..{MAX_JITTER}")
    return interval_s * (1.0 - jitter * rand)


def check_cadence(interval_s: float, lease_ttl_s: float, fencing_margin_s: float) -> None:
    """Raise ValidationError(field="heartbeat_interval_s") unless
    ``MIN_INTERVAL_S ≤ interval_s`` and ``MIN_BEATS_PER_TTL · interval_s ≤ lease_ttl_s - fencing_margin_s``
    (seconds; the margin is ``fencing.margin_us`` of the same Lease)."""
    if interval_s < MIN_INTERVAL_S:
        raise ValidationError("heartbeat_interval_s", "below the minimum", limit=MIN_INTERVAL_S)
    usable = lease_ttl_s - fencing_margin_s
    if MIN_BEATS_PER_TTL * interval_s > usable:
        raise ValidationError("heartbeat_interval_s",
                              f"{MIN_BEATS_PER_TTL} heartbeats must fit in the Lease TTL minus the fencing margin "
                              f"({usable:.3f} s)", limit=usable / MIN_BEATS_PER_TTL)
