"""``qlagent serve`` end to end (issue 4 §1, §2, §4, §5): journald prefixes, config, SIGHUP,
CLI-created Runs starting at once, queued Runs cancelled with their Task, exactly-once
scheduling across restarts and racing loops, and field reports F4, F6, F7.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time

import pytest


from qlcli import cli, js, ok, rows
from servehelp import NotifyListener, add_tasks, db, runs_of, start_serve
from kit import clean_env, qlagent_argv, wait_until

QUICK_STOP = "drain_grace_s = 0\nkill_grace_s = 1\n"


def _config(workdir, text, name="qlagent.toml"):
    path = os.path.join(workdir, name)
    with open(path, "w") as f:
        f.write(text)
    return path


def _live(state, task=None):
    q = ("SELECT count(*) FROM runs r JOIN tasks t USING (task_id) WHERE r.state IN ('starting','running')"
         + (" AND t.name = ?" if task else ""))
    with db(state) as c:
        return c.execute(q, (task,) if task else ()).fetchone()[0]


# ---- logging (§4) --------------------------------------------------------------------------

def _serve_stderr_to_file(state, workdir, env_extra, name):
    """The journal of a short ``serve`` whose stderr is the file ``name`` itself (not a pipe):
    ``JOURNAL_STREAM`` may name that file's device and inode."""
    path = os.path.join(workdir, name)
    with open(path, "wb") as err:
        st = os.fstat(err.fileno())
        env = clean_env(**{k: (v.format(dev=st.st_dev, ino=st.st_ino)) for k, v in env_extra.items()})
        p = subprocess.run(qlagent_argv("--state-dir", state, "serve", "--exit-after", "0.3"), env=env,
                           stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err, timeout=15)
        assert p.returncode == 0
    with open(path) as f:
        return f.read().splitlines()


