"""The helpers every test shares: a scratch directory, a free loopback port, a bounded wait
that names what it awaited, the ``qlagent`` CLI in a subprocess (in a clean environment), and a
real ``qlagent serve`` process whose journal (stderr) goes to a file read as it grows,
Prometheus's linter over a ``/metrics`` document, and a TCP proxy to bend a link.

Importable from every test directory (``pythonpath = ["tests"]``); the fixtures built on them
live in ``tests/conftest.py``.
"""

from __future__ import annotations

import contextlib
import http.client
import inspect
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import shutil
import weakref

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# tmpfs when it is writable, else the system temp dir: the files are real, only a slow disk's
# fsync cost is avoided.
SCRATCH_ROOT = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None


def scratch_dir(prefix: str) -> str:
    """A fresh directory named ``PREFIX…`` under ``SCRATCH_ROOT``. The caller removes it."""
    return tempfile.mkdtemp(prefix=prefix, dir=SCRATCH_ROOT)


@contextlib.contextmanager
def small_file_systems(prefix: str):
    """A scratch directory and ``mount(name, size)``, which mounts a tmpfs of ``size`` (mount's
    syntax: "1m", "8m") at ``name`` below it, mode 0700, and returns its path: a small flash for
    the test. Every mount is undone and the directory removed at the end. Root only."""
    d = tempfile.mkdtemp(prefix=prefix)
    mounts = []

    def mount(name: str, size: str) -> str:
        path = os.path.join(d, name)
        os.mkdir(path, 0o700)
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", path],
                       check=True)
        mounts.append(path)
        return path
    try:
        yield d, mount
    finally:
        for path in mounts:
            subprocess.run(["umount", "-l", path], check=False)
        shutil.rmtree(d, ignore_errors=True)


def fill(path: str) -> None:
    """Write ``path`` until its file system is full (ENOSPC)."""
    with open(path, "ab", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 4096)
        except OSError:
            pass


def readyz(port: int) -> tuple[int, dict]:
    """GET /readyz on loopback ``port``: (status, JSON body)."""
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        c.request("GET", "/readyz")
        r = c.getresponse()
        return r.status, json.loads(r.read())
    finally:
        c.close()


class WaitTimeout(AssertionError, TimeoutError):
    """A wait that ran out: a test failure for pytest, a ``TimeoutError`` for a caller that
    retries on one."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now (bind port 0, read it, release it)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _describe(predicate) -> str:
    try:
        source = " ".join(inspect.getsource(predicate).split())
    except (OSError, TypeError):
        return repr(predicate)
    return source[source.find("lambda"):][:300] if "lambda" in source else source[:300]


def wait_until(predicate, timeout: float = 10.0, what: str | None = None, *, step: float = 0.02,
               detail=None):
    """Poll ``predicate()`` until it returns a truthy value, and return that value. For state
    the test cannot await as an event (rows another process writes, a file appearing).

    ``timeout`` and ``step`` in seconds. Raises :class:`WaitTimeout` "timed out after T s waiting
    for WHAT" (``what`` defaults to the predicate's source), followed by ``detail()`` when given
    (e.g. a journal tail). An exception the predicate raises ends the wait at once.
    """
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            extra = f": {detail()}" if detail else ""
            raise WaitTimeout(f"timed out after {timeout} s waiting for {what or _describe(predicate)}{extra}")
        time.sleep(step)


def clean_env(**extra) -> dict:
    """This process's environment without ``QLAGENT_*`` and the systemd variables
    (``NOTIFY_SOCKET``, ``WATCHDOG_*``, ``JOURNAL_STREAM``), plus ``extra`` (values as str)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("QLAGENT_", "NOTIFY_SOCKET", "WATCHDOG_", "JOURNAL_STREAM"))}
    env.update({k: str(v) for k, v in extra.items()})
    return env


def promtool_check(text: str) -> None:
    """``promtool check metrics`` (Debian's ``prometheus`` package, which tests/run installs):
    Prometheus's own linter of an exposition — counters end in ``_total``, base units such as
    ``_seconds``/``_bytes`` are in the name, every family has HELP. It prints each problem
    naming the metric, and exits non-zero for a document it cannot parse."""
    p = subprocess.run(["promtool", "check", "metrics"], input=text.encode(), capture_output=True, timeout=60)
    assert p.returncode == 0 and not p.stdout.strip() and not p.stderr.strip(), (p.stdout, p.stderr)


def qlagent_argv(*args: str) -> list[str]:
    """The argv of ``qlagent ARGS`` run from the source tree (``python -m qlagent.cli.main``)."""
    return [sys.executable, "-m", "qlagent.cli.main", *args]


def run_cli(*args: str, stdin: bytes | None = None, env: dict | None = None, timeout: float = 60,
            text: bool = False) -> subprocess.CompletedProcess:
    """Run ``qlagent ARGS`` to its end with output captured (bytes, or str with ``text``); the
    environment is :func:`clean_env` updated with ``env``; ``timeout`` in seconds."""
    return subprocess.run(qlagent_argv(*args), input=stdin, capture_output=True, text=text,
                          env={**clean_env(), **(env or {})}, timeout=timeout)


