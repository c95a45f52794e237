"""The local API end to end (issue 5, ADR-0376): a real ``qlagent serve --listen`` subprocess on
loopback, a real HTTP client, tokens from ``qlagent token create``, the real SQLite file."""

from __future__ import annotations

import hashlib
import http.client
import json
import os
import shutil
import socket
import sqlite3
import subprocess
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import psutil
import pytest

from qlagent.adapters.rows import policy
from qlagent.adapters.rows.dialect import Db
from qlagent.adapters.sqlite.dialect import SQLITE
from qlagent.http.routing import openapi_document

from qlcli import ok
from kit import Serve, free_port, scratch_dir, wait_until


def documented_routes() -> set[tuple[str, str]]:
    """Every (METHOD, path template) the shipped OpenAPI document describes."""
    doc = json.loads(openapi_document())
    return {(method.upper(), path) for path, item in doc["paths"].items() for method in item}


TASKS = r"""
[[task]]
name = "hello"
schedule = "@once"
timeout_s = 30
shell = "/bin/sh"
script = 'echo hello'

[[task]]
name = "chatty"
schedule = "@once"
timeout_s = 60
shell = "/bin/sh"
script = '''
printf '\377\376bin\n'
head -c 5000000 /dev/zero | tr '\0' 'x'
'''

[[task]]
name = "sleeper"
schedule = "@once"
timeout_s = 120
shell = "/bin/sh"
script = '''
sleep 3071 &
sleep 3072
'''

[[task]]
name = "editme"
schedule = "0 3 * * *"
timeout_s = 30
shell = "/bin/sh"
script = 'echo v1'

[[task]]
name = "disableme"
schedule = "@once"
timeout_s = 30
shell = "/bin/sh"
script = 'echo d'

[[task]]
name = "noexec"
schedule = "@once"
timeout_s = 30
shell = "/bin/sh"
script = 'echo n'

[[task]]
name = "corrupt"
schedule = "@once"
timeout_s = 30
shell = "/bin/sh"
script = 'echo c'

[[task]]
name = "racer"
schedule = "@once"
timeout_s = 30
shell = "/bin/sh"
script = 'echo r'

[[task]]
name = "revoked"
schedule = "@once"
timeout_s = 30
shell = "/bin/sh"
script = 'echo rv'
"""

OTHER_TASK = """
[[task]]
name = "foreign"
schedule = "@once"
timeout_s = 30
shell = "/bin/sh"
script = 'echo foreign'
"""

BASE = "/api/v3/projects/default"
BUSY_TIMEOUT_S = 1.0
SCHEMA = "qinglong/task-start@v1"

