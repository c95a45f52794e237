"""Budgets (issue 4 §7, field report F8): ``qlagent serve`` inside a REAL cgroup v1 memory+pids
budget (128 MiB / 64 PIDs, as the edge Profile), and the self-policed admission that refuses
new activations near the PID budget and says so in STATUS.
"""

from __future__ import annotations

import http.client
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from qlcli import js, ok
from servehelp import NotifyListener, add_tasks, runs_of, start_serve
from kit import clean_env, free_port, promtool_check, wait_until

MiB = 1_048_576
CG = "/sys/fs/cgroup"


def _cgroup_v1_available() -> bool:
    return os.geteuid() == 0 and all(os.access(f"{CG}/{c}", os.W_OK) for c in ("memory", "pids"))


def _read(ctrl_dir: str, name: str) -> str:
    with open(os.path.join(ctrl_dir, name)) as f:
        return f.read()


@pytest.fixture
def budget_cgroup():
    """memory and pids cgroups ``qlagent-test-PID`` with the edge budget; removed afterwards."""
    if not _cgroup_v1_available():
        pytest.skip("needs root and writable cgroup v1 memory+pids")
    name = f"qlagent-test-{os.getpid()}-{time.monotonic_ns()}"
    mem, pids = f"{CG}/memory/{name}", f"{CG}/pids/{name}"
    os.mkdir(mem)
    os.mkdir(pids)
    with open(f"{mem}/memory.limit_in_bytes", "w") as f:
        f.write(str(128 * MiB))
    with open(f"{pids}/pids.max", "w") as f:
        f.write("64")
    yield mem, pids
    for d in (pids, mem):
        for _ in range(50):
            for pid in _read(d, "cgroup.procs").split():
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except ProcessLookupError:
                    pass
            try:
                os.rmdir(d)
                break
            except OSError:
                time.sleep(0.1)


def _shim(mem: str, pids: str) -> list[str]:
    """A prefix that moves itself into both cgroups, then execs the agent (so the agent and
    everything it forks are inside the budget from the first instruction)."""
    code = ("import os, sys\n"
            f"for d in ({mem!r}, {pids!r}):\n"
            "    open(d + '/cgroup.procs', 'w').write(str(os.getpid()))\n"
            "os.execv(sys.argv[1], sys.argv[1:])\n")
    return [sys.executable, "-c", code]


def _settled_rss(proc, step: float = 0.2, timeout: float = 20.0) -> int:
    """``proc``'s RSS once two readings ``step`` s apart differ by under 256 KiB."""
    deadline = time.monotonic() + timeout
    last = proc.memory_info().rss
    while time.monotonic() < deadline:
        time.sleep(step)
        now = proc.memory_info().rss
        if abs(now - last) < 256 * 1024:
            return now
        last = now
    return last


def test_f8_flat_memory_under_a_128mib_64pid_cgroup(state, workdir, budget_cgroup):
    mem, pids = budget_cgroup
    add_tasks(state, workdir, '''
[[task]]
name = "flood"
timeout_s = 120
shell = "/bin/sh"
script = "head -c 209715200 /dev/zero | tr '\\\\0' x"
''')
    p = start_serve(state, env=clean_env(), prefix=_shim(mem, pids))
    try:
        agent = psutil.Process(p.pid)
        wait_until(lambda: str(p.pid) in _read(pids, "cgroup.procs").split())
        base = _settled_rss(agent)                        # past start-up imports, however slow the box
        run_id = ok(state, "run", "start", "flood").stdout.decode().strip()
        peaks = {p.pid: base}
        bases: dict[int, int] = {}
        while dict(runs_of(state, "flood"))[run_id] in ("queued", "starting", "running"):
            for proc in [agent, *agent.children(recursive=True)]:
                try:
                    if proc.name().startswith("python"):   # the agent and the run's shim
                        rss = proc.memory_info().rss
                        bases.setdefault(proc.pid, rss)
                        peaks[proc.pid] = max(peaks.get(proc.pid, 0), rss)
                except psutil.Error:
                    continue
            time.sleep(0.02)
        assert len(bases) >= 2, "the shim was never sampled"
        for pid, peak in peaks.items():
            grew = peak - bases.get(pid, base)
            assert grew < 8 * MiB, f"pid {pid} grew {grew / MiB:.1f} MiB while 200 MB passed"
        assert p.poll() is None
    finally:
        assert p.stop() == 0
    oom = dict(line.split() for line in _read(mem, "memory.oom_control").splitlines())
    assert oom.get("oom_kill", "0") == "0" and oom["under_oom"] == "0"
    assert int(_read(mem, "memory.max_usage_in_bytes")) < 128 * MiB
    assert _read(pids, "pids.events").split() == ["max", "0"]      # no fork ever failed
    run = js(state, "run", "show", run_id)
    assert run["state"] == "succeeded"
    (attempt,) = run["attempts"]
    assert attempt["bytesKept"] == 4 * MiB and attempt["truncated"]
    assert attempt["bytesKept"] + attempt["bytesDropped"] == 209_715_200
    log = ok(state, "run", "logs", run_id).stdout
    assert len(log) == 4 * MiB and set(log) == {ord("x")}


