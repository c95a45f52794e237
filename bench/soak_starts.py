"""Run starts under load (issue 24, "a start race in the fork-server path"): one real ``qlagent
serve`` (edge Profile, 8 Runs at once) starts Runs of two Tasks, one of them with a Secret, in
batches, first quietly (the baseline), then while CPU hogs run and its fork server is SIGSTOPped
for random spans (``--stop-max`` seconds, below the start bound), every ``--long-stop-every``-th
span past the bound (35 s), and every ``--kill-every``-th time SIGKILLed instead.

Per phase: the Runs' outcomes (state, failure reason), the time each spent ``starting`` (from
its ``run.starting`` RunEvent to ``run.running`` or ``run.start_failed``, the store's clock),
median / p99 / max and the loaded phase's ratio to the baseline; at the end the agent's RSS,
its process count, the tracebacks in its journal and the Runs still live. Every Run must end:
one that stays ``starting`` past the bound (``core.limits.SHIM_START_BOUND_US``, 30 s) plus
``--slack`` seconds stops the soak with the agent's journal.

Usage: python3 bench/soak_starts.py [--runs 200] [--batch 4] [--hogs 4] [--stop-max 3]
       [--long-stop-every N] [--kill-every N]
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter

import psutil

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [REPO, os.path.join(REPO, "tests")]
from execkit import TERMINAL, Agent, task  # noqa: E402

from qlagent.core.limits import SHIM_START_BOUND_US  # noqa: E402

BOUND_S = SHIM_START_BOUND_US / 1e6
LONG_STOP_S = BOUND_S + 5


class Chaos(threading.Thread):
    """SIGSTOP (then SIGCONT), or SIGKILL, the agent's fork server at random moments."""

    def __init__(self, agent_pid: int, stop_max: float, long_every: int, kill_every: int) -> None:
        super().__init__(daemon=True)
        self.agent_pid, self.stop_max, self.long_every, self.kill_every = agent_pid, stop_max, long_every, kill_every
        self.done = threading.Event()
        self.events: Counter = Counter()

    def servers(self) -> list[psutil.Process]:
        try:
            kids = psutil.Process(self.agent_pid).children()
            return [k for k in kids if "--compile" not in k.cmdline()]
        except psutil.Error:
            return []

    def run(self) -> None:
        n = 0
        while not self.done.wait(random.uniform(0.05, 1.5)):
            for fs in self.servers():
                n += 1
                try:
                    if self.kill_every and n % self.kill_every == 0:
                        fs.kill()
                        self.events["SIGKILL"] += 1
                        continue
                    span = LONG_STOP_S if self.long_every and n % self.long_every == 0 else \
                        random.uniform(0.01, self.stop_max)
                    fs.suspend()
                    self.events["SIGSTOP past the bound" if span > BOUND_S else "SIGSTOP"] += 1
                    self.done.wait(span)
                    fs.resume()
                except psutil.Error:
                    continue

    def stop(self) -> None:
        self.done.set()
        self.join()
        for fs in self.servers():
            try:
                fs.resume()
            except psutil.Error:
                pass


def starting_spans(agent: Agent, run_ids: list[str]) -> list[float]:
    """Seconds each Run spent ``starting``, from its RunEvents."""
    spans = []
    with agent.db() as c:
        for rid in run_ids:
            times = {r["type"]: r["created_at_us"] for r in c.execute(
                "SELECT type, created_at_us FROM run_events WHERE run_id = ?", (rid,))}
            end = times.get("run.running", times.get("run.start_failed"))
            if "run.starting" in times and end is not None:
                spans.append((end - times["run.starting"]) / 1e6)
    return spans


def phase(agent: Agent, n: int, batch: int, slack: float) -> tuple[list[str], Counter]:
    """Start ``n`` Runs, ``batch`` at a time, each batch waited for; returns their IDs and outcomes."""
    ids: list[str] = []
    outcomes: Counter = Counter()
    while len(ids) < n:
        batch_ids = [agent.start(random.choice(("secret", "plain"))) for _ in range(min(batch, n - len(ids)))]
        for rid in batch_ids:
            began = time.monotonic()
            while True:
                r = agent.run(rid)
                if r["state"] in TERMINAL:
                    break
                waited = time.monotonic() - began      # queued or starting past the bound, or not ending
                if agent.proc.poll() is not None or (r["state"] != "running" and waited > BOUND_S + slack) \
                        or waited > BOUND_S + slack + 60:
                    alive = "alive" if agent.proc.poll() is None else "gone"
                    raise SystemExit(f"run {rid} still {r['state']} after {waited:.1f} s (agent {alive}); its journal "
                                     f"ends:\n{agent.journal().decode(errors='replace')[-4000:]}")
                time.sleep(0.05)
            reasons = [a["start_error"] or a["failure_reason"] for a in agent.attempts(rid) if a["failure_reason"]]
            outcomes[(r["state"], "; ".join(reasons))] += 1
        ids += batch_ids
    return ids, outcomes


