"""Fleet test harness (issue 11 acceptance): the real parts a fleet test stands on.

- ``PgPair``: a PostgreSQL **primary and a synchronous standby** started for the test (``initdb``,
  ``pg_basebackup -R``, free ports on 127.0.0.1, ``synchronous_standby_names`` on the primary),
  ``promote()``, ``stop_primary(mode)``, and a libpq multi-host URL with
  ``target_session_attrs=read-write`` so a client follows the writable server.
- ``WorkerNet``: one network namespace per Worker, joined to the host by a veth pair with a
  link-local /30 (169.254.A.B) chosen from the test's PID; ``link_down()``/``link_up()`` cut and
  restore the Worker's only link. Traffic flows only between the host and namespaces made here.
- ``Cgroup``: a cgroup v1 memory + pids pair with the edge budget (128 MiB / 64 PIDs) and the
  figures the final assertions read (OOM kills, failed forks, peak memory).
- ``spawn_in(argv, net=, cgroup=)``: a process inside the namespace and the cgroup from its
  first instruction.

PostgreSQL refuses to run as root: as root, data directories belong to the ``postgres`` OS user
and every server binary runs through ``runuser -u postgres --``. Every ``close()`` is safe to
call twice and after a failed start, so fixtures clean up even when a test fails half-way.
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import pytest

from kit import free_port, wait_until

MiB = 1_048_576
CG = "/sys/fs/cgroup"
EDGE_MEMORY_BYTES = 128 * MiB
EDGE_PIDS = 64


# ---------------------------------------------------------------- PostgreSQL primary + standby

def pg_bindir() -> str | None:
    """Directory holding ``initdb``/``pg_ctl``/``pg_basebackup``/``postgres``, or None.

    Tries PATH, ``pg_config --bindir`` and ``/usr/lib/postgresql/*/bin`` (newest version first):
    Debian puts the server binaries outside PATH, and a lone ``pg_ctl`` symlink on PATH is not
    enough (``initdb`` must sit next to it).
    """
    need = ("initdb", "pg_ctl", "pg_basebackup", "postgres")
    dirs = []
    on_path = shutil.which("initdb")
    if on_path:
        dirs.append(os.path.dirname(os.path.realpath(on_path)))
    if shutil.which("pg_config"):
        p = subprocess.run(["pg_config", "--bindir"], capture_output=True, text=True)
        if p.returncode == 0:
            dirs.append(p.stdout.strip())

    def version(d: str) -> float:
        try:
            return float(d.split("/")[-2])
        except ValueError:
            return 0.0

    dirs += sorted(glob.glob("/usr/lib/postgresql/*/bin"), key=version, reverse=True)
    for d in dirs:
        if all(os.access(os.path.join(d, b), os.X_OK) for b in need):
            return d
    return None


