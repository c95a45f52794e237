"""The OpenWrt side run for real off a router (issue 13 §2, §3).

The UCI converter and the procd init script are the shipped files, run under busybox ash (the
shell of OpenWrt) with stand-ins from tests/openwrt_standin/ for what only a router has: `uci`
(answers from one file per option), `logger` (appends to a file: what `logread` would show),
and rc.common + the procd_* functions of procd.sh (they record each call; ``procd_json`` turns
the record into the message that procd.sh sends with ``ubus call service set``).  The converter
validates with the real ``qlagent config check`` of this checkout.  The cgroup writes go to a
real cgroup v2 hierarchy where this machine has one, and to a directory tree with the files of a
cgroup v2 where the kernel lacks the controllers.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from qlagent.core.profiles import PROFILES
from kit import run_cli

REPO = Path(__file__).resolve().parents[1]
FILES = REPO / "openwrt" / "qlagent" / "files"
STANDIN = Path(__file__).resolve().parent / "openwrt_standin"
BUSYBOX = shutil.which("busybox")
BUSYBOX_APPLETS = ("basename", "cat", "chmod", "env", "head", "id", "mkdir", "mktemp", "mv", "rm", "sed", "tail")

pytestmark = pytest.mark.skipif(BUSYBOX is None, reason="busybox not installed (tests/run installs it)")


class Router:
    """One OpenWrt-like environment in a temporary directory."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.uci = root / "uci"
        self.conf_dir = root / "var-etc-qlagent"
        self.cgroup = root / "no-cgroup"
        self.calls = root / "procd.calls"
        self.logread = root / "logread"
        self.applets = root / "busybox-bin"
        for d in (self.uci, self.conf_dir, self.applets):
            d.mkdir()
        # The router's userland: busybox applets, not this machine's coreutils.
        for applet in BUSYBOX_APPLETS:
            (self.applets / applet).symlink_to(BUSYBOX)
        self.set(state_dir=str(root / "state"))

    def set(self, **options: str) -> None:
        for k, v in options.items():
            (self.uci / k).write_bytes(v.encode())

    def unset(self, *names: str) -> None:
        for k in names:
            (self.uci / k).unlink()

    def env(self) -> dict[str, str]:
        return {"PATH": f"{STANDIN}:{self.applets}:{Path(sys.executable).parent}:/usr/sbin:/usr/bin:/sbin:/bin",
                "UCI_DIR": str(self.uci), "PROCD_CALLS": str(self.calls), "LOGREAD": str(self.logread),
                "QLAGENT_CONF_DIR": str(self.conf_dir), "QLAGENT_CGROUP_ROOT": str(self.cgroup),
                "QLAGENT_UCI2TOML": str(FILES / "qlagent-uci2toml")}

    def convert(self) -> subprocess.CompletedProcess:
        return subprocess.run([BUSYBOX, "ash", str(FILES / "qlagent-uci2toml"), str(self.conf_dir)],
                              env=self.env(), capture_output=True, text=True, timeout=60)

    def init(self, action: str) -> tuple[subprocess.CompletedProcess, dict]:
        """Run ``/etc/init.d/qlagent ACTION``; return the process and procd's ``service set`` message."""
        self.calls.write_text("")
        out = subprocess.run([BUSYBOX, "ash", str(STANDIN / "rc.common"), str(FILES / "qlagent.init"), action],
                             env=self.env(), capture_output=True, text=True, timeout=60)
        return out, procd_json(self.calls.read_text())

    def log_lines(self) -> list[str]:
        return self.logread.read_text().splitlines() if self.logread.exists() else []

    def snapshot(self) -> dict[str, bytes]:
        return {p.name: p.read_bytes() for p in sorted(self.conf_dir.iterdir())}


