"""Bench for the fork server (issue 24 §1, §4): dispatch → task exec through the fork server
(processes.ForkServer) vs a direct interpreter start per run (spawn_shim, the path before) vs a
bare os.posix_spawn; per-run extra PIDs and USS of a fork-served shim vs a directly started one,
and the fork server's own idle USS; the drainer's throughput vs `cat` (bench_drainer.throughput).
Every figure beside its baseline measured in the same run, paths interleaved.

Slow CPU: ``--cpu-quota 10`` runs the whole bench (this process and everything it starts) in a
new cgroup limited to 10 % of one core (v2 ``cpu.max``, else v1 ``cpu.cfs_quota_us``; needs
root), so the ratios are measured under throttling as well.

Usage: python3 bench/bench_forkserver.py [--rounds 15] [--mib 128] [--cpu-quota PCT]
"""

import argparse
import os
import select
import signal
import statistics
import sys
import tempfile
import time

import psutil

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_drainer import DATE_ARGV, new_run, private_dirty, throughput, via_posix_spawn  # noqa: E402

from qlagent.adapters import processes  # noqa: E402
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
from shimkit import spawn_shim  # noqa: E402  (the shim alone, by its own interpreter)

MiB = 1024 * 1024
PATH_ENV = {"PATH": "/usr/bin:/bin"}


def throttle(pct):
    """Move this process into a new cgroup with ``pct`` % of one CPU; returns its path."""
    period = 100_000
    quota = period * pct // 100
    v2 = "/sys/fs/cgroup/cgroup.controllers"
    if os.path.exists(v2):
        path = f"/sys/fs/cgroup/qlagent-bench-{os.getpid()}"
        os.mkdir(path)
        with open(f"{path}/cpu.max", "w") as f:
            f.write(f"{quota} {period}")
    else:
        path = f"/sys/fs/cgroup/cpu/qlagent-bench-{os.getpid()}"
        os.mkdir(path)
        with open(f"{path}/cpu.cfs_period_us", "w") as f:
            f.write(str(period))
        with open(f"{path}/cpu.cfs_quota_us", "w") as f:
            f.write(str(quota))
    with open(f"{path}/cgroup.procs", "w") as f:
        f.write(str(os.getpid()))
    return path


def latency(base, rounds, fs):
    argv = DATE_ARGV

    def finish(spec, h):
        while processes.read_receipt(spec["run_dir"]) is None:
            time.sleep(0.001)
        if h.popen is not None:
            h.popen.wait()
        if h.pidfd is not None:
            os.close(h.pidfd)

    def via_fork_server():
        spec = new_run(base, 4096, argv)
        t0 = time.time_ns()
        h = fs.spawn(spec, sys.executable)
        finish(spec, h)
        with open(spec["artifact_path"]) as f:
            return int(f.read()) - t0

    program = processes.compiled_shim(base, sys.executable)

    def via_interpreter():
        spec = new_run(base, 4096, argv)
        t0 = time.time_ns()
        h = spawn_shim(spec, program=program)
        finish(spec, h)
        with open(spec["artifact_path"]) as f:
            return int(f.read()) - t0

    def until_running(spawn):
        def go():
            spec = new_run(base, 4096, ["/bin/true"])
            t0 = time.perf_counter_ns()
            h = spawn(spec)          # returns once the start status said "ok": the Run is running
            took = time.perf_counter_ns() - t0
            finish(spec, h)
            return took
        return go

    def loop_share():
        # What the agent's loop itself spends on a start: the request (begin) and each
        # advance; the waits between them are the selector's, when the loop serves others.
        spec = new_run(base, 4096, ["/bin/true"])
        t0 = time.perf_counter_ns()
        st = fs.begin(spec, sys.executable)
        took = time.perf_counter_ns() - t0
        while True:
            select.select([st.fd] if st.fd is not None else [], [], [], 1)
            t0 = time.perf_counter_ns()
            h = fs.advance(st)
            took += time.perf_counter_ns() - t0
            if h is not None:
                finish(spec, h)
                return took

    paths = {"posix_spawn": via_posix_spawn, "fork": via_fork_server, "interp": via_interpreter,
             "loop": loop_share,
             "fork_ok": until_running(lambda s: fs.spawn(s, sys.executable)),
             "interp_ok": until_running(lambda s: spawn_shim(s, program=program))}
    samples = {name: [] for name in paths}
    for fn in paths.values():
        fn()
    for _ in range(rounds):
        for name, fn in paths.items():
            samples[name].append(fn())
    med = {name: statistics.median(v) / 1e6 for name, v in samples.items()}
    p90 = {name: sorted(v)[int(len(v) * 0.9)] / 1e6 for name, v in samples.items()}
    b = med["posix_spawn"]
    print(f"\n## Dispatch → task exec (median of {rounds}, interleaved, ms)")
    print("| path | median ms | p90 ms | median vs bare posix_spawn |")
    print("|---|---:|---:|---:|")
    print(f"| bare os.posix_spawn of `date +%s%N` (baseline) | {b:.2f} | {p90['posix_spawn']:.2f} | 1.00x |")
    print(f"| fork server → shim → task exec | {med['fork']:.2f} | {p90['fork']:.2f} | {med['fork'] / b:.1f}x |")
    print(f"| interpreter per run (spawn_shim, before) → task exec | {med['interp']:.2f} | {p90['interp']:.2f} | "
          f"{med['interp'] / b:.1f}x |")
    print(f"| fork server: call until `ok` (what the loop waits) | {med['fork_ok']:.2f} | {p90['fork_ok']:.2f} | "
          f"{med['fork_ok'] / b:.1f}x |")
    print(f"| interpreter per run: call until `ok` (before) | {med['interp_ok']:.2f} | {p90['interp_ok']:.2f} | "
          f"{med['interp_ok'] / b:.1f}x |")
    print(f"| fork server: the loop's own work per start (begin + advances, no waiting) | {med['loop']:.2f} | "
          f"{p90['loop']:.2f} | {med['loop'] / b:.1f}x |")


