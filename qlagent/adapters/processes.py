"""Spawn the per-run launcher wrapper, recognise it after a restart, kill run trees (ADR-0071 §5,
issue 3 items 4-6, ARCHITECTURE.md "Launcher wrapper contract").

The wrapper runs in its own session so that it and the task survive an agent crash; the task
runs in its own process group (pgid = task PID, written to run_dir/task.pid) so the agent can
signal it without hitting the wrapper.
"""

from __future__ import annotations

import errno
import json
import os
import select
import signal
import stat
import subprocess
import sys
import time

import msgspec
import psutil

from qlagent.core.canonical import sha256_hex
from qlagent.core.errors import QlError, UnavailableError, ValidationError

WRAPPER_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "launcher", "wrapper.py")

RECEIPT_FIELDS = ("attempt_id", "exit_code", "signal", "start_error", "started_at_us", "ended_at_us",
                  "bytes_total", "bytes_kept", "bytes_dropped", "peak_rss_bytes", "cpu_time_us", "orphans_stopped")
# Fields a receipt written by an older launcher lacks (a Run that was live across an upgrade).
_RECEIPT_OPTIONAL = frozenset({"orphans_stopped"})
# The launcher reports the exec's outcome within its start-up time (~10 ms; seconds on a loaded
# router). Past this bound the agent records the Run running and lets the receipt tell.
START_STATUS_TIMEOUT_S = 30.0
_STATUS_LIMIT_BYTES = 1024
# The wrapper refuses a larger spec (launcher/wrapper.py SPEC_LIMIT_BYTES).
SPEC_LIMIT_BYTES = 1 << 20
# A receipt or truncation fact is a few hundred bytes; refuse to parse anything much larger.
_FACT_LIMIT_BYTES = 65536
_CREATE_TIME_TOLERANCE_S = 0.01


class WrapperSpawnError(UnavailableError):
    """The wrapper could not be started or did not accept its spec (e.g. python missing)."""

    code = "launch_failed"


class RunFileError(QlError):
    """receipt.json, truncated.json or task.pid exists but is not valid; ``field`` names the fault."""

    code = "run_file_invalid"

    def __init__(self, field_name: str, message: str):
        super().__init__(f"{field_name}: {message}", field=field_name)


class WrapperHandle(msgspec.Struct):
    """A started wrapper: ``pid``, ``create_time`` (psutil, seconds since the epoch; with the PID
    it identifies the process across PID reuse), ``pidfd`` (an fd readable when the wrapper
    exits, or None where os.pidfd_open is unavailable), the Popen used to reap it and
    ``start_error``: None once the task was exec'd (or the status did not come in
    START_STATUS_TIMEOUT_S), else the launcher's reason."""

    pid: int
    create_time: float
    pidfd: int | None
    popen: subprocess.Popen
    start_error: str | None = None

    def poll(self) -> int | None:
        """Reap the wrapper if it has exited; returns its exit status (0 = receipt written) or None."""
        return self.popen.poll()

    def close(self) -> None:
        """Release the pidfd (the wrapper keeps running)."""
        if self.pidfd is not None:
            os.close(self.pidfd)
            self.pidfd = None


def _read_status(popen: subprocess.Popen, timeout_s: float) -> str | None:
    """The launcher's start status line (see launcher/wrapper.py): None for ``ok`` or no answer
    within ``timeout_s``; the reason for ``err <reason>`` or an exit before any status."""
    fd = popen.stdout.fileno()
    data = b""
    deadline = time.monotonic() + timeout_s
    try:
        while b"\n" not in data and len(data) < _STATUS_LIMIT_BYTES:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, _STATUS_LIMIT_BYTES)
            if not chunk:
                break
            data += chunk
    finally:
        popen.stdout.close()
    line = data.split(b"\n", 1)[0].decode("utf-8", "replace")
    if line == "ok":
        return None
    if line.startswith("err "):
        return line[4:]
    try:
        status = popen.wait(5)
    except subprocess.TimeoutExpired:
        status = None
    return f"shim: exited with status {status} before starting the task"