def procd_json(record: str) -> dict:
    """The ``ubus call service set`` message procd.sh builds from the recorded calls: types as in
    procd.sh's _procd_set_param (tables for env/data/limits split at the first '=', arrays of
    strings for command/file/respawn, ints for term_timeout and reload_signal (`kill -l`), a
    boolean for stdout/stderr, strings otherwise); unnamed instances are instance1, 2, ..."""
    msg: dict = {}
    inst: dict | None = None
    for line in record.splitlines():
        call, *args = line.split("\x1f")
        if call == "open_service":
            msg = {"name": args[0], "script": args[1], "instances": {}, "triggers": []}
        elif call == "open_instance":
            inst = {}
            msg["instances"][args[0] if args else f"instance{len(msg['instances']) + 1}"] = inst
        elif call == "set_param":
            kind, values = args[0], args[1:]
            if kind in ("env", "data", "limits"):
                inst[kind] = dict(v.split("=", 1) if "=" in v else (v, "") for v in values)
            elif kind in ("command", "netdev", "file", "respawn", "watch", "watchdog"):
                inst[kind] = values
            elif kind == "term_timeout":
                inst[kind] = int(values[0])
            elif kind == "reload_signal":
                inst[kind] = {"HUP": 1, "USR1": 10, "USR2": 12}[values[0]]
            elif kind in ("stdout", "stderr", "no_new_privs"):
                inst[kind] = values[0] == "1"
            else:
                inst[kind] = values[0]
        elif call == "close_instance":
            inst = None
        elif call == "reload_trigger":
            msg["triggers"].append(["config.change", ["if", ["eq", "package", args[0]],
                                                      ["run_script", msg["script"], "reload"]]])
        elif call == "close_service":
            msg["method"] = args[0] if args else "set"
    return msg


@pytest.fixture
def router(tmp_path) -> Router:
    return Router(tmp_path)


# --- the converter -----------------------------------------------------------------------------

def test_defaults_convert_to_the_agents_config(router):
    router.unset("state_dir")
    out = router.convert()
    assert out.returncode == 0 and out.stdout == "" and out.stderr == "", out.stderr
    assert tomllib.loads((router.conf_dir / "qlagent.toml").read_text()) == {
        "profile": "edge", "state_dir": "/etc/qlagent/state",
        "artifact_dir": "/etc/qlagent/state/artifacts", "drain_grace_s": 20}
    assert (router.conf_dir / "procd.env").read_text() == \
        "profile='edge'\nstate_dir='/etc/qlagent/state'\ndrain_grace_s=20\n"
    assert sorted(p.name for p in router.conf_dir.iterdir()) == ["procd.env", "qlagent.toml"]


def test_quotes_backslashes_and_http_listen_survive_both_files(router):
    weird = "/mnt/usb/q\"l\\a'b"
    router.set(profile="standalone", state_dir=weird, http_listen="127.0.0.1:7380", drain_grace_s="600")
    assert router.convert().returncode == 0
    config = tomllib.loads((router.conf_dir / "qlagent.toml").read_text())
    assert config["state_dir"] == weird and config["artifact_dir"] == weird + "/artifacts"
    assert config["http"] == {"listen": "127.0.0.1:7380"} and config["drain_grace_s"] == 600
    # procd.env is sourced by the init script: the value comes back byte for byte.
    back = subprocess.run([BUSYBOX, "ash", "-c", '. "$1"; printf %s "$state_dir"', "sh",
                           str(router.conf_dir / "procd.env")], capture_output=True, text=True)
    assert back.stdout == weird


