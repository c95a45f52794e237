"""Bench for the fork server (issue 24 §1, §4): dispatch → task exec through the fork server
(processes.ForkServer) vs a direct interpreter start per run (spawn_shim, the path before) vs a
bare os.posix_spawn; per-run extra PIDs and USS of a fork-served shim vs a directly started one,
and the fork server's own idle USS; the drainer's throughput vs `cat` (bench_drainer.throughput).
Every figure beside its baseline measured in the same run, paths interleaved.

``--against DIR`` adds the shim of another checkout (e.g. /work/main) as a second fork server
driven by this tree's agent side (the request, ``pid`` line, spec and status protocol is the
same), so both shims are measured in the same process, round by round: on a shared, loaded box
that is the only comparison the noise leaves readable.

The start point is the agent's request to the fork server (``ForkServer.begin``: the spec's
JSON, two pipes, one sendmsg); the dispatcher pass before it (candidate page, plan, secrets,
the claim's durable commit) is bench_dispatch.py's full path.

Slow CPU: ``--cpu-quota 10`` runs the whole bench (this process and everything it starts) in a
new cgroup limited to 10 % of one core (v2 ``cpu.max``, else v1 ``cpu.cfs_quota_us``; needs
root), so the ratios are measured under throttling as well.

``--python PATH`` runs the shims (fork servers, and the interpreter per run) under another
interpreter, e.g. a 3.12+ one, whose immortal objects leave a forked shim fewer pages to copy.

Usage: python3 bench/bench_forkserver.py [--rounds 15] [--mib 128] [--drain-repeats 3] [--cpu-quota PCT]
       [--against DIR] [--python PATH]
"""

import argparse
import contextlib
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
from shimkit import compiled_shim, fork_served, spawn_shim  # noqa: E402  (the shim alone, by its own interpreter)

MiB = 1024 * 1024
PATH_ENV = {"PATH": "/usr/bin:/bin"}
PYTHON = sys.executable          # the shims' interpreter (--python)


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


@contextlib.contextmanager
def shim_of(tree):
    """This tree's ForkServer starting the shim of checkout ``tree`` (None: its own)."""
    saved = processes.SHIM_PATH, processes.SHIM_DIR
    if tree is not None:
        processes.SHIM_DIR = os.path.join(os.path.abspath(tree), "qlagent", "adapters", "shim")
        processes.SHIM_PATH = os.path.join(processes.SHIM_DIR, "main.py")
    try:
        yield
    finally:
        processes.SHIM_PATH, processes.SHIM_DIR = saved


def wait_receipt(spec, h):
    """The receipt once the shim has exited (it writes it first): a wait on its pidfd, not a
    polling loop, which would spend the CPU quota of a ``--cpu-quota`` run beside the paths."""
    if getattr(h, "popen", None) is not None:     # spawn_shim's SpawnedShim: this process's child
        h.popen.wait()
    elif h.pidfd is not None:
        select.select([h.pidfd], [], [])
    else:
        while processes.process_matches(h.pid, h.create_time):
            time.sleep(0.01)
    if h.pidfd is not None:
        os.close(h.pidfd)
    return processes.read_receipt(spec["run_dir"])


def forked(fs):
    """``run(spec)`` for bench_drainer.throughput: a start through ``fs``, then its receipt."""
    return lambda spec: wait_receipt(spec, fork_served(fs, spec, PYTHON))


def latency(base, rounds, arms):
    """Prints the dispatch → task exec table; returns {"median_ms": {path: ms}, "p90_ms": {path: ms}},
    the paths keyed as printed ("posix_spawn" the baseline)."""
    argv = DATE_ARGV
    program = compiled_shim(base, PYTHON)

    def exec_at(spawn):
        def go():
            spec = new_run(base, 4096, argv)
            t0 = time.time_ns()
            wait_receipt(spec, spawn(spec))
            with open(spec["artifact_path"]) as f:
                return int(f.read()) - t0
        return go

    def until_running(spawn):
        def go():
            spec = new_run(base, 4096, ["/bin/true"])
            t0 = time.perf_counter_ns()
            h = spawn(spec)          # returns once the start status said "ok": the Run is running
            took = time.perf_counter_ns() - t0
            wait_receipt(spec, h)
            return took
        return go

    def loop_share(fs):
        # What the agent's loop itself spends on a start: the request (begin) and each
        # advance; the waits between them are the selector's, when the loop serves others.
        def go():
            spec = new_run(base, 4096, ["/bin/true"])
            t0 = time.perf_counter_ns()
            st = fs.begin(spec, PYTHON)
            took = time.perf_counter_ns() - t0
            while True:
                select.select([st.fd] if st.fd is not None else [], [], [], 1)
                t0 = time.perf_counter_ns()
                h = fs.advance(st)
                took += time.perf_counter_ns() - t0
                if h is not None:
                    wait_receipt(spec, h)
                    return took
        return go

    paths = {"posix_spawn": via_posix_spawn}
    for label, fs in arms.items():
        spawn = (lambda f: lambda s: fork_served(f, s, PYTHON))(fs)
        paths[f"{label}: fork server → shim → task exec"] = exec_at(spawn)
        paths[f"{label}: call until `ok`"] = until_running(spawn)
        paths[f"{label}: the loop's own work per start (begin + advances, no waiting)"] = loop_share(fs)
    paths["interpreter per run (spawn_shim, before the fork server) → task exec"] = \
        exec_at(lambda s: spawn_shim(s, PYTHON, program=program))
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
    for name in list(paths)[1:]:
        print(f"| {name} | {med[name]:.2f} | {p90[name]:.2f} | {med[name] / b:.1f}x |")
    return {"median_ms": med, "p90_ms": p90}