class Agent(Serve):
    """``qlagent serve --listen 127.0.0.1:PORT`` in a subprocess; ready once it logs
    ``service.ready``."""

    def __init__(self, state: str, listen: bool = True, config: str | None = None) -> None:
        self.state = state
        self.port = free_port()
        super().__init__("--state-dir", state, *(("--config", config) if config else ()),
                         serve_args=("--listen", f"127.0.0.1:{self.port}") if listen else (), timeout=20)

    def request(self, method: str, path: str, body: bytes | None = None, token: str | None = None,
                headers: dict | None = None) -> tuple[int, dict, bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        try:
            hdrs = dict(headers or {})
            if token:
                hdrs["Authorization"] = f"Bearer {token}"
            conn.request(method, path, body=body, headers=hdrs)
            resp = conn.getresponse()
            return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
        finally:
            conn.close()

    def json(self, method: str, path: str, token: str | None = None, body: bytes | None = None):
        status, headers, data = self.request(method, path, body, token)
        assert headers.get("content-type") == "application/json", (status, data)
        return status, json.loads(data)


def token(state: str, subject: str, role: str, project: str | None = None) -> str:
    args = ("--project", project) if project else ()
    return ok(state, *args, "token", "create", "--subject", subject, "--role", role).stdout.decode().strip()


def db(state: str) -> sqlite3.Connection:
    c = sqlite3.connect(os.path.join(state, "qlagent.db"), isolation_level=None, timeout=30)
    c.row_factory = sqlite3.Row
    return c


def counts(state: str) -> tuple[int, int, int]:
    """(Runs, Attempts, run.created events): what a Task Start writes. Other RunEvents are left
    out because Runs started by earlier tests keep appending theirs."""
    with db(state) as c:
        return tuple(c.execute(q).fetchone()[0] for q in (
            "SELECT count(*) FROM runs", "SELECT count(*) FROM attempts",
            "SELECT count(*) FROM run_events WHERE type = 'run.created'"))


def start_body(revision: int, digest: str, mutation_id: str | None = None, **extra) -> bytes:
    doc = {"schema": SCHEMA, "mutationId": mutation_id or str(uuid.uuid4()), "expectedRevision": revision,
           "expectedContentDigest": digest, **extra}
    return json.dumps(doc).encode()


@pytest.fixture(scope="module")
def env():
    root = scratch_dir("qlagent-api-")
    state = os.path.join(root, "state")
    ok(state, "init")
    tf = os.path.join(root, "tasks.toml")
    with open(tf, "w") as f:
        f.write(TASKS)
    ok(state, "task", "add", "-f", tf)
    of = os.path.join(root, "other.toml")
    with open(of, "w") as f:
        f.write(OTHER_TASK)
    ok(state, "--project", "other", "task", "add", "-f", of)
    tokens = {"op": token(state, "alice", "operator"), "viewer": token(state, "vera", "viewer"),
              "other": token(state, "oscar", "owner", project="other"),
              "racer": token(state, "rita", "operator"), "gone": token(state, "gus", "operator")}
    cfg = os.path.join(root, "qlagent.toml")
    with open(cfg, "w") as f:
        f.write(f"busy_timeout_s = {BUSY_TIMEOUT_S}\n")    # a store write gives up after 1 s, not 5
    agent = Agent(state, config=cfg)
    yield agent, state, tokens, root
    agent.stop()
    shutil.rmtree(root, ignore_errors=True)


def head(agent: Agent, tok: str, task: str, base: str = BASE) -> dict:
    status, doc = agent.json("GET", f"{base}/tasks/{task}", tok)
    assert status == 200, doc
    return doc


def start(agent: Agent, tok: str, task: str, body: bytes, base: str = BASE):
    return agent.json("POST", f"{base}/tasks/{task}/runs", tok, body)


def await_state(agent: Agent, tok: str, run_id: str, states: set[str], timeout: float = 30) -> dict:
    """Poll the Run until its state is in ``states`` (the agent offers no push channel)."""
    def reached() -> dict | None:
        status, run = agent.json("GET", f"{BASE}/runs/{run_id}", tok)
        assert status == 200, run
        return run if run["state"] in states else None
    return wait_until(reached, timeout, f"run {run_id} in {sorted(states)}",
                      detail=lambda: agent.json("GET", f"{BASE}/runs/{run_id}", tok)[1])


# ---- Task Start --------------------------------------------------------------------------------

def test_served_routes_equal_the_openapi_document():
    from qlagent.http.api import Api, build_router
    router = build_router(Api.__new__(Api))
    assert set(router.routes()) == documented_routes()


def test_task_start_202_then_exact_replay_200_with_persisted_identities(env):
    agent, state, tok, _ = env
    h = head(agent, tok["op"], "hello")
    body = start_body(h["revision"], h["contentDigest"])
    status, first = start(agent, tok["op"], "hello", body)
    assert status == 202 and first["outcome"] == "accepted" and first["state"] == "queued"
    assert first["taskSnapshotRef"] == f"qltd:v1:{h['revision']}:{h['contentDigest']}"
    status, again = start(agent, tok["op"], "hello", body)
    assert status == 200 and again["outcome"] == "existing"
    for k in ("runId", "attemptId", "eventIds", "createdAt", "taskSnapshotRef"):
        assert again[k] == first[k]
    # The record ADR-0376 §2 fixes, read from the database itself.
    with db(state) as c:
        run = c.execute("SELECT * FROM runs WHERE run_id = ?", (first["runId"],)).fetchone()
        att = c.execute("SELECT * FROM attempts WHERE run_id = ?", (first["runId"],)).fetchall()
        ev = c.execute("SELECT * FROM run_events WHERE run_id = ? AND sequence <= 2 ORDER BY sequence",
                       (first["runId"],)).fetchall()
    assert (run["execution_origin"], run["execution_owner"], run["trigger_type"], run["priority"]) == \
        ("manual", "runtime", "task_start", 0)
    assert run["requested_by"] == "alice" and json.loads(body)["mutationId"] in run["idempotency_key"]
    assert [a["executor_type"] for a in att] == ["local_process"]
    assert [e["type"] for e in ev] == ["run.created", "run.queued"] and [e["event_id"] for e in ev] == first["eventIds"]
    assert all(e["actor"] == "alice" for e in ev)
    payload = json.loads(ev[0]["payload_json"])
    assert payload["bindingVersion"] >= 1 and payload["contentDigest"] == h["contentDigest"]
    assert "echo" not in json.dumps(payload)   # no command in the audit trail
    # on_change(): the Run starts at once, without waiting for any timer.
    done = await_state(agent, tok["op"], first["runId"], {"succeeded"})
    assert done["exitCode"] == 0 and done["latestAttempt"]["executorType"] == "local_process"


def test_sixteen_concurrent_identical_starts_make_exactly_one_run(env):
    agent, state, tok, _ = env
    h = head(agent, tok["racer"], "racer")
    body = start_body(h["revision"], h["contentDigest"])
    before = counts(state)

    def one(_):
        for _attempt in range(50):
            status, headers, data = agent.request("POST", f"{BASE}/tasks/racer/runs", body, tok["racer"])
            if status != 503:
                return status, json.loads(data)
            assert headers["retry-after"] == "1"
        raise AssertionError("still 503 after 50 retries")

    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(one, range(16)))
    statuses = sorted(s for s, _ in results)
    assert statuses == [200] * 15 + [202]
    assert len({d["runId"] for _, d in results}) == 1
    assert counts(state)[0] == before[0] + 1


