"""Spawn the per-run shim, recognise it after a restart, signal a run's process tree (ADR-0071
§5, issue 3 items 4-6, ARCHITECTURE.md "Shim contract"); ``ShimProcesses`` is the
``core.ports.ProcessPort`` over them.

The shim runs in its own session so that it and the task survive an agent crash; the task
runs in its own process group (pgid = task PID, written to run_dir/task.pid) so the agent can
signal it without hitting the shim.
"""

from __future__ import annotations

import errno
import json
import os
import pwd
import select
import signal
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Container

import msgspec
import psutil

from qlagent.core.canonical import sha256_hex
from qlagent.core.dispatch import LaunchCommand
from qlagent.core.errors import FACT_LIMIT_BYTES, QlError, RunFileError, StartError, UnavailableError, ValidationError
from qlagent.core.receipt import Receipt, TruncationFact, decode_receipt, decode_truncation, start_code

from .artifacts import UnsafeDirectoryError

SHIM_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "shim", "main.py")
SHIM_DIR = os.path.dirname(SHIM_PATH)
# The shim reports the exec's outcome within its start-up time (~10 ms; seconds on a loaded
# router). Past this bound the agent records the Run running and lets the receipt tell.
START_STATUS_TIMEOUT_S = 30.0
_STATUS_LIMIT_BYTES = 1024
# The shim refuses a larger spec (shim/main.py SPEC_LIMIT_BYTES).
SPEC_LIMIT_BYTES = 1 << 20
_CREATE_TIME_TOLERANCE_S = 0.01


class ShimSpawnError(UnavailableError):
    """The shim could not be started or did not accept its spec (e.g. python missing)."""

    code = "launch_failed"


class ShimHandle(msgspec.Struct):
    """A started shim: ``pid``, ``create_time`` (psutil, seconds since the epoch; with the PID
    it identifies the process across PID reuse), ``pidfd`` (an fd readable when the shim
    exits, or None where os.pidfd_open is unavailable), the Popen used to reap it (None when
    the ForkServer started it) and
    ``start_error``: None once the task was exec'd (or the status did not come in
    START_STATUS_TIMEOUT_S), else the shim's reason."""

    pid: int
    create_time: float
    pidfd: int | None
    popen: subprocess.Popen | None     # None for a shim of the ForkServer: not this process's child
    start_error: str | None = None


def compiled_shim(cache_dir: str, python: str) -> str:
    """The shim precompiled for ``python -I -S`` to run as is: an interpreter runs a .pyc
    script without compiling it, which saves the compiler's memory (USS 4.5 → 2.9 MiB per run)
    and its time on every run (bench/results/shim.md). ``python`` itself writes it (``shim/main.py
    --compile``, so its magic number is right and the agent's heap never holds the compiler's
    garbage) into ``cache_dir`` (the agent's private runs root, 0700) as ``.shim-<key>.pyc``,
    mode 0600: one file holding main.py and its siblings (main.py SIBLINGS), which it
    loads into sys.modules itself. The key is the SHA-256 of every source in ``shim/`` and of
    the interpreter file's identity (path, inode, mtime, size): a changed source or an upgraded
    interpreter gets a new file and never runs stale bytecode. Cheap once written (a stat and a read of the source per call).
    Returns SHIM_PATH when it cannot be used (not ours, cannot be written)."""
    try:
        real = os.path.realpath(python)
        st = os.stat(real)
        source = b""
        for name in sorted(n for n in os.listdir(SHIM_DIR) if n.endswith(".py")):
            with open(os.path.join(SHIM_DIR, name), "rb") as f:
                source += name.encode() + b"\0" + f.read()
    except OSError:
        return SHIM_PATH
    key = sha256_hex(source + f"\0{real}\0{st.st_ino}\0{st.st_mtime_ns}\0{st.st_size}".encode())[:32]
    path = os.path.join(cache_dir, f".shim-{key}.pyc")
    try:
        st = os.lstat(path)
        if stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid() and not st.st_mode & 0o077:
            return path
        return SHIM_PATH            # not ours alone: never run it, never replace it
    except FileNotFoundError:
        pass
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        subprocess.run([python, "-I", "-S", SHIM_PATH, "--compile", tmp], stdin=subprocess.DEVNULL,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={}, cwd="/", timeout=30,
                       check=True)
        os.rename(tmp, path)
    except (OSError, subprocess.SubprocessError):
        try:
            os.unlink(tmp)
        except OSError:
            pass
        return SHIM_PATH
    return path


