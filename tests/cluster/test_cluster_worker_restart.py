"""A real fleet Worker (``qlagent serve`` with ``[worker]``) SIGKILLed with a run in flight and
started again, against a real control-plane replica (``qlagent serve`` with ``[cluster]``) on
PostgreSQL with short Session/Lease TTLs. Every ordering of "how long the Worker was down"
against "what the run did meanwhile" must leave the restarted Worker running (never an
internal error), each inbox row closed once, and the control plane ending a Lease it lost
``lost`` with the Task's retry policy deciding (ADR-0014, ADR-0021, docs/worker-protocol.md)."""

from __future__ import annotations

import json
import sqlite3
import os
import shutil
import socket
import threading
import time

import pytest

from test_cluster_e2e import Node, Proc, enroll, sql, start_replica
from kit import SilentLink, TcpProxy, free_port, scratch_dir, wait_until

TTL_S = 10
LOOP = "i=0; while [ $i -lt {n} ]; do echo tick $i; i=$((i+1)); sleep 1; done"
# case → (script, on_lease_loss, how long the Worker stays down, what the run did meanwhile)
CASES = {
    # Down longer than the TTL, the shim fences the run itself (receipt lease_lost); the recovery
    # collects and closes the row, and the hello's not-adopted Lease does not close it again.
    "down_longer_shim_fenced": (LOOP.format(n=15), "kill", "lost", "lease_lost"),
    # Down longer, the run ended on its own before the Lease ran out.
    "down_longer_run_finished": ("echo short; sleep 3; echo done", "kill", "lost", "finished"),
    # Down longer, the run still alive at the restart (on_lease_loss = keep: the shim lets it run).
    "down_longer_run_alive": (LOOP.format(n=20), "keep", "lost", "alive"),
    # Down shorter than the TTL: re-attached, adopted, it goes on to its own end.
    "down_shorter": (LOOP.format(n=15), "kill", "running", "alive"),
}
# One Task per case, placed on that case's Worker only (its label), so a re-offered Attempt
# never lands on the Worker of another case; retried at once (backoff_s = 0) once the sweeper
# ended the first Attempt lost.
TASKS = "".join(f'''
[[task]]
name = "{case}"
shell = "/bin/sh"
script = "{script}"
grace_s = 1
on_lease_loss = "{policy}"
retry = {{max_attempts = 2, backoff_s = 0}}
placement = {{required = {{case = "{case}"}}}}
''' for case, (script, policy, _, _) in CASES.items())
# Two runs on one Worker at the SIGKILL, each ending differently while it is down: one
# outlives its Lease and is fenced by its shim, the other finishes (retried as the cases are).
PAIR = {"pair_fenced": LOOP.format(n=15), "pair_finished": "echo short; sleep 3; echo done"}
TASKS += "".join(f'''
[[task]]
name = "{name}"
shell = "/bin/sh"
script = "{script}"
grace_s = 1
retry = {{max_attempts = 2, backoff_s = 0}}
concurrency = "parallel"
placement = {{required = {{case = "pair"}}}}
''' for name, script in PAIR.items())


TASKS += f'''
[[task]]
name = "late_beat"
shell = "/bin/sh"
script = "{LOOP.format(n=60)}"
grace_s = 1
retry = {{max_attempts = 2}}
placement = {{required = {{case = "late_beat"}}}}
'''

TASKS += """
[[task]]
name = "stop_cut"
shell = "/bin/sh"
script = "sleep 2; echo done"
grace_s = 1
placement = {required = {case = "stop_cut"}}
"""


@pytest.fixture(scope="module")
def plane(pg_url):
    root = scratch_dir("wkfix-restart-")
    port = free_port()
    cp, replica = start_replica(root, f'[cluster]\ndatabase = "{pg_url}"\npool_size = 6\nlease_ttl_s = {TTL_S}\n'
                                      f'session_ttl_s = {TTL_S}\nsweep_interval_s = 1\n', TASKS, port)
    replica.wait_line("service.ready")
    state = {"root": root, "port": port, "cp": cp, "replica": replica, "url": pg_url, "procs": []}
    yield state
    for p in state["procs"]:
        if p.proc.poll() is None:
            p.proc.kill()
            p.proc.wait(30)
    replica.stop()
    shutil.rmtree(root, ignore_errors=True)


