"""The fleet Worker (issue 11) end to end against the Worker-protocol STUB (tests/fleet/stubcp.py):
real `qlagent serve` child processes with a [worker] table, real TLS over loopback, real shims,
task processes, inbox and log files. The fleet integration test replaces the stub with real
control-plane replicas on PostgreSQL."""

from __future__ import annotations

import glob
import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import psutil
import pytest

from stubcp import StubControlPlane, make_ca, now_us, worker_config, write_credential
from kit import PausingLink, Serve, SilentLink, clean_env, fill, free_port, run_cli, wait_until

QUOTA = 4_194_304
SECRET = "s3cr3t-value-never-at-rest-9f2c"


class Worker:
    """One `qlagent serve` Worker process over a state directory (restartable)."""

    def __init__(self, tmp, cp: StubControlPlane, url: str, *, ca_file=None, cred_mode=0o600, slots=2,
                 extra="", drain_grace_s: float | None = None) -> None:
        self.tmp, self.cp = tmp, cp
        self.state = str(tmp / "state")
        self.worker_id, cred = cp.enrol()
        self.cred = write_credential(str(tmp / "credential"), cred, cred_mode)
        self.cfg = worker_config(str(tmp / "qlagent.toml"), state_dir=self.state, worker_id=self.worker_id, url=url,
                                 credential_file=self.cred, ca_file=ca_file or cp.ca_file, slots=slots, extra=extra,
                                 drain_grace_s=drain_grace_s)
        self.p: Serve | None = None
        self.serves: list[Serve] = []

    def start(self, *serve_args: str, env: dict | None = None) -> "Worker":
        """``qlagent --config CFG serve SERVE_ARGS`` (environment ``env``, default a clean one);
        returns at once."""
        self.p = Serve("--config", self.cfg, serve_args=serve_args, env=env, ready=None)
        self.serves.append(self.p)
        return self

    def kill(self) -> None:
        self.p.kill()

    def stop(self) -> int:
        try:
            return self.p.stop(30)
        except subprocess.TimeoutExpired:
            return self.p.returncode

    def journal(self) -> str:
        """What every start of this Worker journalled."""
        return "".join(p.journal() for p in self.serves)


@pytest.fixture
def cp(tmp_path):
    stub = StubControlPlane(str(tmp_path), lease_ttl_s=6, session_ttl_s=6)
    stub.url = stub.start()
    yield stub
    stub.stop()


@pytest.fixture
def worker(tmp_path, cp):
    w = Worker(tmp_path, cp, cp.url)
    yield w
    if w.p is not None:
        w.stop()
    for p in psutil.process_iter():          # nothing of a test's runs outlives it
        try:
            if any(a.startswith(str(tmp_path)) for a in p.cmdline()[1:]):
                p.kill()
        except psutil.Error:
            pass


def completion(cp, aid):
    with cp.lock:
        return next((a for a in cp.acks if a.attempt_id == aid and a.kind == "completion"), None)