def summary(spans: list[float]) -> str:
    if not spans:
        return "none"
    q = statistics.quantiles(spans, n=100, method="inclusive") if len(spans) > 1 else spans
    return f"median {statistics.median(spans) * 1e3:.1f} ms, p99 {q[-1] * 1e3:.1f} ms, max {max(spans) * 1e3:.1f} ms"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=200, help="Runs of the loaded phase (a quarter as many quietly first)")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--hogs", type=int, default=4, help="busy-looping shells during the loaded phase")
    ap.add_argument("--stop-max", type=float, default=3.0, help="longest SIGSTOP of the fork server, seconds")
    ap.add_argument("--long-stop-every", type=int, default=0, help=f"every Nth SIGSTOP lasts {LONG_STOP_S:g} s")
    ap.add_argument("--kill-every", type=int, default=0, help="every Nth time SIGKILL the fork server instead")
    ap.add_argument("--slack", type=float, default=5.0, help="seconds past the bound a Run may stay starting")
    args = ap.parse_args()
    root = tempfile.mkdtemp(prefix="qlagent-soak-starts-", dir="/var/tmp")
    agent = Agent(root, config="max_concurrent_runs = 8\n")
    agent.cli("secret", "set", "token", stdin=b"soak-secret-0123456789\n")
    agent.add(task("secret", 'echo "token of ${#TOKEN} chars"\n', secrets={"TOKEN": "token"}, concurrency="parallel",
                   timeout_s=60),
              task("plain", "echo plain\n", concurrency="parallel", timeout_s=60))
    agent.serve(exit_after=100_000)
    hogs: list[subprocess.Popen] = []
    chaos = None
    try:
        quiet_ids, quiet = phase(agent, max(args.batch, args.runs // 4), args.batch, args.slack)
        hogs = [subprocess.Popen(["sh", "-c", "while :; do :; done"]) for _ in range(args.hogs)]
        chaos = Chaos(agent.proc.pid, args.stop_max, args.long_stop_every, args.kill_every)
        chaos.start()
        load_ids, loaded = phase(agent, args.runs, args.batch, args.slack)
        chaos.stop()
        load = os.getloadavg()
        proc = psutil.Process(agent.proc.pid)
        rss_kib = proc.memory_info().rss // 1024
        tree = 1 + len(proc.children(recursive=True))
        with agent.db() as c:
            live = c.execute("SELECT count(*) FROM runs WHERE state IN ('queued', 'starting', 'running')").fetchone()[0]
    finally:
        if chaos is not None:
            chaos.stop()
        for h in hogs:
            h.kill()
        agent.stop(60)
    quiet_spans, load_spans = starting_spans(agent, quiet_ids), starting_spans(agent, load_ids)
    journal = agent.journal()
    shutil.rmtree(root, ignore_errors=True)
    print(f"python {sys.version.split()[0]}, {os.cpu_count()} CPUs, load {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}, "
          f"{args.hogs} hogs, start bound {BOUND_S:g} s")
    print(f"chaos: {dict(chaos.events) if chaos else {}}")
    for name, outcomes in (("quiet", quiet), ("loaded", loaded)):
        print(f"{name} phase outcomes: " + "; ".join(f"{n} {s}" + (f" ({why})" if why else "")
                                                   for (s, why), n in outcomes.most_common()))
    print(f"time starting, quiet ({len(quiet_spans)} Runs): {summary(quiet_spans)}")
    print(f"time starting, loaded ({len(load_spans)} Runs): {summary(load_spans)}")
    if quiet_spans and load_spans:
        print(f"loaded / quiet: median {statistics.median(load_spans) / statistics.median(quiet_spans):.2f}x, "
              f"max {max(load_spans) / max(quiet_spans):.2f}x; longest starting {max(load_spans):.2f} s "
              f"of the {BOUND_S:g} s bound")
    print(f"agent: RSS {rss_kib} KiB, {tree} processes in its tree at the end; Runs still live: {live}; "
          f"tracebacks in its journal: {journal.count(b'Traceback')}")


if __name__ == "__main__":
    main()
