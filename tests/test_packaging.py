"""Fast checks of what users install: the .deb, the .ipk, the unit and the scripts.

The packages are built from this checkout by the real build scripts (packaging/build-deb,
openwrt/build-ipk) and inspected with the real tools (dpkg-deb, tar, shellcheck,
systemd-analyze, lintian).  A check is skipped only when its tool is absent.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import os
import shutil
import subprocess
import tarfile
import time
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
UNIT = REPO / "systemd" / "qlagent.service"
VERSION = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
DEB_DEPENDS = [
    "python3 (>= 3.11)",
    "python3-msgspec",
    "python3-psutil",
    "python3-sdnotify",
    "python3-cronsim",
    "python3-pyroute2",
    "python3-nacl",
    # The standalone tools first: apt takes the first alternative when none is installed, so an
    # image without systemd gets two small binaries instead of the systemd/dbus/cryptsetup
    # stack; systemd Provides both virtual names, so a box with systemd installs nothing more.
    "systemd-standalone-sysusers | systemd-sysusers",
    "systemd-standalone-tmpfiles | systemd-tmpfiles",
]
SHELL_SCRIPTS = [
    "packaging/build-deb",
    "packaging/e2e-systemd",
    "packaging/vm/build-image",
    "packaging/vm/guest-setup",
    "packaging/vm/guest-boot",
    "packaging/debian/postinst",
    "packaging/debian/prerm",
    "packaging/debian/postrm",
    "systemd/stop-post",
    "openwrt/build-ipk",
    "openwrt/gate/procd-gate",
    "openwrt/qlagent/files/qlagent.init",
    "openwrt/qlagent/files/qlagent-uci2toml",
    "openwrt/qlagent/files/postinst",
    "openwrt/qlagent/files/prerm",
    "tests/openwrt_standin/rc.common",
    "tests/openwrt_standin/uci",
    "tests/openwrt_standin/logger",
    "tests/openwrt_standin/chown",
    "bench/soak_edge.sh",
]


def unit_entries(path: Path) -> dict[str, dict[str, list[str]]]:
    """systemd unit → {section: {key: [values in order]}} (keys may repeat)."""
    sections: dict[str, dict[str, list[str]]] = {}
    current = None
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            current = sections.setdefault(line.strip("[]"), {})
            continue
        key, _, value = line.partition("=")
        current.setdefault(key, []).append(value)
    return sections


@pytest.fixture(scope="module")
def deb(tmp_path_factory) -> Path:
    """The .deb built by packaging/build-deb from a clean clone of this checkout's HEAD
    plus the working tree's packaging files (so uncommitted edits are tested too)."""
    clone = tmp_path_factory.mktemp("clone") / "qlagent"
    subprocess.run(["git", "clone", "-q", str(REPO), str(clone)], check=True)
    for sub in ("packaging", "systemd", "qlagent"):
        shutil.rmtree(clone / sub, ignore_errors=True)
        shutil.copytree(REPO / sub, clone / sub, ignore=shutil.ignore_patterns("__pycache__"))
    out = subprocess.run([str(clone / "packaging" / "build-deb")], check=True, capture_output=True, text=True)
    path = Path(out.stdout.strip())
    assert path == clone / "dist" / f"qlagent_{VERSION}_all.deb"
    return path


