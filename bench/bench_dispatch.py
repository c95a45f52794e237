"""Bench for local dispatch (issue 3 bench lines, ADR-0071 §3): dispatch→exec latency of the full
path vs a bare os.posix_spawn, dispatcher pass time against a backlog of 100 / 1,000 / 10,000
queued Runs, and per-run overhead (extra PIDs, shim RSS/USS). Every figure is printed with its
baseline measured in the same run.

Full path = queued Run in SQLite → ``Engine.dispatcher.dispatch_once()`` (page read, reread,
pinned revision + recipe, secrets, env, statvfs admission, Artifact, CAS, spawn of the shim
shim, FIFO, fork/exec of the task) → the task's first instruction. The task is
``/bin/date +%s%N``, so "exec" is the wall-clock instant the task itself printed; the baseline
posix_spawns the same ``/bin/date`` from the same process.

Usage: python3 bench/bench_dispatch.py [--rounds 30] [--passes 200]
"""

from __future__ import annotations

import argparse
import os
import selectors
import shutil
import statistics
import sys
import tempfile
import time
from types import SimpleNamespace

import psutil

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from qlagent.adapters.secretbox import create_key_file  # noqa: E402
from qlagent.adapters.rows import definitions as defs  # noqa: E402
from qlagent.adapters.rows import runs as runs_repo  # noqa: E402
from qlagent.application.definitions import DefinitionWriter  # noqa: E402
from qlagent.application.runs import RunService  # noqa: E402
from qlagent.application.secrets import SecretService  # noqa: E402
from qlagent.adapters.sqlite.store import SqliteStore  # noqa: E402
from qlagent.core.clock import now_us  # noqa: E402
from qlagent.core.profiles import EDGE  # noqa: E402
from qlagent import bootstrap  # noqa: E402

TERMINAL = ("succeeded", "failed", "timed_out", "cancelled", "lost")


class Rig:
    def __init__(self, root: str, max_concurrent: int = 4) -> None:
        os.makedirs(root)
        self.key = os.path.join(root, "secret.key")
        create_key_file(self.key)
        self.store = SqliteStore(os.path.join(root, "q.db"))
        settings = SimpleNamespace(artifact_dir=os.path.join(root, "artifacts"), runs_dir=os.path.join(root, "runs"),
                                   key_file=self.key, profile=EDGE)
        self.engine = bootstrap.build_engine(settings, self.store, max_concurrent=max_concurrent, budget=None,
                                             clock_us=now_us, log=lambda *a, **k: None)
        self.runs = RunService(self.store)

    def add(self, **t) -> None:
        t.setdefault("timeout_s", 30)
        t.setdefault("grace_s", 1)
        DefinitionWriter(self.store).add(DefinitionWriter.prepare_file({"task": [t]}))

    def queue(self, name: str, n: int) -> None:
        """n queued Runs in one transaction (the same rows Task Start writes)."""
        def tx(c):
            head = defs.get_head(c, self.store.project.project_id, name)
            base = time.time_ns() // 1000
            for i in range(n):
                runs_repo.create_run(c, head=head, origin="manual", trigger_type="cli",
                                     idempotency_key=f"bench:{name}:{base}:{i}", requested_by="bench", now_us=base + i)
        self.store.write(tx)

    def stop_live_and_close(self) -> None:
        """Cancel every live Run, wait for their shims, close the store."""
        from qlagent.application.cancel import request_cancel
        for (rid,) in self.store.read(lambda c: c.execute("SELECT run_id FROM runs WHERE state IN "
                                                          "('starting','running')").fetchall()):
            request_cancel(self.store, rid, "bench")
        self.engine.sweep_cancels()
        self.reap_all()
        self.store.close()

    def reap_all(self, timeout_s: float = 30) -> None:
        """Drive every start in flight and every live shim to its end."""
        self.drive(self.engine.live_count, timeout_s)

    def started(self, timeout_s: float = 30) -> None:
        """Drive every start in flight until its shim runs (``live_pids`` names it)."""
        self.drive(self.engine.starts_in_flight, timeout_s)

    def drive(self, pending, timeout_s: float) -> None:
        """The service loop's part while ``pending()``: the fds to watch change as a start goes
        (the fork server's status pipe, then the shim's pidfd), so they are read each turn."""
        end = time.monotonic() + timeout_s
        while pending() and time.monotonic() < end:
            with selectors.DefaultSelector() as sel:
                for fd, aid in self.engine.pidfds().items():
                    sel.register(fd, selectors.EVENT_READ, aid)
                for key, _ in sel.select(0.5):
                    self.engine.on_exit(key.data)
            self.engine.tick()