def shim_cost(pid, task):
    p = psutil.Process(pid)
    members = [p] + p.children(recursive=True)
    extra = [m for m in members if m.pid != task]
    return len(extra), sum(m.memory_full_info().uss for m in extra), sum(private_dirty(m.pid) for m in extra)


def overhead(base, arms):
    """Prints the per-run and idle table; returns its rows: (process, extra PIDs, USS bytes,
    Private_Dirty bytes), medians of 5 runs, the fork servers' idle rows last."""
    rows = []
    spawns = [(f"{label}: fork-served shim", (lambda f: lambda s: fork_served(f, s, PYTHON))(fs))
              for label, fs in arms.items()]
    for label, spawn in spawns + [("shim with its own interpreter (before the fork server)",
                                   lambda s: spawn_shim(s, PYTHON))]:
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
            wait_receipt(spec, h)
        rows.append((label, max(pids), statistics.median(uss), statistics.median(dirty)))
    time.sleep(0.3)                                # the fork servers alone again, idle
    for label, fs in arms.items():
        (server,) = fs.pids()
        rows.append((f"{label}: the fork server itself (shared by every run, idle)", 1,
                     psutil.Process(server).memory_full_info().uss, private_dirty(server)))
    print("\n## Per-run overhead while draining `yes` past a 4 MiB quota (median of 5)")
    print("| process | extra PIDs | USS MiB | Private_Dirty MiB |")
    print("|---|---:|---:|---:|")
    for label, n, u, d in rows:
        print(f"| {label} | {n} | {u / MiB:.2f} | {d / MiB:.2f} |")
    return rows


def fork_server(base, tree=None):
    """A ForkServer (its cache under ``base``) starting the shim of checkout ``tree`` (None: the
    imported qlagent's), started and warmed by one Run of /bin/true."""
    with shim_of(tree):
        d = tempfile.mkdtemp(dir=base)
        fs = processes.ForkServer(d)
        wait_receipt(spec := new_run(d, 4096, ["/bin/true"]), fork_served(fs, spec, PYTHON))
    return fs


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=15, help="latency samples per path")
    ap.add_argument("--mib", type=int, default=128, help="MiB pushed through the drainer (0: skip)")
    ap.add_argument("--drain-repeats", type=int, default=3, help="drainer samples per path")
    ap.add_argument("--cpu-quota", type=int, default=0, help="run under this %% of one CPU (cgroup; root)")
    ap.add_argument("--against", help="another checkout whose shim is measured beside this tree's")
    ap.add_argument("--python", default=sys.executable, help="the shims' interpreter (default: this one)")
    args = ap.parse_args()
    global PYTHON
    PYTHON = args.python
    cg = throttle(args.cpu_quota) if args.cpu_quota else None
    base = tempfile.mkdtemp(prefix="qlagent-bench-")
    print(f"python {sys.version.split()[0]} (shims: {PYTHON}), {os.uname().release}, {os.cpu_count()} CPUs, load "
          f"{os.getloadavg()[0]:.1f}" + (f", cgroup {cg} at {args.cpu_quota} % of one CPU" if cg else ""))
    arms = {}
    for label, tree in (("this tree", None), (args.against, args.against)):
        if label is not None:
            arms[label] = fork_server(base, tree)
    latency(base, args.rounds, arms)
    overhead(base, arms)
    if args.mib:
        throughput(base, args.mib, args.drain_repeats, shims=[(f"{label}: fork-served shim", forked(fs)) for label, fs in arms.items()])
    print(f"\nload at the end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
