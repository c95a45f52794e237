"""The procd gate (issue #27): the project's ipk under OpenWrt's real userland.

``openwrt/gate/procd-gate`` builds procd, ubusd, logd/logread, uci, jsonfilter and opkg from
their sources (``QLAGENT_OPENWRT_SRC``), lays out an OpenWrt-like root (busybox ash as /bin/sh,
OpenWrt's rc.common, functions.sh, procd.sh), installs ``dist/qlagent_*.ipk`` into it with the
real ``opkg`` and runs ubusd, logd and procd there in a mount + PID namespace.  Every check
below goes through what a user of a router has: ``/etc/init.d/qlagent``, ``uci`` +
``reload_config``, ``ubus call service list``, ``logread``, the ``qlagent`` CLI as user qlagent.
The stand-in tests (tests/test_openwrt.py) stay the CI tests; these need the sources and root.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import pytest
from kit import wait_until

REPO = Path(__file__).resolve().parents[1]
GATE = REPO / "openwrt" / "gate" / "procd-gate"
SRC = os.environ.get("QLAGENT_OPENWRT_SRC")
CACHE = Path(os.environ.get("QLAGENT_OPENWRT_CACHE", "/var/cache/qlagent-openwrt"))
CONF = "/var/etc/qlagent/qlagent.toml"
LOG_LINE = re.compile(r"^\w{3} \w{3} [ \d]\d \d\d:\d\d:\d\d \d{4} (.*)$")

pytestmark = [
    pytest.mark.skipif(not SRC, reason="QLAGENT_OPENWRT_SRC not set: the procd gate needs OpenWrt's sources "
                       "(fetch them as openwrt/README.md 'The procd gate' says)"),
    pytest.mark.skipif(os.geteuid() != 0, reason="the procd gate needs root (mount and PID namespaces, chroot)"),
]


class Router:
    """One gate root with ubusd, logd and procd running in it."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.install_out = ""

    def sh(self, script: str, *, user: str | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
        argv = [str(GATE), "exec", str(self.root)] + (["--user", user] if user else []) + ["sh", "-c", script]
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout)

    def ok(self, script: str, **kw) -> str:
        out = self.sh(script, **kw)
        assert out.returncode == 0, f"{script!r} exited {out.returncode}: {out.stdout}{out.stderr}"
        return out.stdout

    def cli(self, args: str) -> subprocess.CompletedProcess:
        """``qlagent ARGS`` as user qlagent, the owner of the store."""
        return self.sh(f"HOME=/tmp QLAGENT_CONFIG={CONF} qlagent {args}", user="qlagent")

    def services(self) -> dict:
        return json.loads(self.ok("ubus call service list") or "{}")

    def instance(self) -> dict | None:
        return self.services().get("qlagent", {}).get("instances", {}).get("instance1")

    def pid(self) -> int | None:
        i = self.instance()
        return i["pid"] if i and i.get("running") else None

    def log(self, everything: bool = False) -> list[str]:
        """``logread -e qlagent`` (or all of logread), without the date: ``daemon.info qlagent[7]: …``."""
        out = self.ok("logread" if everything else "logread -e qlagent")
        return [m.group(1) for m in map(LOG_LINE.match, out.splitlines()) if m]

    def procd_log(self) -> list[str]:
        """procd's own messages: its stderr (the gate runs it with -S), then syslog once an
        instance has written to its stdout/stderr (procd's ulog switches channel then)."""
        own = (self.root / ".gate-init.log").read_text(errors="replace").splitlines()
        return own + [ln for ln in self.log(everything=True) if " procd: " in ln or ln.startswith("daemon.") and "procd" in ln]

    def uci_commit(self, *sets: str) -> None:
        """``uci set …`` each, ``uci commit qlagent``, ``reload_config``: what LuCI's apply does."""
        self.ok("reload_config; " + "; ".join(f"uci set qlagent.main.{s}" for s in sets)
                + "; uci commit qlagent && reload_config")

    def start(self) -> int:
        self.ok("/etc/init.d/qlagent start")
        return wait_until(self.pid, 30, "procd to run the agent", step=0.3)


@pytest.fixture(scope="module")
def router():
    ipk = subprocess.run([str(REPO / "openwrt" / "build-ipk")], capture_output=True, text=True, check=True,
                         timeout=300).stdout.strip()
    root = CACHE / "roots" / f"pytest-{os.getpid()}"
    env = dict(os.environ, QLAGENT_GATE_PYLIB=sysconfig.get_paths()["purelib"])
    r = Router(root)
    try:
        out = subprocess.run([str(GATE), "root", str(root), ipk], capture_output=True, text=True, env=env,
                             timeout=900)
        assert out.returncode == 0, out.stdout + out.stderr
        r.install_out = out.stdout
        subprocess.run([str(GATE), "up", str(root)], check=True, timeout=120)
        yield r
    finally:
        subprocess.run([str(GATE), "down", str(root)], timeout=120)
        shutil.rmtree(root, ignore_errors=True)


