"""Fleet Worker policy (issue 11 §1 and §6), pure: reconnect backoff, heartbeat cadence, lease
self-fencing. Properties are checked with hypothesis over every draw, clock offset, round trip
and clock rate the documented assumption allows."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from qlagent.core.errors import EXIT_USAGE, ValidationError
from qlagent.worker.policy import backoff, fencing, heartbeat, pacing
from qlagent.worker.policy.fencing import KEEP, RUN, STOP, Renewal

draw = st.floats(min_value=0.0, max_value=1.0, exclude_max=True)


# ---------------------------------------------------------------- reconnect backoff

def test_backoff_window_doubles_up_to_the_cap():
    assert [backoff.ceiling_s(n) for n in (1, 2, 3, 4, 6, 7, 8, 10_000)] == [1, 2, 4, 8, 32, 60, 60, 60]
    assert backoff.reconnect_delay_s(3, 0.0) == backoff.DEFAULT_FLOOR_S
    assert backoff.reconnect_delay_s(3, 0.5) == pytest.approx(0.1 + 0.5 * 3.9)
    assert backoff.reconnect_delay_s(1, 0.999999) < 1.0
    with pytest.raises(ValueError):
        backoff.reconnect_delay_s(0, 0.5)
    with pytest.raises(ValueError):
        backoff.reconnect_delay_s(1, 1.0)


@given(st.integers(1, 10**6), draw, st.floats(0.1, 10), st.floats(10, 3600))
def test_backoff_delay_always_lies_in_floor_to_capped_window(failures, rand, base, cap):
    d = backoff.reconnect_delay_s(failures, rand, base, cap)
    assert backoff.DEFAULT_FLOOR_S <= d <= min(cap, base * 2.0 ** min(failures - 1, 62))
    assert backoff.ceiling_s(failures, base, cap) <= backoff.ceiling_s(failures + 1, base, cap)


@given(st.integers(1, 64), draw, draw)
def test_backoff_is_full_jitter_monotonic_in_the_draw(failures, a, b):
    lo, hi = sorted((a, b))
    assert backoff.reconnect_delay_s(failures, lo) <= backoff.reconnect_delay_s(failures, hi)


# ---------------------------------------------------------------- heartbeat cadence

@given(st.floats(1, 600), draw, st.floats(0, 0.5))
def test_heartbeat_never_later_than_the_interval_nor_earlier_than_the_jitter_allows(interval, rand, jitter):
    d = heartbeat.heartbeat_delay_s(interval, rand, jitter)
    assert interval * (1 - jitter) - 1e-9 <= d <= interval


def test_heartbeat_cadence_must_leave_three_beats_before_the_fencing_margin():
    margin_s = fencing.margin_us(30_000_000, 5_000_000) / 1e6
    usable = 30 - margin_s
    heartbeat.check_cadence(usable / 3, 30, margin_s)               # the edge
    with pytest.raises(ValidationError) as e:
        heartbeat.check_cadence(usable / 3 + 0.001, 30, margin_s)
    assert e.value.field == "heartbeat_interval_s"
    with pytest.raises(ValidationError):
        heartbeat.check_cadence(0.999, 3600, 0)
    with pytest.raises(ValueError):
        heartbeat.heartbeat_delay_s(10, 0.5, 0.6)


# ---------------------------------------------------------------- lease self-fencing

S = 1_000_000


def test_stop_begins_a_margin_before_the_expiry_on_the_worker_clock():
    # Worker monotonic clock at 5 s; database clock 1.7e15 µs; Lease 30 s left.
    r = Renewal(sent_local_us=5 * S, server_now_us=1_700_000_000 * S, expires_at_us=1_700_000_030 * S)
    assert r.expires_at_us - r.offset_us == 35 * S       # the expiry on the Worker's clock
    stop = fencing.stop_at_local_us(r, kill_grace_us=5 * S)
    # 29 s of Lease after the 1 s safety, shrunk by 0.1 % drift, minus the 5 s kill grace.
    assert stop == 5 * S + (29 * S * 1_000_000) // 1_001_000 - 5 * S
    assert fencing.decide(stop - 1, r, "kill", 5 * S) == fencing.FenceDecision(action=RUN, stop_at_local_us=stop)
    assert fencing.decide(stop, r, "kill", 5 * S).action == STOP
    assert fencing.decide(stop, r, "keep", 5 * S).action == KEEP
    assert fencing.decide(stop - 1, r, "keep", 5 * S).action == RUN


def test_a_lease_already_past_its_margin_stops_at_once():
    r = Renewal(sent_local_us=0, server_now_us=100 * S, expires_at_us=101 * S)
    assert fencing.decide(0, r, "kill", 5 * S).action == STOP


@pytest.mark.parametrize("kw, field", [
    (dict(on_lease_loss="retry"), "on_lease_loss"), (dict(kill_grace_us=-1), "kill_grace_us"),
    (dict(kill_grace_us=300 * S + 1), "kill_grace_us"), (dict(drift_ppm=100_001), "drift_ppm"),
    (dict(safety_us=-1), "safety_us"),
])
def test_a_bad_fencing_policy_names_its_field(kw, field):
    args = dict(on_lease_loss="kill", kill_grace_us=5 * S) | kw
    with pytest.raises(ValidationError) as e:
        fencing.decide(0, Renewal(sent_local_us=0, server_now_us=0, expires_at_us=30 * S), **args)
    assert e.value.field == field
    fencing.check_policy("keep", 300 * S, 100_000, 0)                  # the edges are accepted


@given(
    sent=st.integers(0, 10**12),                     # Worker monotonic clock at send
    server_now=st.integers(10**15, 2 * 10**15),      # database clock in the answer (any offset)
    ttl=st.integers(0, 600 * S),
    rtt=st.integers(0, 30 * S),                      # the database read its clock somewhere in here
    read_at=st.floats(0, 1),
    grace=st.integers(0, 300 * S),
    ppm=st.integers(0, 100_000),
    rate=st.floats(-1, 1),                           # the real rate difference, within ±ppm
    safety=st.integers(0, 10 * S),
)
def test_a_run_stopped_on_time_is_dead_before_the_database_sees_its_lease_expire(
        sent, server_now, ttl, rtt, read_at, grace, ppm, rate, safety):
    r = Renewal(sent_local_us=sent, server_now_us=server_now, expires_at_us=server_now + ttl)
    stop = fencing.stop_at_local_us(r, grace, ppm, safety)
    # The true database clock as a function of Worker time t: it read server_now at local
    # t_read ∈ [sent, sent + rtt] and runs at (1 + rate·ppm) times the Worker's rate.
    t_read = sent + int(read_at * rtt)
    factor = 1 + rate * ppm / 1_000_000
    dead_local = stop + grace                         # the stop began at ``stop`` and took ``grace``
    db_time_when_dead = server_now + (dead_local - t_read) * factor
    assert db_time_when_dead <= r.expires_at_us - safety + 1      # +1 µs: float rounding of the model
    # And the Worker does not give up much more than needed (no drift, read at send time).
    if ppm == 0:
        assert stop == sent + ttl - safety - grace


@given(st.integers(0, 10**12), st.integers(0, 600 * S), st.integers(0, 300 * S), st.integers(-10**12, 10**12))
def test_keep_never_stops_and_kill_never_keeps(sent, ttl, grace, now):
    r = Renewal(sent_local_us=sent, server_now_us=sent + 7, expires_at_us=sent + 7 + ttl)
    assert fencing.decide(now, r, "keep", grace).action in (RUN, KEEP)
    assert fencing.decide(now, r, "kill", grace).action in (RUN, STOP)


# ---------------------------------------------------------------- grace under a Lease (core.leasefit)

@given(ttl_s=st.integers(min_value=5, max_value=3600))
def test_the_longest_grace_a_lease_holds_leaves_three_one_second_beats_and_a_ms_more_does_not(ttl_s):
    from qlagent.core import leasefit
    assert (leasefit.SAFETY_US, leasefit.DRIFT_PPM) == (fencing.DEFAULT_SAFETY_US, fencing.DEFAULT_DRIFT_PPM)
    assert (leasefit.MIN_BEATS_PER_TTL, leasefit.MIN_HEARTBEAT_S) == (heartbeat.MIN_BEATS_PER_TTL,
                                                                        heartbeat.MIN_INTERVAL_S)
    limit = leasefit.max_grace_ms(ttl_s)

    def margin_s(grace_ms: int) -> float:
        return fencing.margin_us(ttl_s * 1_000_000, grace_ms * 1000 + leasefit.KILL_REAP_US) / 1e6
    if limit >= 0:
        heartbeat.check_cadence(heartbeat.MIN_INTERVAL_S, ttl_s, margin_s(limit))
        leasefit.check_grace("grace_s", limit, ttl_s)
    with pytest.raises(ValidationError):
        heartbeat.check_cadence(heartbeat.MIN_INTERVAL_S, ttl_s, margin_s(max(limit, 0) + 1))
    with pytest.raises(ValidationError) as e:
        leasefit.check_grace("task[0].grace_s", max(limit, 0) + 1, ttl_s)
    assert e.value.field == "task[0].grace_s" and e.value.exit_code == EXIT_USAGE


def test_grace_zero_first_fits_a_six_second_lease_and_a_shorter_one_is_refused_as_the_config():
    # The least lease_ttl_s is the one grace_s = 0 fits: 5 is refused as the config, and a
    # grace refused under it never reads "0 s … (at most 0 s …)".
    from qlagent.core import leasefit
    assert leasefit.MIN_LEASE_TTL_S == 6 and leasefit.max_grace_ms(5) < 0 <= leasefit.max_grace_ms(6)
    leasefit.check_lease_ttl("cluster.lease_ttl_s", 6)                         # the limit
    leasefit.check_grace("task[0].grace_s", 0, 6)                              # grace 0 fits it
    with pytest.raises(ValidationError) as e:
        leasefit.check_lease_ttl("cluster.lease_ttl_s", 5)                     # limit − 1
    assert (e.value.field, e.value.limit) == ("cluster.lease_ttl_s", "6..3600") and "grace_s = 0" in str(e.value)
    with pytest.raises(ValidationError) as e:                                  # never "at most 0 s" for 0 s
        leasefit.check_grace("task[0].grace_s", 0, 5)
    assert "at most" not in str(e.value) and "no grace fits under 6 s" in str(e.value)


def test_the_grace_limit_shown_is_exact_never_rounded_above_the_real_one():
    # A 1007 s Lease holds 1000.995 s: the message says so, not a rounded "at most 1001 s" that
    # would itself be refused.
    from qlagent.core import leasefit
    assert leasefit.max_grace_ms(1007) == 1_000_995
    leasefit.check_grace("grace_s", 1_000_995, 1007)
    with pytest.raises(ValidationError) as e:
        leasefit.check_grace("grace_s", 1_001_000, 1007)
    assert "at most 1000.995 s" in str(e.value) and e.value.limit == 1000.995


# ---- pacing: the next Pull after one answered without an offer (never a tight loop of Pulls)

@pytest.mark.parametrize("wait_s, reason, after_s", [
    (20, None, 20.0),              # a long-poll that ran out: the next Pull goes at once
    (20, "draining", 20.0),        # answered at once: wait as long as the long-poll would have
    (20, "no_free_slot", 1.0),     # the control plane's slot count catches up with the next ACK
    (0, None, 1.0),                # no long-poll: at most one Pull a second
    (0, "draining", 1.0),
    (0.5, "unmatched", 1.0),
])
def test_the_next_pull_after_an_idle_answer_waits_out_the_long_poll(wait_s, reason, after_s):
    sent = 5_000_000
    assert pacing.next_pull_after_idle_us(sent, wait_s, reason) == sent + int(after_s * 1e6)
    assert pacing.MIN_PULL_INTERVAL_S == 1.0


def test_a_default_grace_the_lease_cannot_hold_is_said_to_be_the_default():
    """A task file naming no grace_s gets 5 s; under lease_ttl_s = 10 the refusal says it is the
    default rather than `task[0].grace_s: 5 s` for a file that sets none."""
    from qlagent.core import leasefit
    with pytest.raises(ValidationError) as e:
        leasefit.check_grace("task[0].grace_s", 5_000, 10, 5_000)
    assert str(e.value).startswith("task[0].grace_s: 5 s (the default when grace_s is not set) cannot live under "
                                   "cluster.lease_ttl_s = 10"), str(e.value)
    with pytest.raises(ValidationError) as e:
        leasefit.check_grace("task[0].grace_s", 6_000, 10, 5_000)
    assert "default" not in str(e.value)
