"""The fork server (adapters/processes.ForkServer, shim/forkserver.py ``serve_forks``): a run starts
with a fork of a process that imported the shim once, and every promise of the shim holds.
Real fork servers, real shims and tasks on real files and FIFOs; the "agent" of the crash tests is
a real process killed with SIGKILL.
"""

from __future__ import annotations

import http.client
import json
import os
import py_compile
import select
import signal
import subprocess
import sys
import textwrap
import threading
import time

import psutil
import pytest
from execkit import Agent, Bench, procs_with_env, task
from kit import free_port, wait_until
from shimkit import PATH_ENV, compiled_shim, fork_served, make_spec

from qlagent.adapters import processes
from qlagent.application.cancel import request_cancel
from qlagent.core.clock import now_us
from qlagent.core.profiles import EDGE, STANDALONE
from qlagent.core.states import AttemptState, RunState
from qlagent.execution import coordinator

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def receipt_of(spec: dict, timeout: float = 20.0):
    return wait_until(lambda: processes.read_receipt(spec["run_dir"]), timeout, "the receipt")


def output_of(spec: dict) -> bytes:
    with open(spec["artifact_path"], "rb") as f:
        return f.read()


def test_runs_outlive_a_killed_fork_server_and_the_next_start_gets_a_new_one(tmp_path):
    fs = processes.ForkServer(str(tmp_path))
    specs = [make_spec(tmp_path, ["/bin/sh", "-c", "sleep 1; echo done $0", str(i)]) for i in range(3)]
    handles = [fork_served(fs, s, sys.executable) for s in specs]
    assert all(h.start_error is None for h in handles)
    (server,) = fs.pids()
    os.kill(server, signal.SIGKILL)
    wait_until(lambda: not psutil.pid_exists(server) or psutil.Process(server).status() == psutil.STATUS_ZOMBIE, 20)
    for i, (s, h) in enumerate(zip(specs, handles)):
        r = receipt_of(s)
        assert (r.exit_code, r.start_error) == (0, None)
        assert output_of(s) == b"done %d\n" % i
        os.close(h.pidfd)
    nxt = make_spec(tmp_path, ["/bin/sh", "-c", "echo again"])
    h = fork_served(fs, nxt, sys.executable)
    assert h.start_error is None and fs.pids() and server not in fs.pids()
    assert receipt_of(nxt).exit_code == 0 and output_of(nxt) == b"again\n"
    os.close(h.pidfd)


def test_a_shim_is_in_its_own_session_and_nobody_it_dies_with(tmp_path):
    fs = processes.ForkServer(str(tmp_path))
    spec = make_spec(tmp_path, ["/bin/sh", "-c", "sleep 30"])
    h = fork_served(fs, spec, sys.executable)
    assert os.getsid(h.pid) == h.pid                  # leads its own session, as a directly started shim
    assert processes.process_matches(h.pid, h.create_time)
    task_pid = wait_until(lambda: processes.read_task_pid(spec["run_dir"]), 20)
    assert psutil.Process(task_pid).ppid() == h.pid   # the task's leader is the shim's child
    processes.signal_tree(task_pid, h.pid, signal.SIGKILL, None, {})
    assert receipt_of(spec).signal == signal.SIGKILL
    os.close(h.pidfd)


AGENT = textwrap.dedent("""
    import json, os, sys, time
    sys.path.insert(0, "tests")
    from qlagent.adapters import processes
    from shimkit import fork_served
    spec = json.loads(sys.stdin.read())
    fs = processes.ForkServer(sys.argv[1])
    if sys.argv[2] == "before-spec":
        # The request is out and the shim forked; the agent dies before the spec reaches it.
        r, w = os.pipe()
        sr, sw = os.pipe()
        fs._send(sys.executable, r, sw)
        print(os.read(sr, 64).decode().split()[1], list(fs.pids())[0], flush=True)
    else:
        h = fork_served(fs, spec, sys.executable)
        print(h.pid, list(fs.pids())[0], flush=True)
    time.sleep(60)
""")


