"""Can a run of a given kill grace live under a Run Lease? (issue 11 §6, ADR-0014 §5.)

A fleet Worker starts stopping a run ``fencing margin`` before its Lease runs out (qlagent/worker/
fencing.py): the spec's grace + the reap allowance + the safety slack + the clock drift over the
Lease. Between two renewals it must still fit ``MIN_BEATS_PER_TTL`` heartbeats of at least
``MIN_HEARTBEAT_S`` (qlagent/worker/heartbeat.py ``check_cadence``). So a Lease of ``ttl`` seconds
holds a grace of at most ``floor((ttl - SAFETY) / (1 + DRIFT)) - MIN_BEATS · MIN_HEARTBEAT - REAP``;
a longer grace is killed by its own Worker right after it starts and ends ``lost``. The control
plane does not offer such an Attempt (reported ``run.unplaceable``, reason ``grace_exceeds_lease``)
and ``task add``/``task edit`` against a ``[cluster]`` config refuse it. The constants are the
Worker's defaults; tests/worker keeps them equal to fencing's and heartbeat's.
"""

from __future__ import annotations

from .errors import ValidationError

KILL_REAP_US = 1_000_000        # after SIGKILL: reaping the tree (added to the spec's grace)
SAFETY_US = 1_000_000           # fencing's loop scheduling and reaping slack
DRIFT_PPM = 1_000               # fencing's clock-rate bound
MIN_BEATS_PER_TTL = 3           # heartbeats that must fit between renewal and the fencing instant
MIN_HEARTBEAT_S = 1.0           # the shortest Worker heartbeat interval


def max_grace_ms(lease_ttl_s: int) -> int:
    """The longest ``grace_s`` (ms, ≥ 0 meaning "none fits" when negative) a Lease of
    ``lease_ttl_s`` seconds can hold for the fastest-beating Worker (rule above)."""
    left = (lease_ttl_s * 1_000_000 - SAFETY_US) * 1_000_000 // (1_000_000 + DRIFT_PPM)
    return (left - int(MIN_BEATS_PER_TTL * MIN_HEARTBEAT_S * 1_000_000) - KILL_REAP_US) // 1000


def check_grace(field: str, grace_ms: int, lease_ttl_s: int) -> None:
    """Raise ValidationError naming ``field`` (a Task's ``grace_s``) and the limit (s) when a grace
    of ``grace_ms`` cannot live under a Lease of ``lease_ttl_s`` s (``cluster.lease_ttl_s``)."""
    limit = max_grace_ms(lease_ttl_s)
    if grace_ms > limit:
        raise ValidationError(field, f"{grace_ms / 1000:g} s cannot live under cluster.lease_ttl_s = {lease_ttl_s} "
                                     f"(at most {max(limit, 0) / 1000:g} s; raise lease_ttl_s or lower grace_s)",
                              limit=max(limit, 0) / 1000)