BAD = [
    # (options, message on stderr) -- each is an input named in issue 13 §3, or an edge of a limit
    ({"state_dir": "/mnt/a\tb"}, "option state_dir: must not contain control characters"),
    ({"artifact_dir": "/mnt/a\nb"}, "option artifact_dir: must not contain control characters"),
    ({"drain_grace_s": "020"}, "option drain_grace_s: must be a decimal whole number of seconds 0..600 without leading zeros, got '020'"),
    ({"drain_grace_s": "08"}, "option drain_grace_s: must be a decimal whole number of seconds 0..600 without leading zeros, got '08'"),
    ({"drain_grace_s": "20s"}, "option drain_grace_s: must be a decimal whole number"),
    ({"drain_grace_s": "601"}, "option drain_grace_s: 601.0 outside 0..600 seconds"),
    ({"http_listen": ":7380"}, "option http_listen: ':7380' is not HOST:PORT"),
    ({"http_listen": "0.0.0.0:80abc"}, "option http_listen: '0.0.0.0:80abc' is not HOST:PORT"),
    ({"http_listen": "127.0.0.1:99999"}, "option http_listen: '127.0.0.1:99999' is not HOST:PORT"),
    ({"profile": "huge"}, "option profile: unknown profile 'huge'"),
    ({"state_dir": "relative/dir"}, "option state_dir: 'relative/dir' must be an absolute path"),
    ({"drain_grace": "5"}, "option drain_grace: unknown option; known options: enabled profile"),
    ({"enabled": "maybe"}, "option enabled: must be 0 or 1, got 'maybe'"),
]


@pytest.mark.parametrize("options,message", BAD, ids=[repr(o) for o, _ in BAD])
def test_a_bad_option_exits_2_with_one_line_and_writes_nothing(router, options, message):
    assert router.convert().returncode == 0
    before = router.snapshot()
    router.set(**options)
    out = router.convert()
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.count("\n") == 1 and message in out.stderr, out.stderr
    assert out.stderr.endswith("(/etc/config/qlagent, section main)\n") and "Traceback" not in out.stderr
    assert router.snapshot() == before          # the previous files, byte for byte; no temporary left


def test_an_unknown_section_is_refused(router):
    (router.uci / ".sections").write_text("mian\n")
    out = router.convert()
    assert out.returncode == 2 and "qlagent: section mian: unknown section; only 'main' is read" in out.stderr
    assert router.snapshot() == {}


def test_drain_grace_edges_are_accepted(router):
    for value, expected in (("0", 0), ("600", 600)):
        router.set(drain_grace_s=value)
        assert router.convert().returncode == 0
        assert tomllib.loads((router.conf_dir / "qlagent.toml").read_text())["drain_grace_s"] == expected


# --- the init script under procd ------------------------------------------------------------------

def test_start_hands_procd_the_instance_with_budget_drain_and_reload_signal(router):
    out, msg = router.init("start")
    assert out.returncode == 0, out.stderr
    conf = str(router.conf_dir / "qlagent.toml")
    assert msg["method"] == "set" and list(msg["instances"]) == ["instance1"]
    assert msg["instances"]["instance1"] == {
        "command": ["/usr/bin/qlagent", "serve", "--config", conf],
        "env": {"QLAGENT_STATE_DIR": str(router.root / "state"), "QLAGENT_LOG": "syslog"},
        "user": "qlagent",
        "limits": {"nproc": "64 64"},
        "respawn": ["3600", "5", "5"],
        "stdout": True, "stderr": True,
        "term_timeout": 30,
        "reload_signal": 1,
        "file": [conf],
    }
    assert msg["triggers"][0][1][1] == ["eq", "package", "qlagent"]
    assert (router.root / "state").is_dir()


BAD_ON_RELOAD = [
    {"state_dir": "/mnt/a\tb"},
    {"drain_grace_s": "020"},
    {"drain_grace_s": "08"},
    {"http_listen": ":7380"},
    {"http_listen": "0.0.0.0:80abc"},
    {"http_listen": "127.0.0.1:99999"},
    {"profile": "huge"},
    {"drain_grace": "5"},
]


