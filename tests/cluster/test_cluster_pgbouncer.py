"""Issue 21 §3: the control plane behind Debian's PgBouncer in transaction mode (each transaction
may run on another server backend; ``default_pool_size = 3`` so clients share them).

- Two ``qlagent init`` started together through the pooler migrate once and both exit 0 (the
  session advisory lock and each migration's transaction went to different backends: a
  duplicate-key failure, or the lock leaked onto a pooled backend and the next start hung).
- A replica behind it serves Task Starts over HTTP and a real Worker's Pulls for a while with no
  ``DuplicatePreparedStatement`` (psycopg prepared after 5 executions) and every Run reaches the
  Worker; its LISTEN, which hears nothing through the pooler, is reported once
  (``listen.unavailable``) and replaced by the periodic re-check; given ``listen_database`` (a
  direct URL) it is not.
- A migration lock held by another session (a leaked one) makes ``qlagent init`` stop after the
  documented bound with a message naming the holder, never hang.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request
import uuid

import psycopg
import pytest

from conftest import create_database, db_url, drop_database, sql
from qlagent.adapters.postgres.migrations import known_migrations
from test_cluster_e2e import Node, Proc
from kit import clean_env, free_port, run_cli, scratch_dir, wait_until

pytestmark = pytest.mark.slow

TASKS = """
[[task]]
name = "quick"
shell = "/bin/sh"
script = "true"
concurrency = "parallel"
"""
STARTS = 30


class Bouncer:
    """``pgbouncer`` (transaction pooling, ``auth_type = any``) on a free port of 127.0.0.1 in
    front of one database of the shared server; run as the ``postgres`` user."""

    def __init__(self, dbname: str) -> None:
        self.dir = tempfile.mkdtemp(prefix="qlagent-pgb-")
        pw = pwd.getpwnam("postgres")
        os.chown(self.dir, pw.pw_uid, pw.pw_gid)
        self.port = free_port()
        self.dbname = dbname
        ini = os.path.join(self.dir, "pgbouncer.ini")
        with open(ini, "w") as f:
            f.write(f"[databases]\n{dbname} = host=127.0.0.1 port=5432 dbname={dbname} user=postgres\n"
                    f"[pgbouncer]\nlisten_addr = 127.0.0.1\nlisten_port = {self.port}\nunix_socket_dir =\n"
                    "auth_type = any\npool_mode = transaction\ndefault_pool_size = 3\nmax_client_conn = 200\n"
                    f"logfile = {self.dir}/pgbouncer.log\npidfile = {self.dir}/pgbouncer.pid\n")
        self.proc = subprocess.Popen(["runuser", "-u", "postgres", "--", "pgbouncer", ini],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

        def listening() -> bool:
            assert self.proc.poll() is None, "pgbouncer ended: " + self.log()
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return True
            except OSError:
                return False
        wait_until(listening, 20, "pgbouncer listening", step=0.1, detail=self.log)

    def url(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{self.dbname}"

    def log(self) -> str:
        try:
            with open(os.path.join(self.dir, "pgbouncer.log")) as f:
                return f.read()[-3000:]
        except OSError:
            return ""

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture
def bouncer():
    if shutil.which("pgbouncer") is None:
        pytest.fail("pgbouncer not installed (apt-get install pgbouncer)", pytrace=False)
    name = create_database("pgbouncer")
    b = Bouncer(name)
    root = scratch_dir("qlagent-pgbt-")
    try:
        yield b, db_url(name), root
    finally:
        b.close()
        shutil.rmtree(root, ignore_errors=True)
        drop_database(name)


def _init_together(nodes: list[Node]) -> list[subprocess.CompletedProcess]:
    procs = [subprocess.Popen(n.argv("init"), stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=clean_env())
             for n in nodes]
    out = []
    for p in procs:
        try:
            stdout, stderr = p.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            p.kill()
            stdout, stderr = p.communicate()
            stderr += b"\n<hung: killed after 60 s>"
        out.append(subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr))
    return out


def _http(port: int, method: str, path: str, token: str, body: dict | None = None):
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", method=method,
                                 data=None if body is None else json.dumps(body).encode(),
                                 headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def test_two_replicas_starting_together_behind_pgbouncer_migrate_once_and_serve_without_prepared_statements(bouncer):
    b, direct, root = bouncer
    cfg = f'[cluster]\ndatabase = "{b.url()}"\npool_size = 6\nsweep_interval_s = 1\n'
    nodes = [Node(root, f"cp{i}", cfg) for i in range(4)]
    results = _init_together(nodes)
    for r in results:
        assert r.returncode == 0 and b"Traceback" not in r.stderr, (r.returncode, r.stderr.decode(), b.log())
    versions = [v for v, in sql(direct, "SELECT version FROM schema_migrations ORDER BY version")]
    assert versions == [m.version for m in known_migrations()], versions
    # Nothing is left holding a lock on a pooled backend: a later start goes through at once.
    again = _init_together(nodes[1:2])[0]
    assert again.returncode == 0, again.stderr.decode()

    cp = nodes[0]
    with open(os.path.join(root, "tasks.toml"), "w") as f:
        f.write(TASKS)
    cp.ok("task", "add", "-f", os.path.join(root, "tasks.toml"))
    token = cp.ok("token", "create", "--subject", "alice", "--role", "operator").strip()
    port = free_port()
    replica = Proc(cp, "--listen", f"127.0.0.1:{port}")
    enrolled = json.loads(cp.ok("workers", "enroll", "edge-1", "--slots", "4", "--json"))
    cred = os.path.join(root, "edge-1.credential")
    fd = os.open(cred, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.write(fd, enrolled["credential"].encode() + b"\n")
    os.close(fd)
    worker = Proc(Node(root, "edge-1", f'[worker]\nworker_id = "{enrolled["workerId"]}"\n'
                                       f'control_url = "http://127.0.0.1:{port}"\ncredential_file = "{cred}"\n'
                                       'heartbeat_interval_s = 1\npull_wait_s = 30\n'))
    direct_listen = None
    try:
        replica.wait_line("service.ready")
        worker.wait_line("worker.ready")
        # Behind the pooler LISTEN hears nothing: said once, naming the setting that fixes it.
        assert "cluster.listen_database" in replica.wait_line("listen.unavailable")
        status, head = _http(port, "GET", "/api/v3/projects/default/tasks/quick", token)
        assert status == 200, head
        started = []
        for _ in range(STARTS):
            status, doc = _http(port, "POST", "/api/v3/projects/default/tasks/quick/runs", token,
                                {"schema": "qinglong/task-start@v1", "mutationId": str(uuid.uuid4()),
                                 "expectedRevision": head["revision"], "expectedContentDigest": head["contentDigest"]})
            assert status == 202, (status, doc, "".join(replica.lines[-10:]))
            started.append(doc["runId"])
            time.sleep(0.3)
        wait_until(lambda: sql(direct, "SELECT count(*) FROM runs WHERE state = 'succeeded'")[0][0] >= STARTS, 60,
                   f"{STARTS} Runs succeeded", step=0.2,
                   detail=lambda: (dict(sql(direct, "SELECT state, count(*) FROM runs GROUP BY state")),
                                   "".join(replica.lines[-20:]), "".join(worker.lines[-20:])))
        states = dict(sql(direct, "SELECT state, count(*) FROM runs GROUP BY state"))
        assert states == {"succeeded": STARTS}, (states, "".join(replica.lines[-20:]), "".join(worker.lines[-20:]))
        # Without LISTEN the re-check (every 0.5 s) still brings each Run to the Worker (4 slots)
        # within seconds; a long-poll that never heard would hold each Run for its full 30 s (the longest allowed).
        lat = sql(direct, "SELECT max(e.created_at_us - r.created_at_us) FROM runs r JOIN run_events e "
                           "USING (run_id) WHERE e.type = 'run.dispatching'")[0][0] / 1e6
        assert lat < 15, lat
        journal = "".join(replica.lines) + "".join(worker.lines)
        assert "DuplicatePreparedStatement" not in journal and "internal error" not in journal, journal[-3000:]
        assert replica.proc.poll() is None
        assert len([ln for ln in replica.lines if "listen.unavailable" in ln]) == 1

        # With a direct URL for LISTEN there is nothing to report.
        other = Node(root, "cp1", cfg + f'listen_database = "{direct}"\n')
        direct_listen = Proc(other, "--listen", f"127.0.0.1:{free_port()}")
        direct_listen.wait_line("service.ready")
        time.sleep(3)       # the probe is over before service.ready; leave room for a late line anyway
        assert not [ln for ln in direct_listen.lines if "listen." in ln], direct_listen.lines
    finally:
        worker.stop()
        replica.stop()
        if direct_listen is not None:
            direct_listen.stop()


def test_a_held_migration_lock_stops_init_after_the_bound_naming_its_holder(bouncer):
    from qlagent.adapters.postgres.migrations import LOCK_WAIT_S, MIGRATION_LOCK
    b, direct, root = bouncer
    node = Node(root, "cp", f'[cluster]\ndatabase = "{b.url()}"\n')
    with psycopg.connect(direct, autocommit=True) as holder:
        holder.execute("SELECT pg_advisory_lock(%s)", (MIGRATION_LOCK,))
        pid = holder.execute("SELECT pg_backend_pid()").fetchone()[0]
        t0 = time.monotonic()
        p = run_cli(*node.scope, "init", timeout=LOCK_WAIT_S + 60)
        took = time.monotonic() - t0
    err = p.stderr.decode()
    assert p.returncode == 5 and took < LOCK_WAIT_S + 20, (p.returncode, took, err)
    assert f"backend pid {pid}" in err and f"pg_terminate_backend({pid})" in err and "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1, err
    # Once the holder is gone, init goes through the pooler.
    assert run_cli(*node.scope, "init", timeout=120).returncode == 0
