"""Issue 11 acceptance: a real fleet on this machine survives crashes, partitions and a PostgreSQL
failover without losing or doubling a Run.

The parts are real (tests/fleet/harness.py): a PostgreSQL primary with a synchronous standby
(initdb, pg_basebackup, free ports); two control-plane replicas = `qlagent serve` with
`[cluster] database = <multi-host URL, target_session_attrs=read-write>` listening with TLS on
0.0.0.0 (a throwaway CA made here with openssl, its certificate naming the host end of every
veth); three Workers = `qlagent serve` with `[worker]` (credential from `qlagent workers
enroll`, the CA pinned, both replicas in `control_url` through the host end of its veth), each
in its own network namespace and its own 128 MiB / 64 PID cgroup, each with a NOTIFY_SOCKET
this test reads (READY=1, WATCHDOG=1 at the shipped unit's WatchdogSec).

Workload: 300 Runs from a seconds schedule and Task Starts (HTTP with mutationIds on both
replicas, a few through the CLI), with `chatty` (log quota) and `hang` (timeout) from the router
task set. Chaos in the same run: a Worker SIGKILLed mid-run and started again, a replica
SIGKILLed and started again, one Worker's link cut for longer than the Lease TTL, another's
for less, the old primary stopped and the standby promoted under load. Every task script marks its start
(and its end, or the SIGTERM that stopped it) in a file named after its Attempt, so the
executions are counted from what really ran, not from what the control plane believes.

Every outcome is read from the database (the promoted standby) at the end.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import threading
import time
import uuid

import pytest

from harness import Cgroup, PgPair, WorkerNet, cgroup_v1_available, pg_bindir, spawn_in
from kit import clean_env, free_port, qlagent_argv, run_cli, wait_until

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0 or not cgroup_v1_available(),
                       reason="needs root and writable cgroup v1 memory+pids (network namespaces, cgroups)"),
]

ROOT_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FIXTURES = os.path.join(ROOT_DIR, "examples", "router-tasks")     # the router task set (shared fixtures)
TAG = f"fleet{os.getpid()}"
RUNS = 300                       # the workload: Runs of the fleet's Tasks, schedule + Task Start
WORKERS = 3
SLOTS = 4                        # the edge Profile's live runs
LEASE_TTL_S = 8                  # short, so a cut longer than it fits in the test
SESSION_TTL_S = 6
HEARTBEAT_S = 1
GRACE_S = 1                      # SIGTERM → SIGKILL of a task; the Worker's kill grace is this + 1 s
QUOTA = 4 * 1_048_576            # the edge Profile's log_max_bytes
SCHEMA = "qinglong/task-start@v1"
API = "/api/v3/projects/default"
WORKER_API = "/api/v3/cluster/workers"
FINAL_STATES = ("succeeded", "failed", "timed_out", "cancelled", "lost")


def _watchdog_sec() -> int:
    """The shipped unit's WatchdogSec: the Workers get exactly what systemd would give them."""
    with open(os.path.join(ROOT_DIR, "systemd", "qlagent.service")) as f:
        return int(re.search(r"^WatchdogSec=(\d+)$", f.read(), re.M).group(1))


def _fixture(name: str) -> str:
    with open(os.path.join(FIXTURES, name)) as f:
        return f.read()


# ---------------------------------------------------------------- the Task set

# Marks carry the time since boot in ns, read by shell builtins: a `date` child would be
# signalled with the rest of the tree and leave a mark without its time.
NOW = 'read -r up _ < /proc/uptime; now="${up%.*}${up#*.}0000000"; '
MARK = 'm="$MARKS/$QL3_ATTEMPT_ID"; ' + NOW + 'echo "start $now" >> "$m"\n'
END = NOW + 'echo "end $now" >> "$m"\n'
TERM = NOW + 'echo "term $now" >> "$m"; exit 143'
TRAP = f"trap '{TERM}' TERM\n"


def sleep(seconds: int) -> str:
    """A sleep that marks ``term`` and ends the script when a signal cut it short: the Worker
    signals the tree process by process, so the shell may see its child die before its own
    SIGTERM arrives (the trap covers the other order)."""
    return f"sleep {seconds} || {{ {TERM}; }}\n"


def tasks_toml(marks: str) -> str:
    """The fleet's Tasks (all `placement.required fleet=yes`, parallel, 3 attempts, no backoff,
    `on_lease_loss = "kill"`) and `probe` for the bad-input tests (only the probe Worker matches it)."""
    def task(name: str, script: str, *, timeout_s: int = 60, schedule: str = "@once", enabled: bool = True,
             placement: str = 'fleet = "yes"') -> str:
        return (f'[[task]]\nname = "{name}"\nschedule = "{schedule}"\nenabled = {str(enabled).lower()}\n'
                f'concurrency = "parallel"\ntimeout_s = {timeout_s}\ngrace_s = {GRACE_S}\non_lease_loss = "kill"\n'
                f'retry = {{ max_attempts = 3, backoff_s = 0 }}\nenv = {{ MARKS = "{marks}" }}\n'
                f'placement = {{ required = {{ {placement} }} }}\nshell = "/bin/sh"\n'
                f"script = '''\n{script}'''\n\n")
    return "".join([
        task("tick", MARK + "echo tick\n" + END, schedule="*/2 * * * * *", enabled=False),
        task("quick", MARK + 'echo "quick $QL3_ATTEMPT_ID"\n' + END),
        task("sleeper", MARK + TRAP + "echo sleeper-start\n" + sleep(2) + "echo sleeper-end\n" + END),
        task("long", MARK + TRAP + "echo long-start\n" + sleep(10) + "echo long-end\n" + END),
        task("chatty", MARK + _fixture("chatty.sh").split("\n", 1)[1], timeout_s=120),
        task("hang", MARK + _fixture("hang.sh").split("\n", 1)[1], timeout_s=2),
        task("probe", "true\n", placement='probe = "yes"'),
    ])