@pytest.mark.parametrize("when", ["before-spec", "after-start"])
def test_sigkill_of_the_agent_during_a_start(tmp_path, when):
    """Killed between the shim's fork and the task's exec the run never starts (the shim reads
    no spec and exits; nothing of it is left); killed after the start the run carries on to
    its receipt. Either way the fork server leaves with the agent."""
    spec = make_spec(tmp_path, ["/bin/sh", "-c", "sleep 0.5; echo finished"], env={**PATH_ENV, "QL3_ATTEMPT_ID": "x"})
    agent = subprocess.Popen([sys.executable, "-c", AGENT, str(tmp_path), when], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, cwd=REPO)
    agent.stdin.write(json.dumps(spec).encode())
    agent.stdin.close()
    shim, server = (int(x) for x in agent.stdout.readline().split())
    agent.kill()
    agent.wait()
    wait_until(lambda: not psutil.pid_exists(server), 20, "the fork server to leave")
    wait_until(lambda: not psutil.pid_exists(shim) or psutil.Process(shim).status() == psutil.STATUS_ZOMBIE,
               timeout=20, what="the shim to end")
    if when == "before-spec":
        assert processes.read_receipt(spec["run_dir"]) is None and output_of(spec) == b""
        assert not os.path.exists(os.path.join(spec["run_dir"], "task.pid"))
    else:
        assert receipt_of(spec).exit_code == 0 and output_of(spec) == b"finished\n"


def test_fifty_concurrent_starts(tmp_path):
    fs = processes.ForkServer(str(tmp_path))
    go = tmp_path / "go"                              # every task waits for it: all 50 live at once
    specs = [make_spec(tmp_path, ["/bin/sh", "-c", 'while [ ! -e "$1" ]; do sleep 0.05; done; echo $0', str(i),
                                  str(go)]) for i in range(50)]
    handles = [fork_served(fs, s, sys.executable) for s in specs]
    assert all(h.start_error is None for h in handles)
    assert sum(processes.process_matches(h.pid, h.create_time) for h in handles) == 50
    assert len({h.pid for h in handles}) == 50
    go.touch()
    for i, (s, h) in enumerate(zip(specs, handles)):
        r = receipt_of(s, 60)
        assert (r.exit_code, output_of(s)) == (0, b"%d\n" % i)
        os.close(h.pidfd)
    assert len(fs.pids()) == 1                        # one fork server served them all


def test_a_fork_server_that_cannot_start_fails_runs_with_its_reason_and_is_not_retried_in_a_storm(tmp_path,
                                                                                                 monkeypatch):
    monkeypatch.setattr(processes, "BACKOFF_MIN_S", 60.0)   # the second start surely falls in the back-off
    tries = tmp_path / "tries"
    broken = tmp_path / "python"
    # Counts its starts as the fork server (the shim's --compile run is not one).
    broken.write_text(f'#!/bin/sh\n[ "$4" = --compile ] || echo x >> {tries}\nexit 3\n')
    broken.chmod(0o755)
    b = Bench(str(tmp_path / "s"), profile=EDGE)
    b.add(task("t", "echo ran\n", concurrency="parallel"))
    b.engine._coordinator._procs._python = str(broken)
    first, second = b.start("t"), b.start("t")
    r = b.engine.dispatcher.dispatch_once()
    # Failed at once when the server was gone before the request, else when the loop learns it.
    assert r.run_id == first and r.status in ("launch_failed", "activated")
    b.drive(lambda: b.run(first).state == "failed", dispatch=False)
    assert b.attempts(first)[0].failure_reason == "shim_failed"
    assert b.attempts(first)[0].start_error == "shim: fork server: exited with status 3 before forking the shim"
    r = b.engine.dispatcher.dispatch_once()
    assert (r.status, r.run_id) == ("launch_failed", second)
    assert b.attempts(second)[0].start_error.startswith(
        "shim: fork server: exited with status 3 before forking the shim (next try in ")
    assert tries.read_text() == "x\n"                  # one start of the broken fork server, not two
    assert b.run(first).state == b.run(second).state == "failed"
    b.close()


# A stand-in fork server: it shuts its socket (the request's pipes go with it, so the agent's
# status pipe is at EOF), then lives on until the test lets it exit with status 3.
LINGERING = """
import os, time
os.close(0)
open({closed!r}, "w").close()
while not os.path.exists({go!r}):
    time.sleep(0.05)
os._exit(3)
"""