def compiled_shim(cache_dir: str, python: str) -> str:
    """The launcher precompiled for ``python -I -S`` to run as is: an interpreter runs a .pyc
    script without compiling it, which saves the compiler's memory (USS 4.5 → 2.9 MiB per run)
    and its time on every run (bench/results/wrapper.md). ``python`` itself writes it (``wrapper.py
    --compile``, so its magic number is right and the agent's heap never holds the compiler's
    garbage) into ``cache_dir`` (the agent's private runs root, 0700) as ``.shim-<key>.pyc``,
    mode 0600, where the key is the SHA-256 of the source and of the interpreter file's identity
    (path, inode, mtime, size): a changed source or an upgraded interpreter gets a new file and
    never runs stale bytecode. Cheap once written (a stat and a read of the source per call).
    Returns WRAPPER_PATH when it cannot be used (not ours, cannot be written)."""
    try:
        real = os.path.realpath(python)
        st = os.stat(real)
        with open(WRAPPER_PATH, "rb") as f:
            source = f.read()
    except OSError:
        return WRAPPER_PATH
    key = sha256_hex(source + f"\0{real}\0{st.st_ino}\0{st.st_mtime_ns}\0{st.st_size}".encode())[:32]
    path = os.path.join(cache_dir, f".shim-{key}.pyc")
    try:
        st = os.lstat(path)
        if stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid() and not st.st_mode & 0o077:
            return path
        return WRAPPER_PATH            # not ours alone: never run it, never replace it
    except FileNotFoundError:
        pass
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        subprocess.run([python, "-I", "-S", WRAPPER_PATH, "--compile", tmp], stdin=subprocess.DEVNULL,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={}, cwd="/", timeout=30,
                       check=True)
        os.rename(tmp, path)
    except (OSError, subprocess.SubprocessError):
        try:
            os.unlink(tmp)
        except OSError:
            pass
        return WRAPPER_PATH
    return path


def spawn_wrapper(spec: dict, python: str = sys.executable,
                  status_timeout_s: float = START_STATUS_TIMEOUT_S, program: str = WRAPPER_PATH) -> WrapperHandle:
    """Start ``python -I -S <program>`` (wrapper.py, or its compiled_shim) in a new session
    with an empty environment, cwd "/", stderr /dev/null, and send ``spec`` (the wrapper
    contract's JSON document, which may hold secret plaintext) through its stdin pipe, then
    close the pipe; then wait (at most
    ``status_timeout_s`` seconds) for its start status on stdout, so the caller learns whether
    the task was exec'd before it records the Run running (``WrapperHandle.start_error``).

    Raises ValidationError (field spec) for a spec over SPEC_LIMIT_BYTES, before anything starts;
    WrapperSpawnError when the interpreter cannot be started or exits before reading the spec.
    """
    payload = json.dumps(spec, separators=(",", ":")).encode("utf-8")
    if len(payload) > SPEC_LIMIT_BYTES:
        raise ValidationError("spec", f"{len(payload)} bytes of JSON, over the limit",
                              limit=SPEC_LIMIT_BYTES)
    try:
        popen = subprocess.Popen([python, "-I", "-S", program], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env={},
                                 cwd="/", start_new_session=True, close_fds=True)
    except OSError as exc:
        raise WrapperSpawnError(f"python {python}: cannot start the shim: {errno_text(exc)}",
                                field="python") from None
    try:
        popen.stdin.write(payload)
        popen.stdin.close()
    except BrokenPipeError:
        popen.stdout.close()
        popen.wait()
        raise WrapperSpawnError("shim: exited before reading its spec") from None
    start_error = _read_status(popen, status_timeout_s)
    try:
        create_time = psutil.Process(popen.pid).create_time()
    except psutil.NoSuchProcess:
        # Already reaped by _read_status after a start failure: no identity to record.
        create_time = 0.0
    try:
        pidfd = os.pidfd_open(popen.pid)
    except (AttributeError, OSError):
        pidfd = None
    return WrapperHandle(popen.pid, create_time, pidfd, popen, start_error)


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


