"""Issue 10 "Races": four control-plane replicas (``qlagent serve`` with ``[cluster]``, separate
processes) on one PostgreSQL authority.

* 64 simulated Worker Sessions pull 10,000 queued Runs concurrently over real HTTP, spread over
  the replicas; one replica is SIGKILLed while claims are in flight and its Workers retry on
  another replica with the SAME pullId and lease token. Checked from the database afterwards:
  every Run leased exactly once (0 double claims), none left queued or leased without its Worker
  holding the offer (0 lost), and the Workers' offers are exactly the Leases.
* 16 concurrent Task Starts with one mutationId across the four replicas: one 202, fifteen 200,
  one Run.
"""

from __future__ import annotations

import json
import secrets
import shutil
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import msgspec
import pytest

from cpkit import BASE as WORKERS, RawHttp
from qlagent.adapters.postgres.registry import PgWorkerRegistry
from qlagent.cluster.registry import WorkerRegistry
from test_cluster_serve import BASE, Env, Replica, body
from kit import scratch_dir, wait_until

RUNS = 10_000
SESSIONS = 64
REPLICAS = 4
KILL_AFTER = RUNS // 4          # claims seen by the Workers before one replica is SIGKILLed
TASKS = """
[[task]]
name = "bulk"
shell = "/bin/sh"
script = "echo bulk"

[[task]]
name = "racer"
shell = "/bin/sh"
script = "echo racer"
"""


@pytest.fixture(scope="module")
def cluster(pg_url, pool):
    root = scratch_dir("qlagent-race-")
    # Leases and Sessions outlive the test: a Lease expiring mid-run would re-queue its Run.
    env = Env(root, pg_url, "pool_size = 6\nsession_ttl_s = 3600\nlease_ttl_s = 3600\n")
    env.define(TASKS)
    token = env.ok("token", "create", "--subject", "rita", "--role", "operator").strip()
    with ThreadPoolExecutor(REPLICAS) as ex:            # each start waits for its readiness line
        replicas = list(ex.map(lambda _: Replica(env), range(REPLICAS)))
    yield env, replicas, token
    for r in replicas:
        r.stop()
    shutil.rmtree(root, ignore_errors=True)


def _queue_bulk(env: Env, runs: int) -> str:
    """``runs`` queued Runs of Task ``bulk`` with claimed remote_worker Attempts, by one INSERT
    (Task Start would take minutes for 10,000; the claims are what this test races)."""
    (task_id, project_id, revision, digest), = env.sql(
        "SELECT t.task_id, t.project_id, t.head_revision, tr.content_digest FROM tasks t"
        " JOIN task_revisions tr ON tr.task_id = t.task_id AND tr.revision = t.head_revision WHERE t.name = 'bulk'")
    env.sql("WITH g AS (SELECT gen_random_uuid()::text AS run_id, gen_random_uuid()::text AS attempt_id,"
            " ql_now_us() + i AS t FROM generate_series(1, %s) i),"
            " r AS (INSERT INTO runs(run_id, project_id, task_id, task_revision, task_snapshot_ref, state, priority,"
            " execution_origin, execution_owner, trigger_type, idempotency_key, requested_by, version, event_sequence,"
            " latest_attempt_id, latest_attempt_created_at_us, created_at_us, updated_at_us)"
            " SELECT run_id, %s, %s, %s, %s, 'queued', 0, 'manual', 'runtime', 'task_start',"
            " 'ql3:task-start:v1:' || run_id, 'race', 2, 2, attempt_id, t, t, t FROM g RETURNING 1)"
            " INSERT INTO attempts(attempt_id, run_id, attempt_no, state, executor_type, created_at_us)"
            " SELECT attempt_id, run_id, 1, 'claimed', 'remote_worker', t FROM g",
            (runs, project_id, task_id, revision, f"qltd:v1:{revision}:{digest}"))
    return task_id


