"""Helpers for tests that run the real ``qlagent serve`` process (``kit.Serve``): a real unix
datagram NOTIFY_SOCKET listener, task files and run queries on the real store.
"""

from __future__ import annotations

import os
import socket
import sqlite3
import threading
import time

from kit import REPO, Serve
from qlcli import ok


class NotifyListener:
    """A bound unix DATAGRAM socket collecting sd_notify messages as (monotonic time, line).

    A thread reads it continuously, as systemd does, so a test that is busy elsewhere never
    leaves the agent's datagrams queued (past ``net.unix.max_dgram_qlen`` a send blocks).
    """

    def __init__(self, directory: str) -> None:
        self.path = os.path.join(directory, "notify.sock")
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(self.path)
        self.sock.settimeout(0.05)
        self.messages: list[tuple[float, str]] = []
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._reader, daemon=True)
        self._thread.start()

    def _reader(self) -> None:
        while not self._closed:
            try:
                data = self.sock.recv(65536)
            except (TimeoutError, socket.timeout):
                continue
            except OSError:
                return
            t = time.monotonic()
            with self._cond:
                self.messages.extend((t, line) for line in data.decode().split("\n") if line)
                self._cond.notify_all()

    def wait_for(self, predicate, timeout: float = 10.0) -> tuple[float, str]:
        """Block until a message satisfying ``predicate(line)`` arrives; returns (time, line)."""
        seen = 0
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                for t, line in self.messages[seen:]:
                    if predicate(line):
                        return t, line
                seen = len(self.messages)
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"no matching notify message in {timeout} s; got {self.lines()[-20:]}")
                self._cond.wait(left)

    def collect(self, seconds: float) -> None:
        """Let ``seconds`` pass while the reader keeps collecting."""
        time.sleep(seconds)

    def lines(self) -> list[str]:
        return [m for _, m in list(self.messages)]

    def close(self) -> None:
        self._closed = True
        self._thread.join()
        self.sock.close()


def start_serve(state: str, *args: str, env: dict | None = None, prefix: tuple = ()) -> Serve:
    """``qlagent --state-dir STATE serve ARGS`` (optionally under ``prefix``, e.g. ip netns exec)
    as a :class:`kit.Serve`, returned at once (not waited for ``service.ready``)."""
    return Serve("--state-dir", state, serve_args=args, env=env, ready=None, prefix=prefix, cwd=REPO)


def add_tasks(state: str, workdir: str, toml: str, name: str = "tasks.toml") -> None:
    path = os.path.join(workdir, name)
    with open(path, "w") as f:
        f.write(toml)
    ok(state, "task", "add", "-f", path)


def db(state: str) -> sqlite3.Connection:
    return sqlite3.connect(os.path.join(state, "qlagent.db"), timeout=10)


def runs_of(state: str, task: str) -> list[tuple[str, str]]:
    """(run_id, state) of a Task's Runs, oldest first."""
    with db(state) as c:
        return c.execute("SELECT r.run_id, r.state FROM runs r JOIN tasks t USING (task_id) "
                         "WHERE t.name = ? ORDER BY r.created_at_us", (task,)).fetchall()