def makefile_depends() -> set[str]:
    mk = (REPO / "openwrt" / "qlagent" / "Makefile").read_text()
    block = re.search(r"DEPENDS:=(.*?)\nendef", mk, re.S).group(1)
    return set(re.findall(r"\+(\S+)", block))


def test_opkg_installs_the_ipk_names_the_depends_this_root_lacks_and_enables_the_service(router):
    line = next(ln for ln in router.install_out.splitlines() if ln.startswith("unsatisfied Depends in this root: "))
    assert set(line.split(": ", 1)[1].split()) == makefile_depends() | {"libc"}
    assert "Installing qlagent (0.1.0-r1) to root..." in router.install_out
    assert re.search(r"^qlagent - 0\.1\.0-r1$", router.ok("opkg list-installed"), re.M)
    # postinst (default_postinst): the user from Require-User, the rc.d links of `enable`
    assert "qlagent:x:377:377:" in (router.root / "etc" / "passwd").read_text()
    for link in ("S95qlagent", "K10qlagent"):
        assert os.readlink(router.root / "etc" / "rc.d" / link) == "../init.d/qlagent"


def test_start_running_restart_stop_enable_disable(router):
    pid = router.start()
    assert router.sh("/etc/init.d/qlagent running").returncode == 0
    wait_until(lambda: f"daemon.info qlagent[{pid}]: service.ready profile=edge" in "\n".join(router.log()), 30,
               "the service.ready line", step=0.3)
    router.ok("/etc/init.d/qlagent restart")
    new = wait_until(lambda: (p := router.pid()) not in (None, pid) and p, 60, "a new agent after restart", step=0.3)
    assert new != pid
    router.ok("/etc/init.d/qlagent stop")
    wait_until(lambda: router.instance() is None, 60, "the instance gone after stop", step=0.3)
    assert router.sh("/etc/init.d/qlagent running").returncode != 0
    router.ok("/etc/init.d/qlagent disable")
    assert not list((router.root / "etc" / "rc.d").iterdir())
    assert router.sh("/etc/init.d/qlagent enabled").returncode == 1
    router.ok("/etc/init.d/qlagent enable")
    assert router.sh("/etc/init.d/qlagent enabled").returncode == 0
    router.start()


def reloads(router, pid: int) -> int:
    return sum(1 for ln in router.log() if ln.startswith(f"daemon.info qlagent[{pid}]: config.reloaded "))


def test_a_good_uci_change_reaches_the_agent_as_sighup_through_the_trigger(router):
    pid = router.pid() or router.start()
    before = reloads(router, pid)
    router.ok("reload_config; uci set qlagent.main.drain_grace_s=25; uci commit qlagent")
    time.sleep(4)           # the uci CLI only writes /etc/config/qlagent: procd hears nothing
    assert reloads(router, pid) == before and router.instance()["term_timeout"] == 30
    router.ok("reload_config")          # the config.change event (LuCI's apply sends it too)
    wait_until(lambda: reloads(router, pid) == before + 1, 30, "config.reloaded after uci commit + reload_config",
               step=0.3)
    inst = router.instance()
    assert inst["pid"] == pid and inst["term_timeout"] == 35
    assert "drain_grace_s = 25" in router.ok(f"cat {CONF}")


def test_a_bad_uci_change_is_refused_and_procd_keeps_the_running_instance(router):
    pid = router.pid() or router.start()
    conf, before = router.ok(f"cat {CONF}"), reloads(router, pid)
    refusal = ("daemon.err qlagent: option profile: unknown profile 'huge'; expected one of ['edge', 'standalone'] "
               f"(/etc/config/qlagent, section main); the running agent and {CONF} are kept")
    n = router.log().count(refusal)
    router.uci_commit("profile=huge")
    wait_until(lambda: router.log().count(refusal) == n + 1, 30, "the refusal logged", step=0.3)
    time.sleep(3)           # procd compared the instance: unchanged, so no signal, no restart
    assert router.pid() == pid and reloads(router, pid) == before
    assert router.ok(f"cat {CONF}") == conf
    router.uci_commit("profile=edge")


TASKS = """\
[[task]]
name = "short"
command = ["/bin/sh", "-c", "sleep 3; echo finished"]

[[task]]
name = "long"
command = ["/bin/sh", "-c", "sleep 120"]
"""