@pytest.mark.parametrize("options", BAD_ON_RELOAD, ids=[repr(o) for o in BAD_ON_RELOAD])
def test_a_bad_option_on_reload_keeps_the_running_instance_and_config(router, options):
    _, good = router.init("start")
    before = router.snapshot()
    router.logread.write_text("")
    router.set(**options)
    out, msg = router.init("reload")
    # procd compares each instance with the one it runs (service/instance.c,
    # instance_config_changed): the same message means the agent is left alone.
    assert msg == good
    assert router.snapshot() == before
    errors = [line for line in router.log_lines() if line.startswith("daemon.err")]
    assert len(errors) == 1, router.log_lines()
    name = next(iter(options))
    assert errors[0].startswith(f"daemon.err qlagent: option {name}: ")
    assert errors[0].endswith(f"the running agent and {router.conf_dir}/qlagent.toml are kept")
    if name == "state_dir":
        assert not Path("/mnt/a\tb").exists()


def test_a_bad_option_at_first_start_starts_nothing(router):
    router.set(profile="huge")
    out, msg = router.init("start")
    assert out.returncode == 1 and msg["instances"] == {}
    assert router.snapshot() == {}
    assert [l for l in router.log_lines() if l.startswith("daemon.err")] == [
        "daemon.err qlagent: option profile: unknown profile 'huge'; expected one of ['edge', 'standalone']"
        " (/etc/config/qlagent, section main); not started"]


def test_a_good_change_is_applied_by_sighup_with_the_new_drain(router):
    _, first = router.init("start")
    router.set(drain_grace_s="45", http_listen="127.0.0.1:7381")
    _, second = router.init("reload")
    inst = second["instances"]["instance1"]
    assert inst["term_timeout"] == 55 and inst["reload_signal"] == 1
    assert tomllib.loads((router.conf_dir / "qlagent.toml").read_text())["http"] == {"listen": "127.0.0.1:7381"}


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another uid needs root")
def test_config_check_as_the_agents_user_trusts_the_state_dir_that_user_owns(router, tmp_path):
    """The converter runs as root; the agent runs as user qlagent and owns state_dir.  As root,
    a state_dir owned by another uid is untrusted, so every reload after the first start was
    refused (as the procd gate runs it): ``config check --as-user`` judges as that user would."""
    state = tmp_path / "owned"
    state.mkdir(mode=0o750)
    os.chown(state, 65534, 65534)                 # nobody, standing in for qlagent
    conf = tmp_path / "c.toml"
    conf.write_text(f'profile = "edge"\nstate_dir = "{state}"\n')
    check = ("config", "check", "--config", str(conf))
    as_root = run_cli(*check, text=True)
    assert as_root.returncode == 5 and f"untrusted state dir {state}: owned by uid 65534" in as_root.stderr
    as_nobody = run_cli(*check, "--as-user", "nobody", text=True)
    assert as_nobody.returncode == 0, as_nobody.stderr
    unknown = run_cli(*check, "--as-user", "no-such-user-27", text=True)
    assert unknown.returncode == 2 and "no user 'no-such-user-27'" in unknown.stderr


def test_disabled_hands_procd_no_instance(router):
    router.set(enabled="0")
    out, msg = router.init("start")
    assert out.returncode == 0 and msg["instances"] == {} and router.snapshot() == {}


# --- the budget in the service's cgroup -----------------------------------------------------------

def fake_cgroup2(root: Path, controllers: str) -> Path:
    """The files of a cgroup v2 root whose kernel offers CONTROLLERS (what the init script reads
    and writes); the kernel would create memory.max/pids.max when a controller is enabled."""
    root.mkdir()
    (root / "cgroup.controllers").write_text(controllers + "\n")
    (root / "cgroup.subtree_control").write_text("")
    (root / "services").mkdir()
    (root / "services" / "cgroup.subtree_control").write_text("")
    return root