# The fork server exits after this long without a request (shim/forkserver.py FORK_SERVER_IDLE_S);
# the agent stops using it a margin earlier, so no request is ever sent to one that is leaving.
FORK_SERVER_IDLE_S = 3600.0
_RETIRE_MARGIN_S = 1.0
# After a fork server failed, starts fail at once with its reason until the next try: the first
# try after BACKOFF_MIN_S, each later one twice as late, at most BACKOFF_MAX_S (no restart storm).
BACKOFF_MIN_S = 0.5
BACKOFF_MAX_S = 30.0
_PIPE_BUF_BYTES = 65536


def _read_line(fd: int, data: bytes, deadline: float) -> tuple[str | None, bytes]:
    """One line from the status pipe ``fd`` after what ``data`` already holds: (line, rest);
    line None on EOF before a line (rest: what came), raises TimeoutError past ``deadline``."""
    while b"\n" not in data:
        if len(data) >= _STATUS_LIMIT_BYTES:
            break
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            raise TimeoutError
        chunk = os.read(fd, _STATUS_LIMIT_BYTES)
        if not chunk:
            return None, data
        data += chunk
    line, _, rest = data.partition(b"\n")
    return line.decode("utf-8", "replace"), rest


def _wait_exit(pidfd: int | None, timeout_s: float) -> None:
    """Until the process behind ``pidfd`` has exited, at most ``timeout_s`` seconds."""
    if pidfd is not None:
        select.select([pidfd], [], [], timeout_s)


