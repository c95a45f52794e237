"""Materialisation before anything exists (issue 3 item 2, ADR-0071 §4, verification 1, 3).

A missing Secret, execution revision or context recipe, and low space on a real small tmpfs,
each end a pass ``unavailable`` with no log file, no run directory and no child process; the
Run's failure is recorded with a reason code and without secret text. The task's environment is
exactly the run user's HOME/USER/LOGNAME/SHELL, the recipe, the secrets, ``QL3_*`` and the
recipe's PATH, whatever the agent's own environment holds. Secret plaintext is never in the DB, WAL, events, errors, journal, shim
argv/environment or run files (byte search, with a positive control).
"""

from __future__ import annotations

import os
import shutil
import socket
import sqlite3
import subprocess
import time

import psutil
import pytest
from execkit import Agent, Bench, file_bytes_under, task

from qlagent.core.limits import DEFAULT_PATH
from qlagent.core.profiles import EDGE, MiB, fs_reserve
from kit import scratch_dir, wait_until

SECRET = b"pl41ntext-S3CRET-7d1e0c"          # must never be found outside the task's own memory/log
OTHER = b"second-S3CRET-value-91"


@pytest.fixture
def root():
    d = scratch_dir("qlagent-mat-")
    yield d
    shutil.rmtree(d, ignore_errors=True)


def children() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)
            if p.status() != psutil.STATUS_ZOMBIE}


def nothing_created(b: Bench, before: set[int]) -> None:
    assert b.artifacts() == []
    assert not os.path.exists(b.runs_dir) or os.listdir(b.runs_dir) == []
    assert children() - before == set()


def unavailable_pass(b: Bench, reason: str):
    before = children()
    r = b.engine.dispatcher.dispatch_once()
    assert (r.status, r.reason) == ("unavailable", reason), r
    nothing_created(b, before)
    return r


def db_tamper(b: Bench, sql: str, *args) -> None:
    """Change the file behind the Engine's back, as a bad restore or a manual edit would."""
    with sqlite3.connect(b.db_path) as c:
        assert c.execute(sql, args).rowcount >= 1


def test_missing_secret_is_unavailable_and_recorded_without_secret_text(root):
    b = Bench(os.path.join(root, "s"))
    b.add(task("ddns", "echo ${#A} ${#B}\n", secrets={"A": "present", "B": "absent"}))
    b.secret("present", SECRET)
    rid = b.start("ddns")
    r = unavailable_pass(b, "secret_missing:absent")
    assert r.run_id == rid
    run, (att,) = b.run(rid), b.attempts(rid)
    assert (run.state, att.state, att.failure_reason) == ("failed", "start_failed", "secret_missing:absent")  # names the Secret, never its value
    assert b.runs.log_source(rid) == (None, None)
    events = [e.type for e in b.runs.events(rid)]
    assert events[-1] == "run.failed"
    assert b.engine.dispatcher.dispatch_once().status == "no_candidate"     # reported once, no loop
    b.close()
    assert SECRET not in file_bytes_under(b.root)


def test_missing_execution_revision_is_unavailable(root):
    b = Bench(os.path.join(root, "s"))
    (head,) = b.add(task("t", "echo hi\n"))
    rid = b.start("t")
    db_tamper(b, "DELETE FROM execution_revisions WHERE task_id = ?", head.task_id)
    unavailable_pass(b, "revision_missing")
    assert b.run(rid).state == "failed"
    assert b.attempts(rid)[0].failure_reason == "revision_missing"
    b.close()


def test_missing_task_revision_fails_the_run_instead_of_hiding_it(root):
    """A Run whose pinned definition revision is gone (bad restore) is not left out of the
    candidate page, queued for ever: it fails with revision_missing (issue 12 §2)."""
    b = Bench(os.path.join(root, "s"))
    (head,) = b.add(task("t", "echo hi\n"))
    rid = b.start("t")
    with sqlite3.connect(b.db_path) as c:
        c.execute("PRAGMA foreign_keys = OFF")
        c.execute("DELETE FROM task_revisions WHERE task_id = ?", (head.task_id,))
    unavailable_pass(b, "revision_missing")
    assert b.run(rid).state == "failed"
    assert b.attempts(rid)[0].failure_reason == "revision_missing"
    b.close()


