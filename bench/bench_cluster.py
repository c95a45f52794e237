"""Cluster control plane benchmark (issues 10 and 25): Task Start, Worker Pull and the whole Run
cycle through HTTP, against bare SQL and procrastinate in the same run.

Same run, same PostgreSQL server, same number of connections:
* baseline: N threads, each with its own connection, loop on one transaction
  ``SELECT … FOR UPDATE SKIP LOCKED LIMIT 1`` + ``UPDATE runs SET state = 'dispatching'``;
* HTTP Pull: N pullers (threads of this process, one keep-alive ``cpkit.RawHttp`` connection
  each) against one control-plane replica in a child process (``tests/cluster/cpkit.py``: the
  real HttpServer, the Worker routes and the PostgreSQL adapters), each ``POST …/pull?waitS=0``
  a full claim (Session check, pullId lookup, candidate page, plan, atomic claim, offer,
  secrets). Printed with the CPU per claim of the replica, of its PostgreSQL backends (and the
  baseline's) and of the pullers.
The queue is refilled (fresh tables) before every phase; each puller owns enough enrolled
Workers that a full Session (slots) is replaced by the next one outside the measured window.
Then pull-to-offer latency with the LISTEN/NOTIFY wake-up (a Pull waiting with ``waitS=10``,
a Run committed, time until the offer arrives) against the latency of a Pull that finds the Run
already queued, and the replica's RSS and threads. Each ``--code`` tree (main's and a branch's)
runs its own replicas on its own database migrated by that tree, the trees in turn at each
puller count. First (``--start-clients``, 0 skips it): Task Start on PostgreSQL through
``qlagent serve`` with ``[cluster]`` against bare inserts of the same rows (``task_start``),
with the share of its transactions' time spent waiting on locks (``WaitSampler``), then the
whole Run cycle on the same replica (``run_cycle``: Task Start → Pull → ACK starting → ACK
running → ACK completion, each over HTTP), once per ``--code`` tree; then, with
``--procrastinate-python``, procrastinate's defer and fetch+finish on the same server
(``bench_procrastinate.py``, in its own venv).

Usage: python3 bench/bench_cluster.py [--seconds 3] [--pullers 1,4,16] [--threads 4] [--replicas 1]
       [--start-clients 4] [--start-tasks 4] [--code /path/to/qlagent ...]
       [--procrastinate-python .bench-venv/bin/python]
The bench venv: python3 -m venv .bench-venv && .bench-venv/bin/pip install procrastinate==3.10.0
Needs PostgreSQL at $QLAGENT_TEST_PG (default postgresql://postgres@127.0.0.1:5432/postgres).
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import subprocess
import sys
import threading
import time
import uuid

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests", "cluster"), os.path.join(ROOT, "tests")]

import msgspec  # noqa: E402
import psutil  # noqa: E402

import pgkit  # noqa: E402  (seeding helpers of the cluster tests)
from cpkit import RawHttp  # noqa: E402  (a lean client: the pullers share the box's 2 cores)
from conftest import create_database, db_url, drop_database  # noqa: E402
from qlagent.adapters.postgres.connection import open_pool  # noqa: E402

BASE = "/api/v3/cluster/workers"
SLOTS = 256
_TABLES = ("log_chunks", "run_leases", "worker_sessions", "workers", "truncation_facts", "run_events", "attempts",
           "runs", "execution_revisions", "context_recipes", "task_revisions", "tasks", "secrets", "projects")


def serve(url: str, threads: int) -> None:
    """Child: one control-plane replica on 127.0.0.1; prints its port, serves until stdin closes."""
    from cpkit import ControlPlane
    from qlagent.http.worker_routes import WorkerRouteLimits
    pool = open_pool(url, threads + 4)
    plane = ControlPlane(pgkit.Kit(pool), url, limits=WorkerRouteLimits(threads=threads, max_long_polls=64),
                         in_flight=96)
    print(plane.port, flush=True)
    sys.stdin.read()
    plane.close()
    pool.close()


def reset(kit, runs: int) -> dict:
    """Empty tables, one Task, ``runs`` queued Runs with claimed remote_worker Attempts."""
    with kit.pool.connection() as conn:
        conn.execute("TRUNCATE " + ", ".join(_TABLES) + " CASCADE")
    kit.project_id = None
    task = kit.task("bench")
    with kit.pool.connection() as conn:
        conn.execute(
            "WITH g AS (SELECT gen_random_uuid()::text AS run_id, gen_random_uuid()::text AS attempt_id, i,"
            " ql_now_us() + i AS t FROM generate_series(1, %s) i),"
            " r AS (INSERT INTO runs(run_id, project_id, task_id, task_revision, task_snapshot_ref, state, priority,"
            " execution_origin, execution_owner, trigger_type, idempotency_key, requested_by, version, event_sequence,"
            " latest_attempt_id, latest_attempt_created_at_us, created_at_us, updated_at_us)"
            " SELECT run_id, %s, %s, 1, %s, 'queued', 0, 'manual', 'runtime', 'task_start',"
            " 'ql3:task-start:v1:' || run_id, 'bench', 2, 2, attempt_id, t, t, t FROM g RETURNING 1)"
            " INSERT INTO attempts(attempt_id, run_id, attempt_no, state, executor_type, created_at_us)"
            " SELECT attempt_id, run_id, 1, 'claimed', 'remote_worker', t FROM g",
            (runs, task["project_id"], task["task_id"], pgkit.snapshot_ref(1, task["digest"])))
    return task


def backend_cpu(kit, name: str) -> dict[int, float]:
    """CPU seconds (user + system) so far of every client backend connected to ``name`` (not
    autovacuum: the baseline's figure has none either)."""
    out = {}
    for (pid,) in kit.sql("SELECT pid FROM pg_stat_activity WHERE datname = %s AND backend_type = 'client backend'"
                          " AND pid <> pg_backend_pid()", (name,)):
        try:
            out[pid] = sum(psutil.Process(pid).cpu_times()[:2])
        except psutil.Error:
            pass
    return out


def baseline(url: str, n: int, seconds: float) -> tuple[int, float]:
    """(claims, CPU seconds of their PostgreSQL backends) of a bare SKIP LOCKED + UPDATE loop on
    ``n`` connections in ``seconds``."""
    import psycopg
    counts, cpu = [0] * n, [0.0] * n
    stop = time.monotonic() + seconds

    def loop(i: int) -> None:
        with psycopg.connect(url) as conn:
            backend = psutil.Process(conn.info.backend_pid)
            cpu0 = sum(backend.cpu_times()[:2])
            try:
                claim_loop(conn, i)
            finally:
                cpu[i] = sum(backend.cpu_times()[:2]) - cpu0

    def claim_loop(conn, i: int) -> None:
        while time.monotonic() < stop:
            with conn.transaction():
                # The candidate index's own predicate and order (runs_dispatch_candidates).
                row = conn.execute("SELECT run_id FROM runs WHERE state = 'queued'"
                                   " AND cancel_requested_at_us IS NULL AND NOT held"
                                   " ORDER BY (-priority), created_at_us, latest_attempt_created_at_us,"
                                   " latest_attempt_id LIMIT 1 FOR UPDATE SKIP LOCKED").fetchone()
                if row is None:
                    return
                conn.execute("UPDATE runs SET state = 'dispatching', version = version + 1 WHERE run_id = %s",
                             (row[0],))
            counts[i] += 1
    _threads(loop, n)
    return sum(counts), sum(cpu)


class Puller:
    """One simulated Worker process: its own Workers (rotated when a Session's slots are full)."""

    def __init__(self, kit, port: int, name: str, workers: int) -> None:
        self.ws = [kit.worker(f"{name}-{j}", slots=SLOTS) for j in range(workers)]
        self.i = 0
        self.http = RawHttp(port)

    def pull(self, wait_s: int = 0) -> dict:
        w = self.ws[self.i]
        body = json.dumps({"sessionId": w["session_id"], "generation": w["generation"],
                           "pullId": str(uuid.uuid4()), "leaseToken": secrets.token_urlsafe(32)}).encode()
        status, data = self.http.post(f"{BASE}/{w['worker_id']}/pull?waitS={wait_s}",
                                      f"Authorization: Worker {w['credential']}\r\n", body)
        answer = msgspec.json.decode(data)
        if status != 200:
            raise RuntimeError(f"pull answered {status}: {answer}")
        return answer


def pullers_for(kit, ports: list[int], n: int, expected: int) -> list[Puller]:
    """``n`` pullers spread over the replicas, with Workers enough for ``expected`` claims."""
    per = max(2, expected // (n * SLOTS) + 2)
    return [Puller(kit, ports[i % len(ports)], f"p{n}-{i}", per) for i in range(n)]


def http_claims(pullers: list[Puller], seconds: float) -> tuple[int, dict]:
    n = len(pullers)
    counts, other = [0] * n, {}
    stop = time.monotonic() + seconds

    def loop(i: int) -> None:
        p = pullers[i]
        while time.monotonic() < stop:
            a = p.pull()
            if a["status"] == "offered":
                counts[i] += 1
            elif a.get("reason") == "no_free_slot" and p.i + 1 < len(p.ws):
                p.i += 1
            else:
                other[a["status"] + ":" + str(a.get("reason"))] = other.get(a["status"] + ":" + str(a.get("reason")),
                                                                           0) + 1
                if a["status"] == "idle":
                    return
    _threads(loop, n)
    return sum(counts), other


def wake_latency(kit, port: int, rounds: int) -> tuple[list[float], list[float]]:
    """(pull-to-offer µs with a waiting Pull woken by NOTIFY, µs of a Pull finding a queued Run)."""
    reset(kit, 0)
    task = kit.task("wake")
    p = Puller(kit, port, "wake", 1)
    woken, direct = [], []
    for _ in range(rounds):
        out = {}

        def wait() -> None:
            out["a"] = p.pull(wait_s=10)
            out["t"] = time.perf_counter()
        t = threading.Thread(target=wait)
        t.start()
        time.sleep(0.05)            # the Pull is parked on the signal (an empty queue answers only at 10 s)
        kit.queue(task)             # commits: the trigger's NOTIFY goes out at commit
        t0 = time.perf_counter()
        t.join(15)
        assert out["a"]["status"] == "offered", out
        woken.append((out["t"] - t0) * 1e6)
        kit.queue(task)
        t0 = time.perf_counter()
        assert p.pull()["status"] == "offered"
        direct.append((time.perf_counter() - t0) * 1e6)
    return woken, direct


START_TASK = '[[task]]\nname = "bench-{i}"\nshell = "/bin/sh"\nscript = "true"\n\n'
START_PATH = "/api/v3/projects/default/tasks/bench-{i}/runs"
# One sample of the database's transactions under way (the sampler's own excluded): their state
# and wait event, and the lock types of the ungranted pg_locks entries.
WAIT_SAMPLE = ("SELECT a.state, a.wait_event_type, a.wait_event, (SELECT string_agg(DISTINCT l.locktype, ',') "
               "FROM pg_locks l WHERE l.pid = a.pid AND NOT l.granted) AS waiting_for FROM pg_stat_activity a "
               "WHERE a.datname = current_database() AND a.pid <> pg_backend_pid() "
               "AND a.backend_type = 'client backend' AND a.state IN ('active', 'idle in transaction')")


class WaitSampler:
    """Every ``interval_s`` a sample of ``WAIT_SAMPLE`` on its own connection: of the samples
    of a backend inside a transaction (running a statement, or idle in it while the replica
    works), the share spent waiting on a heavyweight lock (``wait_event_type = 'Lock'``) is the
    share of Task Start time waiting on locks; the wait events are counted by name."""

    def __init__(self, url: str, interval_s: float = 0.005) -> None:
        import psycopg
        self.conn = psycopg.connect(url, autocommit=True)
        self.interval_s, self.busy, self.lock = interval_s, 0, 0
        self.events: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop)

    def _loop(self) -> None:
        while not self._stop.is_set():
            for state, kind, event, waiting_for in self.conn.execute(WAIT_SAMPLE).fetchall():
                self.busy += 1
                if kind is not None:
                    name = f"{kind}:{event}" + (f" ({waiting_for})" if waiting_for else "")
                    self.events[name] = self.events.get(name, 0) + 1
                self.lock += kind == "Lock"
            self._stop.wait(self.interval_s)

    def __enter__(self) -> "WaitSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.conn.close()

    def report(self) -> str:
        top = sorted(self.events.items(), key=lambda kv: -kv[1])[:4]
        return (f"lock-wait share {self.lock / max(self.busy, 1):.1%} of {self.busy} in-transaction samples"
                f" (top waits: {', '.join(f'{k} {v / max(self.busy, 1):.0%}' for k, v in top) or 'none'})")


def task_start(seconds: float, clients: int, tasks: int, code: str) -> float:
    """Task Start on PostgreSQL: ``qlagent serve`` with ``[cluster]`` (a real control-plane
    replica of the qlagent tree ``code`` on a fresh database), ``clients`` threads each POSTing
    Task Start with a new mutationId to Task ``bench-{client % tasks}`` (each a full ADR-0376
    transaction: a queued Run, its Attempt, two RunEvents) against the same rows inserted bare
    (one transaction each, no check) on as many connections. Meanwhile ``WaitSampler`` samples
    what the replica's transactions wait on. Returns the Task Starts answered 202 per second."""
    import http.client
    import shutil
    import socket
    import tempfile
    name = create_database(f"bench_cluster_start_{os.getpid()}")
    url = db_url(name)
    root = tempfile.mkdtemp(prefix="qlagent-bench-start-")
    state, config = os.path.join(root, "state"), os.path.join(root, "qlagent.toml")
    env = {k: v for k, v in os.environ.items() if not k.startswith("QLAGENT_")}
    proc = None
    rate = 0.0

    def cli(*args: str) -> str:
        return subprocess.run([sys.executable, "-m", "qlagent.cli.main", "--state-dir", state, "--config", config,
                               *args], check=True, capture_output=True, env=env, cwd=code).stdout.decode().strip()
    try:
        with open(config, "w") as f:
            f.write(f'[cluster]\ndatabase = "{url}"\npool_size = 6\n')
        with open(os.path.join(root, "tasks.toml"), "w") as f:
            f.write("".join(START_TASK.format(i=i) for i in range(tasks)))
        cli("init")
        cli("task", "add", "-f", os.path.join(root, "tasks.toml"))
        token = cli("token", "create", "--subject", "bench", "--role", "operator")
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        proc = subprocess.Popen([sys.executable, "-m", "qlagent.cli.main", "--state-dir", state, "--config", config,
                                 "serve", "--listen", f"127.0.0.1:{port}"], stdin=subprocess.DEVNULL,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, cwd=code)
        head = None
        for _ in range(300):
            try:
                c = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
                c.request("GET", "/api/v3/projects/default/tasks/bench-0", headers={"Authorization": f"Bearer {token}"})
                r = c.getresponse()
                head = json.loads(r.read()) if r.status == 200 else None
                c.close()
            except OSError:
                pass
            if head:
                break
            time.sleep(0.1)
        pool = open_pool(url, clients + 1)
        kit = pgkit.Kit(pool)
        (project_id, task_id, digest), = kit.sql(
            "SELECT t.project_id, t.task_id, tr.content_digest FROM tasks t JOIN task_revisions tr"
            " ON tr.task_id = t.task_id AND tr.revision = t.head_revision WHERE t.name = 'bench-0'")
        digests = dict(kit.sql("SELECT t.name, tr.content_digest FROM tasks t JOIN task_revisions tr"
                               " ON tr.task_id = t.task_id AND tr.revision = t.head_revision"))
        counts, cpu = [0] * clients, [0.0] * clients
        stop = time.monotonic() + seconds

        def bare(i: int) -> None:
            import psycopg
            with psycopg.connect(url) as conn:
                backend = psutil.Process(conn.info.backend_pid)
                cpu0 = sum(backend.cpu_times()[:2])
                while time.monotonic() < stop:
                    run_id, attempt_id = str(uuid.uuid4()), str(uuid.uuid4())
                    with conn.transaction():
                        conn.execute(
                            "INSERT INTO runs(run_id, project_id, task_id, task_revision, task_snapshot_ref, state,"
                            " priority, execution_origin, execution_owner, trigger_type, idempotency_key, requested_by,"
                            " version, event_sequence, latest_attempt_id, latest_attempt_created_at_us, created_at_us,"
                            " updated_at_us) VALUES (%s, %s, %s, %s, %s, 'queued', 0, 'manual', 'runtime',"
                            " 'task_start', %s, 'bench', 2, 2, %s, ql_now_us(), ql_now_us(), ql_now_us())",
                            (run_id, project_id, task_id, head["revision"], f"qltd:v1:{head['revision']}:{digest}",
                             f"ql3:task-start:v1:{run_id}", attempt_id))
                        conn.execute("INSERT INTO attempts(attempt_id, run_id, attempt_no, state, executor_type,"
                                     " created_at_us) VALUES (%s, %s, 1, 'claimed', 'remote_worker', ql_now_us())",
                                     (attempt_id, run_id))
                        conn.execute("INSERT INTO run_events VALUES (%s, 1, %s, 'run.created', 'bench', '{}',"
                                     " ql_now_us()), (%s, 2, %s, 'run.queued', 'bench', '{}', ql_now_us())",
                                     (run_id, str(uuid.uuid4()), run_id, str(uuid.uuid4())))
                    counts[i] += 1
                cpu[i] = sum(backend.cpu_times()[:2]) - cpu0
        _threads(bare, clients)
        base, base_pg = sum(counts) / seconds, sum(cpu) * 1e6 / max(sum(counts), 1)
        # Task Start looks at the Task's live Runs: start from the same empty queue as the baseline.
        kit.sql("TRUNCATE run_events, attempts, runs CASCADE")

        replica = psutil.Process(proc.pid)
        answers: dict[int, int] = {}
        https = [RawHttp(port) for _ in range(clients)]
        cpu0, pg0 = sum(replica.cpu_times()[:2]), backend_cpu(kit, name)
        stop = time.monotonic() + seconds

        def start(i: int) -> None:
            while time.monotonic() < stop:
                body = json.dumps({"schema": "qinglong/task-start@v1", "mutationId": str(uuid.uuid4()),
                                   "expectedRevision": head["revision"],
                                   "expectedContentDigest": digests[f"bench-{i % tasks}"]}).encode()
                status, _ = https[i].post(START_PATH.format(i=i % tasks), f"Authorization: Bearer {token}\r\n",
                                          body)
                answers[status] = answers.get(status, 0) + 1
        probes: list[float] = []

        def probe() -> None:
            # What every other connection sees meanwhile: the loop's answer time to /healthz.
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
            while time.monotonic() < stop:
                t0 = time.perf_counter()
                c.request("GET", "/healthz")
                c.getresponse().read()
                probes.append((time.perf_counter() - t0) * 1e6)
                time.sleep(0.01)
            c.close()
        prober = threading.Thread(target=probe)
        prober.start()
        with WaitSampler(url) as waits:
            _threads(start, clients)
        prober.join()
        done = answers.get(202, 0)
        cpu = sum(replica.cpu_times()[:2]) - cpu0
        pg = sum(v - pg0.get(pid, 0.0) for pid, v in backend_cpu(kit, name).items())
        rate = done / seconds
        print(f"Task Start on PostgreSQL ({code}), {clients} clients, {tasks} Task(s): {rate:,.0f} req/s (202) vs bare inserts of the same rows "
              f"{base:,.0f}/s ({rate / base:.2f}); replica CPU {cpu * 1e6 / max(done, 1):,.0f} µs/start, PostgreSQL "
              f"CPU {pg * 1e6 / max(done, 1):,.0f} / {base_pg:,.0f} µs; answers {answers}; "
              f"replica RSS {replica.memory_info().rss / 2**20:.1f} MiB; /healthz meanwhile p50 "
              f"{pct(probes, .5):,.0f} µs, p99 {pct(probes, .99):,.0f} µs ({len(probes)} probes); {waits.report()}")
        for h in https:
            h.close()
        kit.sql("TRUNCATE run_leases, run_events, attempts, runs CASCADE")
        cycles = run_cycle(kit, name, replica, port, token, head["revision"], digests, seconds, clients, tasks)
        print(f"Run cycle ({code}), {clients} clients: {cycles['rate']:,.0f} Runs/s (Task Start → Pull → ACK "
              f"starting → ACK running → ACK completion, each over HTTP); replica CPU {cycles['replica_us']:,.0f} "
              f"µs/Run, PostgreSQL CPU {cycles['pg_us']:,.0f} µs/Run, bench clients {cycles['client_us']:,.0f} "
              f"µs/Run; other answers {cycles['other'] or '-'}")
        pool.close()
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(30)
        shutil.rmtree(root, ignore_errors=True)
        drop_database(name)
    return rate


def run_cycle(kit, name: str, replica, port: int, token: str, revision: int, digests: dict, seconds: float,
              clients: int, tasks: int) -> dict:
    """The whole Run cycle on the replica, ``clients`` threads each looping: Task Start of Task
    ``bench-{i % tasks}`` (202), a Pull (waitS=0) of its own enrolled Worker (offered: any queued
    Run), then the ACKs starting, running and completion (exitCode 0) of that offer, every one an
    HTTP request of the Worker protocol. Returns the Runs completed per second, the CPU per Run
    of the replica, of its PostgreSQL backends and of these clients, and any other answers."""
    workers = [kit.worker(f"cycle-{i}", slots=4) for i in range(clients)]
    https = [(RawHttp(port), RawHttp(port)) for _ in range(clients)]
    done, other = [0] * clients, {}
    stop = time.monotonic() + seconds

    def loop(i: int) -> None:
        api, wire = https[i]
        w = workers[i]
        auth = f"Authorization: Worker {w['credential']}\r\n"
        base = f"{BASE}/{w['worker_id']}"
        while time.monotonic() < stop:
            body = json.dumps({"schema": "qinglong/task-start@v1", "mutationId": str(uuid.uuid4()),
                               "expectedRevision": revision,
                               "expectedContentDigest": digests[f"bench-{i % tasks}"]}).encode()
            status, _ = api.post(START_PATH.format(i=i % tasks), f"Authorization: Bearer {token}\r\n", body)
            if status != 202:
                other[f"start:{status}"] = other.get(f"start:{status}", 0) + 1
                continue
            lease = secrets.token_urlsafe(32)
            status, data = wire.post(f"{base}/pull?waitS=0", auth, json.dumps(
                {"sessionId": w["session_id"], "generation": w["generation"], "pullId": str(uuid.uuid4()),
                 "leaseToken": lease}).encode())
            answer = msgspec.json.decode(data)
            if status != 200 or answer["status"] != "offered":
                key = f"pull:{status}:{answer.get('status')}:{answer.get('reason')}"
                other[key] = other.get(key, 0) + 1
                continue
            offer = answer["offer"]
            fence = {"sessionId": w["session_id"], "generation": w["generation"], "attemptId": offer["attemptId"],
                     "leaseGeneration": offer["leaseGeneration"], "leaseToken": lease}
            for kind, facts in (("starting", {}), ("running", {}), ("completion", {"exitCode": 0})):
                status, data = wire.post(f"{base}/acks", auth, json.dumps({**fence, "kind": kind, **facts}).encode())
                if status != 200:
                    other[f"ack {kind}:{status}"] = other.get(f"ack {kind}:{status}", 0) + 1
                    break
            else:
                done[i] += 1
    cpu0, pg0, me0 = sum(replica.cpu_times()[:2]), backend_cpu(kit, name), time.process_time()
    _threads(loop, clients)
    n = max(sum(done), 1)
    out = {"rate": sum(done) / seconds, "replica_us": (sum(replica.cpu_times()[:2]) - cpu0) * 1e6 / n,
           "pg_us": sum(v - pg0.get(pid, 0.0) for pid, v in backend_cpu(kit, name).items()) * 1e6 / n,
           "client_us": (time.process_time() - me0) * 1e6 / n, "other": other}
    for pair in https:
        for h in pair:
            h.close()
    return out


def procrastinate(python: str, seconds: float, clients: int, workers: int, start_rates: dict[str, float]) -> None:
    """``bench_procrastinate.py`` in ``python`` (a venv with procrastinate) on a fresh database
    of the same server: its defer rate next to the Task Start rates (the last run of each
    ``--code`` tree), its fetch+finish rate."""
    name = create_database(f"bench_procrastinate_{os.getpid()}")
    try:
        out = subprocess.run([python, os.path.join(ROOT, "bench", "bench_procrastinate.py"), db_url(name),
                              "--seconds", str(seconds), "--clients", str(clients), "--workers", str(workers)],
                             check=True, capture_output=True, text=True).stdout
        r = json.loads(out.strip().splitlines()[-1])
        print(f"procrastinate {r['version']}, same server: defer {r['defer_per_s']:,.0f} jobs/s ({clients} threads; "
              + ", ".join(f"Task Start of {code} {rate / r['defer_per_s']:.2f}x" for code, rate in start_rates.items())
              + f"); fetch+finish {r['done_per_s']:,.0f} jobs/s ({workers} worker processes, {r['done']} jobs)")
    finally:
        drop_database(name)


def _threads(fn, n: int) -> None:
    ts = [threading.Thread(target=fn, args=(i,)) for i in range(n)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--pullers", default="1,4,16")
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--wake-rounds", type=int, default=60)
    ap.add_argument("--replicas", type=int, default=1, help="control-plane replicas; pullers spread over them")
    ap.add_argument("--serve")
    ap.add_argument("--start-clients", type=int, default=4, help="Task Start clients (0: skip that phase)")
    ap.add_argument("--start-tasks", type=int, default=4, help="Tasks the Task Start clients start, round robin")
    ap.add_argument("--code", action="append", help="qlagent tree whose replicas serve every phase (repeatable: "
                    "each in turn, e.g. main's and a branch's; default this one)")
    ap.add_argument("--procrastinate-python", help="python of a venv with procrastinate: its defer and "
                    "fetch+finish on the same server (needs --start-clients)")
    ap.add_argument("--procrastinate-workers", type=int, default=4)
    args = ap.parse_args()
    if args.serve:
        serve(args.serve, args.threads)
        return
    if args.start_clients:
        rates = {code: task_start(args.seconds, args.start_clients, args.start_tasks, code)
                 for code in (args.code or [ROOT])}
        if args.procrastinate_python:
            procrastinate(args.procrastinate_python, args.seconds, args.start_clients, args.procrastinate_workers,
                          rates)
    trees = args.code or [ROOT]
    planes: list[Plane] = []
    try:
        for i, code in enumerate(trees):
            planes.append(Plane(code, i, args.replicas, args.threads))
            print(f"{code}: {args.replicas} replica(s), {args.threads} route threads each; idle RSS "
                  f"{planes[-1].rss_idle / 2**20:.1f} MiB")
        print(f"{'tree':>16} | {'pullers':>7} | {'baseline claims/s':>17} | {'HTTP Pull claims/s':>18} | {'ratio':>5} | "
              f"{'replica CPU µs/claim':>11} | PostgreSQL CPU µs/claim, Pull / baseline | "
              f"bench client CPU µs/claim | other answers")
        for n in (int(x) for x in args.pullers.split(",") if x):
            for plane in planes:        # every tree in turn at each concurrency: the same minutes
                plane.claims(n, args.seconds)
        for plane in planes:
            plane.finish(args.wake_rounds)
    finally:
        for plane in planes:
            plane.close()


# A tree's own migrations, run with that tree on the path (``cwd``).
MIGRATE = ("import sys\nfrom qlagent.adapters.postgres.connection import autocommit\n"
           "from qlagent.adapters.postgres.migrations import migrate\n"
           "with autocommit(sys.argv[1]) as conn:\n    migrate(conn)\n")


class Plane:
    """The replicas of one qlagent tree (``code``: its own ``bench_cluster.py --serve``) on a
    fresh database migrated by that tree, with this bench's kit seeding it."""

    def __init__(self, code: str, i: int, replicas: int, threads: int) -> None:
        self.code, self.children = code, []
        self.name = create_database(f"bench_cluster_{os.getpid()}_{i}")
        self.url = db_url(self.name)
        subprocess.run([sys.executable, "-c", MIGRATE, self.url], check=True, cwd=code)
        self.pool = open_pool(self.url, 8)
        self.kit = pgkit.Kit(self.pool)
        for _ in range(replicas):
            self.children.append(subprocess.Popen([sys.executable, os.path.join(code, "bench", "bench_cluster.py"),
                                                   "--serve", self.url, "--threads", str(threads)],
                                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=code))
        self.ports = [int(child.stdout.readline()) for child in self.children]
        self.procs = [psutil.Process(child.pid) for child in self.children]
        self.rss_idle = self.rss_peak = self.procs[0].memory_info().rss

    def claims(self, n: int, seconds: float) -> None:
        """The bare SKIP LOCKED loop, then the HTTP Pulls, on ``n`` connections / pullers."""
        kit = self.kit
        reset(kit, 20_000)
        base_claims, base_pg = baseline(self.url, n, seconds)
        base = base_claims / seconds
        reset(kit, max(2_000, base_claims))
        pullers = pullers_for(kit, self.ports, n, base_claims)
        cpu0, pg0, me0 = self._cpu(), backend_cpu(kit, self.name), time.process_time()
        claims, other = http_claims(pullers, seconds)
        cpu, me = self._cpu() - cpu0, time.process_time() - me0
        pg = sum(v - pg0.get(pid, 0.0) for pid, v in backend_cpu(kit, self.name).items())
        rate = claims / seconds
        self.rss_peak = max(self.rss_peak, self.procs[0].memory_info().rss)
        per = 1e6 / max(claims, 1)
        print(f"{self.code[-16:]:>16} | {n:>7} | {base:>17,.0f} | {rate:>18,.0f} | {rate / base:>5.2f} | "
              f"{cpu * per:>11,.0f} | {pg * per:>5,.0f} / {base_pg * 1e6 / max(base_claims, 1):<5,.0f} | "
              f"{me * per:>6,.0f} | {other or '-'}")
        sys.stdout.flush()

    def _cpu(self) -> float:
        return sum(sum(p.cpu_times()[:2]) for p in self.procs)

    def finish(self, wake_rounds: int) -> None:
        """Double claims of the last phase, the NOTIFY wake-up latency, RSS and threads."""
        kit, proc = self.kit, self.procs[0]
        double = kit.one("SELECT count(*) FROM (SELECT attempt_id FROM run_leases GROUP BY attempt_id"
                         " HAVING count(*) > 1) d")
        if wake_rounds > 0:      # 0: only the claim phases (or only Task Start)
            woken, direct = wake_latency(kit, self.ports[0], wake_rounds)
            print(f"{self.code}: pull-to-offer, waiting Pull woken by NOTIFY: p50 {pct(woken, .5):,.0f} µs, "
                  f"p99 {pct(woken, .99):,.0f} µs ({len(woken)} rounds); a Pull finding a queued Run: p50 "
                  f"{pct(direct, .5):,.0f} µs, p99 {pct(direct, .99):,.0f} µs; median woken/direct "
                  f"{statistics.median(woken) / statistics.median(direct):.2f}x")
        self.rss_peak = max(self.rss_peak, proc.memory_info().rss)
        print(f"{self.code}: replica RSS idle {self.rss_idle / 2**20:.1f} MiB, peak {self.rss_peak / 2**20:.1f} MiB, "
              f"threads {proc.num_threads()}; double claims in the last phase: {double}")

    def close(self) -> None:
        for child in self.children:
            child.stdin.close()
            child.wait(20)
        self.pool.close()
        drop_database(self.name)


if __name__ == "__main__":
    main()