def test_journald_prefixes_only_when_journal_stream_is_our_stderr(state, workdir):
    lines = _serve_stderr_to_file(state, workdir, {"JOURNAL_STREAM": "{dev}:{ino}"}, "j1")
    assert lines and all(re.match(r"<[0-7]>\S", ln) for ln in lines), lines
    assert any(ln.startswith("<6>service.ready ") for ln in lines)
    assert any(ln.startswith("<5>service.draining ") for ln in lines)
    # a JOURNAL_STREAM that names another stream (inherited by a child, say): plain lines
    plain = _serve_stderr_to_file(state, workdir, {"JOURNAL_STREAM": "1:1"}, "j2")
    plain += _serve_stderr_to_file(state, workdir, {}, "j3")
    assert plain and all(re.match(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ (INFO|NOTICE)\s", ln) for ln in plain), plain


def test_agent_stderr_never_carries_secrets_or_task_output(state, workdir):
    secret = "s3cr3t-VALUE-71d0c"
    ok(state, "secret", "set", "tok", stdin=secret.encode())
    add_tasks(state, workdir, '''
[[task]]
name = "leaky"
schedule = "@boot"
secrets = { TOK = "tok" }
shell = "/bin/sh"
script = 'echo "TASKOUT-$TOK"; echo "TASKERR-MARK" >&2; exit 4'
''')
    p = start_serve(state, "--exit-after", "1", env=clean_env())
    assert p.wait(20) == 0
    err = p.journal()
    run_id, st = runs_of(state, "leaky")[0]
    assert st == "failed"
    log = ok(state, "run", "logs", run_id).stdout.decode()
    assert "TASKOUT-" + secret in log and "TASKERR-MARK" in log     # the task did see and print it
    assert "run.failed" in err                                       # the agent did log the Run
    for needle in (secret, "TASKOUT", "TASKERR"):
        assert needle not in err, needle


# ---- config (§5) -----------------------------------------------------------------------------

def test_config_unknown_key_is_an_error_naming_the_key(state, workdir):
    bad = _config(workdir, "drain_grace_s = 3\nbogus_key = 1\n")
    p = cli(state, "--config", bad, "config", "check")
    assert p.returncode == 2 and b"bogus_key" in p.stderr and b"Traceback" not in p.stderr
    nested = _config(workdir, "[http]\nlisten_port = 80\n", "nested.toml")
    p = cli(state, "--config", nested, "config", "check")
    assert p.returncode == 2 and b"http.listen_port" in p.stderr
    wrong = _config(workdir, "drain_grace_s = 9000\n", "range.toml")
    p = cli(state, "--config", wrong, "config", "check")
    assert p.returncode == 2 and b"drain_grace_s" in p.stderr and b"600" in p.stderr
    # busy_timeout_s: 0.05..60 s, both edges accepted, one step past each refused naming the bound
    for value, good in (("0.05", True), ("60", True), ("0.049", False), ("60.5", False)):
        p = cli(state, "--config", _config(workdir, f"busy_timeout_s = {value}\n", "busy.toml"), "config", "check")
        assert (p.returncode == 0) is good, (value, p.stderr)
        if not good:
            assert b"busy_timeout_s" in p.stderr and (b"0.05" in p.stderr or b"60" in p.stderr)
            assert b"Traceback" not in p.stderr
    # serve refuses the same file before touching anything
    p = cli(state, "--config", bad, "serve", "--exit-after", "0.1")
    assert p.returncode == 2 and b"bogus_key" in p.stderr


def test_config_file_env_and_flag_precedence(state, workdir):
    a = _config(workdir, 'profile = "standalone"\ndrain_grace_s = 7\n', "a.toml")
    b = _config(workdir, 'drain_grace_s = 11\n', "b.toml")
    out = json.loads(cli(state, "--config", a, "config", "check", "--json").stdout)
    assert (out["configFile"], out["profile"], out["config"]["drain_grace_s"]) == (a, "standalone", 7)
    by_env = json.loads(cli(state, "config", "check", "--json", env={"QLAGENT_CONFIG": b}).stdout)
    assert (by_env["configFile"], by_env["config"]["drain_grace_s"]) == (b, 11)
    flag_wins = json.loads(cli(state, "--config", a, "config", "check", "--json", env={"QLAGENT_CONFIG": b}).stdout)
    assert flag_wins["configFile"] == a
    env_profile = json.loads(cli(state, "--config", a, "config", "check", "--json",
                                 env={"QLAGENT_PROFILE": "edge"}).stdout)
    assert env_profile["profile"] == "edge"
    flag_profile = json.loads(cli(state, "--config", a, "--profile", "standalone", "config", "check", "--json",
                                  env={"QLAGENT_PROFILE": "edge"}).stdout)
    assert flag_profile["profile"] == "standalone"


def test_sighup_reloads_the_config(state, workdir):
    cfg = _config(workdir, QUICK_STOP + "max_concurrent_runs = 1\n")
    add_tasks(state, workdir, '''
[[task]]
name = "a"
command = ["/bin/sleep", "30"]
[[task]]
name = "b"
command = ["/bin/sleep", "30"]
[[task]]
name = "c"
command = ["/bin/true"]
''')
    p = start_serve(state, env=clean_env(QLAGENT_CONFIG=cfg))
    try:
        ok(state, "run", "start", "a")
        wait_until(lambda: _live(state, "a") == 1)
        ok(state, "run", "start", "b")
        time.sleep(0.5)                      # b must stay queued: the limit is 1
        assert runs_of(state, "b")[0][1] == "queued"
        _config(workdir, QUICK_STOP + "max_concurrent_runs = 2\n")
        p.send_signal(signal.SIGHUP)
        wait_until(lambda: runs_of(state, "b")[0][1] == "running", timeout=5)
        # a broken file on reload: refused with the key named, the running config kept
        _config(workdir, QUICK_STOP + "max_concurent_runs = 3\n")
        p.send_signal(signal.SIGHUP)
        ok(state, "run", "start", "c")
        time.sleep(0.5)
        assert p.poll() is None and runs_of(state, "c")[0][1] == "queued"     # still limited to 2
    finally:
        assert p.stop() == 0
    err = p.journal()
    assert "config.reloaded" in err
    assert re.search(r"config.reload_failed .*max_concurent_runs", err)


def test_sighup_names_every_changed_key_that_needs_a_restart(state, workdir):
    """A reload applies what it can (drain_grace_s) and journals once, naming every changed key
    that waits for a restart, while the running listener keeps serving without /metrics."""
    http = '[http]\nlisten = "127.0.0.1:0"\n'
    cfg = _config(workdir, QUICK_STOP + http)
    p = start_serve(state, env=clean_env(QLAGENT_CONFIG=cfg))
    try:
        p.wait_line("service.ready")
        _config(workdir, "drain_grace_s = 1\nkill_grace_s = 1\n" + http)
        p.send_signal(signal.SIGHUP)
        p.wait_line("config.reloaded")
        _config(workdir, 'profile = "standalone"\n' + QUICK_STOP + '[http]\nlisten = "127.0.0.1:1"\nmetrics = true\n')
        p.send_signal(signal.SIGHUP)
        line = p.wait_line("config.reload_needs_restart")
        assert re.search(r"changed=\"?profile,http\.listen,http\.metrics\"?( |$)", line), line
        _config(workdir, QUICK_STOP + http)       # back to what runs: nothing waits any more
        p.send_signal(signal.SIGHUP)
        wait_until(lambda: p.journal().count("config.reloaded") == 2, 10, "the second config.reloaded")
    finally:
        assert p.stop() == 0
    assert p.journal().count("config.reload_needs_restart") == 1, p.journal()


def test_signals_the_agent_does_not_use_do_not_end_it(state, workdir):
    p = start_serve(state, env=clean_env(QLAGENT_CONFIG=_config(workdir, QUICK_STOP)))
    try:
        p.wait_line("service.ready")
        for sig in (signal.SIGALRM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGPIPE):
            p.send_signal(sig)
        p.send_signal(signal.SIGHUP)          # handled after them: the loop went on
        p.wait_line("config.reloaded")
        assert p.poll() is None
    finally:
        assert p.stop() == 0


def test_doctor_sees_a_serve_started_by_hand(state, workdir):
    from qlagent.adapters.budget import installed_service_cgroup
    if installed_service_cgroup() is not None:
        pytest.skip("a packaged qlagent service cgroup exists on this host")
    def budget() -> str:
        return next(c["detail"] for c in json.loads(cli(state, "doctor", "--json").stdout)["checks"]
                    if c["name"] == "budget")
    assert "service not running" in budget()
    p = start_serve(state, env=clean_env(QLAGENT_CONFIG=_config(workdir, QUICK_STOP)))
    try:
        p.wait_line("service.ready")
        line = budget()
        assert "service not running" not in line and "started by hand" in line, line
    finally:
        assert p.stop() == 0


# ---- CLI and the running service (§1, §2) ------------------------------------------------------

def test_cli_run_starts_at_once_and_cli_works_without_service(state, workdir):
    add_tasks(state, workdir, '''
[[task]]
name = "job"
schedule = "* * * * *"
command = ["/bin/sleep", "0.2"]
''')
    # no service: the CLI runs it inline
    p = cli(state, "run", "start", "job", "--wait")
    assert p.returncode == 0 and b"succeeded" in p.stdout
    cfg = _config(workdir, QUICK_STOP)
    listener = NotifyListener(workdir)
    s = start_serve(state, env=clean_env(QLAGENT_CONFIG=cfg, NOTIFY_SOCKET=listener.path))
    try:
        listener.wait_for(lambda m: m == "READY=1")
        t0 = time.monotonic()
        run_id = ok(state, "run", "start", "job").stdout.decode().strip()
        wait_until(lambda: dict(runs_of(state, "job"))[run_id] in ("running", "succeeded"), timeout=30)
        elapsed = time.monotonic() - t0
        # a poll or the next cron minute would take up to 60 s; the poke makes it ~ one CLI call
        assert elapsed < 3, elapsed
    finally:
        assert s.stop() == 0
        listener.close()


def test_disabling_or_deleting_a_task_cancels_its_queued_runs(state, workdir):
    cfg = _config(workdir, QUICK_STOP + "max_concurrent_runs = 1\n")
    add_tasks(state, workdir, '''
[[task]]
name = "blocker"
command = ["/bin/sleep", "30"]
[[task]]
name = "b"
concurrency = "parallel"
command = ["/bin/true"]
[[task]]
name = "c"
command = ["/bin/true"]
''')
    p = start_serve(state, env=clean_env(QLAGENT_CONFIG=cfg))
    try:
        ok(state, "run", "start", "blocker")
        wait_until(lambda: _live(state, "blocker") == 1)
        for t in ("b", "b", "c"):
            ok(state, "run", "start", t)
        assert [s for _, s in runs_of(state, "b") + runs_of(state, "c")] == ["queued"] * 3
        out = ok(state, "task", "disable", "b").stdout
        assert b"2 queued Runs cancelled" in out
        assert [s for _, s in runs_of(state, "b")] == ["cancelled"] * 2
        out = ok(state, "task", "rm", "c").stdout
        assert b"1 queued Run cancelled" in out
        assert [s for _, s in runs_of(state, "c")] == ["cancelled"]
        assert _live(state, "blocker") == 1             # other Tasks' Runs untouched
    finally:
        assert p.stop() == 0


# ---- exactly once (§2) -------------------------------------------------------------------------

def test_second_service_on_the_same_state_is_refused(state):
    listener = NotifyListener(os.path.dirname(state))
    first = start_serve(state, env=clean_env(NOTIFY_SOCKET=listener.path))
    try:
        listener.wait_for(lambda m: m == "READY=1")
        second = start_serve(state, env=clean_env())
        assert second.wait(15) == 5          # unavailable: the state dir is in use
        assert "service.already_running" in second.journal()
        assert first.poll() is None
    finally:
        assert first.stop() == 0
        listener.close()


def test_restart_during_due_instants_creates_each_scheduled_run_once(state, workdir):
    add_tasks(state, workdir, '''
[[task]]
name = "every"
schedule = "* * * * * *"
concurrency = "parallel"
command = ["/bin/true"]
''')
    for _ in range(3):     # killed at an arbitrary point of its second, restarted at once
        p = start_serve(state, env=clean_env())
        n = len(runs_of(state, "every"))
        wait_until(lambda: len(runs_of(state, "every")) >= n + 2, timeout=10)
        p.kill()
    with db(state) as c:
        dup = c.execute("SELECT scheduled_for_us, count(*) FROM runs WHERE trigger_type = 'cron' "
                        "GROUP BY scheduled_for_us HAVING count(*) > 1").fetchall()
        n = c.execute("SELECT count(*) FROM runs").fetchone()[0]
    assert n >= 6 and dup == []


def test_two_schedulers_on_one_database_create_an_instant_once(state, workdir):
    """The idempotency key, not the cursor, is what stops a second loop: B plans from the cursor
    A had before it fired, as a loop that read it a moment earlier would."""
    from qlagent.adapters.sqlite.store import SqliteStore
    from qlagent.service.scheduler import Scheduler
    add_tasks(state, workdir, '''
[[task]]
name = "minutely"
schedule = "* * * * *"
command = ["/bin/true"]
''')
    instant = 1_800_000_000 * 1_000_000            # a whole minute (UTC)
    now = [instant - 30_000_000]
    dbp = os.path.join(state, "qlagent.db")
    a_store, b_store = (SqliteStore(dbp, "default", clock_us=lambda: now[0]) for _ in range(2))
    try:
        a = Scheduler(a_store, "UTC", lambda: now[0])
        b = Scheduler(b_store, "UTC", lambda: now[0])
        a.reload(), b.reload()
        assert a.fire_due() == 0                         # first look: cursor only
        with db(state) as c:
            cursor = c.execute("SELECT * FROM schedule_cursors").fetchall()
        now[0] = instant + 200_000
        assert a.fire_due() == 1
        with db(state) as c:                             # B's stale view of the cursor
            c.execute("DELETE FROM schedule_cursors")
            c.executemany("INSERT INTO schedule_cursors VALUES (?, ?, ?)", cursor)
        assert b.fire_due() == 0
        assert a.fire_due() == 0 and b.fire_due() == 0
    finally:
        a_store.close()
        b_store.close()
    with db(state) as c:
        got = c.execute("SELECT scheduled_for_us, state FROM runs").fetchall()
        events = c.execute("SELECT type FROM run_events ORDER BY sequence").fetchall()
    assert got == [(instant, "queued")]
    assert [e[0] for e in events][:2] == ["run.created", "run.queued"]


# ---- field reports -----------------------------------------------------------------------------

def test_f6_boot_tasks_all_start_right_after_ready(state, workdir):
    cfg = _config(workdir, QUICK_STOP + "max_concurrent_runs = 4\n")
    add_tasks(state, workdir, "".join(f'''
[[task]]
name = "boot{i}"
schedule = "@boot"
command = ["/bin/sleep", "30"]
''' for i in range(3)))
    listener = NotifyListener(workdir)
    p = start_serve(state, env=clean_env(QLAGENT_CONFIG=cfg, NOTIFY_SOCKET=listener.path))
    try:
        listener.wait_for(lambda m: m == "READY=1")
        t0 = time.monotonic()
        wait_until(lambda: _live(state) == 3, timeout=5)
        assert time.monotonic() - t0 < 2
        with db(state) as c:
            assert c.execute("SELECT count(*) FROM runs WHERE trigger_type = 'boot'").fetchone()[0] == 3
    finally:
        assert p.stop() == 0
        listener.close()


F7_GOOD = ["9,19,29,39,49,59 * * * *", "*/10 * * * * *", "0 */5 * * * *"]
F7_BAD = [("30 5/10 * * * ?", "day-of-week"), ("/6 * * * *", "minute"), ("0 0 0 * * * *", "7 fields")]


def test_f7_cron_lines_accepted_fire_right_and_bad_ones_refused(state, workdir):
    for i, (line, field) in enumerate(F7_BAD):
        path = _config(workdir, f'[[task]]\nname = "bad{i}"\nschedule = "{line}"\ncommand = ["/bin/true"]\n',
                       f"bad{i}.toml")
        p = cli(state, "task", "add", "-f", path)
        assert p.returncode == 2 and field.encode() in p.stderr and b"schedule" in p.stderr, p.stderr
    assert rows(state, "tasks") == 0
    add_tasks(state, workdir, "".join(f'''
[[task]]
name = "good{i}"
schedule = "{line}"
concurrency = "parallel"
command = ["/bin/true"]
''' for i, line in enumerate(F7_GOOD)))

    nf0 = [_epoch(t) for t in js(state, "task", "show", "good0")["nextFires"]]
    assert all(time.gmtime(t).tm_min % 10 == 9 and time.gmtime(t).tm_sec == 0 for t in nf0)
    nf1 = [_epoch(t) for t in js(state, "task", "show", "good1")["nextFires"]]
    assert all(t % 10 == 0 for t in nf1) and nf1[1] - nf1[0] == 10       # seconds first
    nf2 = [_epoch(t) for t in js(state, "task", "show", "good2")["nextFires"]]
    assert all(t % 300 == 0 for t in nf2) and nf2[1] - nf2[0] == 300     # minute */5, second 0

    p = start_serve(state, env=clean_env())
    try:
        wait_until(lambda: runs_of(state, "good1"), timeout=12)           # every 10 s, observed
    finally:
        assert p.stop() == 0
    with db(state) as c:
        fired = c.execute("SELECT scheduled_for_us FROM runs r JOIN tasks t USING (task_id) "
                          "WHERE t.name = 'good1'").fetchall()
    assert fired and all(f % 10_000_000 == 0 for (f,) in fired)


def _epoch(iso: str) -> int:
    import calendar
    return calendar.timegm(time.strptime(iso, "%Y-%m-%dT%H:%M:%S.%fZ"))


def test_f4_single_instance_never_runs_beside_itself(state, workdir):
    add_tasks(state, workdir, '''
[[task]]
name = "f4"
schedule = "* * * * * *"
concurrency = "single"
command = ["/bin/sleep", "5"]
''')
    p = start_serve(state, env=clean_env(QLAGENT_CONFIG=_config(workdir, QUICK_STOP)))
    try:
        deadline = time.monotonic() + 7
        seen_live = set()
        while time.monotonic() < deadline:
            with db(state) as c:
                live = c.execute("SELECT count(*) FROM runs WHERE state IN ('queued','starting','running')"
                                 ).fetchone()[0]
            seen_live.add(live)
            assert live <= 1
            time.sleep(0.05)
        assert 1 in seen_live
        shown = js(state, "task", "show", "f4")
        assert shown["skippedFires"] >= 4
        # one journal line for them all: the next may come a minute after it (suppressed=N)
        assert p.journal().count("schedule.skipped") == 1, p.journal()
        # one Run finished (after 5 s), the next started; nothing else
        assert 1 <= len(runs_of(state, "f4")) <= 2
    finally:
        assert p.stop() == 0


def test_skipped_fires_are_journaled_once_a_minute_per_task_with_the_count_left_out(state, workdir):
    """A per-second single-instance Task behind a live Run: the first skip is journaled, the
    next 59 are not, the one a minute after the first line carries suppressed=59."""
    import io
    from qlagent.adapters.sqlite.store import SqliteStore
    from qlagent.service.journal import Journal
    from qlagent.service.scheduler import Scheduler
    add_tasks(state, workdir, '''
[[task]]
name = "persec"
schedule = "* * * * * *"
concurrency = "single"
command = ["/bin/sleep", "600"]
''')
    t = 1_800_000_000 * 1_000_000
    now = [t]
    journal = io.StringIO()
    store = SqliteStore(os.path.join(state, "qlagent.db"), "default", clock_us=lambda: now[0])
    try:
        s = Scheduler(store, "UTC", lambda: now[0], Journal(journal))
        s.reload()
        # The first pass records the cursor, the instant 1 s later queues the Run, and each
        # second from 2 to 62 is a skip behind it.
        for second in range(0, 63):
            now[0] = t + second * 1_000_000 + 1000
            s.fire_due()
    finally:
        store.close()
    lines = [ln for ln in journal.getvalue().splitlines() if "schedule.skipped" in ln]
    assert len(lines) == 2, lines
    assert "suppressed" not in lines[0] and "suppressed=59" in lines[1], lines
    assert js(state, "task", "show", "persec")["skippedFires"] == 61


def test_run_show_says_why_a_run_waits_behind_the_live_one(state, workdir):
    # A queued Run of a single-instance Task: `run show` names why it waits, and the line goes
    # once it can start (the live one cancelled).
    add_tasks(state, workdir, '[[task]]\nname = "solo"\ncommand = ["/bin/sleep", "60"]\n')
    p = start_serve(state, env=clean_env(QLAGENT_CONFIG=_config(workdir, QUICK_STOP)))
    try:
        first = ok(state, "run", "start", "solo").stdout.decode().strip()
        wait_until(lambda: js(state, "run", "show", first)["state"] == "running", timeout=10)
        second = ok(state, "run", "start", "solo").stdout.decode().strip()
        shown = ok(state, "run", "show", second).stdout.decode()
        assert 'waiting   for the live Run of this Task to end (concurrency = "single")' in shown, shown
        assert "waiting" not in ok(state, "run", "show", first).stdout.decode()
        ok(state, "run", "cancel", first)
        wait_until(lambda: js(state, "run", "show", second)["state"] != "queued", timeout=15)
        assert "waiting" not in ok(state, "run", "show", second).stdout.decode()
    finally:
        assert p.stop() == 0


def test_a_task_added_while_serving_is_scheduled_without_sighup(state, workdir):
    listener = NotifyListener(workdir)
    p = start_serve(state, env=clean_env(NOTIFY_SOCKET=listener.path))
    try:
        listener.wait_for(lambda m: m == "READY=1")
        add_tasks(state, workdir, '''
[[task]]
name = "late"
schedule = "* * * * * *"
concurrency = "parallel"
command = ["/bin/true"]
''')
        wait_until(lambda: len(runs_of(state, "late")) >= 2, timeout=5)
    finally:
        assert p.stop() == 0
        listener.close()


def test_clock_steps_through_the_store_cursor(state, workdir):
    """A router without RTC: the persisted cursor makes a forward jump give one catch-up Run and
    a backward jump repeat nothing — across a scheduler restart (a new Scheduler on the store)."""
    from qlagent.adapters.sqlite.store import SqliteStore
    from qlagent.service.scheduler import Scheduler
    add_tasks(state, workdir, '''
[[task]]
name = "minutely"
schedule = "* * * * *"
concurrency = "parallel"
command = ["/bin/true"]
''')
    t = 1_800_000_000 * 1_000_000
    now = [t - 1_000_000]
    dbp = os.path.join(state, "qlagent.db")

    def fire_with_new_scheduler():
        store = SqliteStore(dbp, "default", clock_us=lambda: now[0])
        try:
            s = Scheduler(store, "UTC", lambda: now[0])
            s.reload()
            return s.fire_due()
        finally:
            store.close()

    assert fire_with_new_scheduler() == 0
    now[0] = t + 600 * 1_000_000 + 5_000_000        # forward 10 minutes (a late NTP sync)
    assert fire_with_new_scheduler() == 1            # one catch-up, not ten
    now[0] = t + 100_000                             # back again, below the cursor
    assert fire_with_new_scheduler() == 0
    now[0] = t + 300 * 1_000_000 + 100_000           # instants already passed once: not repeated
    assert fire_with_new_scheduler() == 0
    now[0] = t + 660 * 1_000_000 + 100_000           # past the cursor: resumes
    assert fire_with_new_scheduler() == 1
    with db(state) as c:
        got = [r[0] for r in c.execute("SELECT scheduled_for_us FROM runs ORDER BY scheduled_for_us")]
    assert got == [t + 600 * 1_000_000, t + 660 * 1_000_000]