class KillReport(msgspec.Struct):
    """Outcome of kill_tree: PIDs sent SIGTERM, PIDs that needed SIGKILL, PIDs still alive at
    the end (empty on success), and the elapsed wall time in seconds."""

    terminated: list[int]
    killed: list[int]
    survivors: list[int]
    elapsed_s: float


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _descendants(wrapper_pid: int) -> dict[int, psutil.Process]:
    try:
        kids = psutil.Process(wrapper_pid).children(recursive=True)
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


def _targets(task_pgid: int | None, wrapper_pid: int | None, started_after: float | None,
             known: dict[int, psutil.Process]) -> tuple[dict[int, psutil.Process], bool]:
    """Live processes of the run and whether the group is proven ours (a member is in the tree).
    A missing (None) wrapper or group contributes nothing; PIDs ≤ 1 are never looked at."""
    tree = _descendants(wrapper_pid) if wrapper_pid and wrapper_pid > 1 else {}
    group = _group_members(task_pgid) if task_pgid and task_pgid > 1 else {}
    owned = any(pid in tree for pid in group)
    if started_after is not None:
        group = {pid: p for pid, p in group.items() if _created(p) >= started_after}
    found = dict(known)
    found.update(tree)
    found.update(group)
    for pid in (wrapper_pid, os.getpid()):
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


def _wait_gone(procs: dict[int, psutil.Process], deadline: float) -> dict[int, psutil.Process]:
    pending = dict(procs)
    while True:
        pending = {pid: p for pid, p in pending.items() if _alive(p)}
        if not pending or time.monotonic() >= deadline:
            return pending
        time.sleep(min(0.02, max(0.0, deadline - time.monotonic())))


def kill_tree(task_pgid: int | None, wrapper_pid: int, grace_s: float,
              started_after: float | None = None) -> KillReport:
    """Stop every process of a run: SIGTERM to the task's process group and to every descendant
    of the wrapper (also those that escaped the group with setsid), SIGKILL to whatever is left
    after ``grace_s`` seconds. Returns within grace_s + ~1 s (issue 3 item 5; field report F2).

    Never signals the wrapper (it must still write the receipt) or this process. The wrapper's
    descendants are snapshotted BEFORE signalling, because children of a killed parent are
    re-parented out of the tree, and re-scanned before SIGKILL. ``task_pgid`` is the PID in
    run_dir/task.pid; None (task.pid not written yet) takes the wrapper's only child, the task.
    killpg() is used only while a group member is in the wrapper's tree (a
    PID number freed and reused for a stranger's group is never hit); otherwise group members
    are signalled one by one, and ``started_after`` (epoch seconds, the run's start) excludes
    members older than the run. Raises ValidationError for a PID <= 1.
    """
    if wrapper_pid <= 1 or (task_pgid is not None and task_pgid <= 1):
        raise ValidationError("task_pgid/wrapper_pid", "must be a process ID > 1")
    if task_pgid is None:
        try:
            kids = psutil.Process(wrapper_pid).children()
        except psutil.NoSuchProcess:
            kids = []
        if not kids:
            return KillReport([], [], [], 0.0)  # no task was started, or the wrapper is gone
        task_pgid = kids[0].pid
    start = time.monotonic()
    snapshot, owned = _targets(task_pgid, wrapper_pid, started_after, {})
    terminated = _signal_all(task_pgid, owned, snapshot, signal.SIGTERM)
    # Re-scan right away: a child forked just before its parent got SIGTERM is caught too.
    more, owned_now = _targets(task_pgid, wrapper_pid, started_after, snapshot)
    terminated += _signal_all(task_pgid, False, {p: v for p, v in more.items() if p not in snapshot},
                              signal.SIGTERM)
    owned = owned or owned_now
    pending = _wait_gone(more, start + grace_s)
    if pending:
        pending, owned_now = _targets(task_pgid, wrapper_pid, started_after, pending)
        killed = _signal_all(task_pgid, owned or owned_now, pending, signal.SIGKILL)
    else:
        killed = []
    survivors = _wait_gone(pending, time.monotonic() + 0.8)
    return KillReport(sorted(set(terminated)), sorted(killed), sorted(survivors),
                      time.monotonic() - start)


