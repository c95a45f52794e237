"""Local API benchmark (issue 5 acceptance): Task Start and a Run read against the real agent.

One run measures, with the same client (4 client processes, one keep-alive connection each):

* **agent** — ``qlagent serve --listen 127.0.0.1:PORT`` (edge profile: 4 in flight) on a fresh
  state directory, bearer token from ``qlagent token create``:
  ``POST /api/v3/projects/default/tasks/bench/runs`` (a new mutationId per request: every
  request is a real ADR-0376 transaction that creates a queued Run, Attempt and two RunEvents;
  the agent also dispatches and runs them), ``GET .../runs/{runId}``, and an exact Task Start
  replay (one mutationId per client: the full ADR-0376 transaction answering 200, no new Run);
* **baseline** — a trivial stdlib ``ThreadingHTTPServer`` answering the same methods and paths
  with a fixed JSON body (no store, no auth).

Prints requests/s, p50/p99 latency (µs) and non-2xx answers per workload, the agent/baseline
ratios, and the agent's RSS and PIDs (whole process tree, sampled every 50 ms) under load.

Usage: python3 bench/bench_api.py [--seconds 3] [--clients 4] [--mode queue|launch]
"""

from __future__ import annotations

import argparse
import array
import http.client
import json
import multiprocessing as mp
import multiprocessing.synchronize
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid

import psutil

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHILD_ENV = {k: v for k, v in os.environ.items() if not k.startswith("QLAGENT_") and k != "PYTHONDONTWRITEBYTECODE"}
CHILD_ENV.update(PYTHONPATH=ROOT, PYTHONPYCACHEPREFIX=os.path.join(tempfile.gettempdir(), "qlagent-bench-pyc"))
# --mode queue (default): one long Run holds the Task's single slot, so each started Run stays
# queued — the figure is the Task Start transaction plus the dispatcher pass it triggers.
# --mode launch: every started Run is launched at once (parallel, `true`): the whole agent.
TASKS = {
    "queue": 'concurrency = "single"\nscript = \'sleep 600\'',
    "launch": 'concurrency = "parallel"\nscript = \'true\'',
}
TASK = """
[[task]]
name = "bench"
schedule = "@once"
timeout_s = 900
shell = "/bin/sh"
{body}
"""