@pytest.mark.parametrize("profile", sorted(PROFILES))
def test_budget_of_the_profile_is_written_to_the_service_cgroup(router, profile):
    router.cgroup = fake_cgroup2(router.root / "cgroup", "cpu memory pids")
    router.set(profile=profile)
    out, msg = router.init("start")
    assert out.returncode == 0, out.stderr
    p = PROFILES[profile]
    cg = router.cgroup / "services" / "qlagent"
    assert (cg / "memory.max").read_text() == f"{p.memory_bytes}\n"
    assert (cg / "pids.max").read_text() == f"{p.pids}\n"
    assert msg["instances"]["instance1"]["limits"] == {"nproc": f"{p.pids} {p.pids}"}
    assert router.log_lines() == []
    # Delegated to the agent (its Runs' cgroups go below it); the limits stay root's.
    assert f"chown qlagent:qlagent {cg} {cg}/cgroup.procs {cg}/cgroup.subtree_control {cg}/cgroup.threads" in \
        Path(f"{router.calls}.chown").read_text().splitlines()


UNIFIED = Path("/sys/fs/cgroup/unified")


@pytest.fixture
def real_cgroup2():
    """A subtree of this machine's real cgroup v2 hierarchy, standing in for /sys/fs/cgroup."""
    if os.geteuid() != 0 or not (UNIFIED / "cgroup.subtree_control").exists():
        pytest.skip("needs root and a cgroup v2 hierarchy at /sys/fs/cgroup/unified")
    root = UNIFIED / f"qlagent-packages-{os.getpid()}"
    root.mkdir()
    yield root
    for d in sorted(root.rglob("*"), key=lambda p: len(p.parts), reverse=True):
        if d.is_dir():
            d.rmdir()
    root.rmdir()


def test_real_cgroup2_gets_the_service_group_and_names_a_missing_controller(router, real_cgroup2):
    router.cgroup = real_cgroup2
    offered = set((real_cgroup2 / "cgroup.controllers").read_text().split())
    out, _ = router.init("start")
    assert out.returncode == 0, out.stderr
    cg = real_cgroup2 / "services" / "qlagent"
    assert (cg / "cgroup.procs").exists()         # a real cgroup, made by the kernel
    if {"memory", "pids"} <= offered:
        assert (cg / "memory.max").read_text() == "134217728\n" and (cg / "pids.max").read_text() == "64\n"
    else:
        # This machine binds memory and pids to cgroup v1: the script must say so, once.
        missing = " ".join(c for c in ("memory", "pids") if c not in offered)
        assert router.log_lines() == [
            f"daemon.warn qlagent: cgroup controller(s) {missing} not available at {real_cgroup2}: "
            "that part of the budget is the agent's admission check (and rlimit nproc) only"]


def test_without_cgroup2_says_so(router):
    out, _ = router.init("start")
    assert out.returncode == 0
    assert router.log_lines() == [f"daemon.warn qlagent: no cgroup v2 at {router.cgroup}: budget not enforced "
                                  "by the kernel (rlimit nproc and the agent's admission check only)"]


@pytest.mark.parametrize("option,value,message", [
    ("state_dir", b"/mnt/usb/\xff\xfe", "option state_dir: is not UTF-8"),
    ("artifact_dir", b"/mnt/" + b"a" * 70_000, "option artifact_dir: is larger than 65536 bytes"),
    ("http_listen", b"\xc3:80", "option http_listen: is not UTF-8"),
])
def test_a_value_the_toml_cannot_hold_is_named_by_its_option(router, option, value, message):
    assert router.convert().returncode == 0
    before = router.snapshot()
    (router.uci / option).write_bytes(value)
    out = router.convert()
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and message in out.stderr, out.stderr
    assert ".qlagent.toml." not in out.stderr and "option config" not in out.stderr   # no temporary file named
    assert router.snapshot() == before


def test_a_list_option_is_refused_not_joined_into_one_value(router):
    # `uci add_list qlagent.main.state_dir=/mnt/b` next to /mnt/a: `uci get` answers "/mnt/a /mnt/b",
    # which would become one state_dir with a space in it.
    assert router.convert().returncode == 0
    before = router.snapshot()
    router.unset("state_dir")
    (router.uci / "state_dir").mkdir()
    (router.uci / "state_dir" / "1").write_text("/mnt/a")
    (router.uci / "state_dir" / "2").write_text("/mnt/b'c")
    out = router.convert()
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
    assert "option state_dir: is a list; give one value (uci set, not uci add_list)" in out.stderr
    assert router.snapshot() == before
    # A one-value list is that value; a value holding "' '" is one value.
    (router.uci / "state_dir" / "2").unlink()
    router.set(artifact_dir="/mnt/x' 'y")
    assert router.convert().returncode == 0
    config = tomllib.loads((router.conf_dir / "qlagent.toml").read_text())
    assert config["state_dir"] == "/mnt/a" and config["artifact_dir"] == "/mnt/x' 'y"


