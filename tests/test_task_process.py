"""The task's process starts the way cron and systemd start it, and why a Run could not start is
always visible (issue 12 §1, §2). Real Engine over a real SQLite file, the real shim,
real child processes and files; ``run show``, ``--json`` and the HTTP Run through a real
``qlagent serve`` subprocess on loopback.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import sys
import urllib.request

import psutil
import pytest
from execkit import Agent, Bench, procs_with_env, task
from shimkit import spawn_shim

from qlagent.core.definitions import parse_task_file, prepare_task
from qlagent.core.errors import ValidationError
from kit import free_port, scratch_dir

SECRET = b"s3cret-V4LUE-never-in-a-reason"


@pytest.fixture
def root():
    d = scratch_dir("qlagent-users-")
    os.chmod(d, 0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def umask():
    """Set the agent's (this process's) umask for one test, as systemd's UMask= would."""
    saved = os.umask(0o022)
    os.umask(saved)

    def set_(value: int) -> None:
        os.umask(value)
    yield set_
    os.umask(saved)


def run_log(b: Bench, name: str, timeout_s: float = 20) -> tuple[object, bytes]:
    rid = b.start(name)
    run = b.wait_run(rid, timeout_s)
    path = b.runs.log_source(rid)[0]
    with open(path, "rb") as f:
        return run, f.read()


def workdir(root: str, name: str) -> str:
    d = os.path.join(root, name)
    os.makedirs(d, mode=0o755)
    return d


# ---- §1 the task's process ---------------------------------------------------------------------

@pytest.mark.parametrize("service_umask, expected", [(0o022, ("0022", "644", "755")),
                                                       (0o002, ("0002", "664", "775"))])
def test_task_gets_the_service_umask_not_the_shims(root, umask, service_umask, expected):
    b = Bench(os.path.join(root, "s"))
    b.add(task("u", "umask; touch f; mkdir d; stat -c %a f d\n", cwd=workdir(root, "w")))
    umask(service_umask)
    run, out = run_log(b, "u")
    assert run.state == "succeeded"
    assert tuple(out.decode().split()) == expected
    # The shim's own files stay private whatever the service's umask.
    assert os.stat(b.artifacts()[0]).st_mode & 0o777 == 0o600
    b.close()


def test_per_task_umask_0027(root, umask):
    b = Bench(os.path.join(root, "s"))
    b.add(task("u", "umask; touch f; mkdir d; stat -c %a f d\n", cwd=workdir(root, "w"), umask="0027"))
    umask(0o022)
    run, out = run_log(b, "u")
    assert run.state == "succeeded" and out.decode().split() == ["0027", "640", "750"]
    b.close()


@pytest.mark.parametrize("value", ["27", "00777", "0778", "0o27", "1000", "", " 022", "0x1f", 23])
def test_umask_outside_3_to_4_octal_digits_is_refused_naming_the_field(value):
    with pytest.raises(ValidationError) as err:
        prepare_task(parse_task_file({"task": [{"name": "t", "command": ["/bin/true"], "umask": value}]})[0], 0)
    assert err.value.field == "task[0].umask"


def test_umask_edges_are_accepted_and_kept_as_four_digits():
    def spec(value):
        return prepare_task(parse_task_file({"task": [{"name": "t", "command": ["/bin/true"],
                                                       "umask": value}]})[0]).definition.execution.umask
    assert spec("000") == "0000" and spec("0777") == "0777" and spec("777") == "0777" and spec("027") == "0027"


def test_bad_umask_via_cli_is_one_line_exit_2_and_nothing_written(root):
    a = Agent(root)
    path = os.path.join(root, "t.toml")
    with open(path, "w") as f:
        f.write('[[task]]\nname = "t"\ncommand = ["/bin/true"]\numask = "0999"\n')
    p = a.cli("task", "add", "-f", path, check=False)
    assert p.returncode == 2
    lines = p.stderr.decode().strip().splitlines()
    assert len(lines) == 1 and "task[0].umask" in lines[0] and "0999" in lines[0]
    with a.db() as c:
        assert c.execute("SELECT count(*) FROM tasks").fetchone()[0] == 0
    with open(path, "w") as f:
        f.write('[[task]]\nname = "t"\ncommand = ["/bin/true"]\numask = "027"\nkeep_orphans = true\n')
    a.cli("task", "add", "-f", path)
    shown = a.cli("task", "show", "t").stdout.decode()
    assert "process       cwd $HOME; umask 0027; leftovers kept (keep_orphans)" in shown
    doc = json.loads(a.cli("task", "show", "t", "--json").stdout)
    assert (doc["definition"]["execution"]["umask"], doc["definition"]["execution"]["keepOrphans"]) == ("0027", True)