def expected_log(task: str, attempt_id: str) -> bytes | None:
    """The whole log of a succeeded Attempt (None: checked by size, see ``chatty``)."""
    return {"tick": b"tick\n", "quick": f"quick {attempt_id}\n".encode(),
            "sleeper": b"sleeper-start\nsleeper-end\n", "long": b"long-start\nlong-end\n"}.get(task)


# ---------------------------------------------------------------- TLS material (openssl CLI)

def make_ca(directory: str, name: str, ips: list[str]) -> tuple[str, str, str]:
    """A throwaway CA and a server certificate for localhost, 127.0.0.1 and ``ips`` (the
    host ends of the Workers' veths) signed by it: (ca.pem, cert.pem, key.pem), keys 0600."""
    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60)
    p = {k: os.path.join(directory, f"{name}-{k}") for k in ("ca.key", "ca.pem", "key.pem", "csr", "cert.pem", "ext")}
    run("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-days", "365",
        "-subj", f"/CN=qlagent fleet test CA {name}", "-keyout", p["ca.key"], "-out", p["ca.pem"])
    run("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-subj", "/CN=localhost",
        "-keyout", p["key.pem"], "-out", p["csr"])
    with open(p["ext"], "w") as f:
        f.write("subjectAltName=" + ",".join(["DNS:localhost", "IP:127.0.0.1"] + [f"IP:{ip}" for ip in ips])
                + "\nbasicConstraints=CA:FALSE\nkeyUsage=digitalSignature\nextendedKeyUsage=serverAuth\n")
    run("x509", "-req", "-in", p["csr"], "-CA", p["ca.pem"], "-CAkey", p["ca.key"], "-CAcreateserial", "-days", "365",
        "-extfile", p["ext"], "-out", p["cert.pem"])
    for k in ("ca.key", "key.pem"):
        os.chmod(p[k], 0o600)
    return p["ca.pem"], p["cert.pem"], p["key.pem"]


# ---------------------------------------------------------------- processes