class ForkServer:
    """The fork server (shim/forkserver.py ``serve_forks``, ARCHITECTURE.md "Fork server"): one
    ``python -I -S <compiled_shim>`` that imported the shim once and forks a fresh shim per run,
    so a start costs a fork, not an interpreter start. Started at the first ``spawn``, again
    after it died or went idle (FORK_SERVER_IDLE_S); a shim it forks leads its own session and
    no death signal ties it to the fork server or to this process, so it survives both (as a
    shim does whose agent died) and is re-attached by PID + start time like any other. The fork
    server ignores SIGCHLD: the kernel reaps its shims, and init does once it is gone.

    The request carries two pipes, never the spec: the spec (secret plaintext) goes from this
    process straight into the shim's stdin pipe."""

    def __init__(self, cache_dir: str) -> None:
        self._cache_dir = cache_dir          # where compiled_shim keeps the bytecode
        self._python = ""                    # the interpreter of the running fork server
        self._popen: subprocess.Popen | None = None
        self._sock: socket.socket | None = None
        self._last_request = 0.0             # time.monotonic() of the last request sent
        self._leaving: list[subprocess.Popen] = []   # retired, not reaped yet
        self._failure: str | None = None
        self._retry_at = 0.0
        self._backoff_s = 0.0

    def pids(self) -> set[int]:
        """The fork server processes this object has started and not reaped (its own children)."""
        return {p.pid for p in [*self._leaving, *([self._popen] if self._popen else [])]}

    def reap(self) -> None:
        """Reap the fork servers that have exited (idle, killed or retired)."""
        if self._popen is not None and self._popen.poll() is not None:
            self._leaving.append(self._popen)
            self._popen = None
            if self._sock is not None:
                self._sock.close()
                self._sock = None
        self._leaving = [p for p in self._leaving if p.poll() is None]

    def _retire(self) -> None:
        if self._sock is not None:
            self._sock.close()            # EOF: it exits
            self._sock = None
        if self._popen is not None:
            self._leaving.append(self._popen)
            self._popen = None
        self.reap()

    def _fail(self, reason: str) -> ShimSpawnError:
        self._retire()
        self._backoff_s = min(BACKOFF_MAX_S, max(BACKOFF_MIN_S, self._backoff_s * 2))
        self._failure = reason
        self._retry_at = time.monotonic() + self._backoff_s
        return ShimSpawnError(reason)

    def _start(self, python: str) -> None:
        program = compiled_shim(self._cache_dir, python)
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._popen = subprocess.Popen([python, "-I", "-S", program], stdin=theirs,
                                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={},
                                           cwd="/", start_new_session=True, close_fds=True)
        except OSError as exc:
            mine.close()
            raise self._fail(f"python {python}: cannot start the shim: {errno_text(exc)}") from None
        finally:
            theirs.close()
        self._sock = mine
        self._python = python
        self._last_request = time.monotonic()

    def _send(self, python: str, spec_r: int, status_w: int) -> None:
        """The request; a new fork server when this one is gone, about to leave or runs
        another interpreter than ``python``."""
        now = time.monotonic()
        if self._sock is not None and (now - self._last_request >= FORK_SERVER_IDLE_S - _RETIRE_MARGIN_S
                                       or self._python != python):
            self._retire()
        for _ in range(2):
            fresh = self._sock is None
            if fresh:
                self._start(python)
            try:
                self._sock.sendmsg([b"s"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS,
                                             spec_r.to_bytes(4, sys.byteorder) + status_w.to_bytes(4, sys.byteorder))])
                self._last_request = now
                return
            except OSError:
                if fresh:                 # one start per request: a server that cannot start is not retried
                    raise self._fail(self._exit_reason()) from None
                self._retire()            # it died since the last request: one new one
        raise self._fail("fork server: does not take requests")

    def _exit_reason(self) -> str:
        """Why the fork server just started or asked took no request / forked no shim."""
        try:
            status = self._popen.wait(1) if self._popen is not None else None
        except subprocess.TimeoutExpired:
            status = None
        if status is None:
            return "fork server: forked no shim"
        return f"fork server: exited with status {status} before forking the shim"

    def spawn(self, spec: dict, python: str, status_timeout_s: float = START_STATUS_TIMEOUT_S) -> ShimHandle:
        """Start one shim for ``spec`` (the shim contract's document) from the fork server of
        ``python -I -S`` and wait (at most ``status_timeout_s`` seconds) for its start status
        (ARCHITECTURE.md "Start status"): the shim's PID comes first (a ``pid <n>`` line from the forked
        shim), then ``ok`` or ``err <reason>``. With a start_error it returns once the shim has
        exited (it writes its receipt first).

        Raises ValidationError (field spec) for a spec over SPEC_LIMIT_BYTES, before anything
        starts; ShimSpawnError when the fork server cannot be started or forks no shim (the
        reason; until the back-off has passed every call fails at once with it)."""
        payload = json.dumps(spec, separators=(",", ":")).encode("utf-8")
        if len(payload) > SPEC_LIMIT_BYTES:
            raise ValidationError("spec", f"{len(payload)} bytes of JSON, over the limit", limit=SPEC_LIMIT_BYTES)
        now = time.monotonic()
        if self._failure is not None and now < self._retry_at:
            raise ShimSpawnError(f"{self._failure} (next try in {self._retry_at - now:.1f} s)")
        self.reap()
        spec_r, spec_w = os.pipe()
        status_r, status_w = os.pipe()
        try:
            if len(payload) > _PIPE_BUF_BYTES:
                import fcntl
                try:
                    fcntl.fcntl(spec_w, fcntl.F_SETPIPE_SZ, len(payload))
                except OSError:
                    pass                     # then the write below waits for the shim to read
            try:
                self._send(python, spec_r, status_w)
            finally:
                os.close(spec_r)
                os.close(status_w)
            deadline = time.monotonic() + status_timeout_s
            try:
                first, rest = _read_line(status_r, b"", deadline)
            except TimeoutError:
                raise self._fail("fork server: no shim forked within %.0f s" % status_timeout_s) from None
            if first is None or not first.startswith("pid "):
                if first is not None and first.startswith("err "):
                    raise self._fail(f"fork server: {first[4:]}")
                raise self._fail(self._exit_reason())
            self._failure, self._backoff_s = None, 0.0
            pid = int(first[4:])
            try:
                pidfd = os.pidfd_open(pid)
            except (AttributeError, OSError):
                pidfd = None
            try:
                create_time = psutil.Process(pid).create_time()
            except psutil.NoSuchProcess:
                create_time = 0.0
            try:
                view = memoryview(payload)
                while view:
                    view = view[os.write(spec_w, view):]
            except BrokenPipeError:
                pass                         # the shim is gone: the status says so
            os.close(spec_w)
            spec_w = -1
            try:
                line, _ = _read_line(status_r, rest, deadline)
            except TimeoutError:
                line = "ok"                  # a slow start: the receipt will tell
            if line == "ok":
                start_error = None
            elif line is not None and line.startswith("err "):
                start_error = line[4:]
            else:
                start_error = "shim: exited before starting the task"
            if start_error is not None:
                _wait_exit(pidfd, status_timeout_s)
            return ShimHandle(pid, create_time, pidfd, None, start_error)
        finally:
            if spec_w >= 0:
                os.close(spec_w)
            os.close(status_r)


