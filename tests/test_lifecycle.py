"""Run lifecycle end to end through a real ``qlagent serve`` subprocess (or ``run start --wait``)
with real shim processes, FIFOs and log files (issue 3 items 4-6 and its acceptance).

Covers every router-task fixture (examples/router-tasks.toml), field reports F1 (log quota and
retention), F2 (cancel kills every process of the run), F3 (timeout on every start path),
F5 (agent SIGKILLed mid-run: the task and its log carry on; after restart the real exit status
from the receipt, or a re-attach; no second spawn; nothing left running), F9 (1 MiB line
byte-exact), the retry policy, single-instance and global concurrency, and per-run figures.
Durations are asserted only as behaviour bounds (≈ timeout + grace, never the task's 30 s).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import tomllib

import psutil
import pytest
from execkit import REPO, Agent, file_bytes_under, procs_with_env, task

from qlagent.adapters import processes
from qlagent.core.profiles import EDGE, MiB
from kit import qlagent_argv, scratch_dir, wait_until

GRACE_S = 1


@pytest.fixture
def root():
    d = scratch_dir("qlagent-life-")
    yield d
    shutil.rmtree(d, ignore_errors=True)


def secs(a) -> float:
    return (a["ended_at_us"] - a["started_at_us"]) / 1e6


def log_bytes(a: Agent, run_id: str) -> bytes:
    return a.cli("run", "logs", run_id).stdout


def none_left(run_id: str) -> None:
    left = procs_with_env("QL3_RUN_ID", run_id)
    for p in left:
        p.kill()
    assert left == [], [(p.pid, p.cmdline()) for p in left]


def event(a: Agent, run_id: str, type_: str):
    with a.db() as c:
        return c.execute("SELECT * FROM run_events WHERE run_id = ? AND type = ? ORDER BY sequence",
                         (run_id, type_)).fetchall()


def router_tasks(root: str) -> list[dict]:
    """examples/router-tasks.toml as shipped, with test-sized grace, a private backup dir and
    manual starts (the test starts every task by hand; cron firing is tested elsewhere)."""
    with open(os.path.join(REPO, "examples", "router-tasks.toml"), "rb") as f:
        tasks = tomllib.load(f)["task"]
    conf = os.path.join(root, "conf")
    os.makedirs(conf)
    with open(os.path.join(conf, "network"), "w") as f:
        f.write("config interface 'lan'\n")
    for t in tasks:
        t["grace_s"] = GRACE_S
        t["schedule"] = "@once"
        if t["name"] == "backup-config":
            t["env"] = {"BACKUP_DIR": os.path.join(root, "backup"), "CONFIG_DIR": conf}
    return tasks


def default_route_iface() -> str | None:
    with open("/proc/net/route") as f:
        next(f)
        for line in f:
            iface, dest, _gw, flags = line.split()[:4]
            if dest == "00000000" and int(flags, 16) & 0x2:
                return iface
    return None


def test_router_tasks_behave_as_their_readme_says(root):
    a = Agent(root, config="max_concurrent_runs = 8\n")
    a.add(*router_tasks(root))
    token = b"ddns-T0KEN-0f3a9c2b"
    a.cli("secret", "set", "ddns_token", stdin=token)
    a.serve()
    try:
        ids = {n: a.start(n) for n in ("heartbeat", "backup-config", "wan-check", "ddns-update", "chatty",
                                       "no-newline", "hang", "fail")}
        slow1 = a.start("slow")
        a.wait(slow1, ("running",))
        slow2 = a.start("slow")
        spawn = a.start("spawn-tree")
        ended = {n: a.wait(r) for n, r in ids.items()}
        # slow: single instance; the second Run waits while the first lives.
        assert a.run(slow1)["state"] == "running" and a.run(slow2)["state"] == "queued"
        a.wait(spawn, ("running",))
        assert b"spawned" in log_bytes(a, spawn)
        a.cli("run", "cancel", spawn)
        a.cli("run", "cancel", slow1)
        assert a.wait(spawn)["state"] == "cancelled"
        assert a.wait(slow1)["state"] == "cancelled"
        a.wait(slow2, ("running",))
        assert a.run(slow1)["ended_at_us"] <= a.attempts(slow2)[0]["started_at_us"]
        a.cli("run", "cancel", slow2)
        assert a.wait(slow2)["state"] == "cancelled"
        logs = {n: log_bytes(a, r) for n, r in ids.items()}
    finally:
        assert a.stop() == 0
    state = {n: r["state"] for n, r in ended.items()}
    assert state == {"heartbeat": "succeeded", "backup-config": "succeeded", "wan-check": "succeeded",
                     "ddns-update": "succeeded", "chatty": "succeeded", "no-newline": "succeeded",
                     "hang": "timed_out", "fail": "failed"}
    # heartbeat: a timestamp and the load, a small log.
    assert logs["heartbeat"].startswith(b"heartbeat 20") and b"load=" in logs["heartbeat"]
    assert len(logs["heartbeat"]) < 200
    # backup-config: an archive of CONFIG_DIR in BACKUP_DIR.
    (archive,) = os.listdir(os.path.join(root, "backup"))
    assert subprocess.run(["tar", "-tzf", os.path.join(root, "backup", archive)], capture_output=True,
                          check=True).stdout.split() == [b"./", b"./network"]
    # wan-check: JSON naming the interface of the default route.
    assert json.loads(logs["wan-check"])["default_route"]["interface"] == default_route_iface()
    # ddns-update: only the token's length is printed; the token is nowhere in the agent's files.
    assert logs["ddns-update"].startswith(f"ddns: token present ({len(token)} chars)".encode())
    assert token not in file_bytes_under(a.state) + a.journal()
    # chatty on edge: exactly the quota, one truncation fact, exit code 0.
    assert len(logs["chatty"]) == EDGE.log_max_bytes == 4194304
    assert logs["chatty"].startswith(b"line 0 0123456789")
    (fact,) = a.truncations(ids["chatty"])
    assert (fact["quota_bytes"], fact["bytes_kept"]) == (4194304, 4194304) and fact["bytes_dropped"] > 5 * MiB
    assert ended["chatty"]["exit_code"] == 0
    # no-newline (F9): one 1 MiB line, byte-exact, read back through `run logs`.
    assert logs["no-newline"] == b"x" * 1048576 and a.truncations(ids["no-newline"]) == []
    # hang: timed out within timeout + grace (it ignores TERM, so SIGKILL after the grace).
    h = a.attempts(ids["hang"])[0]
    assert 2.0 <= secs(h) <= 2 + GRACE_S + 1.5, secs(h)
    # fail: exit code 3 recorded.
    assert (ended["fail"]["exit_code"], a.attempts(ids["fail"])[0]["exit_code"]) == (3, 3)
    for r in (*ids.values(), spawn, slow1, slow2):
        none_left(r)


NETNS = f"qltest-wan-{os.getpid()}"


@pytest.fixture
def netns():
    subprocess.run(["ip", "netns", "del", NETNS], capture_output=True)
    if subprocess.run(["ip", "netns", "add", NETNS], capture_output=True).returncode != 0:
        pytest.skip("cannot create a network namespace here")
    subprocess.run(["ip", "netns", "exec", NETNS, "ip", "link", "set", "lo", "up"], check=True)
    yield NETNS
    subprocess.run(["ip", "netns", "del", NETNS], capture_output=True)


def test_wan_check_does_not_start_without_a_default_route(root, netns):
    a = Agent(root)
    a.add(*[t for t in router_tasks(root) if t["name"] == "wan-check"])
    a.serve(prefix=("ip", "netns", "exec", netns))
    try:
        rid = a.start("wan-check")
        a.poke()
        time.sleep(1.0)   # nothing to await: the point is that no event happens
        assert a.run(rid)["state"] == "queued" and event(a, rid, "run.starting") == []
        for cmd in ("link add wan0 type veth peer name wan1", "addr add 10.9.0.2/24 dev wan0", "link set wan0 up",
                    "link set wan1 up", "route add default via 10.9.0.1 dev wan0"):
            subprocess.run(["ip", "netns", "exec", netns, "ip", *cmd.split()], check=True)
        assert a.wait(rid, timeout_s=10)["state"] == "succeeded"     # the netlink event wakes it
        assert json.loads(log_bytes(a, rid))["default_route"] == {"interface": "wan0", "gateway": "10.9.0.1"}
    finally:
        assert a.stop() == 0


def test_f1_yes_is_cut_at_exactly_4_mib_and_ends_timed_out(root):
    a = Agent(root)
    a.add(task("yes", command=["/usr/bin/yes", "0123456789abcdef"], timeout_s=1.5))
    a.serve()
    try:
        rid = a.start("yes")
        run = a.wait(rid)
    finally:
        assert a.stop() == 0
    assert run["state"] == "timed_out"
    (att,) = a.attempts(rid)
    assert os.path.getsize(att["artifact_path"]) == 4194304
    with open(att["artifact_path"], "rb") as f:
        assert f.read(34) == b"0123456789abcdef\n0123456789abcdef\n"
    (fact,) = a.truncations(rid)
    assert (fact["quota_bytes"], fact["bytes_kept"]) == (4194304, 4194304)
    assert att["bytes_dropped"] > 0 and att["bytes_kept"] == 4194304
    assert secs(att) <= 1.5 + GRACE_S + 1.5
    none_left(rid)


def test_f1_retention_keeps_the_log_folder_bounded(root):
    """F1 asks for 1000 per-minute runs; 15 short runs prove the same bound (each is a real
    process tree, and the rule is a count per Task, so any count above it shows the pruning)."""
    a = Agent(root, config="[retention]\nkeep_per_task = 3\n")
    a.add(task("hi", "echo hi\n", concurrency="parallel"))
    a.serve()
    try:
        from qlagent.application.runs import RunService
        from qlagent.adapters.sqlite.store import SqliteStore
        other = SqliteStore(os.path.join(a.state, "qlagent.db"))    # a second writer, like the CLI
        ids = [RunService(other).start("hi").run_id for _ in range(15)]
        other.close()
        a.poke()
        for r in ids:
            assert a.wait(r)["state"] == "succeeded"
        a.wait(ids[-1])
    finally:
        assert a.stop() == 0
    logs = [f for d, _, fs in os.walk(os.path.join(a.state, "artifacts")) for f in fs]
    assert len(logs) == 3
    with a.db() as c:
        kept = c.execute("SELECT count(*) FROM attempts WHERE artifact_path IS NOT NULL").fetchone()[0]
    assert kept == 3
    assert log_bytes(a, ids[-1]) == b"hi\n"


def test_f2_cancel_leaves_no_process_of_the_run(root):
    a = Agent(root)
    a.add(task("tree", command=["/bin/sh", "-c", "sleep 300 & setsid sleep 301 & sleep 302; wait"],
               timeout_s=60),
          task("stubborn", command=["/bin/sh", "-c", "trap '' INT TERM; sleep 300 & setsid sleep 301 & "
                                    "sleep 302; wait"], timeout_s=60))
    a.serve()
    try:
        ids = [a.start("tree"), a.start("stubborn")]
        for r in ids:
            a.wait(r, ("running",))
            wait_until(lambda: len(procs_with_env("QL3_RUN_ID", r)) >= 4, 5, "sh and its three sleeps")
        for r in ids:
            a.cli("run", "cancel", r)
        runs = [a.wait(r) for r in ids]
    finally:
        assert a.stop() == 0
    for r, run in zip(ids, runs):
        assert run["state"] == "cancelled"
        asked = event(a, r, "run.cancel_requested")[0]["created_at_us"]
        done = event(a, r, "run.cancelled")[0]["created_at_us"]
        assert (done - asked) / 1e6 <= GRACE_S + 1.0, (done - asked) / 1e6
        none_left(r)


def test_f2_shim_killed_leaves_no_process_of_the_run(root):
    """The shim itself is killed (an OOM kill on a router): the Run ends lost and
    every process it started — the setsid grandchild that lost its parent too — is stopped."""
    a = Agent(root)
    a.add(task("tree", command=["/bin/sh", "-c", "sleep 300 & setsid sleep 301 & sleep 302; wait"],
               timeout_s=60))
    a.serve()
    try:
        r = a.start("tree")
        a.wait(r, ("running",))
        wait_until(lambda: len(procs_with_env("QL3_RUN_ID", r)) >= 4, 5, "sh and its three sleeps")
        with a.db() as c:
            shim = c.execute("SELECT shim_pid FROM attempts WHERE run_id = ?", (r,)).fetchone()[0]
        os.kill(shim, signal.SIGKILL)
        run = a.wait(r)
    finally:
        assert a.stop() == 0
    assert run["state"] == "lost"
    none_left(r)


def test_f3_timeout_holds_on_schedule_by_hand_and_inline(root):
    script = ["/bin/sh", "-c", "trap '' INT TERM; sleep 30"]
    a = Agent(root)
    a.add(task("f3cron", command=script, timeout_s=2, schedule="* * * * * *"),
          task("f3hand", command=script, timeout_s=2))
    a.serve()
    try:
        hand = a.start("f3hand")

        def fired():
            with a.db() as c:
                return c.execute("SELECT r.run_id FROM runs r JOIN tasks t USING (task_id) WHERE t.name = 'f3cron' "
                                 "ORDER BY r.created_at_us LIMIT 1").fetchone()
        row = wait_until(fired, 5, "a fire of the every-second schedule", step=0.05)
        cron = row[0]
        runs = {"cron": a.wait(cron), "hand": a.wait(hand)}
        a.cli("task", "disable", "f3cron")
    finally:
        assert a.stop() == 0
    # Third path: `run start --wait` with no service, the CLI's inline engine.
    p = a.cli("run", "start", "f3hand", "--wait", check=False)
    assert p.returncode == 6 and b"timed_out" in p.stdout
    inline = p.stdout.split()[0].decode()
    runs["inline"] = a.run(inline)
    for path, run in runs.items():
        assert run["state"] == "timed_out", path
        (att,) = a.attempts(run["run_id"])
        assert 2.0 <= secs(att) <= 2 + GRACE_S + 1.5, (path, secs(att))
        assert att["exit_signal"] == signal.SIGKILL, (path, dict(att))
        none_left(run["run_id"])
    assert runs["cron"]["trigger_type"] == "cron" and runs["hand"]["trigger_type"] != "cron"


def spawns(root: str) -> list[str]:
    try:
        with open(os.path.join(root, "spawns")) as f:
            return f.read().split()
    except FileNotFoundError:
        return []


def test_f5_agent_killed_mid_run_log_keeps_filling_and_receipt_gives_real_exit(root):
    a = Agent(root)
    # ~6 MB in 100 kB steps over ~1.5 s, then exit 7: the log reaches the 4 MiB quota with no agent.
    a.add(task("chatty", f'echo "$QL3_ATTEMPT_ID" >> {root}/spawns\n'
                         "i=0; while [ $i -lt 60 ]; do head -c 100000 /dev/zero | tr '\\0' a; sleep 0.025; "
                         "i=$((i+1)); done; exit 7\n", timeout_s=30))
    a.serve()
    rid = a.start("chatty")
    a.wait(rid, ("running",))
    att = a.attempts(rid)[0]
    wait_until(lambda: os.path.getsize(att["artifact_path"]) > 0, 5, "the first log bytes", step=0.01)
    a.kill()                                                   # SIGKILL the agent
    at_kill = os.path.getsize(att["artifact_path"])
    assert at_kill < 4194304
    shim = psutil.Process(att["shim_pid"])
    wait_until(lambda: not shim.is_running() or shim.status() == psutil.STATUS_ZOMBIE, 10,
               "the shim's end (its task ends on its own)", step=0.05)
    assert os.path.getsize(att["artifact_path"]) == 4194304    # it kept filling, up to the quota
    assert a.run(rid)["state"] == "running"                    # nobody has told the store yet
    a.serve()
    try:
        run = a.wait(rid)
    finally:
        assert a.stop() == 0
    assert (run["state"], run["exit_code"]) == ("failed", 7)   # the REAL exit status, from the receipt
    assert len(a.attempts(rid)) == 1 and spawns(root) == [att["attempt_id"]]
    (fact,) = a.truncations(rid)
    assert fact["bytes_kept"] == 4194304
    none_left(rid)


def test_f5_agent_killed_then_restarted_reattaches_a_live_task(root):
    a = Agent(root)
    a.add(task("sleepy", f'echo "$QL3_ATTEMPT_ID" >> {root}/spawns\nsleep 1.5\nexit 5\n', timeout_s=30))
    a.serve()
    rid = a.start("sleepy")
    a.wait(rid, ("running",))
    a.kill()
    a.serve()                                                  # while the task still sleeps
    try:
        assert b"service.ready" in a.journal()
        run = a.wait(rid)
    finally:
        assert a.stop() == 0
    assert (run["state"], run["exit_code"]) == ("failed", 5)
    assert len(a.attempts(rid)) == 1 and len(spawns(root)) == 1
    none_left(rid)


def test_f5_shim_gone_without_receipt_ends_lost_and_kills_the_orphan(root):
    """Agent SIGKILLed and the shim killed too (no receipt will ever come): after restart the
    Run ends ``lost`` and the task the shim left behind is killed — nothing runs forever."""
    a = Agent(root)
    a.add(task("orphan", "sleep 60\n", timeout_s=120))
    a.serve()
    rid = a.start("orphan")
    a.wait(rid, ("running",))
    wait_until(lambda: procs_with_env("QL3_RUN_ID", rid), 5, "the task's process")
    a.kill()
    os.kill(a.attempts(rid)[0]["shim_pid"], signal.SIGKILL)
    assert procs_with_env("QL3_RUN_ID", rid)                   # the task is still there
    a.serve()
    try:
        run = a.wait(rid)
    finally:
        assert a.stop() == 0
    assert run["state"] == "lost"
    assert f"run.lost run={rid} attempt={a.attempts(rid)[0]['attempt_id']} reason=agent_restart".encode() in a.journal()
    wait_until(lambda: not procs_with_env("QL3_RUN_ID", rid), 3, "recovery to stop the orphaned task", step=0.05)


def test_a_task_left_behind_is_stopped_by_an_agent_started_on_a_wiped_state_dir(root):
    """Issue #20 point 3: agent and shim SIGKILLed, then the state directory lost (a reflashed
    overlay): the task's leader dies with its shim, and what it forked is found by the next
    agent on the empty state directory and stopped; nothing of the old run keeps running."""
    a = Agent(root)
    a.add(task("sleepy", "sleep 120\necho never\n", timeout_s=300))
    a.serve()
    rid = a.start("sleepy")
    a.wait(rid, ("running",))
    att = a.attempts(rid)[0]
    wait_until(lambda: len(procs_with_env("QL3_RUN_ID", rid)) >= 2, 5, "the shell and its sleep")
    a.kill()
    os.kill(att["shim_pid"], signal.SIGKILL)
    wait_until(lambda: len(procs_with_env("QL3_RUN_ID", rid)) == 1, 5, "the leader gone with its shim",
               detail=lambda: [p.cmdline() for p in procs_with_env("QL3_RUN_ID", rid)])
    (left,) = procs_with_env("QL3_RUN_ID", rid)
    assert left.cmdline()[0].endswith("sleep")
    shutil.rmtree(a.state)
    a.cli("init")
    a.serve()
    try:
        wait_until(lambda: not procs_with_env("QL3_RUN_ID", rid), 5, "the new agent to stop the old task",
                   step=0.05)
    finally:
        assert a.stop() == 0
    line = [ln for ln in a.journal().decode().splitlines() if "run.stray_stopped" in ln]
    assert len(line) == 1 and att["attempt_id"] in line[0] and "processes=1" in line[0], line


def test_a_daemon_a_keep_orphans_task_left_behind_survives_an_agent_restart(root):
    """``keep_orphans = true`` means the daemon a Run leaves is meant to stay: the start-up
    scan for stray tasks is for Attempts nobody accounts for, not for one that ended with its
    leftovers kept on purpose (a VPN or a watchdog a task starts must not die at every
    service restart)."""
    a = Agent(root)
    a.add(task("vpn", "setsid sleep 120 >/dev/null 2>&1 &\necho started\n", keep_orphans=True))
    a.serve()
    try:
        rid = a.start("vpn")
        assert a.wait(rid)["state"] == "succeeded"
    finally:
        assert a.stop() == 0
    (daemon,) = procs_with_env("QL3_RUN_ID", rid)
    try:
        a.serve()
        time.sleep(1)
        assert daemon.is_running() and daemon.status() != psutil.STATUS_ZOMBIE
        assert "run.stray_stopped" not in a.journal().decode()
    finally:
        assert a.stop() == 0
        daemon.kill()


def test_a_run_waiting_for_memory_says_so_once_in_the_journal(root):
    """Admission holds a Run whose memory reservation does not fit beside the live ones; the
    user must be able to see why it sits queued (once, not at every pass), and it starts when
    the memory is released."""
    a = Agent(root)
    a.add(task("big", "sleep 3\n", memory_max="64M"), task("other", "true\n", memory_max="64M"))
    a.serve()
    try:
        big = a.start("big")
        a.wait(big, ("running",))
        other = a.start("other")
        time.sleep(1.5)
        assert a.run(other)["state"] == "queued"
        assert a.wait(other)["state"] == "succeeded"
    finally:
        assert a.stop() == 0
    lines = [ln for ln in a.journal().decode().splitlines() if "run.waiting" in ln]
    assert len(lines) == 1 and other in lines[0] and "reason=memory_reserved" in lines[0], lines


def test_retry_policy(root):
    flaky = os.path.join(root, "flaky")
    a = Agent(root)
    a.add(task("bad", "exit 1\n", retry={"max_attempts": 3, "backoff_s": 0.2}),
          task("good", "true\n", retry={"max_attempts": 3, "backoff_s": 0.2}),
          task("flaky", f'echo x >> {flaky}\n[ "$(wc -l < {flaky})" -ge 2 ]\n',
               retry={"max_attempts": 3, "backoff_s": 0.2}))
    a.serve()
    try:
        bad, good, fl = a.start("bad"), a.start("good"), a.start("flaky")
        runs = {r: a.wait(r) for r in (bad, good, fl)}
    finally:
        assert a.stop() == 0
    assert runs[bad]["state"] == "failed" and runs[bad]["exit_code"] == 1
    atts = a.attempts(bad)
    assert [x["state"] for x in atts] == ["failed"] * 3
    # Backoff 0.2 s then 0.4 s (exponential) between an Attempt's end and the next one's start.
    gaps = [(atts[i + 1]["started_at_us"] - atts[i]["ended_at_us"]) / 1e6 for i in range(2)]
    assert gaps[0] >= 0.2 and gaps[1] >= 0.4, gaps
    assert len(event(a, bad, "run.retry_queued")) == 2
    assert runs[good]["state"] == "succeeded" and len(a.attempts(good)) == 1
    assert runs[fl]["state"] == "succeeded" and [x["state"] for x in a.attempts(fl)] == ["failed", "succeeded"]


def overlap(intervals: list[tuple[int, int]]) -> int:
    points = sorted([(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals])
    best = cur = 0
    for _, d in points:
        cur += d
        best = max(best, cur)
    return best


def test_single_instance_and_global_limit(root):
    a = Agent(root, config="max_concurrent_runs = 2\n")
    # 1.5 s each: long enough that two admitted Runs overlap even when a loaded machine takes
    # most of a second to start each shim (0.4 s did not, once, under 6 parallel test runs).
    a.add(task("single", "sleep 1.5\n", concurrency="single"),
          task("par", "sleep 1.5\n", concurrency="parallel"))
    a.serve()
    try:
        singles = [a.start("single") for _ in range(2)]
        pars = [a.start("par") for _ in range(4)]
        runs = [a.wait(r) for r in singles + pars]
    finally:
        assert a.stop() == 0
    assert all(r["state"] == "succeeded" for r in runs)
    iv = {r: (a.attempts(r)[0]["started_at_us"], a.attempts(r)[0]["ended_at_us"]) for r in singles + pars}
    assert overlap([iv[r] for r in singles]) == 1              # never two live Runs of one Task
    assert overlap(list(iv.values())) == 2                     # never more than the global limit


def test_per_run_figures_are_stored_on_the_attempt(root):
    a = Agent(root)
    a.add(task("hungry", command=[sys.executable, "-I", "-S", "-c",
                                  "b = bytearray(48 << 20)\nimport time\nt = time.process_time()\n"
                                  "while time.process_time() - t < 0.3: pass\n"]))
    a.serve()
    try:
        rid = a.start("hungry")
        assert a.wait(rid)["state"] == "succeeded"
        show = json.loads(a.cli("run", "show", rid, "--json").stdout)
    finally:
        assert a.stop() == 0
    (att,) = a.attempts(rid)
    assert att["peak_rss_bytes"] >= 48 * MiB
    assert att["cpu_time_us"] >= 300_000
    assert show["attempts"][0]["peakRssBytes"] == att["peak_rss_bytes"]     # shown by `run show --json`


def test_inline_wait_honours_timeout_and_network_gate(root, netns):
    """`run start --wait` with no service runs the engine inline: a network-gated task starts
    when the route exists, and with no route the CLI gives up after --timeout (exit 5) instead
    of waiting forever; the Run stays queued for a service."""
    a = Agent(root)
    a.add(*[t for t in router_tasks(root) if t["name"] == "wan-check"])
    p = a.cli("run", "start", "wan-check", "--wait", "--timeout", "10", timeout=20)
    assert p.stdout.split()[1] == b"succeeded"
    p = subprocess.run(["ip", "netns", "exec", netns,
                        *qlagent_argv("--state-dir", a.state, "run", "start", "wan-check", "--wait", "--timeout", "1")],
                       capture_output=True, env=a.env(), cwd=REPO, timeout=20)
    assert p.returncode == 5 and b"still queued after 1 s; it stays queued" in p.stderr, p.stderr
    with a.db() as c:
        assert c.execute("SELECT count(*) FROM runs WHERE state = 'queued'").fetchone()[0] == 1


def test_deadline_and_cancel_survive_an_agent_restart(root):
    """A re-attached Run keeps its deadline (F3 across F5) and a cancel requested while no agent
    ran is carried out by the next one; both trees die, with SIGKILL after the grace."""
    a = Agent(root)
    stubborn = "trap '' INT TERM; sleep 30"
    a.add(task("late", command=["/bin/sh", "-c", stubborn], timeout_s=2),
          task("cancelme", command=["/bin/sh", "-c", stubborn], timeout_s=60))
    a.serve()
    late, cancel = a.start("late"), a.start("cancelme")
    for r in (late, cancel):
        a.wait(r, ("running",))
    a.kill()
    a.cli("run", "cancel", cancel)                           # recorded while no agent runs
    a.serve()
    try:
        runs = {r: a.wait(r) for r in (late, cancel)}
    finally:
        assert a.stop() == 0
    assert runs[late]["state"] == "timed_out"
    assert secs(a.attempts(late)[0]) <= 2 + GRACE_S + 1.5
    assert runs[cancel]["state"] == "cancelled"
    for r in (late, cancel):
        none_left(r)


def first_run_of(a: Agent, name: str) -> str | None:
    with a.db() as c:
        row = c.execute("SELECT r.run_id FROM runs r JOIN tasks t USING (task_id) WHERE t.name = ? "
                        "ORDER BY r.created_at_us LIMIT 1", (name,)).fetchone()
    return row[0] if row else None


@pytest.mark.parametrize("engine", ["serve", "inline", "kept"])
def test_f3_the_shim_holds_the_timeout_while_no_agent_runs(root, engine):
    """F3 across F5: the agent (a ``serve``, or the inline engine of ``run start --wait``) is
    SIGKILLed a moment into a 3 s-timeout run that outlives SIGTERM; with no agent at all, its
    task gets one SIGTERM at the timeout and SIGKILL after the 2 s grace, and the receipt says
    the shim stopped it for its deadline; the next agent ends the Run ``timed_out`` from that
    receipt. ``kept``: the agent runs throughout and still sends no second SIGTERM."""
    terms = os.path.join(root, "terms")
    a = Agent(root)
    # sleep dies of the group's SIGTERM; the shell notes it, survives, sleeps on until SIGKILL.
    a.add(task("hang", command=["/bin/sh", "-c", f"trap 'echo term >> {terms}' TERM; "
                                                "while :; do sleep 0.2; done"], timeout_s=3, grace_s=2))
    inline = None
    if engine == "inline":
        inline = subprocess.Popen(qlagent_argv("--state-dir", a.state, "run", "start", "hang", "--wait"),
                                  stdout=subprocess.DEVNULL, env=a.env(), cwd=REPO)
        rid = wait_until(lambda: first_run_of(a, "hang"), 10, "the inline engine's Run")
    else:
        a.serve()
        rid = a.start("hang")
    a.wait(rid, ("running",))
    (att,) = a.attempts(rid)
    if engine == "inline":
        inline.kill()
        inline.wait()
    elif engine == "serve":
        a.kill()
    if engine != "kept":
        run_dir = os.path.join(a.state, "runs", att["attempt_id"])
        receipt = wait_until(lambda: processes.read_receipt(run_dir), 15, "the shim's receipt with no agent")
        assert not procs_with_env("QL3_RUN_ID", rid)            # nothing of it runs, no agent came
        assert receipt.deadline_passed and receipt.signal == signal.SIGKILL
        assert (receipt.ended_at_us - receipt.started_at_us) / 1e6 >= 3.0      # not before its timeout
        assert a.run(rid)["state"] == "running"                  # nobody has told the store yet
        a.serve()
    try:
        run = a.wait(rid)
    finally:
        assert a.stop() == 0
    (att,) = a.attempts(rid)
    assert (run["state"], att["failure_reason"], att["exit_signal"]) == ("timed_out", "timeout", signal.SIGKILL)
    assert secs(att) >= 3.0
    with open(terms) as f:
        assert f.read().split() == ["term"]                      # one SIGTERM, whoever watched
    none_left(rid)


def test_a_start_that_never_reached_its_exec_runs_once_after_the_agent_restarts(root):
    """"Never lose a run": the fork server is frozen (SIGSTOP), so the Attempt of ``run start``
    stays ``starting`` with no shim; agent and fork server are SIGKILLed. The next agent sees no
    trace of a shim in the run directory: the Attempt ends start_failed (agent_restart), the Run
    is queued again with a journal line naming it, and its next Attempt runs the task once."""
    a = Agent(root)
    a.add(task("warm", "true\n"), task("once", f'echo "$QL3_ATTEMPT_ID" >> {root}/spawns\n'))
    a.serve()
    a.wait(a.start("warm"))                                      # the fork server exists from here on
    (server,) = [p for p in psutil.Process(a.proc.pid).children()
                 if any(".shim-" in arg for arg in p.cmdline())]
    server.suspend()
    rid = a.start("once")
    wait_until(lambda: a.attempts(rid)[0]["state"] == "starting", 10, "the claim", step=0.05)
    a.kill()
    server.kill()
    a.serve()
    try:
        run = a.wait(rid)
    finally:
        assert a.stop() == 0
    first, second = a.attempts(rid)
    assert (first["state"], first["failure_reason"]) == ("start_failed", "agent_restart")
    assert (run["state"], second["state"]) == ("succeeded", "succeeded")
    assert spawns(root) == [second["attempt_id"]]
    journal = a.journal()
    assert f"run.requeued run={rid} attempt={first['attempt_id']} reason=agent_restart".encode() in journal
    assert b"requeued=1" in journal and b"run.lost" not in journal


def test_pid_budget_holds_back_the_next_run(root):
    """Edge: 64 PIDs for the whole service tree. A run holding ~62 processes leaves no room for
    another shim + task: the next Run waits (dispatch.refused pids) until the first ends."""
    a = Agent(root)
    a.add(task("forky", "i=0; while [ $i -lt 62 ]; do sleep 30 & i=$((i+1)); done; wait\n", timeout_s=60),
          task("next", "echo next\n"))
    a.serve()
    try:
        big = a.start("forky")
        a.wait(big, ("running",))
        wait_until(lambda: len(procs_with_env("QL3_RUN_ID", big)) >= 63, 5, "63 processes of the forky task")
        nxt = a.start("next")
        wait_until(lambda: b"dispatch.refused" in a.journal(), 5, "dispatch.refused in the journal",
                   detail=lambda: a.journal()[-2000:])
        assert b"pids" in a.journal().split(b"dispatch.refused", 1)[1][:200]
        assert a.run(nxt)["state"] == "queued"
        a.cli("run", "cancel", big)
        assert a.wait(big)["state"] == "cancelled"
        assert a.wait(nxt)["state"] == "succeeded"
    finally:
        assert a.stop() == 0
    none_left(big)


def test_service_walks_past_a_long_blocked_backlog(root):
    """300 queued Runs of a single-instance Task whose Run is live (75 edge pages, more than one
    wake-up's worth of passes) sit ahead of another Task's Run: the service keeps walking the
    keyset pages and starts that Run without waiting for an unrelated event."""
    a = Agent(root)
    a.add(task("single", "sleep 30\n", timeout_s=60), task("other", "echo other\n"))
    a.serve()
    try:
        first = a.start("single")
        a.wait(first, ("running",))
        from qlagent.adapters.rows import definitions as defs
        from qlagent.adapters.rows import runs as runs_repo
        from qlagent.adapters.sqlite.store import SqliteStore
        other = SqliteStore(os.path.join(a.state, "qlagent.db"))

        def tx(c):
            head = defs.get_head(c, other.project.project_id, "single")
            for i in range(300):
                runs_repo.create_run(c, head=head, origin="manual", trigger_type="cli",
                                     idempotency_key=f"test:blocked:{i}", requested_by="test", now_us=1_000 + i)
        other.write(tx)
        other.close()
        behind = a.start("other")                    # pokes the service once
        assert a.wait(behind, timeout_s=10)["state"] == "succeeded"
        a.cli("run", "cancel", first)
        a.wait(first)
    finally:
        assert a.stop() == 0


def test_inline_wait_after_an_interrupted_one_recovers_the_first_run(root):
    """`run start --wait --timeout` gives up while its task still runs (the shim carries on);
    the next inline `run start --wait` of that single-instance Task re-attaches the first Run,
    lets it finish with its real status, then runs its own."""
    a = Agent(root)
    a.add(task("one", command=["/bin/sh", "-c", "sleep 0.8; exit 4"]))
    p = a.cli("run", "start", "one", "--wait", "--timeout", "0.2", check=False)
    assert p.returncode == 5 and b"still running" in p.stderr
    first = p.stderr.split()[3].decode()
    p = a.cli("run", "start", "one", "--wait", "--timeout", "10", check=False, timeout=20)
    assert p.returncode == 6 and b"failed exit=4" in p.stdout
    assert (a.run(first)["state"], a.run(first)["exit_code"]) == ("failed", 4)
    none_left(first)


def test_orphan_holding_the_output_does_not_keep_the_run_alive(root):
    """The main process exits 0 while a background child still holds the FIFO open for 30 s:
    the Run ends succeeded after the shim's linger (2 s), not after 30 s."""
    a = Agent(root)
    a.add(task("bg", command=["/bin/sh", "-c", "sleep 30 & echo started; exit 0"], timeout_s=60))
    a.serve()
    try:
        rid = a.start("bg")
        t0 = time.monotonic()
        run = a.wait(rid)
        waited = time.monotonic() - t0
    finally:
        assert a.stop() == 0
        for p in procs_with_env("QL3_RUN_ID", rid):     # a succeeded Run's background child is left alone
            p.kill()
    assert (run["state"], run["exit_code"]) == ("succeeded", 0)
    assert waited < 2.0 + 3.0, waited
    assert log_bytes(a, rid) == b"started\n"


def test_wait_without_a_service_answers_cancel_and_interruption(root):
    """`run start --wait` with no service is the service for its Runs: `run cancel` stops the
    tree within grace + 1 s, and SIGTERM/Ctrl-C of the waiting CLI cancels what it launched."""
    a = Agent(root)
    a.add(task("sl", command=["/bin/sh", "-c", "sleep 300 & setsid sleep 301 & wait"], timeout_s=120))
    for interrupt in (False, True):
        waiter = subprocess.Popen(qlagent_argv("--state-dir", a.state, "run", "start", "sl", "--wait"),
                                  env=a.env(), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        def tree_up() -> str | None:
            runs = json.loads(a.cli("run", "ls", "--json").stdout)["items"]
            live = [r["runId"] for r in runs if r["state"] == "running"]
            return live[0] if live and len(procs_with_env("QL3_RUN_ID", live[0])) >= 3 else None
        rid = wait_until(tree_up, 10, "the waiter's Run running with its three processes", step=0.05)
        t0 = time.monotonic()
        if interrupt:
            waiter.send_signal(signal.SIGTERM)
        else:
            a.cli("run", "cancel", rid)
        assert waiter.wait(timeout=GRACE_S + 5) == 6          # the Run did not succeed
        assert time.monotonic() - t0 <= GRACE_S + 1.5
        assert json.loads(a.cli("run", "show", rid, "--json").stdout)["state"] == "cancelled"
        none_left(rid)


def test_activation_is_committed_before_the_task_is_spawned(root):
    """The task itself reads its Attempt from the database file through its own connection: the
    claim (``starting``) is already committed — and, with synchronous=FULL, on stable storage —
    when the task runs, so a power cut after the spawn cannot lose the activation."""
    a = Agent(root)
    db = os.path.join(a.state, "qlagent.db")
    code = ("import os, sqlite3, sys\n"
            "c = sqlite3.connect(f'file:{sys.argv[1]}?mode=ro', uri=True, timeout=10)\n"
            "print(c.execute('SELECT state FROM attempts WHERE attempt_id = ?',"
            " (os.environ['QL3_ATTEMPT_ID'],)).fetchone()[0])\n")
    a.add(task("reader", command=[sys.executable, "-c", code, db]))
    a.serve()
    try:
        rid = a.start("reader")
        run = a.wait(rid)
    finally:
        assert a.stop() == 0
    assert run["state"] == "succeeded"
    (att,) = a.attempts(rid)
    with open(att["artifact_path"]) as f:
        assert f.read().strip() in ("starting", "running")
