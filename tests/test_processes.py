"""Shim spawning, PID-reuse-safe identity and killing whole run trees with real processes
(issue 3 items 5-6; field report F2; fixtures hang.sh and spawn-tree.sh)."""

import json
import os
import signal
import subprocess
import time

import psutil
import pytest

from qlagent.adapters import processes

from shimkit import FIXTURES, fork_served, make_spec, spawn_shim  # noqa: E402
from kit import wait_until  # noqa: E402


def start(tmp_path, argv, linger=0.5):
    spec = make_spec(tmp_path, argv, quota=1 << 20, linger=linger)
    return spec, spawn_shim(spec)


def output(spec):
    with open(spec["artifact_path"], "rb") as f:
        return f.read()


def run_sleeps(shim_pid, args):
    """The `sleep N` processes below this run's shim (other runs on the machine ignored)."""
    try:
        kids = psutil.Process(shim_pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    found = []
    for p in kids:
        try:
            if p.cmdline() in [["sleep", a] for a in args]:
                found.append(p)
        except psutil.NoSuchProcess:
            continue
    return found


def reap_leftovers(procs):
    """After a failed assertion: do not leave the run's sleeps behind on the machine."""
    for p in alive(procs):
        p.kill()


def alive(procs):
    out = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.NoSuchProcess:
            continue
    return out


def stop(task, shim_pid, grace_s):
    """What the coordinator does on a timeout: SIGTERM to the run's tree, SIGKILL to whatever the
    earlier step saw (and the tree now) after ``grace_s``; returns the PIDs of each step."""
    known: dict = {}
    termed = processes.signal_tree(task, shim_pid, signal.SIGTERM, None, known)
    time.sleep(grace_s)
    return termed, processes.signal_tree(task, shim_pid, signal.SIGKILL, None, known)


def test_hang_is_killed_after_the_grace(tmp_path):
    spec, handle = start(tmp_path, ["/bin/sh", os.path.join(FIXTURES, "hang.sh")])
    wait_until(lambda: output(spec) == b"hanging\n", 20, "hanging")
    task = processes.read_task_pid(spec["run_dir"])
    termed, killed = stop(task, handle.pid, 0.5)
    assert task in termed and task in killed        # hang.sh ignores SIGTERM
    assert handle.popen.wait(10) == 0
    assert processes.read_receipt(spec["run_dir"]).signal == signal.SIGKILL


def test_spawn_tree_leaves_no_process_of_the_run_alive(tmp_path):
    spec, handle = start(tmp_path, ["/bin/sh", os.path.join(FIXTURES, "spawn-tree.sh")])
    wait_until(lambda: output(spec) == b"spawned\n", 20, "spawned")
    sleeps = wait_until(lambda: (lambda f: f if len(f) == 3 else None)(
        run_sleeps(handle.pid, ("300", "301", "302"))), 20, "three sleeps")
    escaped = [p for p in sleeps if p.cmdline() == ["sleep", "301"]][0]
    task = processes.read_task_pid(spec["run_dir"])
    assert os.getpgid(escaped.pid) != task  # setsid took it out of the task's group
    try:
        termed = processes.signal_tree(task, handle.pid, signal.SIGTERM, None, {})
        assert escaped.pid in termed and handle.pid not in termed      # never the shim itself
        wait_until(lambda: alive(sleeps) == [], 20, "the run's processes gone")
    finally:
        reap_leftovers(sleeps)
    assert handle.popen.wait(10) == 0
    assert processes.read_receipt(spec["run_dir"]).signal == signal.SIGTERM


def test_signal_tree_spares_processes_outside_the_run(tmp_path):
    spec, handle = start(tmp_path, ["/bin/sh", "-c", "exit 0"])
    assert handle.popen.wait(10) == 0
    task = processes.read_task_pid(spec["run_dir"])
    stranger = subprocess.Popen(["sleep", "30"], start_new_session=True)
    try:
        # A stranger leading a group whose number is handed in (PID reuse): not signalled
        # because it is not in the (gone) shim's tree and started before the run claims.
        assert processes.signal_tree(stranger.pid, handle.pid, signal.SIGTERM, time.time() + 1, {}) == []
        assert processes.signal_tree(task, handle.pid, signal.SIGTERM, None, {}) == []
        assert stranger.poll() is None
    finally:
        stranger.kill()
        stranger.wait()


def test_process_matches_is_pid_reuse_safe(tmp_path):
    go = tmp_path / "go"
    spec, handle = start(tmp_path, ["/bin/sh", "-c", f"while [ ! -e {go} ]; do sleep 0.02; done"])
    assert processes.process_matches(handle.pid, handle.create_time)
    assert not processes.process_matches(handle.pid, handle.create_time - 5)
    go.touch()
    # Exited but not yet reaped (zombie) already counts as gone.
    wait_until(lambda: processes.read_receipt(spec["run_dir"]), 20, "receipt")
    wait_until(lambda: not processes.process_matches(handle.pid, handle.create_time), 20, "exit")
    assert handle.popen.wait(10) == 0
    assert not processes.process_matches(handle.pid, handle.create_time)
    assert not processes.process_matches(2 ** 22 + 1, handle.create_time)


def test_pidfd_becomes_readable_when_the_shim_exits(tmp_path):
    import select
    spec, handle = start(tmp_path, ["/bin/true"])
    assert handle.pidfd is not None
    assert select.select([handle.pidfd], [], [], 10)[0] == [handle.pidfd]
    assert handle.popen.wait(10) == 0
    os.close(handle.pidfd)


def test_signal_tree_without_task_pid_takes_the_shims_child(tmp_path):
    spec, handle = start(tmp_path, ["/bin/sh", "-c", "sleep 30 & sleep 30 & echo up; wait"])
    wait_until(lambda: len(psutil.Process(handle.pid).children(recursive=True)) == 3, 20, "three processes")
    # Without task.pid (None) the shim's first child is taken as the task.
    assert len(processes.signal_tree(None, handle.pid, signal.SIGTERM, None, {})) == 3
    assert handle.popen.wait(10) == 0


def test_a_start_with_a_missing_interpreter_fails_naming_it(tmp_path):
    with pytest.raises(processes.ShimSpawnError, match=r"no-python: cannot start the shim: ENOENT ") as err:
        fork_served(processes.ForkServer(str(tmp_path)), {"attempt_id": "x"}, python=str(tmp_path / "no-python"))
    assert err.value.code == "launch_failed" and err.value.exit_code == 5


def test_readers_return_none_before_and_name_the_field_when_malformed(tmp_path):
    run_dir = tmp_path
    assert processes.read_receipt(str(run_dir)) is None
    assert processes.read_truncation(str(run_dir)) is None
    assert processes.read_task_pid(str(run_dir)) is None
    (run_dir / "receipt.json").write_text(json.dumps({"attempt_id": "a", "exit_code": 0}))
    with pytest.raises(processes.RunFileError, match="receipt.json.signal: missing"):
        processes.read_receipt(str(run_dir))
    (run_dir / "truncated.json").write_text('{"quota_bytes": 5, "bytes_kept": "five"}')
    with pytest.raises(processes.RunFileError, match="truncated.json.bytes_kept"):
        processes.read_truncation(str(run_dir))
    (run_dir / "task.pid").write_text("1")
    with pytest.raises(processes.RunFileError, match="task.pid"):
        processes.read_task_pid(str(run_dir))