def errno_text(exc: OSError) -> str:
    """``ENOENT (No such file or directory)``: the errno name and its text, never invented."""
    name = errno.errorcode.get(exc.errno, f"errno {exc.errno}") if exc.errno else "no errno"
    return f"{name} ({exc.strerror or os.strerror(exc.errno or 0)})"


def process_matches(pid: int, create_time: float) -> bool:
    """True if ``pid`` is a live (not zombie) process started at ``create_time`` (psutil seconds).

    A PID reused by another process has another start time, so recovery never re-attaches to
    a stranger (issue 3 item 5: "PID and start time match").
    """
    try:
        proc = psutil.Process(pid)
        return (abs(proc.create_time() - create_time) < _CREATE_TIME_TOLERANCE_S
                and proc.status() != psutil.STATUS_ZOMBIE)
    except (psutil.NoSuchProcess, psutil.AccessDenied, ValueError):  # ValueError: pid < 0
        return False


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _descendants(shim_pid: int) -> dict[int, psutil.Process]:
    try:
        kids = psutil.Process(shim_pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return {}
    return {p.pid: p for p in kids}


def _group_members(pgid: int) -> dict[int, psutil.Process]:
    members = {}
    for proc in psutil.process_iter():
        try:
            if os.getpgid(proc.pid) == pgid:
                members[proc.pid] = proc
        except (ProcessLookupError, psutil.NoSuchProcess):
            continue
    return members


def _targets(task_pgid: int | None, shim_pid: int | None, started_after: float | None,
             known: dict[int, psutil.Process]) -> tuple[dict[int, psutil.Process], bool]:
    """Live processes of the run and whether the group is proven ours (a member is in the tree).
    A missing (None) shim or group contributes nothing; PIDs ≤ 1 are never looked at."""
    tree = _descendants(shim_pid) if shim_pid and shim_pid > 1 else {}
    group = _group_members(task_pgid) if task_pgid and task_pgid > 1 else {}
    owned = any(pid in tree for pid in group)
    if started_after is not None:
        group = {pid: p for pid, p in group.items() if _created(p) >= started_after}
    found = dict(known)
    found.update(tree)
    found.update(group)
    for pid in (shim_pid, os.getpid()):
        found.pop(pid, None)
    return {pid: p for pid, p in found.items() if _alive(p)}, owned


def _created(proc: psutil.Process) -> float:
    try:
        return proc.create_time()
    except psutil.NoSuchProcess:
        return 0.0


def _signal_all(task_pgid: int, owned: bool, procs: dict[int, psutil.Process], sig: int) -> list[int]:
    in_group = set()
    if owned:
        for pid in procs:  # before killpg: a member may die and be reaped at once
            try:
                if os.getpgid(pid) == task_pgid:
                    in_group.add(pid)
            except ProcessLookupError:
                continue
        try:
            os.killpg(task_pgid, sig)  # atomic for the group, including children forked meanwhile
        except (ProcessLookupError, PermissionError):
            in_group = set()
    sent = sorted(in_group)
    for pid, proc in procs.items():
        if pid in in_group:
            continue  # already reached by killpg; a second signal would be a new event
        try:
            proc.send_signal(sig)  # psutil checks the start time: a reused PID is not signalled
            sent.append(pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return sent


def signal_tree(task_pgid: int | None, shim_pid: int | None, sig: int, started_after: float | None,
                known: dict[int, psutil.Process]) -> list[int]:
    """One non-blocking step of stopping a run (the coordinator sends SIGTERM, then SIGKILL after
    the grace): send ``sig`` to the task's process group, every descendant of the shim and
    every process in ``known``
    (processes seen by an earlier step, which a dead parent may have re-parented out of the
    tree). ``known`` is updated with what this step found, so a later SIGKILL still reaches an
    escaped grandchild. ``shim_pid`` None (the shim is gone) signals the group's members
    started after ``started_after`` one by one. Never signals the shim or this process.
    Returns the PIDs signalled.
    """
    if task_pgid is None and shim_pid and shim_pid > 1:
        kids = _descendants(shim_pid)
        task_pgid = min(kids) if kids else None   # the shim's first child is the task
    live, owned = _targets(task_pgid, shim_pid, started_after, known)
    known.update(live)
    if not live:
        return []
    return _signal_all(task_pgid or 0, owned and bool(task_pgid), live, sig)


def find_by_attempt(attempt_id: str) -> dict[int, psutil.Process]:
    """Processes whose environment carries ``QL3_ATTEMPT_ID=<attempt_id>``: every process a run
    started and that kept the environment it was given, even one that escaped the process
    group with setsid and lost its parent (the shim died). Reads /proc/<pid>/environ of this
    user's processes; used only on the rare paths where the shim's tree is gone."""
    marker = f"\0QL3_ATTEMPT_ID={attempt_id}\0".encode()
    found = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/environ", "rb") as f:
                env = b"\0" + f.read()
        except OSError:
            continue
        if marker in env:
            try:
                found[int(entry.name)] = psutil.Process(int(entry.name))
            except psutil.NoSuchProcess:
                continue
    found.pop(os.getpid(), None)
    return found


AGENT_KEY_ENV = "QL3_AGENT_KEY"


def agent_key(runs_root: str) -> str:
    """The tag (16 lowercase hex) every task of the agent whose runs live under ``runs_root``
    carries as ``QL3_AGENT_KEY``: derived from the root's path, not from anything stored in
    it, so an agent started on a wiped state directory still recognises the tasks of the one
    before, and agents of other state directories (same uid) are told apart."""
    return sha256_hex(os.path.realpath(runs_root).encode("utf-8", "surrogateescape"))[:16]


def stop_strays(key: str, known: Container[str], seen: set[str] | None = None) -> dict[str, int]:
    """SIGKILL every process of this uid whose environment carries ``QL3_AGENT_KEY=<key>`` and a
    ``QL3_ATTEMPT_ID`` not in ``known`` (the Attempts the caller re-attaches or has ended
    itself): a task left by an agent whose state was lost or whose shim died unseen, which would
    otherwise run beside the Attempt's next copy. Returns {attempt ID: processes killed}; a
    ``seen`` set gets the attempt ID of every tagged process found, known or not (so a caller
    can forget the kept Attempts nothing carries any more).
    Reads /proc/<pid>/environ (this user's processes only); signals through psutil, which
    checks the start time, so a PID reused since the scan is never hit."""
    tag = f"\0{AGENT_KEY_ENV}={key}\0".encode()
    prefix = b"\0QL3_ATTEMPT_ID="
    uid = os.geteuid()
    stopped: dict[str, int] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            if entry.stat().st_uid != uid:
                continue
            with open(f"/proc/{entry.name}/environ", "rb") as f:
                env = b"\0" + f.read()
        except OSError:
            continue
        at = env.find(prefix)
        if tag not in env or at < 0:
            continue
        attempt_id = env[at + len(prefix):env.find(b"\0", at + 1)].decode("utf-8", "replace")
        if seen is not None:
            seen.add(attempt_id)
        if attempt_id in known or int(entry.name) == os.getpid():
            continue
        try:
            psutil.Process(int(entry.name)).send_signal(signal.SIGKILL)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        stopped[attempt_id] = stopped.get(attempt_id, 0) + 1
    return stopped


def default_python() -> str:
    """The interpreter for the shim: this one, or the system python3 when embedded."""
    return sys.executable or "/usr/bin/python3"


def _read_fact(path: str) -> bytes | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return None
    try:
        return os.read(fd, FACT_LIMIT_BYTES + 1)
    finally:
        os.close(fd)


def read_receipt(run_dir: str) -> Receipt | None:
    """The completion receipt (run_dir/receipt.json) decoded as core.receipt.Receipt, or None
    if it is not written yet. Raises RunFileError naming the missing or mistyped field."""
    raw = _read_fact(os.path.join(run_dir, "receipt.json"))
    return None if raw is None else decode_receipt(raw)


def read_truncation(run_dir: str) -> TruncationFact | None:
    """The truncation fact (run_dir/truncated.json), or None if the quota was never exceeded.
    Raises RunFileError on a malformed fact."""
    raw = _read_fact(os.path.join(run_dir, "truncated.json"))
    return None if raw is None else decode_truncation(raw)


def read_task_pid(run_dir: str) -> int | None:
    """The task PID (= its process group ID) from run_dir/task.pid, or None before the spawn."""
    try:
        with open(os.path.join(run_dir, "task.pid"), "rb") as f:
            raw = f.read(32)
    except FileNotFoundError:
        return None
    try:
        pid = int(raw)
    except ValueError:
        raise RunFileError("task.pid", "not an integer") from None
    if pid <= 1:
        raise RunFileError("task.pid", "must be a process ID > 1")
    return pid


def baseline_env(uid: int | None = None) -> dict[str, str]:
    """HOME, USER, LOGNAME and SHELL of the run user's passwd entry (the agent's effective uid),
    as cron and systemd give them; {} when the uid has no entry. A recipe value overrides each."""
    try:
        pw = pwd.getpwuid(os.geteuid() if uid is None else uid)
    except KeyError:
        return {}
    return {"HOME": pw.pw_dir or "/", "USER": pw.pw_name, "LOGNAME": pw.pw_name, "SHELL": pw.pw_shell or "/bin/sh"}


class ShimProcesses:
    """``core.ports.ProcessPort``: shims started by this agent (``spawn``) or re-attached after
    a restart, their run directories under the allocator's ``runs_root``, and the signalling of
    a run's process tree (``signal_tree`` with the processes seen by earlier steps)."""

    def __init__(self, allocator, linger_s: float, python: str | None = None, cgroups=None) -> None:
        self._alloc = allocator            # adapters.artifacts.ArtifactAllocator (safe run dirs)
        self._cgroups = cgroups            # adapters.runcgroup.RunCgroups, or None: no run cgroups
        self._linger_s = linger_s
        self._python = python or default_python()
        self._handles: dict[int, ShimHandle] = {}
        self._forks = ForkServer(allocator.runs_root)
        self._known: dict[str, dict] = {}         # attempt → processes seen when first signalled
        self._started: dict[str, float] = {}
        self._key = agent_key(allocator.runs_root)

    def _run_dir(self, attempt_id: str) -> str:
        return os.path.join(self._alloc.runs_root, attempt_id)

    def spawn(self, cmd: LaunchCommand) -> tuple[int, float]:
        attempt_id = cmd.candidate.attempt_id
        try:
            run_dir = self._alloc.run_dir(attempt_id)
        except UnsafeDirectoryError as e:
            raise StartError(e.message, code="run_dir_unsafe") from None
        env = {**cmd.env, AGENT_KEY_ENV: self._key}
        spec = {"attempt_id": attempt_id, "argv": list(cmd.argv), "env": env, "cwd": cmd.cwd,
                "run_dir": run_dir, "artifact_path": cmd.artifact_path, "quota_bytes": cmd.quota_bytes,
                "linger_s": self._linger_s, "umask": cmd.umask, "grace_s": cmd.grace_ms / 1000,
                "keep_orphans": cmd.keep_orphans,
                "cgroup": self._cgroups.create(attempt_id, cmd.memory_max) if self._cgroups else None}
        try:
            h = self._forks.spawn(spec, self._python)
        except QlError as e:              # spec over its bound, no interpreter, no fork server
            raise StartError(f"shim: {e.message}", code="shim_failed") from None
        if h.start_error is not None:
            if h.pidfd is not None:
                os.close(h.pidfd)
            raise StartError(h.start_error, code=start_code(h.start_error))
        self._handles[h.pid] = h
        self._started[attempt_id] = h.create_time
        return h.pid, h.create_time

    def watch(self, pid: int) -> int | None:
        h = self._handles.get(pid)
        if h is not None:
            fd, h.pidfd = h.pidfd, None   # the coordinator owns and closes it from here on
            return fd
        try:
            return os.pidfd_open(pid)
        except (AttributeError, OSError):
            return None

    def alive(self, pid: int, create_time: float) -> bool:
        return process_matches(pid, create_time)

    def reap(self, pid: int) -> None:
        h = self._handles.pop(pid, None)
        self._forks.reap()
        if h is None:
            return
        try:
            os.waitpid(pid, os.WNOHANG)   # ours only as PID 1 of a PID namespace (orphans come here)
        except ChildProcessError:
            pass

    def signal_run(self, attempt_id: str, shim_pid: int | None, sig: int) -> int:
        try:
            pgid = read_task_pid(self._run_dir(attempt_id))
        except RunFileError:
            pgid = None
        known = self._known.setdefault(attempt_id, {})
        if shim_pid is None:
            # The shim is gone (died, or a previous agent's run is lost): its tree can no
            # longer be walked, so find the run's processes by their QL3_ATTEMPT_ID, and by its
            # cgroup, which also holds a daemon that dropped the tag (env -i) and left the group.
            known.update(find_by_attempt(attempt_id))
            if self._cgroups is not None:
                known.update(self._cgroups.members(attempt_id))
        return len(signal_tree(pgid, shim_pid, sig, self._started.get(attempt_id), known))

    def reap_orphans(self) -> int:
        reaped = 0
        self._forks.reap()
        forks = self._forks.pids()
        for child in psutil.Process().children():
            if child.pid in self._handles or child.pid in forks:   # reap() collects these
                continue
            try:
                if child.status() != psutil.STATUS_ZOMBIE:
                    continue
                os.waitpid(child.pid, os.WNOHANG)
                reaped += 1
            except (psutil.Error, ChildProcessError):
                continue
        return reaped

    def stop_strays(self, known: Container[str]) -> dict[str, int]:
        return stop_strays(self._key, known)

    def collect(self, attempt_id: str) -> tuple[Receipt | None, TruncationFact | None]:
        run_dir = self._run_dir(attempt_id)
        try:
            return read_receipt(run_dir), read_truncation(run_dir)
        except RunFileError:
            return None, None

    def cleanup(self, attempt_id: str) -> None:
        self._known.pop(attempt_id, None)
        self._started.pop(attempt_id, None)
        remove_run_dir(self._run_dir(attempt_id))
        if self._cgroups is not None:
            self._cgroups.remove(attempt_id)


def remove_run_dir(run_dir: str) -> None:
    """Delete a finished Attempt's run directory; errors are ignored (it may be gone already).

    The shim writes only files there (FIFO, receipt, facts, task.pid), so a flat removal
    does it; ``shutil`` (whose bz2/lzma imports cost the resident agent ~0.2 MiB) is loaded
    only if something made a subdirectory.
    """
    try:
        entries = list(os.scandir(run_dir))
    except OSError:
        return
    for entry in entries:
        try:
            if entry.is_dir(follow_symlinks=False):
                import shutil
                shutil.rmtree(entry.path, ignore_errors=True)
            else:
                os.unlink(entry.path)
        except OSError:
            pass
    try:
        os.rmdir(run_dir)
    except OSError:
        pass