def test_a_fork_server_that_shuts_its_pipe_and_lingers_holds_up_no_loop_and_the_run_names_its_exit_status(tmp_path):
    """The fork server forks no shim and lingers before it exits: while it lives the agent's
    loop goes on (HTTP answers, the Run waits ``starting``); once it exited the Run fails with
    its exit status."""
    port = free_port()
    a = Agent(str(tmp_path), config=f'[http]\nlisten = "127.0.0.1:{port}"\n')
    a.add(task("t", "echo ran\n"))
    closed, go = tmp_path / "closed", tmp_path / "go"
    source = tmp_path / "lingering.py"
    source.write_text(LINGERING.format(closed=str(closed), go=str(go)))
    runs = os.path.join(a.state, "runs")
    os.makedirs(runs, mode=0o700, exist_ok=True)
    # Planted as the compiled shim of this interpreter: the agent's fork server runs it.
    program = processes._compiled_path(runs, sys.executable)
    py_compile.compile(str(source), cfile=program, doraise=True)
    os.chmod(program, 0o600)
    a.serve()
    try:
        rid = a.start("t")
        wait_until(closed.exists, 20, "the fork server to shut its socket")
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=20)
        conn.request("GET", "/healthz")
        assert conn.getresponse().status == 200
        conn.close()
        assert a.run(rid)["state"] == RunState.STARTING       # its reason, the exit status, is still to come
        go.touch()
        assert a.wait(rid)["state"] == RunState.FAILED
        (att,) = a.attempts(rid)
        assert (att["state"], att["failure_reason"], att["start_error"]) == \
            (AttemptState.START_FAILED, "shim_failed", "shim: fork server: exited with status 3 before forking the shim")
    finally:
        go.touch()
        assert a.stop() == 0


def test_a_spec_larger_than_the_pipe_goes_in_as_the_shim_reads_it_and_the_task_gets_its_environment_byte_exact(
        tmp_path):
    """Three environment values of ~96 KiB each (a spec of ~0.5 MiB, far over the pipe's 64 KiB):
    the start takes what the pipe holds and returns, even while the shim reads nothing (it is
    SIGSTOPped), and goes on as it reads; the task sees every byte of its environment."""
    alphabet = "".join(chr(c) for c in range(1, 0x3000) if not 0xD800 <= c < 0xE000)
    values = {f"BIG{i}": (alphabet * 4)[i * 7:][:34_000] for i in range(3)}
    assert all(90_000 < len(f"{k}={v}".encode()) < 131_072 for k, v in values.items())   # under MAX_ARG_STRLEN
    spec = make_spec(tmp_path, ["/bin/sh", "-c", 'printf "%s\\0%s\\0%s" "$BIG0" "$BIG1" "$BIG2"'],
                     env={**PATH_ENV, **values})
    fs = processes.ForkServer(str(tmp_path))
    compiled_shim(str(tmp_path))                      # compiled already: the request goes out at once
    st = fs.begin(spec, sys.executable)
    assert select.select([st.fd], [], [], 20)[0]      # the shim is forked: its pid line is there
    (server,) = fs.pids()
    (shim,) = psutil.Process(server).children()
    shim.suspend()
    wait_until(lambda: shim.status() == psutil.STATUS_STOPPED, 10, "the shim to stop")
    rescue = threading.Timer(10, shim.resume)         # a start that waited for the shim would hang here
    rescue.start()
    try:
        assert fs.advance(st) is None and st.phase == processes.StartPhase.SPEC
        assert shim.status() == psutil.STATUS_STOPPED
    finally:
        rescue.cancel()
        shim.resume()
    h = fork_served_until_done(fs, st)
    assert h.start_error is None and h.pid == shim.pid
    assert receipt_of(spec).exit_code == 0
    assert output_of(spec) == b"\0".join(values[f"BIG{i}"].encode() for i in range(3))
    os.close(h.pidfd)


def fork_served_until_done(fs, st):
    while True:
        h = fs.advance(st)
        if h is not None:
            return h
        select.select([st.fd], [], [], 20)


