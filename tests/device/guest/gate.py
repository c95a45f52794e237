#!/usr/bin/python3
"""The gates' guest side: runs inside the arm64 router VM (Debian 13, systemd, cgroup v2) as
root, started by qlvm-boot.service after qlagent.service, with the host's control disk mounted
at /mnt/ctl. It acts as a user of the installed package would (systemctl, `runuser -u qlagent --
qlagent …`, the HTTP API on 127.0.0.1, the journal, the cgroup files) and writes what it found
to /mnt/ctl/result-<mode>.json (one JSON object; `checks` maps a check's name to
{"ok": bool, "detail": …}; `figures` are measurements, never asserted here).

Modes (argv[1]): seed, hog, pid1, flash, powercut; and bench, which is no gate: the issue 24
benches' figures in this guest (bench/bench_guest.py, on the control disk), nothing checked. The
host side is tests/device/vmkit.py.
"""

from __future__ import annotations

import json
import os
import pwd
import random
import re
import sqlite3
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid

CTL = "/mnt/ctl"
STATE = "/var/lib/qlagent"
CONF = "/etc/qlagent/qlagent.toml"
UNIT = "qlagent.service"
CG = "/sys/fs/cgroup/system.slice/qlagent.service"
GATE_DIR = "/srv/qlgate"
MiB = 1024 * 1024
TERMINAL = {"succeeded", "failed", "timed_out", "cancelled", "lost"}

checks: dict[str, dict] = {}
GUEST: dict[str, object] = {}
figures: dict[str, object] = {}
T0 = time.monotonic()


def say(msg: str) -> None:
    line = f"qlvm[{time.monotonic() - T0:7.1f}] {msg}"
    print(line, flush=True)
    try:
        with open("/dev/ttyAMA0", "w") as tty:
            tty.write(line + "\n")
    except OSError:
        pass


def check(name: str, ok: bool, detail: object = None) -> bool:
    checks[name] = {"ok": bool(ok), "detail": detail}
    say(f"{'PASS' if ok else 'FAIL'} {name} {detail if detail is not None else ''}")
    return bool(ok)


def sh(*cmd: str, check_rc: bool = False, timeout: float = 300, input: str | None = None) -> subprocess.CompletedProcess:
    p = subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout, input=input)
    if check_rc and p.returncode != 0:
        raise RuntimeError(f"{cmd}: rc={p.returncode} {p.stderr.strip()[-500:]}")
    return p