def percentile(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


def bench_latency(base: str, rounds: int) -> dict:
    rig = Rig(os.path.join(base, "lat"))
    rig.add(name="stamp", command=["/bin/date", "+%s%N"], env={"A": "1"}, secrets={"TOK": "tok"})
    SecretService(rig.store, bootstrap.cipher_factory(rig.key)).set("tok", b"bench-token")
    full, bare, interp = [], [], []
    out = os.path.join(base, "bare.out")
    for _ in range(rounds):
        # Second baseline: start-up of the shim's interpreter alone (python3 -I -S -c pass).
        t0 = time.perf_counter_ns()
        os.waitpid(os.posix_spawn(sys.executable, [sys.executable, "-I", "-S", "-c", "pass"], {}), 0)
        interp.append((time.perf_counter_ns() - t0) / 1e3)
        # Baseline: a bare posix_spawn of the same /bin/date, stdout to a file, same process.
        fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        fa = [(os.POSIX_SPAWN_DUP2, fd, 1)]
        t0 = time.time_ns()
        pid = os.posix_spawn("/bin/date", ["/bin/date", "+%s%N"], {}, file_actions=fa)
        os.waitpid(pid, 0)
        os.close(fd)
        with open(out) as f:
            bare.append((int(f.read()) - t0) / 1e3)
        # Full path.
        run_id = rig.runs.start("stamp").run_id
        t0 = time.time_ns()
        r = rig.engine.dispatcher.dispatch_once()
        assert r.status == "activated", r
        rig.reap_all()
        path, _ = rig.runs.log_source(run_id)
        with open(path) as f:
            full.append((int(f.read()) - t0) / 1e3)
    rig.store.close()
    return {"full": full, "bare": bare, "interp": interp}


def bench_passes(base: str, backlog: int, passes: int) -> dict:
    """Median pass time with ``backlog`` queued Runs, two ways: (a) every candidate must wait
    (network-gated, and no gate answers here): a pass reads a page, materialises up to 4
    candidates to the admission step and returns ``more``; (b) a pass that activates one Run
    (its shim start begun), measured over 20 activations of a higher-priority Task queued
    after the same backlog, each Run reaped before the next pass. ``vm_steps``: SQLite VM instructions of one all-wait pass
    deep in the backlog (after ``passes`` passes moved the keyset cursor). (A single-instance
    backlog behind a live Run is cheaper still: it is held out of the index, see
    ``bench_held``.)"""
    rig = Rig(os.path.join(base, f"pass{backlog}"), max_concurrent=64)
    rig.add(name="blocked", shell="/bin/sh", script="true\n", concurrency="parallel", network="default_route")
    rig.add(name="go", command=["/bin/true"], concurrency="parallel", priority=1)   # ahead of the blocked
    rig.queue("blocked", backlog)
    rig.queue("go", 20)
    acts = []
    for _ in range(20):
        t0 = time.perf_counter_ns()
        r = rig.engine.dispatcher.dispatch_once()
        acts.append((time.perf_counter_ns() - t0) / 1e3)
        assert r.status == "activated", r
        rig.reap_all()      # untimed: each live Run holds memory admission (EDGE: 4 at once)
    waits = []
    steps = [0]

    def count():
        steps[0] += 1
        return 0
    for _ in range(passes):
        t0 = time.perf_counter_ns()
        r = rig.engine.dispatcher.dispatch_once()
        waits.append((time.perf_counter_ns() - t0) / 1e3)
        assert r.status in ("more", "no_candidate"), r
    rig.store.authority.raw(lambda c: c.set_progress_handler(count, 1))
    rig.engine.dispatcher.dispatch_once()
    rig.store.authority.raw(lambda c: c.set_progress_handler(None, 1))
    rig.stop_live_and_close()
    return {"wait_pass_us": statistics.median(waits), "act_pass_us": statistics.median(acts),
            "vm_steps": steps[0]}


def bench_held(base: str, backlog: int) -> dict:
    """A single-instance Task with one live Run and ``backlog`` queued behind it: the queued
    Runs are held out of the dispatch index, so a pass finds nothing to read. Reports the
    no-candidate pass (µs, VM steps) and the one-off cost of holding the backlog (the VM
    steps of the pass that started the live Run)."""
    rig = Rig(os.path.join(base, f"held{backlog}"), max_concurrent=64)
    rig.add(name="single", shell="/bin/sh", script="sleep 60\n", concurrency="single")
    rig.queue("single", backlog + 1)
    steps = [0]

    def count():
        steps[0] += 1
        return 0
    rig.store.authority.raw(lambda c: c.set_progress_handler(count, 1))
    assert rig.engine.dispatcher.dispatch_once().status == "activated"
    hold_steps, steps[0] = steps[0], 0
    passes = []
    for _ in range(50):
        t0 = time.perf_counter_ns()
        assert rig.engine.dispatcher.dispatch_once().status == "no_candidate"
        passes.append((time.perf_counter_ns() - t0) / 1e3)
    pass_steps = steps[0] // 50
    rig.store.authority.raw(lambda c: c.set_progress_handler(None, 1))
    rig.stop_live_and_close()
    return {"pass_us": statistics.median(passes), "pass_steps": pass_steps, "hold_steps": hold_steps}


def bench_overhead(base: str) -> dict:
    rig = Rig(os.path.join(base, "ovh"))
    rig.add(name="sleeper", command=["/bin/sleep", "2"])
    run_id = rig.runs.start("sleeper").run_id
    assert rig.engine.dispatcher.dispatch_once().status == "activated"
    rig.started()
    shim = psutil.Process(rig.engine.live_pids()[0])
    time.sleep(0.5)
    tree = shim.children(recursive=True)
    mem = shim.memory_full_info()
    agent = psutil.Process().memory_full_info()
    # Baseline: the same sleep started bare (no shim), measured the same way.
    bare = psutil.Popen(["/bin/sleep", "2"])
    time.sleep(0.2)
    bare_mem = bare.memory_full_info()
    bare.kill()
    bare.wait()
    rig.reap_all()
    assert rig.runs.get(run_id).state == "succeeded"
    rig.store.close()
    return {"extra_pids": 1 + len(tree) - 1, "tree": len(tree), "shim_rss": mem.rss, "shim_uss": mem.uss,
            "task_rss": bare_mem.rss, "agent_rss": agent.rss, "agent_uss": agent.uss}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--passes", type=int, default=200)
    args = ap.parse_args()
    base = tempfile.mkdtemp(prefix="qlbench-dispatch-", dir="/dev/shm" if os.access("/dev/shm", os.W_OK) else None)
    try:
        lat = bench_latency(base, args.rounds)
        f, b = lat["full"], lat["bare"]
        print(f"dispatch→exec latency over {args.rounds} rounds (µs; median / p90 / min)")
        print(f"  bare posix_spawn /bin/date          {statistics.median(b):9.0f} {percentile(b, 90):9.0f} "
              f"{min(b):9.0f}")
        i = lat["interp"]
        print(f"  posix_spawn python3 -I -S -c pass   {statistics.median(i):9.0f} {percentile(i, 90):9.0f} "
              f"{min(i):9.0f}   (the shim's interpreter start-up, to exit)")
        print(f"  full path queued Run → task exec    {statistics.median(f):9.0f} {percentile(f, 90):9.0f} "
              f"{min(f):9.0f}   ratio {statistics.median(f) / statistics.median(b):.1f}x")
        print(f"\ndispatcher pass vs backlog ({args.passes} blocked passes, 20 activating passes; median µs)")
        base_row = None
        for n in (100, 1_000, 10_000):
            r = bench_passes(base, n, args.passes)
            base_row = base_row or r
            print(f"  backlog {n:>6}: all-wait pass {r['wait_pass_us']:8.0f} µs "
                  f"({r['wait_pass_us'] / base_row['wait_pass_us']:.2f}x)   activating pass "
                  f"{r['act_pass_us']:8.0f} µs ({r['act_pass_us'] / base_row['act_pass_us']:.2f}x)   "
                  f"SQLite VM steps {r['vm_steps']}")
        print("\nsingle-instance backlog held behind a live Run (50 passes; median µs)")
        for n in (100, 1_000, 10_000):
            h = bench_held(base, n)
            print(f"  backlog {n:>6}: pass {h['pass_us']:6.0f} µs, {h['pass_steps']} VM steps; "
                  f"holding the backlog once: {h['hold_steps']} VM steps")
        o = bench_overhead(base)
        MiB = 1048576
        print("\nper-run overhead (sleep task, shim sampled 0.5 s in)")
        print(f"  processes of the run: {o['tree'] + 1} (shim + task) → extra PIDs per run: 1")
        print(f"  shim RSS {o['shim_rss'] / MiB:.1f} MiB, USS {o['shim_uss'] / MiB:.1f} MiB; "
              f"bare sleep RSS {o['task_rss'] / MiB:.1f} MiB; agent (this process) RSS {o['agent_rss'] / MiB:.1f} "
              f"MiB, USS {o['agent_uss'] / MiB:.1f} MiB")
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