# --- the fleet Worker's options (issue 11: `option control_url …` → [worker]) -----------------------

# `config check` (the converter's validator) loads the CA file as serve does: a real PEM
# certificate (a throwaway CA whose key was never kept).
CA_FILE = str(STANDIN / "cp-ca.pem")
WORKER_UCI = {"control_url": "https://cp.example:8443", "worker_id": "0a1b2c3d-0000-4000-8000-00000000000a",
              "credential_file": "/etc/qlagent/worker.cred", "ca_file": CA_FILE}


def set_list(router: Router, name: str, elements: list) -> None:
    """`uci add_list qlagent.main.NAME=E` for each element (the stand-in's list layout)."""
    (router.uci / name).mkdir()
    for i, e in enumerate(elements, 1):
        (router.uci / name / str(i)).write_bytes(e if isinstance(e, bytes) else e.encode())


def test_worker_options_convert_to_the_worker_table_and_the_instance_is_unchanged(router):
    router.set(**WORKER_UCI, slots="2", heartbeat_interval_s="2.5", pull_wait_s="0", log_store_bytes="8388608")
    set_list(router, "label", ["site=lab", "note=it's \"x\" a=b"])
    set_list(router, "executor", ["local_process"])
    out, msg = router.init("start")
    assert out.returncode == 0 and not any("daemon.err" in ln for ln in router.log_lines()), router.log_lines()
    config = tomllib.loads((router.conf_dir / "qlagent.toml").read_text())
    assert config["worker"] == {
        "control_url": "https://cp.example:8443", "worker_id": "0a1b2c3d-0000-4000-8000-00000000000a",
        "credential_file": "/etc/qlagent/worker.cred", "ca_file": CA_FILE,
        "labels": {"site": "lab", "note": "it's \"x\" a=b"}, "executors": ["local_process"], "slots": 2,
        "heartbeat_interval_s": 2.5, "pull_wait_s": 0, "log_store_bytes": 8388608}
    conf = str(router.conf_dir / "qlagent.toml")
    assert msg["instances"]["instance1"]["command"] == ["/usr/bin/qlagent", "serve", "--config", conf]
    # One label given with `uci set` is a one-element list; no label or executor: the enrolment's.
    shutil.rmtree(router.uci / "label")
    shutil.rmtree(router.uci / "executor")
    router.set(label="site=lab")
    assert router.convert().returncode == 0
    worker = tomllib.loads((router.conf_dir / "qlagent.toml").read_text())["worker"]
    assert worker["labels"] == {"site": "lab"} and "executors" not in worker


def test_control_url_as_a_list_names_every_replica(router):
    # `uci add_list qlagent.main.control_url=…` once per replica: the Worker fails over between them.
    router.set(**{k: v for k, v in WORKER_UCI.items() if k != "control_url"})
    urls = [f"https://cp{i}.example:8443" for i in range(1, 9)]          # the limit: 8
    set_list(router, "control_url", urls)
    out, _ = router.init("start")
    assert out.returncode == 0 and not any("daemon.err" in ln for ln in router.log_lines()), router.log_lines()
    assert tomllib.loads((router.conf_dir / "qlagent.toml").read_text())["worker"]["control_url"] == urls


