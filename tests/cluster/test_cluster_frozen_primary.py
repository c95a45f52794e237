"""Issue 21 §2: a frozen primary never hangs a request. Real parts: a PostgreSQL primary (+ its
standby) started for the test, one ``qlagent serve`` replica on its URL, four HTTP clients
sending Task Starts back to back. The primary's postmaster and every process it forked get SIGSTOP for 25 s (the kernel
still accepts and acknowledges: no keepalive or TCP timeout notices), then SIGCONT. Every Task
Start is answered within the documented bound, 15 s (5 s for a pooled connection + 10 s for its
transaction, README "Control plane"): 202, or 503 ``task_start_unavailable`` with Retry-After
while the primary is frozen; a few seconds after SIGCONT they are 202 again (every start sent
from 5 s after it, AFTER of them at least). No request in flight waits for the whole freeze."""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "fleet"))
from harness import PgPair, started_pair  # noqa: E402
from test_cluster_e2e import start_replica  # noqa: E402
from kit import free_port, scratch_dir, wait_until  # noqa: E402

pytestmark = pytest.mark.slow

TASKS = """
[[task]]
name = "quick"
shell = "/bin/sh"
script = "true"
concurrency = "parallel"
"""
BOUND_S = 15.0
FREEZE_S = 25.0
CLIENTS = 4
AFTER = 8
PROBE_EVERY_S = 1.0
FROZEN_PROBES = 15      # beyond the 10 s a loop duty's query may hang before the replica cuts it


@pytest.fixture
def pair():
    with started_pair("w21a-frozen") as p:
        try:
            yield p
        finally:
            _signal_primary(p, signal.SIGCONT)


def _signal_primary(pair: PgPair, sig: int) -> None:
    """``sig`` to the primary's postmaster and every process it forked (backends, walsender, …)."""
    try:
        with open(os.path.join(pair.primary_dir, "postmaster.pid")) as f:
            postmaster = int(f.readline())
    except (OSError, ValueError):
        return
    pids = [postmaster]
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == postmaster:
                        pids.append(int(entry))
            except (OSError, ValueError, IndexError):
                pass
    for pid in pids:
        try:
            os.kill(pid, sig)
        except OSError:
            pass


def _ready_replica(root: str, pair, port: int, extra: str = ""):
    """A replica on ``pair``'s primary listening on ``port``, READY: (cp, replica, an operator
    token, the head of Task ``quick``)."""
    cp, replica = start_replica(root, f'[cluster]\ndatabase = "{pair.url()}"\npool_size = 6\n' + extra,
                                TASKS, port)
    try:
        replica.wait_line("service.ready")
        token = cp.ok("token", "create", "--subject", "alice", "--role", "operator").strip()
        with urllib.request.urlopen(urllib.request.Request(
                f"http://127.0.0.1:{port}/api/v3/projects/default/tasks/quick",
                headers={"Authorization": f"Bearer {token}"}), timeout=30) as r:
            return cp, replica, token, json.loads(r.read())
    except BaseException:
        replica.stop()
        raise


def _start(port: int, token: str, head: dict) -> tuple[int, str | None, str | None]:
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/api/v3/projects/default/tasks/quick/runs", method="POST",
        data=json.dumps({"schema": "qinglong/task-start@v1", "mutationId": str(uuid.uuid4()),
                         "expectedRevision": head["revision"],
                         "expectedContentDigest": head["contentDigest"]}).encode(),
        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=90) as r:
            return r.status, None, None
    except urllib.error.HTTPError as e:
        body = json.loads(e.read() or b"{}")
        return e.code, body.get("code"), e.headers.get("Retry-After")