class PgPair:
    """A primary and one synchronous standby on free ports of 127.0.0.1, user ``postgres``, trust.

    ``start()`` returns once the primary's ``pg_stat_replication`` shows the standby with
    ``sync_state = 'sync'``: from then on a committed transaction is on the standby's disk.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self.bindir = pg_bindir()
        if self.bindir is None:
            raise RuntimeError("PostgreSQL server binaries (initdb, pg_ctl, pg_basebackup) not found")
        self.base = tempfile.mkdtemp(prefix=f"qlagent-{name}-")
        self.primary_dir = os.path.join(self.base, "primary")
        self.standby_dir = os.path.join(self.base, "standby")
        self.primary_port = free_port()
        self.standby_port = free_port()
        self.standby_name = f"standby_{name}".replace("-", "_")
        self._as_postgres = os.geteuid() == 0
        if self._as_postgres:
            pw = pwd.getpwnam("postgres")
            os.chown(self.base, pw.pw_uid, pw.pw_gid)
        os.chmod(self.base, 0o700)
        self._running: set[str] = set()

    # -- helpers
    def _run(self, binary: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        argv = [os.path.join(self.bindir, binary), *args]
        if self._as_postgres:
            argv = ["runuser", "-u", "postgres", "--", *argv]
        p = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=self.base)
        if p.returncode != 0:
            raise RuntimeError(f"{binary} {' '.join(args)} failed ({p.returncode}): {p.stderr.strip()[-2000:]}")
        return p

    def _append_conf(self, datadir: str, lines: list[str]) -> None:
        # Appending keeps the file's owner (postgres) and mode.
        path = os.path.join(datadir, "postgresql.auto.conf")
        with open(path, "a") as f:
            f.write("\n".join(lines) + "\n")

    def _ctl_start(self, which: str, datadir: str) -> None:
        self._run("pg_ctl", "-D", datadir, "-l", os.path.join(self.base, f"{which}.log"), "-w", "-t", "60", "start")
        self._running.add(which)

    @staticmethod
    def conninfo(port: int, dbname: str = "postgres") -> str:
        return f"host=127.0.0.1 port={port} user=postgres dbname={dbname} connect_timeout=5"

    def query(self, port: int, sql: str, params=None, *, autocommit: bool = True):
        """Run one statement on the server at ``port``; returns all rows (or None)."""
        import psycopg
        with psycopg.connect(self.conninfo(port), autocommit=autocommit) as conn:
            cur = conn.execute(sql, params)
            return cur.fetchall() if cur.description else None

    def url(self, dbname: str = "postgres") -> str:
        """libpq multi-host URL: primary first, standby second, only a read-write server accepted."""
        return multi_host_url([("127.0.0.1", self.primary_port), ("127.0.0.1", self.standby_port)], dbname)

    # -- lifecycle
    def start(self, timeout_s: float = 60) -> "PgPair":
        self._run("initdb", "-D", self.primary_dir, "-U", "postgres", "--auth=trust", "-E", "UTF8",
                  "--no-instructions")
        # Sync standby names are set only after the base backup, so the standby's copy of the
        # configuration has none: after promotion it must not wait for a standby of its own.
        self._append_conf(self.primary_dir, [
            "listen_addresses = '127.0.0.1'", f"port = {self.primary_port}",
            f"unix_socket_directories = '{self.base}'", "wal_level = replica", "max_wal_senders = 4",
            "max_connections = 60", "shared_buffers = 16MB", "wal_keep_size = 64MB",
            "synchronous_commit = on", "logging_collector = off",
        ])
        self._ctl_start("primary", self.primary_dir)
        self._run("pg_basebackup", "-d", f"{self.conninfo(self.primary_port)} application_name={self.standby_name}",
                  "-D", self.standby_dir, "-R", "-X", "stream", "-c", "fast")
        self._append_conf(self.standby_dir, [
            f"port = {self.standby_port}", "synchronous_standby_names = ''",
            f"primary_conninfo = '{self.conninfo(self.primary_port)} application_name={self.standby_name}'",
        ])
        self._ctl_start("standby", self.standby_dir)
        self.query(self.primary_port, f"ALTER SYSTEM SET synchronous_standby_names = '{self.standby_name}'")
        self.query(self.primary_port, "SELECT pg_reload_conf()")
        wait_until(lambda: self.query(self.primary_port,
                                      "SELECT 1 FROM pg_stat_replication WHERE application_name = %s "
                                      "AND sync_state = 'sync' AND state = 'streaming'", (self.standby_name,)),
                   timeout_s, "the standby to stream synchronously")
        return self

    def in_recovery(self, port: int) -> bool:
        return self.query(port, "SELECT pg_is_in_recovery()")[0][0]

    def promote(self, timeout_s: float = 60) -> None:
        """Promote the standby (``pg_ctl promote -w``); returns once it accepts writes."""
        self._run("pg_ctl", "-D", self.standby_dir, "-w", "-t", str(int(timeout_s)), "promote")
        wait_until(lambda: not self.in_recovery(self.standby_port), timeout_s, "the promoted standby to leave recovery")

    def stop_primary(self, mode: str = "immediate") -> None:
        """``pg_ctl stop -m MODE`` on the primary (``immediate`` = a crash: no checkpoint)."""
        if mode not in ("smart", "fast", "immediate"):
            raise ValueError(f"mode {mode!r} is not smart, fast or immediate")
        self._run("pg_ctl", "-D", self.primary_dir, "-m", mode, "-w", "stop")
        self._running.discard("primary")

    def close(self) -> None:
        """Stop both servers (immediate) and remove their directories; idempotent."""
        for which, d in (("standby", self.standby_dir), ("primary", self.primary_dir)):
            if which in self._running:
                try:
                    self._run("pg_ctl", "-D", d, "-m", "immediate", "-w", "stop", timeout=60)
                except (RuntimeError, subprocess.TimeoutExpired):
                    _kill_postmaster(d)
                self._running.discard(which)
        shutil.rmtree(self.base, ignore_errors=True)


@contextlib.contextmanager
def started_pair(tag: str):
    """A started :class:`PgPair` for a ``with`` block, closed at its end (also after a failed
    start). Missing server binaries fail the test with one line: a cluster test is never
    skipped silently."""
    if pg_bindir() is None:
        pytest.fail("PostgreSQL server binaries (initdb, pg_ctl, pg_basebackup) not found", pytrace=False)
    pair = PgPair(tag)
    try:
        yield pair.start()
    finally:
        pair.close()


def _kill_postmaster(datadir: str) -> None:
    try:
        with open(os.path.join(datadir, "postmaster.pid")) as f:
            os.kill(int(f.readline()), signal.SIGKILL)
    except (OSError, ValueError):
        pass


def multi_host_url(hosts: list[tuple[str, int]], dbname: str = "postgres", user: str = "postgres") -> str:
    """``postgresql://user@h1:p1,h2:p2/db?target_session_attrs=read-write&connect_timeout=2``.

    libpq tries the hosts in order and keeps the first that accepts writes, so clients follow a
    promotion without knowing which server is the primary.
    """
    if not hosts:
        raise ValueError("hosts: at least one (host, port)")
    netloc = ",".join(f"[{h}]:{p}" if ":" in h else f"{h}:{p}" for h, p in hosts)
    return f"postgresql://{user}@{netloc}/{dbname}?target_session_attrs=read-write&connect_timeout=2"


# ---------------------------------------------------------------- network namespaces

def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    p = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and p.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed: {p.stderr.strip()}")
    return p


class WorkerNet:
    """Namespace ``qlf<pid>w<idx>`` with veth ``qfh<pid>x<idx>`` (host) ↔ ``eth0`` (namespace).

    Addresses: host ``169.254.A.(4i+1)/30``, namespace ``169.254.A.(4i+2)/30`` with A from the
    test's PID, so parallel test processes get different subnets. The namespace has no default
    route: it reaches the host's veth address and nothing else.
    """

    def __init__(self, idx: int, tag: int | None = None) -> None:
        if not 0 <= idx < 64:
            raise ValueError("idx: 0..63 (one /30 each inside a /24)")
        tag = os.getpid() if tag is None else tag
        self.ns = f"qlf{tag}w{idx}"
        self.host_if = f"qfh{tag % 100_000_000}x{idx}"          # ≤ 14 characters (IFNAMSIZ 16)
        octet = 1 + tag % 254
        self.host_addr = f"169.254.{octet}.{4 * idx + 1}"
        self.ns_addr = f"169.254.{octet}.{4 * idx + 2}"
        self._made = False

    def create(self) -> "WorkerNet":
        _ip("netns", "del", self.ns, check=False)          # a leftover of a killed run with this PID
        _ip("link", "del", self.host_if, check=False)
        _ip("netns", "add", self.ns)
        self._made = True
        _ip("link", "add", self.host_if, "type", "veth", "peer", "name", "eth0", "netns", self.ns)
        _ip("addr", "add", f"{self.host_addr}/30", "dev", self.host_if)
        _ip("link", "set", self.host_if, "up")
        _ip("-n", self.ns, "addr", "add", f"{self.ns_addr}/30", "dev", "eth0")
        _ip("-n", self.ns, "link", "set", "lo", "up")
        _ip("-n", self.ns, "link", "set", "eth0", "up")
        return self

    def link_down(self) -> None:
        """Cut the Worker's link (``ip link set HOST_IF down``): the namespace side loses carrier."""
        _ip("link", "set", self.host_if, "down")

    def link_up(self) -> None:
        """Restore the link (``ip link set HOST_IF up``)."""
        _ip("link", "set", self.host_if, "up")

    def prefix(self) -> list[str]:
        """argv prefix that runs a command inside the namespace."""
        return ["ip", "netns", "exec", self.ns]

    def close(self) -> None:
        """Kill every process left in the namespace, delete it and the veth; idempotent."""
        if not self._made:
            return
        p = _ip("netns", "pids", self.ns, check=False)
        for pid in p.stdout.split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
        _ip("link", "del", self.host_if, check=False)
        _ip("netns", "del", self.ns, check=False)
        self._made = False