@pytest.mark.parametrize("field,mutate", [
    ("mutationId", lambda d: d.update(mutationId=d["mutationId"].upper())),
    ("expectedContentDigest", lambda d: d.update(expectedContentDigest=d["expectedContentDigest"].upper())),
    ("extra", lambda d: d.update(extra=1)),
    ("schema", lambda d: d.update(schema="qinglong/task-start@v2")),
    ("expectedRevision", lambda d: d.update(expectedRevision=0)),
    ("expectedRevision", lambda d: d.update(expectedRevision=2147483648)),
    ("expectedRevision", lambda d: d.update(expectedRevision="1")),
    ("expectedContentDigest", lambda d: d.pop("expectedContentDigest")),
    ("runId", lambda d: d.update(runId=str(uuid.uuid4()))),
])
def test_bad_task_start_body_is_400_naming_the_field_and_writes_nothing(env, field, mutate):
    agent, state, tok, _ = env
    h = head(agent, tok["op"], "hello")
    doc = json.loads(start_body(h["revision"], h["contentDigest"]))
    mutate(doc)
    before = counts(state)
    status, err = start(agent, tok["op"], "hello", json.dumps(doc).encode())
    assert status == 400 and err["code"] == "invalid_task_start_request"
    assert err["field"] == field and field in err["message"]
    assert counts(state) == before


def test_malformed_json_and_600_byte_body_are_refused_and_write_nothing(env):
    agent, state, tok, _ = env
    before = counts(state)
    status, err = start(agent, tok["op"], "hello", b'{"schema": ')
    assert status == 400 and err["code"] == "invalid_task_start_request"
    h = head(agent, tok["op"], "hello")
    body = start_body(h["revision"], h["contentDigest"])      # valid, but padded to 600 bytes
    big = body[:-1] + b" " * (600 - len(body)) + b"}"
    assert len(big) == 600 and json.loads(big) == json.loads(body)
    status, _, data = agent.request("POST", f"{BASE}/tasks/hello/runs", big, tok["op"])
    assert status == 413 and json.loads(data)["code"] == "body_too_large"
    assert counts(state) == before


# Every route with a path parameter or a query value holding NUL (%00), or a path parameter that
# is not UTF-8 (%FF): (method, path, status code, field). PostgreSQL text refuses NUL, SQLite
# takes it: the Router refuses it for both before any store call, the same 400 on each
# (tests/cluster/test_cluster_serve.py: the replica).
BAD_PARAMS = [
    ("GET", BASE + "/runs?task=a%00b", "bad_query", "task"),
    ("GET", BASE + "/runs?cursor=a%00b", "bad_query", "cursor"),
    ("GET", BASE + "/runs?state=a%00b", "bad_query", "state"),
    ("GET", BASE + "/runs?a%00b=1", "bad_query", "query"),
    ("GET", BASE + "/runs/a%00b", "bad_request", "runId"),
    ("GET", BASE + "/runs/a%00b/log", "bad_request", "runId"),
    ("GET", BASE + "/runs/a%00b/events", "bad_request", "runId"),
    ("POST", BASE + "/runs/a%00b/cancel", "bad_request", "runId"),
    ("GET", BASE + "/tasks/a%00b", "bad_request", "taskId"),
    ("GET", BASE + "/tasks/hello?x=%00", "bad_query", "x"),
    ("GET", "/api/v3/projects/a%00b/runs", "bad_request", "projectId"),
    ("GET", "/api/v3/projects/a%00b/tasks/hello", "bad_request", "projectId"),
    ("GET", BASE + "/runs/%FF", "bad_request", "runId"),
    # Task Start answers every malformed request with its own code (ADR-0376 §3).
    ("POST", BASE + "/tasks/a%00b/runs", "invalid_task_start_request", "taskId"),
    ("POST", "/api/v3/projects/a%00b/tasks/hello/runs", "invalid_task_start_request", "projectId"),
    ("POST", BASE + "/tasks/hello/runs?x=%00", "invalid_task_start_request", "x"),
    ("POST", BASE + "/tasks/h%FFllo/runs", "invalid_task_start_request", "taskId"),
]


def cancel_intents(state: str) -> int:
    with db(state) as c:
        return c.execute("SELECT count(*) FROM runs WHERE cancel_requested_at_us IS NOT NULL").fetchone()[0]


@pytest.mark.parametrize("method,path,code,field", BAD_PARAMS)
def test_nul_or_non_utf8_parameter_is_400_naming_it_and_writes_nothing(env, method, path, code, field):
    agent, state, tok, _ = env
    h = head(agent, tok["op"], "hello")
    body = start_body(h["revision"], h["contentDigest"]) if method == "POST" else None
    before = counts(state), cancel_intents(state)
    status, err = agent.json(method, path, tok["op"], body)
    assert (status, err["code"], err["field"]) == (400, code, field), err
    assert field in err["message"] and "internal" not in err["message"]
    assert (counts(state), cancel_intents(state)) == before


