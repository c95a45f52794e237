"""Network-gated admission (issue 4 §6) in a network namespace made by the test.

``qlagent serve`` runs inside the namespace (``ip netns exec``); the namespace has a veth pair
of its own and no default route. A gated Run waits in the queue with no process while the
condition is false and starts within 1 s of it becoming true (netlink events, no polling).
The resident agent never imports pyroute2 (~23 MB): the gate is a netlink wake-up socket plus
/proc and /sys reads; the tests create routes and links with iproute2.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import psutil
import pytest

from qlcli import ok
from servehelp import NotifyListener, add_tasks, runs_of, start_serve
from kit import clean_env, qlagent_argv, wait_until

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("ip"), reason="needs root and iproute2")


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


@pytest.fixture
def netns():
    """A namespace with lo up and a veth pair (v0 10.200.0.1/24 up, v1 down); no default route."""
    name = f"qlt{os.getpid()}{time.monotonic_ns() % 100000}"
    ip("netns", "add", name)
    try:
        ip("-n", name, "link", "set", "lo", "up")
        ip("-n", name, "link", "add", "v0", "type", "veth", "peer", "name", "v1")
        ip("-n", name, "addr", "add", "10.200.0.1/24", "dev", "v0")
        ip("-n", name, "link", "set", "v0", "up")
        yield name
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)


def _serve_in(netns, state, listener):
    p = start_serve(state, env=clean_env(NOTIFY_SOCKET=listener.path), prefix=["ip", "netns", "exec", netns])
    listener.wait_for(lambda m: m == "READY=1")
    return p


def _agent(p: subprocess.Popen) -> psutil.Process:
    """``ip netns exec`` execs the agent in place: the Popen pid is the agent."""
    agent = psutil.Process(p.pid)
    assert "qlagent.cli.main" in agent.cmdline()
    return agent


def _time_to_leave_queue(state, task, run_id, change) -> float:
    t0 = time.monotonic()
    change()
    wait_until(lambda: dict(runs_of(state, task))[run_id] != "queued", timeout=5, step=0.01)
    return time.monotonic() - t0


def test_default_route_gate_waits_then_starts_within_1s(state, workdir, netns):
    add_tasks(state, workdir, '''
[[task]]
name = "online"
network = "default_route"
command = ["/bin/sleep", "0.2"]
''')
    listener = NotifyListener(workdir)
    p = _serve_in(netns, state, listener)
    try:
        run_id = ok(state, "run", "start", "online").stdout.decode().strip()
        time.sleep(1.0)                       # plenty for an ungated Run to have started
        assert dict(runs_of(state, "online"))[run_id] == "queued"
        assert _agent(p).children(recursive=True) == []       # no process for a waiting Run
        took = _time_to_leave_queue(state, "online", run_id,
                                    lambda: ip("-n", netns, "route", "add", "default", "via", "10.200.0.2"))
        assert took < 1.0, took
        wait_until(lambda: dict(runs_of(state, "online"))[run_id] == "succeeded")
        # and the route going away gates the next Run again
        ip("-n", netns, "route", "del", "default")
        second = ok(state, "run", "start", "online").stdout.decode().strip()
        time.sleep(0.7)
        assert dict(runs_of(state, "online"))[second] == "queued"
    finally:
        assert p.stop() == 0
        listener.close()


def test_ipv6_default_route_opens_the_gate_within_1s(state, workdir, netns):
    """An IPv6-only uplink (no IPv4 default route at all) is a default route too."""
    ip("netns", "exec", netns, "sysctl", "-q", "-w", "net.ipv6.conf.all.disable_ipv6=0")
    ip("-n", netns, "-6", "addr", "add", "fd00:200::1/64", "dev", "v0", "nodad")
    add_tasks(state, workdir, '''
[[task]]
name = "online6"
network = "default_route"
command = ["/bin/true"]
''')
    listener = NotifyListener(workdir)
    p = _serve_in(netns, state, listener)
    try:
        run_id = ok(state, "run", "start", "online6").stdout.decode().strip()
        time.sleep(1.0)
        assert dict(runs_of(state, "online6"))[run_id] == "queued"
        took = _time_to_leave_queue(state, "online6", run_id,
                                    lambda: ip("-n", netns, "-6", "route", "add", "default", "via", "fd00:200::2",
                                               "dev", "v0"))
        assert took < 1.0, took
        wait_until(lambda: dict(runs_of(state, "online6"))[run_id] == "succeeded")
    finally:
        assert p.stop() == 0
        listener.close()


def test_interface_gate_follows_link_state(state, workdir, netns):
    add_tasks(state, workdir, '''
[[task]]
name = "on-v1"
network = "interface:v1"
command = ["/bin/true"]
''')
    listener = NotifyListener(workdir)
    p = _serve_in(netns, state, listener)
    try:
        run_id = ok(state, "run", "start", "on-v1").stdout.decode().strip()
        time.sleep(1.0)
        assert dict(runs_of(state, "on-v1"))[run_id] == "queued"
        took = _time_to_leave_queue(state, "on-v1", run_id, lambda: ip("-n", netns, "link", "set", "v1", "up"))
        assert took < 1.0, took
        wait_until(lambda: dict(runs_of(state, "on-v1"))[run_id] == "succeeded")
        # the link going down again gates the next Run
        ip("-n", netns, "link", "set", "v1", "down")
        second = ok(state, "run", "start", "on-v1").stdout.decode().strip()
        time.sleep(0.7)
        assert dict(runs_of(state, "on-v1"))[second] == "queued"
    finally:
        assert p.stop() == 0
        listener.close()


PROBE = r'''
import sys
from qlagent.service.config import resolve
from qlagent.service.main import Service
svc = Service(resolve(state_dir=sys.argv[1]), exit_after_s=0.2)
assert svc.run() == 0
print(svc.netgate is not None, "pyroute2" in sys.modules or "asyncio" in sys.modules)
'''


@pytest.mark.parametrize("gated", [False, True])
def test_gate_runs_without_pyroute2(state, workdir, gated):
    """The real Service start-up (store, recovery, scheduler, loop, drain) in a fresh
    interpreter: the gate is started for a gated Task only, and neither configuration ever
    imports pyroute2 (nor its asyncio)."""
    add_tasks(state, workdir, f'''
[[task]]
name = "t"
schedule = "0 3 * * *"
network = "{'default_route' if gated else 'none'}"
command = ["/bin/true"]
''')
    out = subprocess.run([sys.executable, "-c", PROBE, state], capture_output=True, env=clean_env(),
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))), timeout=30)
    assert out.returncode == 0, out.stderr
    assert out.stdout.decode().split() == [str(gated), "False"]


def test_doctor_shows_the_default_route_as_netlink_reports_it(state, netns):
    """``doctor`` (short-lived: pyroute2 decodes netlink there) names gateway and device, and
    agrees with what the gate reads from /proc."""
    def network_check():
        p = subprocess.run(["ip", "netns", "exec", netns, *qlagent_argv("--state-dir", state, "doctor", "--json")],
                           capture_output=True, env=clean_env(), timeout=60)
        assert b"Traceback" not in p.stderr
        return [c for c in json.loads(p.stdout)["checks"] if c["name"] == "network"][0]
    before = network_check()
    assert before["ok"] and before["detail"].startswith("no default route")
    ip("-n", netns, "route", "add", "default", "via", "10.200.0.2")
    after = network_check()
    assert after["ok"] and after["detail"] == "IPv4 default via 10.200.0.2 dev v0", after
