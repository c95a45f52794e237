"""``core.control.WorkerRunsPort``: a fleet Worker's local execution of offered Attempts (issue 11 §4, ADR-0021): the same shim
(``adapters/shim/main.py``), FIFO drainer (``shim/drainer.py``), log quota, truncation fact and receipt as a
local Run, driven by the Worker's loop.

Layout: ``<runs dir>/<attemptId>/`` (0700) is the Attempt's run directory: its existence is the
crash-barrier evidence (``core.inbox_states.recovery_action``): it is created and fsync'd after
the inbox barrier and before the shim is spawned. It holds the shim's files (task.pid,
receipt.json, truncated.json), ``shim.json`` (the shim's PID and start time, for a PID-reuse
safe re-attach after a Worker restart), ``output.log`` (the Artifact, 0600, at most the
spec's ``logQuotaBytes``) and, for ``onLeaseLoss = "kill"``, ``lease``: the instant the shim
stops the run by itself unless the Worker renewed it (shim "Lease self-fencing"). The whole
directory is removed only after the control plane acknowledged the completion and the last log
chunk (``prune``).

Secret values reach the shim through its stdin pipe (never argv or disk) and are dropped by the
caller after this one materialisation.
"""

from __future__ import annotations

import json
import os
import signal

from ..core.cluster import ExecutionSpec
from ..core.errors import QlError, RunFileError, StartError
from ..core.receipt import Receipt, TruncationFact, bounded
from . import processes

ARTIFACT = "output.log"
SHIM_FILE = "shim.json"
LEASE_FILE = "lease"
LINGER_S = 2.0


def _shim_failed(e: Exception) -> StartError:
    return StartError(bounded(f"shim: {getattr(e, 'message', type(e).__name__)}"), code="shim_failed")


class RunHandle:
    """One live (or just ended) shim: ``pid`` + ``create_time`` identify it across PID reuse;
    ``pidfd`` becomes readable when it exits (None without pidfds: the loop looks every second).
    The shim is never this process's child (processes.ForkServer)."""

    __slots__ = ("attempt_id", "pid", "create_time", "pidfd", "known", "started_at")

    def __init__(self, attempt_id: str, pid: int, create_time: float, pidfd: int | None) -> None:
        self.attempt_id, self.pid, self.create_time, self.pidfd = attempt_id, pid, create_time, pidfd
        self.known: dict = {}
        self.started_at = create_time

    def close(self) -> None:
        if self.pidfd is not None:
            os.close(self.pidfd)
            self.pidfd = None