@pytest.mark.parametrize("method,path,code,field", [
    ("GET", BASE + "/runs?bogus=1", "bad_query", "bogus"),
    ("GET", BASE + "/runs?limit=5&Task=hello", "bad_query", "Task"),
    ("GET", BASE + "/tasks/hello?bogus=1", "bad_query", "bogus"),
    ("POST", BASE + "/tasks/hello/runs?bogus=1", "invalid_task_start_request", "bogus"),
    ("POST", BASE + "/tasks/" + "t" * 65 + "/runs", "invalid_task_start_request", "taskId"),
    ("POST", BASE + "/tasks/Bad%20Name!/runs", "invalid_task_start_request", "taskId"),
])
def test_unknown_query_key_or_invalid_path_name_is_400_naming_it(env, method, path, code, field):
    agent, state, tok, _ = env
    h = head(agent, tok["op"], "hello")
    body = start_body(h["revision"], h["contentDigest"]) if method == "POST" else None
    before = counts(state)
    status, err = agent.json(method, path, tok["op"], body)
    assert (status, err.get("code"), err.get("field")) == (400, code, field), err
    assert field in err["message"], err
    assert counts(state) == before


def test_cancel_with_a_body_is_400_and_records_no_intent(env):
    agent, state, tok, _ = env
    h = head(agent, tok["op"], "sleeper")
    status, created = start(agent, tok["op"], "sleeper", start_body(h["revision"], h["contentDigest"]))
    assert status == 202, created
    before = cancel_intents(state)
    status, err = agent.json("POST", f"{BASE}/runs/{created['runId']}/cancel", tok["op"], b'{"reason": "x"}')
    assert (status, err.get("field")) == (400, "body"), err
    assert cancel_intents(state) == before
    status, done = agent.json("POST", f"{BASE}/runs/{created['runId']}/cancel", tok["op"])
    assert status in (200, 202), done


def test_authentication_and_run_start_policy(env):
    agent, state, tok, _ = env
    h = head(agent, tok["op"], "hello")
    body = start_body(h["revision"], h["contentDigest"])
    before = counts(state)
    status, headers, data = agent.request("POST", f"{BASE}/tasks/hello/runs", body)
    assert status == 401 and headers["www-authenticate"] == "Bearer"
    status, _, _ = agent.request("POST", f"{BASE}/tasks/hello/runs", body, "qlt_" + "A" * 43)
    assert status == 401
    status, err = start(agent, tok["viewer"], "hello", body)        # reads only
    assert status == 403 and err["code"] == "permission_denied"
    assert head(agent, tok["viewer"], "hello")["revision"] == h["revision"]
    # A revoked token stops working at once.
    digest = hashlib.sha256(tok["gone"].encode()).hexdigest()
    with db(state) as c:
        token_id = c.execute("SELECT token_id FROM api_tokens WHERE token_digest = ?", (digest,)).fetchone()[0]
    assert agent.json("GET", f"{BASE}/tasks/hello", tok["gone"])[0] == 200
    ok(state, "token", "revoke", token_id)
    assert agent.json("GET", f"{BASE}/tasks/hello", tok["gone"])[0] == 401
    assert counts(state) == before


def test_task_not_found_including_another_projects_task(env):
    agent, state, tok, _ = env
    h = head(agent, tok["op"], "hello")
    body = start_body(h["revision"], h["contentDigest"])
    before = counts(state)
    status, err = start(agent, tok["op"], "nope", body)
    assert (status, err["code"]) == (404, "task_not_found")
    foreign = head(agent, tok["other"], "foreign", "/api/v3/projects/other")
    # The other Project's Task by its ID under this Project, and this Project's token on the other one.
    status, err = start(agent, tok["op"], foreign["taskId"], body)
    assert (status, err["code"]) == (404, "task_not_found")
    status, err = start(agent, tok["op"], "foreign", body, "/api/v3/projects/other")
    assert (status, err["code"]) == (404, "task_not_found")
    assert agent.json("GET", "/api/v3/projects/other/tasks/foreign", tok["op"])[0] == 404
    assert agent.json("GET", "/api/v3/projects/nowhere/runs", tok["op"])[0] == 404
    # The Project may be named by its ID too.
    assert head(agent, tok["op"], "hello", f"/api/v3/projects/{h['projectId']}")["taskId"] == h["taskId"]
    assert counts(state) == before


