"""Helpers for the execution tests (issue 3): a real Engine over a real SQLite file, driven the
way the service loop drives it, and a real ``qlagent serve`` subprocess.

Nothing here is a double: the Engine spawns the real shim, which execs the task
through a real FIFO into a real log file; waits are on pidfds (in-process) or on the store
(``serve`` in another process, where the CLI's own 0.1 s store poll is the only way to see it).
"""

from __future__ import annotations

import os
import selectors
import signal
import sqlite3
import subprocess
import time

import psutil

from types import SimpleNamespace

from qlagent import bootstrap
from qlagent.adapters.secretbox import create_key_file
from qlagent.adapters.sqlite.store import SqliteStore
from qlagent.application.definitions import DefinitionWriter
from qlagent.application.runs import RunService
from qlagent.application.secrets import SecretService
from qlagent.core.clock import now_us
from qlagent.core.profiles import EDGE
from qlagent.service import control
from kit import REPO, Serve, clean_env, qlagent_argv, wait_until

TERMINAL = ("succeeded", "failed", "timed_out", "cancelled", "lost")


def task(name: str, script: str | None = None, **kw) -> dict:
    """A ``[[task]]`` table: a /bin/sh script (or ``command=[...]``), manual, 5 s timeout, 1 s grace."""
    t = {"name": name, "timeout_s": 5, "grace_s": 1, **kw}
    if script is not None:
        t.update(shell="/bin/sh", script=script)
    return t


def toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return "'''\n" + v + "'''" if "\n" in v else '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, list):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{k} = {toml_value(x)}" for k, x in v.items()) + " }"
    raise TypeError(type(v))


def write_toml(path: str, tasks: list[dict]) -> str:
    with open(path, "w") as f:
        for t in tasks:
            f.write("[[task]]\n" + "".join(f"{k} = {toml_value(v)}\n" for k, v in t.items()) + "\n")
    return path