# ---------------------------------------------------------------- cgroups (v1 memory + pids)

def cgroup_v1_available() -> bool:
    return os.geteuid() == 0 and all(os.access(f"{CG}/{c}", os.W_OK) for c in ("memory", "pids"))


class Cgroup:
    """``/sys/fs/cgroup/{memory,pids}/NAME`` with a memory limit (swap included where the kernel
    accounts it) and a PID limit; defaults are the edge Profile's 128 MiB / 64 PIDs."""

    def __init__(self, name: str, memory_bytes: int = EDGE_MEMORY_BYTES, pids: int = EDGE_PIDS) -> None:
        self.name = name
        self.mem = f"{CG}/memory/{name}"
        self.pids = f"{CG}/pids/{name}"
        self.memory_bytes, self.pids_max = memory_bytes, pids
        self._made: list[str] = []

    def create(self) -> "Cgroup":
        for d in (self.mem, self.pids):
            os.mkdir(d)
            self._made.append(d)
        self._write(self.mem, "memory.limit_in_bytes", self.memory_bytes)
        if os.path.exists(f"{self.mem}/memory.memsw.limit_in_bytes"):
            self._write(self.mem, "memory.memsw.limit_in_bytes", self.memory_bytes)
        self._write(self.pids, "pids.max", self.pids_max)
        return self

    @staticmethod
    def _write(d: str, name: str, value) -> None:
        with open(f"{d}/{name}", "w") as f:
            f.write(str(value))

    @staticmethod
    def _read(d: str, name: str) -> str:
        with open(f"{d}/{name}") as f:
            return f.read()

    def enter(self, pid: int) -> None:
        """Move ``pid`` into both controllers."""
        self._write(self.mem, "cgroup.procs", pid)
        self._write(self.pids, "cgroup.procs", pid)

    def procs(self) -> list[int]:
        return [int(p) for p in self._read(self.pids, "cgroup.procs").split()]

    def oom_kills(self) -> int:
        """Processes the kernel OOM-killed in this cgroup (``memory.oom_control`` ``oom_kill``)."""
        fields = dict(line.split() for line in self._read(self.mem, "memory.oom_control").splitlines())
        return int(fields.get("oom_kill", 0))

    def fork_failures(self) -> int:
        """Forks refused because ``pids.max`` was reached (``pids.events`` ``max``)."""
        fields = dict(line.split() for line in self._read(self.pids, "pids.events").splitlines())
        return int(fields.get("max", 0))

    def peak_memory_bytes(self) -> int:
        return int(self._read(self.mem, "memory.max_usage_in_bytes"))

    def close(self) -> None:
        """SIGKILL what is left inside, then rmdir both; idempotent."""
        for d in reversed(self._made):
            for _ in range(100):
                try:
                    for pid in self._read(d, "cgroup.procs").split():
                        try:
                            os.kill(int(pid), signal.SIGKILL)
                        except ProcessLookupError:
                            pass
                    os.rmdir(d)
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.05)
        self._made.clear()


def spawn_in(argv: list[str], *, net: WorkerNet | None = None, cgroup: Cgroup | None = None,
             **popen) -> subprocess.Popen:
    """Start ``argv`` inside ``net``'s namespace and ``cgroup`` (both optional).

    The child joins the cgroup before it execs anything, so everything it forks is counted from
    its first instruction; ``ip netns exec`` then enters the namespace.
    """
    full = (net.prefix() if net else []) + list(argv)
    pre = None
    if cgroup is not None:
        def pre() -> None:
            cgroup.enter(os.getpid())
    return subprocess.Popen(full, preexec_fn=pre, **popen)


def python_in(code: str) -> list[str]:
    """argv running ``code`` with this interpreter, isolated from the test's environment."""
    return [sys.executable, "-I", "-c", code]