def worker_node(plane, name: str, port: int | None = None) -> tuple[Node, str]:
    """A Worker enrolled as ``name`` (2 slots, label case=NAME) talking to the replica, or to
    ``port`` (a proxy in front of it); (its Node, its worker_id)."""
    worker_id, cred = enroll(plane, name, "--slots", "2", "--label", f"case={name}")
    # drain_grace_s: the re-offered Attempt still running at the end is stopped soon.
    node = Node(plane["root"], name, f'drain_grace_s = 1\n[worker]\nworker_id = "{worker_id}"\n'
                                     f'control_url = "http://127.0.0.1:{port or plane["port"]}"\n'
                                     f'credential_file = "{cred}"\nslots = 2\nheartbeat_interval_s = 2\n'
                                     f'pull_wait_s = 20\nlabels = {{case = "{name}"}}\n')
    return node, worker_id


def serve(plane, node: Node) -> Proc:
    p = Proc(node)
    plane["procs"].append(p)
    return p


def attempts(plane, run_id: str) -> list[tuple[int, str]]:
    return sql(plane["url"], "SELECT attempt_no, state FROM attempts WHERE run_id = %s ORDER BY attempt_no",
               (run_id,))


def wait_for(what, check, timeout_s: float = 60, *procs: Proc):
    """``check()``'s first truthy value within ``timeout_s``; the failure carries ``procs``' journals."""
    return wait_until(check, timeout_s, what, step=0.2, detail=lambda: "".join(ln for p in procs for ln in p.lines))