def test_on_lease_loss_round_trips_through_the_store_cli_and_json_and_a_bad_value_is_refused(root):
    a = Agent(root)
    path = os.path.join(root, "t.toml")
    with open(path, "w") as f:
        f.write('[[task]]\nname = "t"\ncommand = ["/bin/true"]\non_lease_loss = "stay"\n')
    p = a.cli("task", "add", "-f", path, check=False)
    lines = p.stderr.decode().strip().splitlines()
    assert p.returncode == 2 and len(lines) == 1 and "task[0].on_lease_loss" in lines[0] and "kill, keep" in lines[0]
    with a.db() as c:
        assert c.execute("SELECT count(*) FROM tasks").fetchone()[0] == 0
    with open(path, "w") as f:
        f.write('[[task]]\nname = "t"\ncommand = ["/bin/true"]\non_lease_loss = "keep"\n')
    a.cli("task", "add", "-f", path)
    assert "lease loss    keep" in a.cli("task", "show", "t").stdout.decode()
    doc = json.loads(a.cli("task", "show", "t", "--json").stdout)
    assert doc["definition"]["execution"]["onLeaseLoss"] == "keep"
    stored = prepare_task(parse_task_file({"task": [{"name": "t", "command": ["/bin/true"],
                                                     "on_lease_loss": "keep"}]})[0])
    assert doc["contentDigest"] == stored.content_digest


# contentDigest / execution digest of these tasks as computed before umask and keep_orphans
# existed (main at b68204d): a Task that does not use them keeps its digests.
PRE_EXISTING = [
    ({"name": "backup", "schedule": "30 3 * * *", "shell": "/bin/sh", "script": "echo hi", "cwd": "/tmp"},
     "f6c972d0489fa57ec0590ceb74759676f972134a4ae6688f3c5fcccabe4031f3",
     "b9c12a4a5d189fbab6c3f1d8ad7b8239e92144fe87848d113082ffd016e9b11e"),
    ({"name": "ping", "command": ["/bin/ping", "-c1", "x"], "cwd": "/"},
     "62b668f1071841c5c0cd80b499b4bc7ec5cb1492c3b5925a166582615528f37f",
     "c057761148d8673344963fd7effa42d16b7486c44f6e7d0d4895bf48d247e4bb"),
]


@pytest.mark.parametrize("t, digest, execution_digest", PRE_EXISTING)
def test_a_task_without_the_new_fields_keeps_its_digests(t, digest, execution_digest):
    p = prepare_task(parse_task_file({"task": [t]})[0])
    assert (p.content_digest, p.execution_digest) == (digest, execution_digest)
    for extra in ({"umask": "0027"}, {"keep_orphans": True}, {"on_lease_loss": "kill"}, {"on_lease_loss": "keep"}):
        q = prepare_task(parse_task_file({"task": [{**t, **extra}]})[0])
        assert q.content_digest != digest and q.execution_digest != execution_digest
    explicit_default = prepare_task(parse_task_file({"task": [{**t, "keep_orphans": False}]})[0])
    assert explicit_default.content_digest == digest


def test_signal_dispositions_default_and_mask_empty_sigxfsz_exits_153(root):
    b = Bench(os.path.join(root, "s"))
    script = ("grep -E '^Sig(Ign|Blk)' /proc/self/status; ulimit -f 1; head -c 10000 /dev/zero > x; echo $?\n")
    b.add(task("sig", script, shell="/bin/bash", cwd=workdir(root, "w")))
    run, out = run_log(b, "sig")
    assert run.state == "succeeded"
    lines = out.decode().splitlines()
    assert "SigBlk:\t0000000000000000" in lines and "SigIgn:\t0000000000000000" in lines, lines
    assert lines[-1] == "153"     # SIGXFSZ killed head, as in a plain shell
    b.close()