def shim_cost(pid, task):
    p = psutil.Process(pid)
    members = [p] + p.children(recursive=True)
    extra = [m for m in members if m.pid != task]
    return len(extra), sum(m.memory_full_info().uss for m in extra), sum(private_dirty(m.pid) for m in extra)


def overhead(base, fs):
    rows = []
    for label, spawn in (("fork-served shim", lambda s: fs.spawn(s, sys.executable)),
                         ("shim with its own interpreter (before)", spawn_shim)):
        uss, dirty, pids = [], [], []
        for _ in range(5):
            spec = new_run(base, 4 * MiB, ["/usr/bin/yes", "0123456789abcdef"])
            h = spawn(spec)
            task = None
            while task is None:
                task = processes.read_task_pid(spec["run_dir"])
            time.sleep(0.3)                        # past the quota: the drainer is discarding
            n, u, d = shim_cost(h.pid, task)
            pids.append(n)
            uss.append(u)
            dirty.append(d)
            processes.signal_tree(task, h.pid, signal.SIGTERM, None, {})
            while processes.read_receipt(spec["run_dir"]) is None:
                time.sleep(0.005)
            if h.popen is not None:
                h.popen.wait()
            os.close(h.pidfd)
        rows.append((label, max(pids), statistics.median(uss), statistics.median(dirty)))
    (server,) = fs.pids()
    idle = psutil.Process(server).memory_full_info()
    print("\n## Per-run overhead while draining `yes` past a 4 MiB quota (median of 5)")
    print("| shim | extra PIDs | USS MiB | Private_Dirty MiB |")
    print("|---|---:|---:|---:|")
    for label, n, u, d in rows:
        print(f"| {label} | {n} | {u / MiB:.2f} | {d / MiB:.2f} |")
    print(f"| the fork server itself (shared by every run, idle) | 1 | {idle.uss / MiB:.2f} | "
          f"{private_dirty(server) / MiB:.2f} |")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=15, help="latency samples per path")
    ap.add_argument("--mib", type=int, default=128, help="MiB pushed through the drainer (0: skip)")
    ap.add_argument("--cpu-quota", type=int, default=0, help="run under this %% of one CPU (cgroup; root)")
    args = ap.parse_args()
    cg = throttle(args.cpu_quota) if args.cpu_quota else None
    base = tempfile.mkdtemp(prefix="qlagent-bench-")
    print(f"python {sys.version.split()[0]}, {os.uname().release}, {os.cpu_count()} CPUs, load "
          f"{os.getloadavg()[0]:.1f}" + (f", cgroup {cg} at {args.cpu_quota} % of one CPU" if cg else ""))
    fs = processes.ForkServer(base)
    latency(base, args.rounds, fs)
    overhead(base, fs)
    if args.mib:
        throughput(base, args.mib)


if __name__ == "__main__":
    main()
