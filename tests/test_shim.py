"""The shim shim with real processes, a real FIFO and real files (issue 3 item 4;
field reports F1, F9; fixtures in examples/router-tasks)."""

import json
import os
import signal
import stat
import subprocess
import sys
import time
import uuid

import psutil
import pytest

from qlagent.adapters import processes
from qlagent.core.errors import ValidationError
from qlagent.core.limits import MAX_TIMEOUT_S
from qlagent.core.receipt import Receipt, TruncationFact

from shimkit import EDGE_LOG, FIXTURES, PATH_ENV, REPO, fork_served, make_spec, spawn_shim  # noqa: E402
from kit import wait_until  # noqa: E402


def run_to_end(spec, timeout=30.0):
    handle = spawn_shim(spec)
    try:
        assert handle.popen.wait(timeout) == 0
    finally:
        if handle.pidfd is not None:
            os.close(handle.pidfd)
    receipt = processes.read_receipt(spec["run_dir"])
    assert receipt is not None
    return receipt


def log_bytes(spec):
    with open(spec["artifact_path"], "rb") as f:
        return f.read()


def fixture(name):
    return ["/bin/sh", os.path.join(FIXTURES, name)]


def assert_clean_end(spec):
    assert not os.path.exists(os.path.join(spec["run_dir"], "output.fifo"))
    assert not any(n.endswith(".tmp") or ".tmp." in n for n in os.listdir(spec["run_dir"]))


def test_heartbeat_exits_zero_with_small_log_and_full_receipt(tmp_path):
    spec = make_spec(tmp_path, fixture("heartbeat.sh"))
    receipt = run_to_end(spec)
    with open(os.path.join(spec["run_dir"], "receipt.json"), "rb") as f:
        assert set(json.load(f)) == set(Receipt.__struct_fields__)     # the shim writes every field
    assert receipt.exit_code == 0 and receipt.signal is None and receipt.start_error is None
    out = log_bytes(spec)
    assert out.startswith(b"heartbeat ") and b"load=" in out
    assert receipt.bytes_total == receipt.bytes_kept == len(out) and receipt.bytes_dropped == 0
    assert receipt.started_at_us <= receipt.ended_at_us
    assert receipt.peak_rss_bytes > 0 and receipt.cpu_time_us >= 0
    assert processes.read_truncation(spec["run_dir"]) is None
    assert stat.S_IMODE(os.stat(os.path.join(spec["run_dir"], "receipt.json")).st_mode) == 0o600
    assert_clean_end(spec)


def test_chatty_on_edge_stops_exactly_at_quota_with_one_truncation_fact(tmp_path):
    spec = make_spec(tmp_path, fixture("chatty.sh"))
    receipt = run_to_end(spec, timeout=60)
    assert receipt.exit_code == 0 and receipt.signal is None
    assert os.path.getsize(spec["artifact_path"]) == EDGE_LOG
    assert receipt.bytes_kept == EDGE_LOG
    assert receipt.bytes_total > 9_000_000  # every byte was drained, none blocked the task
    assert receipt.bytes_dropped == receipt.bytes_total - EDGE_LOG
    assert processes.read_truncation(spec["run_dir"]) == TruncationFact(quota_bytes=EDGE_LOG, bytes_kept=EDGE_LOG)
    facts = [n for n in os.listdir(spec["run_dir"]) if n.startswith("truncated")]
    assert facts == ["truncated.json"]
    with open(os.path.join(spec["run_dir"], "truncated.json"), "rb") as f:
        fact = json.loads(f.read())     # counts and the reason, no content
        assert set(fact) == {"quota_bytes", "bytes_kept", "reason"} and fact["reason"] == "quota"
    out = log_bytes(spec)
    assert out.startswith(b"line 0 0123456789abcdefghijklmnopqrstuvwxyz\n")
    assert b"progress 0\n" in out  # stderr shares the artifact
    assert_clean_end(spec)


def test_no_newline_megabyte_is_captured_byte_exact(tmp_path):
    spec = make_spec(tmp_path, fixture("no-newline.sh"))
    receipt = run_to_end(spec)
    assert receipt.exit_code == 0
    assert log_bytes(spec) == b"x" * 1048576
    assert processes.read_truncation(spec["run_dir"]) is None