def test_signals_the_service_was_started_with_ignored_are_default_for_the_task(root):
    """A service started under nohup (SIGHUP ignored) or by a supervisor that ignores others
    hands those dispositions to its fork server (exec keeps an ignored signal): the task still
    gets every signal at its default, as from a plain shell."""
    import signal
    saved = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGHUP, signal.SIGUSR1, signal.SIGRTMIN + 3)}
    try:
        b = Bench(os.path.join(root, "s"))
        b.add(task("sig", "grep -E '^SigIgn' /proc/self/status\n", shell="/bin/bash", cwd=workdir(root, "w")))
        run, out = run_log(b, "sig")
    finally:
        for s, h in saved.items():
            signal.signal(s, h)
    assert run.state == "succeeded"
    assert out.decode().splitlines() == ["SigIgn:\t0000000000000000"]
    b.close()


def test_home_user_logname_shell_from_passwd_and_cwd_home(root):
    pw = pwd.getpwuid(os.geteuid())
    b = Bench(os.path.join(root, "s"))
    show = 'echo "HOME=${HOME-unset} USER=${USER-unset} LOGNAME=${LOGNAME-unset} SHELL=${SHELL-unset}"; pwd\n'
    elsewhere = workdir(root, "elsewhere")
    b.add(task("plain", show), task("withcwd", show, cwd=elsewhere),
          task("recipe", show, env={"HOME": elsewhere, "USER": "u1", "SHELL": "/bin/false"}))
    run, out = run_log(b, "plain")
    assert out.decode().splitlines() == [
        f"HOME={pw.pw_dir} USER={pw.pw_name} LOGNAME={pw.pw_name} SHELL={pw.pw_shell}",
        os.path.realpath(pw.pw_dir)]
    _, out = run_log(b, "withcwd")
    assert out.decode().splitlines()[1] == elsewhere
    _, out = run_log(b, "recipe")        # a recipe value overrides the baseline; cwd follows HOME
    assert out.decode().splitlines() == [f"HOME={elsewhere} USER=u1 LOGNAME={pw.pw_name} SHELL=/bin/false",
                                         elsewhere]
    b.close()


def test_rlimits_as_the_services_stdin_dev_null_and_only_fds_0_1_2(root):
    b = Bench(os.path.join(root, "s"))
    b.add(task("fds", "cat /proc/self/limits; echo --; ls /proc/$$/fd; echo --; readlink /proc/$$/fd/0\n"))
    run, out = run_log(b, "fds")
    assert run.state == "succeeded"
    limits, fds, stdin = out.decode().split("--\n")
    with open("/proc/self/limits") as f:
        assert limits == f.read()
    assert fds.split() == ["0", "1", "2"]
    assert stdin.strip() == "/dev/null"
    b.close()


def test_what_the_main_process_left_behind_is_stopped_and_counted(root):
    b = Bench(os.path.join(root, "s"))
    # a background child in the group; one that left the group with setsid (found by its
    # QL3_ATTEMPT_ID); one that ignores SIGTERM (needs the SIGKILL after grace; the main process
    # waits until it does ignore it).
    b.add(task("bg", "sleep 30 & setsid sleep 31 & sh -c 'trap \"\" TERM; touch ready; exec sleep 32' &\n"
                     "while [ ! -e ready ]; do sleep 0.01; done; echo started\n", grace_s=1, cwd=workdir(root, "w")))
    rid = b.start("bg")
    run = b.wait_run(rid, 20)
    assert run.state == "succeeded"
    (a,) = b.attempts(rid)
    assert a.orphans_stopped == 3
    assert procs_with_env("QL3_RUN_ID", rid) == []
    events = [e for e in b.runs.events(rid) if e.type == "run.succeeded"]
    assert events[0].payload["orphansStopped"] == 3
    b.close()