def receipt(node: Node, attempt_id: str) -> dict | None:
    try:
        with open(os.path.join(node.state, "worker-runs", attempt_id, "receipt.json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def inbox_state(node: Node, attempt_id: str) -> list[str]:
    """The states of the Worker's inbox rows for ``attempt_id`` (read-only; the Worker stopped)."""
    with sqlite3.connect(f"file:{os.path.join(node.state, 'inbox.sqlite3')}?mode=ro", uri=True) as c:
        return [r[0] for r in c.execute("SELECT state FROM offers WHERE attempt_id = ?", (attempt_id,))]


def first_attempt(plane, run_id: str) -> str:
    return sql(plane["url"], "SELECT attempt_id FROM attempts WHERE run_id = %s AND attempt_no = 1", (run_id,))[0][0]


@pytest.mark.parametrize("case", list(CASES))
def test_a_worker_restarted_after_a_sigkill_with_a_run_in_flight_keeps_running(plane, case):
    _, _, cp_state, run_then = CASES[case]
    node, _ = worker_node(plane, case)
    worker = serve(plane, node)
    worker.wait_line("worker.session_opened")
    cp = plane["cp"]
    run_id = cp.ok("run", "start", case).strip()
    wait_for("attempt 1 running", lambda: attempts(plane, run_id) == [(1, "running")], 60, worker,
             plane["replica"])
    aid = first_attempt(plane, run_id)
    worker.proc.kill()
    assert worker.proc.wait(30) == -9
    if cp_state == "lost":
        # Down longer than the Lease TTL: the sweeper ended the Attempt, and the run reached the
        # state this case is about before the Worker comes back.
        wait_for("attempt 1 lost", lambda: attempts(plane, run_id)[:1] == [(1, "lost")])
    if run_then == "lease_lost":
        assert wait_for("the shim's receipt", lambda: receipt(node, aid))["lease_lost"] is True
    elif run_then == "finished":
        assert wait_for("the shim's receipt", lambda: receipt(node, aid))["lease_lost"] is False
    else:
        assert receipt(node, aid) is None

    again = serve(plane, node)
    again.wait_line("worker.session_opened")
    again.wait_line("worker.ready")
    if case == "down_shorter":
        again.wait_line("worker.lease_adopted")
        wait_for("attempt 1 succeeded", lambda: attempts(plane, run_id) == [(1, "succeeded")], 60)
        assert cp.ok("run", "show", run_id).count("succeeded") >= 1
    else:
        # The sweeper ended the first Attempt lost and the retry policy offers the Run again;
        # the restarted Worker (the only one its placement allows) takes it and runs it.
        wait_for("attempt 2 running on the restarted Worker",
                 lambda: attempts(plane, run_id) in ([(1, "lost"), (2, "running")], [(1, "lost"), (2, "succeeded")]),
                 60, again)
    if case == "down_longer_run_alive":
        # The kept run goes on without a Lease; when it ends its row is closed (nothing sent).
        wait_for("the kept run's receipt", lambda: receipt(node, aid) is not None or not os.path.isdir(
            os.path.join(node.state, "worker-runs", aid)), 60)
    assert again.proc.poll() is None, "".join(again.lines)
    journal = "".join(again.lines)
    assert "internal error" not in journal and "Traceback" not in journal, journal
    assert again.stop() == 0, journal
    journal = "".join(again.lines)
    assert "internal error" not in journal and "Traceback" not in journal, journal
    # The first Attempt's row was closed (acknowledged or closed as lost/fenced), not left open.
    assert inbox_state(node, aid) == ["acked"], journal


def test_a_worker_down_past_the_lease_with_one_run_fenced_and_one_finished_restarts(plane):
    node, _ = worker_node(plane, "pair")
    worker = serve(plane, node)
    worker.wait_line("worker.session_opened")
    cp = plane["cp"]
    runs = {name: cp.ok("run", "start", name).strip() for name in PAIR}
    for run_id in runs.values():
        wait_for("attempt 1 running", lambda: attempts(plane, run_id) == [(1, "running")], 60, worker)
    aids = {name: first_attempt(plane, run_id) for name, run_id in runs.items()}
    worker.proc.kill()
    assert worker.proc.wait(30) == -9
    for run_id in runs.values():
        wait_for("attempt 1 lost", lambda: attempts(plane, run_id)[:1] == [(1, "lost")])
    assert wait_for("the fenced shim's receipt", lambda: receipt(node, aids["pair_fenced"]))["lease_lost"] is True
    assert wait_for("the finished shim's receipt", lambda: receipt(node, aids["pair_finished"]))["lease_lost"] is False
    again = serve(plane, node)
    again.wait_line("worker.ready")
    for run_id in runs.values():
        wait_for("attempt 2 on the restarted Worker", lambda: attempts(plane, run_id)
                 in ([(1, "lost"), (2, "running")], [(1, "lost"), (2, "succeeded")]), 60, again)
    journal = "".join(again.lines)
    assert again.proc.poll() is None and "internal error" not in journal and "Traceback" not in journal, journal
    assert again.stop() == 0, "".join(again.lines)
    assert [inbox_state(node, a) for a in aids.values()] == [["acked"], ["acked"]], "".join(again.lines)


class HoldingProxy(TcpProxy):
    """A TCP proxy to the replica. While held, what Workers send is kept back (the connection
    stays up, as on a congested link) and delivered on release, even after the Worker gave up
    on it and closed its socket: a request applied late."""

    def __init__(self, upstream_port: int) -> None:
        self.open = threading.Event()
        self.open.set()
        super().__init__(upstream_port)

    def _pipe(self, src: socket.socket, dst: socket.socket, outbound: bool) -> None:
        try:
            while data := src.recv(65536):
                if outbound:
                    self.open.wait()
                dst.sendall(data)
        except OSError:
            pass
        if outbound:
            time.sleep(5)               # the replica answers what it got last (into a closed socket)
        self._shut(src, dst)

    def close(self) -> None:
        self.open.set()
        super().close()


def test_a_heartbeat_the_worker_gave_up_on_does_not_extend_the_lease_of_the_run_it_stopped(plane):
    """A heartbeat naming a run's Lease is held on the link; the Worker gives up on it and stops
    the run before the Lease can expire. Delivered late, it extended that Lease by a whole TTL
    (the re-offer waited for nothing). The replica now refuses a heartbeat past the instant the
    Worker stopped waiting (heartbeat_late): the Lease ends when the Worker assumed it would."""
    proxy = HoldingProxy(plane["port"])
    node, _ = worker_node(plane, "late_beat", proxy.port)
    worker = serve(plane, node)
    try:
        worker.wait_line("worker.session_opened")
        run_id = plane["cp"].ok("run", "start", "late_beat").strip()
        wait_for("attempt 1 running", lambda: attempts(plane, run_id) == [(1, "running")], 60, worker)
        aid = first_attempt(plane, run_id)
        renewed = "SELECT expires_at_us FROM run_leases WHERE attempt_id = %s"
        first = sql(plane["url"], renewed, (aid,))[0][0]
        wait_for("a heartbeat renewal", lambda: sql(plane["url"], renewed, (aid,))[0][0] > first, 30, worker)
        proxy.open.clear()
        worker.wait_line("worker.lease_lost", 30)
        assert "action=kill" in worker.wait_line("worker.lease_lost")
        held_at = sql(plane["url"], renewed, (aid,))[0][0]
        proxy.open.set()                # the held heartbeat (it named the Lease) arrives now
        wait_for("attempt 1 lost", lambda: attempts(plane, run_id)[:1] == [(1, "lost")], 60, worker)
        assert sql(plane["url"], renewed, (aid,))[0][0] == held_at, "".join(worker.lines)
    finally:
        worker.stop()
        proxy.close()


def test_a_sigterm_while_a_call_waits_on_a_dead_link_still_fits_the_units_stop_timeout(plane):
    """The link goes silent (packets vanish, connections stay up) while a run goes on; its log
    is owed once it ended, and every call waits its whole 10 s. A SIGTERM coming right after a
    heartbeat gave up was handled only after the send that followed had waited too, and the
    drain counted from then: the Worker exited ~drain_grace_s + 14 s after the signal, past
    systemd's TimeoutStopSec (drain_grace_s + 10 s), so it was SIGKILLed."""
    grace_s = 3
    proxy = SilentLink(plane["port"])
    worker_id, cred = enroll(plane, "stop_cut", "--label", "case=stop_cut")
    node = Node(plane["root"], "stop_cut", f'drain_grace_s = {grace_s}\n[worker]\nworker_id = "{worker_id}"\n'
                                          f'control_url = "http://127.0.0.1:{proxy.port}"\n'
                                          f'credential_file = "{cred}"\nheartbeat_interval_s = 2\n'
                                          'pull_wait_s = 20\nlabels = {case = "stop_cut"}\n')
    worker = serve(plane, node)
    try:
        worker.wait_line("worker.session_opened")
        run_id = plane["cp"].ok("run", "start", "stop_cut").strip()
        wait_for("attempt 1 running", lambda: attempts(plane, run_id) == [(1, "running")], 60, worker)
        proxy.cut.set()
        # The run ends (its log is owed; its Lease is given up on while the heartbeat waits),
        # then the Worker alternates heartbeats and sends, each waiting 10 s: the second
        # heartbeat given up on is followed by a send.
        wait_for("two heartbeats given up on the cut link",
                 lambda: len([ln for ln in worker.lines if "worker.heartbeat_failed" in ln]) >= 2, 60, worker)
        began = time.monotonic()
        rc = worker.stop(60)
        took = time.monotonic() - began
        assert rc == 0 and took < grace_s + 10, (took, "".join(worker.lines))
        assert "worker.send_failed" in "".join(worker.lines)    # something was owed
    finally:
        if worker.proc.poll() is None:
            worker.proc.kill()
        proxy.close()