class NotifySocket:
    """A datagram socket standing in for systemd's NOTIFY_SOCKET of one Worker process: every
    message is kept with the test's monotonic time of arrival."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(path)
        self.sock.settimeout(0.2)
        self.messages: list[tuple[float, str]] = []
        self.ended_at: float | None = None          # the process was killed or stopped here
        self._stop = False
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        while not self._stop:
            try:
                data = self.sock.recv(4096)
            except socket.timeout:
                continue
            except OSError:
                return
            self.messages.append((time.monotonic(), data.decode(errors="replace")))

    def pings(self) -> list[float]:
        """Arrival times of READY=1 and WATCHDOG=1, in order."""
        return [t for t, m in self.messages if "WATCHDOG=1" in m.split("\n") or "READY=1" in m.split("\n")]

    def max_gap_s(self, until: float) -> float:
        """The longest time without a ping, from READY=1 to ``until`` (or the process's end)."""
        times = self.pings() + [self.ended_at or until]
        return max(b - a for a, b in zip(times, times[1:]))

    def close(self) -> None:
        self._stop = True
        self.thread.join(2)
        self.sock.close()


class Replica:
    """`qlagent serve --listen 0.0.0.0:PORT` with the cluster config: one control-plane replica."""

    def __init__(self, fleet: "Fleet", idx: int) -> None:
        self.fleet, self.idx = fleet, idx
        self.port = free_port()
        self.log = os.path.join(fleet.root, f"replica{idx}.log")
        self.proc: subprocess.Popen | None = None

    def start(self) -> "Replica":
        with open(self.log, "a") as err:
            self.proc = subprocess.Popen(qlagent_argv("--config", self.fleet.cp_config, "serve",
                                                      "--listen", f"0.0.0.0:{self.port}"),
                                         stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err,
                                         env=clean_env())
        wait_until(lambda: self.ready() or self.proc.poll() is not None, 60, f"replica {self.idx} to answer /readyz")
        assert self.proc.poll() is None, self.journal()[-3000:]
        return self

    def ready(self) -> bool:
        try:
            return self.request("GET", "/readyz")[0] == 200
        except OSError:
            return False

    def request(self, method: str, path: str, body: bytes | None = None, headers: dict | None = None,
                timeout: float = 10) -> tuple[int, dict | None]:
        conn = http.client.HTTPSConnection("127.0.0.1", self.port, timeout=timeout, context=self.fleet.tls)
        try:
            conn.request(method, path, body=body, headers=headers or {})
            resp = conn.getresponse()
            data = resp.read()
            return resp.status, (json.loads(data) if data else None)
        finally:
            conn.close()

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.kill()

    def journal(self) -> str:
        with open(self.log, errors="replace") as f:
            return f.read()


class Worker:
    """One enrolled Worker: `qlagent serve` with `[worker]` inside its namespace and cgroup."""

    def __init__(self, fleet: "Fleet", idx: int) -> None:
        self.fleet, self.idx = fleet, idx
        self.net = WorkerNet(idx, tag=os.getpid()).create()
        fleet.cleanup.append(self.net.close)
        self.cg = Cgroup(f"{TAG}-w{idx}").create()
        fleet.cleanup.append(self.cg.close)
        self.name = f"fleet-w{idx}"
        out = json.loads(fleet.ok("workers", "enroll", self.name, "--label", "fleet=yes", "--slots", str(SLOTS),
                                  "--json"))
        self.worker_id = out["workerId"]
        base = os.path.join(fleet.root, self.name)
        os.makedirs(base)
        self.state = os.path.join(base, "state")
        self.credential = os.path.join(base, "credential")
        fd = os.open(self.credential, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(out["credential"] + "\n")
        urls = [f"https://{self.net.host_addr}:{r.port}" for r in fleet.replicas]
        self.config = os.path.join(base, "qlagent.toml")
        with open(self.config, "w") as f:
            f.write(f'state_dir = "{self.state}"\n\n[worker]\nworker_id = "{self.worker_id}"\n'
                    f"control_url = {json.dumps(urls)}\ncredential_file = \"{self.credential}\"\n"
                    f'ca_file = "{fleet.ca}"\nlabels = {{ fleet = "yes" }}\nslots = {SLOTS}\n'
                    f"heartbeat_interval_s = {HEARTBEAT_S}\npull_wait_s = 5\n")
        os.chmod(self.config, 0o600)
        self.log = os.path.join(base, "worker.log")
        self.proc: subprocess.Popen | None = None
        self.notifies: list[NotifySocket] = []

    def start(self) -> "Worker":
        n = NotifySocket(os.path.join(self.fleet.root, f"notify-w{self.idx}-{len(self.notifies)}.sock"))
        self.notifies.append(n)
        with open(self.log, "a") as err:
            self.proc = spawn_in(qlagent_argv("--config", self.config, "serve"),
                                 net=self.net, cgroup=self.cg, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                 stderr=err, env=clean_env(NOTIFY_SOCKET=n.path,
                                                           WATCHDOG_USEC=_watchdog_sec() * 1_000_000))
        wait_until(lambda: any("READY=1" in m for _, m in n.messages) or self.proc.poll() is not None, 60,
                   f"{self.name} to send READY=1")
        assert self.proc.poll() is None, self.journal()[-3000:]
        return self

    def kill(self) -> None:
        """SIGKILL the Worker process only: its shims (and their tasks) live on."""
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)
        self.notifies[-1].ended_at = time.monotonic()

    def stop(self) -> int | None:
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        self.proc.send_signal(signal.SIGTERM)
        try:
            rc = self.proc.wait(40)
        except subprocess.TimeoutExpired:
            self.kill()
            return None
        self.notifies[-1].ended_at = time.monotonic()
        return rc

    def journal(self) -> str:
        with open(self.log, errors="replace") as f:
            return f.read()


class Fleet:
    """PostgreSQL pair, cluster config, two replicas (``start``); Workers on demand
    (``start_workers``). ``close`` undoes whatever was made, even after a failed ``start``."""

    def __init__(self) -> None:
        self.cleanup: list = []
        self.workers: list[Worker] = []
        self.root = tempfile.mkdtemp(prefix=f"qlagent-{TAG}-")

    def start(self) -> "Fleet":
        os.chmod(self.root, 0o711)
        self.marks = os.path.join(self.root, "marks")
        os.makedirs(self.marks)
        os.chmod(self.marks, 0o777)
        self.pg = PgPair(TAG)
        self.cleanup.append(self.pg.close)
        self.pg.start()
        self.url = self.pg.url()
        nets_host = [WorkerNet(i, tag=os.getpid()).host_addr for i in range(WORKERS)]
        self.ca, cert, key = make_ca(self.root, "fleet", nets_host)
        self.tls = ssl.create_default_context(cafile=self.ca)
        self.state = os.path.join(self.root, "cp-state")
        self.cp_config = os.path.join(self.root, "cluster.toml")
        with open(self.cp_config, "w") as f:
            f.write(f'state_dir = "{self.state}"\n\n[cluster]\ndatabase = "{self.url}"\npool_size = 6\n'
                    f"session_ttl_s = {SESSION_TTL_S}\nlease_ttl_s = {LEASE_TTL_S}\nsweep_interval_s = 0.5\n"
                    f'tls_cert = "{cert}"\ntls_key = "{key}"\n')
        os.chmod(self.cp_config, 0o600)
        self.ok("init")
        tasks = os.path.join(self.root, "tasks.toml")
        with open(tasks, "w") as f:
            f.write(tasks_toml(self.marks))
        self.ok("task", "add", "-f", tasks)
        self.token = self.ok("token", "create", "--subject", "fleet-loader", "--role", "operator").strip()
        self.replicas = [Replica(self, i) for i in range(2)]
        self.cleanup.append(lambda: [r.stop() for r in self.replicas])
        for r in self.replicas:
            r.start()
        return self

    def start_workers(self) -> list[Worker]:
        if not self.workers:
            self.workers = [Worker(self, i) for i in range(WORKERS)]
            self.cleanup.append(lambda: [w.stop() for w in self.workers])
            for w in self.workers:
                w.start()
        return self.workers

    def cli(self, *args: str, stdin: bytes | None = None) -> subprocess.CompletedProcess:
        return run_cli("--config", self.cp_config, *args, stdin=stdin)

    def ok(self, *args: str) -> str:
        p = self.cli(*args)
        assert p.returncode == 0 and b"Traceback" not in p.stderr, (args, p.stdout, p.stderr)
        return p.stdout.decode()

    def sql(self, query: str, args=()) -> list[tuple]:
        """One statement on the writable server (the multi-host URL follows a promotion)."""
        import psycopg
        with psycopg.connect(self.url, autocommit=True) as c:
            cur = c.execute(query, args)
            return cur.fetchall() if cur.description else []

    def close(self) -> None:
        for fn in reversed(self.cleanup):
            try:
                fn()
            except Exception as e:                 # cleanup goes on; the failure is shown
                print(f"cleanup: {type(e).__name__}: {e}", file=sys.stderr)
        for w in self.workers:
            for n in w.notifies:
                n.close()
        shutil.rmtree(self.root, ignore_errors=True)


@pytest.fixture(scope="module")
def fleet():
    if pg_bindir() is None:
        pytest.skip("PostgreSQL server binaries not installed (tests/run installs them as root)")
    f = Fleet()
    try:
        yield f.start()
    finally:
        f.close()


# ---------------------------------------------------------------- Task Start load

class Loader:
    """Task Starts over HTTPS with one mutationId each, alternating replicas; a start that got
    no 202/200 is sent again, same body, to the other replica, until acknowledged (a client that
    wants its Run). ``acked``: (mutationId, runId, status, task)."""

    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet
        self.heads: dict[str, dict] = {}
        self.acked: list[tuple[str, str, int, str]] = []
        self.ack_times: list[float] = []
        self.retries = 0
        self.lock = threading.Lock()
        self._n = 0

    def head(self, task: str) -> dict:
        if task not in self.heads:
            status, doc = self.fleet.replicas[0].request("GET", f"{API}/tasks/{task}", headers=self._auth())
            assert status == 200, doc
            self.heads[task] = doc
        return self.heads[task]

    def _auth(self) -> dict:
        return {"Authorization": f"Bearer {self.fleet.token}", "Content-Type": "application/json"}

    def start(self, task: str, deadline_s: float = 90) -> str:
        h = self.head(task)
        mid = str(uuid.uuid4())
        body = json.dumps({"schema": SCHEMA, "mutationId": mid, "expectedRevision": h["revision"],
                           "expectedContentDigest": h["contentDigest"]}).encode()
        with self.lock:
            self._n += 1
            i = self._n
        end = time.monotonic() + deadline_s
        while True:
            replica = self.fleet.replicas[i % 2]
            try:
                status, doc = replica.request("POST", f"{API}/tasks/{task}/runs", body, self._auth())
            except OSError:
                status, doc = None, None
            if status in (200, 202):
                with self.lock:
                    self.acked.append((mid, doc["runId"], status, task))
                    self.ack_times.append(time.monotonic())
                return doc["runId"]
            assert status is None or status >= 500, (task, status, doc)     # only "no answer yet" is retried
            assert time.monotonic() < end, f"Task Start {mid} of {task} never acknowledged (last: {status} {doc})"
            with self.lock:
                self.retries += 1
            i += 1
            time.sleep(0.3)


def background(fn, *args) -> tuple[threading.Thread, list]:
    """Run ``fn(*args)`` in a thread; the list receives its exception, if any."""
    errors: list = []

    def body() -> None:
        try:
            fn(*args)
        except BaseException as e:          # re-raised by the test thread
            errors.append(e)
    t = threading.Thread(target=body, daemon=True)
    t.start()
    return t, errors


# ---------------------------------------------------------------- bad input (probe Worker, no fleet load)

def _probe(fleet: Fleet) -> dict:
    """An enrolled Worker the test drives by hand over HTTPS (no process): labels probe=yes."""
    if not hasattr(fleet, "probe"):
        out = json.loads(fleet.ok("workers", "enroll", "fleet-probe", "--label", "probe=yes", "--json"))
        fleet.probe = {"worker_id": out["workerId"], "credential": out["credential"]}
    return fleet.probe


def _worker_call(fleet: Fleet, worker_id: str, credential: str, route: str, body: dict) -> tuple[int, dict]:
    return fleet.replicas[0].request("POST", f"{WORKER_API}/{worker_id}/{route}", json.dumps(body).encode(),
                                     {"Authorization": f"Worker {credential}", "Content-Type": "application/json"})


def _session(fleet: Fleet, w: dict) -> tuple[str, int]:
    status, grant = _worker_call(fleet, w["worker_id"], w["credential"], "sessions", {})
    assert status == 201, grant
    return grant["sessionId"], grant["generation"]


def _db_facts(fleet: Fleet) -> dict:
    """What a refused request must not change: Sessions, generations, Leases, Attempts, events,
    logs. Read once the replicas' sweepers have nothing left to do (two reads 0.6 s apart agree;
    a Session's own expiry is time, not a write of the request, so its state is left out)."""
    q = {
        "workers": "SELECT worker_id, generation, state FROM workers ORDER BY worker_id",
        "sessions": "SELECT session_id, worker_id, generation FROM worker_sessions ORDER BY session_id",
        "leases": "SELECT attempt_id, lease_generation, state, expires_at_us FROM run_leases ORDER BY 1, 2",
        "attempts": "SELECT attempt_id, state, version FROM attempts ORDER BY attempt_id",
        "runs": "SELECT run_id, state, version, event_sequence FROM runs ORDER BY run_id",
        "events": "SELECT count(*) FROM run_events",
        "chunks": "SELECT count(*) FROM log_chunks",
    }

    def read() -> dict:
        return {k: fleet.sql(v) for k, v in q.items()}
    last = read()
    for _ in range(15):
        time.sleep(0.6)
        now = read()
        if now == last:
            return now
        last = now
    raise AssertionError("the database never settled (a sweeper keeps writing)")


def _refused(status: int, doc: dict, want_status: int, want_code: str) -> None:
    assert (status, doc["error"]) == (want_status, want_code), (status, doc)
    assert doc["message"] and "Traceback" not in doc["message"], doc


def test_a_forged_offer_is_refused_and_nothing_is_written(fleet):
    """ACKs and a log chunk for a Lease the control plane never issued: a random Attempt, and a
    real queued Attempt with an invented lease token (ADR-0109 fencing)."""
    w = _probe(fleet)
    sid, gen = _session(fleet, w)
    run_id = fleet.ok("run", "start", "probe").strip()
    (real_attempt,) = fleet.sql("SELECT attempt_id FROM attempts WHERE run_id = %s", (run_id,))[0]
    before = _db_facts(fleet)
    forged = {"sessionId": sid, "generation": gen, "attemptId": str(uuid.uuid4()), "leaseGeneration": 1,
              "leaseToken": "F" * 43, "kind": "starting"}
    for body in (forged, {**forged, "attemptId": real_attempt}):
        status, doc = _worker_call(fleet, w["worker_id"], w["credential"], "acks", body)
        _refused(status, doc, 404, "attempt_not_found")
        assert "F" * 43 not in json.dumps(doc)                           # the token is never echoed
        status, doc = fleet.replicas[0].request(
            "PUT", f"{WORKER_API}/{w['worker_id']}/attempts/{body['attemptId']}/log?offset=0", b"forged log\n",
            {"Authorization": f"Worker {w['credential']}", "Content-Type": "application/octet-stream",
             "X-Qlagent-Session": sid, "X-Qlagent-Generation": str(gen), "X-Qlagent-Lease-Generation": "1",
             "X-Qlagent-Lease-Token": "F" * 43})
        _refused(status, doc, 404, "attempt_not_found")
    assert _db_facts(fleet) == before
    fleet.ok("run", "cancel", run_id)


def test_a_replayed_ack_with_an_old_generation_is_refused_and_nothing_is_written(fleet):
    w = _probe(fleet)
    sid, gen = _session(fleet, w)
    run_id = fleet.ok("run", "start", "probe").strip()
    token = "T" * 43
    # A long-poll, as a Worker pulls: the fleet's Workers' own Pulls may hold the new Run for the
    # instant they look at it (it is not theirs), and a Pull with no wait skips what is held.
    status, answer = _worker_call(fleet, w["worker_id"], w["credential"], "pull?waitS=5",
                                  {"sessionId": sid, "generation": gen, "pullId": str(uuid.uuid4()),
                                   "leaseToken": token})
    assert status == 200 and answer["status"] == "offered" and answer["offer"]["runId"] == run_id, answer
    o = answer["offer"]
    ack = {"sessionId": sid, "generation": gen, "attemptId": o["attemptId"], "leaseGeneration": o["leaseGeneration"],
           "leaseToken": token, "kind": "starting"}
    status, doc = _worker_call(fleet, w["worker_id"], w["credential"], "acks", ack)
    assert status == 200, doc
    _session(fleet, w)                                   # the Worker restarted: a newer generation
    before = _db_facts(fleet)
    status, doc = _worker_call(fleet, w["worker_id"], w["credential"], "acks", ack)
    _refused(status, doc, 409, "stale_generation")
    status, doc = _worker_call(fleet, w["worker_id"], w["credential"], "acks", {**ack, "kind": "running"})
    _refused(status, doc, 409, "stale_generation")
    assert _db_facts(fleet) == before
    fleet.ok("run", "cancel", run_id)


def test_a_worker_credential_on_another_workers_route_is_refused_and_nothing_is_written(fleet):
    w = _probe(fleet)
    other = json.loads(fleet.ok("workers", "enroll", "fleet-other", "--label", "probe=yes", "--json"))
    before = _db_facts(fleet)
    for route, body in (("sessions", {}), ("heartbeat", {"sessionId": str(uuid.uuid4()), "generation": 1})):
        status, doc = _worker_call(fleet, other["workerId"], w["credential"], route, body)
        _refused(status, doc, 403, "worker_mismatch")
    assert _db_facts(fleet) == before
    fleet.ok("workers", "rm", "fleet-other")


def test_a_worker_with_a_wrong_ca_is_refused_with_one_clear_line_and_nothing_is_written(fleet):
    w = _probe(fleet)
    d = os.path.join(fleet.root, "wrong-ca")
    os.makedirs(d)
    wrong_ca, _, _ = make_ca(d, "other", [])
    cred = os.path.join(d, "credential")
    fd = os.open(cred, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(w["credential"] + "\n")
    cfg = os.path.join(d, "qlagent.toml")
    with open(cfg, "w") as f:
        f.write(f'state_dir = "{d}/state"\n[worker]\nworker_id = "{w["worker_id"]}"\n'
                f'control_url = "https://127.0.0.1:{fleet.replicas[0].port}"\ncredential_file = "{cred}"\n'
                f'ca_file = "{wrong_ca}"\nlabels = {{ probe = "yes" }}\n')
    os.chmod(cfg, 0o600)
    before = _db_facts(fleet)
    p = run_cli("--config", cfg, "serve")
    errors = [ln for ln in p.stderr.decode().splitlines() if " ERR " in ln]
    assert p.returncode == 2 and len(errors) == 1, p.stderr
    assert "worker.ca_file" in errors[0] and "certificate" in errors[0] and "Traceback" not in p.stderr.decode()
    assert _db_facts(fleet) == before


# ---------------------------------------------------------------- the fleet under chaos

def _running_attempts(fleet: Fleet, task: str, within_s: float = 2.0) -> list[tuple[str, str, str]]:
    """(attempt_id, worker_id, run_id) of ``task``'s Attempts the database holds as running,
    started in the last ``within_s`` seconds (so most of the run is still ahead), newest first."""
    return fleet.sql("SELECT a.attempt_id, a.worker_id, a.run_id FROM attempts a JOIN runs r USING (run_id) "
                     "JOIN tasks t USING (task_id) WHERE t.name = %s AND a.state = 'running' "
                     "AND a.started_at_us > ql_now_us() - %s ORDER BY a.started_at_us DESC",
                     (task, int(within_s * 1e6)))


def _fresh_run(fleet: Fleet, loader: Loader, task: str, within_s: float, exclude: str | None,
               timeout_s: float = 60) -> tuple[str, str, str]:
    """Start ``task`` until one of its Attempts runs, started less than ``within_s`` ago, on a
    Worker other than ``exclude``: (attempt_id, worker_id, run_id)."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        loader.start(task)
        try:
            return wait_until(lambda: next((r for r in _running_attempts(fleet, task, within_s) if r[1] != exclude),
                                           None), 2.0, f"a {task} run")
        except TimeoutError:
            continue
    raise AssertionError(f"no {task} run started on a Worker other than {exclude} within {timeout_s} s")


def _marks(fleet: Fleet, attempt_id: str) -> list[tuple[str, int]]:
    try:
        with open(os.path.join(fleet.marks, attempt_id)) as f:
            return [(w, int(t)) for w, t in (ln.split() for ln in f if ln.strip())]
    except FileNotFoundError:
        return []


def _sql_retry(fleet: Fleet, query: str, args=(), timeout_s: float = 60):
    """A test read during the failover: retried until the promoted server answers."""
    import psycopg
    end = time.monotonic() + timeout_s
    while True:
        try:
            return fleet.sql(query, args)
        except psycopg.OperationalError:
            if time.monotonic() > end:
                raise
            time.sleep(0.3)


def _log(fleet: Fleet, attempt_id: str) -> bytes:
    """The Attempt's log as the control plane holds it; the chunks must tile it without a gap."""
    chunks = fleet.sql("SELECT offset_bytes, data FROM log_chunks WHERE attempt_id = %s ORDER BY offset_bytes",
                       (attempt_id,))
    out = b""
    for off, data in chunks:
        assert off == len(out), f"attempt {attempt_id}: chunk at {off} after {len(out)} bytes"
        out += bytes(data)
    return out


def test_status_names_both_replicas_and_the_synchronous_standby(fleet):
    """``qlagent status`` on the fleet's primary (issue 26 §4): the two replicas by host/pid, the
    standby streaming with its replay lag."""
    out = json.loads(fleet.ok("status", "--json"))
    assert out["database"]["role"] == "primary"
    (standby,) = out["database"]["standbys"]
    assert standby["state"] == "streaming", standby
    assert standby["replayLagS"] is None or 0 <= standby["replayLagS"] < 60, standby
    assert sorted(int(r["name"].rsplit("/", 1)[1]) for r in out["replicas"]) == sorted(
        r.proc.pid for r in fleet.replicas), out["replicas"]
    text = fleet.ok("status")
    assert "; standbys: " in text and " streaming lag " in text, text


def test_a_fleet_of_three_workers_survives_crashes_partitions_and_a_failover(fleet):
    t_begin = time.monotonic()
    workers = fleet.start_workers()
    by_id = {w.worker_id: w for w in workers}
    fig: dict = {}
    loader = Loader(fleet)
    for t in ("quick", "sleeper", "long", "chatty", "hang"):
        loader.head(t)
    fleet.ok("task", "enable", "tick")
    # The steady Task Start load: chatty and hang spread in, a sleeper in ten, the rest quick.
    plan = [t for extra in ["chatty", "hang"] * 6 + ["quick"] * 3 for t in ["quick"] * 13 + ["sleeper", extra]]

    def steady() -> None:
        for task in plan:
            loader.start(task)
            time.sleep(0.15)
    cli_runs: list[str] = []

    def via_cli() -> None:                   # a few Task Starts by operators at a shell
        for _ in range(5):
            p = fleet.cli("run", "start", "quick")
            while p.returncode != 0:        # refused while PostgreSQL fails over: tried again
                assert p.returncode == 5 and len(p.stderr.splitlines()) == 1, p.stderr    # EXIT_UNAVAILABLE
                time.sleep(0.5)
                p = fleet.cli("run", "start", "quick")
            cli_runs.append(p.stdout.decode().strip())
            time.sleep(2)
    load, load_errors = background(steady)
    cli_thread, cli_errors = background(via_cli)

    def succeeded() -> int:
        return _sql_retry(fleet, "SELECT count(*) FROM runs WHERE state = 'succeeded'")[0][0]
    wait_until(lambda: succeeded() >= 20, 90, "20 Runs to succeed on the fleet")

    # -- 1. a Worker SIGKILLed mid-run and started again: its live run is re-attached ----------
    aid_k, wid_k, run_k = _fresh_run(fleet, loader, "long", within_s=2.0, exclude=None)
    victim = by_id[wid_k]
    sessions = victim.journal().count("worker.session_opened")
    victim.kill()
    time.sleep(1)
    victim.start()
    wait_until(lambda: victim.journal().count("worker.session_opened") > sessions, 30,
               f"{victim.name} to open its new Session")
    fig["worker_restart"] = victim.name

    # -- 2. the replica every Worker talks to first SIGKILLed: they move to the other one ---------
    (db_kill_us,) = fleet.sql("SELECT ql_now_us()")[0]
    fleet.replicas[0].kill()
    t_replica = time.monotonic()
    claimed_after = ("SELECT DISTINCT worker_id FROM run_leases WHERE claimed_at_us > %s")
    wait_until(lambda: len(fleet.sql(claimed_after, (db_kill_us,))) == WORKERS, 60,
               "every Worker to be offered a run through the surviving replica")
    fig["replica_failover_s"] = round(time.monotonic() - t_replica, 2)
    fleet.replicas[0].start()

    # -- 3. a link cut longer than the Lease TTL: the runs stop themselves and are re-offered ----
    aid_c, wid_c, run_c = _fresh_run(fleet, loader, "long", within_s=2.0, exclude=wid_k)
    cut = by_id[wid_c]
    cut.net.link_down()
    t_cut = time.monotonic()
    time.sleep(LEASE_TTL_S + 3)
    cut.net.link_up()
    fig["long_cut_s"] = round(time.monotonic() - t_cut, 1)

    # -- 4. a cut shorter than the Lease: what was queued meanwhile is delivered after it --------
    aid_s, wid_s, _ = _fresh_run(fleet, loader, "sleeper", within_s=0.7, exclude=wid_c)
    short = by_id[wid_s]
    short.net.link_down()
    t_short = time.monotonic()
    wait_until(lambda: any(w == "end" for w, _ in _marks(fleet, aid_s)), 10, "the sleeper to end during the cut")
    state_during_cut = fleet.sql("SELECT state FROM attempts WHERE attempt_id = %s", (aid_s,))[0][0]
    short.net.link_up()
    fig["short_cut_s"] = round(time.monotonic() - t_short, 1)

    # -- 5. PostgreSQL failover mid-load: stop the primary, promote the standby -------------------
    acked_at_stop = len(loader.acked)
    t_stop = time.monotonic()
    fleet.pg.stop_primary("immediate")
    fleet.pg.promote()
    t_promoted = time.monotonic()
    wait_until(lambda: len(loader.acked) > acked_at_stop and loader.ack_times[-1] > t_promoted, 60,
               "a Task Start acknowledged after the promotion")
    fig["promote_s"] = round(t_promoted - t_stop, 2)
    # What a client saw: the longest wait between two acknowledged Task Starts across the failover.
    back = min(x for x in loader.ack_times if x > t_promoted)
    around = sorted(t for t in loader.ack_times if t_stop - 5 <= t <= back)
    fig["failover_client_gap_s"] = round(max(b - a for a, b in zip(around, around[1:])), 2)

    # -- the load ends; the schedule stops; top up to exactly RUNS Runs ---------------------------
    load.join(240)
    cli_thread.join(120)
    assert not load_errors and not cli_errors, (load_errors, cli_errors)
    fleet.ok("task", "disable", "tick")
    time.sleep(2.5)                                       # a fire already planned is written or not
    fleet_runs = "SELECT count(*) FROM runs r JOIN tasks t USING (task_id) WHERE t.name <> 'probe'"
    have = fleet.sql(fleet_runs)[0][0]
    assert have <= RUNS, f"{have} Runs before the top-up: the plan must leave room for {RUNS}"
    for _ in range(RUNS - have):
        loader.start("quick")
    assert fleet.sql(fleet_runs)[0][0] == RUNS

    def unfinished() -> list:
        return fleet.sql("SELECT r.run_id, t.name, r.state FROM runs r JOIN tasks t USING (task_id) "
                         "WHERE t.name <> 'probe' AND r.state <> ALL(%s)", (list(FINAL_STATES),))
    try:
        wait_until(lambda: not unfinished(), 120, "every Run to end")
    except TimeoutError:
        stuck = unfinished()
        pytest.fail(f"{len(stuck)} Runs not terminal: {stuck[:5]}; their Attempts: " + repr(fleet.sql(
            "SELECT a.attempt_id, a.state, a.worker_id, a.not_before_us - ql_now_us() FROM attempts a "
            "WHERE a.run_id = ANY(%s)", ([r[0] for r in stuck[:5]],))) + "; Sessions: " + repr(fleet.sql(
            "SELECT worker_id, generation, state, expires_at_us - ql_now_us() FROM worker_sessions")) + "; Leases: "
            + repr(fleet.sql("SELECT attempt_id, worker_id, state, expires_at_us - ql_now_us() FROM run_leases "
                             "WHERE state = 'active'")))

    # ================================================================ outcome, from the database
    runs = fleet.sql("SELECT r.run_id, t.name, r.state, r.trigger_type FROM runs r JOIN tasks t USING (task_id) "
                     "WHERE t.name <> 'probe'")
    attempts = fleet.sql("SELECT a.attempt_id, a.run_id, a.attempt_no, a.state, a.worker_id, "
                         "(SELECT count(*) FROM run_leases l WHERE l.attempt_id = a.attempt_id) "
                         "FROM attempts a JOIN runs r USING (run_id) JOIN tasks t USING (task_id) "
                         "WHERE t.name <> 'probe'")
    task_of = {r[0]: r[1] for r in runs}
    fig["runs"] = len(runs)
    fig["scheduled"] = sum(1 for r in runs if r[1] == "tick")
    fig["attempts"] = len(attempts)
    fig["states"] = {s: sum(1 for r in runs if r[2] == s) for s in sorted({r[2] for r in runs})}

    # Attempts are lost only where the chaos took a Worker away: the long cut self-fences every
    # run of that Worker, and the SIGKILLed Worker may lose one it had not yet handed to a shim.
    chaos = {wid_k, wid_c}
    lost_elsewhere = [(a[0], task_of[a[1]], a[4]) for a in attempts if a[3] == "lost" and a[4] not in chaos]
    assert not lost_elsewhere, f"Attempts lost on Workers no chaos touched: {lost_elsewhere[:10]}"
    fig["lost_attempts"] = sum(1 for a in attempts if a[3] == "lost")

    # Every Run terminal, with the state its Task means; `lost` only when its last Attempt (the
    # retry policy's third) was one of those (a `hang` Run lives for three 2 s timeouts, so the
    # long cut may well catch its last Attempt).
    last = {}
    for a in attempts:
        if a[2] > last.get(a[1], (0,))[0]:
            last[a[1]] = (a[2], a[3], a[4])
    want = {"hang": "timed_out"}
    # `task disable tick` ends the schedule; a tick Run still queued then (the fleet busy) is
    # cancelled by the disable itself — what an operator asked for.
    disabled = {run_id for (run_id,) in fleet.sql(
        "SELECT e.run_id FROM run_events e JOIN runs r USING (run_id) JOIN tasks t USING (task_id) "
        "WHERE t.name = 'tick' AND e.type = 'run.cancelled' AND e.payload_json->>'reason' = 'task_disabled' "
        "AND e.payload_json->>'from' = 'queued'")}
    fig["tick_cancelled_by_disable"] = len(disabled)
    wrong = [(r[0], r[1], r[2]) for r in runs if r[2] != want.get(r[1], "succeeded")
             and not (r[2] == "lost" and last[r[0]][1] == "lost" and last[r[0]][2] in chaos)
             and not (r[2] == "cancelled" and r[0] in disabled)]
    assert not wrong, f"{len(wrong)} Runs not in their expected state: {wrong[:10]}"

    # Every acknowledged Task Start (HTTP 202/200, CLI exit 0) is there after the failover, once.
    acked_ids = {run_id for _, run_id, _, _ in loader.acked} | set(cli_runs)
    assert acked_ids <= set(task_of), f"acknowledged but missing: {sorted(acked_ids - set(task_of))[:5]}"
    assert len({mid for mid, _, _, _ in loader.acked}) == len(loader.acked)
    by_key = dict(fleet.sql("SELECT idempotency_key, run_id FROM runs WHERE idempotency_key LIKE 'ql3:task-start:%%'"))
    assert {f"ql3:task-start:v1:{mid}": run_id for mid, run_id, _, _ in loader.acked}.items() <= by_key.items(), \
        "a mutationId answered with one Run is stored with another"
    fig["task_starts_acked"] = len(acked_ids)
    fig["task_start_retries"] = loader.retries

    # No Attempt executed twice under one Lease: the task scripts' own marks, per Attempt, never
    # more starts than the Leases the control plane issued for it (and none without a Lease).
    doubled = []
    for aid, run_id, _, state, _, leases in attempts:
        starts = sum(1 for w, _ in _marks(fleet, aid) if w == "start")
        if starts > leases or (state == "succeeded" and starts != 1):
            doubled.append((aid, task_of[run_id], state, starts, leases))
    assert not doubled, f"Attempts executed more often than leased: {doubled[:10]}"
    marked = set(os.listdir(fleet.marks))
    assert marked <= {a[0] for a in attempts}, "a task ran under an Attempt the database does not know"
    # And no Run ever ran twice at once: each execution (start → end or SIGTERM mark; a task
    # without either, e.g. killed by SIGKILL, counts as running until the next mark of its Run)
    # is over before the next Attempt of the same Run starts.
    spans: dict[str, list[tuple[int, int | None]]] = {}
    for aid, run_id, _, _, _, _ in attempts:
        m = _marks(fleet, aid)
        for i, (w, t) in enumerate(m):
            if w == "start":
                stop = next((t2 for w2, t2 in m[i + 1:] if w2 in ("end", "term")), None)
                spans.setdefault(run_id, []).append((t, stop))
    overlapping = []
    for run_id, ss in spans.items():
        ss.sort()
        for (a0, a1), (b0, _) in zip(ss, ss[1:]):
            if a1 is None and task_of[run_id] in ("quick", "tick", "sleeper", "long") or a1 is not None and a1 > b0:
                overlapping.append((run_id, task_of[run_id]))
    assert not overlapping, f"Runs with two executions at once: {overlapping[:10]}"

    # 1. The SIGKILLed Worker's run was re-attached: one execution, to its end, succeeded.
    assert fleet.sql("SELECT state FROM attempts WHERE attempt_id = %s", (aid_k,)) == [("succeeded",)]
    assert [w for w, _ in _marks(fleet, aid_k)] == ["start", "end"]
    assert re.search(r"worker\.ready .*reattached=[1-9]", victim.journal()), victim.journal()[-2000:]

    # 3. The long cut: the run was stopped by the Worker itself (SIGTERM mark, no end) before the
    #    control plane offered the Run again; the next Attempt ran after it, and succeeded.
    cut_marks = _marks(fleet, aid_c)
    kinds = [w for w, _ in cut_marks]
    assert kinds[0] == "start" and "term" in kinds and "end" not in kinds, cut_marks
    stopped_at = next(t for w, t in cut_marks if w == "term")
    assert re.search(rf"worker\.lease_lost attempt={aid_c} action=kill", cut.journal())
    later = fleet.sql("SELECT attempt_id, state FROM attempts WHERE run_id = %s ORDER BY attempt_no", (run_c,))
    assert later[0] == (aid_c, "lost") and later[-1][1] == "succeeded", later
    next_start = min(t for w, t in _marks(fleet, later[1][0]) if w == "start")
    assert stopped_at < next_start, "the re-offered Attempt started before the fenced one was stopped"

    # 4. The short cut: the completion ACK and the log waited for the link, then arrived; the
    #    Attempt was not re-run.
    assert state_during_cut == "running"
    assert fleet.sql("SELECT state FROM attempts WHERE attempt_id = %s", (aid_s,)) == [("succeeded",)]
    assert [w for w, _ in _marks(fleet, aid_s)] == ["start", "end"]

    # Every succeeded Run's log is complete: exactly what its script printed, or the quota and
    # the truncation fact for chatty.
    def logs_complete() -> list:
        bad = []
        for aid, run_id, _, state, _, _ in attempts:
            task = task_of[run_id]
            if state != "succeeded":
                continue
            log = _log(fleet, aid)
            exp = expected_log(task, aid)
            if exp is not None and log != exp:
                bad.append((aid, task, len(log)))
            elif task == "chatty" and (len(log) != QUOTA or not log.startswith(b"line 0 0123456789")):
                bad.append((aid, task, len(log)))
        return bad
    try:
        wait_until(lambda: not logs_complete(), 60, "every succeeded Attempt's log to be uploaded")
    except TimeoutError:
        pytest.fail(f"incomplete logs: {logs_complete()[:10]}")
    chatty = [a[0] for a in attempts if task_of[a[1]] == "chatty" and a[3] == "succeeded"]
    facts = dict(fleet.sql("SELECT attempt_id, bytes_kept FROM truncation_facts WHERE attempt_id = ANY(%s)",
                           (chatty,)))
    assert len(chatty) == 6 and facts == dict.fromkeys(chatty, QUOTA), facts

    # The Workers stayed inside the edge budget and their watchdog never went hungry.
    now = time.monotonic()
    watchdog_s = _watchdog_sec()
    fig["peak_memory_mib"] = {}
    fig["max_watchdog_gap_s"] = {}
    for w in workers:
        assert w.cg.oom_kills() == 0, f"{w.name} OOM-killed"
        assert w.cg.fork_failures() == 0, f"{w.name} ran out of PIDs"
        fig["peak_memory_mib"][w.name] = round(w.cg.peak_memory_bytes() / 1_048_576, 1)
        gaps = [n.max_gap_s(now) for n in w.notifies]
        assert all(n.pings() for n in w.notifies), f"{w.name}: a process never sent READY=1"
        fig["max_watchdog_gap_s"][w.name] = round(max(gaps), 2)
        assert max(gaps) < watchdog_s, f"{w.name}: {max(gaps):.1f} s without WATCHDOG=1 (WatchdogSec={watchdog_s})"
        assert w.proc.poll() is None, f"{w.name} exited: {w.journal()[-2000:]}"
    for r in fleet.replicas:
        assert r.proc.poll() is None, r.journal()[-2000:]
    fig["elapsed_s"] = round(time.monotonic() - t_begin, 1)
    print("\nFLEET", json.dumps(fig, sort_keys=True))