def runs(router) -> dict[str, tuple[str, str]]:
    out = router.cli("run ls")
    assert out.returncode == 0, out.stderr
    rows = [ln.split() for ln in out.stdout.splitlines()[1:] if ln.strip()]
    return {r[1]: (r[2], r[-1]) for r in rows}


def test_stop_with_live_runs_honours_the_drain_within_term_timeout(router):
    pid = router.pid() or router.start()
    router.uci_commit("drain_grace_s=5")
    wait_until(lambda: (router.instance() or {}).get("term_timeout") == 15, 30, "term_timeout 15", step=0.3)
    (router.root / "root").mkdir(exist_ok=True)
    (router.root / "root" / "gate-tasks.toml").write_text(TASKS)
    os.chmod(router.root / "root", 0o755)
    assert router.cli("task add -f /root/gate-tasks.toml").returncode == 0
    for t in ("short", "long"):
        assert router.cli(f"run start {t}").returncode == 0
    wait_until(lambda: {s for s, _ in runs(router).values()} == {"running"}, 30, "every run running", step=0.3)
    t0 = time.monotonic()
    router.ok("/etc/init.d/qlagent stop")
    wait_until(lambda: router.instance() is None, 30, "the agent stopped", step=0.3)
    elapsed = time.monotonic() - t0
    assert elapsed < 15, f"stop took {elapsed:.1f} s: procd's term_timeout (15 s) would SIGKILL"
    assert runs(router) == {"short": ("succeeded", "0"), "long": ("cancelled", "sig15")}
    log = router.log()
    i = log.index(f"daemon.notice qlagent[{pid}]: service.draining live=2 grace_s=5.0")
    tail = log[i:]
    assert f"daemon.notice qlagent[{pid}]: service.drain_expired cancelling=1" in tail
    assert f"daemon.info qlagent[{pid}]: service.stopped" in tail
    assert "sleep 120" not in router.ok("ps")          # no process of the runs survives
    router.start()


def test_procd_puts_the_instance_in_its_cgroup_and_the_budget_lands_above_it(router):
    pid = router.pid() or router.start()
    cg = next(ln for ln in router.ok(f"cat /proc/{pid}/cgroup").splitlines() if ln.startswith("0::"))
    assert cg.endswith("/services/qlagent/instance1"), cg          # procd's instance_add_cgroup
    controllers = router.ok("cat /sys/fs/cgroup/cgroup.controllers").split()
    service = "/sys/fs/cgroup/services/qlagent"
    if {"memory", "pids"} <= set(controllers):
        assert router.ok(f"cat {service}/memory.max").strip() == "134217728"
        assert router.ok(f"cat {service}/pids.max").strip() == "64"
    else:
        # This host (hybrid cgroups): no memory/pids controller on cgroup2, so no limit file;
        # the init script says so once per start.
        missing = " ".join(c for c in ("memory", "pids") if c not in controllers)
        assert (f"daemon.warn qlagent: cgroup controller(s) {missing} not available at /sys/fs/cgroup: that part of "
                "the budget is the agent's admission check (and rlimit nproc) only") in router.log()
        assert router.sh(f"test -e {service}/memory.max").returncode != 0
    assert router.instance()["limits"] == {"nproc": "64 64"}


def test_logread_shows_the_agents_lines_with_their_priorities(router):
    log = router.log()
    for prio, event in (("info", "service.ready"), ("notice", "service.draining"), ("warn", "run.cancelled"),
                        ("info", "config.reloaded")):
        assert any(re.match(rf"daemon\.{prio} qlagent\[\d+\]: {re.escape(event)}\b", ln) for ln in log), (prio, event)
    assert not [ln for ln in log if re.match(r"daemon\.err qlagent\[\d+\]: (service|config|run|schedule)\.", ln)
                and not re.search(r"\.(failed|reload_failed)\b", ln)]


# ---- the fleet Worker under procd: respawn that cannot strand a router --------------------------

sys.path.insert(0, str(Path(__file__).resolve().parent / "fleet"))


@pytest.fixture
def cp(tmp_path):
    from stubcp import StubControlPlane
    # TTLs a Worker's default heartbeat (5 s) can renew (the fleet tests' 6 s need 1 s heartbeats)
    stub = StubControlPlane(str(tmp_path), lease_ttl_s=60, session_ttl_s=60)
    stub.url = stub.start()
    yield stub
    stub.stop()