def test_fifty_runs_start_at_once_and_each_is_running_only_once_its_task_was_execd(tmp_path):
    """The dispatcher activates 50 Runs without waiting for one shim: all 50 are asked for
    (Attempts ``starting``) before any start is taken in, then each becomes ``running`` as its
    exec is reported, all 50 tasks live at once, each with its own output."""
    b = Bench(str(tmp_path / "s"), profile=STANDALONE, max_concurrent=50)
    go = tmp_path / "go"
    b.add(task("t", f'while [ ! -e {go} ]; do sleep 0.05; done; echo "$QL3_RUN_ID"\n', concurrency="parallel",
               timeout_s=120, memory_max="4M"))
    ids = [b.start("t") for _ in range(50)]
    results = [b.engine.dispatcher.dispatch_once() for _ in ids]
    assert [r.status for r in results] == ["activated"] * 50
    assert sorted(r.run_id for r in results) == sorted(ids)
    assert {b.attempts(r)[0].state for r in ids} == {"starting"}     # nothing recorded running yet
    b.drive(lambda: all(b.run(r).state == "running" for r in ids), 120, dispatch=False)
    assert len(set(b.engine.live_pids())) == 50
    go.touch()
    b.drive(lambda: all(b.run(r).state == "succeeded" for r in ids), 120, dispatch=False)
    for r in ids:
        with open(b.runs.log_source(r)[0]) as f:
            assert f.read() == r + "\n"
    assert len(b.engine._coordinator._procs._forks.pids()) == 1     # one fork server served them all
    b.close()


def test_a_cancel_that_comes_while_the_shim_starts_stops_the_task_once_it_runs(tmp_path):
    b = Bench(str(tmp_path / "s"))
    b.add(task("t", "sleep 30\n"))
    rid = b.start("t")
    assert b.engine.dispatcher.dispatch_once().status == "activated"
    request_cancel(b.store, rid, "test")
    assert b.engine.sweep_cancels() == 1              # before the start was taken in
    assert b.wait_run(rid).state == "cancelled"
    aid = b.attempts(rid)[0].attempt_id
    assert procs_with_env("QL3_ATTEMPT_ID", aid) == []
    b.close()


ENGINE_AGENT = textwrap.dedent("""
    import os, select, sys
    sys.path.insert(0, sys.argv[2])
    from execkit import Bench
    b = Bench(sys.argv[1])
    assert b.engine.dispatcher.dispatch_once().status == "activated"
    (fd,) = b.engine.pidfds()              # the start's status pipe; nothing taken in from it yet
    select.select([fd], [], [], 30)
    print(os.read(fd, 64).decode().split()[1], flush=True)     # the forked shim's "pid <n>"
    select.select([], [], [], 60)
""")


def test_an_agent_killed_between_the_shims_fork_and_the_exec_runs_nothing_and_the_next_one_runs_it_once(tmp_path):
    """The claim is committed and the shim forked, the agent is SIGKILLed before it took in the
    shim's PID (so before the spec went out): the shim execs nothing and leaves; the next
    agent's recovery sees that the start never reached the exec, ends the Attempt start_failed
    (agent_restart) and queues the Run again, whose next Attempt runs the task once."""
    marker = tmp_path / "ran"
    b = Bench(str(tmp_path / "s"))
    b.add(task("t", f"echo \"$QL3_ATTEMPT_ID\" >> {marker}\n"))
    rid = b.start("t")
    os.makedirs(b.runs_dir, mode=0o700, exist_ok=True)
    compiled_shim(b.runs_dir, sys.executable)     # compiled already: the request goes out at once
    agent = subprocess.Popen([sys.executable, "-c", ENGINE_AGENT, b.root, os.path.join(REPO, "tests")],
                             stdout=subprocess.PIPE, cwd=REPO)
    shim = int(agent.stdout.readline())
    assert b.attempts(rid)[0].state == "starting"
    agent.kill()
    agent.wait()
    wait_until(lambda: not psutil.pid_exists(shim) or psutil.Process(shim).status() == psutil.STATUS_ZOMBIE,
               timeout=20, what="the shim to end")
    aid = b.attempts(rid)[0].attempt_id
    assert not marker.exists() and processes.read_receipt(os.path.join(b.runs_dir, aid)) is None
    counts = b.engine.recover()
    assert (counts["requeued"], counts["lost"]) == (1, 0)
    first = b.attempts(rid)[0]
    assert (first.state, first.failure_reason) == ("start_failed", "agent_restart")
    assert b.run(rid).state == "queued" and not marker.exists()
    assert b.wait_run(rid).state == "succeeded"
    (second,) = [a for a in b.attempts(rid) if a.attempt_id != aid]
    assert marker.read_text().split() == [second.attempt_id]      # once, by the new Attempt
    b.close()


