"""Wrapper spawning, PID-reuse-safe identity and killing whole run trees with real processes
(issue 3 items 5-6; field report F2; fixtures hang.sh and spawn-tree.sh)."""

import json
import os
import signal
import subprocess
import time

import psutil
import pytest

from qlagent.adapters import processes
from qlagent.core.errors import ValidationError

from wrapkit import FIXTURES, make_spec, wait_for  # noqa: E402


def start(tmp_path, argv, linger=0.5):
    spec = make_spec(tmp_path, argv, quota=1 << 20, linger=linger)
    return spec, processes.spawn_wrapper(spec)


def output(spec):
    with open(spec["artifact_path"], "rb") as f:
        return f.read()


def run_sleeps(wrapper_pid, args):
    """The `sleep N` processes below this run's wrapper (other runs on the machine ignored)."""
    try:
        kids = psutil.Process(wrapper_pid).children(recursive=True)
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


def test_hang_is_killed_within_grace_plus_one_second(tmp_path):
    spec, handle = start(tmp_path, ["/bin/sh", os.path.join(FIXTURES, "hang.sh")])
    wait_for(lambda: output(spec) == b"hanging\n", what="hanging")
    task = processes.read_task_pid(spec["run_dir"])
    grace = 0.5
    began = time.monotonic()
    report = processes.kill_tree(task, handle.pid, grace)
    assert time.monotonic() - began < grace + 1.0
    assert report.survivors == [] and task in report.terminated and task in report.killed, report
    assert handle.popen.wait(10) == 0
    assert processes.read_receipt(spec["run_dir"])["signal"] == signal.SIGKILL


def test_spawn_tree_leaves_no_process_of_the_run_alive(tmp_path):
    spec, handle = start(tmp_path, ["/bin/sh", os.path.join(FIXTURES, "spawn-tree.sh")])
    wait_for(lambda: output(spec) == b"spawned\n", what="spawned")
    sleeps = wait_for(lambda: (lambda f: f if len(f) == 3 else None)(
        run_sleeps(handle.pid, ("300", "301", "302"))), what="three sleeps")
    escaped = [p for p in sleeps if p.cmdline() == ["sleep", "301"]][0]
    task = processes.read_task_pid(spec["run_dir"])
    assert os.getpgid(escaped.pid) != task  # setsid took it out of the task's group
    try:
        report = processes.kill_tree(task, handle.pid, grace_s=1.0)
        assert report.survivors == []
        assert escaped.pid in report.terminated
        assert alive(sleeps) == []
    finally:
        reap_leftovers(sleeps)
    assert handle.popen.wait(10) == 0
    assert processes.read_receipt(spec["run_dir"])["signal"] == signal.SIGTERM


def test_f2_cancel_kills_setsid_grandchild_and_returns_within_grace_plus_one(tmp_path):
    spec, handle = start(tmp_path, ["/bin/sh", "-c",
                                    "sleep 310 & setsid sleep 311 & echo up; sleep 312; wait"])
    sleeps = wait_for(lambda: (lambda f: f if len(f) == 3 else None)(
        run_sleeps(handle.pid, ("310", "311", "312"))), what="three sleeps")
    # The setsid grandchild's parent dies from SIGTERM first; the snapshot must still reach it.
    began = time.monotonic()
    try:
        report = processes.kill_tree(processes.read_task_pid(spec["run_dir"]), handle.pid, grace_s=0.5)
        assert time.monotonic() - began < 1.5
        assert report.survivors == [] and alive(sleeps) == []
    finally:
        reap_leftovers(sleeps)
    assert handle.popen.wait(10) == 0  # the wrapper itself was spared and wrote its receipt
    assert processes.read_receipt(spec["run_dir"]) is not None


def test_kill_tree_spares_processes_outside_the_run(tmp_path):
    spec, handle = start(tmp_path, ["/bin/sh", "-c", "exit 0"])
    assert handle.popen.wait(10) == 0
    task = processes.read_task_pid(spec["run_dir"])
    stranger = subprocess.Popen(["sleep", "30"], start_new_session=True)
    try:
        # A stranger leading a group whose number is handed in (PID reuse): not signalled
        # because it is not in the (gone) wrapper's tree and started before the run claims.
        report = processes.kill_tree(stranger.pid, handle.pid, 0.2, started_after=time.time() + 1)
        assert report.terminated == [] and stranger.poll() is None
        report = processes.kill_tree(task, handle.pid, 0.2)
        assert report.terminated == [] and stranger.poll() is None
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
    wait_for(lambda: processes.read_receipt(spec["run_dir"]), what="receipt")
    wait_for(lambda: not processes.process_matches(handle.pid, handle.create_time), what="exit")
    assert handle.popen.wait(10) == 0
    assert not processes.process_matches(handle.pid, handle.create_time)
    assert not processes.process_matches(2 ** 22 + 1, handle.create_time)


def test_pidfd_becomes_readable_when_the_wrapper_exits(tmp_path):
    import select
    spec, handle = start(tmp_path, ["/bin/true"])
    assert handle.pidfd is not None
    assert select.select([handle.pidfd], [], [], 10)[0] == [handle.pidfd]
    assert handle.popen.wait(10) == 0
    handle.close()
    assert handle.pidfd is None


def test_kill_tree_without_task_pid_takes_the_wrappers_child(tmp_path):
    spec, handle = start(tmp_path, ["/bin/sh", "-c", "sleep 30 & sleep 30 & echo up; wait"])
    wait_for(lambda: len(psutil.Process(handle.pid).children(recursive=True)) == 3, what="three processes")
    # Without task.pid (None) the wrapper's only child is taken as the task.
    report = processes.kill_tree(None, handle.pid, 0.5)
    assert report.survivors == [] and len(report.terminated) == 3
    assert handle.popen.wait(10) == 0


def test_spawn_wrapper_with_a_missing_interpreter_raises(tmp_path):
    with pytest.raises(processes.WrapperSpawnError, match=r"no-python: cannot start the shim: ENOENT ") as err:
        processes.spawn_wrapper({"attempt_id": "x"}, python=str(tmp_path / "no-python"))
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
    with pytest.raises(ValidationError, match="task_pgid/wrapper_pid"):
        processes.kill_tree(1, 12345, 0.1)