def read_pid(path, timeout_s=20.0) -> int:
    def pid() -> int | None:
        try:
            with open(path) as f:
                return int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            return None
    return wait_until(pid, timeout_s, f"a PID in {path}", step=0.05)


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_pull_run_acks_and_complete_log_chunks_chatty_truncated_at_quota(tmp_path, cp, worker):
    chatty = cp.add_run(shell="/bin/sh", script="yes chatty-line-0123456789 | head -c 5000000; echo \"$API_TOKEN\" >&2",
                        secrets={"API_TOKEN": SECRET.encode()})
    small = cp.add_run(argv=["/bin/echo", "hello", "fleet"])
    worker.start()
    assert cp.wait(lambda: all(any(a.attempt_id == x and a.kind == "completion" for a in cp.acks)
                               for x in (chatty, small)), 60)
    assert cp.acks_of(chatty) == cp.acks_of(small) == ["starting", "running", "completion"]
    c = completion(cp, chatty)
    assert (c.exit_code, c.bytes_kept, c.bytes_dropped) == (0, QUOTA, 5_000_000 + len(SECRET) + 1 - QUOTA)
    assert completion(cp, small).exit_code == 0 and c.truncation_reason is None     # the quota: the default
    # Every kept byte reaches the control plane, in order; then the local Artifact is pruned.
    assert cp.wait(lambda: len(cp.logs.get(chatty, b"")) == QUOTA and cp.logs.get(small) == b"hello fleet\n", 30)
    expected = (b"chatty-line-0123456789\n" * (QUOTA // 23 + 1))[:QUOTA]
    assert cp.log_of(chatty) == expected
    runs = os.path.join(worker.state, "worker-runs")
    assert cp.wait(lambda: not glob.glob(os.path.join(runs, "*-*")), 20)
    # The secret went to the task in memory only: not in the inbox, its WAL or the journal.
    for path in glob.glob(os.path.join(worker.state, "inbox.sqlite3*")):
        with open(path, "rb") as f:
            assert SECRET.encode() not in f.read()
    assert SECRET not in worker.journal()
    assert worker.stop() == 0


def test_a_quota_above_the_workers_profile_is_cut_to_it(tmp_path, cp, worker):
    """A replica of the standalone Profile offers a 64 MiB log quota; an edge Worker keeps 4 MiB
    (its Profile's log_max_bytes): the flash is the Worker's to bound."""
    big = cp.add_run(shell="/bin/sh", script="yes chatty-line-0123456789 | head -c 5000000",
                     log_quota_bytes=64 * 1_048_576)
    worker.start()
    assert cp.wait(lambda: completion(cp, big) is not None, 60)
    c = completion(cp, big)
    assert (c.exit_code, c.bytes_kept, c.bytes_dropped) == (0, QUOTA, 5_000_000 - QUOTA)
    assert cp.wait(lambda: cp.log_ends.get(big) == QUOTA, 30)


def test_a_control_url_list_moves_past_a_replica_that_does_not_answer(tmp_path, cp):
    """worker.control_url lists replicas: the first refuses connections, so the Worker opens its
    Session, pulls, ACKs and uploads through the second."""
    with socket.socket() as s:              # a port nobody listens on: connection refused
        s.bind(("127.0.0.1", 0))
        dead = f"https://localhost:{s.getsockname()[1]}"
    w = Worker(tmp_path, cp, [dead, cp.url])
    small = cp.add_run(argv=["/bin/echo", "via", "the", "second"])
    w.start()
    try:
        assert cp.wait(lambda: cp.logs.get(small) == b"via the second\n", 30)
        assert cp.acks_of(small) == ["starting", "running", "completion"]
        assert "localhost:%s" % dead.rsplit(":", 1)[1] in w.journal()      # the refusal named the replica
        (ready,) = [ln for ln in w.journal().splitlines() if "worker.ready" in ln]
        assert f"control={dead},{cp.url} " in ready + " " and "ControlClient" not in ready, ready
    finally:
        assert w.stop() == 0


def test_a_run_that_cannot_be_reattached_after_a_restart_is_stopped_not_left_running(tmp_path, cp, worker):
    """The Worker died after spawning a shim and before writing its identity (shim.json): the
    restarted Worker cannot re-attach it, reports it lost, and stops what still runs, so the
    Attempt offered again never runs beside it."""
    pidfile = tmp_path / "task.pid"
    aid = cp.add_run(shell="/bin/sh", script=f"echo $$ > {pidfile}; exec sleep 60")
    worker.start()
    assert cp.wait(lambda: "running" in cp.acks_of(aid), 30)
    task_pid = read_pid(str(pidfile))
    worker.kill()
    os.unlink(os.path.join(worker.state, "worker-runs", aid, "shim.json"))
    worker.start()
    assert cp.wait(lambda: gone(task_pid), 20), "the task the Worker lost still runs"
    assert cp.wait(lambda: f"worker.run_lost attempt={aid}" in worker.journal(), 10)


def test_a_task_left_by_a_worker_whose_state_dir_was_wiped_is_stopped_at_its_next_start(tmp_path, cp, worker):
    """Issue #20 point 3: the Worker and the run's shim SIGKILLed, then the state directory lost
    (a reflashed overlay): no inbox row names the Attempt any more, yet the task it left must not
    run beside the copy the control plane offers again. Its leader died with the shim; what it
    forked is found by the Worker's tag at the next start and stopped."""
    child = tmp_path / "child.pid"
    aid = cp.add_run(shell="/bin/sh", script=f"sleep 120 & echo $! > {child}; wait")
    worker.start()
    assert cp.wait(lambda: "running" in cp.acks_of(aid), 30)
    sleeper = read_pid(str(child))
    with open(os.path.join(worker.state, "worker-runs", aid, "shim.json")) as f:
        shim = json.load(f)["pid"]
    leader = psutil.Process(sleeper).ppid()
    worker.kill()
    os.kill(shim, signal.SIGKILL)
    assert cp.wait(lambda: gone(leader), 5), "the task's leader outlived its shim"
    assert not gone(sleeper)
    subprocess.run(["rm", "-rf", worker.state], check=True)
    worker.start()
    assert cp.wait(lambda: gone(sleeper), 20), "the old task still runs beside the Attempt offered again"
    assert cp.wait(lambda: f"worker.stray_stopped attempt={aid} processes=1" in worker.journal(), 10)


def test_a_daemon_a_keep_orphans_task_left_behind_survives_a_worker_restart(tmp_path, cp, worker):
    """``keep_orphans = true`` holds on a Worker as on the local agent: once the run is done and
    acknowledged its inbox row no longer names the Attempt, yet the daemon it left on purpose (a
    VPN, a watchdog) is no stray, and the start-up scan must not kill it at every restart."""
    child = tmp_path / "daemon.pid"
    aid = cp.add_run(shell="/bin/sh", script=f"setsid sleep 300 >/dev/null 2>&1 & echo $! > {child}; echo started",
                     keep_orphans=True)
    worker.start()
    assert cp.wait(lambda: completion(cp, aid) is not None, 30)
    daemon = psutil.Process(read_pid(str(child)))
    try:
        # The row is acknowledged and closed (its run directory goes with it).
        assert cp.wait(lambda: not os.path.exists(os.path.join(worker.state, "worker-runs", aid)), 20)
        assert worker.stop() == 0
        worker.start()
        assert cp.wait(lambda: worker.journal().count("worker.ready") == 2, 20)   # its scan is done
        time.sleep(0.5)
        assert daemon.is_running() and daemon.status() != psutil.STATUS_ZOMBIE
        assert f"worker.stray_stopped attempt={aid}" not in worker.journal()
    finally:
        daemon.kill()


def test_more_offers_than_the_inbox_cap_over_a_lifetime_keep_flowing(tmp_path, cp):
    """The inbox caps rows at once (edge: 64), not offers ever: acknowledged rows make room, so a
    Worker that has finished 64 runs still pulls the 65th and later."""
    from qlagent.core.profiles import EDGE
    w = Worker(tmp_path, cp, cp.url, slots=4)
    ids = [cp.add_run(argv=["/bin/true"]) for _ in range(EDGE.inbox_rows + 4)]
    w.start()
    try:
        assert cp.wait(lambda: all(completion(cp, a) is not None for a in ids), 120), \
            f"{sum(completion(cp, a) is not None for a in ids)} of {len(ids)} completed"
    finally:
        assert w.stop() == 0


def test_a_restart_while_one_replica_is_down_reattaches_through_the_other(tmp_path, cp):
    """Restarted with its first control_url dead, the Worker must not take that one refusal for
    "the control plane is unreachable" and kill the run it re-attached: the second replica
    answers, the Session adopts the Lease, and the run completes once."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"https://localhost:{s.getsockname()[1]}"
    marks = tmp_path / "marks"
    w = Worker(tmp_path, cp, [dead, cp.url])
    aid = cp.add_run(shell="/bin/sh", script=f"echo started >> {marks}; sleep 3; echo finished")
    w.start()
    try:
        assert cp.wait(lambda: "running" in cp.acks_of(aid), 30)
        w.kill()
        w.start()
        assert cp.wait(lambda: completion(cp, aid) is not None, 40)
        assert completion(cp, aid).exit_code == 0 and marks.read_text() == "started\n"
        assert "worker.lease_lost" not in w.journal()
    finally:
        assert w.stop() == 0


def test_a_lost_pull_answer_is_retried_byte_identical_and_runs_once(tmp_path, cp, worker):
    marks = tmp_path / "marks"
    cp.drop_next_pull_answer()
    aid = cp.add_run(shell="/bin/sh", script=f"echo ran >> {marks}")
    worker.start()
    assert cp.wait(lambda: completion(cp, aid) is not None, 40)
    bodies = list(cp.pull_bodies)
    first = json.loads(bodies[0])
    # The request whose answer was lost went again byte for byte (same pullId and lease token).
    assert bodies[1] == bodies[0] and json.loads(bodies[1])["pullId"] == first["pullId"]
    assert cp.lease(aid)["generation"] == 1
    assert marks.read_text() == "ran\n"
    assert cp.acks_of(aid) == ["starting", "running", "completion"]


def test_worker_sigkilled_mid_run_restarts_reattaches_and_resends(tmp_path, cp, worker):
    marks = tmp_path / "marks"
    aid = cp.add_run(shell="/bin/sh", script=f"echo started >> {marks}; sleep 3; echo finished")
    worker.start()
    assert cp.wait(lambda: "running" in cp.acks_of(aid), 30)
    worker.kill()
    worker.start()
    assert cp.wait(lambda: completion(cp, aid) is not None, 40)
    assert marks.read_text() == "started\n"                     # re-attached, never spawned twice
    assert cp.acks_of(aid) == ["starting", "running", "completion"]
    assert completion(cp, aid).exit_code == 0
    assert cp.wait(lambda: cp.log_of(aid) == b"finished\n", 20)
    # The restart opened a new Session whose hello adopted the live run's Lease (same lease
    # generation, now fenced by the new Worker generation): completed once, never re-offered.
    first, second = cp.hellos
    assert first.adopt == () and [c.attempt_id for c in second.adopt] == [aid]
    lease = cp.lease(aid)
    assert (lease["generation"], lease["worker_generation"], lease["session"]) == (1, 2, cp.workers[
        worker.worker_id]["session"]) and cp.state(aid) == "ended"
    assert second.adopt[0].lease_token not in worker.journal()
    assert "worker.lease_adopted" in worker.journal()


def test_a_restarted_worker_renews_an_adopted_lease_at_once_instead_of_killing_the_run(tmp_path):
    # The hello adopts the Lease with the expiry it had (docs/worker-protocol.md): after a
    # restart late in the Lease, less than the fencing margin plus one heartbeat interval is
    # left. The Worker must renew it at once rather than wait a heartbeat and self-fence a run
    # it could keep (here: lease_ttl_s 12, heartbeat 2 s, restart soon after a beat).
    stub = StubControlPlane(str(tmp_path), lease_ttl_s=12, session_ttl_s=12)
    stub.url = stub.start()
    w = Worker(tmp_path, stub, stub.url)
    w.cfg = worker_config(w.cfg, state_dir=w.state, worker_id=w.worker_id, url=stub.url, credential_file=w.cred,
                          ca_file=stub.ca_file, heartbeat_s=2)
    try:
        marks = tmp_path / "marks"
        aid = stub.add_run(shell="/bin/sh", script=f"echo started >> {marks}; sleep 4; echo finished")  # margin 3 s
        w.start()
        assert stub.wait(lambda: "running" in stub.acks_of(aid), 30)
        w.kill()
        stub.adopt_left_us = 3_500_000        # margin + 0.5 s, less than the first beat (≥ 1.6 s)
        w.start()
        assert stub.wait(lambda: completion(stub, aid) is not None, 30), w.journal()
        assert completion(stub, aid).exit_code == 0, w.journal()
        assert stub.wait(lambda: stub.log_of(aid) == b"finished\n", 20)
        assert "worker.lease_adopted" in w.journal() and "worker.lease_lost" not in w.journal(), w.journal()
        assert marks.read_text() == "started\n"                 # kept, never killed and run again
    finally:
        w.stop()
        stub.stop()


@pytest.mark.parametrize("reachable", [True, False])
def test_serve_exit_after_ends_a_worker_with_the_sigterm_drain(tmp_path, cp, worker, reachable):
    # `serve --exit-after S` ends a Worker too, through its SIGTERM drain, reachable or not.
    if not reachable:
        worker.cfg = worker_config(worker.cfg, state_dir=worker.state, worker_id=worker.worker_id,
                                   url=f"https://127.0.0.1:{free_port()}", credential_file=worker.cred,
                                   ca_file=cp.ca_file)
    worker.start("--exit-after", "1")
    assert worker.p.wait(30) == 0, worker.journal()
    assert "worker.draining" in worker.journal()
    assert run_cli("--config", worker.cfg, "serve", "--exit-after", "-1", timeout=30).returncode == 2


def test_two_processes_with_one_credential_back_off_and_say_so_instead_of_a_hello_storm(tmp_path, cp, worker):
    # A second `serve` with the first's credential must not make both reopen a Session at once
    # on every stale_generation (a hello storm, each fencing the other's runs).
    (tmp_path / "twin").mkdir()
    twin = Worker(tmp_path / "twin", cp, cp.url)
    twin.worker_id, twin.cred = worker.worker_id, worker.cred
    twin.cfg = worker_config(twin.cfg, state_dir=twin.state, worker_id=worker.worker_id, url=cp.url,
                             credential_file=worker.cred, ca_file=cp.ca_file)
    worker.start()
    assert cp.wait(lambda: len(cp.hellos) >= 1, 30)
    twin.start()
    try:
        assert cp.wait(lambda: "worker.session_replaced" in worker.journal() + twin.journal(), 30)
        time.sleep(5)                           # both keep trying: count the hellos meanwhile
        assert len(cp.hellos) < 30, len(cp.hellos)
        assert "another process uses this Worker's credential" in worker.journal() + twin.journal()
    finally:
        twin.stop()


def test_a_run_that_ended_while_the_worker_was_down_is_adopted_and_its_completion_accepted(tmp_path, cp, worker):
    done = tmp_path / "done"
    aid = cp.add_run(shell="/bin/sh", script=f"sleep 1; echo ended-alone; touch {done}")
    worker.start()
    assert cp.wait(lambda: "running" in cp.acks_of(aid), 30)
    worker.kill()
    wait_until(done.exists, 20, "the run to end while its Worker is down", step=0.05)
    worker.start()
    assert cp.wait(lambda: completion(cp, aid) is not None and cp.log_of(aid) == b"ended-alone\n", 30), \
        worker.journal()
    assert [c.attempt_id for c in cp.hellos[-1].adopt] == [aid]
    assert completion(cp, aid).generation == 2 and completion(cp, aid).exit_code == 0


def test_a_restart_whose_adoption_is_refused_kills_the_reattached_run(tmp_path, cp, worker):
    pidfile = tmp_path / "task.pid"
    aid = cp.add_run(shell="/bin/sh", script=f"echo $$ > {pidfile}; exec sleep 60")
    worker.start()
    assert cp.wait(lambda: "running" in cp.acks_of(aid), 30)
    pid = read_pid(pidfile)
    worker.kill()
    cp.expire_lease(aid)                        # down longer than the Lease: the new Session may not adopt it
    worker.start()
    wait_until(lambda: gone(pid), 15, f"the task {pid} gone", step=0.05, detail=worker.journal)
    assert [c.attempt_id for c in cp.hellos[-1].adopt] == [aid]
    # Refused as expired — or as not found when the dead Worker's long-poll, still waiting in the
    # control plane, claimed the re-queued Run under the old Session first (a newer Lease).
    assert re.search(rf"worker\.lease_gone attempt={aid} code=lease_(expired|not_found)\n", worker.journal())
    assert completion(cp, aid) is None          # nothing of the refused Lease is reported


def test_a_worker_restarted_between_its_starting_ack_and_the_spawn_gets_the_secrets_again(tmp_path, cp, worker):
    aid = cp.add_run(shell="/bin/sh", script='printf %s "$API_TOKEN"', secrets={"API_TOKEN": SECRET.encode()})
    cp.drop_ack_answers = True                  # the starting ACK is applied; the Worker never hears so
    worker.start()
    assert cp.wait(lambda: cp.acks_of(aid) == ["starting"], 30)
    worker.kill()                               # before the spawn: the secret values are gone
    assert not os.path.exists(os.path.join(worker.state, "worker-runs", aid))
    cp.drop_ack_answers = False
    worker.start()
    assert cp.wait(lambda: completion(cp, aid) is not None, 30), worker.journal()
    assert cp.acks_of(aid) == ["starting", "running", "completion"] and completion(cp, aid).exit_code == 0
    assert cp.wait(lambda: cp.log_of(aid) == SECRET.encode(), 20)        # the task got the value
    # The new Session adopted the Lease (the row was still "received") and sent the Pull that
    # brought the offer again: same pullId and lease token, its own fence; no second claim.
    assert [c.attempt_id for c in cp.hellos[-1].adopt] == [aid]
    pull_id = cp.lease(aid)["pull_id"]
    same = [json.loads(b) for b in cp.pull_bodies if json.loads(b)["pullId"] == pull_id]
    assert len(same) == 2 and same[0]["leaseToken"] == same[1]["leaseToken"]
    assert (same[0]["generation"], same[1]["generation"]) == (1, 2) and cp.lease(aid)["generation"] == 1
    assert "worker.secrets_refetched" in worker.journal() and SECRET not in worker.journal()
    for path in glob.glob(os.path.join(worker.state, "inbox.sqlite3*")):
        with open(path, "rb") as f:
            assert SECRET.encode() not in f.read()


@pytest.mark.parametrize("policy", ["kill", "keep"])
def test_control_plane_unreachable_longer_than_the_lease(tmp_path, cp, worker, policy):
    pidfile = tmp_path / "task.pid"
    aid = cp.add_run(shell="/bin/sh", script=f"echo $$ > {pidfile}; exec sleep 60", on_lease_loss=policy)
    worker.start()
    assert cp.wait(lambda: "running" in cp.acks_of(aid), 30)
    pid = read_pid(pidfile)
    cp.wait(lambda: False, 1.5)                 # a heartbeat renews the Lease after running
    cp.partition(True)
    expires_us = cp.lease(aid)["expires"]
    deadline = time.monotonic() + (expires_us / 1e6 - time.time()) + 3
    while time.monotonic() < deadline and not gone(pid):
        time.sleep(0.05)
    if policy == "kill":
        # Dead before the control plane could see the Lease expire and offer the Attempt again.
        assert gone(pid) and time.time_ns() // 1000 < expires_us
        assert "worker.lease_lost" in worker.journal() and "action=kill" in worker.journal()
    else:
        assert not gone(pid)
        assert "action=keep" in worker.journal()
        os.kill(pid, signal.SIGKILL)            # the kept run would hold the Worker's stop for its drain_grace_s
    cp.partition(False)


@pytest.mark.parametrize("policy", ["kill", "keep"])
def test_a_dead_workers_shim_stops_the_run_before_its_lease_can_expire(tmp_path, cp, worker, policy):
    pidfile = tmp_path / "task.pid"
    aid = cp.add_run(shell="/bin/sh", script=f"echo $$ > {pidfile}; exec sleep 60", on_lease_loss=policy)
    worker.start()
    assert cp.wait(lambda: "running" in cp.acks_of(aid), 30)
    pid = read_pid(pidfile)
    cp.wait(lambda: False, 1.5)                 # a heartbeat renews the Lease after running
    worker.kill()                               # nobody renews it any more; the shim lives on
    expires_us = cp.lease(aid)["expires"]
    deadline = time.monotonic() + (expires_us / 1e6 - time.time()) + 1
    while time.monotonic() < deadline and not gone(pid):
        time.sleep(0.05)
    receipt = os.path.join(worker.state, "worker-runs", aid, "receipt.json")
    if policy == "kill":
        # Dead before the control plane could see the Lease expire and offer the Attempt again.
        assert gone(pid) and time.time_ns() // 1000 < expires_us
        wait_until(lambda: os.path.exists(receipt), 10, receipt, step=0.05)
        with open(receipt) as f:
            doc = json.load(f)
        assert doc["lease_lost"] is True and doc["signal"] == signal.SIGTERM
    else:
        assert not gone(pid) and not os.path.exists(receipt)     # keep: at-least-once, it runs on
        os.kill(pid, signal.SIGKILL)


def test_a_cut_shorter_than_the_lease_keeps_the_session_and_delivers_what_was_queued(tmp_path, cp, worker):
    aid = cp.add_run(shell="/bin/sh", script="sleep 0.5; echo done-during-the-cut")
    worker.start()
    assert cp.wait(lambda: "running" in cp.acks_of(aid), 30)
    cp.partition(True)
    cp.wait(lambda: False, 2)                   # the run ends while no request gets through (TTLs: 6 s)
    assert completion(cp, aid) is None
    cp.partition(False)
    assert cp.wait(lambda: completion(cp, aid) is not None and cp.logs.get(aid) == b"done-during-the-cut\n", 20), \
        worker.journal()
    assert completion(cp, aid).exit_code == 0
    assert len(cp.sessions) == 1 and "worker.heartbeat_failed" in worker.journal(), worker.journal()


def _lock_free(path) -> bool:
    """True when no process holds ``path``'s flock (a task tree holding it is wholly dead)."""
    import fcntl
    with open(path, "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        fcntl.flock(f, fcntl.LOCK_UN)
        return True


def test_a_self_fenced_run_is_not_renewed_after_the_link_returns_and_is_offered_again_once(tmp_path):
    """Issue 11 §6: a cut past the Worker's fencing instant but shorter than the control plane's
    Lease (and Session) TTL. The Worker kills the run; when the link returns its heartbeats do
    not name that Lease, so it runs out and the Attempt is offered again; the killed copy was
    wholly dead before the second one started, which runs once."""
    # Lease 8 s; the spec's 3 s grace puts the Worker's stop ~3 s after a renewal, ~5 s before
    # the control plane's expiry: the link comes back inside that window.
    cp = StubControlPlane(str(tmp_path), lease_ttl_s=8, session_ttl_s=60)
    url = cp.start()
    w = Worker(tmp_path, cp, url, slots=1)
    lock, out, first = tmp_path / "lock", tmp_path / "out", tmp_path / "first"
    lock.touch()
    script = (f"exec 9>>{lock}; flock -n 9 || {{ echo overlap >> {out}; exit 3; }}; "
              f"if [ -e {first} ]; then echo second >> {out}; exit 0; fi; "
              f": > {first}; echo first >> {out}; exec sleep 60")
    aid = cp.add_run(shell="/bin/sh", script=script, grace_ms=3000)

    def named(hb) -> bool:
        return any(x.attempt_id == aid and x.lease_generation == 1 for x in hb.leases)
    try:
        w.start()
        assert cp.wait(lambda: "running" in cp.acks_of(aid) and any(named(h) for h in cp.heartbeats), 30), \
            w.journal()
        assert not _lock_free(lock)
        cp.partition(True)
        # the whole tree is dead (the Worker killed it)
        wait_until(lambda: _lock_free(lock), 10, f"{lock} free", step=0.05, detail=w.journal)
        lease = cp.lease(aid)
        # Still the first Lease, active and unexpired at the control plane: only a heartbeat's
        # renewal could keep it alive from here.
        assert (lease["generation"], lease["state"]) == (1, "active") and time.time_ns() // 1000 < lease["expires"]
        seen = len(cp.heartbeats)
        cp.partition(False)
        assert cp.wait(lambda: completion(cp, aid) is not None, 40), w.journal()
        assert completion(cp, aid).exit_code == 0 and cp.lease(aid)["generation"] == 2
        assert out.read_text() == "first\nsecond\n"      # never both at once, the second copy once
        with cp.lock:
            after = cp.heartbeats[seen:]
        assert after and not any(named(h) for h in after)
        assert "worker.lease_lost" in w.journal() and "action=kill" in w.journal()
        assert len(cp.sessions) == 1                        # the Session outlived the cut: no adoption fenced it
    finally:
        if w.p is not None:
            w.stop()
        cp.stop()


def test_unuploaded_logs_are_bounded_oldest_cut_first_with_a_recorded_fact(tmp_path, cp):
    store = 4_194_304                           # the least log_store_bytes for 1 slot on the edge Profile
    w = Worker(tmp_path, cp, cp.url, slots=1, extra=f"log_store_bytes = {store}")
    cp.refuse_chunks = True                     # the control plane takes ACKs but no log chunk
    n = 1_500_000
    ids = [cp.add_run(shell="/bin/sh", script=f"head -c {n} /dev/zero | tr '\\0' '{c}'", log_quota_bytes=n)
           for c in "abc"]
    w.start()
    try:
        assert cp.wait(lambda: all(completion(cp, x) is not None for x in ids), 60)
        cp.refuse_chunks = False
        # Refused chunks drove the send back-off up to its cap (a random draw under 60 s); a blip
        # of the link ends it: the first answer after a lost heartbeat sends what waited at once.
        blip = len(cp.requests)
        cp.partition(True)
        assert cp.wait(lambda: ("POST", "heartbeat", 0) in cp.requests[blip:], 10)
        cp.partition(False)
        assert cp.wait(lambda: all(cp.log_ends.get(x) == n for x in ids[1:]), 90)
        assert all(cp.log_of(x) == c * n for x, c in zip(ids[1:], (b"b", b"c")))
        # Before the third spawn 2 × 1.5 MB not uploaded + 1.5 MB needed (its quota) is over the
        # store: the oldest run's unuploaded tail is cut by exactly that, and said so.
        over = 3 * n - store
        assert cp.log_of(ids[0]) == b"a" * (n - over) and completion(cp, ids[0]).bytes_kept == n
        assert f"worker.log_truncated attempt={ids[0]} bytes_dropped={over} bytes_kept={n - over}" in w.journal()
        assert cp.wait(lambda: not glob.glob(os.path.join(w.state, "worker-runs", "*-*")), 20)
    finally:
        w.stop()


def test_cancel_from_a_heartbeat_stops_the_whole_process_tree(tmp_path, cp, worker):
    pids = tmp_path / "pids"
    aid = cp.add_run(shell="/bin/sh", script=f"sleep 60 & echo $! >> {pids}; sh -c 'echo $$ >> {pids}; sleep 60'")
    worker.start()
    assert cp.wait(lambda: "running" in cp.acks_of(aid), 30)
    wait_until(lambda: len(pids.read_text().split() if pids.exists() else []) >= 2, 10, f"two PIDs in {pids}",
               step=0.05)
    tree = [int(x) for x in pids.read_text().split()]
    cp.cancel(aid)
    assert cp.wait(lambda: completion(cp, aid) is not None, 20)
    assert completion(cp, aid).kill_reason == "cancel"
    assert all(gone(p) for p in tree)

def _http(port: int, path: str, method: str = "GET") -> tuple[int, dict]:
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        c.request(method, path)
        r = c.getresponse()
        return r.status, json.loads(r.read() or b"null")
    finally:
        c.close()


def _wait_http(port: int, path: str, timeout_s: float = 20.0) -> tuple[int, dict]:
    def answer() -> tuple[int, dict] | None:
        try:
            return _http(port, path)
        except OSError:
            return None
    return wait_until(answer, timeout_s, f"an answer to GET {path} on port {port}", step=0.05)


def test_with_http_listen_a_worker_serves_a_read_only_status(tmp_path, cp):
    port = free_port()
    w = Worker(tmp_path, cp, cp.url, extra=f'\n[http]\nlisten = "127.0.0.1:{port}"')
    aid = cp.add_run(shell="/bin/sh", script="exec sleep 30")
    w.start()
    try:
        assert cp.wait(lambda: "running" in cp.acks_of(aid), 30)
        status, st = _wait_http(port, "/api/v3/worker")
        with cp.lock:
            session = cp.workers[w.worker_id]["session"]
        assert status == 200 and st["workerId"] == w.worker_id and st["control"] == [cp.url]
        assert st["session"] == {"sessionId": session, "generation": 1} and st["draining"] is False
        assert (st["slots"], st["freeSlots"], st["liveRuns"]) == (2, 1, 1)
        assert st["inbox"]["rows"] == st["inbox"]["open"] == 1 and st["inbox"]["maxRows"] == 64
        assert _http(port, "/healthz") == (200, {"status": "ok"})
        assert _http(port, "/readyz")[0] == 200
        assert _http(port, "/api/v3/worker", "POST")[0] == 405        # read-only
        assert _http(port, "/api/v3/projects/default/runs")[0] == 404  # no local store, no local routes
        cp.cancel(aid)
        assert cp.wait(lambda: completion(cp, aid) is not None, 20)
        assert w.stop() == 0
    finally:
        if w.p.poll() is None:
            w.kill()


def test_a_worker_without_a_session_is_alive_but_not_ready(tmp_path, cp):
    port = free_port()
    w = Worker(tmp_path, cp, "http://127.0.0.1:9", extra=f'\n[http]\nlisten = "127.0.0.1:{port}"')
    w.start()
    try:
        assert _wait_http(port, "/healthz") == (200, {"status": "ok"})
        status, body = _http(port, "/readyz")
        assert status == 503 and body["checks"]["session"] == "connecting"
        assert _http(port, "/api/v3/worker")[1]["session"] is None
        assert w.stop() == 0
    finally:
        if w.p.poll() is None:
            w.kill()


def test_a_wrong_ca_is_refused_with_one_clear_error_and_nothing_written(tmp_path, cp):
    other_ca, _, _ = make_ca(str(tmp_path), "other")
    w = Worker(tmp_path, cp, cp.url, ca_file=other_ca)
    assert w.start().p.wait(30) == 2
    lines = [ln for ln in w.journal().splitlines() if "ERR" in ln]
    assert len(lines) == 1 and "worker.ca_file" in lines[0] and "certificate refused" in lines[0]
    assert cp.sessions == {} and cp.requests == []


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o700])
def test_a_credential_file_not_0600_is_refused(tmp_path, cp, mode):
    # `config check` (ExecReload, the OpenWrt converter) refuses it with serve's line.
    w = Worker(tmp_path, cp, cp.url, cred_mode=mode)
    check = run_cli("--config", w.cfg, "config", "check")
    assert w.start().p.wait(30) == 2
    lines = w.journal().strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("qlagent: error: worker.credential_file: ") \
        and f"mode {mode:04o}, must be 0600" in lines[0], lines
    assert check.returncode == 2 and check.stderr.decode().strip().splitlines() == lines, check
    assert cp.requests == [] and not os.path.exists(w.state)         # nothing created, not even the lock


def test_config_check_refuses_a_file_that_is_not_a_credential(tmp_path, cp):
    w = Worker(tmp_path, cp, cp.url)
    write_credential(w.cred, "not-a-credential")
    check = run_cli("--config", w.cfg, "config", "check")
    (line,) = check.stderr.decode().strip().splitlines()
    assert check.returncode == 2 and line.startswith("qlagent: error: worker.credential_file: ") \
        and "not a Worker credential" in line and "not-a-credential" not in line, check


def load_worker_config(tmp_path, key: str, value: str):
    """``[worker].<key>`` of a minimal Worker config with ``key = value``; a refusal is the
    ValidationError."""
    from qlagent.service.config import load_config
    cfg = tmp_path / "qlagent.toml"
    table = {"worker_id": f'"{"0" * 8}-0000-0000-0000-{"0" * 12}"', "control_url": '"https://cp.example:8443"',
             "ca_file": '"/etc/ca.pem"', "credential_file": '"/etc/cred"', key: value}
    cfg.write_text(f'state_dir = "{tmp_path}/s"\n[worker]\n' + "".join(f"{k} = {v}\n" for k, v in table.items()))
    cfg.chmod(0o600)
    return getattr(load_config(str(cfg))[0].worker, key)


def refused(tmp_path, key: str, value: str):
    from qlagent.core.errors import ValidationError
    with pytest.raises(ValidationError) as e:
        load_worker_config(tmp_path, key, value)
    assert e.value.field == f"worker.{key}"
    return e.value


@pytest.mark.parametrize("slots, ok", [(4, True), (5, False), (0, False)])
def test_worker_slots_at_the_edge_profile_limit(tmp_path, slots, ok):
    if ok:
        assert load_worker_config(tmp_path, "slots", str(slots)) == slots
    else:
        assert refused(tmp_path, "slots", str(slots)).limit == 4


@pytest.mark.parametrize("urls, ok", [
    (["https://a:1", "https://b:2"], True),
    ([f"https://r{i}:1" for i in range(8)], True),
    ([f"https://r{i}:1" for i in range(9)], False),         # over the 8 replicas
    (["https://a:1", "https://a:1"], False),                 # a repeat
    ([], False),
    (["https://a:1", "ftp://b:2"], False),
])
def test_worker_control_url_list_at_its_edges(tmp_path, urls, ok):
    if ok:
        assert load_worker_config(tmp_path, "control_url", json.dumps(urls)) == urls
    else:
        refused(tmp_path, "control_url", json.dumps(urls))


@pytest.mark.parametrize("value, ok", [(4_194_304, True), (4_194_303, False), (65_536, False), (0, False),
                                       (67_108_864, True), (67_108_865, False)])
def test_worker_log_store_bytes_at_its_edges(tmp_path, value, ok):
    """At least slots (1 here) × the edge Profile's 4 MiB log quota — a live run's log is never
    cut, so a smaller store could not hold its bound during a partition — at most its 64 MiB."""
    if ok:
        assert load_worker_config(tmp_path, "log_store_bytes", str(value)) == value
    else:
        assert "4194304..67108864" in str(refused(tmp_path, "log_store_bytes", str(value))) or value == 0


def test_worker_log_store_bytes_grows_with_the_slots(tmp_path):
    cfg = tmp_path / "qlagent.toml"
    cfg.write_text(f'state_dir = "{tmp_path}/s"\n[worker]\nworker_id = "{"0" * 8}-0000-0000-0000-{"0" * 12}"\n'
                   'control_url = "https://cp.example:8443"\nca_file = "/etc/ca.pem"\ncredential_file = "/etc/cred"\n'
                   'slots = 3\nlog_store_bytes = 8388608\n')
    cfg.chmod(0o600)
    from qlagent.core.errors import ValidationError
    from qlagent.service.config import load_config
    with pytest.raises(ValidationError) as e:
        load_config(str(cfg))
    assert e.value.field == "worker.log_store_bytes" and "12582912..67108864" in str(e.value)


def test_worker_mode_never_loads_the_control_plane_and_a_local_agent_never_loads_the_client():
    # Everything Worker mode loads (bootstrap.build_worker's lazy imports included).
    worker_mods = ("qlagent.service.worker_mode", "qlagent.adapters.control_client", "qlagent.adapters.worker_runs",
                   "qlagent.adapters.sqlite.inbox", "qlagent.worker.runtime")
    probe = ("import sys, importlib; [importlib.import_module(m) for m in sys.argv[1:]]; "
             "print(' '.join(m for m in sys.modules if m.startswith(('qlagent.cluster', 'psycopg', "
             "'qlagent.adapters.control_client', 'qlagent.http', 'qlagent.application.engine'))))")
    worker = subprocess.run([sys.executable, "-c", probe, *worker_mods], capture_output=True, text=True,
                            check=True).stdout.split()
    assert worker == ["qlagent.adapters.control_client"]
    local = subprocess.run([sys.executable, "-c", probe, "qlagent.service.main"], capture_output=True, text=True,
                           check=True).stdout.split()
    assert "qlagent.adapters.control_client" not in local and not any(m.startswith("qlagent.cluster") for m in local)


def test_a_control_plane_that_never_answers_does_not_starve_the_watchdog(tmp_path, cp):
    """The replica accepts connections and never answers (a black-holed link): each call waits at
    most a quarter of WATCHDOG_USEC, so WATCHDOG=1 keeps coming at its half-interval cadence
    instead of one call's full timeout (10 s) later."""
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)                       # the kernel completes the handshake; nobody reads
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(str(tmp_path / "notify.sock"))
    notify.settimeout(0.2)
    w = Worker(tmp_path, cp, f"https://localhost:{silent.getsockname()[1]}")
    w.start(env=clean_env(NOTIFY_SOCKET=tmp_path / "notify.sock", WATCHDOG_USEC=2000000))
    pings = []
    try:
        end = time.monotonic() + 9
        while time.monotonic() < end:
            try:
                if b"WATCHDOG=1" in notify.recv(4096).split(b"\n"):
                    pings.append(time.monotonic())
            except socket.timeout:
                pass
    finally:
        assert w.stop() == 0
        silent.close()
        notify.close()
    assert len(pings) >= 5, (pings, w.journal())
    gaps = [b - a for a, b in zip(pings, pings[1:])]
    assert max(gaps) < 2.0, gaps             # never a missed watchdog
    assert "worker.connect_failed" in w.journal()    # it did try, and the calls timed out