# An agent that stops (for ever) right after its shim got the whole spec: it never takes in the
# shim's "ok", so the Attempt stays starting while the task runs.
ENGINE_AGENT_PAST_SPEC = textwrap.dedent("""
    import select, sys
    sys.path.insert(0, sys.argv[2])
    from execkit import Bench
    from qlagent.adapters import processes
    give = processes.ForkServer._give_spec

    def given(st):
        done = give(st)
        if done:
            print("spec", flush=True)
            select.select([], [], [], 60)
        return done

    processes.ForkServer._give_spec = staticmethod(given)
    Bench(sys.argv[1]).drive(lambda: False, 60)
""")


def test_an_agent_killed_after_the_spec_went_out_ends_the_run_lost_and_its_task_never_runs_twice(tmp_path):
    """The shim got its spec and exec'd the task, but the agent was SIGKILLed before it took in
    the shim's ``ok`` (the Attempt is still ``starting``): the task may have run, so the next
    agent does not queue the Run again. The Attempt ends lost (agent_restart) with a ``run.lost``
    journal line, its task is killed, and it ran once."""
    marker = tmp_path / "ran"
    b = Bench(str(tmp_path / "s"))
    b.add(task("t", f'echo "$QL3_ATTEMPT_ID" >> {marker}\nsleep 60\n', timeout_s=120))
    rid = b.start("t")
    os.makedirs(b.runs_dir, mode=0o700, exist_ok=True)
    compiled_shim(b.runs_dir, sys.executable)
    agent = subprocess.Popen([sys.executable, "-c", ENGINE_AGENT_PAST_SPEC, b.root, os.path.join(REPO, "tests")],
                             stdout=subprocess.PIPE, cwd=REPO)
    assert agent.stdout.readline() == b"spec\n"
    wait_until(lambda: marker.exists() and marker.read_text().strip(), 20, "the task's exec")
    aid = b.attempts(rid)[0].attempt_id
    assert b.attempts(rid)[0].state == "starting"
    agent.kill()
    agent.wait()
    counts = b.engine.recover()
    assert (counts["requeued"], counts["lost"]) == (0, 1)
    (att,) = b.attempts(rid)
    assert (att.state, att.failure_reason, b.run(rid).state) == ("lost", "agent_restart", "lost")
    assert (("warning", "run.lost"), {"run": rid, "attempt": aid, "reason": "agent_restart"}) in b.log_lines
    wait_until(lambda: not procs_with_env("QL3_ATTEMPT_ID", aid), 10, "recovery to stop the task")
    assert marker.read_text().split() == [aid]
    b.close()


def test_a_killed_fork_server_leaves_the_agents_live_runs_to_finish_and_the_next_run_gets_a_new_one(tmp_path):
    """Through the agent: SIGKILL of the fork server while two Runs run; both end succeeded with
    their whole output (their shims and receipts never depended on it), and the next Run is
    forked by a new fork server."""
    b = Bench(str(tmp_path / "s"), profile=STANDALONE)
    go = tmp_path / "go"
    b.add(task("t", f'while [ ! -e {go} ]; do sleep 0.05; done; echo "$QL3_RUN_ID"\n', concurrency="parallel"))
    ids = [b.start("t") for _ in range(2)]
    b.drive(lambda: all(b.run(r).state == "running" for r in ids))
    forks = b.engine._coordinator._procs._forks
    (server,) = forks.pids()
    os.kill(server, signal.SIGKILL)
    wait_until(lambda: not psutil.pid_exists(server) or psutil.Process(server).status() == psutil.STATUS_ZOMBIE, 20)
    go.touch()
    for r in ids:
        assert b.wait_run(r).state == "succeeded"
        with open(b.runs.log_source(r)[0]) as f:
            assert f.read() == r + "\n"
    nxt = b.start("t")
    assert b.wait_run(nxt).state == "succeeded"
    assert forks.pids() and server not in forks.pids()
    b.close()