def as_worker(router, cp, ca_pem: str) -> str:
    """Enrol with the stub, put the credential and CA where UCI names them; the Worker's ID."""
    wid, cred = cp.enrol()
    etc = router.root / "etc" / "qlagent"
    etc.mkdir(exist_ok=True)
    (etc / "worker.cred").write_text(cred + "\n")
    os.chown(etc / "worker.cred", 377, 377)
    os.chmod(etc / "worker.cred", 0o600)
    shutil.copy(ca_pem, etc / "cp-ca.pem")
    os.chmod(etc / "cp-ca.pem", 0o644)
    router.ok("/etc/init.d/qlagent stop")
    wait_until(lambda: router.instance() is None, 60, "the agent stopped", step=0.3)
    router.ok(f"uci set qlagent.main.control_url='{cp.url}'; uci set qlagent.main.worker_id='{wid}'; "
              "uci set qlagent.main.credential_file=/etc/qlagent/worker.cred; "
              "uci set qlagent.main.ca_file=/etc/qlagent/cp-ca.pem; uci commit qlagent")
    return wid


def watch_pids(router, seconds: float) -> list[int | None]:
    """procd's pid of the instance every 0.5 s (None: not running): each new pid is a respawn."""
    seen, end = [], time.monotonic() + seconds
    while time.monotonic() < end:
        p = router.pid()
        if not seen or seen[-1] != p:
            seen.append(p)
        time.sleep(0.5)
    return seen


def test_a_worker_at_1970_retries_in_process_and_joins_when_the_clock_is_set(router, cp):
    fake = router.root / "etc" / "gate-faketime"
    wid = as_worker(router, cp, cp.ca_file)
    fake.write_text("@1970-01-02 00:00:00\n")          # the router's clock: not set yet
    try:
        pid = router.start()
        seen = watch_pids(router, 25)
        assert seen == [pid], f"procd respawned the Worker at 1970: pids {seen}"
        mine = [ln for ln in router.log() if f"qlagent[{pid}]" in ln]
        # said once (a minute), naming the cause: the clock, not the configuration
        said = [ln for ln in mine if "worker.not_ready code=clock_not_set" in ln]
        assert len(said) == 1 and "not yet valid" in said[0], mine[-5:]
        with cp.lock:
            assert cp.workers[wid]["session"] is None
        fake.write_text("+0\n")                          # NTP stepped the clock to now
        t0 = time.monotonic()
        wait_until(lambda: cp.workers[wid]["session"] is not None, 60, "the Worker's Session after the clock step",
                   step=0.3)
        print(f"joined {time.monotonic() - t0:.1f} s after the clock step")
        time.sleep(3)
        assert router.pid() == pid, "\n".join(router.log()[-4:] + router.procd_log()[-4:])  # no restart, no reboot
    finally:
        fake.write_text("")


def test_a_worker_without_dns_retries_in_process_and_joins_when_names_resolve(router, cp):
    hosts = router.root / "etc" / "hosts"
    saved = hosts.read_text()
    wid = as_worker(router, cp, cp.ca_file)          # control_url https://localhost:PORT
    hosts.write_text("")                             # no name resolves yet (no resolv.conf either)
    try:
        pid = router.start()
        seen = watch_pids(router, 20)
        assert seen == [pid], f"procd respawned the Worker without DNS: pids {seen}"
        assert any("worker.connect_failed code=control_unreachable" in ln and "name resolution" in ln
                   for ln in router.log() if f"qlagent[{pid}]" in ln)
        hosts.write_text(saved)                      # the name resolves now
        t0 = time.monotonic()
        wait_until(lambda: cp.workers[wid]["session"] is not None, 120, "the Worker's Session once names resolved",
                   step=0.3)
        print(f"joined {time.monotonic() - t0:.1f} s after names resolved")
        assert router.pid() == pid
    finally:
        hosts.write_text(saved)


def test_a_real_worker_config_error_is_reported_once_per_start_and_procd_stops_respawning(router, cp, tmp_path):
    from stubcp import make_ca
    other = tmp_path / "other"
    other.mkdir()
    wrong_ca, _, _ = make_ca(str(other), "other")
    as_worker(router, cp, wrong_ca)
    n0, m0 = len(router.log()), len(router.procd_log())
    router.ok("/etc/init.d/qlagent start")
    seen = [p for p in watch_pids(router, 50) if p is not None]
    errors = [ln for ln in router.log()[n0:] if "certificate refused" in ln and re.match(r"daemon\.err qlagent\[\d+\]", ln)]
    # every start that procd made: the pids seen running and the pids that logged
    starts = len(set(seen) | {int(re.match(r"daemon\.err qlagent\[(\d+)\]", ln).group(1)) for ln in errors})
    # procd's budget (respawn 3600 5 5): at most 5 respawns, 5 s apart, then the instance is halted
    assert starts <= 6, f"{starts} starts"
    assert len(errors) == starts, errors                   # one line per start, naming the option
    assert all("worker.ca_file" in ln for ln in errors)
    if starts > 1:
        assert any("in a crash loop" in ln for ln in router.procd_log()[m0:]), router.procd_log()[m0:]
        assert router.pid() is None
