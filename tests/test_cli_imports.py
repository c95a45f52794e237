"""The CLI loads only what the command needs (issue 24 §3).

Each case runs the real ``qlagent`` entry in a fresh interpreter over a real state directory and
prints ``sys.modules`` at exit (``--help`` and ``--version`` leave through SystemExit), so every
module a command loaded on its way — parser, configuration, store, use case, output — is seen.
A read command on a router must not pay for the HTTP server, the dispatcher, the execution
engine, the service loop, the cluster or the fleet Worker.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from qlcli import ok

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FORBIDDEN = ("qlagent.http", "qlagent.dispatch", "qlagent.execution", "qlagent.application.engine",
             "qlagent.service.main", "qlagent.service.controlplane", "qlagent.service.worker_mode",
             "qlagent.cluster", "qlagent.core.cluster", "qlagent.worker",
             "qlagent.adapters.postgres", "qlagent.adapters.control_client", "qlagent.adapters.processes",
             "psycopg", "http.server", "socketserver", "selectors", "ssl")
PROBE = r'''
import atexit, json, os, sys
from qlagent.cli.main import main
atexit.register(lambda: open(os.environ["MODULES_OUT"], "w").write(json.dumps(sorted(sys.modules))))
sys.exit(main(sys.argv[1:]))
'''
TASK = b'''
[[task]]
name = "t"
schedule = "0 3 * * *"
command = ["/bin/true"]
'''


def modules_of(state: str, *args: str) -> tuple[subprocess.CompletedProcess, list[str]]:  # noqa: F811
    """Run ``qlagent --state-dir STATE ARGS``; (the process, the modules loaded by its exit)."""
    out = os.path.join(os.path.dirname(state), "modules.json")
    env = {k: v for k, v in os.environ.items() if not k.startswith("QLAGENT_")}
    p = subprocess.run([sys.executable, "-c", PROBE, "--state-dir", state, *args], cwd=REPO,
                       env={**env, "MODULES_OUT": out}, capture_output=True, timeout=60)
    with open(out) as f:
        return p, json.load(f)


@pytest.mark.parametrize("args,shows", [
    (["--version"], b"qlagent "),
    (["--help"], b"run "),
    (["run", "ls"], b"task_start"),
    (["task", "ls"], b"0 3 * * *"),
], ids=["--version", "--help", "run ls", "task ls"])
def test_a_read_command_loads_no_server_dispatcher_cluster_or_worker(state, tmp_path, args, shows):  # noqa: F811
    task = tmp_path / "t.toml"
    task.write_bytes(TASK)
    ok(state, "task", "add", "-f", str(task))
    ok(state, "run", "start", "t")
    p, loaded = modules_of(state, *args)
    assert p.returncode == 0 and shows in p.stdout, p.stderr
    assert [m for m in loaded if m.startswith(FORBIDDEN)] == []


def test_version_is_the_packages_and_exits_0():
    from qlagent import __version__
    p = subprocess.run([sys.executable, "-m", "qlagent.cli.main", "--version"], capture_output=True, timeout=60)
    assert (p.returncode, p.stdout, p.stderr) == (0, f"qlagent {__version__}\n".encode(), b"")