def test_definition_changed_when_the_task_is_edited_between_read_and_start(env):
    agent, state, tok, root = env
    h = head(agent, tok["op"], "editme")
    assert h["schedules"][0]["nextFireAt"] and len(h["nextFires"]) == 5
    f = os.path.join(root, "edit.toml")
    with open(f, "w") as fh:
        fh.write(TASKS.split("[[task]]")[4].join(["[[task]]", ""]).replace("echo v1", "echo v2"))
    ok(state, "task", "edit", "editme", "-f", f, "--expect-revision", str(h["revision"]),
       "--expect-digest", h["contentDigest"])
    before = counts(state)
    status, err = start(agent, tok["op"], "editme", start_body(h["revision"], h["contentDigest"]))
    assert (status, err["code"], err["reason"]) == (409, "task_start_fence_rejected", "definition_changed")
    assert counts(state) == before
    h2 = head(agent, tok["op"], "editme")
    assert h2["revision"] == h["revision"] + 1
    assert start(agent, tok["op"], "editme", start_body(h2["revision"], h2["contentDigest"]))[0] == 202


def test_task_disabled_and_mutation_conflict(env):
    agent, state, tok, _ = env
    h = head(agent, tok["op"], "disableme")
    mid = str(uuid.uuid4())
    assert start(agent, tok["op"], "disableme", start_body(h["revision"], h["contentDigest"], mid))[0] == 202
    # The same mutationId for another Task (or other fences) never returns the existing Run.
    other = head(agent, tok["op"], "hello")
    status, err = start(agent, tok["op"], "hello", start_body(other["revision"], other["contentDigest"], mid))
    assert (status, err["reason"]) == (409, "mutation_conflict")
    ok(state, "task", "disable", "disableme")
    assert head(agent, tok["op"], "disableme")["enabled"] is False
    before = counts(state)
    status, err = start(agent, tok["op"], "disableme", start_body(h["revision"], h["contentDigest"]))
    assert (status, err["code"], err["reason"]) == (409, "task_start_fence_rejected", "task_disabled")
    assert counts(state) == before


def test_task_not_executable_and_corrupt_execution_revision(env):
    agent, state, tok, _ = env
    h = head(agent, tok["op"], "noexec")
    with db(state) as c:
        c.execute("DELETE FROM execution_revisions WHERE task_id = ?", (h["taskId"],))
    before = counts(state)
    status, err = start(agent, tok["op"], "noexec", start_body(h["revision"], h["contentDigest"]))
    assert (status, err["code"], err["reason"]) == (409, "task_start_fence_rejected", "task_not_executable")
    h = head(agent, tok["op"], "corrupt")
    with db(state) as c:   # rows are append-only: replace the row with one whose spec was altered
        row = dict(c.execute("SELECT * FROM execution_revisions WHERE task_id = ?", (h["taskId"],)).fetchone())
        c.execute("DELETE FROM execution_revisions WHERE task_id = ?", (h["taskId"],))
        row["spec_json"] = row["spec_json"].replace("echo c", "rm -rf /")
        c.execute(f"INSERT INTO execution_revisions ({','.join(row)}) VALUES ({','.join('?' * len(row))})",
                  tuple(row.values()))
    status, headers, data = agent.request("POST", f"{BASE}/tasks/corrupt/runs",
                                          start_body(h["revision"], h["contentDigest"]), tok["op"])
    assert status == 503 and json.loads(data)["code"] == "task_start_unavailable"
    assert headers["retry-after"] == "1"
    assert counts(state) == before


def _locked_start(agent: Agent, state: str, tok: str, task: str, body: bytes, while_locked, hold_s: float):
    """Hold the write lock from another connection while a Task Start is admitted, run
    ``while_locked(conn)`` inside that transaction, commit after ``hold_s`` and return the answer."""
    # No Run may be live: the engine's own writes would wait on this lock too (see the report:
    # a finishing Run whose write outlasts busy_timeout stops the agent).
    def idle() -> bool:
        with db(state) as c:
            return not c.execute("SELECT count(*) FROM runs WHERE state IN ('queued','starting','running')").fetchone()[0]
    wait_until(idle, 30, "no live Run")
    # Two answered requests = the loop went once around after the last Run ended, so the
    # scheduler pass that a Run end triggers has written already.
    for _ in range(2):
        assert agent.request("GET", "/healthz")[0] == 200
    c = db(state)
    c.execute("BEGIN IMMEDIATE")
    box: list = []
    t = threading.Thread(target=lambda: box.append(start(agent, tok, task, body)))
    t.start()
    # Admission reads are not blocked (WAL); the Task Start transaction waits on the lock.
    time.sleep(hold_s)
    while_locked(c)
    c.execute("COMMIT")
    c.close()
    t.join(30)
    assert box, "".join(agent.lines[-30:])
    return box[0]