def test_pid_budget_refuses_activations_and_says_so_in_status(state, workdir, budget_cgroup):
    mem, pids = budget_cgroup
    add_tasks(state, workdir, '''
[[task]]
name = "job"
command = ["/bin/true"]
''')
    listener = NotifyListener(workdir)
    p = start_serve(state, env=clean_env(NOTIFY_SOCKET=listener.path), prefix=_shim(mem, pids))
    fillers: list[subprocess.Popen] = []
    try:
        listener.wait_for(lambda m: m == "READY=1")
        # Other tenants of the same budget bring pids.current to 61: one more Run (≈ 4 PIDs)
        # would pass it, so the agent must refuse to activate.
        while int(_read(pids, "pids.current")) < 61:
            f = subprocess.Popen(["/bin/sleep", "120"])
            with open(f"{pids}/cgroup.procs", "w") as fh:
                fh.write(str(f.pid))
            fillers.append(f)
        ok(state, "run", "start", "job")
        listener.wait_for(lambda m: m.startswith("STATUS=") and "blocked=pids" in m)
        assert runs_of(state, "job")[0][1] == "queued"
        assert "max 0" in _read(pids, "pids.events")          # refused before any fork failed
        for f in fillers:
            f.kill()
            f.wait()
        fillers.clear()
        ok(state, "run", "start", "job")                       # the poke re-checks the budget
        wait_until(lambda: [s for _, s in runs_of(state, "job")] == ["succeeded"] * 2, timeout=15)
    finally:
        for f in fillers:
            f.kill()
            f.wait()
        assert p.stop() == 0
        listener.close()
    assert "dispatch.refused reason=pids" in p.journal()


def test_block_reason_on_a_small_profile():
    """BudgetMeter against a real process tree (this test process, outside any budget cgroup
    of its own or inside one: either way the figures are real)."""
    import msgspec

    from qlagent.core.profiles import EDGE
    from qlagent.adapters.budget import BudgetMeter
    me = psutil.Process()
    mine = len([me, *me.children(recursive=True)])
    roomy = msgspec.structs.replace(EDGE, pids=10_000, memory_bytes=1 << 40)
    assert BudgetMeter(roomy).block_reason() is None
    children = [subprocess.Popen(["/bin/sleep", "30"]) for _ in range(6)]
    try:
        m = BudgetMeter(msgspec.structs.replace(roomy, pids=mine + 6 + 3))
        u = m.usage()
        if m.cgroup is None or m.cgroup.pids_dir is None:   # counted from the tree: exactly us + 6
            assert u.pids == mine + 6
        assert m.block_reason() == "pids"
        tight_mem = msgspec.structs.replace(roomy, memory_bytes=u.rss_bytes)
        assert BudgetMeter(tight_mem).block_reason() == "memory"
    finally:
        for c in children:
            c.kill()
            c.wait()


