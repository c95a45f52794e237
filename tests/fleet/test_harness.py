"""The fleet harness works (issue 11 acceptance rig): each piece is shown doing what a fleet test
relies on, against the real thing — two PostgreSQL servers replicating synchronously, network
namespaces whose link really goes down, cgroups whose limits really bite."""

from __future__ import annotations

import http.server
import os
import subprocess
import threading

import pytest

from harness import (Cgroup, PgPair, WorkerNet, cgroup_v1_available, multi_host_url, pg_bindir, python_in,
                     spawn_in)
from kit import wait_until

TAG = f"fleet-{os.getpid()}"


def test_multi_host_url_shape():
    assert multi_host_url([("127.0.0.1", 5433), ("127.0.0.1", 5434)], "ql") == (
        "postgresql://postgres@127.0.0.1:5433,127.0.0.1:5434/ql?target_session_attrs=read-write&connect_timeout=2")
    assert multi_host_url([("::1", 5)]).startswith("postgresql://postgres@[::1]:5/postgres?")
    with pytest.raises(ValueError):
        multi_host_url([])


# ---------------------------------------------------------------- PostgreSQL

@pytest.fixture
def pg():
    if pg_bindir() is None:
        pytest.skip("PostgreSQL server binaries not installed (tests/run installs them as root)")
    pair = PgPair(TAG.replace("-", "_"))
    try:
        yield pair.start()
    finally:
        pair.close()
    assert not os.path.exists(pair.base)


@pytest.mark.slow
def test_synchronous_standby_then_failover_through_the_multi_host_url(pg):
    import psycopg

    assert pg.query(pg.primary_port, "SHOW synchronous_standby_names") == [(pg.standby_name,)]
    assert pg.in_recovery(pg.standby_port)
    url = pg.url()
    with psycopg.connect(url, autocommit=True) as c:
        assert c.execute("SELECT inet_server_port(), pg_is_in_recovery()").fetchone() == (pg.primary_port, False)
        c.execute("CREATE TABLE acked (n int PRIMARY KEY)")
        for n in range(50):                      # each commit returned = on the standby's disk
            c.execute("INSERT INTO acked VALUES (%s)", (n,))

    pg.stop_primary(mode="immediate")            # a crash: no checkpoint, no goodbye to the standby
    with pytest.raises(psycopg.OperationalError):
        psycopg.connect(url).close()             # the standby is read-only until promoted
    pg.promote()

    with psycopg.connect(url, autocommit=True) as c:
        assert c.execute("SELECT inet_server_port(), pg_is_in_recovery()").fetchone() == (pg.standby_port, False)
        assert c.execute("SELECT count(*), min(n), max(n) FROM acked").fetchone() == (50, 0, 49)
        c.execute("INSERT INTO acked VALUES (50)")   # writable, and not waiting for a standby it lacks


# ---------------------------------------------------------------- network namespaces

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (network namespaces, cgroups)")


def _gone(w: WorkerNet) -> bool:
    return (subprocess.run(["ip", "netns", "pids", w.ns], capture_output=True).returncode != 0
            and subprocess.run(["ip", "link", "show", w.host_if], capture_output=True).returncode != 0)


@pytest.fixture
def net():
    w = WorkerNet(0)
    try:
        yield w.create()
    finally:
        w.close()
    assert _gone(w)


@pytest.fixture
def fleet_nets():
    made = []
    try:
        for i in range(1, 4):
            made.append(WorkerNet(i).create())
        yield made
    finally:
        for w in made:
            w.close()
    assert all(_gone(w) for w in made)