def test_missing_context_recipe_is_unavailable(root):
    b = Bench(os.path.join(root, "s"))
    b.add(task("t", "echo hi\n", env={"X": "1"}, secrets={"T": "tok"}))
    b.secret("tok", SECRET)
    rid = b.start("t")
    db_tamper(b, "DELETE FROM context_recipes")
    unavailable_pass(b, "recipe_missing")
    assert b.run(rid).state == "failed"
    assert b.attempts(rid)[0].failure_reason == "recipe_missing"
    b.close()
    assert SECRET not in file_bytes_under(b.root)


@pytest.fixture
def small_tmpfs(root):
    """A real 40 MiB tmpfs (edge: its reserve is a quarter of it, 10 MiB, + one 4 MiB log)."""
    mnt = os.path.join(root, "mnt")
    os.makedirs(mnt)
    p = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=40m,mode=0700", "tmpfs", mnt], capture_output=True)
    if p.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {p.stderr.decode().strip()}")
    yield mnt
    subprocess.run(["umount", "-l", mnt], check=False)


def test_low_space_is_unavailable_then_admitted_when_space_returns(root, small_tmpfs):
    b = Bench(os.path.join(root, "s"), artifact_dir=os.path.join(small_tmpfs, "artifacts"))
    b.add(task("t", "echo hi\n"))
    rid = b.start("t")
    filler = os.path.join(small_tmpfs, "filler")
    with open(filler, "wb") as f:
        f.write(b"\0" * (27 * MiB))              # free 13 MiB: 13 - 10 reserve < one 4 MiB log
    vfs = os.statvfs(small_tmpfs)
    assert vfs.f_bavail * vfs.f_frsize - fs_reserve(EDGE, 40 * MiB) < EDGE.log_max_bytes
    unavailable_pass(b, "low_space")
    assert b.run(rid).state == "queued"           # capacity is transient: the Run waits
    assert os.listdir(small_tmpfs) == ["filler"]  # not even the artifact root was created
    os.unlink(filler)
    assert b.wait_run(rid, 10).state == "succeeded"
    assert len(b.artifacts()) == 1 and b.artifacts()[0].startswith(small_tmpfs)
    b.close()


AGENT_ENV = {"NOTIFY_SOCKET": "", "WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "1", "HOME": "/root/agent-home",
             "AWS_SECRET_ACCESS_KEY": "agent-credential-xyz", "INVOCATION_ID": "abc", "LANG": "C.UTF-8",
             "QLAGENT_SOMETHING": "1", "LD_PRELOAD": ""}


def env_lines(data: bytes) -> dict[str, str]:
    return dict(line.split("=", 1) for line in data.decode().splitlines() if "=" in line)


def expected_env_keys(recipe: set[str]) -> set[str]:
    return recipe | {"PATH", "HOME", "USER", "LOGNAME", "SHELL", "QL3_RUN_ID", "QL3_ATTEMPT_ID", "QL3_PROJECT_ID", "QL3_TASK_ID", "QL3_TASK_NAME",
                     "QL3_TASK_REVISION", "QL3_AGENT_KEY"}


def test_task_env_is_recipe_secrets_and_identity_only_in_process(root, monkeypatch):
    for k, v in AGENT_ENV.items():
        monkeypatch.setenv(k, v or os.path.join(root, "notify.sock"))
    b = Bench(os.path.join(root, "s"))
    b.add(task("envdump", command=["/usr/bin/env"], env={"FOO": "bar"}, secrets={"TOK": "tok"}))
    b.secret("tok", SECRET)
    rid = b.start("envdump")
    assert b.wait_run(rid, 10).state == "succeeded"
    with open(b.runs.log_source(rid)[0], "rb") as f:
        env = env_lines(f.read())
    assert set(env) == expected_env_keys({"FOO", "TOK"})
    assert env["FOO"] == "bar" and env["TOK"] == SECRET.decode() and env["PATH"] == DEFAULT_PATH
    assert env["QL3_RUN_ID"] == rid and env["QL3_TASK_NAME"] == "envdump"
    b.close()


def test_task_env_under_serve_with_a_real_notify_socket(root):
    a = Agent(root)
    a.add(task("envdump", command=["/usr/bin/env"], env={"FOO": "bar"}, secrets={"TOK": "tok"}))
    a.cli("secret", "set", "tok", stdin=SECRET)
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(os.path.join(root, "notify.sock"))
    a.serve(env={**AGENT_ENV, "NOTIFY_SOCKET": os.path.join(root, "notify.sock"), "WATCHDOG_PID": ""})
    try:
        assert b"READY=1" in notify.recv(4096)    # the agent really is under a (fake) systemd
        rid = a.start("envdump")
        assert a.wait(rid)["state"] == "succeeded"
        env = env_lines(a.cli("run", "logs", rid).stdout)
        assert set(env) == expected_env_keys({"FOO", "TOK"})
    finally:
        assert a.stop() == 0
        notify.close()