class Bench:
    """One state directory with a real SqliteStore and a real Engine (no service loop), wired by
    the composition root as the service wires it."""

    def __init__(self, root: str, profile=EDGE, max_concurrent: int | None = None, artifact_dir: str | None = None,
                 db_path: str | None = None) -> None:
        self.root = root
        os.makedirs(root, exist_ok=True)
        self.db_path = db_path or os.path.join(root, "qlagent.db")
        self.artifact_dir = artifact_dir or os.path.join(root, "artifacts")
        self.runs_dir = os.path.join(root, "runs")
        self.key_file = os.path.join(os.path.dirname(self.db_path), "secret.key")
        os.makedirs(os.path.dirname(self.db_path), exist_ok=True)
        create_key_file(self.key_file)
        self.store = SqliteStore(self.db_path)
        self.log_lines: list[tuple] = []
        settings = SimpleNamespace(artifact_dir=self.artifact_dir, runs_dir=self.runs_dir, key_file=self.key_file,
                                   profile=profile)
        self.engine = bootstrap.build_engine(settings, self.store,
                                             max_concurrent=max_concurrent or profile.max_concurrent_runs,
                                             budget=None, clock_us=now_us,
                                             log=lambda *a, **k: self.log_lines.append((a, k)))
        self.runs = RunService(self.store)

    def add(self, *tasks: dict):
        return DefinitionWriter(self.store).add(DefinitionWriter.prepare_file({"task": list(tasks)}))

    def secret(self, name: str, value: bytes) -> None:
        SecretService(self.store, bootstrap.cipher_factory(self.key_file)).set(name, value)

    def start(self, name: str) -> str:
        return self.runs.start(name).run_id

    def run(self, run_id: str):
        return self.runs.get(run_id)

    def attempts(self, run_id: str):
        return self.runs.attempts(run_id)

    def artifacts(self) -> list[str]:
        out = []
        for d, _, files in os.walk(self.artifact_dir):
            out += [os.path.join(d, f) for f in files]
        return out

    def drive(self, until, timeout_s: float = 20.0, dispatch: bool = True) -> None:
        """The service loop in miniature: dispatch (unless ``dispatch`` is False), then sleep on
        the shims' pidfds or the next deadline until ``until()`` is true. Raises
        AssertionError after ``timeout_s``."""
        sel = selectors.DefaultSelector()
        registered: set[int] = set()
        end = time.monotonic() + timeout_s
        try:
            while not until():
                assert time.monotonic() < end, "engine did not reach the expected state in time"
                self.engine.sweep_cancels()
                self.engine.tick()
                for _ in range(16 if dispatch else 0):
                    if self.engine.dispatcher.dispatch_once().status not in ("activated", "more"):
                        break
                for fd, aid in self.engine.pidfds().items():
                    if fd not in registered:
                        sel.register(fd, selectors.EVENT_READ, aid)
                        registered.add(fd)
                if until():
                    return
                wake = self.engine.next_wakeup_us()
                wait = 0.5 if wake is None else max(0.0, min(0.5, (wake - time.time_ns() // 1000) / 1e6))
                for key, _ in sel.select(wait):
                    sel.unregister(key.fileobj)
                    registered.discard(key.fd)
                    self.engine.on_exit(key.data)
        finally:
            sel.close()

    def wait_run(self, run_id: str, timeout_s: float = 20.0):
        self.drive(lambda: self.run(run_id).state in TERMINAL, timeout_s)
        return self.run(run_id)

    def close(self) -> None:
        self.store.close()


def file_bytes_under(root: str) -> bytes:
    """Every regular file under ``root`` concatenated (DB, WAL, SHM, logs, run dirs)."""
    out = bytearray()
    for d, _, files in os.walk(root):
        for f in files:
            p = os.path.join(d, f)
            if os.path.isfile(p) and not os.path.islink(p):
                try:
                    with open(p, "rb") as fh:
                        out += fh.read()
                except OSError:
                    pass
    return bytes(out)


def procs_with_env(key: str, value: str) -> list[psutil.Process]:
    """Live (non-zombie) processes whose environment holds ``key=value`` (a run's processes)."""
    needle = f"{key}={value}".encode()
    found = []
    for p in psutil.process_iter():
        try:
            with open(f"/proc/{p.pid}/environ", "rb") as f:
                if needle in f.read().split(b"\0") and p.status() != psutil.STATUS_ZOMBIE:
                    found.append(p)
        except (OSError, psutil.NoSuchProcess):
            continue
    return found


class Agent:
    """A real ``qlagent serve`` (a :class:`kit.Serve`) over its own state directory; ``proc`` is
    the latest one's process."""

    def __init__(self, root: str, config: str = "", profile: str = "edge") -> None:
        self.root = root
        self.state = os.path.join(root, "state")
        self.config = os.path.join(root, "qlagent.toml")
        with open(self.config, "w") as f:
            f.write(f'profile = "{profile}"\ndrain_grace_s = 0\nkill_grace_s = 1\n' + config)
        self.proc: subprocess.Popen | None = None
        self.serves: list[Serve] = []
        self.cli("init")

    def env(self, extra: dict | None = None) -> dict:
        return {**clean_env(QLAGENT_CONFIG=self.config), **(extra or {})}

    def cli(self, *args: str, stdin: bytes | None = None, check: bool = True, timeout: float = 60):
        p = subprocess.run(qlagent_argv("--state-dir", self.state, *args),
                           input=stdin, capture_output=True, env=self.env(), timeout=timeout, cwd=REPO)
        if check:
            assert p.returncode == 0, (args, p.stdout, p.stderr)
        assert b"Traceback" not in p.stderr, p.stderr
        return p

    def add(self, *tasks: dict) -> None:
        path = write_toml(os.path.join(self.root, f"tasks-{time.monotonic_ns()}.toml"), list(tasks))
        self.cli("task", "add", "-f", path)

    def serve(self, exit_after: float = 60, env: dict | None = None, prefix: tuple = (),
              ready: str | None = "service.ready") -> subprocess.Popen:
        """Start ``qlagent serve --exit-after`` (under ``prefix``, e.g. ``ip netns exec NS``)
        and return once its journal has a ``ready`` line (``service.ready``: migrations and
        recovery are done, the control socket is bound); ``ready=None`` returns at once."""
        serve = Serve("--state-dir", self.state, serve_args=("--exit-after", str(exit_after)), env=self.env(env),
                      ready=ready, timeout=15, prefix=prefix, cwd=REPO)
        self.serves.append(serve)
        self.proc = serve.proc
        return self.proc

    def start(self, name: str) -> str:
        return self.cli("run", "start", name).stdout.decode().strip()

    def db(self) -> sqlite3.Connection:
        c = sqlite3.connect(os.path.join(self.state, "qlagent.db"), timeout=10)
        c.row_factory = sqlite3.Row
        return c

    def run(self, run_id: str) -> sqlite3.Row:
        with self.db() as c:
            return c.execute("SELECT * FROM runs WHERE run_id = ?", (run_id,)).fetchone()

    def attempts(self, run_id: str) -> list[sqlite3.Row]:
        with self.db() as c:
            return c.execute("SELECT * FROM attempts WHERE run_id = ? ORDER BY attempt_no", (run_id,)).fetchall()

    def truncations(self, run_id: str) -> list[sqlite3.Row]:
        with self.db() as c:
            return c.execute("SELECT t.* FROM truncation_facts t JOIN attempts a USING (attempt_id) "
                             "WHERE a.run_id = ?", (run_id,)).fetchall()

    def wait(self, run_id: str, states=TERMINAL, timeout_s: float = 30.0) -> sqlite3.Row:
        """Poll the store (another process owns the engine) until the Run is in ``states``;
        fails at once, with the journal, if ``serve`` ended."""
        def reached() -> sqlite3.Row | None:
            r = self.run(run_id)
            if r["state"] in states:
                return r
            assert self.proc is None or self.proc.poll() is None, self.journal()[-4000:]
            return None
        return wait_until(reached, timeout_s, f"run {run_id} in {states}", step=0.05,
                          detail=lambda: f"still {self.run(run_id)['state']}")

    def poke(self) -> None:
        control.poke(os.path.join(self.state, "control.sock"))

    def stop(self, timeout: float = 15) -> int:
        """SIGTERM (drain) and wait; returns the exit status."""
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else 0
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()

    def journal(self) -> bytes:
        """Every journal line every ``serve`` of this Agent wrote."""
        return "".join(s.journal() for s in self.serves).encode()
