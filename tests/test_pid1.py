"""``qlagent serve`` as PID 1 of a PID namespace (a container's init): it reaps the orphans the
kernel re-parents to it — a ``keep_orphans`` task's daemon, processes ``nsenter`` left — and a
SIGTERM still drains and exits 0. Real ``unshare --pid --fork --mount-proc``, real shims.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess

import pytest
from qlcli import ok
from servehelp import add_tasks, runs_of
from kit import Serve, wait_until

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None
                                or shutil.which("nsenter") is None,
                                reason="needs root, unshare and nsenter (util-linux) for a PID namespace")


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(x) for x in f.read().split()]


def _is_fork_server(pid: int) -> bool:
    """The agent's one long-lived child: ``python -I -S …/.shim-<key>.pyc`` (processes.ForkServer)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"/.shim-" in f.read()
    except OSError:
        return False


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def _zombies(pid: int) -> list[int]:
    out = []
    for c in _children(pid):
        try:
            if _state(c) == "Z":
                out.append(c)
        except OSError:
            continue
    return out


def test_serve_as_pid_1_reaps_reparented_orphans_and_drains_on_sigterm(tmp_path):
    state, work = str(tmp_path / "st"), str(tmp_path)
    ok(state, "init")
    add_tasks(state, work, '''
[[task]]
name = "orphan"
keep_orphans = true
shell = "/bin/sh"
script = "sleep 1 & echo left"

[[task]]
name = "longrun"
shell = "/bin/sh"
script = "sleep 3; echo done"
''')
    u = Serve("--state-dir", state, prefix=("unshare", "--pid", "--fork", "--mount-proc"))
    try:
        (agent,) = _children(u.pid)                     # unshare's one child: the agent, PID 1 inside
        with open(f"/proc/{agent}/status") as f:
            assert [ln for ln in f if ln.startswith("NSpid:")][0].split()[-1] == "1"
        ok(state, "run", "start", "orphan")
        subprocess.run(["nsenter", "-t", str(agent), "-p", "-m", "--", "sh", "-c",
                        "sleep 0.5 & sleep 0.5 & sleep 0.5 & exit 0"], check=True)
        wait_until(lambda: runs_of(state, "orphan")[-1][1] == "succeeded", 30)
        # Every orphan has ended by now (each slept ≤ 1 s); as PID 1 the agent must have reaped them.
        # Its one child left is the fork server, which outlives runs by design.
        wait_until(lambda: not _zombies(agent) and not [c for c in _children(agent) if not _is_fork_server(c)],
                   15, "the orphans reaped", step=0.2)
        run_id = ok(state, "run", "start", "longrun").stdout.decode().strip()
        wait_until(lambda: dict(runs_of(state, "longrun"))[run_id] == "running", 30)
        os.kill(agent, signal.SIGTERM)
        assert u.wait(60) == 0
        err = u.journal()
        assert "service.draining" in err and "service.stopped" in err, err[-2000:]
        assert dict(runs_of(state, "longrun"))[run_id] == "succeeded"
    finally:
        u.kill()