class _Hello(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = b"hello from the control plane\n"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def _fetch(net: WorkerNet, url: str) -> subprocess.CompletedProcess:
    code = ("import sys, urllib.request\n"
            f"sys.stdout.write(urllib.request.urlopen({url!r}, timeout=1.5).read().decode())\n")
    return spawn_in(python_in(code), net=net, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                    text=True).communicate(timeout=30)


@needs_root
def test_a_worker_namespace_reaches_the_host_only_while_its_link_is_up(net):
    srv = http.server.HTTPServer((net.host_addr, 0), _Hello)      # bound on the veth address only
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    url = f"http://{net.host_addr}:{srv.server_address[1]}/"
    try:
        out, err = _fetch(net, url)
        assert out == "hello from the control plane\n", err
        # The namespace has no other way out: loopback of the host is not reachable from it.
        out, err = _fetch(net, f"http://127.0.0.1:{srv.server_address[1]}/")
        assert out == "" and "Connection refused" in err

        net.link_down()
        out, err = _fetch(net, url)
        assert out == "" and ("unreachable" in err or "timed out" in err), err

        net.link_up()
        wait_until(lambda: _fetch(net, url)[0] == "hello from the control plane\n", 15, "the link to come back")
    finally:
        srv.shutdown()
        srv.server_close()


@needs_root
def test_three_workers_cut_one_link_the_others_stay_connected_and_apart(fleet_nets):
    servers = []
    try:
        for w in fleet_nets:
            srv = http.server.HTTPServer((w.host_addr, 0), _Hello)
            threading.Thread(target=srv.serve_forever, daemon=True).start()
            servers.append(srv)
        urls = [f"http://{w.host_addr}:{s.server_address[1]}/" for w, s in zip(fleet_nets, servers)]
        assert len({w.ns for w in fleet_nets}) == len({w.host_addr for w in fleet_nets}) == 3
        # Worker 1 reaches its own host address only; the other Workers' subnets are not routed.
        out, err = _fetch(fleet_nets[0], urls[1])
        assert out == "" and "unreachable" in err, err
        fleet_nets[1].link_down()
        assert _fetch(fleet_nets[1], urls[1])[0] == ""
        assert [_fetch(w, u)[0] for w, u in ((fleet_nets[0], urls[0]), (fleet_nets[2], urls[2]))] == [
            "hello from the control plane\n"] * 2
    finally:
        for srv in servers:
            srv.shutdown()
            srv.server_close()


# ---------------------------------------------------------------- cgroups

@pytest.fixture
def cgroup():
    if not cgroup_v1_available():
        pytest.skip("needs root and writable cgroup v1 memory+pids")
    cg = Cgroup(f"qlagent-{TAG}")
    try:
        yield cg.create()
    finally:
        cg.close()
    assert not os.path.exists(cg.mem) and not os.path.exists(cg.pids)


HOG = "b = b'x' * (200 * 1048576)\nprint(len(b))\n"
FORKS = """
import os, time
kids = []
try:
    for _ in range(200):
        pid = os.fork()
        if pid == 0:
            time.sleep(30)
            os._exit(0)
        kids.append(pid)
except BlockingIOError:
    pass
print(len(kids), flush=True)
for k in kids:
    os.kill(k, 9)
    os.waitpid(k, 0)
"""


@needs_root
def test_a_worker_in_its_namespace_and_edge_cgroup_is_bounded_and_the_figures_show_it(net, cgroup):
    calm = spawn_in(python_in("print('ok')"), net=net, cgroup=cgroup, stdout=subprocess.PIPE, text=True)
    assert calm.communicate(timeout=30)[0] == "ok\n"
    assert (cgroup.oom_kills(), cgroup.fork_failures()) == (0, 0)
    assert 0 < cgroup.peak_memory_bytes() < 128 * 1048576

    hog = spawn_in(python_in(HOG), net=net, cgroup=cgroup, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    assert hog.wait(timeout=60) == -9                       # a 200 MiB allocation is OOM-killed
    assert cgroup.oom_kills() == 1

    forks = spawn_in(python_in(FORKS), net=net, cgroup=cgroup, stdout=subprocess.PIPE, text=True)
    made = int(forks.communicate(timeout=60)[0])
    # 64 PIDs in the cgroup: ``ip netns exec`` execs into python (one PID), the rest are children.
    assert made == 63
    assert cgroup.fork_failures() >= 1
    wait_until(lambda: cgroup.procs() == [], 10, "the cgroup to empty")


@needs_root
def test_cleanup_is_idempotent_and_survives_a_half_gone_setup():
    w = WorkerNet(5).create()
    cg = Cgroup(f"qlagent-{TAG}-half").create()
    sleeper = spawn_in(["sleep", "60"], net=w, cgroup=cg)
    wait_until(lambda: sleeper.pid in cg.procs(), 10, "the sleeper in its cgroup")
    subprocess.run(["ip", "link", "del", w.host_if], check=True)     # something already went away
    for _ in range(2):
        w.close()
        cg.close()
    assert sleeper.wait(timeout=10) == -9                           # the leftover process was killed
    assert _gone(w) and not os.path.exists(cg.mem) and not os.path.exists(cg.pids)