def test_a_heartbeat_too_slow_to_renew_the_lease_is_refused_at_start_up_naming_the_key(tmp_path, cp):
    # Session/Lease 6 s: a run is stopped 2 s before expiry, so 3 beats need ≤ 1.33 s each.
    w = Worker(tmp_path, cp, cp.url)
    with open(w.cfg) as f:
        text = f.read()
    with open(w.cfg, "w") as f:
        f.write(text.replace("heartbeat_interval_s = 1.0", "heartbeat_interval_s = 2"))
    assert w.start().p.wait(30) == 2
    lines = [ln for ln in w.journal().splitlines() if "ERR" in ln]
    assert len(lines) == 1 and "worker.heartbeat_interval_s" in lines[0] and "1.33" in lines[0], w.journal()
    assert "Traceback" not in w.journal() and not any(a.kind == "starting" for a in cp.acks)


def test_config_check_refuses_the_ca_file_serve_refuses(tmp_path, cp):
    # `config check` (ExecReload, the OpenWrt converter's validator) runs serve's preflight: a CA
    # file serve refuses is refused there too, with the same field. (The credential file's rule
    # depends on the uid running the check, so it stays serve's: service.preflight.)
    junk = tmp_path / "junk.pem"
    junk.write_text("not a PEM certificate\n")
    for sub, ca_file, ok in (("junk", str(junk), False), ("missing", str(tmp_path / "none.pem"), False),
                             ("ok", None, True)):
        (tmp_path / sub).mkdir()
        w = Worker(tmp_path / sub, cp, cp.url, ca_file=ca_file)
        p = run_cli("--config", w.cfg, "config", "check")
        if ok:
            assert p.returncode == 0 and p.stdout.startswith(b"config ok: "), p.stderr
            continue
        lines = p.stderr.decode().strip().splitlines()
        assert p.returncode == 2 and len(lines) == 1 and lines[0].startswith("qlagent: error: worker.ca_file: "), \
            p.stderr
        assert w.start().p.wait(30) == 2
        assert w.journal().strip().splitlines() == lines, w.journal()      # serve: the same one line
        assert not os.path.exists(w.state)
    assert cp.requests == []