def test_the_tree_from_the_children_files_is_the_one_psutil_finds_by_every_process_parent():
    """The budget walks the service tree through /proc/<pid>/task/<tid>/children; a kernel
    without them (CONFIG_PROC_CHILDREN off, OpenWrt) gets psutil's scan of every process's
    parent instead: both name the same processes, grandchildren and a second thread's child
    included."""
    import threading

    from qlagent.adapters.budget import _psutil_tree, _tree
    tree = subprocess.Popen(["/bin/sh", "-c", "sleep 30 & sleep 30 & wait"])
    from_thread = []
    t = threading.Thread(target=lambda: from_thread.append(subprocess.Popen(["/bin/sleep", "30"])))
    t.start()
    t.join()
    grandchildren = []
    try:
        wait_until(lambda: len(psutil.Process(tree.pid).children()) == 2)
        grandchildren = psutil.Process(tree.pid).children()
        walked = _tree(os.getpid())
        assert walked is not None, "this kernel has no children files"
        assert sorted(walked) == sorted(_psutil_tree(os.getpid()))
        assert {tree.pid, from_thread[0].pid} | {c.pid for c in grandchildren} <= set(walked)
    finally:
        for c in grandchildren:
            c.kill()
        for p in (tree, *from_thread):
            p.kill()
            p.wait()


# --- the service cgroup's own figures (issue 22 §2) -------------------------------------------

def _spawn_in(dirs, argv):
    """A process moved into each of ``dirs`` (cgroup directories) before it execs ``argv``."""
    code = ("import os, sys\n"
            "for d in sys.argv[1].split(':'):\n"
            "    open(d + '/cgroup.procs', 'w').write(str(os.getpid()))\n"
            "os.execv(sys.argv[2], sys.argv[2:])\n")
    return subprocess.Popen([sys.executable, "-c", code, ":".join(dirs), *argv])


def test_v1_figures_are_the_kernels_of_the_service_cgroup(budget_cgroup):
    """A process in a real v1 memory+pids pair named for the agent: the meter reads that pair
    (pids.current, total_rss, limits, OOM kills), not psutil."""
    from qlagent.adapters.budget import BudgetMeter, find_service_cgroup
    from qlagent.core.profiles import EDGE
    mem, pids = budget_cgroup
    with open(f"{pids}/pids.max", "w") as f:
        f.write("40")
    p = _spawn_in([mem, pids], ["/bin/sh", "-c", "sleep 60 & sleep 60 & wait"])
    try:
        wait_until(lambda: int(_read(pids, "pids.current")) == 3)
        cg = find_service_cgroup(proc_cgroup=f"/proc/{p.pid}/cgroup")
        assert (cg.version, cg.memory_dir, cg.pids_dir) == (1, mem, pids)
        m = BudgetMeter(EDGE, cgroup=cg)
        u = m.usage()
        assert (u.source, u.pids, u.pids_max, u.memory_max, u.oom_kills) == ("cgroup v1", 3, 40, 128 * MiB, 0)
        assert 0 < u.rss_bytes <= u.current_bytes <= u.peak_bytes < 128 * MiB
        assert m.limits(u) == (128 * MiB, 40)          # the kernel's lower pids.max, the Profile's memory
        assert m.block_reason() is None
        with open(f"{pids}/pids.max", "w") as f:
            f.write("6")                                # 3 + one Run's 4 would pass it
        assert m.block_reason() == "pids"
    finally:
        p.kill()
        p.wait()


def _v2_tree(root, leaf: str, files: dict[str, str]):
    """The files of a cgroup v2 mount at ``root`` with the service at system.slice/qlagent.service,
    and a /proc/PID/cgroup naming ``leaf`` under it (a last resort: this host binds memory and
    pids to v1, so a real v2 memory cgroup exists only in the VM guest's gates)."""
    (root / "cgroup.controllers").write_text("cpu memory pids\n")
    svc = root / "system.slice" / "qlagent.service"
    (svc / "agent").mkdir(parents=True)
    for name, text in files.items():
        (svc / name).write_text(text)
    proc = root / "proc-cgroup"
    proc.write_text(f"0::/system.slice/qlagent.service{leaf}\n")
    return svc, str(proc)


V2_FILES = {"memory.current": "70000000\n", "memory.peak": "90000000\n", "memory.max": "67108864\n",
            "memory.events": "low 0\nhigh 0\nmax 12\noom 2\noom_kill 2\noom_group_kill 1\n",
            "memory.stat": "anon 50331648\nfile 19668352\nkernel 1000\n", "pids.current": "7\n", "pids.max": "max\n"}


