"""End to end through real processes: ``qlagent serve`` with ``[cluster]`` (HTTPS from a throwaway
CA) on a fresh PostgreSQL database, a Worker enrolled with ``qlagent workers enroll``, and
``qlagent serve`` with ``[worker]`` running a Task started from the CLI — its outcome and its log
read back from PostgreSQL by ``run show`` / ``run logs`` and over HTTPS. Also: a Worker trusting
another CA is refused with one line and writes nothing; bad TLS or pool values stop the replica
before anything is written; SIGTERM ends the replica promptly while the Worker long-polls."""

from __future__ import annotations

import http.client
import json
import os
import shutil
import signal
import ssl
import subprocess
import time
import urllib.request

import psycopg
import pytest

from conftest import create_database, db_url, drop_database
from cpkit import make_ca
from kit import Serve, free_port, qlagent_argv, run_cli, scratch_dir, wait_until

BASE = "/api/v3/projects/default"
TASKS = """
[[task]]
name = "greet"
shell = "/bin/sh"
script = "echo hello-from-the-worker; echo second line"

[[task]]
name = "envdump"
shell = "/bin/sh"
script = "env | grep '^QL3_' | sort"
"""

class Node:
    """A state directory and a config file (0600); ``cli`` runs ``qlagent`` on them."""

    def __init__(self, root: str, name: str, config: str) -> None:
        self.state = os.path.join(root, f"{name}-state")
        self.config = os.path.join(root, f"{name}.toml")
        with open(self.config, "w") as f:
            f.write(config)
        os.chmod(self.config, 0o600)

    @property
    def scope(self) -> tuple[str, ...]:
        """The global arguments naming this node's state directory and config."""
        return ("--state-dir", self.state, "--config", self.config)

    def argv(self, *args: str) -> list[str]:
        return qlagent_argv(*self.scope, *args)

    def cli(self, *args: str) -> subprocess.CompletedProcess:
        return run_cli(*self.scope, *args)

    def ok(self, *args: str) -> str:
        p = self.cli(*args)
        assert p.returncode == 0 and b"Traceback" not in p.stderr, (args, p.stdout, p.stderr)
        return p.stdout.decode()


class Proc(Serve):
    """``qlagent serve ARGS`` on ``node`` (environment ``env``, default :func:`kit.clean_env`);
    returns at once, its journal lines collected as they come."""

    def __init__(self, node: Node, *args: str, env: dict | None = None) -> None:
        super().__init__(*node.scope, serve_args=args, env=env, ready=None)


def sql(url: str, query: str, args=()):
    with psycopg.connect(url, autocommit=True) as c:
        cur = c.execute(query, args)
        return cur.fetchall() if cur.description else []


def start_replica(root: str, config: str, tasks: str, port: int) -> tuple[Node, Proc]:
    """``init`` a control plane with ``config`` (TOML with ``[cluster]``) in ``root``, add
    ``tasks``, start ``serve --listen 127.0.0.1:PORT``; (its Node, its Proc)."""
    cp = Node(root, "cp", config)
    cp.ok("init")
    with open(os.path.join(root, "tasks.toml"), "w") as f:
        f.write(tasks)
    cp.ok("task", "add", "-f", os.path.join(root, "tasks.toml"))
    return cp, Proc(cp, "--listen", f"127.0.0.1:{port}")


@pytest.fixture(scope="module")
def plane(pg_url):
    root = scratch_dir("qlagent-e2e-")
    ca, cert, key = make_ca(root, "cp")
    other_ca, _, other_key = make_ca(root, "other")
    port = free_port()
    cp, replica = start_replica(root, f'[cluster]\ndatabase = "{pg_url}"\npool_size = 6\nsweep_interval_s = 0.5\n'
                                      f'tls_cert = "{cert}"\ntls_key = "{key}"\n', TASKS, port)
    assert "tls=on" in replica.wait_line("http.listening")
    replica.wait_line("service.ready")
    state = {"root": root, "ca": ca, "cert": cert, "key": key, "other_ca": other_ca, "other_key": other_key,
             "port": port, "cp": cp, "replica": replica, "url": pg_url, "workers": []}
    yield state
    for w in state["workers"]:
        w.stop()
    replica.stop()
    shutil.rmtree(root, ignore_errors=True)


