"""``qlagent serve`` / the CLI with a ``[cluster]`` table against real PostgreSQL: a control-plane
replica serves the existing HTTP routes on the cluster authority (ADR-0376 matrix over real
HTTP, two replicas racing one mutationId), the CLI works through the same ports, bad
``[cluster]`` values are refused naming the field with nothing written, and a configuration
without ``[cluster]`` never imports psycopg or ``qlagent.cluster``."""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import psycopg
import pytest

from conftest import ADMIN_URL, create_database, db_url, drop_database
from jsonshape import check_conventions, check_list
from kit import Serve, clean_env, free_port, qlagent_argv, run_cli, scratch_dir, wait_until

BASE = "/api/v3/projects/default"
SCHEMA = "qinglong/task-start@v1"
TASKS = """
[[task]]
name = "hello"
shell = "/bin/sh"
script = "echo hello"

[[task]]
name = "racer"
shell = "/bin/sh"
script = "echo racer"

[[task]]
name = "fenced"
shell = "/bin/sh"
script = "echo fenced"

[[task]]
name = "on-mars"
shell = "/bin/sh"
script = "echo mars"
placement = { required = { site = "mars" }, preferred = { arch = "arm64" } }

[[task]]
name = "in-lab"
shell = "/bin/sh"
script = "echo lab"
executor = "remote_worker"
placement = { required = { site = "lab" } }
"""

class Env:
    """A state directory, a config with ``[cluster]`` on the module's database, the CLI."""

    def __init__(self, root: str, url: str, extra: str = "") -> None:
        self.root, self.url = root, url
        self.state = os.path.join(root, "state")
        self.config = os.path.join(root, "qlagent.toml")
        with open(self.config, "w") as f:
            pool = "" if "pool_size" in extra else "pool_size = 4\n"
            f.write(f'[cluster]\ndatabase = "{url}"\n{pool}{extra}')
        os.chmod(self.config, 0o600)

    def cli(self, *args: str, stdin: bytes | None = None) -> subprocess.CompletedProcess:
        return run_cli("--state-dir", self.state, "--config", self.config, *args, stdin=stdin)

    def ok(self, *args: str, stdin: bytes | None = None) -> str:
        p = self.cli(*args, stdin=stdin)
        assert p.returncode == 0 and b"Traceback" not in p.stderr, (args, p.stdout, p.stderr)
        return p.stdout.decode()

    def define(self, tasks: str) -> None:
        """``init`` the cluster authority and ``task add`` the TOML ``tasks``."""
        self.ok("init")
        path = os.path.join(self.root, "tasks.toml")
        with open(path, "w") as f:
            f.write(tasks)
        self.ok("task", "add", "-f", path)

    def sql(self, query: str, args=()):
        with psycopg.connect(self.url, autocommit=True) as c:
            cur = c.execute(query, args)
            return cur.fetchall() if cur.description else []


class Replica(Serve):
    """``qlagent serve --listen`` with ``[cluster]``: a control-plane replica in a subprocess."""

    def __init__(self, env: Env) -> None:
        self.port = free_port()
        super().__init__("--state-dir", env.state, "--config", env.config,
                         serve_args=("--listen", f"127.0.0.1:{self.port}"))
        assert any("role=control-plane" in ln for ln in self.lines), "".join(self.lines)

    def request(self, method: str, path: str, body: bytes | None = None, token: str | None = None):
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        try:
            conn.request(method, path, body=body, headers={"Authorization": f"Bearer {token}"} if token else {})
            resp = conn.getresponse()
            return resp.status, json.loads(resp.read() or b"null")
        finally:
            conn.close()


def body(head: dict, mutation_id: str | None = None) -> bytes:
    return json.dumps({"schema": SCHEMA, "mutationId": mutation_id or str(uuid.uuid4()),
                       "expectedRevision": head["revision"], "expectedContentDigest": head["contentDigest"]}).encode()


@pytest.fixture(scope="module")
def cp(pg_url):
    root = scratch_dir("qlagent-cp-")
    env = Env(root, pg_url, "sweep_interval_s = 0.5\n")
    env.define(TASKS)
    tokens = {s: env.ok("token", "create", "--subject", s, "--role", "operator").strip() for s in ("alice", "rita")}
    replicas = [Replica(env), Replica(env)]
    yield env, replicas, tokens
    for r in replicas:
        assert r.stop() == 0
    shutil.rmtree(root, ignore_errors=True)


def _head(replica, tok, task):
    status, doc = replica.request("GET", f"{BASE}/tasks/{task}", token=tok)
    assert status == 200, doc
    return doc


def _runs(env, task):
    return env.sql("SELECT r.run_id FROM runs r JOIN tasks t USING (task_id) WHERE t.name = %s", (task,))


MANY_TASKS, MANY_STARTS, MANY_CLIENTS = 20, 200, 100


@pytest.fixture(scope="module")
def cp20():
    """Two replicas on a database of 20 Tasks (its own, so the count of Runs is the test's)."""
    root = scratch_dir("qlagent-cp20-")
    name = create_database("serve_many")
    env = Env(root, db_url(name), "pool_size = 8\n\n[http]\nmax_in_flight = 64\n")
    with open(env.config, "r+") as f:         # a control-plane host's profile: 64 requests in flight
        doc = f.read()
        f.seek(0)
        f.write('profile = "standalone"\n' + doc)
    env.define("".join(f'[[task]]\nname = "many-{i}"\nshell = "/bin/sh"\nscript = "true"\n\n'
                       for i in range(MANY_TASKS)))
    token = env.ok("token", "create", "--subject", "rita", "--role", "operator").strip()
    replicas = [Replica(env), Replica(env)]
    yield env, replicas, token
    for r in replicas:
        assert r.stop() == 0
    drop_database(name)
    shutil.rmtree(root, ignore_errors=True)


def test_replica_is_ready_and_task_start_is_202_then_200_on_the_other_replica(cp):
    env, (a, b), tok = cp
    assert a.request("GET", "/readyz")[0] == 200 and b.request("GET", "/readyz")[0] == 200
    h = _head(a, tok["alice"], "hello")
    req = body(h)
    status, first = a.request("POST", f"{BASE}/tasks/hello/runs", req, tok["alice"])
    assert (status, first["outcome"], first["state"]) == (202, "accepted", "queued")
    status, again = b.request("POST", f"{BASE}/tasks/hello/runs", req, tok["alice"])   # another replica
    assert (status, again["outcome"]) == (200, "existing")
    assert {k: again[k] for k in ("runId", "attemptId", "eventIds")} == {k: first[k] for k in ("runId", "attemptId",
                                                                                              "eventIds")}
    assert env.sql("SELECT a.executor_type, r.requested_by FROM attempts a JOIN runs r USING (run_id) "
                   "WHERE r.run_id = %s", (first["runId"],)) == [("remote_worker", "alice")]
    status, run = b.request("GET", f"{BASE}/runs/{first['runId']}", token=tok["alice"])
    assert status == 200 and run["state"] == "queued"