BAD_WORKER = [
    # (options, lists, message): one per rule the converter adds, and one per [worker] rule of the agent
    ({"worker_id": WORKER_UCI["worker_id"], "control_url": None},
     {}, "option worker_id: is a fleet Worker option; set option control_url too"),
    ({"worker_id": None}, {}, "option worker_id: missing: a Worker needs the worker_id of its enrolment"),
    ({"credential_file": None}, {}, "option credential_file: missing: a Worker needs its credential file (0600)"),
    ({"slots": "05"}, {}, "option slots: must be a decimal whole number without leading zeros, got '05'"),
    ({"slots": "5"}, {}, "option slots: outside 1..4 (the Profile's live runs)"),
    ({"heartbeat_interval_s": "2.5.1"}, {}, "option heartbeat_interval_s: must be a decimal number of seconds"),
    ({"heartbeat_interval_s": "0.5"}, {}, "option heartbeat_interval_s: 0.5 outside 1..60 seconds"),
    ({"pull_wait_s": "31"}, {}, "option pull_wait_s: 31 outside 0..30 seconds"),
    ({"log_store_bytes": "1e6"}, {}, "option log_store_bytes: must be a decimal whole number of bytes"),
    ({}, {"label": ["site=lab", "nokey"]}, "option label: 'nokey' is not KEY=VALUE"),
    ({}, {"label": ["a=1", "a=2"]}, "option label: key 'a' is given twice"),
    ({}, {"label": ["a=b", "c=\td"]}, "option label: must not contain control characters"),
    ({}, {"label": ["k=" + "v" * 129]}, "option label: empty, too long or contains NUL (limit 128)"),
    ({}, {"label": [b"k=\xff"]}, "option label: is not UTF-8"),
    ({}, {"executor": ["docker"]}, 'option executor: must be a non-empty list of ["local_process"] without repeats'),
    ({"control_url": "ftp://cp.example"}, {}, "option control_url: must be https://HOST[:PORT]"),
    ({"ca_file": None}, {}, "option ca_file: required with an https:// control_url"),
    # serve's own CA check (service.preflight), before anything is written
    ({"ca_file": str(STANDIN / "rc.common")}, {},
     f"option ca_file: {STANDIN / 'rc.common'}: not a readable PEM CA (SSLError)"),
    ({"ca_file": "/nonexistent/ca.pem"}, {}, "option ca_file: /nonexistent/ca.pem: not a readable PEM CA"),
    ({"control_url": None}, {"control_url": [f"https://cp{i}.example" for i in range(9)]},
     "option control_url: one URL or a list of 1..8 without repeats"),
    ({"control_url": None}, {"control_url": ["https://cp.example", "https://cp.example"]},
     "option control_url: one URL or a list of 1..8 without repeats"),
    ({"control_url": None}, {"control_url": ["https://cp.example", "ftp://cp2.example"]},
     "option control_url: must be https://HOST[:PORT] (no path, query or user) ('ftp://cp2.example')"),
    ({"credential_file": "worker.cred"}, {}, "option credential_file: 'worker.cred' must be an absolute path"),
    ({"credential_file": b"/etc/\xff"}, {}, "option credential_file: is not UTF-8"),
    ({"worker_id": "ABC"}, {}, "option worker_id: must be the enrolled Worker's lowercase UUID"),
]


@pytest.mark.parametrize("options,lists,message", BAD_WORKER, ids=[m.split(":")[0] + repr(o) + repr(l)
                                                                   for o, l, m in BAD_WORKER])
def test_a_bad_worker_option_exits_2_with_one_line_and_writes_nothing(router, options, lists, message):
    router.set(**WORKER_UCI)
    assert router.convert().returncode == 0
    before = router.snapshot()
    for k, v in options.items():
        if v is None:
            router.unset(k)
        else:
            (router.uci / k).write_bytes(v if isinstance(v, bytes) else v.encode())
    for k, v in lists.items():
        set_list(router, k, v)
    out = router.convert()
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.count("\n") == 1 and message in out.stderr, out.stderr
    assert out.stderr.endswith("(/etc/config/qlagent, section main)\n") and "Traceback" not in out.stderr
    assert router.snapshot() == before