def test_a_daemon_that_double_forks_setsids_and_clears_its_environment_is_stopped_too(root):
    # The classic daemonize (fork, setsid, fork, exec with an empty environment) leaves neither
    # the process group nor QL3_ATTEMPT_ID; it must still be found (the wrapper is the task's
    # subreaper, so the orphan is reparented to it) and stopped, as in a control group.
    b = Bench(os.path.join(root, "s"))
    tag = f"setsid-daemon-{os.getpid()}"
    b.add(task("dd", f"(setsid env -i {sys.executable} -c 'import time; open(\"up\", \"w\").close(); "
                     f"time.sleep(33)' {tag} &)\n"
                     "while [ ! -e up ]; do sleep 0.01; done; echo started\n",
               grace_s=1, cwd=workdir(root, "w")))
    rid = b.start("dd")
    try:
        assert b.wait_run(rid, 20).state == "succeeded"
        left = [p for p in psutil.process_iter(["cmdline"]) if tag in (p.info["cmdline"] or [])
                and p.status() != psutil.STATUS_ZOMBIE]
        assert left == []
        assert b.attempts(rid)[0].orphans_stopped == 1
    finally:
        for p in psutil.process_iter(["cmdline"]):
            if tag in (p.info["cmdline"] or []):
                p.kill()
    b.close()


def test_keep_orphans_leaves_the_daemon_running(root):
    b = Bench(os.path.join(root, "s"))
    b.add(task("daemon", "sleep 30 >/dev/null 2>&1 & echo started\n", keep_orphans=True))
    rid = b.start("daemon")
    try:
        assert b.wait_run(rid, 20).state == "succeeded"
        left = procs_with_env("QL3_RUN_ID", rid)
        assert [p.cmdline() for p in left] == [["sleep", "30"]]
        assert b.attempts(rid)[0].orphans_stopped is None
    finally:
        for p in procs_with_env("QL3_RUN_ID", rid):
            p.kill()
    b.close()


# ---- §2 why a Run could not start ---------------------------------------------------------------

def event_types(b: Bench, rid: str) -> list[str]:
    return [e.type for e in b.runs.events(rid)]


def assert_start_failed(b: Bench, rid: str, reason: str, error: str) -> None:
    """Failed with the reason on the Attempt and in a run.start_failed event; never running."""
    assert b.run(rid).state == "failed"
    (a,) = b.attempts(rid)
    assert (a.state, a.failure_reason, a.start_error) == ("start_failed", reason, error)
    types = event_types(b, rid)
    assert "run.running" not in types
    assert types[-2:] == ["run.start_failed", "run.failed"], types
    ev = [e for e in b.runs.events(rid) if e.type == "run.start_failed"][0]
    assert ev.payload == {"attemptId": a.attempt_id, "reason": reason, "error": error}
    warned = [k for (prio, name), k in b.log_lines if name == "run.start_failed" and prio == "warning"]
    assert warned and warned[-1]["run"] == rid and warned[-1]["error"] == error


def test_symlinked_run_directory_fails_the_run_with_its_path(root):
    b = Bench(os.path.join(root, "s"))
    b.add(task("t", "echo ran\n"))
    rid = b.start("t")
    aid = b.attempts(rid)[0].attempt_id
    os.makedirs(b.runs_dir, mode=0o700)
    os.symlink(workdir(root, "elsewhere"), os.path.join(b.runs_dir, aid))
    r = b.engine.dispatcher.dispatch_once()
    assert (r.status, r.reason) == ("launch_failed", "run_dir_unsafe")
    assert_start_failed(b, rid, "run_dir_unsafe", f"run directory {b.runs_dir}/{aid}: not a real directory: "
                                                  "ENOTDIR (Not a directory)")
    assert os.listdir(os.path.join(root, "elsewhere")) == []
    b.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another uid needs root")
def test_foreign_owned_run_directory_fails_the_run_naming_the_owner(root):
    b = Bench(os.path.join(root, "s"))
    b.add(task("t", "echo ran\n"))
    rid = b.start("t")
    aid = b.attempts(rid)[0].attempt_id
    run_dir = os.path.join(b.runs_dir, aid)
    os.makedirs(run_dir, mode=0o700)
    os.chown(run_dir, 65534, 65534)
    assert b.engine.dispatcher.dispatch_once().status == "launch_failed"
    assert_start_failed(b, rid, "run_dir_unsafe", f"run directory {run_dir}: owned by uid 65534, not 0")
    b.close()


