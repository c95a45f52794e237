"""Start the per-run shim through the fork server and follow it (ADR-0071 §5, issue 3 items
4-6, issue 24, ARCHITECTURE.md "Shim contract", "Fork server"); ``ShimProcesses`` is the
``core.ports.ProcessPort`` over it, over the run directory's files (``rundir``) and over the
run's process tree (``proctree``).

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
import sys
import time
from collections.abc import Container
from typing import TYPE_CHECKING

import msgspec

from qlagent.core.canonical import sha256_hex
from qlagent.core.dispatch import LaunchCommand
from qlagent.core.errors import QlError, RunFileError, StartError, UnavailableError, ValidationError
from qlagent.core.limits import SHIM_START_BOUND_US
from qlagent.core.receipt import Receipt, TruncationFact, start_code

from .artifacts import UnsafeDirectoryError
from .proctree import AGENT_KEY_ENV, agent_key, find_by_attempt, process_matches, signal_tree, stop_strays
from .rundir import read_receipt, read_task_pid, read_truncation, remove_run_dir

if TYPE_CHECKING:
    # Imported where a process is started or looked at: an idle agent (no Run since its start,
    # no stray found) loads neither (~2 MiB, bench/results/service.md).
    import subprocess

SHIM_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "shim", "main.py")
SHIM_DIR = os.path.dirname(SHIM_PATH)
START_STATUS_TIMEOUT_S = SHIM_START_BOUND_US / 1e6
_STATUS_LIMIT_BYTES = 1024
# The shim refuses a larger spec (shim/main.py SPEC_LIMIT_BYTES).
SPEC_LIMIT_BYTES = 1 << 20
# In the run directory: the Run's deadline, written by a shim that holds it (shim/main.py "Deadline").
DEADLINE_FILE = "deadline"


class ShimSpawnError(UnavailableError):
    """The shim could not be started or did not accept its spec (e.g. python missing)."""

    code = "launch_failed"


class ShimHandle(msgspec.Struct):
    """A started shim: ``pid``, ``create_time`` (psutil, seconds since the epoch; with the PID
    it identifies the process across PID reuse), ``pidfd`` (an fd readable when the shim
    exits, or None where os.pidfd_open is unavailable) and
    ``start_error``: None once the task was exec'd, else the shim's reason (or that it did not
    report within its start's bound and was killed)."""

    pid: int
    create_time: float
    pidfd: int | None
    start_error: str | None = None


def _compiled_path(cache_dir: str, python: str) -> str | None:
    """Where the fork server's program for ``python`` is kept once compiled (``ForkServer._program``),
    None when the sources or the interpreter cannot be read (then the shim runs from its source).

    The shim precompiled for ``python -I -S`` to run as is: an interpreter runs a .pyc script
    without compiling it, which saves the compiler's memory (USS 4.5 → 2.9 MiB per run) and its
    time on every run (bench/results/shim.md). ``python`` itself writes it (``shim/main.py
    --compile``, so its magic number is right and the agent's heap never holds the compiler's
    garbage) into ``cache_dir`` (the agent's private runs root, 0700) as ``.shim-<key>.pyc``,
    mode 0600: one file holding main.py and its siblings (main.py SIBLINGS), which it loads
    into sys.modules itself. The key is the SHA-256 of every source in ``shim/`` and of the
    interpreter file's identity (path, inode, mtime, size): a changed source or an upgraded
    interpreter gets a new file and never runs stale bytecode. Cheap once written (a stat and a
    read of the source per call)."""
    try:
        real = os.path.realpath(python)
        st = os.stat(real)
        source = b""
        for name in sorted(n for n in os.listdir(SHIM_DIR) if n.endswith(".py")):
            with open(os.path.join(SHIM_DIR, name), "rb") as f:
                source += name.encode() + b"\0" + f.read()
    except OSError:
        return None
    key = sha256_hex(source + f"\0{real}\0{st.st_ino}\0{st.st_mtime_ns}\0{st.st_size}".encode())[:32]
    return os.path.join(cache_dir, f".shim-{key}.pyc")


def _compiled_state(path: str) -> str:
    """``ours`` (a regular file of this euid, mode without group/other bits: run it),
    ``foreign`` (anything else: never run it, never replace it) or ``missing``."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return "missing"
    if stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid() and not st.st_mode & 0o077:
        return "ours"
    return "foreign"


def _start_compile(python: str, tmp: str) -> subprocess.Popen:
    import subprocess
    return subprocess.Popen([python, "-I", "-S", SHIM_PATH, "--compile", tmp], stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={}, cwd="/")


def _end_compile(popen: subprocess.Popen, tmp: str, path: str) -> bool:
    """Put a finished compile's file in place; False (nothing left behind) when it failed."""
    try:
        if popen.returncode != 0:
            raise OSError
        os.rename(tmp, path)
        return True
    except OSError:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        return False


def _ready_program(path: str | None) -> str | None:
    """What runs the shim without a compile: SHIM_PATH for no usable ``path`` (None) or a file
    there that is not ours, ``path`` once compiled; None when it still has to be compiled."""
    if path is None:
        return SHIM_PATH
    state = _compiled_state(path)
    if state == "missing":
        return None
    return path if state == "ours" else SHIM_PATH


# The fork server exits after this long without a request (shim/forkserver.py FORK_SERVER_IDLE_S);
# the agent stops using it a margin earlier, so no request is ever sent to one that is leaving
# (the margin covers a loop that stalls between its look at the clock and the request).
FORK_SERVER_IDLE_S = 3600.0
_RETIRE_MARGIN_S = 60.0
# After a fork server failed, starts fail at once with its reason until the next try: the first
# try after BACKOFF_MIN_S, each later one twice as late, at most BACKOFF_MAX_S (no restart storm).
BACKOFF_MIN_S = 0.5
BACKOFF_MAX_S = 30.0


def _exited(pid: int, create_time: float, pidfd: int | None) -> bool:
    """Has this exact process ended? Its pidfd is readable then; without one, psutil looks."""
    if pidfd is not None:
        return bool(select.select([pidfd], [], [], 0)[0])
    return not process_matches(pid, create_time)


def _kill(pid: int, create_time: float, pidfd: int | None) -> None:
    """SIGKILL this exact process (through its pidfd; without one, psutil checks its start
    time first, so a reused PID is never hit); nothing when it is gone already."""
    import psutil
    try:
        if pidfd is not None:
            signal.pidfd_send_signal(pidfd, signal.SIGKILL)
        elif process_matches(pid, create_time):
            psutil.Process(pid).send_signal(signal.SIGKILL)
    except (OSError, psutil.Error):
        pass


class StartPhase:
    """The phases of one fork-served shim start (:class:`ShimStart`), in order; ``SPEC`` only for
    a spec larger than the pipe takes at once, ``EXIT`` only after a failed exec, ``SERVER_EXIT``
    only when the fork server forked no shim."""

    COMPILING = "compiling"   # the shim is being compiled for a new fork server
    FORK = "fork"             # the request is out; the shim's ``pid <n>`` line is awaited
    SPEC = "giving_spec"      # the rest of the spec goes into the shim's stdin as the shim reads it
    EXEC = "exec"             # the spec went to the shim; ``ok`` or ``err <reason>`` is awaited
    EXIT = "exit"             # the exec failed; the shim's exit (after its receipt) is awaited
    SERVER_EXIT = "server_exit"   # the fork server shut the status pipe unforked; its exit status is awaited


class ShimStart:
    """One shim start in flight (``ForkServer.begin``), driven by ``ForkServer.advance``
    whenever ``fd`` is readable (the caller's selector watches it; None: nothing to watch, call
    ``advance`` once in a while). Phases (:class:`StartPhase`): ``compiling`` (the shim is being
    compiled for a new fork server; ``fd`` is the compile's pidfd), ``fork`` (the request is
    out; the forked shim's ``pid <n>`` line is awaited on the status pipe), ``giving_spec`` (the spec
    is larger than the pipe holds: ``fd`` is an epoll fd, readable when the shim's stdin pipe
    takes more), ``exec`` (the whole spec went to the shim; ``ok`` or ``err <reason>`` is
    awaited), ``exit`` (the exec failed; ``fd`` is the shim's pidfd, readable once it wrote its
    receipt and exited), ``server_exit`` (the fork server shut the status pipe without forking:
    ``fd`` is its pidfd, readable once its exit status, the start's reason, can be had).
    ``pid``/``create_time``/``pidfd`` are set from ``giving_spec`` on; ``bound_s`` (seconds) is the
    start's bound; ``server`` is the fork server the request went to (None while compiling)."""

    __slots__ = ("fd", "phase", "pid", "create_time", "pidfd", "start_error", "bound_s", "request",
                 "server", "_status_r", "_spec_w", "_payload", "_buf", "_poll")

    def __init__(self, status_r: int, spec_w: int, payload: bytes, bound_s: float) -> None:
        self.fd: int | None = status_r
        self.phase = StartPhase.FORK
        self.pid = 0
        self.create_time = 0.0
        self.pidfd: int | None = None
        self.start_error: str | None = None
        self.bound_s = bound_s
        self.request: tuple[str, int, int] | None = None   # compiling: (python, spec_r, status_w) to send
        self.server: subprocess.Popen | None = None
        self._status_r, self._spec_w = status_r, spec_w
        # The spec not yet written, held until the shim exists to read it.
        self._payload: memoryview | None = memoryview(payload)
        self._buf = b""
        self._poll: select.epoll | None = None     # spec: readable when the spec pipe takes more

    def _lines(self) -> tuple[list[str], bool]:
        """The complete lines that came in (without blocking) and whether the pipe is at EOF;
        a line over _STATUS_LIMIT_BYTES counts as one line."""
        eof = False
        while True:
            try:
                chunk = os.read(self._status_r, _STATUS_LIMIT_BYTES)
            except BlockingIOError:
                break
            if not chunk:
                eof = True
                break
            self._buf += chunk
            if len(self._buf) >= _STATUS_LIMIT_BYTES:
                break
        *lines, self._buf = self._buf.split(b"\n")
        if len(self._buf) >= _STATUS_LIMIT_BYTES:
            lines.append(self._buf)
            self._buf = b""
        return [line.decode("utf-8", "replace") for line in lines], eof

    def close(self) -> None:
        """Release the pipes and the pidfds (a start given up: the shim carries on alone)."""
        fds = [self.pidfd, *(self.request[1:] if self.request else ())]
        if self.phase in (StartPhase.COMPILING, StartPhase.SERVER_EXIT) and self.fd is not None:
            fds.append(self.fd)                     # the compile's or the fork server's pidfd
        self._close_pipes()
        for fd in fds:
            if fd is not None and fd >= 0:
                os.close(fd)
        self.pidfd = self.fd = self.request = None

    def _close_spec(self) -> None:
        if self._spec_w >= 0:
            os.close(self._spec_w)
        if self._poll is not None:
            self._poll.close()
        self._spec_w, self._poll, self._payload = -1, None, None

    def _close_pipes(self) -> None:
        self._close_spec()
        if self._status_r >= 0:
            os.close(self._status_r)
        self._status_r = -1


class ForkServer:
    """The fork server (shim/forkserver.py ``serve_forks``, ARCHITECTURE.md "Fork server"): one
    ``python -I -S <program>`` (the shim compiled for that interpreter, ``_compiled_path``) that
    imported the shim once and forks a fresh shim per run, so a start costs a fork, not an
    interpreter start. Started at the first ``begin``, again after it died or went idle
    (FORK_SERVER_IDLE_S); a shim it forks leads its own session and no death signal ties it to
    the fork server or to this process, so it survives both (as a shim does whose agent died)
    and is re-attached by PID + start time like any other. The fork server ignores SIGCHLD: the
    kernel reaps its shims, and init does once it is gone.

    The request carries two pipes, never the spec: the spec (secret plaintext) goes from this
    process straight into the shim's stdin pipe."""

    def __init__(self, cache_dir: str) -> None:
        self._cache_dir = cache_dir          # where the compiled shim is kept (_compiled_path)
        self._python = ""                    # the interpreter of the running fork server
        self._popen: subprocess.Popen | None = None
        self._sock: socket.socket | None = None
        # The fork server started last, until a failure of it is charged (the back-off): a start
        # that fails on it charges it even once it was retired or reaped, on an older one never.
        self._newest: subprocess.Popen | None = None
        self._last_request = 0.0             # time.monotonic() of the last request sent
        self._leaving: list[subprocess.Popen] = []   # retired fork servers, a killed compile: not reaped yet
        self._failure: str | None = None
        self._retry_at = 0.0
        self._backoff_s = 0.0
        self._compiling: tuple[subprocess.Popen, str, str] | None = None   # (process, temp file, path)
        self._uncompilable: set[str] = set()        # _compiled_path paths whose compile failed here

    def pids(self) -> set[int]:
        """The processes this object has started and not reaped (its own children): fork
        servers, and the shim's compile while it runs."""
        procs = [*self._leaving, *([self._popen] if self._popen else [])]
        if self._compiling is not None:
            procs.append(self._compiling[0])
        return {p.pid for p in procs}

    def _program(self, python: str) -> str | None:
        """What a new fork server of ``python`` runs: the compiled shim (``_compiled_path``)
        once it exists, SHIM_PATH when it cannot be had; None while it is being compiled, by a
        process of its own that nobody waits for (an interpreter start and a compile: 0.4 s
        here, seconds on a router; once per shim source and interpreter)."""
        if self._compiling is not None:
            popen, tmp, path = self._compiling
            if popen.poll() is None:
                return None
            self._compiling = None
            if not _end_compile(popen, tmp, path):
                self._uncompilable.add(path)       # not tried again by this process
        path = _compiled_path(self._cache_dir, python)
        ready = _ready_program(None if path in self._uncompilable else path)
        if ready is not None:
            return ready
        tmp = f"{path}.tmp.{os.getpid()}"
        try:
            self._compiling = (_start_compile(python, tmp), tmp, path)
        except OSError:
            return SHIM_PATH                       # no such interpreter: the fork server's start says so
        return None

    def _takes_requests(self, python: str) -> bool:
        """Can a request for ``python`` go out now: a fork server of it runs and stays, or the
        program for a new one is there (else ``_program`` has its compile under way)."""
        if self._sock is not None and self._python == python and \
                time.monotonic() - self._last_request < FORK_SERVER_IDLE_S - _RETIRE_MARGIN_S:
            return True
        return self._program(python) is not None

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

    def _fail(self, reason: str, server: subprocess.Popen | None = None) -> ShimSpawnError:
        """A start fails with ``reason``. The first failure of the newest fork server (or of
        none: ``server`` None) retires it and grows the back-off; a start left on a fork server
        already charged or succeeded fails alone (its successor stays, nothing more is
        charged)."""
        if server is None or server is self._newest:
            self._newest = None
            self._retire()
            self._backoff_s = min(BACKOFF_MAX_S, max(BACKOFF_MIN_S, self._backoff_s * 2))
            self._failure = reason
            self._retry_at = time.monotonic() + self._backoff_s
        return ShimSpawnError(reason)

    def _give_up_compile(self) -> None:
        """A compile that outlived a start's bound is killed (reaped with the retired fork
        servers); this process runs the shim from its source from now on."""
        popen, tmp, path = self._compiling
        self._compiling = None
        self._uncompilable.add(path)
        popen.kill()
        self._leaving.append(popen)
        try:
            os.unlink(tmp)
        except OSError:
            pass

    def _start(self, python: str) -> None:
        # The source when the compiled file is not there yet (a server that died between a
        # _takes_requests and its request): it works the same, at the compiler's memory.
        program = self._program(python) or SHIM_PATH
        import subprocess
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
        self._newest = self._popen
        self._last_request = time.monotonic()

    def _request(self, spec_r: int, status_w: int) -> None:
        self._sock.sendmsg([b"s"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS,
                                     spec_r.to_bytes(4, sys.byteorder) + status_w.to_bytes(4, sys.byteorder))])

    def _send(self, python: str, spec_r: int, status_w: int) -> subprocess.Popen:
        """The request; a new fork server when this one is gone, about to leave or runs
        another interpreter than ``python``. Returns the fork server it went to, or the new
        one that took none (it died at once or shut its socket; retired here): the caller then
        holds the only write end of the status pipe, which ``advance`` finds at EOF and so
        takes the reason from that fork server's exit."""
        now = time.monotonic()
        if self._sock is not None and (now - self._last_request >= FORK_SERVER_IDLE_S - _RETIRE_MARGIN_S
                                       or self._python != python):
            self._retire()
        if self._sock is not None:
            try:
                self._request(spec_r, status_w)
                self._last_request = now
                return self._popen
            except OSError:
                self._retire()            # it died since the last request: one new one
        self._start(python)
        server = self._popen
        try:
            self._request(spec_r, status_w)
            self._last_request = now
        except OSError:
            self._retire()                # one start per request: a server that cannot start is not retried
        return server

    def begin(self, spec: dict, python: str, status_timeout_s: float | None = None) -> ShimStart:
        """Ask the fork server of ``python -I -S`` for one shim for ``spec`` (the shim
        contract's document) and return at once: the start goes on in ``advance`` each time
        the returned ShimStart's ``fd`` is readable, so nothing here waits for a child (only
        the fork server's own exec when there is none yet; its bytecode is compiled by a
        process nobody waits for, ``_program``). ``status_timeout_s`` (seconds; None:
        START_STATUS_TIMEOUT_S) is the ShimStart's ``bound_s``.

        Raises ValidationError (field spec) for a spec over SPEC_LIMIT_BYTES, before anything
        starts; ShimSpawnError when the fork server cannot be started (the reason; until the
        back-off has passed every call fails at once with it, the reason of the failure that
        set it)."""
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
            queued = not self._takes_requests(python)
            server = None if queued else self._send(python, spec_r, status_w)
        except BaseException:
            for fd in (spec_r, status_w, spec_w, status_r):
                os.close(fd)
            raise
        if not queued:
            os.close(spec_r)
            os.close(status_w)
        os.set_blocking(status_r, False)
        os.set_blocking(spec_w, False)
        st = ShimStart(status_r, spec_w, payload,
                       START_STATUS_TIMEOUT_S if status_timeout_s is None else status_timeout_s)
        st.server = server
        if queued:
            st.phase, st.request = StartPhase.COMPILING, (python, spec_r, status_w)
            try:
                st.fd = os.pidfd_open(self._compiling[0].pid)
            except (AttributeError, OSError):
                st.fd = None
        return st

    def advance(self, st: ShimStart, expired: bool = False) -> ShimHandle | None:
        """Take in what ``st``'s shim reported (never waits for it): None while the start
        goes on (``st.fd`` may have changed), else its ShimHandle (``st`` is then spent; the
        handle owns the pidfd): ``start_error`` None once the task was exec'd, else the shim's
        reason, returned once the shim has exited (its receipt is written by then).
        ``expired`` (the caller's bound passed) ends the start whatever came: a shim that has
        not reported its task's exec is SIGKILLed (its task, if the exec was that late, dies
        with it: PR_SET_PDEATHSIG) and the handle says so; a compile still running is killed.

        The shim's PID comes first (the fork server's ``pid <n>`` line); only then does
        the spec (secrets included) go into its stdin pipe, as much as the pipe takes, the rest
        each time it takes more (``giving_spec``), so a shim whose agent died before knowing its PID
        reads no spec and runs nothing, and a shim slow to read holds nobody up. Raises
        ShimSpawnError (``st`` closed) when the fork server forked no shim or the shim was not
        compiled in time: its reason (``fork server: exited with status N before forking the
        shim`` once its exit status is known, which is awaited on its pidfd, never waited for
        here), the back-off as in ``begin``."""
        if st.phase == StartPhase.SERVER_EXIT:
            return self._server_gone(st, expired)
        if st.phase == StartPhase.COMPILING:
            if expired:
                st.close()
                if self._compiling is not None:
                    self._give_up_compile()
                raise ShimSpawnError("fork server: the shim was not compiled within %.0f s" % st.bound_s)
            if self._program(st.request[0]) is None:
                return None
            python, spec_r, status_w = st.request
            if st.fd is not None:
                os.close(st.fd)
            st.phase, st.fd, st.request = StartPhase.FORK, st._status_r, None
            try:
                st.server = self._send(python, spec_r, status_w)
            except ShimSpawnError:
                st.close()
                raise
            finally:
                os.close(spec_r)
                os.close(status_w)
        if st.phase == StartPhase.FORK:
            lines, eof = st._lines()
            if not lines:
                if eof:
                    return self._server_gone(st, expired)
                if expired:
                    server = st.server
                    st.close()
                    raise self._fail("fork server: no shim forked within %.0f s" % st.bound_s, server)
                return None
            first = lines.pop(0)
            if first.startswith("err "):
                server = st.server
                st.close()
                raise self._fail(f"fork server: {first[4:]}", server)
            if not first.startswith("pid "):
                return self._server_gone(st, expired)
            self._failure, self._backoff_s = None, 0.0
            st.pid = int(first[4:])
            try:
                st.pidfd = os.pidfd_open(st.pid)
            except (AttributeError, OSError):
                st.pidfd = None
            import psutil
            try:
                st.create_time = psutil.Process(st.pid).create_time()
            except psutil.NoSuchProcess:
                st.create_time = 0.0
            st.phase = StartPhase.SPEC
            st._buf = "\n".join(lines).encode() + (b"\n" if lines else b"") + st._buf
        if st.phase == StartPhase.SPEC:
            if not self._give_spec(st) and not expired:
                return None
            st.phase, st.fd = StartPhase.EXEC, st._status_r
        if st.phase == StartPhase.EXEC:
            lines, eof = st._lines()
            if not (lines or eof or expired):
                return None
            st._close_pipes()
            if lines and lines[0] == "ok":
                return self._handle(st, None)
            if not lines and not eof:
                # The bound passed and the shim has not said whether its task runs: counted as
                # started, a shim stuck before the exec would leave a Run running with nothing
                # to stop (the shim itself is never signalled), so it ends here.
                _kill(st.pid, st.create_time, st.pidfd)
                return self._handle(st, "shim: the task was not started within %.0f s; the shim was killed"
                                    % st.bound_s)
            st.start_error = lines[0][4:] if lines and lines[0].startswith("err ") else \
                "shim: exited before starting the task"
            st.phase, st.fd = StartPhase.EXIT, st.pidfd
        if expired or _exited(st.pid, st.create_time, st.pidfd):
            return self._handle(st, st.start_error)
        return None

    def _server_gone(self, st: ShimStart, expired: bool) -> None:
        """The fork server forked no shim for ``st`` (its status pipe at EOF, or a line that is
        neither ``pid`` nor ``err``): it has exited or is exiting, and its exit status is the
        reason. Never waits for it: the failure is raised once ``Popen.poll`` (a WNOHANG reap)
        has the status, else the start waits in ``server_exit`` on the fork server's pidfd (no
        pidfd: looked at by the caller's next ``advance``) or, past the bound, fails
        ``no shim forked``. Retired at once, so no further request goes to it."""
        server = st.server
        if st.phase != StartPhase.SERVER_EXIT:
            st._close_pipes()
            st.phase, st.fd = StartPhase.SERVER_EXIT, None
            if server is self._popen:
                self._retire()
            if server.poll() is None:         # not reaped, so its PID is still its own
                try:
                    st.fd = os.pidfd_open(server.pid)
                except (AttributeError, OSError):
                    pass
        status = server.poll()
        if status is None and not expired:
            return None
        st.close()
        raise self._fail("fork server: no shim forked within %.0f s" % st.bound_s if status is None else
                         f"fork server: exited with status {status} before forking the shim", server)

    @staticmethod
    def _give_spec(st: ShimStart) -> bool:
        """Write into the forked shim's stdin what its pipe takes now, never waiting for the
        shim to read (it reads nothing else first): True once the whole spec is in (the pipe
        then closed) or the shim is gone (its status says so), else False with ``st.fd`` an
        epoll fd that is readable when the pipe takes more."""
        try:
            while st._payload:
                st._payload = st._payload[os.write(st._spec_w, st._payload):]
        except BlockingIOError:
            if st._poll is None:
                st._poll = select.epoll(1)
                st._poll.register(st._spec_w, select.EPOLLOUT)
            st.fd = st._poll.fileno()
            return False
        except BrokenPipeError:
            pass
        st._close_spec()
        return True

    @staticmethod
    def _handle(st: ShimStart, start_error: str | None) -> ShimHandle:
        h = ShimHandle(st.pid, st.create_time, st.pidfd, start_error)
        st.pidfd = None
        st.close()
        return h


