"""systemd notify protocol of ``qlagent serve`` over a real unix datagram NOTIFY_SOCKET (issue 4 §3).

READY=1 only after recovery, WATCHDOG=1 at half of WATCHDOG_USEC and never while the main loop
is wedged on the store, STATUS= one line, STOPPING=1 and a bounded drain on SIGTERM, nothing
at all without NOTIFY_SOCKET, and no pings when WATCHDOG_PID names another process.
"""

from __future__ import annotations

import os
import re
import signal
import sqlite3
import time

import pytest

from qlcli import ok
from servehelp import NotifyListener, add_tasks, db, runs_of, start_serve
from kit import clean_env, wait_until


@pytest.fixture
def listener(workdir):
    n = NotifyListener(workdir)
    yield n
    n.close()


def _env(listener, **extra):
    return clean_env(NOTIFY_SOCKET=listener.path, **extra)


def _is(prefix):
    return lambda line: line.startswith(prefix)


def test_ready_only_after_recovery_of_a_previous_agents_runs(state, workdir, listener):
    add_tasks(state, workdir, '''
[[task]]
name = "short"
command = ["/bin/sleep", "1"]
[[task]]
name = "long"
command = ["/bin/sleep", "30"]
''')
    first = start_serve(state, env=clean_env())
    try:
        ok(state, "run", "start", "short")
        ok(state, "run", "start", "long")
        wait_until(lambda: [r[1] for r in runs_of(state, "short") + runs_of(state, "long")] == ["running"] * 2)
    finally:
        first.kill()             # the agent dies; its shims live on
        first.wait()
    # "short" ends while no agent runs: its receipt waits on disk, the Run still says running.
    time.sleep(1.5)
    assert runs_of(state, "short")[0][1] == "running"

    p = start_serve(state, env=_env(listener))
    try:
        listener.wait_for(_is("READY=1"))
        # At READY the previous agent's Runs are reconciled already: the finished one ingested
        # from its receipt, the live one re-attached (counted as running in STATUS).
        assert runs_of(state, "short")[0][1] == "succeeded"
        assert runs_of(state, "long")[0][1] == "running"
        status = [m for m in listener.lines() if m.startswith("STATUS=")][0]
        assert "running=1" in status
        ok(state, "run", "cancel", runs_of(state, "long")[0][0])
        wait_until(lambda: runs_of(state, "long")[0][1] == "cancelled")
    finally:
        assert p.stop() == 0


def test_watchdog_cadence_status_line_and_sigterm(state, listener):
    p = start_serve(state, env=_env(listener, WATCHDOG_USEC=1_000_000))
    try:
        t_ready, _ = listener.wait_for(_is("READY=1"))
        listener.collect(3.0)
        pings = [t for t, m in listener.messages if m == "WATCHDOG=1" and t_ready + 0.25 <= t <= t_ready + 3.25]
        # every 0.5 s over 3 s: 6 expected; loose bounds, a cadence of 1 s or a busy loop fail
        assert 5 <= len(pings) <= 8, len(pings)
        statuses = [m for m in listener.lines() if m.startswith("STATUS=")]
        assert statuses and all("\n" not in s for s in statuses)
        assert re.match(r"STATUS=running=0 queued=0 next=\S+", statuses[-1]), statuses[-1]
        p.send_signal(signal.SIGTERM)
        listener.wait_for(_is("STOPPING=1"))
        assert p.wait(10) == 0
    finally:
        p.stop()
    assert "Traceback" not in p.journal()


def test_the_next_fire_is_in_status_right_after_ready(state, workdir, listener):
    # The Scheduler is built after READY=1 but before the loop's first wait: the next fire is
    # planned (and shown by `systemctl status`) at once, not at some later wake-up.
    add_tasks(state, workdir, '[[task]]\nname = "nightly"\nschedule = "0 3 * * *"\ntimezone = "UTC"\n'
                              'command = ["/bin/true"]\n')
    p = start_serve(state, env=_env(listener, WATCHDOG_USEC=120_000_000))
    try:
        t_ready, _ = listener.wait_for(_is("READY=1"))
        t_status, _ = listener.wait_for(_is("STATUS=running=0 queued=0 next=03:00:00Z"))
        assert t_status - t_ready < 5
    finally:
        assert p.stop() == 0


def test_no_watchdog_while_the_store_is_wedged(state, workdir, listener):
    # An every-second single-instance Task whose Run stays live: each second the loop writes
    # (skipped fire + schedule cursor), so a held write lock wedges the loop's store operation.
    add_tasks(state, workdir, '''
[[task]]
name = "tick"
schedule = "* * * * * *"
concurrency = "single"
command = ["/bin/sleep", "60"]
''')
    cfg = os.path.join(workdir, "qlagent.toml")
    with open(cfg, "w") as f:
        f.write("drain_grace_s = 0\nkill_grace_s = 1\n")
    p = start_serve(state, env=_env(listener, WATCHDOG_USEC=1_000_000, QLAGENT_CONFIG=cfg))
    try:
        listener.wait_for(_is("READY=1"))
        wait_until(lambda: runs_of(state, "tick") and runs_of(state, "tick")[0][1] == "running")
        listener.wait_for(lambda m: m == "WATCHDOG=1")
        # A write lock held past the store's busy_timeout (5 s) wedges the loop's next write.
        c = sqlite3.connect(os.path.join(state, "qlagent.db"), isolation_level=None, timeout=10)
        c.execute("BEGIN IMMEDIATE")
        locked_at = time.monotonic()
        listener.collect(7.0)
        c.execute("ROLLBACK")
        c.close()
        released_at = time.monotonic()
        # the wedge starts at the next second boundary (≤ 1 s) and lasts until the release
        during = [t for t, m in listener.messages if m == "WATCHDOG=1" and locked_at + 1.6 < t < released_at]
        assert during == [], f"{len(during)} pings while the loop was wedged"
        # the loop recovers once the store answers again, and pings resume
        listener.collect(1.5)
        assert [t for t, m in listener.messages if m == "WATCHDOG=1" and t > released_at]
        assert p.poll() is None
    finally:
        assert p.stop() == 0
    err = p.journal()
    assert "store.busy" in err and "Traceback" not in err