def enroll(plane, name: str, *enroll_args: str) -> tuple[str, str]:
    """``workers enroll NAME ARGS`` on the plane; (Worker ID, path of its 0600 credential file)."""
    enrolled = json.loads(plane["cp"].ok("workers", "enroll", name, *enroll_args, "--json"))
    cred = os.path.join(plane["root"], f"{name}.credential")
    fd = os.open(cred, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.write(fd, enrolled["credential"].encode() + b"\n")
    os.close(fd)
    return enrolled["workerId"], cred


def start_worker(plane, name: str, ca_file: str, *enroll_args: str, extra: str = "") -> tuple[Proc, str]:
    worker_id, cred = enroll(plane, name, *enroll_args)
    node = Node(plane["root"], name, f'[worker]\nworker_id = "{worker_id}"\n'
                                     f'control_url = "https://127.0.0.1:{plane["port"]}"\n'
                                     f'credential_file = "{cred}"\nca_file = "{ca_file}"\n'
                                     'heartbeat_interval_s = 1\npull_wait_s = 20\n' + extra)
    proc = Proc(node)
    plane["workers"].append(proc)
    return proc, worker_id


def https(plane, path: str, token: str, headers: dict | None = None, method: str = "GET", body: bytes | None = None):
    ctx = ssl.create_default_context(cafile=plane["ca"])
    conn = http.client.HTTPSConnection("127.0.0.1", plane["port"], timeout=30, context=ctx)
    try:
        conn.request(method, path, body=body, headers={"Authorization": f"Bearer {token}", **(headers or {})})
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


def announce_body(plane, path: str, length: int) -> tuple[int, bytes]:
    """Send only a head announcing ``length`` body bytes: the server refuses on the head (a
    body sent anyway would race the server's close)."""
    ctx = ssl.create_default_context(cafile=plane["ca"])
    conn = http.client.HTTPSConnection("127.0.0.1", plane["port"], timeout=30, context=ctx)
    try:
        conn.putrequest("POST", path)
        conn.putheader("Content-Type", "application/json")
        conn.putheader("Content-Length", str(length))
        conn.endheaders()
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def test_a_real_worker_runs_a_task_started_from_the_cli_and_its_log_is_read_from_postgresql(plane):
    cp = plane["cp"]
    worker, worker_id = start_worker(plane, "edge-1", plane["ca"])
    worker.wait_line("worker.ready")
    run_id = cp.ok("run", "start", "greet").strip()
    # The Worker ends the Run (completion ACK), then uploads the log's chunks: the completion
    # carries no log size, so wait for the bytes too before reading them back.
    output = b"hello-from-the-worker\nsecond line\n"
    wait_until(lambda: sql(plane["url"], "SELECT r.state, a.log_next_offset FROM runs r JOIN attempts a "
                                         "ON a.attempt_id = r.latest_attempt_id WHERE r.run_id = %s",
                           (run_id,)) == [("succeeded", len(output))], 20, "the Run succeeded with its log uploaded",
               step=0.1, detail=lambda: (worker.lines, plane["replica"].lines))
    shown = cp.ok("run", "show", run_id)
    assert "state     succeeded exit=0" in shown, (shown, worker.lines, plane["replica"].lines)
    assert next(ln for ln in shown.splitlines() if ln.startswith("attempt ")).endswith(" worker=edge-1"), shown
    assert cp.ok("run", "logs", run_id) == output.decode()
    assert sql(plane["url"], "SELECT w.name FROM attempts a JOIN workers w ON w.worker_id = a.worker_id "
                             "WHERE a.run_id = %s", (run_id,)) == [("edge-1",)]
    doc = json.loads(cp.ok("run", "show", run_id, "--json"))      # the Run and its Attempt name the Worker
    assert (doc["workerId"], doc["workerName"]) == (worker_id, "edge-1")
    assert [(a["workerId"], a["workerName"]) for a in doc["attempts"]] == [(worker_id, "edge-1")]
    assert cp.ok("run", "ls", "--state", "dispatching").count(run_id) == 0
    token = cp.ok("token", "create", "--subject", "alice", "--role", "operator").strip()
    status, _, body = https(plane, f"{BASE}/runs/{run_id}", token)
    run = json.loads(body)
    assert status == 200 and (run["workerId"], run["workerName"]) == (worker_id, "edge-1")
    assert (run["latestAttempt"]["workerId"], run["latestAttempt"]["workerName"]) == (worker_id, "edge-1")
    status, headers, body = https(plane, f"{BASE}/runs/{run_id}/log", token)
    assert (status, body, headers["x-qlagent-log-size"]) == (200, output, str(len(output)))
    assert int(headers["x-qlagent-server-now-us"]) > 0
    status, headers, body = https(plane, f"{BASE}/runs/{run_id}/log", token, {"Range": "bytes=6-9"})
    assert (status, body, headers["content-range"]) == (206, b"from", "bytes 6-9/34")
    status, _, body = https(plane, f"{BASE}/runs?state=dispatching", token)
    assert status == 200 and json.loads(body)["items"] == []
    # The listener admits a Worker's 256 KiB log chunk; the API keeps its own body bound, and the
    # server's refusals carry both error shapes (API ``code``, Worker protocol ``error``).
    big = json.dumps({"pad": "x" * 4096}).encode()
    status, _, body = https(plane, f"{BASE}/tasks/greet/runs", token, {"Content-Type": "application/json"},
                            "POST", big)
    assert status == 413 and json.loads(body)["code"] == "body_too_large", body
    status, body = announce_body(plane, f"{BASE}/tasks/greet/runs", 300_000)
    doc = json.loads(body)
    assert status == 413 and doc["code"] == doc["error"] == "body_too_large", body
    assert sql(plane["url"], "SELECT count(*) FROM runs") == [(1,)]


def test_a_drained_worker_waits_out_its_long_poll_instead_of_pulling_in_a_loop(plane):
    """A Pull answered ``draining`` comes back at once; the Worker waits until its long-poll
    (pull_wait_s = 20) would have ended before it asks again (it sent ~170 Pulls a second)."""
    port = free_port()
    cp = plane["cp"]
    worker_id, cred = enroll(plane, "pacer")
    cp.ok("workers", "drain", "pacer")
    node = Node(plane["root"], "pacer", f'[worker]\nworker_id = "{worker_id}"\n'
                                        f'control_url = "https://127.0.0.1:{plane["port"]}"\n'
                                        f'credential_file = "{cred}"\nca_file = "{plane["ca"]}"\n'
                                        'heartbeat_interval_s = 1\npull_wait_s = 20\n'
                                        f'[http]\nlisten = "127.0.0.1:{port}"\n')
    worker = Proc(node)
    plane["workers"].append(worker)
    worker.wait_line("worker.ready")

    def pulls() -> int:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/v3/worker", timeout=10) as r:
            return json.loads(r.read())["counts"]["pulls"]
    first = wait_until(pulls, 10, "the first Pull (the Session opens)", step=0.1)
    time.sleep(5)
    assert first >= 1 and pulls() - first == 0, (first, pulls())
    # Heartbeats go on meanwhile: the Session stays open.
    assert sql(plane["url"], "SELECT s.state FROM worker_sessions s JOIN workers w USING (worker_id) "
                             "WHERE w.name = 'pacer' ORDER BY s.generation DESC LIMIT 1") == [("open",)]
    worker.stop()


def test_a_burst_of_task_starts_of_a_single_instance_task_all_run_one_at_a_time(plane):
    # A burst of concurrent Task Starts of a `concurrency = "single"` Task (the default): every
    # Run ends, each released as the live one ends, and no two Workers run two of its Runs at once.
    # Here two Workers with 2 slots each.
    import uuid
    from concurrent.futures import ThreadPoolExecutor
    cp = plane["cp"]
    for name in ("burst-1", "burst-2"):
        start_worker(plane, name, plane["ca"], "--slots", "2")[0].wait_line("worker.ready")
    token = cp.ok("token", "create", "--subject", "bursty", "--role", "operator").strip()
    head = json.loads(https(plane, f"{BASE}/tasks/greet", token)[2])
    before = {r[0] for r in sql(plane["url"], "SELECT run_id FROM runs")}

    def start(_):
        body = json.dumps({"schema": "qinglong/task-start@v1", "mutationId": str(uuid.uuid4()),
                           "expectedRevision": head["revision"], "expectedContentDigest": head["contentDigest"]})
        return https(plane, f"{BASE}/tasks/greet/runs", token, {"Content-Type": "application/json"}, "POST",
                     body.encode())[0]
    with ThreadPoolExecutor(4) as ex:
        assert list(ex.map(start, range(24))) == [202] * 24
    new = "SELECT r.run_id, r.state FROM runs r WHERE NOT r.run_id = ANY(%s)"
    states = lambda: [st for _, st in sql(plane["url"], new, (list(before),))]  # noqa: E731
    wait_until(lambda: states() == ["succeeded"] * 24, 90, "the 24 Runs succeeded", step=0.2, detail=states)
    spans = sorted(sql(plane["url"], "SELECT a.started_at_us, a.ended_at_us FROM attempts a "
                                     "WHERE NOT a.run_id = ANY(%s)", (list(before),)))
    assert len(spans) == 24 and all(e0 <= s1 for (_, e0), (s1, _) in zip(spans, spans[1:])), spans
    assert sql(plane["url"], "SELECT count(DISTINCT worker_id) FROM attempts WHERE NOT run_id = ANY(%s)",
               (list(before),))[0][0] >= 1


def test_a_worker_trusting_another_ca_is_refused_with_one_line_and_writes_nothing(plane):
    worker, worker_id = start_worker(plane, "edge-wrong-ca", plane["other_ca"])
    assert worker.proc.wait(20) == 2
    errors = [ln for ln in worker.lines if " ERR " in ln]
    assert len(errors) == 1 and "worker.ca_file" in errors[0] and "Traceback" not in "".join(worker.lines), \
        worker.lines
    assert sql(plane["url"], "SELECT generation FROM workers WHERE worker_id = %s", (worker_id,)) == [(0,)]
    assert sql(plane["url"], "SELECT count(*) FROM worker_sessions WHERE worker_id = %s", (worker_id,)) == [(0,)]


@pytest.mark.parametrize("extra, field, why", [
    # README's example: enrolled with site and arch, configured with site and uplink.
    ('labels = { site = "lab", uplink = "lte" }\n', "worker.labels.uplink", "not granted by the enrolment"),
    ("slots = 3\n", "worker.slots", "3 exceeds the enrolled 2"),
])
def test_a_worker_claiming_more_than_its_enrolment_stops_naming_the_key_and_opens_no_session(plane, extra, field,
                                                                                            why):
    # The Worker stops (exit 2) with one line naming the key and opens no Session: it does not
    # retry a refused hello for ever.
    name = f"edge-wide-{field.rsplit('.', 1)[-1]}"
    worker, worker_id = start_worker(plane, name, plane["ca"], "--label", "site=lab", "--label", "arch=arm64",
                                     "--slots", "2", extra=extra)
    assert worker.proc.wait(20) == 2, worker.lines
    errors = [ln for ln in worker.lines if " ERR " in ln]
    assert len(errors) == 1 and f"field={field}" in errors[0] and why in errors[0], worker.lines
    assert "Traceback" not in "".join(worker.lines) and "connect_failed" not in "".join(worker.lines)
    assert sql(plane["url"], "SELECT count(*) FROM worker_sessions WHERE worker_id = %s", (worker_id,)) == [(0,)]


@pytest.mark.parametrize("cluster, field", [
    ('tls_cert = "{root}/missing.pem"\ntls_key = "{key}"\n', "cluster.tls_cert"),
    ('tls_cert = "{cert}"\ntls_key = "{other_key}"\n', "cluster.tls_key"),
    ("pool_size = 3\nthreads = 4\n", "cluster.pool_size"),
])
def test_bad_tls_or_pool_values_stop_the_replica_naming_the_field_and_write_nothing(plane, cluster, field):
    root = plane["root"]
    name = create_database(f"e2e_bad_{field.rsplit('.', 1)[-1]}")
    try:
        node = Node(root, f"bad-{field}", f'[cluster]\ndatabase = "{db_url(name)}"\n' +
                    cluster.format(root=root, cert=plane["cert"], key=plane["key"], other_key=plane["other_key"]))
        p = run_cli(*node.scope, "serve", "--listen", "127.0.0.1:0", timeout=30)
        lines = p.stderr.decode().strip().splitlines()
        assert p.returncode == 2 and len(lines) == 1 and field in lines[0], p.stderr
        assert sql(db_url(name), "SELECT count(*) FROM pg_tables WHERE schemaname = 'public'") == [(0,)]
    finally:
        drop_database(name)


def test_a_task_sees_the_same_ql3_variables_on_a_worker_as_on_a_local_agent(plane):
    """README lists the QL3_* identity every task gets: a fleet Worker sets the same names, none
    empty, as a local agent (QL3_TASK_NAME was empty on a Worker)."""
    cp = plane["cp"]
    worker, _ = start_worker(plane, "edge-env", plane["ca"])
    worker.wait_line("worker.ready")
    run_id = cp.ok("run", "start", "envdump").strip()
    done = "SELECT r.state, a.log_next_offset > 0 FROM runs r JOIN attempts a ON a.attempt_id = r.latest_attempt_id " \
           "WHERE r.run_id = %s"
    wait_until(lambda: sql(plane["url"], done, (run_id,)) == [("succeeded", True)], 30,
               "the Run succeeded with log bytes", step=0.1, detail=lambda: "".join(worker.lines))
    on_worker = dict(ln.split("=", 1) for ln in cp.ok("run", "logs", run_id).splitlines())
    local = Node(plane["root"], "local-env", "")
    local.ok("init")
    tasks = os.path.join(plane["root"], "local-env-tasks.toml")
    with open(tasks, "w") as f:
        f.write(TASKS)
    local.ok("task", "add", "-f", tasks)
    local_run = local.ok("run", "start", "envdump", "--wait").split()[0]
    on_local = dict(ln.split("=", 1) for ln in local.ok("run", "logs", local_run).splitlines())
    assert sorted(on_worker) == sorted(on_local) and "QL3_TASK_NAME" in on_local, (on_worker, on_local)
    assert all(on_worker.values()) and all(on_local.values()), (on_worker, on_local)
    assert on_worker["QL3_TASK_NAME"] == on_local["QL3_TASK_NAME"] == "envdump"
    assert on_worker["QL3_RUN_ID"] == run_id


def test_sigterm_ends_the_replica_promptly_while_the_worker_long_polls(plane):
    replica, worker = plane["replica"], plane["workers"][0]
    # The Worker is idle: its Pull waits up to pull_wait_s = 20 s on the replica. The replica
    # answers it at once on SIGTERM instead of holding the drain until the wait ends.
    time.sleep(1.0)                  # the Worker's Pull after its last ACK is parked on the replica
    replica.proc.send_signal(signal.SIGTERM)
    assert replica.proc.wait(10) == 0               # not held until the Pull's 20 s are up
    replica.wait_line("service.stopped")
    assert worker.proc.poll() is None                     # the Worker survives and retries
    assert worker.stop() == 0


def test_a_replica_whose_certificate_names_none_of_its_listen_addresses_warns_at_start(plane):
    """The certificate names localhost/127.0.0.1; a replica listening on 127.0.0.2 started
    without a word, and every Worker then refused it. It warns at start (the address and the
    names); the plane's replica on 127.0.0.1 does not."""
    assert not any("http.tls_names" in ln for ln in plane["replica"].lines)
    name = create_database("e2e_tls_names")
    try:
        node = Node(plane["root"], "tls-names", f'[cluster]\ndatabase = "{db_url(name)}"\n'
                                                f'tls_cert = "{plane["cert"]}"\ntls_key = "{plane["key"]}"\n')
        node.ok("init")
        replica = Proc(node, "--listen", f"127.0.0.2:{free_port()}")
        try:
            line = replica.wait_line("http.tls_names")
            assert "WARNING" in line and "address=127.0.0.2" in line and "DNS:localhost" in line, line
            assert "IP:127.0.0.1" in line
        finally:
            assert replica.stop() == 0
    finally:
        drop_database(name)