# ---- the start bound (core.limits.SHIM_START_BOUND_US): a start that cannot finish ends, with its reason ----

BOUND_S = 2


@pytest.fixture
def short_bound(monkeypatch):
    """The start bound cut to BOUND_S seconds, for the coordinator and for the fork server's reasons."""
    monkeypatch.setattr(coordinator, "SHIM_START_BOUND_US", BOUND_S * 1_000_000)
    monkeypatch.setattr(processes, "START_STATUS_TIMEOUT_S", float(BOUND_S))


def stopped(pid: int) -> psutil.Process:
    p = psutil.Process(pid)
    p.suspend()
    wait_until(lambda: p.status() == psutil.STATUS_STOPPED, 10, "the fork server to stop")
    return p


def test_a_stalled_fork_server_fails_the_start_at_the_bound_and_the_next_run_gets_a_new_one(tmp_path, short_bound):
    """A fork server that forks nothing (SIGSTOPped) leaves no Run ``starting``: at the bound the
    start fails with the reason, and once the back-off has passed the next Run is forked by a new
    fork server."""
    b = Bench(str(tmp_path / "s"))
    b.add(task("t", "echo ran\n", concurrency="parallel"))
    assert b.wait_run(b.start("t")).state == "succeeded"
    forks = b.engine._coordinator._procs._forks
    (server,) = forks.pids()
    frozen = stopped(server)
    try:
        rid = b.start("t")
        assert b.wait_run(rid).state == "failed"
        (att,) = b.attempts(rid)
        assert (att.failure_reason, att.start_error) == \
            ("shim_failed", f"shim: fork server: no shim forked within {BOUND_S} s")
        wait_until(lambda: time.monotonic() >= forks._retry_at, 10, "the back-off to pass")
        nxt = b.start("t")
        assert b.wait_run(nxt).state == "succeeded"
        assert forks._popen.pid != server
    finally:
        frozen.kill()
    b.close()


def test_a_clock_set_back_does_not_extend_the_start_bound(tmp_path, short_bound):
    """The bound is on the monotonic clock: the store clock set back an hour while a start waits
    on a stalled fork server still ends the start at the bound, not an hour later."""
    b = Bench(str(tmp_path / "s"))
    b.add(task("t", "echo ran\n"))
    assert b.wait_run(b.start("t")).state == "succeeded"
    (server,) = b.engine._coordinator._procs._forks.pids()
    frozen = stopped(server)
    try:
        rid = b.start("t")
        assert b.engine.dispatcher.dispatch_once().status == "activated"
        b.engine._coordinator._now = lambda: now_us() - 3_600_000_000
        assert b.wait_run(rid).state == "failed"
        assert b.attempts(rid)[0].start_error == f"shim: fork server: no shim forked within {BOUND_S} s"
    finally:
        frozen.kill()
    b.close()


def test_a_clock_set_forward_does_not_end_a_start_in_flight(tmp_path, short_bound):
    """A router's clock steps forward by years at its first NTP answer, often while its first Runs
    start: a start then in flight goes on (the bound is on the monotonic clock)."""
    b = Bench(str(tmp_path / "s"))
    b.add(task("t", "echo ran\n"))
    assert b.wait_run(b.start("t")).state == "succeeded"
    (server,) = b.engine._coordinator._procs._forks.pids()
    frozen = stopped(server)
    rid = b.start("t")
    assert b.engine.dispatcher.dispatch_once().status == "activated"
    b.engine._coordinator._now = lambda: now_us() + 10 * 365 * 86_400_000_000
    b.engine.tick()                      # what the loop does at its next wake-up
    frozen.resume()
    assert b.wait_run(rid).state == "succeeded"
    b.close()