class Serve:
    """``qlagent GLOBAL_ARGS serve SERVE_ARGS`` in a subprocess (under ``prefix``, e.g. ``ip netns
    exec NS``); its journal (stderr) goes straight to a file, so nothing can fill a pipe and a
    line is readable as soon as the process wrote it. With ``ready`` set, the constructor
    returns once a journal line contains it (default ``service.ready``) and fails, naming the
    journal, if the process ends first. ``pid``, ``poll``, ``send_signal``, ``returncode`` are
    the process's.
    """

    def __init__(self, *global_args: str, serve_args: tuple = (), env: dict | None = None,
                 ready: str | None = "service.ready", timeout: float = 30, prefix: tuple | list = (),
                 cwd: str | None = None) -> None:
        fd, self.journal_path = tempfile.mkstemp(prefix="qlagent-serve-", suffix=".journal", dir=SCRATCH_ROOT)
        weakref.finalize(self, os.unlink, self.journal_path)
        try:
            self.proc = subprocess.Popen([*prefix, *qlagent_argv(*global_args, "serve", *serve_args)],
                                         stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=fd,
                                         env=env if env is not None else clean_env(), cwd=cwd)
        finally:
            os.close(fd)
        if ready:
            self.wait_line(ready, timeout)

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def returncode(self) -> int | None:
        return self.proc.returncode

    def poll(self) -> int | None:
        return self.proc.poll()

    def send_signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def journal(self) -> str:
        """Every journal line written so far."""
        with open(self.journal_path, "rb") as f:
            return f.read().decode(errors="replace")

    @property
    def lines(self) -> list[str]:
        """The journal's lines so far, each with its newline."""
        return self.journal().splitlines(keepends=True)

    def wait_line(self, text: str, timeout: float = 20) -> str:
        """The first journal line containing ``text``, waiting up to ``timeout`` seconds for it;
        ``AssertionError`` carrying the journal when it does not come (or the process ended)."""
        def found() -> tuple[str | None] | None:
            ended = self.proc.poll() is not None        # read after: an ended process wrote its last line
            line = next((ln for ln in self.lines if text in ln), None)
            return (line,) if line is not None or ended else None
        try:
            (line,) = wait_until(found, timeout, text)
        except WaitTimeout:
            line = None
        assert line is not None, f"no journal line with {text!r} within {timeout} s:\n" + self.journal()
        return line

    def wait(self, timeout: float | None = None) -> int:
        """Wait up to ``timeout`` seconds for the process to end (``TimeoutExpired`` otherwise);
        the exit status."""
        return self.proc.wait(timeout)

    def stop(self, timeout: float = 30) -> int:
        """SIGTERM (drain) and wait up to ``timeout`` seconds; the exit status. A process still
        there then is killed and ``TimeoutExpired`` raised."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise

    def kill(self) -> int:
        """SIGKILL, then the exit status."""
        if self.proc.poll() is None:
            self.proc.kill()
        return self.proc.wait()


class TcpProxy:
    """A TCP proxy on 127.0.0.1 (``port``) to the server (a replica, a control-plane stub) at
    127.0.0.1:``upstream_port``: every connection it admits (``_admit``) is piped both ways by
    two threads running the subclass's ``_pipe(src, dst, outbound)`` (``outbound``: from the
    client to the server); ``_shut`` ends sockets both ways."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream = upstream_port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                c, _ = self.listener.accept()
            except OSError:
                return
            if not self._admit(c):
                continue
            u = socket.create_connection(("127.0.0.1", self.upstream))
            threading.Thread(target=self._pipe, args=(c, u, True), daemon=True).start()
            threading.Thread(target=self._pipe, args=(u, c, False), daemon=True).start()

    def _admit(self, conn: socket.socket) -> bool:
        return True

    @staticmethod
    def _shut(*socks: socket.socket) -> None:
        for s in socks:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def close(self) -> None:
        self.listener.close()


class PausingLink(TcpProxy):
    """A TCP proxy to the replica that ``flowing.clear()`` pauses as a SIGSTOPped replica does:
    connections are still accepted and what is sent is kept, but nothing goes through either
    way until ``flowing.set()``, which delivers everything held in order."""

    def __init__(self, upstream_port: int) -> None:
        self.flowing = threading.Event()
        self.flowing.set()
        super().__init__(upstream_port)

    def _pipe(self, src: socket.socket, dst: socket.socket, outbound: bool) -> None:
        try:
            while data := src.recv(65536):
                self.flowing.wait()
                dst.sendall(data)
        except OSError:
            pass
        self._shut(src, dst)


class SilentLink(TcpProxy):
    """A TCP proxy to the replica that ``cut`` turns into a black hole: connections are
    accepted and kept open, nothing is forwarded either way and nothing is closed, so every
    call of the Worker waits its whole timeout (a link whose packets vanish, a SIGSTOPped
    replica whose kernel still completes connections)."""

    def __init__(self, upstream_port: int) -> None:
        self.cut = threading.Event()
        self.held: list[socket.socket] = []
        super().__init__(upstream_port)

    def _admit(self, conn: socket.socket) -> bool:
        if self.cut.is_set():
            self.held.append(conn)
            return False
        return True

    def _pipe(self, src: socket.socket, dst: socket.socket, outbound: bool) -> None:
        try:
            while (data := src.recv(65536)) and not self.cut.is_set():
                dst.sendall(data)
        except OSError:
            pass
        if self.cut.is_set():
            self.held += [src, dst]
            return
        self._shut(src, dst)

    def close(self) -> None:
        super().close()
        for s in self.held:
            s.close()