@pytest.mark.parametrize("leaf", ["", "/agent"])
def test_v2_figures_are_read_from_the_service_cgroup_not_psutil(tmp_path, leaf):
    from qlagent.adapters.budget import BudgetMeter, find_service_cgroup
    from qlagent.core.profiles import EDGE
    svc, proc = _v2_tree(tmp_path, leaf, V2_FILES)
    cg = find_service_cgroup(str(tmp_path), proc)
    assert (cg.version, cg.memory_dir, cg.pids_dir) == (2, str(svc), str(svc))
    m = BudgetMeter(EDGE, cgroup=cg)
    u = m.usage()
    assert (u.source, u.rss_bytes, u.current_bytes, u.peak_bytes, u.oom_kills, u.pids) == (
        "cgroup v2", 50331648, 70000000, 90000000, 2, 7)
    assert (u.memory_max, u.pids_max) == (64 * MiB, None)
    assert m.limits(u) == (64 * MiB, 64)                # MemoryMax=64M under the edge 128 MiB
    assert m.block_reason() is None                     # 48 MiB anon of 64: under 85 %
    (svc / "memory.stat").write_text("anon 57671680\nfile 0\n")   # 55 MiB: over 85 % of 64
    assert m.block_reason() == "memory"


def test_v2_cgroup_of_a_stranger_or_without_controllers_is_not_the_budget(tmp_path):
    from qlagent.adapters.budget import find_service_cgroup
    (tmp_path / "cgroup.controllers").write_text("cpu\n")
    (tmp_path / "user.slice" / "session-1.scope").mkdir(parents=True)
    (tmp_path / "user.slice" / "session-1.scope" / "memory.current").write_text("1\n")
    proc = tmp_path / "proc-cgroup"
    proc.write_text("0::/user.slice/session-1.scope\n")
    assert find_service_cgroup(str(tmp_path), str(proc)) is None          # a CI job's scope is not ours
    (tmp_path / "system.slice" / "qlagent.service").mkdir(parents=True)
    proc.write_text("0::/system.slice/qlagent.service\n")
    assert find_service_cgroup(str(tmp_path), str(proc)) is None          # ours, but no memory/pids files


def test_doctor_budget_line_reads_the_running_services_v1_cgroup(budget_cgroup, tmp_path):
    """`doctor` runs outside the service: it reads the packaged place (system.slice/qlagent.service)
    — here real v1 cgroups under a root whose memory/ and pids/ point at the test's pair."""
    from qlagent.adapters.budget import budget_check
    from qlagent.core.profiles import EDGE
    mem, pids = budget_cgroup
    for ctrl, d in (("memory", mem), ("pids", pids)):
        os.makedirs(f"{d}/system.slice/qlagent.service")
        os.symlink(d, tmp_path / ctrl)
    try:
        with open(f"{pids}/system.slice/qlagent.service/pids.max", "w") as f:
            f.write("64")
        with open(f"{mem}/system.slice/qlagent.service/memory.limit_in_bytes", "w") as f:
            f.write(str(128 * MiB))
        ok_, detail = budget_check(EDGE, True, str(tmp_path))
        assert ok_ and detail == (f"cgroup v1 {tmp_path}/memory/system.slice/qlagent.service: memory 0 MiB (peak 0, "
                                  "anon 0) of 128, pids 0 of 64, 0 OOM kills"), detail
        with open(f"{pids}/system.slice/qlagent.service/pids.max", "w") as f:
            f.write("max")
        ok_, detail = budget_check(EDGE, True, str(tmp_path))
        assert not ok_ and detail.endswith("; the kernel enforces no pids limit within the edge profile")
    finally:
        for d in (mem, pids):
            os.rmdir(f"{d}/system.slice/qlagent.service")
            os.rmdir(f"{d}/system.slice")


def test_doctor_budget_line_on_v2(tmp_path):
    from qlagent.adapters.budget import budget_check
    from qlagent.core.profiles import EDGE
    svc, _ = _v2_tree(tmp_path, "", V2_FILES)
    ok_, detail = budget_check(EDGE, True, str(tmp_path))
    assert not ok_ and detail == (f"cgroup v2 {svc}: memory 66 MiB (peak 85, anon 48) of 64, pids 7 of max, "
                                  "2 OOM kills; the kernel enforces no pids limit within the edge profile")


# --- a runaway task never takes the agent down (issue 22 §3) ----------------------------------