def test_sixteen_concurrent_starts_with_one_mutation_id_across_two_replicas(cp):
    env, replicas, tok = cp
    req = body(_head(replicas[0], tok["rita"], "racer"))
    with ThreadPoolExecutor(16) as ex:
        answers = list(ex.map(lambda i: replicas[i % 2].request("POST", f"{BASE}/tasks/racer/runs", req, tok["rita"]),
                              range(16)))
    assert sorted(s for s, _ in answers) == [200] * 15 + [202]
    assert len({doc["runId"] for _, doc in answers}) == 1
    assert len(_runs(env, "racer")) == 1


def test_a_task_start_waiting_on_the_database_never_holds_the_probes_or_other_requests(cp):
    # A Task Start may wait up to 5 s for its Task's row; run on the loop thread it held every
    # other connection (/healthz p50 43 ms under 4 Task Start clients): the API routes run on
    # the database threads instead. Here the Task's row is held by this test, so the Task Start
    # is parked in PostgreSQL while the other requests are answered.
    env, (a, _), tok = cp
    req = body(_head(a, tok["alice"], "hello"))
    with psycopg.connect(env.url) as holder:
        holder.execute("SELECT 1 FROM tasks WHERE name = 'hello' FOR UPDATE")
        started: dict = {}
        t = threading.Thread(target=lambda: started.update(answer=a.request("POST", f"{BASE}/tasks/hello/runs",
                                                                            req, tok["alice"])))
        t.start()
        wait_until(lambda: env.sql("SELECT 1 FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                                   "AND datname = current_database() AND pid <> pg_backend_pid()"),
                   10, "the Task Start parked behind the Task's row")
        assert _probe(a.port, "/healthz", 2)[0] == 200
        assert _probe(a.port, f"{BASE}/tasks/hello", 2, tok["alice"])[0] == 200
        assert "answer" not in started                # still parked behind the Task's row all along
        holder.commit()
    t.join(30)
    assert started["answer"][0] == 202, started


def test_two_hundred_starts_of_twenty_tasks_across_two_replicas_one_mutation_id_ten_times(cp20):
    """200 Task Starts over real HTTP from 100 concurrent clients (as many as the replicas' HTTP
    in-flight bound admits), spread over two replicas: 20 Tasks, 10 starts each; one mutationId
    is sent 10 times (the Task "many-0"), the others once. Every start is answered 202 or 200 —
    never 503 while PostgreSQL is up — and each mutationId has one Run."""
    env, replicas, token = cp20
    heads = {f"many-{i}": _head(replicas[0], token, f"many-{i}") for i in range(MANY_TASKS)}
    repeated = str(uuid.uuid4())
    requests = [(task, body(heads[task], repeated if task == "many-0" else None))
                for task in heads for _ in range(MANY_STARTS // MANY_TASKS)]
    with ThreadPoolExecutor(MANY_CLIENTS) as ex:
        answers = list(ex.map(lambda ir: replicas[ir[0] % 2].request("POST", f"{BASE}/tasks/{ir[1][0]}/runs",
                                                                      ir[1][1], token), enumerate(requests)))
    statuses = sorted(s for s, _ in answers)
    new = MANY_STARTS - MANY_STARTS // MANY_TASKS + 1
    assert statuses == [200] * (MANY_STARTS - new) + [202] * new, [a for a in answers if a[0] not in (200, 202)]
    assert len({doc["runId"] for s, doc in answers}) == new
    assert len({doc["runId"] for (task, _), (s, doc) in zip(requests, answers) if task == "many-0"}) == 1
    per_key = env.sql("SELECT idempotency_key, count(*) FROM runs WHERE trigger_type = 'task_start' "
                      "AND task_id IN (SELECT task_id FROM tasks WHERE name LIKE 'many-%%') GROUP BY 1")
    assert len(per_key) == new and {n for _, n in per_key} == {1}


def test_fences_over_http_on_postgresql(cp):
    env, (a, b), tok = cp
    h = _head(a, tok["alice"], "fenced")
    mid = str(uuid.uuid4())
    assert a.request("POST", f"{BASE}/tasks/fenced/runs", body(h, mid), tok["alice"])[0] == 202
    other = _head(a, tok["alice"], "hello")
    status, err = b.request("POST", f"{BASE}/tasks/hello/runs", body(other, mid), tok["alice"])
    assert (status, err["reason"]) == (409, "mutation_conflict")
    before = len(_runs(env, "fenced"))
    with open(os.path.join(env.root, "edit.toml"), "w") as f:
        f.write('[[task]]\nname = "fenced"\nshell = "/bin/sh"\nscript = "echo edited"\n')
    env.ok("task", "edit", "fenced", "-f", os.path.join(env.root, "edit.toml"), "--expect-revision",
           str(h["revision"]), "--expect-digest", h["contentDigest"])
    status, err = b.request("POST", f"{BASE}/tasks/fenced/runs", body(h), tok["alice"])
    assert (status, err["code"], err["reason"]) == (409, "task_start_fence_rejected", "definition_changed")
    env.ok("task", "disable", "fenced")
    status, err = a.request("POST", f"{BASE}/tasks/fenced/runs", body(_head(a, tok["alice"], "fenced")), tok["alice"])
    assert (status, err["reason"]) == (409, "task_disabled")
    env.ok("task", "enable", "fenced")
    env.ok("role", "set", "alice", "viewer")                                   # authorization revoked
    status, err = b.request("POST", f"{BASE}/tasks/fenced/runs", body(_head(a, tok["alice"], "fenced")), tok["alice"])
    assert (status, err["code"]) == (403, "permission_denied"), err
    env.ok("role", "set", "alice", "operator")
    status, err = a.request("POST", f"{BASE}/tasks/nope/runs", body(h), tok["alice"])
    assert (status, err["code"]) == (404, "task_not_found")
    assert len(_runs(env, "fenced")) == before                               # no refusal wrote a Run


def test_execution_revision_missing_corrupt_and_unprovable_over_http(cp):
    env, (a, b), tok = cp
    h = _head(a, tok["alice"], "hello")
    task_id = env.sql("SELECT task_id FROM tasks WHERE name = 'hello' AND deleted_at_us IS NULL")[0][0]
    before = len(_runs(env, "hello"))
    env.sql("ALTER TABLE execution_revisions DISABLE TRIGGER execution_revisions_append_only")
    try:
        env.sql("CREATE TABLE qlt_saved AS SELECT * FROM execution_revisions WHERE task_id = %s", (task_id,))
        env.sql("UPDATE execution_revisions SET spec_json = spec_json || ' ' WHERE task_id = %s", (task_id,))
        status, err = a.request("POST", f"{BASE}/tasks/hello/runs", body(h), tok["alice"])
        assert (status, err["code"]) == (503, "task_start_unavailable")
        env.sql("DELETE FROM execution_revisions WHERE task_id = %s", (task_id,))
        status, err = b.request("POST", f"{BASE}/tasks/hello/runs", body(h), tok["alice"])
        assert (status, err["reason"]) == (409, "task_not_executable")
    finally:
        env.sql("DELETE FROM execution_revisions WHERE task_id = %s", (task_id,))
        env.sql("INSERT INTO execution_revisions SELECT * FROM qlt_saved")
        env.sql("DROP TABLE qlt_saved")
        env.sql("ALTER TABLE execution_revisions ENABLE TRIGGER execution_revisions_append_only")
    # A transaction that can never be proven consistent (every try a serialization failure):
    # bounded re-runs, then 503 task_start_unavailable, nothing written.
    env.sql("CREATE FUNCTION qlt_conflict() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
            "RAISE EXCEPTION 'could not serialize' USING ERRCODE = '40001'; END $$")
    env.sql("CREATE TRIGGER qlt_conflict BEFORE INSERT ON runs FOR EACH ROW EXECUTE FUNCTION qlt_conflict()")
    try:
        status, err = a.request("POST", f"{BASE}/tasks/hello/runs", body(h), tok["alice"])
    finally:
        env.sql("DROP TRIGGER qlt_conflict ON runs")
        env.sql("DROP FUNCTION qlt_conflict()")
    assert (status, err["code"]) == (503, "task_start_unavailable")
    assert len(_runs(env, "hello")) == before
    assert a.request("POST", f"{BASE}/tasks/hello/runs", body(h), tok["alice"])[0] == 202   # and it recovers


def test_cli_runs_logs_and_cancel_through_the_ports_on_postgresql(cp):
    env, (a, _), tok = cp
    run_id = env.ok("run", "start", "hello").strip()
    shown = json.loads(env.ok("run", "show", run_id, "--json"))
    assert shown["state"] == "queued" and [a["executorType"] for a in shown["attempts"]] == ["remote_worker"]
    assert run_id in env.ok("run", "ls")
    (attempt_id,) = env.sql("SELECT attempt_id FROM attempts WHERE run_id = %s", (run_id,))[0]
    for off, data in ((0, b"hello "), (6, b"from a worker\n")):     # what a Worker's upload leaves
        env.sql("INSERT INTO log_chunks VALUES (%s, %s, %s)", (attempt_id, off, data))
    assert env.ok("run", "logs", run_id) == "hello from a worker\n"
    page = json.loads(env.ok("run", "logs", run_id, "--json", "--offset", "6", "--limit", "4"))
    assert (page["data"], page["size"], page["nextOffset"], page["eof"]) == ("from", 20, 10, False)
    assert env.ok("run", "cancel", run_id).split() == [run_id, "cancelled"]
    assert env.sql("SELECT state FROM runs WHERE run_id = %s", (run_id,)) == [("cancelled",)]
    env.ok("secret", "set", "api-key", stdin=b"s3cr3t\n")
    (blob,) = env.sql("SELECT ciphertext FROM secrets WHERE name = 'api-key'")[0]
    assert b"s3cr3t" not in bytes(blob)                                        # ciphertext only


@pytest.mark.parametrize("extra, field", [
    ("[cluster.dispatcher]\ncandidate_pages = 17\n", "cluster.dispatcher.candidate_pages"),
    ("[cluster.dispatcher]\nclaim_tries = 65\n", "cluster.dispatcher.claim_tries"),
    ("pool_size = 65\n", "cluster.pool_size"),
    ("lease_ttl_s = 4\n", "cluster.lease_ttl_s"),
    ('tls_cert = "/etc/cert.pem"\n', "cluster.tls_key"),
])
def test_bad_cluster_config_is_refused_at_start_up_naming_the_field_and_writes_nothing(tmp_path, extra, field):
    name = create_database(f"badcfg_{abs(hash(field)) % 10_000}")
    try:
        env = Env(str(tmp_path), db_url(name), extra)
        for args in (("serve",), ("init",)):
            p = env.cli(*args)
            lines = p.stderr.decode().strip().splitlines()
            assert p.returncode == 2 and len(lines) == 1 and field in lines[0], (args, p.stderr)
        assert env.sql("SELECT count(*) FROM pg_tables WHERE schemaname = 'public'") == [(0,)]
    finally:
        drop_database(name)


def test_a_retired_dispatcher_key_is_a_warning_naming_it_not_a_refusal(tmp_path):
    """A file written for an earlier version (the dispatch cycle's recovery and Worker page
    budgets) still loads: one warning line per retired key, exit 0."""
    env = Env(str(tmp_path), "postgresql://postgres@127.0.0.1:5432/unused",
              "[cluster.dispatcher]\nworker_page_size = 64\nrecovery_pages = 2\nclaim_tries = 8\n")
    p = env.cli("config", "check", "--json")
    assert p.returncode == 0, p.stderr
    assert p.stderr.decode().splitlines() == [
        f"qlagent: warning: {env.config}: cluster.dispatcher.{k} is no longer used (ignored); remove it"
        for k in ("recovery_pages", "worker_page_size")]
    assert json.loads(p.stdout)["config"]["cluster"]["dispatcher"] == {
        "candidate_page_size": 8, "candidate_pages": 2, "claim_tries": 8}


def test_several_hosts_need_target_session_attrs_read_write(tmp_path):
    env = Env(str(tmp_path), "postgresql://postgres@127.0.0.1:5432,127.0.0.2:5432/x")
    p = env.cli("task", "ls")
    assert p.returncode == 2 and b"cluster.database.target_session_attrs" in p.stderr and b"Traceback" not in p.stderr
    env = Env(str(tmp_path), "postgresql://postgres@127.0.0.1:5432,127.0.0.1:5432/postgres"
                             "?target_session_attrs=read-write")
    assert env.cli("config", "check").returncode == 0


def test_without_cluster_nothing_of_the_cluster_is_imported(tmp_path):
    """A local agent (serve with HTTP, the CLI) in a fresh interpreter loads neither psycopg nor
    qlagent.cluster nor the PostgreSQL adapter."""
    state = str(tmp_path / "state")
    code = f"""
import sys, threading
from qlagent.cli.main import main
assert main(["--state-dir", {state!r}, "init"]) == 0
assert main(["--state-dir", {state!r}, "task", "ls"]) == 0
from qlagent.service.config import resolve
from qlagent.service.main import Service
s = Service(resolve(None, state_dir={state!r}), listen="127.0.0.1:0", exit_after_s=0.2)
assert s.run() == 0
bad = sorted(m for m in sys.modules if m.startswith(("psycopg", "qlagent.cluster", "qlagent.adapters.postgres",
                                                      "qlagent.service.controlplane")))
print("LOADED", bad)
"""
    env = {k: v for k, v in os.environ.items() if not k.startswith("QLAGENT_")}
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, env=env, timeout=60, cwd=str(tmp_path))
    assert p.returncode == 0, p.stderr
    assert p.stdout.decode().strip().splitlines()[-1] == "LOADED []"


def test_workers_enroll_ls_drain_rm(cp):
    import hashlib

    from qlagent.adapters.postgres.connection import open_pool
    from qlagent.adapters.postgres.registry import PgWorkerRegistry
    from qlagent.cluster.registry import WorkerRegistry
    env, _, _ = cp
    out = json.loads(env.ok("workers", "enroll", "edge-1", "--label", "site=lab", "--label", "arch=arm64",
                            "--slots", "2", "--json"))
    credential = out["credential"]
    assert env.sql("SELECT name, credential_digest, labels, slots FROM workers WHERE worker_id = %s",
                   (out["workerId"],)) == [("edge-1", hashlib.sha256(credential.encode()).hexdigest(),
                                            {"arch": "arm64", "site": "lab"}, 2)]
    listed = json.loads(env.ok("workers", "ls", "--json"))["items"]
    assert [(w["name"], w["state"], w["generation"], w["freeSlots"]) for w in listed] == [("edge-1", "offline", 0, 2)]
    pool = open_pool(env.url, 1)
    try:                                                  # the Worker connects: a Session, generation 1
        WorkerRegistry(PgWorkerRegistry(pool)).open_session(out["workerId"], credential)
    finally:
        pool.close()
    listed = json.loads(env.ok("workers", "ls", "--json"))
    (w,) = check_list(listed, "workers ls", pages=False)        # README "JSON output": items, RFC 3339 instants
    assert (w["state"], w["generation"], w["sessionId"] is not None, w["lastHeartbeatAt"] is not None) == \
        ("online", 1, True, True)
    check_conventions(out, "workers enroll")
    assert "edge-1" in env.ok("workers", "ls") and credential not in env.ok("workers", "ls")
    assert env.ok("workers", "drain", "edge-1").split()[-1] == "draining"
    assert json.loads(env.ok("workers", "ls", "--json"))["items"][0]["state"] == "draining"
    assert env.cli("workers", "enroll", "edge-1").returncode == 3                   # the live name is taken
    for _ in range(2):                                                             # resume undoes drain; idempotent
        assert json.loads(env.ok("workers", "resume", "edge-1", "--json")) == \
            {"name": "edge-1", "workerId": out["workerId"], "state": "active"}
        assert json.loads(env.ok("workers", "ls", "--json"))["items"][0]["state"] == "online"
    assert json.loads(env.ok("workers", "drain", "edge-1", "--json")) == \
        {"name": "edge-1", "workerId": out["workerId"], "state": "draining"}
    assert env.ok("workers", "resume", "edge-1").split()[-1] == "active"
    env.ok("workers", "rm", "edge-1")
    assert json.loads(env.ok("workers", "ls", "--json"))["items"] == []
    p = env.cli("workers", "rm", "edge-1")
    assert p.returncode == 4 and b"edge-1" in p.stderr


def _labels(n: int, key_bytes: int = 1, value_bytes: int = 1) -> list[str]:
    """``n`` --label options; the first has a key and value of exactly these byte lengths."""
    out = []
    for i in range(n):
        key = ("k" * key_bytes) if i == 0 else f"l{i}"
        out += ["--label", f"{key}={'v' * value_bytes if i == 0 else 'x'}"]
    return out


@pytest.mark.parametrize("args, field, limit", [
    (("Bad Name",), "name", "64"),
    (("w" * 65,), "name", "64"),                                     # 64 is the longest name
    (("edge\n",), "name", "64"),
    (("w", "--label", "site"), "--label", None),
    (("w", "--label", "=v"), "--label", None),
    (("w", "--label", "a=1", "--label", "a=2"), "--label", None),
    (("w", *_labels(33)), "label", "32"),                           # 32 labels is the most
    (("w", *_labels(1, key_bytes=129)), "label.kkk", "128"),         # 128-byte keys and values pass
    (("w", *_labels(1, value_bytes=129)), "label.k", "128"),
    (("w", "--label", "k=" + "é" * 65), "label.k", "128"),           # bytes, not characters
    (("w", "--slots", "0"), "slots", "256"),
    (("w", "--slots", "257"), "slots", "256"),
    (("w", "--slots", "two"), "--slots", None),
    (("w", "--executor", "remote_worker"), "--executor", None),
    (("w", "--executor", "local_process", "--executor", "local_process"), "executor", None),
    (("w", *[a for i in range(33) for a in ("--project", f"p{i}")]), "project", "32"),    # 32 Projects at most
    (("w", "--project", "default", "--project", "default"), "project", None),
    (("w", "--project", ""), "project", "128"),
])
def test_bad_workers_enroll_is_one_line_exit_2_and_writes_nothing(cp, args, field, limit):
    env, _, _ = cp
    before = env.sql("SELECT * FROM workers ORDER BY worker_id")
    p = env.cli("workers", "enroll", *args)
    lines = p.stderr.decode().strip().splitlines()
    assert p.returncode == 2 and len(lines) == 1 and field in lines[0], p.stderr
    assert limit is None or limit in lines[0], lines
    assert b"Traceback" not in p.stderr and p.stdout == b""
    assert env.sql("SELECT * FROM workers ORDER BY worker_id") == before


X = "\udcff"     # how Python gives the argv byte 0xFF, which is not UTF-8 (PEP 383 surrogateescape)
_COUNTED = ("projects", "role_bindings", "api_tokens", "tasks", "task_revisions", "runs", "attempts", "workers")


def _written(env) -> tuple:
    """Row counts a refused request or command must leave as they were, and the cancel intents."""
    return tuple(env.sql(f"SELECT count(*) FROM {t}")[0][0] for t in _COUNTED) + (
        env.sql("SELECT count(*) FROM runs WHERE cancel_requested_at_us IS NOT NULL")[0][0],)


@pytest.mark.parametrize("args, name", [
    (("workers", "enroll", "w2", "--label", f"k{X}=v"), "--label"),
    (("workers", "enroll", "w2", "--label", f"k=v{X}"), "--label"),
    (("--project", X, "task", "ls"), "--project"),
    (("task", "show", X), "name"),
    (("task", "edit", X, "-f", "/nonexistent.toml", "--expect-revision", "1", "--expect-digest", "0" * 64), "name"),
    (("run", "start", X), "task"),
    (("run", "ls", "--task", X), "--task"),
    (("token", "create", "--subject", X, "--role", "viewer"), "--subject"),
    (("workers", "drain", X), "name"),
], ids=lambda v: " ".join(v).replace(X, "<FF>") if isinstance(v, tuple) else v)
def test_a_not_utf8_argument_on_the_cluster_is_one_line_exit_2_and_writes_nothing(cp, args, name):
    # Refused before psycopg sees it: one line naming the argument, never `internal error:
    # UnicodeEncodeError` (exit 1).
    env, _, _ = cp
    before = _written(env)
    p = env.cli(*args)
    assert (p.returncode, p.stderr, p.stdout) == (2, f"qlagent: error: {name}: is not valid UTF-8\n".encode(), b"")
    p = env.cli("--json", *args)
    assert p.returncode == 2 and json.loads(p.stdout)["error"] == {
        "code": "invalid_input", "field": name, "message": f"{name}: is not valid UTF-8"}
    assert _written(env) == before


_NO_WORKER = "/api/v3/cluster/workers/00000000-0000-4000-8000-000000000000"


@pytest.mark.parametrize("method, path, field, code", [
    ("GET", f"{BASE}/runs?task=a%00b", "task", "bad_query"),
    ("GET", f"{BASE}/runs/a%00b", "runId", "bad_request"),
    ("GET", f"{BASE}/runs/a%00b/log", "runId", "bad_request"),
    ("GET", f"{BASE}/runs/a%00b/events", "runId", "bad_request"),
    ("POST", f"{BASE}/runs/a%00b/cancel", "runId", "bad_request"),
    ("GET", f"{BASE}/tasks/a%00b", "taskId", "bad_request"),
    ("GET", "/api/v3/projects/a%00b/runs", "projectId", "bad_request"),
    ("POST", f"{BASE}/tasks/a%00b/runs", "taskId", "invalid_task_start_request"),
    ("POST", "/api/v3/projects/a%00b/tasks/hello/runs", "projectId", "invalid_task_start_request"),
    # the Worker routes, in the Worker protocol's error shape
    ("POST", "/api/v3/cluster/workers/a%00b/heartbeat", "workerId", "invalid_request"),
    ("POST", "/api/v3/cluster/workers/a%00b/sessions", "workerId", "invalid_request"),
    ("PUT", f"{_NO_WORKER}/attempts/a%00b/log", "attemptId", "invalid_request"),
    ("POST", f"{_NO_WORKER}/pull?wait=%00", "wait", "invalid_request"),
])
def test_nul_in_a_path_parameter_or_query_is_400_on_a_replica_and_writes_nothing(cp, method, path, field, code):
    # PostgreSQL text cannot hold NUL (a DataError would be 500 internal_error) where SQLite takes
    # it: the Router refuses it first on both (tests/test_http_api.py: SQLite).
    env, replicas, tok = cp
    before = _written(env)
    body = b'{"schema": "qinglong/task-start@v1"}' if method != "GET" else None
    for replica in replicas:
        status, doc = replica.request(method, path, body, tok["alice"])
        assert status == 400, doc
        got = (doc["error"], doc["field"]) if "error" in doc else (doc["code"], doc["field"])
        assert got == (code, field) and field in doc["message"], doc
    assert _written(env) == before


def test_workers_enroll_at_every_limit_is_accepted_exactly(cp):
    env, _, _ = cp
    name = "w" * 64
    out = json.loads(env.ok("workers", "enroll", name, *_labels(32, key_bytes=128, value_bytes=128),
                            "--slots", "256", "--json"))
    small = json.loads(env.ok("workers", "enroll", "w", "--label", "k=" + "é" * 64, "--slots", "1", "--json"))
    try:
        (labels, slots), = env.sql("SELECT labels, slots FROM workers WHERE worker_id = %s", (out["workerId"],))
        assert (len(labels), labels["k" * 128], slots) == (32, "v" * 128, 256)
        assert env.sql("SELECT name, labels, slots FROM workers WHERE worker_id = %s", (small["workerId"],)) == \
            [("w", {"k": "é" * 64}, 1)]
    finally:
        env.ok("workers", "rm", name)
        env.ok("workers", "rm", "w")


def test_bad_workers_drain_resume_and_rm_name_the_field_and_write_nothing(cp):
    env, _, _ = cp
    env.ok("workers", "enroll", "keep-me")
    try:
        before = env.sql("SELECT * FROM workers ORDER BY worker_id")
        for verb in ("drain", "resume", "rm"):
            for name, code, text in (("w" * 65, 2, "name"), ("Bad Name", 2, "name"), ("absent", 4, "absent")):
                p = env.cli("workers", verb, name)
                lines = p.stderr.decode().strip().splitlines()
                assert p.returncode == code and len(lines) == 1 and text in lines[0], (verb, name, p.stderr)
            p = env.cli("workers", verb, "absent", "--json")             # --json: the error object on stdout
            assert p.returncode == 4 and json.loads(p.stdout)["error"]["code"] == "worker_not_found", p.stdout
            p = env.cli("workers", verb)                                 # NAME missing: usage
            assert p.returncode == 2 and len(p.stderr.decode().strip().splitlines()) == 1, p.stderr
        assert env.sql("SELECT * FROM workers ORDER BY worker_id") == before
    finally:
        env.ok("workers", "rm", "keep-me")


def test_workers_need_a_cluster_table(tmp_path):
    p = run_cli("--state-dir", str(tmp_path / "s"), "workers", "ls")
    assert p.returncode == 2 and b"[cluster]" in p.stderr and not (tmp_path / "s").exists()


def test_a_run_no_enrolled_worker_can_match_is_reported_not_left_waiting_silently(cp):
    env, _, _ = cp
    env.ok("workers", "enroll", "lab-1", "--label", "site=lab")
    mars, lab = env.ok("run", "start", "on-mars").strip(), env.ok("run", "start", "in-lab").strip()
    # the replicas' sweep pass (every 0.5 s) checks it
    wait_until(lambda: "run.unplaceable" in env.ok("run", "show", mars), 20, "the mars Run reported unplaceable",
               step=0.2)
    shown = json.loads(env.ok("run", "show", mars, "--json"))
    (ev,) = [e for e in shown["events"] if e["type"] == "run.unplaceable"]
    assert ev["payload"]["required"] == {"site": "mars", "executor": "local_process"} and shown["state"] == "queued"
    wait_until(lambda: env.sql("SELECT placement_checked FROM runs WHERE run_id = %s", (lab,)) == [(True,)], 20,
               "the lab Run's placement checked", step=0.2)
    assert "run.unplaceable" not in env.ok("run", "show", lab)         # lab-1 can take it
    env.ok("workers", "rm", "lab-1")


def test_placement_and_executor_fields_are_validated_naming_the_field(cp):
    env, _, _ = cp
    for body_, field in (('executor = "docker"', "executor"),
                         ('executor = "local_process"', "executor"),      # the cluster runs remote_worker
                         ('placement = { required = { executor = "ssh" } }', "placement.required.executor"),
                         ('placement = { anywhere = { a = "b" } }', "placement"),
                         ("placement = { preferred = { %s } }" % ", ".join(f'k{i} = "v"' for i in range(33)),
                          "placement.preferred")):
        path = os.path.join(env.root, "bad.toml")
        with open(path, "w") as f:
            f.write(f'[[task]]\nname = "bad"\nshell = "/bin/sh"\nscript = "true"\n{body_}\n')
        p = env.cli("task", "add", "-f", path)
        lines = p.stderr.decode().strip().splitlines()
        assert p.returncode == 2 and len(lines) == 1 and field in lines[0], (body_, p.stderr)
    assert "bad" not in env.ok("task", "ls")


def test_doctor_checks_the_cluster_database(cp, tmp_path):
    env, _, _ = cp
    checks = {c["name"]: c for c in json.loads(env.ok("doctor", "--json"))["checks"]}
    assert all(checks[n]["ok"] for n in ("database", "schema", "capability", "secrets"))
    gone = Env(str(tmp_path), "postgresql://postgres@127.0.0.1:1/none")
    p = gone.cli("doctor")
    assert p.returncode == 5 and b"FAIL  database" in p.stdout and b"Traceback" not in p.stderr


def test_two_replica_processes_fire_each_instant_once_and_sighup_reloads(cp):
    env, replicas, _ = cp
    path = os.path.join(env.root, "tick.toml")
    with open(path, "w") as f:        # every second (6 fields, seconds first); added after the replicas started
        f.write('[[task]]\nname = "tick"\nshell = "/bin/sh"\nscript = "true"\nschedule = "* * * * * *"\n'
                'concurrency = "parallel"\n')
    env.ok("task", "add", "-f", path)
    for r in replicas:
        r.proc.send_signal(signal.SIGHUP)              # re-read the heads now, not at the 10 s reload
    wait_until(lambda: len(_runs(env, "tick")) >= 3, 8, "three Runs of the every-second schedule", step=0.2)
    env.ok("task", "disable", "tick")
    per_instant = env.sql("SELECT r.scheduled_for_us, count(*) FROM runs r JOIN tasks t USING (task_id) "
                          "WHERE t.name = 'tick' GROUP BY 1")
    assert len(per_instant) >= 3 and all(n == 1 for _, n in per_instant)
    assert all(r.proc.poll() is None for r in replicas)


def test_run_start_wait_on_the_cluster_watches_until_the_worker_ends_it(cp):
    """``--wait`` waits through ``dispatching`` (a Lease offered) and ends with the Worker's
    outcome; the replica never runs it itself."""
    env, replicas, tokens = cp
    p = subprocess.Popen(qlagent_argv("--state-dir", env.state, "--config", env.config,
                                      "run", "start", "hello", "--wait", "--timeout", "30"),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=clean_env())
    ((run_id,),) = wait_until(lambda: env.sql(
        "SELECT r.run_id FROM runs r JOIN tasks t USING (task_id) WHERE t.name = 'hello' AND r.state = 'queued' "
        "AND r.requested_by = 'local:cli' ORDER BY r.created_at_us DESC LIMIT 1"), 15, "the CLI's queued Run", step=0.1)
    env.sql("UPDATE runs SET state = 'dispatching' WHERE run_id = %s", (run_id,))   # what a claim does
    assert run_id in env.ok("run", "ls", "--state", "dispatching")               # the filter knows the state
    status, page = replicas[0].request("GET", f"{BASE}/runs?state=dispatching&limit=100", token=tokens["alice"])
    assert status == 200 and run_id in [r["runId"] for r in page["items"]], page
    assert {r["state"] for r in page["items"]} == {"dispatching"}
    time.sleep(1.0)
    assert p.poll() is None                                                       # still waiting
    env.sql("UPDATE runs SET state = 'succeeded', exit_code = 0 WHERE run_id = %s", (run_id,))   # the Worker's end
    out, err = p.communicate(timeout=30)
    assert p.returncode == 0 and out.decode().split() == [run_id, "succeeded", "exit=0"], err


def test_readyz_is_503_naming_the_store_while_the_database_refuses_connections(tmp_path):
    # With the database refusing connections, /readyz answers 503 naming the store (not 500
    # internal_error after the pool's 10 s) and the replica's journal carries no traceback.
    name = create_database("readyz_down")
    env = Env(str(tmp_path), db_url(name), "sweep_interval_s = 0.5\n")
    env.ok("init")
    replica = Replica(env)
    try:
        assert replica.request("GET", "/readyz")[0] == 200
        with psycopg.connect(ADMIN_URL, autocommit=True) as admin:
            admin.execute(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS false')
            admin.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s", (name,))
            status, doc = replica.request("GET", "/readyz")
            assert status == 503 and doc["status"] == "not_ready", doc
            assert "cluster database unavailable" in doc["checks"]["store"], doc
            admin.execute(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS true')
        # The pool reconnects within a couple of seconds of the database's return (README).
        wait_until(lambda: replica.request("GET", "/readyz")[0] == 200, 10, "/readyz 200 again")
        assert replica.stop() == 0
        assert "Traceback" not in "".join(replica.lines), "".join(replica.lines)
    finally:
        replica.stop()
        drop_database(name)


def _probe(port: int, path: str, timeout: float, token: str | None = None):
    """(status, Retry-After, JSON body) or a socket.timeout when no answer comes in ``timeout`` s."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("GET", path, headers={"Authorization": f"Bearer {token}"} if token else {})
        resp = conn.getresponse()
        return resp.status, resp.getheader("Retry-After"), json.loads(resp.read() or b"null")
    finally:
        conn.close()


def test_a_database_outage_never_silences_the_probes_and_is_journalled_once(tmp_path):
    # The loop's duties do not each wait the pool's 10 s for a connection: during an outage and
    # once access returns, /healthz and /readyz keep being answered.
    name = create_database("outage")
    env = Env(str(tmp_path), db_url(name), "sweep_interval_s = 0.5\n")
    env.ok("init")
    tok = env.ok("token", "create", "--subject", "olga", "--role", "operator").strip()
    replica = Replica(env)
    admin = psycopg.connect(ADMIN_URL, autocommit=True)
    try:
        admin.execute(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS false')
        admin.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s"
                      " AND pid <> pg_backend_pid()", (name,))
        for _ in range(12):            # several of the loop's failing passes and back-offs
            assert _probe(replica.port, "/healthz", 3)[0] == 200
            time.sleep(0.25)
        status, retry, doc = _probe(replica.port, "/readyz", 4)
        assert (status, retry, doc["status"]) == (503, "1", "not_ready"), doc
        assert "cluster database unavailable" in doc["checks"]["store"], doc
        status, retry, doc = _probe(replica.port, f"{BASE}/tasks/hello", 8, tok)
        assert (status, retry) == (503, "1"), doc
        admin.execute(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS true')
        # a couple of seconds: the pool does not sit in a long back-off
        wait_until(lambda: _probe(replica.port, "/readyz", 4)[0] == 200, 6, "/readyz 200 once access returned",
                   step=0.1)
        replica.wait_line("store.available", 15)   # the loop's duties resume within their back-off cap (8 s)
        assert replica.stop() == 0
        journal = "".join(replica.lines)
        assert journal.count("store.unavailable") == 1 and journal.count("store.available") == 1, journal
        assert "pool-1" not in journal and "Traceback" not in journal, journal
    finally:
        admin.execute(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS true')
        admin.close()
        replica.stop()
        drop_database(name)


def test_a_grace_the_lease_cannot_hold_is_refused_at_task_add_and_never_offered(tmp_path):
    # grace_s = 30 under lease_ttl_s = 30: were it offered, its Worker would stop it right after it
    # started (lease_lost action=kill) and the run would end lost with no hint.
    name = create_database("ops_grace")
    env = Env(str(tmp_path), db_url(name), "sweep_interval_s = 0.5\n")       # lease_ttl_s = 30: grace ≤ 24.971 s
    env.ok("init")
    long_grace = ('[[task]]\nname = "slow-stop"\nshell = "/bin/sh"\nscript = "true"\ngrace_s = 30\n'
                  'placement = { required = { pool = "g" } }\n')
    path = os.path.join(str(tmp_path), "grace.toml")
    with open(path, "w") as f:
        f.write(long_grace)
    replica = None
    try:
        for verb in (("task", "add", "-f", path), ("task", "edit", "slow-stop", "-f", path,
                                                      "--expect-revision", "1", "--expect-digest", "0" * 64)):
            p = env.cli(*verb)
            lines = p.stderr.decode().strip().splitlines()
            assert p.returncode == 2 and len(lines) == 1 and "grace_s" in lines[0] and "24.971" in lines[0], p.stderr
        assert env.sql("SELECT count(*) FROM tasks") == [(0,)]                # nothing written
        with open(path, "w") as f:                                            # the same grace fits a 24 s one
            f.write(long_grace.replace("grace_s = 30", "grace_s = 24"))
        env.ok("task", "add", "-f", path)
        # A Task stored before (here: by a CLI with a longer Lease) is never offered but reported.
        os.mkdir(tmp_path / "roomy")
        roomy = Env(str(tmp_path / "roomy"), db_url(name), "lease_ttl_s = 120\n")
        roomy.state = env.state
        with open(path, "w") as f:
            f.write(long_grace)
        head = json.loads(env.ok("task", "show", "slow-stop", "--json"))
        roomy.ok("task", "edit", "slow-stop", "-f", path, "--expect-revision", str(head["revision"]),
                 "--expect-digest", head["contentDigest"])
        out = json.loads(env.ok("workers", "enroll", "g-1", "--label", "pool=g", "--json"))
        replica = Replica(env)
        run = env.ok("run", "start", "slow-stop").strip()
        # the replica's sweep pass (every 0.5 s) checks it
        wait_until(lambda: "run.unplaceable" in env.ok("run", "show", run), 20, "the Run reported unplaceable",
                   step=0.2)
        shown = json.loads(env.ok("run", "show", run, "--json"))
        (ev,) = [e for e in shown["events"] if e["type"] == "run.unplaceable"]
        assert ev["payload"]["reason"] == "grace_exceeds_lease" and ev["payload"]["field"] == "grace_s"
        assert (ev["payload"]["graceS"], ev["payload"]["limitS"]) == (30, 24.971)
        headers = {"Authorization": f"Worker {out['credential']}", "Content-Type": "application/json"}

        def call(route: str, doc: dict) -> tuple[int, dict]:
            conn = http.client.HTTPConnection("127.0.0.1", replica.port, timeout=30)
            try:
                conn.request("POST", f"/api/v3/cluster/workers/{out['workerId']}/{route}", json.dumps(doc), headers)
                resp = conn.getresponse()
                return resp.status, json.loads(resp.read() or b"null")
            finally:
                conn.close()
        status, grant = call("sessions", {})
        assert status == 201, grant
        status, answer = call("pull", {"sessionId": grant["sessionId"], "generation": grant["generation"],
                                       "pullId": str(uuid.uuid4()), "leaseToken": "t" * 43})
        assert status == 200 and answer["status"] in ("idle", "unmatched") and "attemptId" not in answer, answer
        assert json.loads(env.ok("run", "show", run, "--json"))["state"] == "queued"
        # A Task that fits is offered; removing its Worker loses the Attempt, whose missing
        # figures `run show` prints as "-" (it printed kept=None dropped=None).
        with open(path, "w") as f:
            f.write(long_grace.replace("slow-stop", "quick").replace("grace_s = 30", "grace_s = 1"))
        env.ok("task", "add", "-f", path)
        quick = env.ok("run", "start", "quick").strip()
        status, answer = call("pull", {"sessionId": grant["sessionId"], "generation": grant["generation"],
                                       "pullId": str(uuid.uuid4()), "leaseToken": "t" * 43})
        assert status == 200 and answer["offer"]["runId"] == quick, answer
        o = answer["offer"]
        status, acked = call("acks", {"sessionId": o["sessionId"], "generation": o["generation"],
                                      "attemptId": o["attemptId"], "leaseGeneration": o["leaseGeneration"],
                                      "leaseToken": o["leaseToken"], "kind": "starting"})
        assert status == 200, acked
        env.ok("workers", "rm", "g-1")
        wait_until(lambda: json.loads(env.ok("run", "show", quick, "--json"))["state"] == "lost", 20,
                   "the removed Worker's Run lost", step=0.2)
        (line,) = [ln for ln in env.ok("run", "show", quick).splitlines() if ln.startswith("attempt")]
        assert " lost " in line and "kept=- dropped=-" in line and "None" not in line, line
    finally:
        if replica is not None:
            assert replica.stop() == 0
        drop_database(name)


# ---- config check runs serve's database-free checks (service.preflight) --------------------

def _one_error(p: subprocess.CompletedProcess) -> str:
    lines = p.stderr.decode().strip().splitlines()
    assert p.returncode == 2 and len(lines) == 1 and "Traceback" not in lines[0], p.stderr
    return lines[0]


@contextlib.contextmanager
def own_database(name: str):
    """A database of this test's own (its URL), dropped afterwards whatever happened."""
    created = create_database(name)
    try:
        yield db_url(created)
    finally:
        drop_database(created)


@pytest.mark.parametrize("extra, field, words, ok_extra", [
    # 1 route thread needs 3 connections: 2 is one under the limit, 3 the limit.
    ("pool_size = 2\nthreads = 1\n", "cluster.pool_size", "threads + 2 = 3", "pool_size = 3\nthreads = 1\n"),
    ("pool_size = 1\n", "cluster.pool_size", "threads + 2 = 3", "pool_size = 3\n"),
    # grace_s = 0 first fits under a 6 s Lease (core.leasefit): 5 is refused, 6 accepted.
    ("lease_ttl_s = 5\n", "cluster.lease_ttl_s", "6..3600", "lease_ttl_s = 6\n"),
])
def test_config_check_refuses_what_serve_refuses_before_the_database(tmp_path, extra, field, words, ok_extra):
    # `config check` (ExecReload, the OpenWrt validator) refuses what serve refuses: pool_size = 1,
    # and a lease_ttl_s = 5 under which no Task would fit.
    with own_database(f"cfgchk_pre_{abs(hash(extra)) % 10_000}") as url:
        os.makedirs(tmp_path / "bad")
        env = Env(str(tmp_path / "bad"), url, extra)
        for args in (("config", "check"), ("serve",)):
            line = _one_error(env.cli(*args))
            assert f"{field}: " in line and words in line, (args, line)
        assert env.sql("SELECT count(*) FROM pg_tables WHERE schemaname = 'public'") == [(0,)]
        os.makedirs(tmp_path / "ok")
        good = Env(str(tmp_path / "ok"), url, ok_extra)
        assert good.ok("config", "check").startswith("config ok: ")


def test_config_check_and_serve_name_the_tls_file_that_is_wrong(tmp_path):
    from cpkit import make_ca
    _, cert, key = make_ca(str(tmp_path), "a")
    _, _, other_key = make_ca(str(tmp_path), "b")
    junk = str(tmp_path / "junk.pem")
    with open(junk, "w") as f:
        f.write("not PEM at all\n")
    os.chmod(junk, 0o600)           # as private as a key must be: judged for what it holds
    cert_as_key = str(tmp_path / "cert-as-key.pem")
    shutil.copyfile(cert, cert_as_key)
    os.chmod(cert_as_key, 0o600)
    missing = str(tmp_path / "missing.pem")
    cases = [  # (cert, key, field, words): the certificate is judged first, then the key, then the pair
        (junk, key, "cluster.tls_cert", "holds no PEM certificate"),
        (key, key, "cluster.tls_cert", "holds no PEM certificate"),          # a key where the cert goes
        (missing, key, "cluster.tls_cert", "cannot read"),
        (cert, junk, "cluster.tls_key", "holds no PEM private key"),
        (cert, cert_as_key, "cluster.tls_key", "holds no PEM private key"),
        (cert, missing, "cluster.tls_key", "cannot read"),
        (cert, other_key, "cluster.tls_key", "are not a pair"),
    ]
    with own_database("cfgchk_tls") as url:
        for i, (c, k, field, words) in enumerate(cases):
            os.makedirs(tmp_path / str(i))
            env = Env(str(tmp_path / str(i)), url, f'tls_cert = "{c}"\ntls_key = "{k}"\n')
            for args in (("config", "check"), ("serve",)):
                line = _one_error(env.cli(*args))
                assert f"{field}: " in line and words in line, (c, k, args, line)
        assert env.sql("SELECT count(*) FROM pg_tables WHERE schemaname = 'public'") == [(0,)]
        os.makedirs(tmp_path / "ok")
        env = Env(str(tmp_path / "ok"), url, f'tls_cert = "{cert}"\ntls_key = "{key}"\n')
        assert env.ok("config", "check").startswith("config ok: ")


@pytest.mark.parametrize("mode", [0o640, 0o644, 0o666, 0o604], ids=oct)
def test_a_tls_key_others_may_read_is_refused_by_config_check_serve_and_doctor(tmp_path, mode):
    # A 0666 replica key is refused by `config check` and `serve`, as a 0666 config file is: the
    # key is judged like every trusted file.
    from cpkit import make_ca
    _, cert, key = make_ca(str(tmp_path), "k")
    os.chmod(key, mode)
    with own_database(f"trust_key_{mode:o}") as url:
        os.makedirs(tmp_path / "cp")
        env = Env(str(tmp_path / "cp"), url, f'tls_cert = "{cert}"\ntls_key = "{key}"\n')
        for args in (("config", "check"), ("serve", "--listen", "127.0.0.1:0")):
            p = env.cli(*args)
            lines = p.stderr.decode().strip().splitlines()
            assert p.returncode == 5 and len(lines) == 1, (args, p.stderr)
            assert f"cluster.tls_key {key}: mode {mode:04o}" in lines[0] and f"fix: chmod 600 {key}" in lines[0], lines
        assert env.sql("SELECT count(*) FROM pg_tables WHERE schemaname = 'public'") == [(0,)]
        p = env.cli("doctor")
        assert p.returncode == 5 and f"cluster.tls_key {key}: mode {mode:04o}" in p.stdout.decode(), p.stdout
        os.chmod(key, 0o600)
        assert env.ok("config", "check").startswith("config ok: ")
        os.chmod(cert, 0o666)           # the certificate is public, but nobody else may replace it
        line = env.cli("config", "check").stderr.decode()
        assert f"cluster.tls_cert {cert}: mode 0666 is group and world-writable" in line, line


def test_grace_zero_fits_the_least_lease_ttl_and_the_message_reads_at_the_edge(tmp_path):
    # lease_ttl_s = 6 (the least accepted) holds a grace of 0.995 s: 0 and 0.995 are added, 1 is
    # refused naming the real limit (never "0 s … (at most 0 s)").
    with own_database("cfgchk_grace") as url:
        env = Env(str(tmp_path), url, "lease_ttl_s = 6\n")
        env.ok("init")
        path = os.path.join(str(tmp_path), "t.toml")
        for task, grace, ok in (("g0", "0", True), ("g995", "0.995", True), ("g1", "1", False)):
            with open(path, "w") as f:
                f.write(f'[[task]]\nname = "{task}"\nshell = "/bin/sh"\nscript = "true"\ngrace_s = {grace}\n')
            p = env.cli("task", "add", "-f", path)
            if ok:
                assert p.returncode == 0, p.stderr
            else:
                line = _one_error(p)
                assert "task[0].grace_s: 1 s cannot live under cluster.lease_ttl_s = 6 (at most 0.995 s" in line, line
        assert [r[0] for r in env.sql("SELECT name FROM tasks ORDER BY name")] == ["g0", "g995"]


def test_workers_commands_never_create_a_project(tmp_path):
    # `workers enroll w2 --project nosuch` creates no Project 'nosuch'. Workers belong to the
    # cluster: `enroll --project` scopes a Worker to Projects
    # that exist (else exit 4, nothing enrolled); the other verbs do not use --project.
    with own_database("cfgchk_wproj") as url:
        env = Env(str(tmp_path), url)
        env.ok("init")
        before = env.sql("SELECT * FROM projects ORDER BY name")
        p = env.cli("workers", "enroll", "w2", "--project", "nosuch")
        assert p.returncode == 4 and b"no Project named 'nosuch'" in p.stderr, p.stderr
        assert env.sql("SELECT count(*) FROM workers") == [(0,)]
        out = json.loads(env.ok("workers", "enroll", "w2", "--json"))
        assert [w["name"] for w in json.loads(env.ok("workers", "ls", "--project", "nosuch", "--json"))["items"]] \
            == ["w2"]
        for verb in ("drain", "resume"):
            assert env.ok("workers", verb, "w2", "--project", "other").split()[:2] == ["w2", out["workerId"]]
        env.ok("workers", "rm", "w2", "--project", "nosuch")
        assert env.sql("SELECT * FROM projects ORDER BY name") == before


def test_project_option_never_creates_a_project_a_command_is_refused_in(tmp_path):
    # `--project zz1 run start one` (exit 4) leaves no Project zz1 behind, nor does a mistyped
    # `--project nosuch8 token create …`. Commands that act on what a Project holds refuse an
    # unknown one; defining commands create it only with their own write.
    with own_database("projfix_scope") as url:
        env = Env(str(tmp_path), url)
        env.ok("init")
        before = env.sql("SELECT * FROM projects ORDER BY name")
        good = str(tmp_path / "one.toml")
        with open(good, "w") as f:
            f.write('[[task]]\nname = "one"\nshell = "/bin/sh"\nscript = "true"\n')
        bad = str(tmp_path / "bad.toml")
        with open(bad, "w") as f:
            f.write('[[task]]\nname = "one"\n')
        rid = "01JAAAAAAAAAAAAAAAAAAAAAAA"
        for args in [("run", "start", "one"), ("run", "cancel", rid), ("run", "ls"), ("run", "show", rid),
                     ("run", "logs", rid),
                     ("task", "rm", "one"), ("task", "edit", "one", "-f", good, "--expect-revision", "1",
                                             "--expect-digest", "0" * 64),
                     ("task", "enable", "one"), ("task", "disable", "one"), ("task", "show", "one"), ("task", "ls"),
                     ("secret", "rm", "S1"), ("secret", "ls"), ("token", "ls"), ("role", "set", "alice", "none")]:
            p = env.cli("--project", "zz1", *args)
            assert (p.returncode, p.stdout, p.stderr) == (4, b"", b"qlagent: error: project 'zz1' does not exist\n"), \
                args
            assert env.sql("SELECT * FROM projects ORDER BY name") == before, args
        for args, stdin in [(("task", "add", "-f", bad), None), (("secret", "set", "S1"), b""),
                            (("token", "create", "--subject", "", "--role", "viewer"), None),
                            (("token", "create", "--subject", "x" * 129, "--role", "viewer"), None),
                            (("role", "set", "", "viewer"), None)]:
            p = env.cli("--project", "nosuch8", *args, stdin=stdin)
            assert p.returncode == 2 and len(p.stderr.splitlines()) == 1 and b"Traceback" not in p.stderr, \
                (args, p.stderr)
            assert env.sql("SELECT * FROM projects ORDER BY name") == before, args
        env.ok("--project", "p-task", "task", "add", "-f", good)
        assert "one" in env.ok("--project", "p-task", "task", "ls")
        env.ok("--project", "p-secret", "secret", "set", "S1", stdin=b"v")
        assert "S1" in env.ok("--project", "p-secret", "secret", "ls")
        env.ok("--project", "p-token", "token", "create", "--subject", "alice", "--role", "viewer")
        env.ok("--project", "p-role", "role", "set", "alice", "viewer")
        assert [r[0] for r in env.sql("SELECT name FROM projects ORDER BY name")] == \
            ["default", "p-role", "p-secret", "p-task", "p-token"]