def test_a_shim_that_has_not_started_its_task_at_the_bound_is_killed_and_the_start_fails(tmp_path):
    """The shim was forked and got its spec but does not report the exec (here it blocks opening
    its Artifact, a FIFO nobody reads): at the bound it is killed and the start fails with the
    reason, instead of counting as started with no task to stop. The task never runs."""
    fs = processes.ForkServer(str(tmp_path))
    marker = tmp_path / "ran"
    spec = make_spec(tmp_path, ["/bin/sh", "-c", f"touch {marker}"])
    os.unlink(spec["artifact_path"])
    os.mkfifo(spec["artifact_path"], 0o600)
    h = fork_served(fs, spec, sys.executable, status_timeout_s=BOUND_S)
    assert h.start_error == f"shim: the task was not started within {BOUND_S} s; the shim was killed"
    wait_until(lambda: not processes.process_matches(h.pid, h.create_time), 10, "the shim to be gone")
    assert not marker.exists()
    if h.pidfd is not None:
        os.close(h.pidfd)


def test_a_start_left_on_a_retired_fork_server_does_not_retire_its_successor(tmp_path):
    """Two starts wait on a stalled fork server; the first's bound retires it and a new one
    serves the next Run; the second's bound then fails only that start: the new server stays,
    no back-off is charged, and the Run after it starts at once."""
    fs = processes.ForkServer(str(tmp_path))
    first = fork_served(fs, make_spec(tmp_path, ["/bin/true"]), sys.executable)
    (server,) = fs.pids()
    frozen = stopped(server)
    try:
        early_end = time.monotonic() + 1
        early = fs.begin(make_spec(tmp_path, ["/bin/true"]), sys.executable, status_timeout_s=1)
        late_end = time.monotonic() + BOUND_S + 2
        late = fs.begin(make_spec(tmp_path, ["/bin/true"]), sys.executable, status_timeout_s=BOUND_S + 2)
        wait_until(lambda: time.monotonic() >= early_end, 10)
        with pytest.raises(processes.ShimSpawnError, match="no shim forked within 1 s"):
            fs.advance(early, expired=True)
        wait_until(lambda: time.monotonic() >= fs._retry_at, 10, "the back-off to pass")
        assert fork_served(fs, make_spec(tmp_path, ["/bin/true"]), sys.executable).start_error is None
        successor = fs._popen.pid
        wait_until(lambda: time.monotonic() >= late_end, 10)
        with pytest.raises(processes.ShimSpawnError, match="no shim forked within"):
            fs.advance(late, expired=True)
        h = fork_served(fs, make_spec(tmp_path, ["/bin/true"]), sys.executable)
        assert h.start_error is None and fs._popen.pid == successor
    finally:
        frozen.kill()
    for x in (first, h):
        os.close(x.pidfd)


def test_a_compile_that_hangs_is_killed_at_the_bound_and_the_next_start_runs_the_shim_from_source(tmp_path):
    """The shim's compile for a new fork server never ends: the start waiting for it fails at
    the bound with the reason, the compile is killed, and the next start runs the shim from
    its source instead of waiting for a compile again."""
    python = tmp_path / "python"
    python.write_text(f'#!/bin/sh\n[ "$4" = --compile ] && exec sleep 600\nexec {sys.executable} "$@"\n')
    python.chmod(0o755)
    fs = processes.ForkServer(str(tmp_path))
    end = time.monotonic() + BOUND_S
    st = fs.begin(make_spec(tmp_path, ["/bin/true"]), str(python), status_timeout_s=BOUND_S)
    assert st.phase == processes.StartPhase.COMPILING
    (compile_pid,) = fs.pids()
    wait_until(lambda: time.monotonic() >= end, 10)
    with pytest.raises(processes.ShimSpawnError, match=f"the shim was not compiled within {BOUND_S} s"):
        fs.advance(st, expired=True)
    wait_until(lambda: not psutil.pid_exists(compile_pid) or
               psutil.Process(compile_pid).status() == psutil.STATUS_ZOMBIE, 10, "the compile to be killed")
    wait_until(lambda: time.monotonic() >= fs._retry_at, 10, "the back-off to pass")
    spec = make_spec(tmp_path, ["/bin/sh", "-c", "echo from source"])
    h = fork_served(fs, spec, str(python))
    assert h.start_error is None and receipt_of(spec).exit_code == 0 and output_of(spec) == b"from source\n"
    assert psutil.Process(fs._popen.pid).cmdline()[-1] == processes.SHIM_PATH
    os.close(h.pidfd)