@pytest.mark.parametrize("url, says", [
    ("http://10.0.0.1:17461", "plain http:// only to a loopback host"),
    ("https://127.0.0.1:99999", "port outside 1..65535"),
    ("https://user@cp.example:1", "no path, query or user"),
    (["https://a.example:1", "http://192.0.2.1:2"], "plain http:// only to a loopback host"),
])
def test_config_check_refuses_the_control_url_serve_refuses(tmp_path, cp, url, says):
    """One rule for the URL's shape (``core.control_url``): `config check` refuses a plain
    http:// to another host and port 99999 as serve does."""
    w = Worker(tmp_path, cp, url)
    p = run_cli("--config", w.cfg, "config", "check")
    lines = p.stderr.decode().strip().splitlines()
    assert p.returncode == 2 and len(lines) == 1 and lines[0].startswith("qlagent: error: worker.control_url: ") \
        and says in lines[0], p.stderr
    assert w.start().p.wait(30) == 2 and w.journal().strip().splitlines() == lines
    assert not os.path.exists(w.state)


def test_sighup_answers_the_notify_reload_handshake_and_sigterm_says_stopping(tmp_path, cp):
    """``systemctl reload`` on a Worker box (Type=notify-reload): SIGHUP → RELOADING=1 with
    MONOTONIC_USEC, the file read again, READY=1 — before, the Worker kept silent and the reload
    job hung until systemd's timeout. Nothing applies live; the journal says what changed. SIGTERM
    → STOPPING=1."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(tmp_path / "notify.sock"))
    sock.settimeout(0.2)
    got: list[str] = []

    def expect(line_start: str, timeout_s: float = 15) -> None:
        def heard() -> bool:
            if any(x.startswith(line_start) for x in got):
                return True
            try:                                # blocks up to the socket's 0.2 s
                got.extend(sock.recv(65536).decode().split("\n"))
            except socket.timeout:
                pass
            return False
        wait_until(heard, timeout_s, f"{line_start} on NOTIFY_SOCKET", step=0, detail=lambda: got)
        got.clear()

    w = Worker(tmp_path, cp, cp.url)
    w.start(env=clean_env(NOTIFY_SOCKET=tmp_path / "notify.sock"))
    try:
        expect("READY=1")
        assert cp.wait(lambda: len(cp.sessions) == 1, 30)

        def reload() -> None:
            w.p.send_signal(signal.SIGHUP)
            expect("RELOADING=1")
            expect("READY=1")
        reload()
        assert "config.reloaded" in w.journal()
        with open(w.cfg) as f:
            text = f.read()
        with open(w.cfg, "w") as f:
            f.write(text.replace("slots = 2", "slots = 1"))
        reload()
        assert re.search(r"config\.reload_needs_restart .*changed=worker", w.journal()), w.journal()
        with open(w.cfg, "w") as f:
            f.write(text.replace("slots = 2", "slots = 'x'"))
        reload()
        assert re.search(r"ERR +config\.reload_failed .*slots", w.journal()), w.journal()
        assert w.p.poll() is None and len(cp.sessions) == 1      # the same Session all along
        w.p.send_signal(signal.SIGTERM)
        expect("STOPPING=1")
        assert w.p.wait(30) == 0
    finally:
        w.stop()
        sock.close()


def test_a_replica_closing_mid_handshake_at_start_up_is_retried_not_taken_for_a_wrong_ca(tmp_path, cp):
    """A replica that accepts and closes during the TLS handshake (shutting down, a cut link) at
    the Worker's first connect is not a wrong ca_file (exit 2): the Worker backs off and moves
    to the next replica, which answers."""
    closer = socket.socket()
    closer.bind(("127.0.0.1", 0))
    closer.listen(16)
    stop = threading.Event()

    def close_each() -> None:
        closer.settimeout(0.2)
        while not stop.is_set():
            try:
                c, _ = closer.accept()
                c.recv(65536)           # the whole ClientHello read: hang up mid-handshake (EOF)
                c.close()
            except OSError:
                pass
    t = threading.Thread(target=close_each, daemon=True)
    t.start()
    w = Worker(tmp_path, cp, [f"https://localhost:{closer.getsockname()[1]}", cp.url])
    try:
        w.start()
        assert cp.wait(lambda: len(cp.sessions) == 1, 30), w.journal()
        assert w.p.poll() is None
        assert "connection closed during the TLS handshake" in w.journal() and "worker.ca_file" not in w.journal()
    finally:
        stop.set()
        w.stop()
        t.join()
        closer.close()


def _plain_http_listener(stop: threading.Event) -> tuple[socket.socket, threading.Thread]:
    """A port answering plain HTTP 400 (no TLS): a replica redeployed without tls_cert, a proxy."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(16)
    srv.settimeout(0.2)

    def answer() -> None:
        while not stop.is_set():
            try:
                c, _ = srv.accept()
                c.recv(65536)
                c.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
                c.close()
            except OSError:
                pass
    t = threading.Thread(target=answer, daemon=True)
    t.start()
    return srv, t


