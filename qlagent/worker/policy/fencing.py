"""Lease self-fencing (issue 11 §6): when must a Worker stop a run whose Lease it cannot renew,
so that the run is dead before the control plane may offer the Attempt again?

The control plane re-offers an Attempt only after its Run Lease expired by the DATABASE clock
(ADR-0014 §5; the sweeper reads ``now()`` of PostgreSQL). The Worker cannot read that clock; it
keeps, from its last successful renewal (the claim itself, a heartbeat answer naming the
Lease's new expiry, or the SessionGrant that adopted it after a restart), a ``Renewal``: its own
monotonic time when it SENT that request, and the database time and Lease expiry in the answer.

Clock-skew assumption (documented, and the only one):
- No assumption about the offset between the Worker's clock and the database clock: it is
  measured at each renewal (``offset_us``), and since the database read its clock AFTER the
  request was sent, anchoring at the send time can only make the Worker's estimate earlier.
- The RATE of the Worker's monotonic clock differs from the database clock's by at most
  ``drift_ppm`` (default 1000 ppm = 0.1 %; uncorrected quartz is within ~100 ppm). A router whose
  clock runs slower than that could be late; that is outside the contract.
- The control plane keeps its promise never to re-offer before expiry; the sweeper's own delay
  only adds margin.

Rule (all times µs): with ``r = expires_at - server_now`` (Lease time left at the renewal),
``stop_at = sent_local + floor((r - safety) / (1 ± drift_ppm·10⁻⁶)) - kill_grace`` (+ when
``r ≥ safety``; − otherwise, when the instant is already past). Starting the
stop at ``stop_at`` and finishing it within ``kill_grace`` (local) leaves the run dead at least
``safety`` before the expiry by the database clock, for every offset and every rate within the
bound. ``on_lease_loss = "kill"`` (default) stops there; ``"keep"`` lets the run go on
(documented at-least-once: the control plane may start a second copy) and reports the loss.
A run stopped here is never named again in a heartbeat's ``leases``: should the link come back
before the expiry, the control plane does not renew that Lease, so it runs out and the sweeper
ends the Attempt ``lost`` (docs/worker-protocol.md, heartbeat row).
"""

from __future__ import annotations

import msgspec

from ...core.errors import ValidationError

ON_LEASE_LOSS = ("kill", "keep")
DEFAULT_DRIFT_PPM = 1_000
MAX_DRIFT_PPM = 100_000
DEFAULT_SAFETY_US = 1_000_000          # loop scheduling and reaping slack
MAX_KILL_GRACE_US = 300_000_000        # SIGTERM grace + SIGKILL + reap of the process tree

RUN = "run"        # the Lease is safe: keep running, look again at ``stop_at_local_us``
STOP = "stop"      # kill: stop the whole process tree now
KEEP = "keep"      # keep: the Lease is (about to be) lost; the run goes on and the loss is reported


class Renewal(msgspec.Struct, frozen=True, kw_only=True):
    """The last successful renewal of one Run Lease.

    ``sent_local_us``: the Worker's monotonic clock (µs) when the renewing request was sent;
    ``server_now_us``/``expires_at_us``: database clock (µs since the epoch) in the answer.
    """

    sent_local_us: int
    server_now_us: int
    expires_at_us: int

    @property
    def offset_us(self) -> int:
        """Estimated database clock minus Worker clock (µs), biased so the expiry looks earlier."""
        return self.server_now_us - self.sent_local_us


class FenceDecision(msgspec.Struct, frozen=True, kw_only=True):
    action: str                 # run | stop | keep
    stop_at_local_us: int       # when the stop must begin (the Worker's monotonic clock)


def check_policy(on_lease_loss: str, kill_grace_us: int, drift_ppm: int = DEFAULT_DRIFT_PPM,
                 safety_us: int = DEFAULT_SAFETY_US) -> None:
    """Raise ValidationError naming ``on_lease_loss`` (kill|keep), ``kill_grace_us``
    (0..300 s), ``drift_ppm`` (0..100000) or ``safety_us`` (≥ 0)."""
    if on_lease_loss not in ON_LEASE_LOSS:
        raise ValidationError("on_lease_loss", f"must be one of {list(ON_LEASE_LOSS)}")
    if not isinstance(kill_grace_us, int) or not 0 <= kill_grace_us <= MAX_KILL_GRACE_US:
        raise ValidationError("kill_grace_us", "outside 0..", limit=MAX_KILL_GRACE_US)
    if not isinstance(drift_ppm, int) or not 0 <= drift_ppm <= MAX_DRIFT_PPM:
        raise ValidationError("drift_ppm", "outside 0..", limit=MAX_DRIFT_PPM)
    if not isinstance(safety_us, int) or safety_us < 0:
        raise ValidationError("safety_us", "must be ≥ 0", limit=0)


def stop_at_local_us(renewal: Renewal, kill_grace_us: int, drift_ppm: int = DEFAULT_DRIFT_PPM,
                     safety_us: int = DEFAULT_SAFETY_US) -> int:
    """The latest Worker-clock instant (µs) at which stopping the run may begin (rule above)."""
    left = renewal.expires_at_us - renewal.server_now_us - safety_us
    # Time left shrinks by the fastest rate; a deficit (the answer came with less than the safety
    # left) grows by the slowest, so the instant lies in the past and the run stops at once.
    rate = 1_000_000 + drift_ppm if left >= 0 else 1_000_000 - drift_ppm
    return renewal.sent_local_us + (left * 1_000_000) // rate - kill_grace_us


def margin_us(lease_ttl_us: int, kill_grace_us: int, drift_ppm: int = DEFAULT_DRIFT_PPM,
              safety_us: int = DEFAULT_SAFETY_US) -> int:
    """How much earlier than a Lease of ``lease_ttl_us`` the Worker starts stopping (µs): the
    ``fencing_margin`` that heartbeat cadence must leave room for."""
    r = Renewal(sent_local_us=0, server_now_us=0, expires_at_us=lease_ttl_us)
    return lease_ttl_us - stop_at_local_us(r, kill_grace_us, drift_ppm, safety_us)


def decide(now_local_us: int, renewal: Renewal, on_lease_loss: str, kill_grace_us: int,
           drift_ppm: int = DEFAULT_DRIFT_PPM, safety_us: int = DEFAULT_SAFETY_US) -> FenceDecision:
    """What to do with one running Attempt at Worker time ``now_local_us`` (monotonic, µs).

    Raises ValidationError for a bad policy (``check_policy``).
    """
    check_policy(on_lease_loss, kill_grace_us, drift_ppm, safety_us)
    stop_at = stop_at_local_us(renewal, kill_grace_us, drift_ppm, safety_us)
    if now_local_us < stop_at:
        return FenceDecision(action=RUN, stop_at_local_us=stop_at)
    return FenceDecision(action=STOP if on_lease_loss == "kill" else KEEP, stop_at_local_us=stop_at)