def errno_text(exc: OSError) -> str:
    """``ENOENT (No such file or directory)``: the errno name and its text, never invented."""
    name = errno.errorcode.get(exc.errno, f"errno {exc.errno}") if exc.errno else "no errno"
    return f"{name} ({exc.strerror or os.strerror(exc.errno or 0)})"


def default_python() -> str:
    """The interpreter for the shim: this one, or the system python3 when embedded."""
    return sys.executable or "/usr/bin/python3"


def baseline_env(uid: int | None = None) -> dict[str, str]:
    """HOME, USER, LOGNAME and SHELL of the run user's passwd entry (the agent's effective uid),
    as cron and systemd give them; {} when the uid has no entry. A recipe value overrides each."""
    try:
        pw = pwd.getpwuid(os.geteuid() if uid is None else uid)
    except KeyError:
        return {}
    return {"HOME": pw.pw_dir or "/", "USER": pw.pw_name, "LOGNAME": pw.pw_name, "SHELL": pw.pw_shell or "/bin/sh"}


class ShimProcesses:
    """``core.ports.ProcessPort``: shims started by this agent (``begin``/``advance``) or re-attached after
    a restart, their run directories under the allocator's ``runs_root``, and the signalling of
    a run's process tree (``signal_tree`` with the processes seen by earlier steps)."""

    def __init__(self, allocator, linger_s: float, python: str | None = None, cgroups=None) -> None:
        self._alloc = allocator            # adapters.artifacts.ArtifactAllocator (safe run dirs)
        self._cgroups = cgroups            # adapters.runcgroup.RunCgroups, or None: no run cgroups
        self._linger_s = linger_s
        self._python = python or default_python()
        self._handles: dict[int, ShimHandle] = {}
        self._forks = ForkServer(allocator.runs_root)
        self._starts: dict[str, ShimStart] = {}   # attempt → its start in flight (begin → advance)
        self._known: dict[str, dict] = {}         # attempt → processes seen when first signalled
        self._started: dict[str, float] = {}
        self._key = agent_key(allocator.runs_root)

    def _run_dir(self, attempt_id: str) -> str:
        return os.path.join(self._alloc.runs_root, attempt_id)

    def begin(self, cmd: LaunchCommand) -> None:
        attempt_id = cmd.candidate.attempt_id
        try:
            run_dir = self._alloc.run_dir(attempt_id)
        except UnsafeDirectoryError as e:
            raise StartError(e.message, code="run_dir_unsafe") from None
        env = {**cmd.env, AGENT_KEY_ENV: self._key}
        spec = {"attempt_id": attempt_id, "argv": list(cmd.argv), "env": env, "cwd": cmd.cwd,
                "run_dir": run_dir, "artifact_path": cmd.artifact_path, "quota_bytes": cmd.quota_bytes,
                "linger_s": self._linger_s, "umask": cmd.umask, "grace_s": cmd.grace_ms / 1000,
                "keep_orphans": cmd.keep_orphans, "timeout_s": cmd.timeout_ms / 1000,
                "cgroup": self._cgroups.create(attempt_id, cmd.memory_max) if self._cgroups else None}
        try:
            self._starts[attempt_id] = self._forks.begin(spec, self._python)
        except QlError as e:              # spec over its bound, no interpreter, no fork server
            raise StartError(f"shim: {e.message}", code="shim_failed") from None

    def start_fd(self, attempt_id: str) -> int | None:
        st = self._starts.get(attempt_id)
        return None if st is None else st.fd

    def advance(self, attempt_id: str, expired: bool = False) -> tuple[int, float] | None:
        st = self._starts[attempt_id]
        try:
            h = self._forks.advance(st, expired)
        except QlError as e:
            del self._starts[attempt_id]
            raise StartError(f"shim: {e.message}", code="shim_failed") from None
        if h is None:
            return None
        del self._starts[attempt_id]
        if h.start_error is not None:
            if h.pidfd is not None:
                os.close(h.pidfd)
            raise StartError(h.start_error, code=start_code(h.start_error))
        self._handles[h.pid] = h
        self._started[attempt_id] = h.create_time
        return h.pid, h.create_time

    def holds_deadline(self, attempt_id: str) -> bool:
        return os.path.exists(os.path.join(self._run_dir(attempt_id), DEADLINE_FILE))

    def fence_unstarted(self, attempt_id: str) -> bool:
        # The agent creates the run directory empty; the shim's first write there, the FIFO,
        # comes before the exec, and it is never empty again until the agent removes it
        # (shim/main.py, output.fifo). rmdir succeeds only on an empty directory, and once it is
        # gone a shim still on its way fails its mkfifo (ENOENT) before any exec: the kernel
        # orders the two. No directory at all: begin never asked for a shim.
        try:
            os.rmdir(self._run_dir(attempt_id))
        except FileNotFoundError:
            return True
        except OSError:
            return False                 # ENOTEMPTY: a shim got that far
        return True

    def abandon_start(self, attempt_id: str) -> None:
        st = self._starts.pop(attempt_id, None)
        if st is not None:
            st.close()

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
        import psutil
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