def ql(*args: str, check_rc: bool = True, input: str | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    return sh("runuser", "-u", "qlagent", "--", "qlagent", "--config", CONF, *args,
              check_rc=check_rc, input=input, timeout=timeout)


def qljson(*args: str):
    return json.loads(ql(*args, "--json").stdout)


def show(*props: str) -> dict[str, str]:
    out = sh("systemctl", "show", UNIT, *[f"-p{p}" for p in props]).stdout
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


def read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            v = f.read().strip()
        return None if v == "max" else int(v)
    except (OSError, ValueError):
        return None


def vm_status(pid: int) -> dict[str, int]:
    out = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                k, _, v = line.partition(":")
                if k in ("VmRSS", "VmHWM"):
                    out[k] = int(v.split()[0]) * 1024
    except OSError:
        pass
    return out


def all_runs() -> list[dict]:
    items, cursor = [], None
    while True:
        args = ["run", "ls", "--limit", "200"] + (["--cursor", cursor] if cursor else [])
        page = qljson(*args)
        items += page["items"]
        cursor = page.get("nextCursor")
        if not cursor:
            return items


def run_states(db: str = f"{STATE}/qlagent.db") -> dict[str, str]:
    """Run ID → state, read from the store by a forked child as the service user: the waits
    below poll this instead of `run ls`, whose interpreter start costs seconds of guest CPU
    under TCG, CPU the Runs being waited for need. Checks read through the CLI as a user would."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.close(r)
            pw = pwd.getpwnam("qlagent")
            os.setgroups([])
            os.setgid(pw.pw_gid)
            os.setuid(pw.pw_uid)
            con = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=30)
            rows = con.execute("SELECT run_id, state FROM runs").fetchall()
            with os.fdopen(w, "w") as out:
                json.dump(dict(rows), out)
            code = 0
        finally:
            os._exit(code)
    os.close(w)
    with os.fdopen(r) as inp:
        data = inp.read()
    _, status = os.waitpid(pid, 0)
    return json.loads(data) if status == 0 and data else {}


def journal(since: str, *extra: str) -> str:
    return sh("journalctl", "-u", UNIT, "--since", since, "-o", "cat", "--no-pager", *extra).stdout


def now_stamp() -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S")


def integrity(db: str = f"{STATE}/qlagent.db") -> str:
    # Read-only, as the service user would be refused nothing; immutable=0 so the WAL counts.
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=30)
    try:
        return ";".join(r[0] for r in con.execute("PRAGMA integrity_check"))
    finally:
        con.close()


def set_config(profile: str, http: bool = False, state_dir: str = STATE) -> None:
    text = (f'profile = "{profile}"\nstate_dir = "{state_dir}"\nartifact_dir = "{state_dir}/artifacts"\n'
            'drain_grace_s = 20\n')
    if http:
        text += '[http]\nlisten = "127.0.0.1:7380"\n'
    with open(CONF, "w") as f:
        f.write(text)
    dropin = "/etc/systemd/system/qlagent.service.d"
    os.makedirs(dropin, exist_ok=True)
    # The gates' tasks write their marks to /srv/qlgate (README: a drop-in with ReadWritePaths=).
    with open(f"{dropin}/gate.conf", "w") as f:
        f.write(f"[Service]\nReadWritePaths={GATE_DIR}\n")
    sa = f"{dropin}/standalone.conf"
    if profile == "standalone":
        with open("/usr/share/qlagent/standalone.conf") as src, open(sa, "w") as dst:
            dst.write(src.read())
    elif os.path.exists(sa):
        os.unlink(sa)
    os.makedirs(GATE_DIR, exist_ok=True)
    sh("chown", "qlagent:qlagent", GATE_DIR)
    sh("systemctl", "daemon-reload", check_rc=True)


def wait_for(pred, timeout: float, step: float = 1.0):
    end = time.monotonic() + timeout
    while True:
        v = pred()
        if v or time.monotonic() > end:
            return v
        time.sleep(step)


TICK_TASK = """
[[task]]
name = "tick"
description = "seconds schedule: a Run every 5 s; appends runId attempt to a file it fsyncs"
schedule = "*/5 * * * * *"
timeout_s = 30
shell = "/bin/sh"
script = '''
echo "$QL3_RUN_ID $QL3_ATTEMPT_ID" >> /srv/qlgate/marks
sync /srv/qlgate/marks
echo tick
'''

[[task]]
name = "mark"
description = "started over HTTP by the load client; appends runId attempt, fsynced"
timeout_s = 30
shell = "/bin/sh"
script = '''
echo "$QL3_RUN_ID $QL3_ATTEMPT_ID" >> /srv/qlgate/marks
sync /srv/qlgate/marks
echo marked
'''

[[task]]
name = "sleeper"
description = "a long, quiet live run that must go on while other things happen"
timeout_s = 600
shell = "/bin/sh"
script = '''
echo "sleeper $QL3_RUN_ID"
sleep "${SLEEP_S:-60}"
echo done
'''
"""


# chatty's own timeout (300 s) fits a router's CPU; under TCG on a shared host its 200,000-line
# shell loop took 150-300 s, so the gates give it room: what they check is the quota, not speed.
CHATTY_TIMEOUT_S = 1200


def add_tasks(extra: str = "") -> None:
    with open(f"{CTL}/router-tasks.toml") as f:
        router = f.read()
    head, sep, rest = router.partition('name = "chatty"')
    assert sep and "timeout_s = 300" in rest.split("[[task]]")[0], "router-tasks.toml: chatty's timeout moved"
    router = head + sep + rest.replace("timeout_s = 300", f"timeout_s = {CHATTY_TIMEOUT_S}", 1)
    path = "/srv/qlgate/tasks.toml"
    with open(path, "w") as f:
        f.write(router + TICK_TASK + extra)
    os.chmod(path, 0o644)
    have = {t["name"] for t in qljson("task", "ls")["items"]}
    if "heartbeat" in have:
        return
    ql("secret", "set", "ddns_token", input="my-ddns-token\n")
    ql("task", "add", "-f", path)


def start_ok(since_us: float) -> dict:
    s = show("ActiveState", "SubState", "MainPID", "NRestarts", "StatusText", "Result")
    return s


def stop_and_watch() -> dict:
    """`systemctl stop` with live runs; poll the unit while it stops: the agent's STOPPING=1
    shows as ActiveState=deactivating with StatusText draining."""
    seen = set()
    p = subprocess.Popen(["systemctl", "stop", UNIT])
    t = time.monotonic()
    while p.poll() is None:
        s = show("ActiveState", "StatusText")
        seen.add(f'{s.get("ActiveState")}|{s.get("StatusText")}')
        time.sleep(0.2)
    took = time.monotonic() - t
    s = show("ActiveState", "Result", "ExecMainStatus", "ExecMainCode")
    left = sh("pgrep", "-u", "qlagent").stdout.split()
    return {"rc": p.returncode, "seen": sorted(seen), "after": s, "left": left,
            "stop_s": round(took, 1)}


# ---------------------------------------------------------------- seed
def seed_profile(profile: str) -> dict:
    say(f"seed: profile {profile}")
    sh("systemctl", "stop", UNIT)
    set_config(profile)
    add_tasks()
    for t in ("slow", "tick"):
        ql("task", "enable", t)
    t0 = time.monotonic()
    p = sh("systemctl", "start", UNIT)
    ready_s = time.monotonic() - t0
    s = show("ActiveState", "SubState", "MainPID", "NRestarts", "StatusText", "MemoryMax", "TasksMax")
    pre = f"seed.{profile}."
    check(pre + "active_after_start", p.returncode == 0 and s["ActiveState"] == "active"
          and s["SubState"] == "running", s)
    want_mem = 128 * MiB if profile == "edge" else 256 * MiB
    want_pids = 64 if profile == "edge" else 256
    check(pre + "cgroup_limits", read_int(f"{CG}/memory.max") == want_mem
          and read_int(f"{CG}/pids.max") == want_pids,
          {"memory.max": read_int(f"{CG}/memory.max"), "pids.max": read_int(f"{CG}/pids.max")})
    pid = int(s["MainPID"])
    figures[pre + "ready_s"] = round(ready_s, 2)
    figures[pre + "rss_idle"] = vm_status(pid).get("VmRSS")
    started = {}
    for name in ("chatty", "hang", "spawn-tree", "no-newline", "fail"):
        out = qljson("run", "start", name)
        started[name] = out["runId"]
    # Sample the agent's RSS while the router set runs.
    rss_max = 0

    def enough() -> bool:
        nonlocal rss_max
        rss_max = max(rss_max, vm_status(pid).get("VmRSS", 0))
        states = run_states()
        done = [s for s in states.values() if s in TERMINAL]
        mine_done = all(states.get(started[n]) in TERMINAL
                        for n in ("chatty", "hang", "spawn-tree", "no-newline", "fail"))
        return len(done) >= 20 and mine_done

    ok = wait_for(enough, CHATTY_TIMEOUT_S + 120, 2)
    runs = all_runs()
    by_id = {r["runId"]: r for r in runs}
    done = [r for r in runs if r["state"] in TERMINAL]
    check(pre + "runs_20", ok and len(done) >= 20,
          {"terminal": len(done), "by_task": _count(r["taskName"] for r in done)})
    chatty = qljson("run", "show", started["chatty"])
    att = chatty["attempts"][-1]
    quota = 4 * MiB if profile == "edge" else 64 * MiB
    if profile == "edge":
        okc = chatty["state"] == "succeeded" and att["truncated"] and att["bytesKept"] == quota
    else:
        okc = chatty["state"] == "succeeded" and not att["truncated"] and att["bytesKept"] > 9 * 10**6
    check(pre + "chatty_at_quota", okc, {k: att.get(k) for k in ("state", "bytesKept", "bytesDropped", "truncated")}
          | {"run": chatty["state"], "quota": quota})
    hang = by_id.get(started["hang"], {})
    check(pre + "hang_timed_out", hang.get("state") == "timed_out", hang.get("state"))
    fail = by_id.get(started["fail"], {})
    check(pre + "fail_exit_3", fail.get("state") == "failed" and fail.get("exitCode") == 3,
          {"state": fail.get("state"), "exitCode": fail.get("exitCode")})
    started["sleeper"] = qljson("run", "start", "sleeper")["runId"]
    live = wait_for(lambda: qljson("run", "show", started["sleeper"])["state"] == "running", 60)
    check(pre + "live_run_before_stop", bool(live), qljson("run", "show", started["sleeper"])["state"])
    s2 = show("MainPID", "NRestarts")
    check(pre + "no_restart", s2["MainPID"] == str(pid) and s2["NRestarts"] == "0", s2)
    figures[pre + "rss_peak_sampled"] = rss_max
    figures[pre + "vmhwm"] = vm_status(pid).get("VmHWM")
    figures[pre + "memory.peak"] = read_int(f"{CG}/memory.peak")
    figures[pre + "pids.peak"] = read_int(f"{CG}/pids.peak")
    figures[pre + "memory.events"] = open(f"{CG}/memory.events").read().split()
    since = now_stamp()
    st = stop_and_watch()
    check(pre + "stop_draining_seen", any(x.startswith("deactivating|") and "draining" in x for x in st["seen"]),
          st["seen"])
    check(pre + "stop_exit_0", st["rc"] == 0 and st["after"].get("Result") == "success"
          and st["after"].get("ExecMainStatus") == "0", st["after"])
    check(pre + "stop_no_process_left", not st["left"] and read_int(f"{CG}/pids.current") in (None, 0), st["left"])
    figures[pre + "stop_s"] = st["stop_s"]
    integ = integrity()
    check(pre + "integrity", integ == "ok", integ)
    jr = journal(since)
    check(pre + "journal_drain", "service.draining" in jr and "service.stopped" in jr, jr[-600:])
    after = {r["runId"]: r["state"] for r in all_runs() if r["state"] in ("starting", "running")}
    check(pre + "no_live_run_after_stop", not after, after)
    return {}


def _count(it) -> dict:
    out: dict = {}
    for x in it:
        out[x] = out.get(x, 0) + 1
    return out


def mode_seed() -> None:
    for profile in ("edge", "standalone"):
        try:
            seed_profile(profile)
        except Exception as e:  # noqa: BLE001 — a gate reports, it never hides the cause
            check(f"seed.{profile}.completed", False, repr(e))
    # Back to edge for whatever follows in this boot.
    set_config("edge")


# ---------------------------------------------------------------- hog
HOG_TASK = """
[[task]]
name = "hog"
description = "allocates without bound (touching every page) until something stops it"
timeout_s = 300
shell = "/bin/sh"
script = '''
exec python3 -c '
import time
chunks = []
while True:
    b = bytearray(8 << 20)
    for i in range(0, len(b), 4096):
        b[i] = 1
    chunks.append(b)
'
'''
"""


def http(method: str, path: str, token: str | None = None, body: dict | None = None, timeout: float = 10):
    req = urllib.request.Request(f"http://127.0.0.1:7380{path}", method=method,
                                 data=None if body is None else json.dumps(body).encode())
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    if body is not None:
        req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")


def mode_hog() -> None:
    sh("systemctl", "stop", UNIT)
    set_config("edge", http=True)
    add_tasks(HOG_TASK)
    have = {t["name"] for t in qljson("task", "ls")["items"]}
    if "hog" not in have:
        path = "/srv/qlgate/hog.toml"
        with open(path, "w") as f:
            f.write(HOG_TASK)
        ql("task", "add", "-f", path)
    for t in ("slow", "tick"):
        ql("task", "disable", t, check_rc=False)
    since = now_stamp()
    sh("systemctl", "start", UNIT, check_rc=True)
    s0 = show("MainPID", "NRestarts")
    pid = s0["MainPID"]
    sleeper = qljson("run", "start", "sleeper")["runId"]
    wait_for(lambda: qljson("run", "show", sleeper)["state"] == "running", 60)
    hog = qljson("run", "start", "hog")["runId"]
    health = []
    stop = threading.Event()

    def probe():
        while not stop.is_set():
            try:
                st, _ = http("GET", "/healthz", timeout=5)
            except Exception as e:  # noqa: BLE001
                st = repr(e)[:80]
            health.append(st)
            time.sleep(1)

    th = threading.Thread(target=probe, daemon=True)
    th.start()
    ended = wait_for(lambda: qljson("run", "show", hog)["state"] in TERMINAL, 240, 2)
    time.sleep(3)
    stop.set()
    th.join(10)
    h = qljson("run", "show", hog)
    check("hog.run_ended", bool(ended), h["state"])
    text = json.dumps(h)
    check("hog.oom_killed", "oom_killed" in text,
          {"state": h["state"], "attempt": {k: h["attempts"][-1].get(k) for k in
                                            ("state", "exitCode", "signal", "failureReason", "peakRssBytes")}})
    s1 = show("MainPID", "NRestarts", "ActiveState")
    check("hog.agent_kept_pid", s1["MainPID"] == pid and s1["NRestarts"] == "0" and s1["ActiveState"] == "active",
          {"before": s0, "after": s1})
    jr = journal(since)
    wd = [ln for ln in sh("journalctl", "--since", since, "-o", "cat", "--no-pager").stdout.splitlines()
          if "atchdog" in ln or "oom" in ln.lower() or "Main process exited" in ln]
    check("hog.no_watchdog_timeout", not any("Watchdog timeout" in ln or "result 'watchdog'" in ln for ln in wd),
          wd[-12:])
    bad = [x for x in health if x != 200]
    check("hog.http_answered", len(health) >= 3 and not bad, {"probes": len(health), "not_200": bad[:10]})
    st, _ = http("GET", "/healthz")
    check("hog.http_after", st == 200, st)
    sl = qljson("run", "show", sleeper)
    check("hog.other_run_goes_on", sl["state"] in ("running", "succeeded"), sl["state"])
    ev = open(f"{CG}/memory.events").read().split()
    figures["hog.service_memory.events"] = ev
    figures["hog.service_memory.peak"] = read_int(f"{CG}/memory.peak")
    figures["hog.attempt"] = h["attempts"][-1]
    ql("run", "cancel", sleeper, check_rc=False)
    sh("systemctl", "stop", UNIT)
    check("hog.integrity", integrity() == "ok", None)


# ---------------------------------------------------------------- pid1
PID1_TASKS = """
[[task]]
name = "orphan"
description = "leaves a short-lived daemon behind (keep_orphans): re-parented to PID 1 when the shim ends"
keep_orphans = true
timeout_s = 30
shell = "/bin/sh"
script = '''
( setsid sh -c 'sleep 2' >/dev/null 2>&1 & )
echo left
'''

[[task]]
name = "longrun"
description = "live when SIGTERM comes"
timeout_s = 120
shell = "/bin/sh"
script = '''
echo start; sleep 8; echo end
'''
"""


def zombies_under(pid: int) -> list[str]:
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                st = f.read()
        except OSError:
            continue
        rest = st.rsplit(")", 1)[1].split()
        if rest[0] == "Z" and int(rest[1]) == pid:
            out.append(d)
    return out


def mode_pid1() -> None:
    state = "/srv/pid1state"
    sh("rm", "-rf", state)
    os.makedirs(state, mode=0o700)
    conf = "/srv/pid1.toml"
    with open(conf, "w") as f:
        f.write(f'profile = "edge"\nstate_dir = "{state}"\ndrain_grace_s = 20\n')
    tasks = "/srv/pid1-tasks.toml"
    with open(tasks, "w") as f:
        f.write(PID1_TASKS)
    base = ["qlagent", "--config", conf]
    sh(*base, "init", check_rc=True)
    sh(*base, "task", "add", "-f", tasks, check_rc=True)
    log = open("/srv/pid1.log", "w")
    u = subprocess.Popen(["unshare", "--pid", "--fork", "--mount-proc", *base, "serve"],
                         stdout=log, stderr=subprocess.STDOUT)
    agent = wait_for(lambda: _child_of(u.pid), 30, 0.2)
    check("pid1.started", bool(agent), agent)
    if not agent:
        u.kill()
        return
    with open(f"/proc/{agent}/status") as f:
        nspid = [ln for ln in f if ln.startswith("NSpid:")][0].split()[1:]
    check("pid1.is_pid1", nspid[-1] == "1", nspid)
    time.sleep(8)  # serve to READY on TCG
    # 1: a zombie re-parented from a task's daemon (keep_orphans: the shim leaves it behind).
    sh(*base, "run", "start", "orphan")
    # 2: orphans re-parented by something outside the agent's runs (nsenter into the PID ns).
    sh("nsenter", "-t", str(agent), "-p", "-m", "--", "sh", "-c", "sleep 1 & sleep 1 & sleep 1 & exit 0")
    time.sleep(12)
    z = zombies_under(agent)
    check("pid1.reaps_zombies", not z, z)
    lr = json.loads(sh(*base, "run", "start", "longrun", "--json").stdout)["runId"]
    wait_for(lambda: json.loads(sh(*base, "run", "show", lr, "--json").stdout)["state"] == "running", 30, 0.5)
    t = time.monotonic()
    os.kill(agent, 15)
    try:
        rc = u.wait(60)
    except subprocess.TimeoutExpired:
        u.kill()
        rc = "timeout"
    figures["pid1.sigterm_to_exit_s"] = round(time.monotonic() - t, 1)
    log.close()
    out = open("/srv/pid1.log").read()
    check("pid1.exit_0", rc == 0, rc)
    check("pid1.drained", "service.draining" in out and "service.stopped" in out, out[-800:])
    run = json.loads(sh(*base, "run", "show", lr, "--json").stdout)
    check("pid1.live_run_finished_in_drain", run["state"] == "succeeded", run["state"])
    check("pid1.integrity", integrity(f"{state}/qlagent.db") == "ok", None)


def _child_of(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            kids = f.read().split()
        return int(kids[0]) if kids else None
    except OSError:
        return None


# ---------------------------------------------------------------- flash
def df(path: str) -> int:
    v = os.statvfs(path)
    return v.f_bavail * v.f_frsize


def mode_flash() -> None:
    """/dev/vdc: squashfs (the read-only lower, like OpenWrt's /rom); /dev/vdd: a small ext4
    (the upper, like OpenWrt's /overlay). The state dir is an overlayfs of both."""
    sh("systemctl", "stop", UNIT)
    for m in ("squashfs", "overlay"):
        sh("modprobe", m)
    os.makedirs("/rom", exist_ok=True)
    os.makedirs("/overlay", exist_ok=True)
    sh("mount", "-t", "squashfs", "-o", "ro", "/dev/vdc", "/rom", check_rc=True)
    sh("mount", "-t", "ext4", "/dev/vdd", "/overlay", check_rc=True)
    os.makedirs("/overlay/upper", exist_ok=True)
    os.makedirs("/overlay/work", exist_ok=True)
    sh("mount", "-t", "overlay", "overlay", "-o",
       "lowerdir=/rom,upperdir=/overlay/upper,workdir=/overlay/work", STATE, check_rc=True)
    sh("chown", "qlagent:qlagent", STATE)
    os.chmod(STATE, 0o750)
    set_config("edge")
    ql("init")
    add_tasks()
    ql("task", "disable", "slow")
    ql("task", "disable", "tick")
    figures["flash.free_at_start"] = df(STATE)
    since = now_stamp()
    sh("systemctl", "start", UNIT, check_rc=True)
    s0 = show("MainPID", "NRestarts")
    r = qljson("run", "start", "heartbeat")["runId"]
    okr = wait_for(lambda: qljson("run", "show", r)["state"] in TERMINAL, 60)
    check("flash.runs_with_space", okr and qljson("run", "show", r)["state"] == "succeeded", None)
    # Fill from outside (root, like another process on the router) to just below the reserve:
    # the edge Profile's 32 MiB, at most a quarter of the file system (README, "small flash").
    fill = "/overlay/upper/fill"
    v = os.statvfs(STATE)
    reserve = min(32 * MiB, v.f_blocks * v.f_frsize // 4)
    figures["flash.reserve"] = reserve
    free = df(STATE)
    want = max(0, free - (reserve - 4 * MiB))
    sh("fallocate", "-l", str(want), fill, check_rc=True)
    figures["flash.free_below_reserve"] = df(STATE)
    r2 = qljson("run", "start", "heartbeat")["runId"]
    time.sleep(20)
    r2s = qljson("run", "show", r2)
    jr = journal(since)
    check("flash.refused_below_reserve", r2s["state"] not in ("running", "succeeded") and "low_space" in jr,
          {"state": r2s["state"], "journal": [ln for ln in jr.splitlines() if "low_space" in ln][:3]})
    # Fill completely during runs: the chatty run writes its log while the disk fills.
    sh("rm", "-f", fill)
    ch = qljson("run", "start", "chatty")["runId"]
    time.sleep(3)
    sh("sh", "-c", f"dd if=/dev/zero of={fill} bs=1M 2>/dev/null; sync")
    figures["flash.free_when_full"] = df(STATE)
    cli = []
    for args in (("run", "start", "heartbeat"), ("run", "show", ch), ("run", "ls", "--limit", "5")):
        p = ql(*args, check_rc=False, timeout=120)
        cli.append({"cmd": " ".join(args[:2]), "rc": p.returncode, "stderr": p.stderr.strip()[-300:]})
        time.sleep(5)
    time.sleep(25)
    s1 = show("MainPID", "NRestarts", "ActiveState")
    figures["flash.cli_when_full"] = cli
    check("flash.no_crash_loop", s1["ActiveState"] == "active" and int(s1["NRestarts"]) <= 1,
          {"before": s0, "after": s1})
    # A user's command on a full disk: exit status and one line, never a crash (signal) or traceback.
    check("flash.cli_clear_when_full", all(c["rc"] < 128 and "Traceback" not in c["stderr"] for c in cli), cli)
    jr = journal(since)
    errs = [ln for ln in jr.splitlines() if any(w in ln for w in ("ENOSPC", "low_space", "No space", "unavailable", "full"))]
    check("flash.clear_errors", bool(errs) and "Traceback" not in jr, errs[:6])
    # Free the space: the agent carries on by itself (no restart, no command).
    sh("rm", "-f", fill)
    sh("sync")
    t = time.monotonic()

    def heartbeat_ok() -> bool:
        try:
            rid = qljson("run", "start", "heartbeat")["runId"]
            return bool(wait_for(lambda: qljson("run", "show", rid)["state"] == "succeeded", 60, 2))
        except Exception:  # noqa: BLE001 — the agent may still be coming back
            return False

    okr3 = wait_for(heartbeat_ok, 240, 5)
    figures["flash.recovery_s"] = round(time.monotonic() - t, 1)
    try:
        r2e = qljson("run", "show", r2)["state"]
    except Exception as e:  # noqa: BLE001
        r2e = repr(e)[:200]
    check("flash.recovers_by_itself", bool(okr3) and r2e in TERMINAL, {"queued_run_before": r2e})
    s2 = show("MainPID", "NRestarts", "ActiveState")
    check("flash.agent_alive", s2["ActiveState"] == "active", {"after_fill": s1, "after_free": s2})
    sh("systemctl", "stop", UNIT)
    check("flash.integrity", integrity() == "ok", None)
    sh("umount", STATE)


# ---------------------------------------------------------------- power cut
ACKED = [0]


def load_client(token: str, stop: threading.Event, acks: str) -> None:
    """Task Starts over HTTP; every 202 is appended (runId) to the acks file and fsynced
    before the next request, so what the file holds the client was told."""
    st, head = http("GET", "/api/v3/projects/default/tasks/mark", token)
    fd = os.open(acks, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    while not stop.is_set():
        body = {"schema": "qinglong/task-start@v1", "mutationId": str(uuid.uuid4()),
                "expectedRevision": head["revision"], "expectedContentDigest": head["contentDigest"]}
        try:
            code, out = http("POST", "/api/v3/projects/default/tasks/mark/runs", token, body)
        except Exception:  # noqa: BLE001
            time.sleep(0.5)
            continue
        if code == 202:
            os.write(fd, (out["runId"] + "\n").encode())
            os.fsync(fd)
            ACKED[0] += 1
        else:
            time.sleep(0.5)
        time.sleep(random.uniform(0.0, 0.3))


def powercut_check(boot: int) -> None:
    """After a boot that followed a cut (or the first boot): the checks of the issue."""
    pre = "powercut."
    s = show("ActiveState", "SubState", "NRestarts")
    ok_up = wait_for(lambda: show("ActiveState")["ActiveState"] == "active", 60)
    check(pre + "service_up_by_itself", bool(ok_up), s)
    integ = integrity()
    check(pre + "integrity", integ == "ok", integ)
    ql("task", "disable", "tick", check_rc=False)
    # Let recovery and the queue finish: Runs queued before the cut may run now.
    wait_for(lambda: all(s in TERMINAL for s in run_states().values()), 240, 3)
    runs = all_runs()
    by_id = {r["runId"]: r for r in runs}
    live = [(r["runId"], r["state"]) for r in runs if r["state"] not in TERMINAL]
    check(pre + "no_run_left_live", not live, live[:10])
    acks = []
    if os.path.exists(f"{CTL}/acks.log"):
        acks = [ln.strip() for ln in open(f"{CTL}/acks.log") if len(ln.strip()) == 36]
    lost = [a for a in acks if a not in by_id]
    check(pre + "acknowledged_starts_kept", not lost, {"acked": len(acks), "missing": lost[:10]})
    marks = [ln.split() for ln in open(f"{GATE_DIR}/marks")] if os.path.exists(f"{GATE_DIR}/marks") else []
    per_run: dict[str, int] = {}
    for m in marks:
        if len(m) == 2:
            per_run[m[0]] = per_run.get(m[0], 0) + 1
    twice = {k: v for k, v in per_run.items() if v > 1}
    check(pre + "no_double_execution", not twice, twice)
    # Artifacts: never over the edge quota; a finished Attempt's log has the size it recorded.
    over, mismatch = [], []
    quota = 4 * MiB
    art = f"{STATE}/artifacts"
    sizes = {}
    for root, _dirs, files in os.walk(art):
        for fn in files:
            if fn.endswith(".log"):
                sizes[fn[:-4]] = os.path.getsize(os.path.join(root, fn))
    over = [k for k, v in sizes.items() if v > quota]
    checked = 0
    for r in runs:
        if r["taskName"] != "chatty" or r["state"] != "succeeded":
            continue
        a = qljson("run", "show", r["runId"])["attempts"][-1]
        if a["attemptId"] in sizes:
            checked += 1
            if sizes[a["attemptId"]] != a["bytesKept"]:
                mismatch.append((a["attemptId"], sizes[a["attemptId"]], a["bytesKept"]))
    check(pre + "artifacts_within_quota", not over and not mismatch,
          {"logs": len(sizes), "over": over[:5], "mismatch": mismatch[:5], "chatty_checked": checked})
    figures.setdefault("powercut.boots", []).append(
        {"boot": boot, "acked": len(acks), "lost": len(lost), "double": len(twice), "runs": len(runs),
         "live_after": len(live), "integrity": integ, "marks": len(marks)})
    ql("task", "enable", "tick", check_rc=False)


def mode_powercut() -> None:
    state_file = f"{CTL}/powercut-boot"
    boot = int(open(state_file).read()) + 1 if os.path.exists(state_file) else 0
    with open(state_file, "w") as f:
        f.write(str(boot))
        f.flush()
        os.fsync(f.fileno())
    if boot == 0:
        sh("systemctl", "stop", UNIT)
        set_config("edge", http=True)
        add_tasks()
        for t in ("slow", "heartbeat", "wan-check", "ddns-update", "fail", "backup-config"):
            ql("task", "disable", t, check_rc=False)
        token = ql("token", "create", "--subject", "gate", "--role", "operator").stdout.strip().split()[-1]
        with open(f"{CTL}/token", "w") as f:
            f.write(token)
        sh("systemctl", "start", UNIT, check_rc=True)
    else:
        # The control disk's results of the boot before were written before the cut: keep them.
        prev = f"{CTL}/result-powercut.json"
        if os.path.exists(prev):
            try:
                old = json.load(open(prev))
                figures["powercut.boots"] = old.get("figures", {}).get("powercut.boots", [])
                for k, v in old.get("checks", {}).items():
                    if not v["ok"]:
                        checks[f"{k}@boot{old.get('boot')}"] = v
            except ValueError:
                pass
    powercut_check(boot)
    write_result("powercut", {"boot": boot})
    if os.path.exists(f"{CTL}/powercut-last"):
        return
    token = open(f"{CTL}/token").read().strip()
    stop = threading.Event()
    th = threading.Thread(target=load_client, args=(token, stop, f"{CTL}/acks.log"), daemon=True)
    th.start()
    ql("run", "start", "chatty", check_rc=False)
    # The host cuts the power at a random instant after this line: once the client has had a
    # few 202s, so that every cut falls among acknowledged starts.
    wait_for(lambda: ACKED[0] >= 3, 180, 0.5)
    say(f"LOAD RUNNING acked={ACKED[0]}")
    while True:
        time.sleep(5)
        ql("run", "start", "chatty", check_rc=False)


# ---------------------------------------------------------------- bench
def idle_share(seconds: float = 5.0) -> float:
    """The share of the guest's CPU time (all CPUs, /proc/stat) spent idle over ``seconds``."""
    def sample() -> tuple[int, int]:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        return v[3] + v[4], sum(v)
    i0, t0 = sample()
    time.sleep(seconds)
    i1, t1 = sample()
    return (i1 - i0) / max(1, t1 - t0)


def mode_bench() -> None:
    """bench/bench_guest.py's figures into figures["bench"], with the agent stopped and the boot's
    tail settled (a 5 s window ≥ 90 % idle, at most 240 s) so that the benches have the guest's
    CPUs to themselves; its arguments from bench-args.json."""
    sh("systemctl", "stop", UNIT, check_rc=True)
    t, last = time.monotonic(), [0.0]

    def quiet() -> bool:
        last[0] = idle_share()
        return last[0] >= 0.9

    wait_for(quiet, 240, 0)
    figures["bench.settled"] = {"waited_s": round(time.monotonic() - t, 1), "idle_share": round(last[0], 3),
                                "load": os.getloadavg()[0]}
    sys.path.insert(0, f"{CTL}/bench")
    import bench_guest
    with open(f"{CTL}/bench-args.json") as f:
        args = json.load(f)
    say(f"bench: {args}")
    figures["bench"] = bench_guest.in_guest(**args)


def write_result(mode: str, extra: dict | None = None) -> None:
    out = {"mode": mode, "guest": GUEST, "checks": checks, "figures": figures, "elapsed_s": round(time.monotonic() - T0, 1)}
    out.update(extra or {})
    tmp = f"{CTL}/result-{mode}.json.tmp"
    with open(tmp, "w") as f:
        json.dump(out, f, indent=1, default=str)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, f"{CTL}/result-{mode}.json")
    dfd = os.open(CTL, os.O_RDONLY)
    os.fsync(dfd)
    os.close(dfd)


def main() -> int:
    modes = sys.argv[1:] or open(f"{CTL}/modes").read().split()
    GUEST["uname"] = os.uname().release
    GUEST["machine"] = os.uname().machine
    GUEST["systemd"] = sh("systemctl", "--version").stdout.split("\n")[0]
    GUEST["cgroup"] = sh("stat", "-fc", "%T", "/sys/fs/cgroup").stdout.strip()
    GUEST["memtotal_kib"] = int(re.search(r"MemTotal:\s+(\d+)", open("/proc/meminfo").read()).group(1))
    GUEST["nproc"] = os.cpu_count()
    GUEST["uptime_at_gate_s"] = float(open("/proc/uptime").read().split()[0])
    GUEST["service_at_boot"] = show("ActiveState", "SubState", "MainPID")
    for mode in modes:
        checks.clear()
        t = time.monotonic()
        try:
            {"seed": mode_seed, "hog": mode_hog, "pid1": mode_pid1, "flash": mode_flash,
             "powercut": mode_powercut, "bench": mode_bench}[mode]()
        except Exception as e:  # noqa: BLE001
            import traceback
            check(f"{mode}.completed", False, traceback.format_exc()[-1500:])
        figures[f"{mode}.gate_s"] = round(time.monotonic() - t, 1)
        write_result(mode)
        figures.clear()
    return 0


if __name__ == "__main__":
    sys.exit(main())