def test_one_replica_without_tls_among_several_is_passed_over_and_all_of_them_is_bad_config(tmp_path, cp):
    """Start-up with a control_url list whose first replica does not speak TLS: the Worker
    moves on to the healthy one instead of blaming worker.ca_file (WRONG_VERSION_NUMBER); only
    when every replica refuses TLS is it bad config, naming the URL."""
    stop = threading.Event()
    srv, t = _plain_http_listener(stop)
    plain = f"https://localhost:{srv.getsockname()[1]}"
    try:
        (tmp_path / "mixed").mkdir()
        w = Worker(tmp_path / "mixed", cp, [plain, cp.url])
        w.start()
        try:
            assert cp.wait(lambda: len(cp.sessions) == 1, 30), w.journal()
            assert w.p.poll() is None and "WRONG_VERSION_NUMBER" in w.journal()
        finally:
            w.stop()
        (tmp_path / "only").mkdir()
        w = Worker(tmp_path / "only", cp, plain)
        assert w.start().p.wait(30) == 2
        assert re.search(r"service\.failed code=control_tls_refused field=worker\.control_url ", w.journal()), \
            w.journal()
    finally:
        stop.set()
        t.join()
        srv.close()


def test_a_stop_with_acks_owed_and_no_link_ends_inside_the_units_stop_timeout(tmp_path, cp, worker):
    """SIGTERM with a live run and the link cut: the run is stopped after drain_grace_s, its
    completion stays owed, and the Worker still exits before systemd's TimeoutStopSec (and
    procd's term_timeout) would SIGKILL it: both grant drain_grace_s + the same margin."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with open(os.path.join(root, "systemd", "qlagent.service")) as f:
        timeout_stop_s = int(re.search(r"^TimeoutStopSec=(\d+)$", f.read(), re.M).group(1))
    with open(os.path.join(root, "packaging", "qlagent.toml")) as f:
        packaged_grace_s = int(re.search(r"^drain_grace_s = (\d+)$", f.read(), re.M).group(1))
    with open(os.path.join(root, "openwrt", "qlagent", "files", "qlagent.init")) as f:
        procd_margin_s = int(re.search(r'term_timeout "\$\(\(drain_grace_s \+ (\d+)\)\)"', f.read()).group(1))
    margin_s = timeout_stop_s - packaged_grace_s
    assert margin_s == procd_margin_s
    with open(worker.cfg) as f:
        text = f.read()
    with open(worker.cfg, "w") as f:
        f.write("drain_grace_s = 1\n" + text)
    pidfile = tmp_path / "task.pid"
    aid = cp.add_run(shell="/bin/sh", script=f"echo $$ > {pidfile}; exec sleep 60")
    worker.start()
    assert cp.wait(lambda: "running" in cp.acks_of(aid), 30)
    pid = read_pid(pidfile)
    cp.partition(True)
    began = time.monotonic()
    worker.p.send_signal(signal.SIGTERM)
    assert worker.p.wait(60) == 0, worker.journal()
    took = time.monotonic() - began
    assert took < 1 + margin_s, (took, worker.journal())
    assert gone(pid) and completion(cp, aid) is None
    cp.partition(False)
    worker.start()                              # the completion was kept owed, and goes now
    assert cp.wait(lambda: completion(cp, aid) is not None, 30), worker.journal()
    assert completion(cp, aid).kill_reason == "shutdown"


def test_a_worker_restarted_during_a_cut_keeps_the_reattached_run_for_its_whole_lease(tmp_path):
    """Link down, Worker SIGKILLed and restarted with the link still down: the re-attached run
    is not stopped before the instant its Lease (kept in the shim's lease file) says; the link
    returns in time, the new Session adopts it and it completes with its whole log."""
    stub = StubControlPlane(str(tmp_path), lease_ttl_s=30, session_ttl_s=30)
    stub.url = stub.start()
    w = Worker(tmp_path, stub, stub.url)
    stopfile, pidfile = tmp_path / "stop", tmp_path / "task.pid"
    try:
        aid = stub.add_run(shell="/bin/sh", script=f"echo $$ > {pidfile}; "
                                                   f"while [ ! -e {stopfile} ]; do echo tick; sleep 0.2; done; echo done")
        w.start()
        assert stub.wait(lambda: "running" in stub.acks_of(aid), 30)
        pid = read_pid(pidfile)
        stub.wait(lambda: False, 1.5)                       # a heartbeat renewed the Lease
        stub.partition(True)
        w.kill()
        lease_file = os.path.join(w.state, "worker-runs", aid, "lease")
        with open(lease_file) as f:
            stop_at_s = int(f.read()) / 1e6                 # CLOCK_MONOTONIC, as time.monotonic()
        w.start()
        assert stop_at_s - time.monotonic() > 15            # the Lease has most of its 30 s left
        stub.wait(lambda: False, 4)                         # the restarted Worker's connects fail
        assert not gone(pid), w.journal()
        stub.partition(False)
        assert stub.wait(lambda: len(stub.hellos) == 2, stop_at_s - time.monotonic()), w.journal()
        assert not gone(pid) and "worker.lease_lost" not in w.journal(), w.journal()
        stopfile.touch()
        assert stub.wait(lambda: completion(stub, aid) is not None, 30), w.journal()
        assert completion(stub, aid).exit_code == 0
        assert stub.wait(lambda: stub.log_of(aid).endswith(b"tick\ndone\n"), 20)
        assert set(stub.log_of(aid).splitlines()) == {b"tick", b"done"}
    finally:
        w.stop()
        stub.stop()


def test_a_run_fenced_for_its_lease_keeps_its_log_until_cut_with_a_recorded_fact(tmp_path):
    """A cut past the Lease: the Worker stops the run before the Lease expires; its log, never
    uploaded, is not deleted silently: once the control plane says the Lease is gone, the cut
    is journaled with the bytes the control plane holds and the bytes dropped. The stub offers
    the Attempt again once its Lease ran out: the stop ends that run at once (drain_grace_s = 0)."""
    stub = StubControlPlane(str(tmp_path), lease_ttl_s=8, session_ttl_s=8)
    stub.url = stub.start()
    w = Worker(tmp_path, stub, stub.url, drain_grace_s=0)
    pidfile = tmp_path / "task.pid"
    try:
        aid = stub.add_run(shell="/bin/sh", script=f"echo $$ > {pidfile}; head -c 300000 /dev/zero | tr '\\0' x; "
                                                   "while :; do echo tick; sleep 0.1; done")
        w.start()
        assert stub.wait(lambda: "running" in stub.acks_of(aid), 30)
        pid = read_pid(pidfile)
        assert stub.wait(lambda: len(stub.log_of(aid)) == 262_144, 20)      # one whole chunk went up
        stub.partition(True)
        wait_until(lambda: gone(pid), 20, f"the task {pid} gone", step=0.05, detail=w.journal)
        assert "action=kill" in w.journal()
        log = os.path.join(w.state, "worker-runs", aid, "output.log")
        size = os.path.getsize(log)
        assert size > 262_144                               # kept after the stop, not deleted
        assert stub.wait(lambda: stub.lease(aid)["expires"] < time.time_ns() // 1000, 20)
        stub.partition(False)
        assert stub.wait(lambda: "worker.log_truncated" in w.journal(), 30), w.journal()
        line = next(ln for ln in w.journal().splitlines() if "worker.log_truncated" in ln)
        held = len(stub.log_of(aid))
        assert f"attempt={aid}" in line and f"bytes_kept={held}" in line and f"bytes_dropped={size - held}" in line
        assert "reason=lease_gone" in line
        assert stub.wait(lambda: not os.path.exists(log), 10)
        assert completion(stub, aid) is None
    finally:
        w.stop()
        stub.stop()


FAKETIME_LIB = "/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1"


@pytest.mark.skipif(not os.path.exists(FAKETIME_LIB), reason="libfaketime is not installed")
def test_a_worker_booted_with_its_clock_at_1970_waits_for_the_clock_and_joins_once_it_is_set(tmp_path, cp):
    """A router without a battery-backed clock boots at 1970: every replica's certificate is
    "not yet valid". That is not bad config (exit 2, never restarted by procd): the Worker stays
    up and not ready, says the clock is before qlagent's build date, and joins once NTP sets it.
    libfaketime reads the offset from a file the test rewrites (its monotonic clock moves with
    it, forward only; stat() times stay real, as the package's files are)."""
    port = free_port()
    w = Worker(tmp_path, cp, cp.url, extra=f'\n[http]\nlisten = "127.0.0.1:{port}"')
    offset = tmp_path / "faketime"
    offset.write_text("-20000d\n")                              # 1972
    w.start(env=clean_env(LD_PRELOAD=FAKETIME_LIB, FAKETIME_TIMESTAMP_FILE=offset, FAKETIME_NO_CACHE=1,
                          NO_FAKE_STAT=1))
    try:
        assert _wait_http(port, "/healthz") == (200, {"status": "ok"}), w.journal()
        assert cp.wait(lambda: "clock_not_set" in w.journal(), 20), w.journal()
        cp.wait(lambda: False, 3)                               # several hellos refused by TLS meanwhile
        assert w.p.poll() is None, w.journal()                  # not exit 2: the clock is not config
        status, body = _http(port, "/readyz")
        assert status == 503 and body["checks"]["control"].startswith("clock_not_set: "), body
        line = next(ln for ln in w.journal().splitlines() if "worker.not_ready" in ln)
        assert re.search(r"clock \(197\d-\d\d-\d\dT[\d:]+Z\), which is before qlagent's build date \(20\d\d-", line), line
        assert "worker.ca_file" not in line and cp.sessions == {}
        offset.write_text("+0\n")                               # NTP sets the clock
        assert cp.wait(lambda: len(cp.sessions) == 1, 20), w.journal()
        wait_until(lambda: _http(port, "/readyz")[0] == 200, 10, "/readyz 200", step=0.1, detail=w.journal)
        assert w.stop() == 0
    finally:
        if w.p.poll() is None:
            w.kill()


def test_a_worker_holding_another_workers_credential_says_it_is_stuck(tmp_path, cp):
    """403 worker_mismatch on every hello: the Worker keeps retrying (the credential may be
    replaced) but /readyz and the journal say why it cannot work, not just "connecting"."""
    port = free_port()
    w = Worker(tmp_path, cp, cp.url, extra=f'\n[http]\nlisten = "127.0.0.1:{port}"')
    _, other = cp.enrol()
    write_credential(w.cred, other)
    w.start()
    try:
        assert cp.wait(lambda: sum(r[2] == 403 for r in cp.requests) >= 3, 30), w.journal()
        status, body = _wait_http(port, "/readyz")
        assert status == 503 and body["checks"]["control"].startswith("worker_mismatch: 403"), body
        assert _http(port, "/api/v3/worker")[1]["blocked"]["code"] == "worker_mismatch"
        stuck = [ln for ln in w.journal().splitlines() if "worker.not_ready" in ln]
        assert len(stuck) == 1 and " ERR " in f" {stuck[0]} " and "code=worker_mismatch" in stuck[0], w.journal()
        assert w.p.poll() is None and w.stop() == 0
    finally:
        if w.p.poll() is None:
            w.kill()


def test_plain_http_to_a_tls_port_hints_at_https(tmp_path, cp):
    port = int(cp.url.rsplit(":", 1)[1])
    w = Worker(tmp_path, cp, f"http://127.0.0.1:{port}")
    w.start()
    try:
        assert cp.wait(lambda: "worker.not_ready" in w.journal(), 20), w.journal()
        line = next(ln for ln in w.journal().splitlines() if "worker.not_ready" in ln)
        assert f"127.0.0.1:{port} serves TLS, worker.control_url must say https://" in line, line
        assert w.p.poll() is None and w.stop() == 0
    finally:
        if w.p.poll() is None:
            w.kill()


def test_a_server_certificate_given_as_the_ca_is_refused_by_config_check_and_serve_alike(tmp_path, cp):
    """worker.ca_file holding the replica's own certificate (not its CA): `config check` said
    "config ok" and serve then stopped on every replica's TLS refusal; both now refuse the file
    itself, with the same one line, before anything is written or sent."""
    w = Worker(tmp_path, cp, cp.url, ca_file=cp.cert)
    p = run_cli("--config", w.cfg, "config", "check")
    lines = p.stderr.decode().strip().splitlines()
    assert p.returncode == 2 and len(lines) == 1, p
    assert lines[0].startswith(f"qlagent: error: worker.ca_file: {cp.cert}: holds no CA certificate"), lines
    assert w.start().p.wait(30) == 2
    assert w.journal().strip().splitlines() == lines and not os.path.exists(w.state)
    assert cp.requests == []


@pytest.mark.parametrize("sans, expired, says", [
    (("cp.example", "10.9.8.7"), False,
     r"certificate \(signed by the pinned CA\) does not name 127\.0\.0\.1; it names DNS:cp\.example, "
     r"IP Address:10\.9\.8\.7: worker\.control_url must use one of those"),
    (("localhost", "127.0.0.1"), True,
     r"certificate expired \(valid 20\d\d-\d\d-\d\dT[\d:]+Z \.\. 20\d\d-\d\d-\d\dT[\d:]+Z; this host's clock: 20\d\d-"),
])
def test_a_refused_certificate_says_what_is_wrong_with_it(tmp_path, sans, expired, says):
    """The CA is right but the certificate names other hosts or has expired: the one line names
    that fault, not "worker.ca_file must hold the CA that signed it"."""
    stub = StubControlPlane(str(tmp_path))
    stub.ca_file, stub.cert, stub.key = make_ca(str(tmp_path), "odd", sans=sans, expired=expired)
    url = stub.start().replace("localhost", "127.0.0.1")
    try:
        w = Worker(tmp_path, stub, url)
        assert w.start().p.wait(30) == 2
        (line,) = [ln for ln in w.journal().splitlines() if "ERR" in ln]
        assert re.search(says, line) and "worker.ca_file" not in line, line
    finally:
        stub.stop()


def test_the_worker_loop_answers_while_a_shim_start_is_held_up(tmp_path, cp):
    """Issue 24 §2: the Worker asks its fork server for a shim and follows the start from its
    selector. With the fork server stopped (SIGSTOP) the start cannot go on, yet the Worker
    answers its status surface and sends no ``running`` ACK; once the fork server goes on the
    run starts, runs and completes."""
    port = free_port()
    w = Worker(tmp_path, cp, cp.url, extra=f'\n[http]\nlisten = "127.0.0.1:{port}"\n')
    w.start()
    try:
        first = cp.add_run(argv=["/bin/true"])
        assert cp.wait(lambda: completion(cp, first) is not None, 30), w.journal()
        (server,) = [c for c in psutil.Process(w.p.pid).children() if c.cmdline()[1:3] == ["-I", "-S"]]
        server.suspend()
        try:
            held = cp.add_run(argv=["/bin/echo", "went on"])
            assert cp.wait(lambda: "starting" in cp.acks_of(held), 30), w.journal()
            status, body = _http(port, "/api/v3/worker")      # the loop is not waiting on the start
            assert status == 200 and body["liveRuns"] == 0
            assert cp.acks_of(held) == ["starting"]
        finally:
            server.resume()
        assert cp.wait(lambda: completion(cp, held) is not None, 30), w.journal()
        assert cp.acks_of(held) == ["starting", "running", "completion"]
        assert cp.wait(lambda: cp.log_of(held) == b"went on\n", 20)
        assert w.stop() == 0
    finally:
        if w.p.poll() is None:
            w.kill()


@pytest.mark.skipif(os.geteuid() != 0, reason="mounts a tmpfs: root only")
def test_a_log_cut_by_a_full_file_system_is_acked_with_its_reason(tmp_path, cp):
    """The Worker's state file system (its run directories and logs) fills to 0 bytes while a task
    writes 41 lines of 100 kB, far below the quota: the completion ACK names the write error, so
    the control plane records the truncation fact with it (a quota cut sends no reason)."""
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=32m,mode=0700", "tmpfs", str(state)], check=True)
    go, done = str(tmp_path / "go"), str(tmp_path / "done")
    os.mkfifo(go, 0o600)
    line = "head -c 100000 /dev/zero | tr '\\0' x; echo\n"
    aid = cp.add_run(shell="/bin/sh", script=line + f"read _ < {go}\ni=0\nwhile [ $i -lt 40 ]; do\n  {line}"
                     f"  i=$((i+1))\ndone\n: > {done}\n")
    w = Worker(tmp_path, cp, cp.url, slots=1)
    filler = str(state / "filler")
    try:
        w.start()
        log = os.path.join(w.state, "worker-runs", aid, "output.log")
        wait_until(lambda: os.path.exists(log) and os.path.getsize(log) == 100_001, 30, "the first line")
        fill(filler)
        with open(go, "w") as f:
            f.write("go\n")
        wait_until(lambda: os.path.exists(done), 30, "the task's last line")
        os.unlink(filler)
        assert cp.wait(lambda: completion(cp, aid) is not None, 30)
        c = completion(cp, aid)
        assert c.exit_code == 0 and c.bytes_kept + c.bytes_dropped == 41 * 100_001 and c.bytes_dropped > 0
        assert c.truncation_reason == "write_error: ENOSPC (No space left on device)"
        assert "Traceback" not in w.journal()
    finally:
        w.stop()
        subprocess.run(["umount", "-l", str(state)], check=False)


def _probe(port: int, path: str) -> tuple[int, dict]:
    """GET ``path`` on the Worker's status surface, given 2 s to answer (raises OSError past it)."""
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
    try:
        c.request("GET", path)
        r = c.getresponse()
        return r.status, json.loads(r.read() or b"null")
    finally:
        c.close()


def _two_replicas(tmp_path, cp, **kw) -> tuple[Worker, SilentLink, SilentLink, int]:
    """A Worker with a status surface and two replicas in its control_url, two links to the one
    stub: the first (which it talks to) can be silenced, the second stays healthy."""
    stub_port = int(cp.url.rsplit(":", 1)[1])
    r1, r2 = SilentLink(stub_port), SilentLink(stub_port)
    port = free_port()
    w = Worker(tmp_path, cp, [f"https://localhost:{r1.port}", f"https://localhost:{r2.port}"],
               extra=f'\n[http]\nlisten = "127.0.0.1:{port}"', **kw)
    return w, r1, r2, port


def test_a_replica_that_stops_answering_holds_neither_the_status_surface_nor_new_runs(tmp_path):
    """The replica the Worker talks to stops answering (connections accepted, nothing answered:
    a SIGSTOPped replica). The control plane's default TTLs (30 s) let each call wait the
    client's whole timeout (10 s) there; the Worker's /healthz answers every probe meanwhile,
    and a Run queued then is pulled through the other replica and starts, the first one kept."""
    cp = StubControlPlane(str(tmp_path), lease_ttl_s=30, session_ttl_s=30)
    cp.url = cp.start()
    w, r1, r2, port = _two_replicas(tmp_path, cp)
    first = cp.add_run(shell="/bin/sh", script="exec sleep 60")
    w.start()
    try:
        assert cp.wait(lambda: "running" in cp.acks_of(first), 30), w.journal()
        r1.cut.set()
        second = cp.add_run(shell="/bin/sh", script="exec sleep 60")
        answered = []

        def probed() -> bool:
            try:
                answered.append(_probe(port, "/healthz"))
            except OSError as e:
                raise AssertionError(f"probe {len(answered) + 1}: /healthz gave no answer ({e})\n{w.journal()}")
            return len(answered) >= 15 and "running" in cp.acks_of(second)
        wait_until(probed, 90, "15 answered probes and the second Run running", step=1.0, detail=w.journal)
        assert all(a == (200, {"status": "ok"}) for a in answered)
        assert f"localhost:{r1.port}: timed out" in w.journal() and "worker.lease_lost" not in w.journal()
        assert cp.state(first) == "running"
        assert w.stop() == 0
    finally:
        if w.p.poll() is None:
            w.kill()
        r1.close()
        r2.close()
        cp.stop()


def test_a_replica_silent_for_longer_than_the_lease_loses_none_of_the_runs(tmp_path, cp):
    """Short TTLs (6 s at the stub, heartbeat 1 s): the replica the Worker talks to goes silent
    for good. Each heartbeat it leaves unanswered is sent to the other replica in time, so both
    runs' Leases are renewed through it long past their TTL and neither run is stopped."""
    w, r1, r2, port = _two_replicas(tmp_path, cp)
    runs = [cp.add_run(shell="/bin/sh", script="exec sleep 120") for _ in range(2)]
    w.start()
    try:
        assert cp.wait(lambda: all("running" in cp.acks_of(a) for a in runs), 30), w.journal()
        r1.cut.set()
        past = now_us() + 3 * cp.lease_ttl_us          # three Leases' worth after the cut
        assert cp.wait(lambda: all(cp.lease(a)["expires"] > past for a in runs), 60), w.journal()
        assert [cp.state(a) for a in runs] == ["running", "running"]
        assert "worker.lease_lost" not in w.journal() and "worker.session_gone" not in w.journal()
        assert _probe(port, "/api/v3/worker")[1]["liveRuns"] == 2
        assert w.stop() == 0
    finally:
        if w.p.poll() is None:
            w.kill()
        r1.close()
        r2.close()


def test_a_rotated_credential_backs_off_says_so_once_a_minute_and_is_not_ready(tmp_path, cp):
    """The Worker's credential is rotated at the control plane while it works: every request
    is refused 401. The Worker gives its Session up, retries with a growing back-off, and
    journals the refusal once (then at most once a minute with the count left out); /readyz
    says why and that it has no Session."""
    port = free_port()
    w = Worker(tmp_path, cp, cp.url, extra=f'\n[http]\nlisten = "127.0.0.1:{port}"')
    w.start()
    try:
        _wait_http(port, "/healthz")
        wait_until(lambda: _http(port, "/readyz")[0] == 200, 20, "a Session open", detail=w.journal)
        cp.rotate_credential(w.worker_id)
        assert cp.wait(lambda: sum(r[2] == 401 for r in cp.requests) >= 5, 60), w.journal()
        status, body = _http(port, "/readyz")
        assert status == 503 and body["checks"]["session"] != "ok", body
        assert body["checks"]["control"].startswith("worker_unauthenticated: 401"), body
        refused = [ln for ln in w.journal().splitlines() if "worker_unauthenticated" in ln]
        failed = [ln for ln in refused if "_failed" in ln]
        assert len(failed) == 1 and len(refused) <= 2, w.journal()
        assert w.p.poll() is None and w.stop() == 0
    finally:
        if w.p.poll() is None:
            w.kill()


def test_a_run_that_ends_while_a_call_waits_on_a_paused_replica_reports_its_end_not_a_loss(tmp_path, cp):
    """The only replica pauses (SIGSTOP-like: nothing answered, nothing lost) while a run is
    about to exit 0. The heartbeat waits until the run's fencing instant; the run exited before
    it, so the Worker ends it as a completion, not a loss, and once the replica answers again
    (its Lease still valid) the completion and the whole log are accepted."""
    link = PausingLink(int(cp.url.rsplit(":", 1)[1]))
    w = Worker(tmp_path, cp, f"https://localhost:{link.port}")
    go = tmp_path / "go"
    os.mkfifo(go)
    aid = cp.add_run(shell="/bin/sh", script=f"read go < {go}; echo done")
    w.start()
    try:
        assert cp.wait(lambda: "running" in cp.acks_of(aid), 30), w.journal()
        link.flowing.clear()
        with open(go, "w") as f:
            f.write("now\n")            # the run exits 0 while every call waits
        wait_until(lambda: "worker.run_ended" in w.journal() or "worker.lease_lost" in w.journal(), 30,
                   "the run's end or loss", detail=w.journal)
        link.flowing.set()
        assert "worker.lease_lost" not in w.journal(), w.journal()
        assert cp.wait(lambda: completion(cp, aid) is not None and cp.logs.get(aid) == b"done\n", 30), w.journal()
        assert completion(cp, aid).exit_code == 0
        assert w.stop() == 0
    finally:
        link.flowing.set()
        if w.p.poll() is None:
            w.kill()
        link.close()