def test_drain_gives_live_runs_their_grace_then_cancels(state, workdir, listener):
    cfg = os.path.join(workdir, "qlagent.toml")
    with open(cfg, "w") as f:
        f.write("drain_grace_s = 2\nkill_grace_s = 1\n")
    add_tasks(state, workdir, '''
[[task]]
name = "stubborn"
shell = "/bin/sh"
script = "trap '' TERM INT; while :; do sleep 1; done"
[[task]]
name = "quick"
command = ["/bin/sleep", "1"]
''')
    p = start_serve(state, env=_env(listener, QLAGENT_CONFIG=cfg))
    try:
        listener.wait_for(_is("READY=1"))
        ok(state, "run", "start", "stubborn")
        ok(state, "run", "start", "quick")
        wait_until(lambda: [r[1] for r in runs_of(state, "stubborn") + runs_of(state, "quick")] == ["running"] * 2)
        t0 = time.monotonic()
        p.send_signal(signal.SIGTERM)
        listener.wait_for(_is("STOPPING=1"))
        _, ext = listener.wait_for(_is("EXTEND_TIMEOUT_USEC="))
        assert int(ext.split("=")[1]) >= 2_000_000          # at least the grace is asked for
        # inside the grace a live Run is left alone: the quick one finishes normally
        wait_until(lambda: runs_of(state, "quick")[0][1] == "succeeded", timeout=1.8)
        assert runs_of(state, "stubborn")[0][1] == "running"
        assert p.wait(2 + 1 + 4) == 0                         # grace + kill grace + a little
        elapsed = time.monotonic() - t0
        assert elapsed >= 1.9, elapsed                        # it did wait out the grace
    finally:
        p.stop()
    assert runs_of(state, "stubborn")[0][1] == "cancelled"
    with db(state) as c:
        assert c.execute("SELECT count(*) FROM runs WHERE state IN ('queued','starting','running')").fetchone()[0] == 0


def test_without_notify_socket_nothing_is_sent_and_serve_works(state, workdir, listener):
    add_tasks(state, workdir, '''
[[task]]
name = "boot"
schedule = "@boot"
command = ["/bin/true"]
''')
    p = start_serve(state, "--exit-after", "1.5", env=clean_env(WATCHDOG_USEC=100_000))
    assert p.wait(15) == 0
    listener.collect(0.2)
    assert listener.messages == []
    assert runs_of(state, "boot")[0][1] == "succeeded"


def test_watchdog_pid_of_another_process_disables_pings(state, listener):
    p = start_serve(state, env=_env(listener, WATCHDOG_USEC=200_000, WATCHDOG_PID=1))
    try:
        listener.wait_for(_is("READY=1"))
        listener.collect(1.5)
        assert "WATCHDOG=1" not in listener.lines()
    finally:
        assert p.stop() == 0


def test_sighup_reload_protocol_good_and_refused_file(state, workdir, listener):
    """Type=notify-reload (issue 13 §4): on SIGHUP RELOADING=1 with MONOTONIC_USEC (CLOCK_MONOTONIC µs,
    taken after the signal was sent), then READY=1 once the file is applied -- and also when it is
    refused, so that systemd leaves the reloading state; the refusal names the field and the agent
    keeps running with the configuration it had."""
    cfg = os.path.join(workdir, "qlagent.toml")

    def reload_with(text):
        with open(cfg, "w") as f:
            f.write(text)
        seen = len(listener.messages)
        sent_us = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
        p.send_signal(signal.SIGHUP)
        wait_until(lambda: "READY=1" in [m for _, m in listener.messages[seen:]], timeout=10)
        after = [m for _, m in listener.messages[seen:]]
        stamp = next(int(m.split("=", 1)[1]) for m in after if m.startswith("MONOTONIC_USEC="))
        assert after.index("RELOADING=1") < after.index("READY=1")
        assert sent_us <= stamp <= time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
        assert "STATUS=reloading" in after

    with open(cfg, "w") as f:
        f.write("drain_grace_s = 0\n")
    p = start_serve(state, env=_env(listener, QLAGENT_CONFIG=cfg))
    try:
        listener.wait_for(_is("READY=1"))
        reload_with("drain_grace_s = 1\n")
        reload_with("drain_grace_s = 9999\n")
        assert p.poll() is None
    finally:
        assert p.stop() == 0
    err = p.journal()
    assert "config.reloaded" in err
    assert re.search(r"config.reload_failed .*drain_grace_s: 9999.0 outside 0..600", err), err