def test_authorization_changed_when_the_role_is_revoked_between_admission_and_start(env):
    agent, state, tok, _ = env
    h = head(agent, tok["op"], "revoked")
    before = counts(state)

    def demote(c):    # what `qlagent role set alice viewer` writes, inside the held transaction
        pid = c.execute("SELECT project_id FROM projects WHERE name = 'default'").fetchone()[0]
        policy.bind_role(Db(c, SQLITE), pid, "alice", "viewer", time.time_ns() // 1000)

    status, err = _locked_start(agent, state, tok["op"], "revoked", start_body(h["revision"], h["contentDigest"]),
                                demote, 0.5)
    assert (status, err["code"], err["reason"]) == (409, "task_start_fence_rejected", "authorization_changed")
    assert counts(state) == before
    # Now a plain request is refused at admission; restoring the role lets it through.
    assert start(agent, tok["op"], "revoked", start_body(h["revision"], h["contentDigest"]))[0] == 403
    ok(state, "role", "set", "alice", "operator")
    assert start(agent, tok["op"], "revoked", start_body(h["revision"], h["contentDigest"]))[0] == 202


def test_store_locked_past_busy_timeout_is_503_task_start_unavailable(env):
    agent, state, tok, _ = env
    h = head(agent, tok["op"], "hello")
    before = counts(state)
    status, err = _locked_start(agent, state, tok["op"], "hello", start_body(h["revision"], h["contentDigest"]),
                                lambda c: None, BUSY_TIMEOUT_S + 0.6)   # held past the agent's busy timeout
    assert (status, err["code"]) == (503, "task_start_unavailable"), "".join(agent.lines[-30:])
    assert counts(state) == before


# ---- reads, logs, cancel ----------------------------------------------------------------------

def test_cli_json_and_http_share_one_shape_for_task_run_attempt_and_event(env):
    """application.presenter renders both surfaces: the same Run, Attempt, RunEvents and Task
    head read over HTTP and by `qlagent … --json` are equal field for field."""
    agent, state, tok, _ = env
    h = head(agent, tok["op"], "hello")
    rid = start(agent, tok["op"], "hello", start_body(h["revision"], h["contentDigest"]))[1]["runId"]
    run = await_state(agent, tok["op"], rid, {"succeeded"})
    shown = json.loads(ok(state, "run", "show", rid, "--json").stdout)
    attempts, events = shown.pop("attempts"), shown.pop("events")
    latest = run.pop("latestAttempt")
    assert shown == run and set(run) >= {"runId", "createdAt", "latestAttemptId", "signal"}
    assert attempts[-1] == latest and {"peakRssBytes", "cpuTimeUs", "startedAt"} <= set(latest)
    assert events == agent.json("GET", f"{BASE}/runs/{rid}/events", tok["op"])[1]["items"]
    listed = json.loads(ok(state, "run", "ls", "--task", "hello", "--json").stdout)["items"]
    assert listed[0] == agent.json("GET", f"{BASE}/runs?task=hello", tok["op"])[1]["items"][0]
    task = json.loads(ok(state, "task", "show", "hello", "--json").stdout)
    assert task.pop("definition")["name"] == "hello" and task.pop("skippedFires") == 0
    assert task.pop("secrets") == {} and "PATH" in task.pop("env")          # `task show` extras
    assert task == head(agent, tok["op"], "hello")


def test_run_list_keyset_pagination_and_filters(env):
    agent, state, tok, _ = env
    h = head(agent, tok["op"], "hello")
    ids = {start(agent, tok["op"], "hello", start_body(h["revision"], h["contentDigest"]))[1]["runId"]
           for _ in range(3)}
    seen, cursor = [], None
    while True:
        q = f"{BASE}/runs?task=hello&limit=2" + (f"&cursor={cursor}" if cursor else "")
        status, page = agent.json("GET", q, tok["viewer"])
        assert status == 200 and len(page["items"]) <= 2
        seen += [r["runId"] for r in page["items"]]
        cursor = page["nextCursor"]
        if cursor is None:
            break
    assert ids <= set(seen) and len(seen) == len(set(seen))
    assert all(r["taskName"] == "hello" for r in agent.json("GET", f"{BASE}/runs?task=hello", tok["op"])[1]["items"])
    created = [r["createdAt"] for r in agent.json("GET", f"{BASE}/runs?limit=100", tok["op"])[1]["items"]]
    assert created == sorted(created, reverse=True)
    # ``dispatching`` exists on a control plane only (tests/cluster/test_cluster_e2e.py)
    for q, field in (("state=bogus", "state"), ("state=dispatching", "state"), ("limit=0", "limit"),
                     ("limit=101", "limit"), ("cursor=zzz", "cursor")):
        status, err = agent.json("GET", f"{BASE}/runs?{q}", tok["op"])
        assert status == 400 and err["field"] == field, (q, err)
    status, page = agent.json("GET", f"{BASE}/runs?state=cancelled&limit=100", tok["op"])
    assert all(r["state"] == "cancelled" for r in page["items"])
    assert agent.json("GET", f"{BASE}/runs/{uuid.uuid4()}", tok["op"])[0] == 404


def test_log_reads_offset_limit_range_raw_bytes_and_truncation_header(env):
    agent, state, tok, _ = env
    h = head(agent, tok["op"], "chatty")
    run_id = start(agent, tok["op"], "chatty", start_body(h["revision"], h["contentDigest"]))[1]["runId"]
    await_state(agent, tok["op"], run_id, {"succeeded"})
    path = f"{BASE}/runs/{run_id}/log"
    status, headers, data = agent.request("GET", path + "?offset=0&limit=8", token=tok["viewer"])
    assert status == 200 and data == b"\xff\xfebin\nxx"     # non-UTF-8 bytes intact
    assert headers["content-type"] == "application/octet-stream"
    size = int(headers["x-qlagent-log-size"])
    assert size == 4 * 1024 * 1024 and headers["x-qlagent-log-truncated"] == "true"
    quota, kept, dropped = (int(x.split("=")[1]) for x in headers["x-qlagent-truncation"].split())
    assert quota == size == kept and dropped > 0
    status, headers, data = agent.request("GET", path, token=tok["op"])
    assert status == 200 and len(data) == 65536                       # bounded default
    status, headers, data = agent.request("GET", path + "?limit=1048576&offset=4194000", token=tok["op"])
    assert status == 200 and len(data) == size - 4194000
    status, headers, data = agent.request("GET", path, token=tok["op"], headers={"Range": "bytes=2-5"})
    assert status == 206 and data == b"bin\n" and headers["content-range"] == f"bytes 2-5/{size}"
    status, headers, _ = agent.request("GET", path, token=tok["op"], headers={"Range": f"bytes={size}-"})
    assert status == 416 and headers["content-range"] == f"bytes */{size}"
    status, _, data = agent.request("GET", path + "?limit=1048577", token=tok["op"])
    assert status == 400 and json.loads(data)["field"] == "limit"
    # In JSON (events), bytes are escaped, never raw; the log itself is only ever raw.
    status, events = agent.json("GET", f"{BASE}/runs/{run_id}/events?limit=2", tok["op"])
    assert [e["sequence"] for e in events["items"]] == [1, 2] and events["nextCursor"] == "2"
    status, rest = agent.json("GET", f"{BASE}/runs/{run_id}/events?cursor={events['nextCursor']}", tok["op"])
    assert rest["items"][0]["sequence"] == 3 and rest["nextCursor"] is None


def _tree_alive() -> list[psutil.Process]:
    out = []
    for p in psutil.process_iter(["cmdline"]):
        if p.info["cmdline"] and p.info["cmdline"][:2] in (["sleep", "3071"], ["sleep", "3072"]):
            out.append(p)
    return out


def test_cancel_queued_and_running_runs_stops_the_process_tree(env):
    agent, state, tok, _ = env
    h = head(agent, tok["op"], "sleeper")
    first = start(agent, tok["op"], "sleeper", start_body(h["revision"], h["contentDigest"]))[1]["runId"]
    await_state(agent, tok["op"], first, {"running"})
    wait_until(lambda: len(_tree_alive()) == 2, 10, "the run's two sleep processes")
    second = start(agent, tok["op"], "sleeper", start_body(h["revision"], h["contentDigest"]))[1]["runId"]
    assert agent.json("GET", f"{BASE}/runs/{second}", tok["op"])[1]["state"] == "queued"  # concurrency single
    assert agent.json("POST", f"{BASE}/runs/{second}/cancel", tok["viewer"])[0] == 403
    status, res = agent.json("POST", f"{BASE}/runs/{second}/cancel", tok["op"])
    assert (status, res["state"]) == (200, "cancelled")
    assert agent.json("POST", f"{BASE}/runs/{second}/cancel", tok["op"]) == (200, res)   # idempotent
    status, res = agent.json("POST", f"{BASE}/runs/{first}/cancel", tok["op"])
    assert status == 202 and res["state"] in ("starting", "running")
    run = await_state(agent, tok["op"], first, {"cancelled"})
    assert run["cancelRequested"] is True
    assert _tree_alive() == []
    assert agent.json("POST", f"{BASE}/runs/{first}/cancel", tok["op"]) == (200, {"runId": first, "state": "cancelled"})
    assert agent.json("POST", f"{BASE}/runs/{uuid.uuid4()}/cancel", tok["op"])[0] == 404
    status, events = agent.json("GET", f"{BASE}/runs/{first}/events", tok["op"])
    assert "run.cancel_requested" in [e["type"] for e in events["items"]]
    assert [e["actor"] for e in events["items"] if e["type"] == "run.cancel_requested"] == ["alice"]


def test_health_ready_and_openapi(env):
    agent, _, _, _ = env
    assert agent.json("GET", "/healthz") == (200, {"status": "ok"})
    status, doc = agent.json("GET", "/readyz")
    assert status == 200 and doc["status"] == "ready"
    status, doc = agent.json("GET", "/api/v3/openapi.json")
    assert status == 200 and doc["openapi"].startswith("3.1")
    assert {(m.upper(), p) for p, item in doc["paths"].items() for m in item} == documented_routes()


# ---- restart, drain, import closure -----------------------------------------------------------

def test_replay_after_agent_restart_returns_the_same_identities(workdir):
    state = os.path.join(workdir, "state")
    ok(state, "init")
    tf = os.path.join(workdir, "t.toml")
    with open(tf, "w") as f:
        f.write(TASKS.split("[[task]]")[1].join(["[[task]]", ""]))
    ok(state, "task", "add", "-f", tf)
    tok = token(state, "alice", "operator")
    agent = Agent(state)
    try:
        h = head(agent, tok, "hello")
        body = start_body(h["revision"], h["contentDigest"])
        status, first = start(agent, tok, "hello", body)
        assert status == 202
        await_state(agent, tok, first["runId"], {"succeeded"})
        status, _ = agent.json("GET", "/readyz")
        assert agent.stop() == 0
    finally:
        agent.stop()
    agent = Agent(state)
    try:
        status, again = start(agent, tok, "hello", body)
        assert status == 200 and again["outcome"] == "existing" and again["state"] == "succeeded"
        assert {k: again[k] for k in ("runId", "attemptId", "eventIds", "createdAt")} == \
            {k: first[k] for k in ("runId", "attemptId", "eventIds", "createdAt")}
        assert counts(state)[0] == 1
    finally:
        assert agent.stop() == 0


def test_cli_run_start_and_cancel_share_the_api_semantics(env):
    agent, state, tok, _ = env
    run_id = ok(state, "run", "start", "hello").stdout.decode().strip()
    status, run = agent.json("GET", f"{BASE}/runs/{run_id}", tok["op"])
    assert status == 200 and (run["triggerType"], run["executionOrigin"], run["requestedBy"]) == \
        ("task_start", "manual", policy.LOCAL_SUBJECT)
    status, events = agent.json("GET", f"{BASE}/runs/{run_id}/events?limit=1", tok["op"])
    assert events["items"][0]["payload"]["mutationId"]        # generated, fenced on the read head


PROBE = r"""
import sys, json
from qlagent.service.config import resolve
from qlagent.service.main import Service
listen = sys.argv[2] if len(sys.argv) > 2 else None
code = Service(resolve(None, state_dir=sys.argv[1]), listen=listen, exit_after_s=0.2).run()
print(json.dumps({"code": code, "http": sorted(m for m in sys.modules if m.startswith("qlagent.http"))}))
"""


def test_headless_serve_imports_no_http_module(workdir):
    state = os.path.join(workdir, "state")
    ok(state, "init")
    env_ = {k: v for k, v in os.environ.items() if not k.startswith("QLAGENT_")}
    out = subprocess.run([sys.executable, "-c", PROBE, state], capture_output=True, env=env_, timeout=60)
    assert json.loads(out.stdout) == {"code": 0, "http": []}, out.stderr
    # The probe can see the surface: with --listen it is loaded.
    out = subprocess.run([sys.executable, "-c", PROBE, state, f"127.0.0.1:{free_port()}"],
                         capture_output=True, env=env_, timeout=60)
    doc = json.loads(out.stdout)
    assert doc["code"] == 0 and "qlagent.http.service" in doc["http"], out.stderr


def test_http_config_overrides_stay_within_the_profile_bounds(workdir):
    from qlagent.core.errors import ValidationError
    from qlagent.http.service import limits_for
    from qlagent.service.config import resolve

    def settings(body: str, profile: str = "edge"):
        path = os.path.join(workdir, "c.toml")
        with open(path, "w") as f:
            f.write(f'profile = "{profile}"\n[http]\n{body}\n')
        return resolve(path, state_dir=os.path.join(workdir, "s"))

    lim = limits_for(settings("max_in_flight = 2\nmax_body_bytes = 300\nread_timeout_s = 2.5"))
    assert (lim.max_in_flight, lim.max_body_bytes, lim.read_timeout_s) == (2, 300, 2.5)
    assert limits_for(settings("")).max_in_flight == 4 and limits_for(settings("")).max_body_bytes == 512
    assert limits_for(settings("max_in_flight = 32", "standalone")).max_in_flight == 32
    for body, field in (("max_in_flight = 5", "http.max_in_flight"), ("max_body_bytes = 513", "http.max_body_bytes"),
                        ("max_in_flight = 0", "http.max_in_flight"), ("read_timeout_s = 0", "http.read_timeout_s")):
        with pytest.raises(ValidationError) as exc:
            limits_for(settings(body))
        assert exc.value.field == field
        assert ("edge" if field != "http.read_timeout_s" else "seconds") in str(exc.value)


def test_unix_socket_from_config_serves_the_api(workdir):
    state = os.path.join(workdir, "state")
    sock = os.path.join(workdir, "api.sock")
    cfg = os.path.join(workdir, "c.toml")
    with open(cfg, "w") as f:
        f.write(f'[http]\nunix_socket = "{sock}"\n')
    ok(state, "init")
    agent = Serve("--state-dir", state, "--config", cfg)
    try:
        with socket.socket(socket.AF_UNIX) as s:
            s.connect(sock)
            s.sendall(b"GET /readyz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            data = b""
            while chunk := s.recv(4096):
                data += chunk
        assert data.startswith(b"HTTP/1.1 200 ") and b'"status":"ready"' in data
    finally:
        assert agent.stop() == 0
    assert not os.path.exists(sock)     # removed at close