def test_f9_long_line_is_byte_exact_up_to_a_smaller_quota(tmp_path):
    spec = make_spec(tmp_path, ["/bin/sh", "-c", "head -c 1048576 /dev/zero | tr '\\0' x; echo"],
                     quota=1000)
    receipt = run_to_end(spec)
    assert receipt.exit_code == 0
    assert log_bytes(spec) == b"x" * 1000
    assert receipt.bytes_total == 1048577 and receipt.bytes_dropped == 1048577 - 1000
    assert processes.read_truncation(spec["run_dir"]) == TruncationFact(quota_bytes=1000, bytes_kept=1000)


def test_fail_exit_code_three_is_recorded(tmp_path):
    spec = make_spec(tmp_path, fixture("fail.sh"))
    receipt = run_to_end(spec)
    assert receipt.exit_code == 3 and receipt.signal is None
    assert log_bytes(spec) == b"about to fail\n"


def test_backup_config_writes_into_backup_dir(tmp_path):
    config = tmp_path / "config"
    config.mkdir()
    (config / "network").write_text("option proto dhcp\n")
    backups = tmp_path / "backups"
    spec = make_spec(tmp_path, fixture("backup-config.sh"),
                     env={**PATH_ENV, "CONFIG_DIR": str(config), "BACKUP_DIR": str(backups)})
    receipt = run_to_end(spec)
    assert receipt.exit_code == 0, log_bytes(spec)
    archives = os.listdir(backups)
    assert len(archives) == 1 and archives[0].endswith(".tar.gz")
    assert log_bytes(spec).startswith(b"wrote " + str(backups).encode())


def test_ddns_update_sees_the_secret_but_the_log_holds_only_its_length(tmp_path):
    token = "s3cr3t-" + uuid.uuid4().hex
    spec = make_spec(tmp_path, fixture("ddns-update.sh"),
                     env={**PATH_ENV, "DDNS_TOKEN": token, "DDNS_HOST": "home.example"})
    receipt = run_to_end(spec)
    assert receipt.exit_code == 0
    out = log_bytes(spec)
    assert out == f"ddns: token present ({len(token)} chars), host=home.example\n".encode()
    for name in os.listdir(spec["run_dir"]):
        with open(os.path.join(spec["run_dir"], name), "rb") as f:
            assert token.encode() not in f.read()


def test_ddns_update_without_the_secret_fails(tmp_path):
    spec = make_spec(tmp_path, fixture("ddns-update.sh"))
    receipt = run_to_end(spec)
    assert receipt.exit_code != 0
    assert b"DDNS_TOKEN secret missing" in log_bytes(spec)


def test_wan_check_prints_json(tmp_path):
    spec = make_spec(tmp_path, [sys.executable, os.path.join(FIXTURES, "wan-check.py")])
    receipt = run_to_end(spec)
    assert receipt.exit_code == 0
    assert "default_route" in json.loads(log_bytes(spec))


def test_slow_is_running_until_stopped(tmp_path):
    spec = make_spec(tmp_path, fixture("slow.sh"))
    handle = spawn_shim(spec)
    wait_until(lambda: log_bytes(spec) == b"slow start\n", 20, "slow start")
    task = processes.read_task_pid(spec["run_dir"])
    assert task in processes.signal_tree(task, handle.pid, signal.SIGTERM, None, {})
    assert handle.popen.wait(10) == 0
    receipt = processes.read_receipt(spec["run_dir"])
    assert receipt.signal == signal.SIGTERM and receipt.exit_code is None
    assert log_bytes(spec) == b"slow start\n"