@pytest.fixture(scope="module")
def deb_tree(deb, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("debroot")
    subprocess.run(["dpkg-deb", "-x", str(deb), str(root)], check=True)
    return root


@pytest.fixture(scope="module")
def ipk(tmp_path_factory) -> Path:
    out = subprocess.run([str(REPO / "openwrt" / "build-ipk")], check=True, capture_output=True, text=True)
    return Path(out.stdout.strip())


def control_fields(text: str) -> dict[str, str]:
    fields: dict[str, str] = {}
    key = None
    for line in text.splitlines():
        if line.startswith((" ", "\t")) and key:
            fields[key] += "\n" + line.strip()
        elif ":" in line:
            key, _, value = line.partition(":")
            fields[key] = value.strip()
    return fields


# --- systemd unit ----------------------------------------------------------

def test_unit_is_notify_with_watchdog_budget_and_drain_consistent_stop_timeout():
    svc = unit_entries(UNIT)["Service"]
    assert svc["Type"] == ["notify-reload"] and svc["NotifyAccess"] == ["main"]
    assert svc["ExecStart"] == ["/usr/bin/qlagent serve --config /etc/qlagent/qlagent.toml"]
    # systemctl reload: SIGHUP (notify-reload) + the same validator, whose exit status fails the job.
    assert svc["ExecReload"] == ["/usr/bin/qlagent config check --config /etc/qlagent/qlagent.toml"]
    assert svc["Restart"] == ["on-failure"] and int(svc["WatchdogSec"][0]) > 0
    assert svc["MemoryMax"] == ["128M"] and svc["TasksMax"] == ["64"]
    # The agent is the OOM killer's last choice; shims (500) and tasks (1000) raise themselves.
    assert int(svc["OOMScoreAdjust"][0]) < 0
    assert svc["User"] == ["qlagent"] and svc["StateDirectory"] == ["qlagent"]
    # KillMode=process keeps runs across watchdog/crash restarts; stop-post ends them on a real stop.
    assert svc["KillMode"] == ["process"] and svc["ExecStopPost"] == ["/usr/lib/qlagent/stop-post"]
    grace = tomllib.loads((REPO / "packaging" / "qlagent.toml").read_text())["drain_grace_s"]
    assert int(svc["TimeoutStopSec"][0]) >= grace + 10


def test_state_dir_mode_is_the_one_doctor_accepts():
    """One rule (core.limits.STATE_DIR_MODE) for the mode every package gives the state dir
    and the most `qlagent doctor` accepts: a package that sets more fails doctor on a healthy box."""
    from qlagent.core.limits import STATE_DIR_MODE
    want = f"{STATE_DIR_MODE:04o}"
    assert unit_entries(UNIT)["Service"]["StateDirectoryMode"] == [want]
    tmpfiles = [ln.split() for ln in (REPO / "systemd" / "qlagent.tmpfiles").read_text().splitlines()
                if ln and not ln.startswith("#")]
    assert ["d", "/var/lib/qlagent", want, "qlagent", "qlagent", "-"] in tmpfiles
    init = (REPO / "openwrt" / "qlagent" / "files" / "qlagent.init").read_text()
    assert f'chmod {want} "$state_dir"' in init


def test_unit_hardening_keys():
    svc = unit_entries(UNIT)["Service"]
    for key in ("NoNewPrivileges", "ProtectHome", "PrivateTmp", "ProtectKernelTunables",
                "ProtectKernelModules", "ProtectKernelLogs", "RestrictSUIDSGID"):
        assert svc[key] == ["yes"], key
    # The unit's own cgroup is the agent's to divide among Runs (adapters.runcgroup); a
    # read-only /sys/fs/cgroup would leave only oom_score_adj.
    assert (svc["Delegate"], svc["DelegateSubgroup"], svc["ProtectControlGroups"]) == (
        ["memory pids"], ["agent"], ["no"])
    assert svc["ProtectSystem"] == ["strict"]
    assert svc["RestrictAddressFamilies"] == ["AF_UNIX AF_INET AF_INET6 AF_NETLINK"]
    assert svc["CapabilityBoundingSet"] == [""]


def test_standalone_dropin_raises_the_budget():
    svc = unit_entries(REPO / "systemd" / "standalone.conf")["Service"]
    assert svc == {"MemoryMax": ["256M"], "TasksMax": ["256"]}


@pytest.mark.skipif(not shutil.which("systemd-analyze"), reason="systemd-analyze not installed")
def test_systemd_analyze_verify_and_security_exposure(deb_tree, tmp_path):
    # The installed tree plus the host's own units (targets the unit orders against), so that
    # verify also checks that ExecStart/ExecStopPost exist and are executable in the package.
    root = tmp_path / "root"
    shutil.copytree(deb_tree, root, symlinks=True)
    host_units = Path("/usr/lib/systemd/system") if Path("/usr/lib/systemd/system/sysinit.target").exists() \
        else Path("/lib/systemd/system")
    shutil.copytree(host_units, root / "usr/lib/systemd/system", symlinks=True, dirs_exist_ok=True)
    verify = subprocess.run(["systemd-analyze", "verify", f"--root={root}", "qlagent.service"],
                            capture_output=True, text=True)
    problems = [l for l in verify.stderr.splitlines() if "qlagent.service" in l]
    version = int(subprocess.run(["systemd-analyze", "--version"], capture_output=True, text=True).stdout.split()[1])
    if version < 253:
        # notify-reload is systemd 253+ (Debian 13 has 257; packaging/e2e-systemd verifies there).
        problems = [l for l in problems if not l.endswith("Failed to parse service type, ignoring: notify-reload")]
    if version < 254:       # DelegateSubgroup= is 254+, likewise
        problems = [l for l in problems if "Unknown key 'DelegateSubgroup'" not in l]
    assert verify.returncode == 0 and not problems, verify.stderr
    unit = deb_tree / "usr/lib/systemd/system/qlagent.service"
    sec = subprocess.run(["systemd-analyze", "security", "--offline=yes", str(unit)], capture_output=True, text=True)
    line = next(l for l in sec.stdout.splitlines() if "Overall exposure level" in l)
    exposure = float(line.split(":")[1].split()[0])
    assert exposure <= 3.0, line


# --- Debian package ----------------------------------------------------------

def test_deb_control_depends_and_conffile(deb):
    fields = control_fields(subprocess.run(["dpkg-deb", "-f", str(deb)], check=True, capture_output=True, text=True).stdout)
    assert fields["Package"] == "qlagent" and fields["Version"] == VERSION and fields["Architecture"] == "all"
    depends = [d.strip() for d in fields["Depends"].split(",")]
    for dep in DEB_DEPENDS:
        assert dep in depends
    # cryptography only reads Secrets an earlier version stored: recommended (kept on upgrade), not required
    assert "python3-cryptography" not in depends and fields["Recommends"] == "python3-cryptography"
    conffiles = subprocess.run(["dpkg-deb", "-I", str(deb), "conffiles"], check=True, capture_output=True, text=True).stdout
    assert conffiles.split() == ["/etc/qlagent/qlagent.toml"]


def apt_simulate_install(debs: list[Path | str], status: Path | None) -> dict[str, list[str]]:
    """``apt-get -s install`` of local .debs or package names against this host's package lists → {"Inst": [...],
    "Remv": [...]} package names. ``status``: a dpkg status file standing for the root's
    installed packages (None: this host's own). Takes no lock and writes no cache."""
    opts = ["-o", "Debug::NoLocking=1", "-o", "Dir::Cache::pkgcache=", "-o", "Dir::Cache::srcpkgcache="]
    if status is not None:
        opts += ["-o", f"Dir::State::status={status}"]
    out = subprocess.run(["apt-get", "-s", *opts, "install", "--no-install-recommends", *map(str, debs)],
                         capture_output=True, text=True, env=dict(os.environ, LC_ALL="C"))
    assert out.returncode == 0, out.stdout + out.stderr
    actions: dict[str, list[str]] = {"Inst": [], "Remv": []}
    for line in out.stdout.splitlines():
        verb, _, rest = line.partition(" ")
        if verb in actions:
            actions[verb].append(rest.split()[0])
    return actions


@pytest.mark.skipif(not shutil.which("apt-get") or subprocess.run(
    ["apt-cache", "show", "systemd-standalone-sysusers"], capture_output=True).returncode != 0,
    reason="needs apt-get with Debian package lists holding systemd-standalone-sysusers (apt-get update)")
def test_apt_install_without_systemd_pulls_the_standalone_tools_not_systemd(deb, tmp_path):
    # A Depends the host's archive has not got (python3-msgspec before trixie) is provided by a
    # stub, so that apt resolves the rest exactly as the package says.
    depends = control_fields(subprocess.run(["dpkg-deb", "-f", str(deb)], check=True, capture_output=True,
                                            text=True).stdout)["Depends"]
    missing = [d for d in (g.strip().split()[0] for g in depends.split(",") if "|" not in g)
               if subprocess.run(["apt-cache", "show", d], capture_output=True).returncode != 0]
    stub = tmp_path / "stub"
    (stub / "DEBIAN").mkdir(parents=True)
    (stub / "DEBIAN" / "control").write_text(
        "Package: qlagent-test-stub\nVersion: 1\nArchitecture: all\nMaintainer: t <t@t.invalid>\n"
        + (f"Provides: {', '.join(missing)}\n" if missing else "") + "Description: stands in for missing packages\n")
    subprocess.run(["dpkg-deb", "--build", str(stub), str(tmp_path / "stub.deb")], check=True, capture_output=True)
    debs = [deb, tmp_path / "stub.deb"]

    bare = tmp_path / "status"             # a root with nothing installed: every dependency resolves
    bare.write_text("")
    fresh = apt_simulate_install(debs, bare)
    assert {"systemd-standalone-sysusers", "systemd-standalone-tmpfiles", "qlagent"} <= set(fresh["Inst"])
    assert not {"systemd", "dbus", "libcryptsetup12", "libsystemd-shared"} & set(fresh["Inst"]), fresh["Inst"]

    # That root, installed, later gets systemd: apt replaces the standalone tools, qlagent stays.
    # (One apt-cache for every archive package: each call loads the package lists anew.)
    local = {"qlagent": deb, "qlagent-test-stub": tmp_path / "stub.deb"}
    shown = subprocess.run(["apt-cache", "show", "--no-all-versions", *(n for n in fresh["Inst"] if n not in local)],
                           check=True, capture_output=True, text=True).stdout
    archive = {control_fields(r)["Package"]: r.strip() for r in shown.split("\n\n") if r.strip()}
    records = []
    for name in fresh["Inst"]:
        text = (subprocess.run(["dpkg-deb", "-f", str(local[name])], check=True, capture_output=True,
                               text=True).stdout.strip() if name in local else archive[name])
        records.append(text.replace("\n", "\nStatus: install ok installed\n", 1))
    installed = tmp_path / "installed"
    installed.write_text("\n\n".join(records) + "\n")
    later = apt_simulate_install(["systemd"], installed)
    assert "systemd" in later["Inst"]
    assert sorted(later["Remv"]) == ["systemd-standalone-sysusers", "systemd-standalone-tmpfiles"], later

    if subprocess.run(["dpkg-query", "-W", "-f", "${db:Status-Status}", "systemd"], capture_output=True,
                      text=True).stdout != "installed":
        pytest.skip("this host has no systemd installed: the box-with-systemd half cannot run")
    host = apt_simulate_install(debs, None)
    assert not {p for p in host["Inst"] if p.startswith("systemd")} and not host["Remv"], host


def test_deb_tree(deb_tree):
    for rel in ("usr/bin/qlagent", "usr/lib/qlagent/stop-post"):
        assert os.access(deb_tree / rel, os.X_OK), rel
    for rel in ("usr/lib/python3/dist-packages/qlagent/__init__.py",
                "usr/lib/python3/dist-packages/qlagent/adapters/sqlite/migrations/0001_core.sql",
                *(f"usr/lib/python3/dist-packages/qlagent/adapters/shim/{name}.py"   # the shim runs from them
                  for name in ("main", "drainer", "leftovers", "oom", "forkserver")),
                "usr/lib/systemd/system/qlagent.service", "usr/lib/sysusers.d/qlagent.conf",
                "usr/lib/tmpfiles.d/qlagent.conf", "usr/share/doc/qlagent/copyright",
                "usr/share/doc/qlagent/changelog.gz", "usr/share/qlagent/standalone.conf"):
        assert (deb_tree / rel).is_file(), rel
    assert not list(deb_tree.rglob("__pycache__")), "bytecode must be built at install time, not shipped"
    config = tomllib.loads((deb_tree / "etc/qlagent/qlagent.toml").read_text())
    assert config == {"profile": "edge", "state_dir": "/var/lib/qlagent",
                      "artifact_dir": "/var/lib/qlagent/artifacts", "drain_grace_s": 20}
    assert "u qlagent" in (deb_tree / "usr/lib/sysusers.d/qlagent.conf").read_text()


def test_deb_maintainer_scripts_start_stop_purge(deb, tmp_path):
    subprocess.run(["dpkg-deb", "-e", str(deb), str(tmp_path)], check=True)
    postinst = (tmp_path / "postinst").read_text()
    assert "systemd-sysusers qlagent.conf" in postinst and "deb-systemd-invoke" in postinst
    # Not behind `command -v`: /var/lib/qlagent must exist before `qlagent init` runs as qlagent.
    assert "\n    systemd-tmpfiles --create qlagent.conf" in postinst
    assert "[ -d /run/systemd/system ]" in postinst  # no start inside a chroot
    assert "deb-systemd-invoke stop qlagent.service" in (tmp_path / "prerm").read_text()
    postrm = (tmp_path / "postrm").read_text()
    purge = postrm[postrm.index('"$1" = purge'):]
    assert "rm -rf /var/lib/qlagent" in purge


def test_deb_build_is_byte_reproducible(deb):
    """Two builds, a second apart, give the same bytes: mtimes are SOURCE_DATE_EPOCH (default:
    the last commit's time); an explicit SOURCE_DATE_EPOCH is honoured."""
    first = hashlib.sha256(deb.read_bytes()).hexdigest()
    time.sleep(1.1)
    build = deb.parents[1] / "packaging" / "build-deb"
    again = subprocess.run([str(build)], check=True, capture_output=True, text=True).stdout.strip()
    assert hashlib.sha256(Path(again).read_bytes()).hexdigest() == first
    env = dict(os.environ, SOURCE_DATE_EPOCH="1700000000")
    other = subprocess.run([str(build)], check=True, capture_output=True, text=True, env=env).stdout.strip()
    listing = subprocess.run(["dpkg-deb", "-c", other], check=True, capture_output=True, text=True).stdout
    assert "2023-11-14" in listing.splitlines()[0]   # 1700000000 = 2023-11-14T22:13:20Z


@pytest.mark.skipif(not shutil.which("lintian"), reason="lintian not installed (apt-get install lintian)")
def test_lintian_reports_no_errors(deb):
    out = subprocess.run(["lintian", "--fail-on", "error", str(deb)], capture_output=True, text=True)
    errors = [l for l in out.stdout.splitlines() if l.startswith("E:")]
    assert out.returncode == 0 and not errors, out.stdout + out.stderr


# --- OpenWrt package -----------------------------------------------------------

def makefile_var(name: str) -> str:
    mk = (REPO / "openwrt" / "qlagent" / "Makefile").read_text()
    return next(l.split(":=", 1)[1] for l in mk.splitlines() if l.startswith(name + ":="))


def test_ipk_layout_and_control(ipk):
    ipk_version = f"{VERSION}-r{makefile_var('PKG_RELEASE')}"
    assert ipk.name == f"qlagent_{ipk_version}_all.ipk"
    with tarfile.open(ipk, "r:gz") as outer:
        assert outer.getnames() == ["./debian-binary", "./data.tar.gz", "./control.tar.gz"]
        assert outer.extractfile("./debian-binary").read() == b"2.0\n"
        control_tgz = outer.extractfile("./control.tar.gz").read()
        data_tgz = outer.extractfile("./data.tar.gz").read()
    with tarfile.open(fileobj=io.BytesIO(control_tgz), mode="r:gz") as ctl:
        names = set(ctl.getnames())
        assert {"./control", "./conffiles", "./postinst", "./prerm"} <= names
        fields = control_fields(ctl.extractfile("./control").read().decode())
        conffiles = ctl.extractfile("./conffiles").read().decode().split()
    assert fields["Package"] == "qlagent" and fields["Version"] == ipk_version and fields["Architecture"] == "all"
    depends = [d.strip() for d in fields["Depends"].split(",")]
    # The Makefile's DEPENDS (checked against the imports by test_openwrt_imports.py); no sdnotify.
    assert depends == ["libc", "python3-light", "python3-codecs", "python3-ctypes", "python3-logging",
                       "python3-openssl", "python3-sqlite3",
                       "python3-urllib", "python3-uuid", "python3-cronsim", "python3-msgspec",
                       "python3-psutil", "python3-pynacl", "python3-pyroute2"]
    # Installed-Size as OpenWrt's scripts/ipkg-build computes it: bytes of the uncompressed data tar.
    assert int(fields["Installed-Size"]) == len(gzip.decompress(data_tgz))
    assert fields["Require-User"] == "qlagent=377:qlagent=377"
    assert conffiles == ["/etc/config/qlagent"]
    with tarfile.open(fileobj=io.BytesIO(data_tgz), mode="r:gz") as data:
        members = {m.name: m for m in data.getmembers()}
    for path, mode in (("./etc/init.d/qlagent", 0o755), ("./usr/bin/qlagent", 0o755),
                       ("./usr/libexec/qlagent-uci2toml", 0o755), ("./etc/config/qlagent", 0o600),
                       ("./usr/lib/qlagent/python/qlagent/__init__.py", 0o644),
                       *((f"./usr/lib/qlagent/python/qlagent/adapters/shim/{name}.py", 0o644)
                         for name in ("main", "drainer", "leftovers", "oom", "forkserver"))):
        assert members[path].mode == mode, path
        assert members[path].uid == 0 and members[path].gid == 0, path
    assert not any("__pycache__" in n for n in members)


def test_ipk_build_is_reproducible(ipk, tmp_path):
    first = ipk.read_bytes()
    out = subprocess.run([str(REPO / "openwrt" / "build-ipk")], check=True, capture_output=True, text=True)
    assert Path(out.stdout.strip()).read_bytes() == first


def test_init_script_is_a_procd_script():
    # What it hands procd is checked by running it: tests/test_openwrt.py.
    init = (REPO / "openwrt" / "qlagent" / "files" / "qlagent.init").read_text()
    assert init.startswith("#!/bin/sh /etc/rc.common\n") and "USE_PROCD=1" in init


# --- shell scripts ----------------------------------------------------------------

@pytest.mark.parametrize("script", SHELL_SCRIPTS)
def test_shell_script_parses(script):
    path = REPO / script
    shell = "bash" if path.read_text().startswith("#!/bin/bash") else "sh"
    subprocess.run([shell, "-n", str(path)], check=True)


@pytest.mark.skipif(not shutil.which("shellcheck"), reason="shellcheck not installed (apt-get install shellcheck)")
def test_shellcheck_clean():
    out = subprocess.run(["shellcheck", "-S", "style", *[str(REPO / s) for s in SHELL_SCRIPTS]],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stdout


# --- stop-post (ExecStopPost) in a real cgroup -------------------------------------------

V1_SYSTEMD = Path("/sys/fs/cgroup/systemd")


@pytest.fixture
def unit_cgroup():
    """A fresh cgroup in the v1 name=systemd hierarchy, standing in for qlagent.service's."""
    if os.geteuid() != 0 or not (V1_SYSTEMD / "cgroup.procs").exists():
        pytest.skip("needs root and the cgroup v1 name=systemd hierarchy at /sys/fs/cgroup/systemd")
    cg = V1_SYSTEMD / f"qlagent-stoppost-{os.getpid()}"
    cg.mkdir()
    yield cg
    for pid in (cg / "cgroup.procs").read_text().split():
        try:
            os.kill(int(pid), 9)
        except ProcessLookupError:
            pass
    for _ in range(100):
        try:
            cg.rmdir()
            break
        except OSError:
            import time
            time.sleep(0.05)


def spawn_in(cg: Path, argv: list[str]) -> subprocess.Popen:
    def enter():
        with open(cg / "cgroup.procs", "w") as f:
            f.write("0")
    # Like a run: its own session, so nothing but an explicit kill reaches it.
    return subprocess.Popen(argv, preexec_fn=enter, start_new_session=True)


def stop_post(cg: Path, result: str) -> subprocess.CompletedProcess:
    def enter():
        with open(cg / "cgroup.procs", "w") as f:
            f.write("0")
    return subprocess.run(["sh", str(REPO / "systemd" / "stop-post")], preexec_fn=enter, timeout=30,
                          env={"PATH": "/usr/bin:/bin", "SERVICE_RESULT": result}, capture_output=True, text=True)


@pytest.mark.parametrize("result", ["watchdog", "signal", "exit-code", "core-dump"])
def test_stop_post_keeps_runs_when_a_restart_follows(unit_cgroup, result):
    run = spawn_in(unit_cgroup, ["sleep", "60"])
    try:
        assert stop_post(unit_cgroup, result).returncode == 0
        assert run.poll() is None, f"SERVICE_RESULT={result} must leave the run for the restarted agent"
    finally:
        run.kill()
        run.wait()


@pytest.mark.parametrize("result", ["success", "timeout"])
def test_stop_post_ends_every_run_process_on_a_real_stop(unit_cgroup, result):
    polite = spawn_in(unit_cgroup, ["sleep", "60"])
    # Ignores SIGTERM: only the SIGKILL after the 5 s grace ends it.
    stubborn = spawn_in(unit_cgroup, ["sh", "-c", "trap '' TERM; while :; do sleep 0.2; done"])
    outsider = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        assert stop_post(unit_cgroup, result).returncode == 0
        assert polite.wait(timeout=5) == -15
        assert stubborn.wait(timeout=5) == -9
        assert outsider.poll() is None, "a process outside the unit's cgroup must not be touched"
    finally:
        outsider.kill()
        outsider.wait()


def test_stop_post_from_control_ends_the_processes_of_every_sub_cgroup(unit_cgroup):
    """With delegation systemd runs ExecStopPost in <unit>/.control while the agent and each
    Run's tasks sit in <unit>/agent and <unit>/run-<attempt>: a real stop ends them all."""
    subs = {n: unit_cgroup / n for n in (".control", "agent", "run-a1")}
    for d in subs.values():
        d.mkdir()
    agent = spawn_in(subs["agent"], ["sleep", "60"])
    task = spawn_in(subs["run-a1"], ["sleep", "60"])
    try:
        assert stop_post(subs[".control"], "success").returncode == 0
        assert agent.wait(10) == -15 and task.wait(10) == -15
    finally:
        for p in (agent, task):
            p.kill()
            p.wait()
        for d in subs.values():
            d.rmdir()
