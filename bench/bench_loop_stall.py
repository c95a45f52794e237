"""Bench for the service loop while runs start (issue 24 §2, §4): the longest answer of
``GET /healthz`` (probed back to back over one keep-alive connection) while 4 Runs start at
once, vs the same probe while nothing starts, same ``qlagent serve``, same run. Today the loop
waits for each shim's start status, so a start stalls every HTTP answer, watchdog ping and
schedule for as long as a shim takes to start.

``--tree DIR`` runs the serve of another checkout (e.g. ``git archive <commit>`` unpacked) for a
before/after in one session; ``--cpu-quota PCT`` as in bench_forkserver.py.

``--queue cli`` (the default) queues the 4 Runs with 4 ``qlagent run start`` processes at once:
their 4 interpreter starts compete with the agent and the probe for the CPUs during the window.
``--queue store`` queues them from this process (4 Task Start transactions on the same SQLite
file, then one poke of the control socket), so the window holds the agent's own work only.

Usage: python3 bench/bench_loop_stall.py [--rounds 5] [--tree DIR] [--cpu-quota PCT] [--queue cli|store]
"""

import argparse
import http.client
import os
import socket
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_forkserver import throttle  # noqa: E402
from qlagent.adapters.sqlite.store import SqliteStore  # noqa: E402  (bench_forkserver put the tree on sys.path)
from qlagent.application.runs import RunService  # noqa: E402
from qlagent.service import control  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TASKS = "".join(f'[[task]]\nname = "t{i}"\ncommand = ["/bin/sleep", "0.5"]\n\n' for i in range(4))


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cli(tree, state, *args):
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": tree}
    return subprocess.run([sys.executable, "-m", "qlagent.cli.main", "--state-dir", state, *args], env=env,
                          cwd=tree, check=True, capture_output=True)


def running(state):
    with sqlite3.connect(os.path.join(state, "qlagent.db"), timeout=10) as c:
        return c.execute("SELECT count(*) FROM runs WHERE state IN ('running', 'succeeded')").fetchone()[0]


class Probe(threading.Thread):
    def __init__(self, port):
        super().__init__(daemon=True)
        self.port = port
        self.samples = []          # (start monotonic, seconds)
        self.stop = False

    def run(self):
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        while not self.stop:
            t0 = time.monotonic()
            conn.request("GET", "/healthz")
            conn.getresponse().read()
            self.samples.append((t0, time.monotonic() - t0))

    def window(self, a, b):
        return [s for t, s in self.samples if a <= t <= b]


def p99(v):
    v = sorted(v)
    return v[min(len(v) - 1, int(len(v) * 0.99))] if v else float("nan")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tree", default=REPO, help="the checkout whose serve is measured")
    ap.add_argument("--cpu-quota", type=int, default=0)
    ap.add_argument("--queue", choices=("cli", "store"), default="cli", help="how the 4 Runs are queued")
    args = ap.parse_args()
    if args.cpu_quota:
        throttle(args.cpu_quota)
    root = tempfile.mkdtemp(prefix="qlagent-stall-")
    state = os.path.join(root, "st")
    cli(args.tree, state, "init")
    with open(os.path.join(root, "t.toml"), "w") as f:
        f.write(TASKS)
    cli(args.tree, state, "task", "add", "-f", os.path.join(root, "t.toml"))
    port = free_port()
    serve = subprocess.Popen([sys.executable, "-m", "qlagent.cli.main", "--state-dir", state, "serve", "--listen",
                              f"127.0.0.1:{port}"], env={"PATH": "/usr/bin:/bin", "PYTHONPATH": args.tree},
                             cwd=args.tree, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), 1).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        store = SqliteStore(os.path.join(state, "qlagent.db"), migrate=False, create_project=False) \
            if args.queue == "store" else None
        runs = RunService(store) if store is not None else None
        probe = Probe(port)
        probe.start()
        quiet, busy = [], []
        done = 0
        for _ in range(args.rounds):
            time.sleep(1.0)
            q0 = time.monotonic()
            time.sleep(1.0)
            quiet += probe.window(q0, time.monotonic())
            b0 = time.monotonic()
            if args.queue == "store":
                for i in range(4):
                    runs.start(f"t{i}")
                control.poke(os.path.join(state, "control.sock"))
            else:
                with open(os.path.join(root, "runs.txt"), "w") as f:   # 4 Runs queued at once, one poke each
                    starts = [subprocess.Popen([sys.executable, "-m", "qlagent.cli.main", "--state-dir", state, "run",
                                                "start", f"t{i}"], env={"PATH": "/usr/bin:/bin", "PYTHONPATH": args.tree},
                                               cwd=args.tree, stdout=f, stderr=subprocess.DEVNULL) for i in range(4)]
                    for s in starts:
                        s.wait()
            done += 4
            while running(state) < done:
                time.sleep(0.01)
            busy += probe.window(b0, time.monotonic())
        probe.stop = True
        probe.join()
        if store is not None:
            store.close()
    finally:
        serve.terminate()
        serve.wait()
    ms = 1000
    print(f"python {sys.version.split()[0]}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}, tree {args.tree}, "
          f"queued by {args.queue}" + (f", {args.cpu_quota} % of one CPU" if args.cpu_quota else ""))
    print(f"\n## /healthz while 4 Runs start at once ({args.rounds} rounds; ms)")
    print("| window | probes | median | p99 | max |")
    print("|---|---:|---:|---:|---:|")
    for label, v in (("nothing starting (baseline)", quiet), ("4 Runs starting", busy)):
        print(f"| {label} | {len(v)} | {statistics.median(v) * ms:.2f} | {p99(v) * ms:.2f} | {max(v) * ms:.2f} |")


if __name__ == "__main__":
    main()