def test_f1_yes_fills_exactly_the_quota_then_is_killed(tmp_path):
    quota = 65536 * 3 + 17  # not a multiple of the read size
    spec = make_spec(tmp_path, ["/usr/bin/yes", "0123456789abcdef"], quota=quota)
    handle = spawn_shim(spec)
    fact = wait_until(lambda: processes.read_truncation(spec["run_dir"]), 20, "truncation fact")
    assert fact == TruncationFact(quota_bytes=quota, bytes_kept=quota)
    # The task is not blocked by the quota: output keeps being drained.
    assert psutil.Process(processes.read_task_pid(spec["run_dir"])).status() != psutil.STATUS_STOPPED
    processes.signal_tree(processes.read_task_pid(spec["run_dir"]), handle.pid, signal.SIGTERM, None, {})
    assert handle.popen.wait(10) == 0
    receipt = processes.read_receipt(spec["run_dir"])
    assert receipt.signal == signal.SIGTERM
    assert receipt.bytes_kept == quota and receipt.bytes_total > quota
    out = log_bytes(spec)
    assert len(out) == quota
    assert out == (b"0123456789abcdef\n" * (quota // 17 + 1))[:quota]


def test_shim_outlives_its_spawner_and_reports_the_real_exit_status(tmp_path):
    go = tmp_path / "go"
    script = f"while [ ! -e {go} ]; do sleep 0.02; done; head -c 3000000 /dev/zero; exit 7"
    spec = make_spec(tmp_path, ["/bin/sh", "-c", script], quota=1048576)
    spawner = subprocess.Popen(
        [sys.executable, "-c",
         "import json, sys, time\n"
         f"sys.path[:0] = [{REPO!r}, {os.path.join(REPO, 'tests')!r}]\n"
         "from shimkit import spawn_shim\n"
         "h = spawn_shim(json.loads(sys.stdin.readline()))\n"
         "print(h.pid, flush=True)\n"
         "time.sleep(60)\n"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    spawner.stdin.write(json.dumps(spec) + "\n")
    spawner.stdin.flush()
    shim_pid = int(spawner.stdout.readline())
    task_pid = wait_until(lambda: processes.read_task_pid(spec["run_dir"]), 20, "task.pid")
    spawner.kill()
    spawner.wait()
    assert psutil.pid_exists(shim_pid) and psutil.Process(task_pid).status() != psutil.STATUS_ZOMBIE
    assert os.path.getsize(spec["artifact_path"]) == 0
    go.touch()
    receipt = wait_until(lambda: processes.read_receipt(spec["run_dir"]), 20, "receipt")
    assert receipt.exit_code == 7
    assert os.path.getsize(spec["artifact_path"]) == 1048576
    assert processes.read_truncation(spec["run_dir"]) == TruncationFact(quota_bytes=1048576, bytes_kept=1048576)
    # The FIFO goes right after the receipt (until then the run directory is never empty).
    wait_until(lambda: not psutil.pid_exists(shim_pid) or psutil.Process(shim_pid).status() == psutil.STATUS_ZOMBIE,
               20, "the shim's exit")
    assert_clean_end(spec)


def test_a_kept_orphan_holding_the_fifo_does_not_keep_the_shim_past_linger(tmp_path):
    spec = make_spec(tmp_path, ["/bin/sh", "-c", "sleep 30 & echo main; exit 5"], linger=0.3)
    spec["keep_orphans"] = True
    handle = spawn_shim(spec)
    task = wait_until(lambda: processes.read_task_pid(spec["run_dir"]), 20, "task.pid")
    fifo = os.path.join(spec["run_dir"], "output.fifo")
    st = os.stat(fifo)
    assert stat.S_ISFIFO(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600
    try:
        assert handle.popen.wait(10) == 0  # long before the orphan's 30 s
        receipt = processes.read_receipt(spec["run_dir"])
        assert receipt.exit_code == 5 and receipt.orphans_stopped is None
        assert log_bytes(spec) == b"main\n"
        with open(os.path.join(spec["run_dir"], "shim.err")) as f:
            assert "stopped draining" in f.read()
        assert_clean_end(spec)
    finally:
        orphans = [p for p in psutil.process_iter(["cmdline"])
                   if p.info["cmdline"] == ["sleep", "30"] and os.getpgid(p.pid) == task]
        assert orphans, "the orphan should still be alive"
        for p in orphans:
            p.kill()


def test_missing_executable_gives_start_error_and_no_task(tmp_path):
    for argv0 in ("/nonexistent/prog", "no-such-command-here"):
        spec = make_spec(tmp_path, [argv0, "x"])
        receipt = run_to_end(spec)
        assert receipt.exit_code is None and receipt.signal is None
        assert receipt.start_error.startswith("exec " + argv0)
        assert processes.read_task_pid(spec["run_dir"]) is None
        assert_clean_end(spec)


def test_task_environment_is_exactly_the_given_one(tmp_path, monkeypatch):
    monkeypatch.setenv("NOTIFY_SOCKET", "/run/systemd/notify")
    monkeypatch.setenv("WATCHDOG_USEC", "1000000")
    spec = make_spec(tmp_path, ["/usr/bin/env"], env={"A": "1", "B": "two words"})
    receipt = run_to_end(spec)
    assert receipt.exit_code == 0
    assert log_bytes(spec) == b"A=1\nB=two words\n"


def test_task_runs_in_its_own_group_with_null_stdin_in_cwd(tmp_path):
    spec = make_spec(tmp_path, ["/bin/sh", "-c", "cut -d' ' -f5 /proc/$$/stat; pwd; cat; echo $$"],
                     cwd=str(tmp_path))
    handle = spawn_shim(spec)
    assert os.getsid(handle.pid) == handle.pid  # the shim leads its own session
    assert handle.popen.wait(10) == 0
    pgrp, cwd, pid = log_bytes(spec).decode().split("\n")[:3]
    assert pgrp == pid == str(processes.read_task_pid(spec["run_dir"]))
    assert cwd == str(tmp_path)


def test_sigterm_to_the_shim_is_forwarded_and_a_receipt_still_written(tmp_path):
    spec = make_spec(tmp_path, ["/bin/sh", "-c", "echo up; exec sleep 30"])
    handle = spawn_shim(spec)
    wait_until(lambda: log_bytes(spec) == b"up\n", 20, "task output")
    os.kill(handle.pid, signal.SIGTERM)
    assert handle.popen.wait(10) == 0
    assert processes.read_receipt(spec["run_dir"]).signal == signal.SIGTERM


def test_a_task_never_outlives_its_shim_killed_by_sigkill(tmp_path):
    # Issue #20 point 3: the shim SIGKILLed (OOM killer, a Worker's whole tree) must not leave
    # the task running unseen beside the Attempt offered again.
    spec = make_spec(tmp_path, ["/bin/sh", "-c", "echo up; exec sleep 120"])
    handle = spawn_shim(spec)
    wait_until(lambda: log_bytes(spec) == b"up\n", 20, "task output")
    task = psutil.Process(processes.read_task_pid(spec["run_dir"]))
    os.kill(handle.pid, signal.SIGKILL)
    handle.popen.wait(10)
    wait_until(lambda: not task.is_running() or task.status() == psutil.STATUS_ZOMBIE, timeout=5.0,
               what="the task to die with its shim")


def test_sigint_sighup_sigpipe_to_the_shim_are_ignored(tmp_path):
    go = tmp_path / "go"
    spec = make_spec(tmp_path, ["/bin/sh", "-c", f"while [ ! -e {go} ]; do sleep 0.02; done; echo done"])
    handle = spawn_shim(spec)
    wait_until(lambda: processes.read_task_pid(spec["run_dir"]), 20, "task.pid")
    shim = psutil.Process(handle.pid)
    assert shim.environ() == {} and shim.cwd() == "/"  # nothing of the agent's leaks in
    for sig in (signal.SIGINT, signal.SIGHUP, signal.SIGPIPE):
        os.kill(handle.pid, sig)
    go.touch()
    assert handle.popen.wait(10) == 0
    receipt = processes.read_receipt(spec["run_dir"])
    assert receipt.exit_code == 0 and log_bytes(spec) == b"done\n"


def test_bad_spec_field_is_named_in_the_receipt_and_nothing_runs(tmp_path):
    spec = make_spec(tmp_path, ["/bin/sh", "-c", "echo ran"])
    spec["quota_bytes"] = -1
    receipt = run_to_end(spec)
    assert receipt.start_error == "bad spec: quota_bytes: must be an integer >= 0"
    assert log_bytes(spec) == b"" and processes.read_task_pid(spec["run_dir"]) is None


def test_symlinked_artifact_is_not_followed(tmp_path):
    spec = make_spec(tmp_path, ["/bin/sh", "-c", "echo secret-output"])
    target = tmp_path / "elsewhere"
    target.write_bytes(b"")
    os.unlink(spec["artifact_path"])
    os.symlink(target, spec["artifact_path"])
    receipt = run_to_end(spec)
    assert receipt.start_error == f"artifact_path {spec['artifact_path']}: ELOOP (Too many levels of symbolic links)"
    assert target.read_bytes() == b""


@pytest.mark.parametrize("payload", [b"", b"not json", b'{"attempt_id": "a"} trailing', b"[1]",
                                     b'{"attempt_id": "a", "run_dir": "relative"}'])
def test_unusable_spec_exits_two_and_writes_nothing(tmp_path, payload):
    proc = subprocess.run([sys.executable, "-I", "-S", processes.SHIM_PATH], input=payload,
                          capture_output=True, env={}, cwd=tmp_path, timeout=10)
    assert proc.returncode == 2
    assert proc.stderr.startswith(b"qlagent shim: ")
    assert os.listdir(tmp_path) == []


def test_missing_cwd_gives_start_error_naming_cwd(tmp_path):
    spec = make_spec(tmp_path, ["/bin/sh", "-c", "echo ran"], cwd=str(tmp_path / "gone"))
    receipt = run_to_end(spec)
    assert receipt.start_error == f"cwd {tmp_path / 'gone'}: ENOENT (No such file or directory)"
    assert log_bytes(spec) == b"" and processes.read_task_pid(spec["run_dir"]) is None


def test_oversized_spec_is_refused_before_anything_starts(tmp_path):
    spec = make_spec(tmp_path, ["/bin/true"], env={"BIG": "x" * (1 << 20)})
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    with pytest.raises(ValidationError, match="spec: .* bytes of JSON, over the limit") as err:
        spawn_shim(spec)
    assert err.value.limit == 1048576 and err.value.field == "spec"
    assert {p.pid for p in psutil.Process().children(recursive=True)} == before
    assert os.listdir(spec["run_dir"]) == []


def test_artifact_that_is_not_a_regular_file_is_refused(tmp_path):
    spec = make_spec(tmp_path, ["/bin/sh", "-c", "echo out"])
    os.unlink(spec["artifact_path"])
    os.mkfifo(spec["artifact_path"], 0o600)
    opener = os.open(spec["artifact_path"], os.O_RDONLY | os.O_NONBLOCK)  # lets the open succeed
    try:
        receipt = run_to_end(spec)
    finally:
        os.close(opener)
    assert receipt.start_error == f"artifact_path {spec['artifact_path']}: not a regular file"
    assert processes.read_task_pid(spec["run_dir"]) is None


def test_full_filesystem_keeps_draining_and_the_exit_status_unchanged(tmp_path):
    small = tmp_path / "flash"
    small.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(small)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"mounting a 1 MiB tmpfs is not permitted here: {mounted.stderr.strip()}")
    try:
        spec = make_spec(tmp_path, ["/bin/sh", "-c", "head -c 3000000 /dev/zero; exit 4"])
        os.unlink(spec["artifact_path"])
        spec["artifact_path"] = str(small / "a.log")
        os.close(os.open(spec["artifact_path"], os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
        receipt = run_to_end(spec)
        assert receipt.exit_code == 4  # ENOSPC on the log never reaches the task
        assert receipt.bytes_total == 3000000
        assert 0 < receipt.bytes_kept == os.path.getsize(spec["artifact_path"]) <= 1048576
        assert receipt.write_error == "ENOSPC (No space left on device)"
        assert receipt.bytes_dropped == 3000000 - receipt.bytes_kept
        # The run directory is elsewhere: the fact is written, naming the write error, not the quota.
        assert processes.read_truncation(spec["run_dir"]) == TruncationFact(
            quota_bytes=spec["quota_bytes"], bytes_kept=receipt.bytes_kept,
            reason="write_error: ENOSPC (No space left on device)")
        with open(os.path.join(spec["run_dir"], "shim.err")) as f:
            assert "artifact write failed" in f.read()
    finally:
        subprocess.run(["umount", str(small)], check=True)


def test_start_status_comes_after_the_exec_and_carries_the_exact_reason(tmp_path):
    spec = make_spec(tmp_path, ["/bin/sh", "-c", "exec sleep 30"])
    handle = spawn_shim(spec)
    try:
        assert handle.start_error is None
        task = wait_until(lambda: processes.read_task_pid(spec["run_dir"]), 20, "task.pid")
        assert psutil.Process(task).cmdline()[0] in ("/bin/sh", "sleep")   # exec'd, not a python fork
    finally:
        os.killpg(task, signal.SIGKILL)
        handle.popen.wait(10)
        if handle.pidfd is not None:
            os.close(handle.pidfd)
    bad = make_spec(tmp_path, ["/bin/sh", "-c", "echo ran"], cwd=str(tmp_path / "gone"))
    handle = spawn_shim(bad)
    assert handle.start_error == f"cwd {tmp_path / 'gone'}: ENOENT (No such file or directory)"
    assert handle.popen.wait(10) == 0
    assert processes.read_receipt(bad["run_dir"]).start_error == handle.start_error


def test_start_error_is_bounded_whatever_the_path_length(tmp_path):
    deep = "/" + "/".join(["d" * 200] * 20)                 # 4,020 bytes, under MAX_PATH_BYTES
    spec = make_spec(tmp_path, [deep + "/prog"])
    receipt = run_to_end(spec)
    error = receipt.start_error
    assert len(error) <= 512 and error.startswith("exec /ddd") and error.endswith(
        "dd/prog: ENOENT (No such file or directory)")


def test_shim_that_dies_before_the_status_is_a_start_error_not_a_hang(tmp_path):
    spec = make_spec(tmp_path, ["/bin/true"])
    spec["quota_bytes"] = "not a number"        # bad spec: receipt with start_error, status err
    handle = fork_served(processes.ForkServer(str(tmp_path)), spec, sys.executable)
    assert handle.start_error == "bad spec: quota_bytes: must be an integer >= 0"


# --- lease self-fencing (a fleet Worker's run under on_lease_loss = "kill") ---------------------

def _mono_us():
    return time.monotonic_ns() // 1000


def _write_lease(path, at_us):
    """As WorkerRuns.set_lease_deadline: the instant, written to a temporary file and renamed."""
    with open(path + ".tmp", "w") as f:
        f.write(f"{at_us}\n")
    os.rename(path + ".tmp", path)


def test_a_lease_renewed_in_time_lets_the_run_finish(tmp_path):
    spec = make_spec(tmp_path, ["/bin/sh", "-c", "sleep 2.5; echo done"])
    spec["lease_file"] = os.path.join(spec["run_dir"], "lease")
    _write_lease(spec["lease_file"], _mono_us() + 1_500_000)
    handle = spawn_shim(spec)
    # The Worker renews every 0.2 s: at each instant it was given, the shim finds a later one.
    while handle.popen.poll() is None:
        _write_lease(spec["lease_file"], _mono_us() + 1_500_000)
        time.sleep(0.2)
    assert handle.popen.returncode == 0
    receipt = processes.read_receipt(spec["run_dir"])
    assert receipt.exit_code == 0 and receipt.lease_lost is False and log_bytes(spec) == b"done\n"


def test_a_lease_not_renewed_stops_the_whole_tree_kept_orphans_too_and_the_receipt_says_so(tmp_path):
    pids = tmp_path / "pids"
    # The main process ignores SIGTERM (so SIGKILL after grace_s ends it); its background child is
    # in a session of its own and would be kept as an orphan without the lease.
    script = f"setsid sleep 60 & echo $! > {pids}; trap '' TERM; sleep 60"
    spec = make_spec(tmp_path, ["/bin/sh", "-c", script])
    spec.update(keep_orphans=True, grace_s=0.5, lease_file=os.path.join(spec["run_dir"], "lease"))
    _write_lease(spec["lease_file"], _mono_us() + 2_000_000)
    handle = spawn_shim(spec)
    orphan = wait_until(lambda: pids.exists() and pids.read_text().strip() and int(pids.read_text()), 20, "pids")
    assert handle.popen.wait(20) == 0
    receipt = processes.read_receipt(spec["run_dir"])
    assert receipt.lease_lost is True and receipt.signal == signal.SIGKILL
    assert not psutil.pid_exists(orphan) or psutil.Process(orphan).status() == psutil.STATUS_ZOMBIE
    with open(os.path.join(spec["run_dir"], "shim.err")) as f:
        assert "lease not renewed" in f.read()


def test_an_unreadable_lease_file_fails_closed(tmp_path):
    spec = make_spec(tmp_path, ["/bin/sleep", "60"])
    spec["lease_file"] = os.path.join(spec["run_dir"], "lease")           # never written
    handle = spawn_shim(spec)
    assert handle.popen.wait(20) == 0
    receipt = processes.read_receipt(spec["run_dir"])
    assert receipt.lease_lost is True and receipt.signal == signal.SIGTERM


# --- the Run's deadline (spec timeout_s: ShimProcesses.begin) --------------------------------

def test_a_deadline_stops_the_whole_tree_kept_orphans_too_with_one_sigterm_and_the_receipt_says_so(tmp_path):
    terms, pids = tmp_path / "terms", tmp_path / "pids"
    # The shell notes each SIGTERM and goes on (SIGKILL after grace_s ends it); its background
    # child is in a session of its own and would be kept as an orphan without the deadline.
    script = f"setsid sleep 60 & echo $! > {pids}; trap 'echo term >> {terms}' TERM; while :; do sleep 0.1; done"
    spec = make_spec(tmp_path, ["/bin/sh", "-c", script])
    spec.update(keep_orphans=True, grace_s=0.5, timeout_s=1)
    handle = spawn_shim(spec)
    orphan = wait_until(lambda: pids.exists() and pids.read_text().strip() and int(pids.read_text()), 20, "pids")
    with open(os.path.join(spec["run_dir"], "deadline")) as f:
        assert int(f.read()) > _mono_us()                      # the instant, still to come
    assert handle.popen.wait(20) == 0
    receipt = processes.read_receipt(spec["run_dir"])
    assert receipt.deadline_passed is True and receipt.lease_lost is False and receipt.signal == signal.SIGKILL
    assert 1.0 <= (receipt.ended_at_us - receipt.started_at_us) / 1e6
    assert terms.read_text().split() == ["term"]
    assert not psutil.pid_exists(orphan) or psutil.Process(orphan).status() == psutil.STATUS_ZOMBIE
    assert_clean_end(spec)


def test_a_task_that_ends_before_its_deadline_keeps_its_own_outcome(tmp_path):
    spec = make_spec(tmp_path, ["/bin/sh", "-c", "exit 3"])
    spec["timeout_s"] = 30
    receipt = run_to_end(spec)
    assert (receipt.exit_code, receipt.deadline_passed) == (3, False)


@pytest.mark.parametrize("value", [0, -1, MAX_TIMEOUT_S + 1, "5", True])
def test_a_timeout_out_of_range_is_a_bad_spec_and_nothing_runs(tmp_path, value):
    """The shim's bound is the task definition's (core.limits), which it cannot import."""
    marker = tmp_path / "ran"
    spec = make_spec(tmp_path, ["/bin/sh", "-c", f"touch {marker}"])
    spec["timeout_s"] = value
    receipt = run_to_end(spec)
    assert receipt.start_error == f"bad spec: timeout_s: must be null or a number of seconds in (0, {MAX_TIMEOUT_S}]"
    assert not marker.exists()


@pytest.mark.parametrize("splicing", [True, False], ids=["splice", "copy"])
def test_the_drainer_keeps_exactly_the_room_left_by_splice_and_by_copy(tmp_path, splicing):
    """The drainer moves the FIFO by splice(2); where splice is refused it copies through a
    buffer. Both keep exactly the room left (what the file held counts), count every byte, and
    write the truncation fact once, at the first byte past the quota."""
    import threading
    sys.path.insert(0, processes.SHIM_DIR)       # the shim's modules go by their plain names
    try:
        import drainer
    finally:
        sys.path.remove(processes.SHIM_DIR)
    facts = []

    class Run:                                  # what the drainer uses of its shim (main.Shim)
        def log_error(self, message):
            facts.append(("shim.err", message))

        def write_file_atomic(self, name, doc, exclusive):
            facts.append((name, doc))

    art = tmp_path / "a.log"
    art.write_bytes(b"old")
    fd = os.open(art, os.O_WRONLY)
    os.lseek(fd, 0, os.SEEK_END)
    r, w = os.pipe()
    os.set_blocking(r, False)
    wake_r, wake_w = os.pipe()
    os.close(wake_w)
    d = drainer.Drainer(Run(), fd, 100_003, 100_000)
    d.splicing = splicing
    d.watch(r, wake_r)
    payload = bytes(range(256)) * 1000

    def write():
        view = memoryview(payload)
        while view:
            view = view[os.write(w, view[:7000]):]
        os.close(w)
    writer = threading.Thread(target=write)
    writer.start()
    while not d.eof:
        d.drain(1000)
    writer.join()
    for x in (fd, r, wake_r):
        os.close(x)
    assert art.read_bytes() == b"old" + payload[:100_000]
    assert (d.bytes_total, d.bytes_kept, d.truncated) == (256_000, 100_000, True)
    assert facts == [("truncated.json", {"quota_bytes": 100_003, "bytes_kept": 100_000, "reason": "quota"})]
