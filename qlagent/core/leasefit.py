"""Can a run of a given kill grace live under a Run Lease? (issue 11 §6, ADR-0014 §5.)

A fleet Worker starts stopping a run ``fencing margin`` before its Lease runs out (qlagent/worker/policy/
fencing.py): the spec's grace + the reap allowance + the safety slack + the clock drift over the
Lease. Between two renewals it must still fit ``MIN_BEATS_PER_TTL`` heartbeats of at least
``MIN_HEARTBEAT_S`` (qlagent/worker/policy/heartbeat.py ``check_cadence``). So a Lease of ``ttl`` seconds
holds a grace of at most ``floor((ttl - SAFETY) / (1 + DRIFT)) - MIN_BEATS · MIN_HEARTBEAT - REAP``;
a longer grace is killed by its own Worker right after it starts and ends ``lost``. The control
plane does not offer such an Attempt (reported ``run.unplaceable``, reason ``grace_exceeds_lease``)
and ``task add``/``task edit`` against a ``[cluster]`` config refuse it. A Lease shorter than
``MIN_LEASE_TTL_S`` holds no grace at all, so ``cluster.lease_ttl_s`` is refused under it. The constants are the
Worker's defaults; tests/worker keeps them equal to fencing's and heartbeat's.
"""

from __future__ import annotations

from .errors import ValidationError

KILL_REAP_US = 1_000_000        # after SIGKILL: reaping the tree (added to the spec's grace)
SAFETY_US = 1_000_000           # fencing's loop scheduling and reaping slack
DRIFT_PPM = 1_000               # fencing's clock-rate bound
MIN_BEATS_PER_TTL = 3           # heartbeats that must fit between renewal and the fencing instant
MIN_HEARTBEAT_S = 1.0           # the shortest Worker heartbeat interval
MAX_LEASE_TTL_S = 3600          # ``cluster.lease_ttl_s`` ceiling (s)


def max_grace_ms(lease_ttl_s: int) -> int:
    """The longest ``grace_s`` (ms; negative when not even 0 fits) a Lease of
    ``lease_ttl_s`` seconds can hold for the fastest-beating Worker (rule above)."""
    left = (lease_ttl_s * 1_000_000 - SAFETY_US) * 1_000_000 // (1_000_000 + DRIFT_PPM)
    return (left - int(MIN_BEATS_PER_TTL * MIN_HEARTBEAT_S * 1_000_000) - KILL_REAP_US) // 1000


# The shortest Lease (s) that holds ``grace_s = 0`` (6 with the constants above): under it no Task
# could be added or placed at all, so ``cluster.lease_ttl_s`` starts here (check_lease_ttl).
MIN_LEASE_TTL_S = next(t for t in range(1, MAX_LEASE_TTL_S + 1) if max_grace_ms(t) >= 0)


def check_lease_ttl(field: str, lease_ttl_s: int) -> None:
    """Raise ValidationError naming ``field`` (``cluster.lease_ttl_s``) and the range
    ``MIN_LEASE_TTL_S..MAX_LEASE_TTL_S`` (s) when ``lease_ttl_s`` is outside it."""
    if not MIN_LEASE_TTL_S <= lease_ttl_s <= MAX_LEASE_TTL_S:
        span = f"{MIN_LEASE_TTL_S}..{MAX_LEASE_TTL_S}"
        raise ValidationError(field, f"{lease_ttl_s} outside {span} seconds (a shorter Lease cannot hold even "
                                     "grace_s = 0: the Worker's fencing margin and 3 heartbeats)", limit=span)


def _seconds(ms: int) -> str:
    """``ms`` as exact seconds (``0.995``, ``26``): never rounded up past the real limit."""
    return f"{ms / 1000:.3f}".rstrip("0").rstrip(".")


def check_grace(field: str, grace_ms: int, lease_ttl_s: int, default_ms: int | None = None) -> None:
    """Raise ValidationError naming ``field`` (a Task's ``grace_s``) and the limit (s) when a grace
    of ``grace_ms`` cannot live under a Lease of ``lease_ttl_s`` s (``cluster.lease_ttl_s``); a
    grace equal to ``default_ms`` is said to be the default (the file may not name it at all)."""
    limit = max_grace_ms(lease_ttl_s)
    if grace_ms == default_ms:
        field_note = f"{_seconds(grace_ms)} s (the default when grace_s is not set)"
    else:
        field_note = f"{_seconds(grace_ms)} s"
    if limit < 0:       # a lease_ttl_s under MIN_LEASE_TTL_S (the config refuses it): no grace at all fits
        raise ValidationError(field, f"{field_note} cannot live under cluster.lease_ttl_s = {lease_ttl_s}: "
                                     f"no grace fits under {MIN_LEASE_TTL_S} s; raise lease_ttl_s",
                              limit=f"lease_ttl_s >= {MIN_LEASE_TTL_S}")
    if grace_ms > limit:
        raise ValidationError(field, f"{field_note} cannot live under cluster.lease_ttl_s = {lease_ttl_s} "
                                     f"(at most {_seconds(limit)} s; raise lease_ttl_s or lower grace_s)",
                              limit=limit / 1000)
