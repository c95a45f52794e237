"""Helpers shared by the shim and process-tree tests and the shim benches: the router-task
scripts, a minimal task environment, a shim spec on real files, ``spawn_shim``: the shim
program started alone by its own interpreter, without the agent's fork server, ``fork_served``:
a start through a ``ForkServer`` waited for to its end, and ``compiled_shim``: the fork server's
compiled program written before any start."""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time
import uuid

import psutil

from qlagent.adapters import processes
from qlagent.adapters.processes import (SHIM_PATH, SPEC_LIMIT_BYTES, START_STATUS_TIMEOUT_S, ForkServer, ShimHandle,
                                        ShimSpawnError, errno_text)
from qlagent.core.errors import ValidationError

_STATUS_LIMIT_BYTES = 1024   # the shim's status line (processes)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURES = os.path.join(REPO, "examples", "router-tasks")
EDGE_LOG = 4194304
PATH_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin"}


def make_spec(tmp_path, argv, env=None, quota=EDGE_LOG, linger=0.5, cwd="/"):
    """A shim spec with a fresh 0700 run directory and an empty 0600 Artifact under tmp_path."""
    attempt_id = str(uuid.uuid4())
    run_dir = tmp_path / "runs" / attempt_id
    run_dir.mkdir(parents=True, mode=0o700)
    artifact = tmp_path / (attempt_id + ".log")
    os.close(os.open(artifact, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    return {"attempt_id": attempt_id, "argv": argv, "env": PATH_ENV if env is None else env,
            "cwd": cwd, "run_dir": str(run_dir), "artifact_path": str(artifact),
            "quota_bytes": quota, "linger_s": linger}


def _read_status(popen: subprocess.Popen, timeout_s: float) -> str | None:
    """The shim's start status line (see shim/main.py): None for ``ok`` or no answer
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


class SpawnedShim(ShimHandle):
    """A shim started by ``spawn_shim``: this process's child, reaped through ``popen``."""

    popen: subprocess.Popen | None = None


def spawn_shim(spec: dict, python: str = sys.executable,
                  status_timeout_s: float = START_STATUS_TIMEOUT_S, program: str = SHIM_PATH) -> SpawnedShim:
    """Start ``python -I -S <program>`` (shim/main.py, or its ``compiled_shim``) in a new session
    with an empty environment, cwd "/", stderr /dev/null, and send ``spec`` (the shim
    contract's JSON document, which may hold secret plaintext) through its stdin pipe, then
    close the pipe; then wait (at most
    ``status_timeout_s`` seconds) for its start status on stdout, so the caller learns whether
    the task was exec'd before it records the Run running (``ShimHandle.start_error``).

    Raises ValidationError (field spec) for a spec over SPEC_LIMIT_BYTES, before anything starts;
    ShimSpawnError when the interpreter cannot be started or exits before reading the spec.
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
        raise ShimSpawnError(f"python {python}: cannot start the shim: {errno_text(exc)}",
                                field="python") from None
    try:
        popen.stdin.write(payload)
        popen.stdin.close()
    except BrokenPipeError:
        popen.stdout.close()
        popen.wait()
        raise ShimSpawnError("shim: exited before reading its spec") from None
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
    return SpawnedShim(popen.pid, create_time, pidfd, start_error, popen=popen)


def fork_served(fs: ForkServer, spec: dict, python: str = sys.executable,
                status_timeout_s: float | None = None) -> ShimHandle:
    """``fs.begin`` and ``fs.advance`` until the start is over, waiting on the start's fd (at
    most ``status_timeout_s`` seconds, None: START_STATUS_TIMEOUT_S, then ``advance`` with
    ``expired``): the agent's loop reduced to one start. Returns and raises as those two do;
    with a start_error it returns once the shim has exited or was killed."""
    st = fs.begin(spec, python, status_timeout_s)
    deadline = time.monotonic() + st.bound_s
    while True:
        left = deadline - time.monotonic()
        h = fs.advance(st, expired=left <= 0)
        if h is not None:
            return h
        select.select([st.fd] if st.fd is not None else [], [], [], min(max(left, 0), 0.05 if st.fd is None else left))


def compiled_shim(cache_dir: str, python: str = sys.executable) -> str:
    """The program a new ``ForkServer(cache_dir)`` of ``python`` runs, compiled now and waited
    for (at most 30 s) instead of by the fork server's own compile: the path of the compiled
    shim (processes._compiled_path), or SHIM_PATH when it cannot be had or a file there is not
    ours alone (never run, never replaced)."""
    path = processes._compiled_path(cache_dir, python)
    ready = processes._ready_program(path)
    if ready is not None:
        return ready
    tmp = f"{path}.tmp.{os.getpid()}"
    popen = processes._start_compile(python, tmp)
    try:
        popen.wait(30)
    except subprocess.TimeoutExpired:
        popen.kill()
        popen.wait()
    return path if processes._end_compile(popen, tmp, path) else SHIM_PATH
