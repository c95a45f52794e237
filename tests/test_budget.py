"""Budgets (issue 4 §7, field report F8): ``qlagent serve`` inside a REAL cgroup v1 memory+pids
budget (128 MiB / 64 PIDs, as the edge Profile), and the self-policed admission that refuses
new activations near the PID budget and says so in STATUS.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from qlcli import js, ok, state, workdir  # noqa: F401  (fixtures)
from servehelp import NotifyListener, add_tasks, clean_env, runs_of, start_serve, stop, wait_until

MiB = 1_048_576
CG = "/sys/fs/cgroup"


def _cgroup_v1_available() -> bool:
    return os.geteuid() == 0 and all(os.access(f"{CG}/{c}", os.W_OK) for c in ("memory", "pids"))


pytestmark = pytest.mark.skipif(not _cgroup_v1_available(), reason="needs root and writable cgroup v1 memory+pids")


def _read(ctrl_dir: str, name: str) -> str:
    with open(os.path.join(ctrl_dir, name)) as f:
        return f.read()


@pytest.fixture
def budget_cgroup():
    """memory and pids cgroups ``qlagent-test-PID`` with the edge budget; removed afterwards."""
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


def test_f8_flat_memory_under_a_128mib_64pid_cgroup(state, workdir, budget_cgroup):  # noqa: F811
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
        time.sleep(0.3)                                   # past start-up imports
        base = agent.memory_info().rss
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
        assert stop(p) == 0
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


def test_pid_budget_refuses_activations_and_says_so_in_status(state, workdir, budget_cgroup):  # noqa: F811
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
        assert stop(p) == 0
        listener.close()
    assert b"dispatch.refused reason=pids" in p.stderr.read()


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
        if m._pids_file is None:                    # counted from the tree: exactly us + 6
            assert u.pids == mine + 6
        assert m.block_reason() == "pids"
        tight_mem = msgspec.structs.replace(roomy, memory_bytes=u.rss_bytes)
        assert BudgetMeter(tight_mem).block_reason() == "memory"
    finally:
        for c in children:
            c.kill()
            c.wait()