def _oom_kills(port: int) -> float | None:
    """``qlagent_service_oom_kills_total`` of the agent's ``GET /metrics`` on ``port`` (None:
    not in the document), the document checked by Prometheus's parser and linter."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", "/metrics")
        resp = conn.getresponse()
        text = resp.read().decode()
        assert resp.status == 200, text
    finally:
        conn.close()
    promtool_check(text)
    return next((s.value for f in text_string_to_metric_families(text) for s in f.samples
                 if s.name == "qlagent_service_oom_kills_total"), None)


def test_a_hog_in_the_agents_64mib_v1_cgroup_is_killed_not_the_agent_and_the_run_says_oom_killed(
        state, workdir, budget_cgroup):
    """No cgroup of its own for the Run (cgroup v1 host): the agent, its shim and a task that
    allocates 200 MiB share one 64 MiB memory cgroup. The kernel kills the task (oom_score_adj
    1000; the shim 500), the agent lives on and runs the next Task, and the Run ends failed with
    reason oom_killed in `run show`, its JSON and the journal; the agent's /metrics counts the
    kill (``qlagent_service_oom_kills_total`` 0 → 1)."""
    mem, pids = budget_cgroup
    with open(f"{mem}/memory.limit_in_bytes", "w") as f:
        f.write(str(64 * MiB))
    cfg = os.path.join(workdir, "qlagent.toml")
    with open(cfg, "w") as f:
        f.write("[http]\nmetrics = true\n")
    port = free_port()
    add_tasks(state, workdir, f'''
[[task]]
name = "hog"
timeout_s = 60
command = ["{sys.executable}", "-c", "import time\\nb = []\\nfor _ in range(200):\\n    b.append(b'x' * 1048576)\\ntime.sleep(60)"]

[[task]]
name = "peek"
command = ["/bin/sh", "-c", "cat /proc/self/oom_score_adj /proc/$PPID/oom_score_adj"]
''')
    listener = NotifyListener(workdir)
    p = start_serve(state, "--listen", f"127.0.0.1:{port}", env=clean_env(NOTIFY_SOCKET=listener.path,
                                                                          QLAGENT_CONFIG=cfg), prefix=_shim(mem, pids))
    try:
        listener.wait_for(lambda m: m == "READY=1")
        assert _oom_kills(port) == 0
        peek = ok(state, "run", "start", "peek").stdout.decode().strip()
        wait_until(lambda: dict(runs_of(state, "peek"))[peek] == "succeeded", timeout=20)
        # sh execs its one command: `cat` is the task, its parent the shim.
        assert ok(state, "run", "logs", peek).stdout.split() == [b"1000", b"500"]
        run_id = ok(state, "run", "start", "hog").stdout.decode().strip()
        wait_until(lambda: dict(runs_of(state, "hog"))[run_id] not in ("queued", "starting", "running"), timeout=60)
        assert p.poll() is None, "the agent was killed"
        run = js(state, "run", "show", run_id)
        (attempt,) = run["attempts"]
        assert (run["state"], attempt["signal"], attempt["failureReason"]) == ("failed", 9, "oom_killed")
        assert "reason=oom_killed" in ok(state, "run", "show", run_id).stdout.decode()
        again = ok(state, "run", "start", "peek").stdout.decode().strip()
        wait_until(lambda: dict(runs_of(state, "peek"))[again] == "succeeded", timeout=20)
        # STATUS reads the kernel's figures of the agent's cgroup: the limit is the cgroup's 64 MiB.
        listener.wait_for(lambda m: m.startswith("STATUS=") and "/64MiB" in m and "oom_kills=1" in m)
        wait_until(lambda: _oom_kills(port) == 1, 10, "the kill counted on /metrics")
    finally:
        assert p.stop() == 0
        listener.close()
    oom = dict(line.split() for line in _read(mem, "memory.oom_control").splitlines())
    assert int(oom["oom_kill"]) >= 1
    journal = p.journal()
    assert f"run.failed run={run_id}" in journal and "reason=oom_killed" in journal


# --- each Run in a cgroup of its own, on this host's real cgroup v2 hierarchy -------------------

UNIFIED = "/sys/fs/cgroup/unified"


@pytest.fixture
def v2_service_cgroup():
    """A cgroup ``qlagent-test-…`` in this host's real cgroup v2 hierarchy (hybrid: no memory or
    pids controller here, so limits are the VM guest's to prove; placement, the agent's leaf,
    re-attach and removal are real). Removed afterwards, with whatever is left in it."""
    if os.geteuid() != 0 or not os.path.exists(f"{UNIFIED}/cgroup.procs"):
        pytest.skip("needs root and a cgroup v2 hierarchy at /sys/fs/cgroup/unified")
    d = f"{UNIFIED}/qlagent-test-{os.getpid()}-{time.monotonic_ns()}"
    os.mkdir(d)
    yield d
    for _ in range(50):
        for sub in [os.path.join(d, n) for n in os.listdir(d) if os.path.isdir(os.path.join(d, n))] + [d]:
            for pid in _read(sub, "cgroup.procs").split():
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except ProcessLookupError:
                    pass
        try:
            for n in os.listdir(d):
                if os.path.isdir(os.path.join(d, n)):
                    os.rmdir(os.path.join(d, n))
            os.rmdir(d)
            break
        except OSError:
            time.sleep(0.1)


def _cgroup_of(pid: int) -> str:
    with open(f"/proc/{pid}/cgroup") as f:
        return next(ln.split("::", 1)[1].strip() for ln in f if ln.startswith("0::"))


def test_each_run_has_its_own_v2_cgroup_the_agent_a_leaf_and_reattach_keeps_it(state, workdir, v2_service_cgroup):
    s = v2_service_cgroup
    name = "/" + os.path.basename(s)
    add_tasks(state, workdir, '''
[[task]]
name = "where"
command = ["/bin/sh", "-c", "grep ^0:: /proc/self/cgroup"]

[[task]]
name = "napper"
command = ["/bin/sleep", "4"]
''')
    prefix = [sys.executable, "-c", "import os, sys\n"
              f"open({s!r} + '/cgroup.procs', 'w').write(str(os.getpid()))\n"
              "os.execv(sys.argv[1], sys.argv[1:])\n"]
    p = start_serve(state, env=clean_env(), prefix=prefix)
    try:
        # No process may stay in the service cgroup itself: the agent moved into its leaf.
        wait_until(lambda: _cgroup_of(p.pid) == f"{name}/agent")
        assert _read(s, "cgroup.procs").split() == []
        rid = ok(state, "run", "start", "where").stdout.decode().strip()
        wait_until(lambda: dict(runs_of(state, "where"))[rid] == "succeeded", timeout=20)
        attempt = js(state, "run", "show", rid)["attempts"][0]["attemptId"]
        assert ok(state, "run", "logs", rid).stdout.decode().strip() == f"0::{name}/run-{attempt}"
        wait_until(lambda: not os.path.exists(f"{s}/run-{attempt}"))          # removed after the Run
        nap = ok(state, "run", "start", "napper").stdout.decode().strip()
        wait_until(lambda: dict(runs_of(state, "napper"))[nap] == "running", timeout=20)
        nap_attempt = js(state, "run", "show", nap)["attempts"][0]["attemptId"]
        (sleeper,) = [int(x) for x in _read(f"{s}/run-{nap_attempt}", "cgroup.procs").split()]
        shim = psutil.Process(sleeper).ppid()
        assert _cgroup_of(shim) == f"{name}/agent"          # the shim stays with the agent
        p.kill()                                            # the agent crashes; the Run goes on
        p.wait()
        p = start_serve(state, env=clean_env(), prefix=prefix)
        wait_until(lambda: dict(runs_of(state, "napper"))[nap] == "succeeded", timeout=20)
        wait_until(lambda: not os.path.exists(f"{s}/run-{nap_attempt}"))
        assert _cgroup_of(p.pid) == f"{name}/agent"
    finally:
        assert p.stop() == 0
    assert "service.run_cgroups detail=\"run cgroups under " in p.journal()


def test_run_cgroup_gets_the_runs_limit_and_oom_group_where_memory_is_delegated(tmp_path):
    """The files a delegated v2 subtree with the memory controller has (a fixture tree: this host
    binds memory to v1): the Run's memory.max, memory.oom.group = 1, no swap; removed after."""
    from qlagent.adapters.runcgroup import RunCgroups
    svc, proc = _v2_tree(tmp_path, "/agent", V2_FILES)
    (svc / "cgroup.controllers").write_text("cpu memory pids\n")
    (svc / "cgroup.procs").write_text("")
    rc = RunCgroups.setup(proc, str(tmp_path))
    assert rc.enabled and rc.memory and (svc / "cgroup.subtree_control").read_text() == "+memory +pids"
    os.mkdir(svc / "run-a1")                  # the kernel makes a new cgroup's files
    (svc / "run-a1" / "memory.swap.max").write_text("max\n")
    assert rc.create("a1", 48 * MiB) == str(svc / "run-a1")
    assert [(svc / "run-a1" / f).read_text() for f in ("memory.max", "memory.oom.group", "memory.swap.max")] == \
        [str(48 * MiB), "1", "0"]
    for f in os.listdir(svc / "run-a1"):
        os.unlink(svc / "run-a1" / f)           # the kernel's files vanish with the cgroup
    rc.remove("a1")
    assert not (svc / "run-a1").exists()