def baseline() -> None:
    """Child: trivial stdlib server; any GET/POST answers a fixed JSON (202 for POST)."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    body = json.dumps({"outcome": "accepted", "runId": str(uuid.uuid4()), "state": "queued"}).encode()

    class H(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        disable_nagle_algorithm = True     # else Nagle + delayed ACK: 40 ms per answer

        def _answer(self, status: int) -> None:
            n = int(self.headers.get("Content-Length") or 0)
            if n:
                self.rfile.read(n)
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:
            self._answer(200)

        def do_POST(self) -> None:
            self._answer(202)

        def log_message(self, *args: object) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), H)
    print(httpd.server_address[1], flush=True)
    httpd.serve_forever()


def _client(port: int, kind: str, target: str, token: str, digest: str, seconds: float,
            go: mp.synchronize.Event, out: mp.Queue) -> None:
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    headers = {"Authorization": f"Bearer {token}"}
    lat, bad = array.array("q"), 0
    fixed = str(uuid.uuid4())      # "replay": one mutationId per client, so all but one are 200
    go.wait()
    stop = time.perf_counter() + seconds
    while time.perf_counter() < stop:
        body = None
        if kind in ("start", "replay"):
            body = json.dumps({"schema": "qinglong/task-start@v1",
                               "mutationId": fixed if kind == "replay" else str(uuid.uuid4()),
                               "expectedRevision": 1, "expectedContentDigest": digest}).encode()
        t0 = time.perf_counter_ns()
        c.request("GET" if kind == "read" else "POST", target, body=body, headers=headers)
        r = c.getresponse()
        r.read()
        lat.append(time.perf_counter_ns() - t0)
        bad += not 200 <= r.status < 300
        if r.will_close:
            c.close()
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    c.close()
    out.put((lat.tobytes(), bad))


def tree(proc: psutil.Process) -> tuple[int, int]:
    """(RSS bytes, PIDs) of a process and its descendants."""
    rss, pids = 0, 0
    for p in [proc, *proc.children(recursive=True)]:
        try:
            rss += p.memory_info().rss
            pids += 1
        except psutil.NoSuchProcess:
            pass
    return rss, pids


def load(port: int, kind: str, target: str, token: str, digest: str, clients: int, seconds: float,
         proc: psutil.Process) -> dict[str, float]:
    ctx = mp.get_context("fork")
    go, out = ctx.Event(), ctx.Queue()
    workers = [ctx.Process(target=_client, args=(port, kind, target, token, digest, seconds, go, out))
               for _ in range(clients)]
    for w in workers:
        w.start()
    go.set()
    peak_rss, peak_pids, own_rss = 0, 0, 0
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        rss, pids = tree(proc)
        peak_rss, peak_pids = max(peak_rss, rss), max(peak_pids, pids)
        own_rss = max(own_rss, proc.memory_info().rss)
        time.sleep(0.05)
    lat, bad = array.array("q"), 0
    for _ in workers:
        raw, b = out.get(timeout=60)
        lat.frombytes(raw)
        bad += b
    for w in workers:
        w.join()
    q = statistics.quantiles(sorted(lat), n=100)
    return {"rps": len(lat) / seconds, "p50_us": q[49] / 1000, "p99_us": q[98] / 1000, "non2xx": bad,
            "rss_mib": own_rss / 2**20, "tree_rss_mib": peak_rss / 2**20, "pids": peak_pids}


def cli(state: str, *args: str) -> str:
    return subprocess.run([sys.executable, "-m", "qlagent.cli.main", "--state-dir", state, *args], check=True,
                          capture_output=True, env=CHILD_ENV, cwd=ROOT).stdout.decode().strip()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_agent(clients: int, seconds: float, mode: str) -> tuple[dict, dict, dict, float]:
    root = tempfile.mkdtemp(prefix="qlagent-bench-api-", dir="/dev/shm" if os.access("/dev/shm", os.W_OK) else None)
    state = os.path.join(root, "state")
    try:
        cli(state, "init")
        with open(os.path.join(root, "t.toml"), "w") as f:
            f.write(TASK.format(body=TASKS[mode]))
        cli(state, "task", "add", "-f", os.path.join(root, "t.toml"))
        token = cli(state, "token", "create", "--subject", "bench", "--role", "operator")
        port = free_port()
        agent = subprocess.Popen([sys.executable, "-m", "qlagent.cli.main", "--state-dir", state, "serve",
                                  "--listen", f"127.0.0.1:{port}"], stderr=subprocess.PIPE,
                                 stdout=subprocess.DEVNULL, env=CHILD_ENV, cwd=ROOT)
        try:
            for line in agent.stderr:
                if b"service.ready" in line:
                    break
            proc = psutil.Process(agent.pid)
            idle = proc.memory_info().rss / 2**20
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
            c.request("GET", "/api/v3/projects/default/tasks/bench", headers={"Authorization": f"Bearer {token}"})
            digest = json.loads(c.getresponse().read())["contentDigest"]
            start_path = "/api/v3/projects/default/tasks/bench/runs"
            load(port, "start", start_path, token, digest, clients, min(0.5, seconds), proc)   # warm-up
            start = load(port, "start", start_path, token, digest, clients, seconds, proc)
            c.request("GET", "/api/v3/projects/default/runs?limit=1", headers={"Authorization": f"Bearer {token}"})
            run_id = json.loads(c.getresponse().read())["items"][0]["runId"]
            c.close()
            read = load(port, "read", f"/api/v3/projects/default/runs/{run_id}", token, digest, clients, seconds, proc)
            replay = load(port, "replay", start_path, token, digest, clients, seconds, proc)
            return start, read, replay, idle
        finally:
            agent.terminate()
            agent.wait(60)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def run_baseline(clients: int, seconds: float) -> tuple[dict, dict, dict]:
    child = subprocess.Popen([sys.executable, __file__, "--baseline"], stdout=subprocess.PIPE, cwd=ROOT,
                             env=CHILD_ENV)
    try:
        port = int(child.stdout.readline())
        proc = psutil.Process(child.pid)
        path = "/api/v3/projects/default/tasks/bench/runs"
        load(port, "start", path, "x", "0" * 64, clients, min(0.5, seconds), proc)
        start = load(port, "start", path, "x", "0" * 64, clients, seconds, proc)
        read = load(port, "read", "/api/v3/projects/default/runs/x", "x", "0" * 64, clients, seconds, proc)
        return start, read, start
    finally:
        child.terminate()
        child.wait(10)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--mode", choices=sorted(TASKS), default="queue")
    ap.add_argument("--baseline", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.baseline:
        baseline()
        return
    a_start, a_read, a_replay, idle = run_agent(a.clients, a.seconds, a.mode)
    b_start, b_read, b_post = run_baseline(a.clients, a.seconds)
    print(f"{a.clients} clients, {a.seconds:g} s per workload, mode {a.mode}; agent idle RSS {idle:.1f} MiB")
    print(f"{'workload':<22}{'req/s':>9}{'p50 µs':>10}{'p99 µs':>10}{'non-2xx':>9}{'RSS MiB':>9}"
          f"{'tree MiB':>10}{'PIDs':>6}")
    for name, r in (("agent Task Start", a_start), ("baseline POST", b_start),
                    ("agent Run read", a_read), ("baseline GET", b_read),
                    ("agent Start replay", a_replay)):
        print(f"{name:<22}{r['rps']:>9.0f}{r['p50_us']:>10.0f}{r['p99_us']:>10.0f}{r['non2xx']:>9}"
              f"{r['rss_mib']:>9.1f}{r['tree_rss_mib']:>10.1f}{r['pids']:>6}")
    for name, a_, b_ in (("Task Start", a_start, b_start), ("Run read", a_read, b_read),
                         ("Start replay (200)", a_replay, b_post)):
        print(f"ratio agent/baseline {name}: req/s {a_['rps'] / b_['rps']:.2f}x, "
              f"p50 {a_['p50_us'] / b_['p50_us']:.2f}x, p99 {a_['p99_us'] / b_['p99_us']:.2f}x")


if __name__ == "__main__":
    main()