@pytest.mark.parametrize("kind", ["file", "symlink"])
def test_something_already_at_the_artifact_path_fails_the_run_instead_of_waiting_for_ever(root, kind):
    b = Bench(os.path.join(root, "s"))
    b.add(task("t", "echo ran\n"))
    rid = b.start("t")
    aid = b.attempts(rid)[0].attempt_id
    path = os.path.join(b.artifact_dir, aid[:2], aid + ".log")
    os.makedirs(os.path.dirname(path), mode=0o700)
    victim = os.path.join(root, "victim")
    with open(victim, "wb") as f:
        f.write(b"keep me")
    if kind == "file":
        with open(path, "wb") as f:
            f.write(b"old log")
    else:
        os.symlink(victim, path)
    r = b.engine.dispatcher.dispatch_once()
    assert (r.status, r.reason, r.run_id) == ("unavailable", "artifact_unusable", rid)
    what = "a file" if kind == "file" else "a symlink"
    assert_start_failed(b, rid, "artifact_unusable", f"artifact_path {path}: EEXIST ({what} is already there)")
    assert b.engine.dispatcher.dispatch_once().status == "no_candidate"     # not skipped on every pass
    with open(victim, "rb") as f:
        assert f.read() == b"keep me"
    b.close()

def test_start_failures_are_visible_in_run_show_json_http_events_and_journal(root):
    port = free_port()
    a = Agent(root, config=f'[http]\nlisten = "127.0.0.1:{port}"\n')
    script = os.path.join(root, "not-executable.sh")
    with open(script, "w") as f:
        f.write("#!/bin/sh\necho ran\n")
    os.chmod(script, 0o644)
    cases = {
        "nocwd": (dict(cwd="/nonexistent/dir", secrets={"TOK": "tok"}), "cwd_unusable",
                  "cwd /nonexistent/dir: ENOENT (No such file or directory)"),
        "nocmd": (dict(command=["/usr/local/bin/does-not-exist"]), "exec_failed",
                  "exec /usr/local/bin/does-not-exist: ENOENT (No such file or directory)"),
        "noexec": (dict(command=[script]), "exec_failed", f"exec {script}: EACCES (Permission denied)"),
    }
    a.add(*[task(name, "echo ran\n" if "command" not in kw else None, **kw) for name, (kw, _, _) in cases.items()],
          task("bg", "sleep 30 & echo started\n"))
    a.cli("secret", "set", "tok", stdin=SECRET)
    viewer = a.cli("token", "create", "--subject", "v", "--role", "viewer").stdout.decode().strip()
    a.serve()
    try:
        started = {name: a.start(name) for name in cases}
        for name, rid in started.items():
            _, reason, error = cases[name]
            assert a.wait(rid)["state"] == "failed"
            show = a.cli("run", "show", rid).stdout.decode()
            assert f"reason={reason}" in show and f"could not start: {error}" in show
            assert SECRET.decode() not in show
            doc = json.loads(a.cli("run", "show", rid, "--json").stdout)
            assert doc["attempts"][0]["startError"] == error and doc["attempts"][0]["failureReason"] == reason
            types = [e["type"] for e in doc["events"]]
            assert "run.running" not in types and types[-2:] == ["run.start_failed", "run.failed"]
            assert doc["events"][-2]["payload"]["error"] == error
            req = urllib.request.Request(f"http://127.0.0.1:{port}/api/v3/projects/default/runs/{rid}",
                                         headers={"Authorization": f"Bearer {viewer}"})
            with urllib.request.urlopen(req, timeout=10) as resp:
                latest = json.loads(resp.read())["latestAttempt"]
            assert (latest["startError"], latest["failureReason"]) == (error, reason)
        bg = a.start("bg")                          # a Run that did start, and left a process behind
        assert a.wait(bg)["state"] == "succeeded"
        assert "orphans_stopped=1" in a.cli("run", "show", bg).stdout.decode()
        req = urllib.request.Request(f"http://127.0.0.1:{port}/api/v3/projects/default/runs/{bg}",
                                     headers={"Authorization": f"Bearer {viewer}"})
        with urllib.request.urlopen(req, timeout=10) as resp:
            latest = json.loads(resp.read())["latestAttempt"]
        assert (latest["orphansStopped"], latest["startError"]) == (1, None)
        assert procs_with_env("QL3_RUN_ID", bg) == []
    finally:
        assert a.stop() == 0
    journal = a.journal().decode()
    for name, rid in started.items():
        line = [ln for ln in journal.splitlines() if "run.start_failed" in ln and rid in ln]
        assert line and "warning" in line[0].lower() and cases[name][2] in line[0], journal[-3000:]
    assert SECRET.decode() not in journal