def test_on_a_read_only_cgroup_mount_runs_get_no_cgroup_and_the_reason_says_so(tmp_path):
    """As under systemd's ProtectControlGroups=yes (a read-only /sys/fs/cgroup): a real read-only
    mount; the agent stays where it is and Runs fall back to oom_score_adj."""
    from qlagent.adapters.runcgroup import RunCgroups
    if os.geteuid() != 0:
        pytest.skip("needs root to mount")
    ro = tmp_path / "ro"
    ro.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "none", str(ro)], check=True)
    try:
        svc, proc = _v2_tree(ro, "", V2_FILES)
        (svc / "cgroup.controllers").write_text("memory pids\n")
        subprocess.run(["mount", "-o", "remount,ro", str(ro)], check=True)
        rc = RunCgroups.setup(proc, str(ro))
        assert not rc.enabled and rc.reason == f"{svc}: Read-only file system"
        assert rc.create("a1", None) is None and not (svc / "run-a1").exists()
    finally:
        subprocess.run(["umount", str(ro)], check=True)


def test_a_lost_runs_cgroup_is_emptied_even_of_an_untagged_daemon(tmp_path, monkeypatch):
    """Shim SIGKILLed, then the agent restarts: the Run is lost and everything it started must
    stop. A daemon that dropped the run's environment (``env -i``) and left its session
    (``setsid``) is found by neither its tag nor its process group, but it still sits in the
    Run's cgroup (a real cgroup2 mount, no controllers: this host binds them to v1)."""
    from execkit import Bench, task
    from qlagent.adapters.runcgroup import RunCgroups
    if os.geteuid() != 0:
        pytest.skip("needs root to mount cgroup2")
    mnt = tmp_path / "cg"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "cgroup2", "none", str(mnt)], check=True)
    svc = mnt / f"qlagent-test-{os.getpid()}"
    svc.mkdir()
    rc = RunCgroups(str(svc))
    rc._enable(str(mnt))                      # the agent stays where it is (no leaf move)
    monkeypatch.setattr(RunCgroups, "setup", classmethod(lambda cls, *a, **k: rc))
    root = str(tmp_path / "s")
    daemon = None
    try:
        assert rc.enabled, rc.reason
        b = Bench(root)
        b.add(task("de", "env -i /usr/bin/setsid /bin/sleep 3335 &\nsleep 60\n", timeout_s=120))
        rid = b.start("de")
        b.drive(lambda: b.run(rid).state == "running")
        (att,) = b.store.live_attempts()
        cg = svc / f"run-{att.attempt_id}"
        end = time.monotonic() + 5
        while daemon is None:
            assert time.monotonic() < end, "the daemon did not start"
            daemon = next((psutil.Process(int(p)) for p in (cg / "cgroup.procs").read_text().split()
                           if psutil.Process(int(p)).cmdline()[-1:] == ["3335"]), None)
            time.sleep(0.05)
        os.kill(att.shim_pid, signal.SIGKILL)
        b.close()
        again = Bench(root)
        try:
            assert again.engine.recover()["lost"] == 1
        finally:
            again.close()
        end = time.monotonic() + 3
        while daemon.is_running() and daemon.status() != psutil.STATUS_ZOMBIE:
            assert time.monotonic() < end, "the daemon outlived its lost Run"
            time.sleep(0.05)
    finally:
        for d in [svc / n for n in os.listdir(svc)] + [svc]:
            if d.is_dir():
                for p in (d / "cgroup.procs").read_text().split():
                    os.kill(int(p), signal.SIGKILL)
        time.sleep(0.2)
        for d in [svc / n for n in os.listdir(svc) if (svc / n).is_dir()] + [svc]:
            try:
                os.rmdir(d)
            except OSError:
                pass
        subprocess.run(["umount", "-l", str(mnt)], check=False)