def test_task_starts_while_the_primary_is_frozen_are_answered_503_within_the_bound_then_202(pair):
    root = scratch_dir("qlagent-frozen-")
    replica = None
    try:
        port = free_port()
        cp, replica, token, head = _ready_replica(root, pair, port)
        answers: list[tuple[float, float, int, str | None, str | None]] = []
        stop = threading.Event()

        def client() -> None:
            while not stop.is_set():
                t0 = time.monotonic()
                status, code, retry = _start(port, token, head)
                answers.append((t0, time.monotonic() - t0, status, code, retry))
                time.sleep(0.1)
        threads = [threading.Thread(target=client) for _ in range(CLIENTS)]
        for t in threads:
            t.start()
        try:
            wait_until(lambda: sum(a[2] == 202 for a in answers) >= CLIENTS, 30,
                       "Task Starts answered 202 before the freeze")
            frozen_at = time.monotonic()
            _signal_primary(pair, signal.SIGSTOP)
            time.sleep(FREEZE_S)
            _signal_primary(pair, signal.SIGCONT)
            thawed_at = time.monotonic()
            wait_until(lambda: sum(a[0] >= thawed_at + 5 for a in answers) >= AFTER, 60,
                       f"{AFTER} Task Starts sent from 5 s after the thaw answered", step=0.1)
        finally:
            stop.set()
        for t in threads:
            t.join(120)
        # Sent once the primary was frozen, answered before it was thawed.
        during = [a for a in answers if a[0] >= frozen_at + 1 and a[0] + a[1] <= thawed_at]
        worst = max(a[1] for a in answers)
        print(f"{len(answers)} Task Starts; longest answer {worst:.1f} s; during the freeze: "
              f"{sorted({(a[2], a[3]) for a in during})}")
        assert worst <= BOUND_S, sorted(a[1] for a in answers)[-10:]
        assert during and all(a[2] == 503 and a[3] == "task_start_unavailable" and a[4] for a in during), during
        after = [a for a in answers if a[0] >= thawed_at + 5]
        assert after and all(a[2] == 202 for a in after), after
        assert replica.proc.poll() is None
    finally:
        if replica is not None:
            replica.stop()
        shutil.rmtree(root, ignore_errors=True)


def _get(port: int, path: str, timeout: float) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def test_healthz_answers_every_probe_while_the_primary_is_frozen_and_readyz_names_the_database(pair):
    """Liveness never waits on the database: the replica sweeps every 0.5 s, so its loop duties
    keep asking the frozen primary, yet every ``/healthz`` probe (one a second) is answered
    200 before the next is due; ``/readyz`` says 503 with the database in its store check; after
    SIGCONT Task Starts are 202 again."""
    root = scratch_dir("qlagent-frozen-probe-")
    replica = None
    try:
        port = free_port()
        cp, replica, token, head = _ready_replica(root, pair, port, "sweep_interval_s = 0.5\n")
        assert _start(port, token, head)[0] == 202
        probes: list[tuple[float, object]] = []     # (sent, HTTP status, or the error when none came)
        stop = threading.Event()

        def prober() -> None:
            while not stop.is_set():
                sent = time.monotonic()
                try:        # unanswered once the next probe is due
                    status: object = _get(port, "/healthz", PROBE_EVERY_S)[0]
                except OSError as e:
                    status = repr(e)
                probes.append((sent, status))
                stop.wait(max(0.0, sent + PROBE_EVERY_S - time.monotonic()))

        def readyz_failed():
            status, body = _get(port, "/readyz", 30)
            return status == 503 and "database" in body["checks"]["store"] and body

        thread = threading.Thread(target=prober)
        frozen_at = time.monotonic()
        _signal_primary(pair, signal.SIGSTOP)
        try:
            thread.start()
            ready = wait_until(readyz_failed, 30, "/readyz 503 naming the database", step=0.5)
            wait_until(lambda: sum(p[0] >= frozen_at for p in probes) >= FROZEN_PROBES, 60,
                       f"{FROZEN_PROBES} /healthz probes sent while the primary is frozen", step=0.1)
        finally:
            stop.set()
            thread.join(30)
            _signal_primary(pair, signal.SIGCONT)
        print(f"{len(probes)} /healthz probes during the freeze; /readyz: {ready}")
        assert ready["status"] == "not_ready"
        assert all(status == 200 for _, status in probes), probes
        wait_until(lambda: _start(port, token, head)[0] == 202, 60, "a Task Start answered 202 after the thaw",
                   step=0.5)
        assert replica.proc.poll() is None
    finally:
        if replica is not None:
            replica.stop()
        shutil.rmtree(root, ignore_errors=True)