class Workers:
    """``SESSIONS`` simulated Workers, Worker ``i`` starting on replica ``i % REPLICAS``. A Pull
    that gets no answer (the replica died) is sent again, same pullId and token, to the next
    replica; an answer moves the Worker to a new pullId."""

    def __init__(self, sessions: list[dict], ports: list[int]) -> None:
        self.sessions, self.ports = sessions, ports
        self.offers: list[dict] = []
        self.retried = 0
        self.unexpected: list[str] = []
        self.lock = threading.Lock()
        self.done = threading.Event()

    def claimed(self) -> int:
        return len(self.offers)

    def run(self, i: int) -> None:
        w, at = self.sessions[i], i % REPLICAS
        headers = f"Authorization: Worker {w['credential']}\r\n"
        path = f"{WORKERS}/{w['worker_id']}/pull?waitS=0"
        request = None
        http = None
        while not self.done.is_set():
            if request is None:
                request = {"sessionId": w["session_id"], "generation": w["generation"], "pullId": str(uuid.uuid4()),
                           "leaseToken": secrets.token_urlsafe(32)}
                data = json.dumps(request).encode()
            try:
                http = http or RawHttp(self.ports[at], timeout=30)
                status, raw = http.post(path, headers, data)
            except OSError:             # no answer: the same request to the next replica
                if http is not None:
                    http.close()
                http, at = None, (at + 1) % REPLICAS
                with self.lock:
                    self.retried += 1
                continue
            answer = msgspec.json.decode(raw)
            if status == 503:           # busy or the authority briefly unavailable: same request again
                time.sleep(0.05)
                continue
            if status != 200:
                self._unexpected(f"{status} {answer}")
                return
            if answer["status"] == "offered":
                o = answer["offer"]
                with self.lock:
                    self.offers.append({"attempt": o["attemptId"], "run": o["runId"], "offer": o["offerId"],
                                        "session": o["sessionId"], "pull": request["pullId"],
                                        "token": o["leaseToken"] == request["leaseToken"]})
                    if len(self.offers) >= RUNS:
                        self.done.set()
                request = None
            elif answer["status"] == "idle" and answer.get("reason") == "no_free_slot":
                return
            elif answer["status"] == "idle":
                time.sleep(0.02)        # the last Runs are held by other Pulls for a moment
            else:
                self._unexpected(f"{answer['status']}:{answer.get('reason')}")
                return
        if http is not None:
            http.close()

    def _unexpected(self, what: str) -> None:
        with self.lock:
            self.unexpected.append(what)


def test_64_sessions_claim_10000_runs_exactly_once_across_4_replicas_one_sigkilled(cluster, pool):
    env, replicas, _ = cluster
    task_id = _queue_bulk(env, RUNS)
    registry = WorkerRegistry(PgWorkerRegistry(pool))
    sessions = []
    for i in range(SESSIONS):                 # enrolled by the operator; each Session opened over HTTP
        worker_id, credential = registry.enroll(f"race-{i:02d}", {}, ("local_process",), 256)
        status, raw = RawHttp(replicas[i % REPLICAS].port).post(f"{WORKERS}/{worker_id}/sessions",
                                                               f"Authorization: Worker {credential}\r\n", b"{}")
        assert status == 201, raw
        grant = msgspec.json.decode(raw)
        sessions.append({"worker_id": worker_id, "credential": credential, "session_id": grant["sessionId"],
                         "generation": grant["generation"]})
    workers = Workers(sessions, [r.port for r in replicas])
    threads = [threading.Thread(target=workers.run, args=(i,), daemon=True) for i in range(SESSIONS)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 240
    wait_until(lambda: workers.claimed() >= KILL_AFTER or workers.unexpected, 240, f"{KILL_AFTER} claims",
               step=0.005)
    victim = replicas[0]
    victim.proc.kill()                        # SIGKILL with Pulls in flight on it
    assert victim.proc.wait(10) == -9
    for t in threads:
        t.join(max(1, deadline - time.monotonic()))
    workers.done.set()
    assert workers.unexpected == []
    assert workers.retried >= 1               # Workers of the killed replica got no answer and went elsewhere

    # The Workers' view: 10,000 offers, each Run once, each with the token its Pull sent.
    offers = workers.offers
    assert len(offers) == RUNS
    assert len({o["attempt"] for o in offers}) == len({o["run"] for o in offers}) == len({o["offer"] for o in offers}) \
        == RUNS
    assert all(o["token"] for o in offers)
    # The database's view, afterwards: every Run leased exactly once, to the Session and pullId
    # whose Worker holds the offer; nothing left queued.
    leases = env.sql("SELECT l.attempt_id, l.session_id, l.pull_id, l.state, r.state FROM run_leases l"
                     " JOIN runs r ON r.run_id = l.run_id WHERE r.task_id = %s", (task_id,))
    assert len(leases) == RUNS
    assert {(a, s, p) for a, s, p, _, _ in leases} == {(o["attempt"], o["session"], o["pull"]) for o in offers}
    assert {(ls, rs) for _, _, _, ls, rs in leases} == {("active", "dispatching")}
    assert env.sql("SELECT count(*) FROM runs WHERE task_id = %s AND state <> 'dispatching'", (task_id,)) == [(0,)]

    replicas[0] = Replica(env)                # the killed replica's place is taken again
    assert replicas[0].request("GET", "/readyz")[0] == 200


def test_sixteen_concurrent_task_starts_with_one_mutation_id_across_four_replicas(cluster):
    env, replicas, token = cluster
    for i, r in enumerate(replicas):           # run alone (-k), or after a failure before the restart
        if r.proc.poll() is not None:
            replicas[i] = Replica(env)
    status, head = replicas[0].request("GET", f"{BASE}/tasks/racer", token=token)
    assert status == 200, head
    req = body(head)
    with ThreadPoolExecutor(16) as ex:
        answers = list(ex.map(lambda i: replicas[i % REPLICAS].request("POST", f"{BASE}/tasks/racer/runs", req,
                                                                         token), range(16)))
    assert sorted(s for s, _ in answers) == [200] * 15 + [202]
    assert len({doc["runId"] for _, doc in answers}) == 1
    assert env.sql("SELECT count(*) FROM runs r JOIN tasks t USING (task_id) WHERE t.name = 'racer'") == [(1,)]