def signal_tree(task_pgid: int | None, wrapper_pid: int | None, sig: int, started_after: float | None,
                known: dict[int, psutil.Process]) -> list[int]:
    """One non-blocking step of ``kill_tree`` for a loop that must not wait: send ``sig`` to the
    task's process group, every descendant of the wrapper and every process in ``known``
    (processes seen by an earlier step, which a dead parent may have re-parented out of the
    tree). ``known`` is updated with what this step found, so a later SIGKILL still reaches an
    escaped grandchild. ``wrapper_pid`` None (the wrapper is gone) signals the group's members
    started after ``started_after`` one by one. Never signals the wrapper or this process.
    Returns the PIDs signalled.
    """
    if task_pgid is None and wrapper_pid and wrapper_pid > 1:
        kids = _descendants(wrapper_pid)
        task_pgid = min(kids) if kids else None   # the wrapper's first child is the task
    live, owned = _targets(task_pgid, wrapper_pid, started_after, known)
    known.update(live)
    if not live:
        return []
    return _signal_all(task_pgid or 0, owned and bool(task_pgid), live, sig)


def find_by_attempt(attempt_id: str) -> dict[int, psutil.Process]:
    """Processes whose environment carries ``QL3_ATTEMPT_ID=<attempt_id>``: every process a run
    started and that kept the environment it was given, even one that escaped the process
    group with setsid and lost its parent (the wrapper died). Reads /proc/<pid>/environ of this
    user's processes; used only on the rare paths where the wrapper's tree is gone."""
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


def default_python() -> str:
    """The interpreter for the wrapper: this one, or the system python3 when embedded."""
    return sys.executable or "/usr/bin/python3"


def _read_fact(path: str, name: str) -> dict | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return None
    try:
        raw = os.read(fd, _FACT_LIMIT_BYTES + 1)
    finally:
        os.close(fd)
    if len(raw) > _FACT_LIMIT_BYTES:
        raise RunFileError(name, f"larger than {_FACT_LIMIT_BYTES} bytes")
    try:
        doc = json.loads(raw)
    except ValueError as exc:
        raise RunFileError(name, f"not valid JSON ({exc})") from None
    if not isinstance(doc, dict):
        raise RunFileError(name, "must be a JSON object")
    return doc


def read_receipt(run_dir: str) -> dict | None:
    """The wrapper's completion receipt (run_dir/receipt.json) with exactly RECEIPT_FIELDS,
    or None if it is not written yet. Raises RunFileError naming the missing field otherwise."""
    doc = _read_fact(os.path.join(run_dir, "receipt.json"), "receipt.json")
    if doc is None:
        return None
    for name in RECEIPT_FIELDS:
        if name not in doc and name not in _RECEIPT_OPTIONAL:
            raise RunFileError(f"receipt.json.{name}", "missing")
    return {name: doc.get(name) for name in RECEIPT_FIELDS}


def read_truncation(run_dir: str) -> dict | None:
    """The truncation fact (run_dir/truncated.json): {"quota_bytes": int, "bytes_kept": int},
    or None if the quota was never exceeded. Raises RunFileError on a malformed fact."""
    doc = _read_fact(os.path.join(run_dir, "truncated.json"), "truncated.json")
    if doc is None:
        return None
    out = {}
    for name in ("quota_bytes", "bytes_kept"):
        value = doc.get(name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise RunFileError(f"truncated.json.{name}", "must be an integer >= 0")
        out[name] = value
    return out


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


def remove_run_dir(run_dir: str) -> None:
    """Delete a finished Attempt's run directory; errors are ignored (it may be gone already).

    The wrapper writes only files there (FIFO, receipt, facts, task.pid), so a flat removal
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