class WorkerRuns:
    """Run directories, spawn, re-attach, signal, collect and prune under ``runs_dir``."""

    def __init__(self, runs_dir: str, python: str | None = None) -> None:
        self.runs_dir = runs_dir
        os.makedirs(runs_dir, mode=0o700, exist_ok=True)
        self._python = python or processes.default_python()
        self._forks = processes.ForkServer(self.runs_dir)
        self._baseline = processes.baseline_env()
        self._key = processes.agent_key(runs_dir)

    def run_dir(self, attempt_id: str) -> str:
        return os.path.join(self.runs_dir, attempt_id)

    def artifact(self, attempt_id: str) -> str:
        return os.path.join(self.run_dir(attempt_id), ARTIFACT)

    def exists(self, attempt_id: str) -> bool:
        return os.path.isdir(self.run_dir(attempt_id))

    def make_run_dir(self, attempt_id: str) -> None:
        """The crash-barrier evidence: create the run directory and the empty Artifact, fsync
        both and the parent. Raises StartError(run_dir_unsafe) if it cannot."""
        d = self.run_dir(attempt_id)
        try:
            os.mkdir(d, 0o700)
            os.close(os.open(os.path.join(d, ARTIFACT), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600))
            for path in (d, self.runs_dir):
                fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
        except OSError as e:
            raise StartError(f"run directory {d}: {processes.errno_text(e)}", code="run_dir_unsafe") from None

    def set_lease_deadline(self, attempt_id: str, stop_at_us: int) -> bool:
        """Write ``stop_at_us`` (CLOCK_MONOTONIC µs, ``fencing.stop_at_local_us``) to the run's
        lease file (temp + rename: the shim never reads half a number); False if it could not."""
        path = os.path.join(self.run_dir(attempt_id), LEASE_FILE)
        tmp = path + ".tmp"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
            try:
                os.write(fd, b"%d\n" % stop_at_us)
            finally:
                os.close(fd)
            os.rename(tmp, path)
        except OSError:
            return False
        return True

    def lease_deadline(self, attempt_id: str) -> int | None:
        """The self-fencing instant in the run's lease file (CLOCK_MONOTONIC µs, what
        ``set_lease_deadline`` last wrote), or None when there is none or it cannot be read."""
        try:
            with open(os.path.join(self.run_dir(attempt_id), LEASE_FILE), "rb") as f:
                data = f.read(33)
            return int(data.strip()) if len(data) <= 32 else None
        except (OSError, ValueError):
            return None

    def begin(self, spec: ExecutionSpec, secrets: dict[str, bytes], lease_stop_at_us: int | None = None):
        """Materialise the environment (baseline, spec env, secrets, QL3_* identity) and ask the
        fork server for the shim; returns at once the start in flight (``processes.ShimStart``),
        which ``advance`` takes on each time its ``fd`` is readable (None: in a second). With
        ``lease_stop_at_us`` (µs, CLOCK_MONOTONIC) the lease file is written first and the shim
        self-fences by it. Raises StartError: code ``secret_unusable``, ``run_dir_unsafe`` (lease
        file) or ``shim_failed`` (the spec over its bound, no interpreter, no fork server)."""
        aid = spec.attempt_id
        lease_file = None
        if lease_stop_at_us is not None:
            if not self.set_lease_deadline(aid, lease_stop_at_us):
                raise StartError(f"lease file in {self.run_dir(aid)}: not writable", code="run_dir_unsafe")
            lease_file = os.path.join(self.run_dir(aid), LEASE_FILE)
        try:
            plain = {k: v.decode("utf-8") for k, v in secrets.items()}
        except UnicodeDecodeError:
            raise StartError("a secret value is not UTF-8 text", code="secret_unusable") from None
        identity = {"QL3_RUN_ID": spec.run_id, "QL3_ATTEMPT_ID": aid, "QL3_PROJECT_ID": spec.project_id,
                    "QL3_TASK_ID": spec.task_id, "QL3_TASK_NAME": spec.task_name,
                    "QL3_TASK_REVISION": str(spec.task_revision), processes.AGENT_KEY_ENV: self._key}
        env = {**self._baseline, **spec.env, **plain, **identity}
        argv = list(spec.argv) if spec.kind == "local_process" else [spec.shell, "-c", spec.script]
        doc = {"attempt_id": aid, "argv": argv, "env": env, "cwd": spec.cwd or env.get("HOME") or "/",
               "run_dir": self.run_dir(aid), "artifact_path": self.artifact(aid), "quota_bytes": spec.log_quota_bytes,
               "linger_s": LINGER_S, "umask": int(spec.umask, 8) if spec.umask else None,
               "grace_s": spec.grace_ms / 1000, "keep_orphans": spec.keep_orphans, "lease_file": lease_file}
        try:
            return self._forks.begin(doc, self._python)
        except Exception as e:       # spec over its bound, no interpreter: never the spec in the text
            raise _shim_failed(e) from None
        finally:
            doc = env = plain = None                                   # noqa: F841  (one materialisation)

    def advance(self, attempt_id: str, start, expired: bool = False) -> RunHandle | None:
        """Take in what the shim of ``begin`` reported (never waits): None while the start goes
        on, else the live shim's handle once its task was exec'd (its identity is then in
        ``shim.json`` for a re-attach). ``expired`` (the caller's bound passed) ends it as
        ``processes.ForkServer.advance`` does. Raises StartError: ``shim_failed`` (no shim was
        forked), or code ``start`` with the shim's start error as the message (paths and errno
        names only), once that shim has exited."""
        try:
            h = self._forks.advance(start, expired)
        except QlError as e:         # the fork server forked no shim
            raise _shim_failed(e) from None
        if h is None:
            return None
        if h.start_error is not None:
            if h.pidfd is not None:
                os.close(h.pidfd)
            raise StartError(bounded(h.start_error), code="start")
        with open(os.path.join(self.run_dir(attempt_id), SHIM_FILE), "w") as f:
            json.dump({"pid": h.pid, "create_time": h.create_time}, f)
        return RunHandle(attempt_id, h.pid, h.create_time, h.pidfd)

    def reattach(self, attempt_id: str) -> RunHandle | None:
        """The shim of a previous Worker process, if it is still the same live process."""
        try:
            with open(os.path.join(self.run_dir(attempt_id), SHIM_FILE)) as f:
                doc = json.load(f)
            pid, ctime = int(doc["pid"]), float(doc["create_time"])
        except (OSError, ValueError, KeyError, TypeError):
            return None
        if not processes.process_matches(pid, ctime):
            return None
        try:
            fd = os.pidfd_open(pid)
        except (AttributeError, OSError):
            fd = None
        return RunHandle(attempt_id, pid, ctime, fd)

    def alive(self, h: RunHandle) -> bool:
        return processes.process_matches(h.pid, h.create_time)

    def signal(self, h: RunHandle, sig: int) -> int:
        """Signal the task's process group and every descendant of the shim (never the shim)."""
        try:
            pgid = processes.read_task_pid(self.run_dir(h.attempt_id))
        except RunFileError:
            pgid = None
        if not self.alive(h):
            h.known.update(processes.find_by_attempt(h.attempt_id))
        return len(processes.signal_tree(pgid, h.pid if self.alive(h) else None, sig, h.started_at, h.known))

    def finished(self, h: RunHandle) -> None:
        """Release the shim's pidfd; reap a fork server that has left."""
        self._forks.reap()
        h.close()

    def collect(self, attempt_id: str) -> tuple[Receipt | None, TruncationFact | None]:
        """(receipt, truncation fact), None for each that is missing or unreadable."""
        d = self.run_dir(attempt_id)
        try:
            return processes.read_receipt(d), processes.read_truncation(d)
        except RunFileError:
            return None, None

    def has_receipt(self, attempt_id: str) -> bool:
        return self.collect(attempt_id)[0] is not None

    def kill_orphans(self, attempt_id: str) -> None:
        """SIGKILL whatever of a run is left when its shim is gone (found by QL3_ATTEMPT_ID)."""
        processes.signal_tree(None, None, signal.SIGKILL, None, processes.find_by_attempt(attempt_id))

    def stop_strays(self, known: set[str], seen: set[str] | None = None) -> dict[str, int]:
        """SIGKILL this Worker's tasks (its QL3_AGENT_KEY) of Attempts not in ``known``, even
        after its state directory was wiped; {attempt ID: processes killed}. ``seen`` gets the
        attempt ID of every tagged process found, known or not."""
        return processes.stop_strays(self._key, known, seen)

    def log_size(self, attempt_id: str) -> int:
        try:
            return os.stat(self.artifact(attempt_id)).st_size
        except OSError:
            return 0

    def read_log(self, attempt_id: str, offset: int, size: int) -> bytes:
        try:
            with open(self.artifact(attempt_id), "rb") as f:
                f.seek(offset)
                return f.read(size)
        except OSError:
            return b""

    def truncate_log(self, attempt_id: str, size: int) -> int:
        """Cut the Artifact to ``size`` bytes (the local store cap); returns the bytes freed."""
        before = self.log_size(attempt_id)
        if before <= size:
            return 0
        try:
            os.truncate(self.artifact(attempt_id), size)
        except OSError:
            return 0
        return before - size

    def prune(self, attempt_id: str) -> None:
        processes.remove_run_dir(self.run_dir(attempt_id))


def log_store_usage(runs_dir: str) -> tuple[int, int]:
    """(run directories, bytes of their logs) under ``runs_dir``, read only (``qlagent doctor``:
    what counts against ``worker.log_store_bytes``); (0, 0) when it does not exist yet."""
    try:
        names = os.listdir(runs_dir)
    except FileNotFoundError:
        return 0, 0
    total = 0
    for name in names:
        try:
            total += os.stat(os.path.join(runs_dir, name, ARTIFACT), follow_symlinks=False).st_size
        except OSError:
            pass
    return len(names), total