def test_secret_plaintext_never_leaves_the_launch(root):
    """Byte search after a success, a failure, a timeout-free cancel and a missing-secret refusal,
    with the shim's own argv and environment checked while it runs."""
    a = Agent(root)
    a.add(task("uses", 'echo "len ${#TOK}"\nexit 3\n', secrets={"TOK": "tok", "TOK2": "tok2"}),
          task("sleeper", "sleep 30\n", secrets={"TOK": "tok"}),
          task("missing", "true\n", secrets={"TOK": "tok", "GONE": "gone"}),
          task("leaky", 'echo "$TOK"\n', secrets={"TOK": "tok"}))
    a.cli("secret", "set", "tok", stdin=SECRET)
    a.cli("secret", "set", "tok2", stdin=OTHER)
    a.serve()
    try:
        failed = a.start("uses")
        assert a.wait(failed)["state"] == "failed"
        missing = a.start("missing")
        assert a.wait(missing)["state"] == "failed"
        sleeper = a.start("sleeper")
        a.wait(sleeper, ("running",))
        att = a.attempts(sleeper)[0]
        shim = psutil.Process(att["shim_pid"])
        assert SECRET.decode() not in " ".join(shim.cmdline())
        with open(f"/proc/{shim.pid}/environ", "rb") as f:
            assert f.read() == b""                  # the shim itself runs with an empty environment
        a.cli("run", "cancel", sleeper)
        assert a.wait(sleeper)["state"] == "cancelled"
        leaky = a.start("leaky")
        assert a.wait(leaky)["state"] == "succeeded"
        shows = b"".join(a.cli("run", "show", r, "--json").stdout for r in (failed, missing, sleeper, leaky))
    finally:
        assert a.stop() == 0
    # Positive control: the task that printed its secret has it in its own log — the search works.
    leaky_log = a.attempts(leaky)[0]["artifact_path"]
    with open(leaky_log, "rb") as f:
        assert SECRET in f.read()
    os.unlink(leaky_log)
    everything = file_bytes_under(a.state) + a.journal() + shows
    with a.db() as c:
        reasons = " ".join(str(r[0]) for r in c.execute("SELECT failure_reason FROM attempts"))
        payloads = " ".join(r[0] for r in c.execute("SELECT payload_json FROM run_events"))
    assert "secret_missing" in reasons
    for s in (SECRET, OTHER):
        assert s not in everything
        assert s.decode() not in reasons + payloads


def test_symlinked_artifact_root_is_refused_without_spinning(root):
    """An artifact root that is a symlink is refused (unsafe_directory): no file appears behind
    the link, no process starts, the Run waits, and the service neither spins nor floods its
    journal retrying it."""
    target = os.path.join(root, "elsewhere")
    os.makedirs(target)
    link = os.path.join(root, "artifacts-link")
    os.symlink(target, link)
    a = Agent(root, config=f'artifact_dir = "{link}"\n')
    a.add(task("t", "echo hi\n"))
    a.serve()
    try:
        rid = a.start("t")
        wait_until(lambda: b"dispatch.refused" in a.journal() or b"run.unavailable" in a.journal(), 5,
                   "the Run refused or unavailable", detail=a.journal)
        cpu0 = psutil.Process(a.proc.pid).cpu_times()
        time.sleep(1.0)     # nothing to await: the point is that the service stays idle
        cpu1 = psutil.Process(a.proc.pid).cpu_times()
        assert a.run(rid)["state"] == "queued"
        assert os.listdir(target) == []
        assert (cpu1.user + cpu1.system) - (cpu0.user + cpu0.system) < 0.3
        assert a.journal().count(b"unsafe_directory") <= 2
    finally:
        assert a.stop() == 0


def test_read_only_artifact_filesystem_is_unavailable_not_an_exception(root, small_tmpfs):
    """Flash remounted read-only (space is fine, creating the log fails with EROFS): the pass
    returns ``unavailable`` instead of raising into the service loop; nothing starts."""
    subprocess.run(["mount", "-o", "remount,ro", small_tmpfs], check=True)
    b = Bench(os.path.join(root, "s"), artifact_dir=os.path.join(small_tmpfs, "artifacts"))
    b.add(task("t", "echo hi\n"))
    rid = b.start("t")
    unavailable_pass(b, "artifact_unwritable")
    assert b.run(rid).state == "queued"
    b.close()