def test_the_shim_runs_precompiled_from_the_private_runs_root(root):
    from qlagent.adapters import processes
    b = Bench(os.path.join(root, "s"))
    b.add(task("t", "sleep 0.5; echo done\n"))
    rid = b.start("t")
    assert b.engine.dispatcher.dispatch_once().status == "activated"
    b.drive(lambda: b.run(rid).state == "running", dispatch=False)
    (pid,) = b.engine.live_pids()
    program = psutil.Process(pid).cmdline()[-1]
    assert os.path.dirname(program) == b.runs_dir and program.endswith(".pyc")
    st = os.lstat(program)
    assert st.st_mode & 0o777 == 0o600 and st.st_uid == os.geteuid()
    assert b.wait_run(rid).state == "succeeded"
    assert [n for n in os.listdir(b.runs_dir) if n.startswith(".shim-")] == [os.path.basename(program)]   # written once
    b.close()
    # A file at that name that is not ours alone is never run (nor replaced): the source is.
    os.chmod(program, 0o622)
    again = Bench(os.path.join(root, "s"))                 # a new agent: a new fork server
    rid = again.start("t")
    assert again.engine.dispatcher.dispatch_once().status == "activated"
    again.drive(lambda: again.run(rid).state == "running", dispatch=False)
    (pid,) = again.engine.live_pids()
    assert psutil.Process(pid).cmdline()[-1] == processes.SHIM_PATH
    assert again.wait_run(rid).state == "succeeded"
    assert os.lstat(program).st_mode & 0o777 == 0o622
    again.close()


def test_recovery_keeps_the_reason_of_a_start_failure_the_previous_agent_never_read(root):
    """The agent died while waiting for the start status; the shim wrote its receipt with
    the start error. The next agent ends the Attempt with that reason, not as lost."""
    from qlagent.adapters.artifacts import ArtifactAllocator
    from qlagent.core.profiles import EDGE
    b = Bench(os.path.join(root, "s"))
    b.add(task("t", "echo ran\n", cwd="/nonexistent/dir"))
    rid = b.start("t")
    aid = b.attempts(rid)[0].attempt_id
    run_dir = ArtifactAllocator(b.artifact_dir, EDGE, runs_root=b.runs_dir).run_dir(aid)
    art = os.path.join(root, "art.log")
    os.close(os.open(art, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    h = spawn_shim({"attempt_id": aid, "argv": ["/bin/sh", "-c", "echo ran"], "env": {},
                    "cwd": "/nonexistent/dir", "run_dir": run_dir, "artifact_path": art, "quota_bytes": 1024})
    assert h.popen.wait(10) == 0
    os.close(h.pidfd)
    b.store.write(lambda c: (c.execute("UPDATE runs SET state = 'starting' WHERE run_id = ?", (rid,)),
                             c.execute("UPDATE attempts SET state = 'starting' WHERE attempt_id = ?", (aid,))))
    assert b.engine.recover()["ingested"] == 1
    assert_start_failed(b, rid, "cwd_unusable", "cwd /nonexistent/dir: ENOENT (No such file or directory)")
    b.close()


@pytest.mark.parametrize("first_line, shown", [("#!/nonexistent/interp", "'/nonexistent/interp'"),
                                               ("#!/bin/sh\r", "'/bin/sh\\r'"),          # CRLF file
                                               ("#! /nonexistent/env python3", "'/nonexistent/env'")])
def test_a_script_whose_interpreter_is_missing_names_the_interpreter_not_the_script(root, first_line, shown):
    # The kernel's ENOENT is about the #! interpreter; "exec /x/job.sh: ENOENT" about a file the
    # user can see is there sends them looking in the wrong place (cron's classic CRLF fault).
    script = os.path.join(root, "job.sh")
    with open(script, "w", newline="") as f:
        f.write(first_line + "\necho ran\n")
    os.chmod(script, 0o755)
    b = Bench(os.path.join(root, "s"))
    b.add(task("t", None, command=[script]))
    rid = b.start("t")
    b.wait_run(rid, 20)
    assert_start_failed(b, rid, "exec_failed",
                        f"exec {script}: ENOENT (interpreter {shown} of its #! line not found)")
    b.close()
