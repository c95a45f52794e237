"""Bench for the shim (issue 3 item 4 and bench lines): drainer throughput vs `cat`
through a FIFO, per-run overhead (extra PIDs, shim RSS/USS) of `python3 -I -S shim/main.py`
vs a POSIX sh shim, and dispatch→exec latency of the shim by its own interpreter (tests/shimkit.spawn_shim) vs a bare os.posix_spawn.
Every figure is printed with its baseline measured in the same run.

Usage: python3 bench/bench_drainer.py [--mib 256] [--rounds 15]
"""

import argparse
import json
import os
import signal
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid

import psutil

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from qlagent.adapters import processes  # noqa: E402
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
from shimkit import spawn_shim  # noqa: E402  (the shim alone, by its own interpreter)

MiB = 1024 * 1024
PATH_ENV = {"PATH": "/usr/bin:/bin"}

# The alternative measured against: the same job in POSIX sh (dash). Drains with head (quota)
# then cat (discard), so it needs extra processes and cannot count bytes_total, time the
# truncation fact, bound the linger or read the task's rusage.
SH_SHIM = r"""
rd=$1; art=$2; q=$3; shift 3
mkfifo -m 600 "$rd/output.fifo"
{ head -c "$q" >> "$art"; cat > /dev/null; } < "$rd/output.fifo" &
drain=$!
set -m
"$@" > "$rd/output.fifo" 2>&1 < /dev/null &
task=$!
echo "$task" > "$rd/task.pid"
wait "$task"; code=$?
wait "$drain"
printf '{"exit_code":%d,"bytes_kept":%d}' "$code" "$(wc -c < "$art")" > "$rd/receipt.tmp"
mv "$rd/receipt.tmp" "$rd/receipt.json"
rm -f "$rd/output.fifo"
"""


def new_run(base, quota, argv, linger=1.0):
    attempt = str(uuid.uuid4())
    run_dir = os.path.join(base, attempt)
    os.mkdir(run_dir, 0o700)
    artifact = os.path.join(base, attempt + ".log")
    os.close(os.open(artifact, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    return {"attempt_id": attempt, "argv": argv, "env": PATH_ENV, "cwd": "/", "run_dir": run_dir,
            "artifact_path": artifact, "quota_bytes": quota, "linger_s": linger}


def run_python_shim(spec):
    h = spawn_shim(spec)
    assert h.popen.wait() == 0
    os.close(h.pidfd)
    return processes.read_receipt(spec["run_dir"])


def run_sh_shim(spec):
    p = subprocess.Popen(["/bin/sh", "-c", SH_SHIM, "sh", spec["run_dir"], spec["artifact_path"],
                          str(spec["quota_bytes"]), *spec["argv"]], env=PATH_ENV, cwd="/",
                         stdin=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    assert p.wait() == 0
    with open(os.path.join(spec["run_dir"], "receipt.json")) as f:
        return json.load(f)


def timed(fn):
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def throughput(base, mib, repeats=3, shims=None):
    """Drainer vs ``cat`` through a FIFO into a file. The shim rows time the whole run (start,
    drain, the Artifact's and the receipt's fsyncs); "drain only" is the receipt's started → ended
    span (the writer ends when its last byte is in the FIFO, at most 64 KiB before the drainer),
    the figure to set beside ``cat``; "cat + fsync" is cat with the durability the shim adds.
    ``shims``: [(label, run)], ``run(spec)`` starts a shim and returns its receipt once written
    (default: one interpreter per run). Prints the table; returns {path: median seconds}."""
    shims = shims or [("python shim", run_python_shim)]
    n = mib * MiB
    src = ["/usr/bin/head", "-c", str(n), "/dev/zero"]
    fifo = os.path.join(base, "cat.fifo")
    os.mkfifo(fifo, 0o600)
    out = os.path.join(base, "cat.out")
    drains = {}

    def cat(dest, sync=False):
        def go():
            then = f'; sync "{dest}"' if sync else ""
            subprocess.run(["/bin/sh", "-c", f'head -c {n} /dev/zero > "{fifo}" & cat "{fifo}" > "{dest}"; wait{then}'],
                           check=True)
            if dest != "/dev/null":
                os.unlink(dest)
        return go

    def shim(run, quota, label):
        def go():
            spec = new_run(base, quota, src)
            r = run(spec)
            assert os.path.getsize(spec["artifact_path"]) == min(n, quota)
            if run is not run_sh_shim:
                assert r.bytes_total == n and r.bytes_kept == min(n, quota), r
                drains.setdefault(label, []).append((r.ended_at_us - r.started_at_us) / 1e6)
            os.unlink(spec["artifact_path"])
        return go

    paths = [("cat through a FIFO to a file (baseline)", cat(out)),
             ("cat through a FIFO to a file, then fsync (`sync FILE`)", cat(out, sync=True)),
             ("cat through a FIFO to /dev/null", cat("/dev/null"))]
    for name, run in shims:
        for quota, what in ((n + MiB, "quota > output (all kept)"), (4 * MiB, "edge quota 4 MiB (rest dropped)")):
            label = f"{name}, {what}"
            paths.append((label, shim(run, quota, label)))
    paths += [("sh shim, quota > output", shim(run_sh_shim, n + MiB, None)),
              ("sh shim, quota 4 MiB", shim(run_sh_shim, 4 * MiB, None))]
    times = {label: [] for label, _ in paths}
    for _ in range(repeats):  # interleaved: page cache and writeback hit every path alike
        for label, fn in paths:
            times[label].append(timed(fn))
    med = {label: statistics.median(v) for label, v in times.items()}
    for label, v in drains.items():
        med[f"{label}: drain only"] = statistics.median(v)
    base_s = med[paths[0][0]]
    print(f"\n## Drainer throughput: {mib} MiB of output (median of {repeats}, interleaved)")
    print("| path | seconds | MiB/s | time vs cat-to-file | throughput vs cat-to-file |")
    print("|---|---:|---:|---:|---:|")
    for label, s_ in med.items():
        print(f"| {label} | {s_:.3f} | {mib / s_:.0f} | {s_ / base_s:.2f}x | {base_s / s_:.2f}x |")
    return med


def sample_overhead(base, runner_cmd, label, argv=("/usr/bin/yes", "0123456789abcdef")):
    """Start a shim around an endless producer, sample its session while it drains."""
    spec = new_run(base, 4 * MiB, list(argv))
    if runner_cmd == "python":
        h = spawn_shim(spec)
        root = h.pid
    else:
        p = subprocess.Popen(["/bin/sh", "-c", SH_SHIM, "sh", spec["run_dir"], spec["artifact_path"],
                              str(spec["quota_bytes"]), *spec["argv"]], env=PATH_ENV, cwd="/",
                             stdin=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        root = p.pid
    deadline = time.monotonic() + 10
    while not os.path.exists(os.path.join(spec["run_dir"], "task.pid")) and time.monotonic() < deadline:
        time.sleep(0.005)
    task = int(open(os.path.join(spec["run_dir"], "task.pid")).read())
    time.sleep(0.5)  # steady state: the quota is reached and the drainer is discarding
    peak_extra = peak_rss = peak_uss = peak_dirty = 0
    for _ in range(20):
        wr = psutil.Process(root)
        members = [wr] + wr.children(recursive=True)
        extra = [m for m in members if m.pid != task]
        rss = sum(m.memory_info().rss for m in extra)
        uss = sum(m.memory_full_info().uss for m in extra)
        dirty = sum(private_dirty(m.pid) for m in extra)
        peak_extra = max(peak_extra, len(extra))
        peak_rss, peak_uss, peak_dirty = max(peak_rss, rss), max(peak_uss, uss), max(peak_dirty, dirty)
        time.sleep(0.02)
    processes.signal_tree(task, root, signal.SIGTERM, None, {})
    if runner_cmd == "python":
        h.popen.wait()
        os.close(h.pidfd)
    else:
        p.wait()
    return label, peak_extra, peak_rss, peak_uss, peak_dirty


def private_dirty(pid):
    """Private_Dirty bytes (anonymous memory the process alone pays for) from smaps_rollup."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Private_Dirty:"):
                    return int(line.split()[1]) * 1024
    except FileNotFoundError:
        pass
    return 0


def overhead(base):
    rows = [sample_overhead(base, "python", "python3 -I -S shim/main.py (shim + drainer in one)"),
            sample_overhead(base, "python", "python shim, endless line without newline (F8)",
                            ("/bin/sh", "-c", "exec tr '\\0' x < /dev/zero")),
            sample_overhead(base, "sh", "POSIX sh shim (dash + drain subshell + head/cat)")]
    print("\n## Per-run overhead while draining past a 4 MiB quota (`yes` unless noted)")
    print("| shim | extra PIDs | RSS MiB | USS MiB | Private_Dirty MiB |")
    print("|---|---:|---:|---:|---:|")
    for label, extra, rss, uss, dirty in rows:
        print(f"| {label} | {extra} | {rss / MiB:.1f} | {uss / MiB:.1f} | {dirty / MiB:.1f} |")


DATE_ARGV = ["/bin/date", "+%s%N"]


def via_posix_spawn() -> int:
    """ns from a bare posix_spawn of ``date +%s%N`` to the clock it prints (the baseline)."""
    r, w = os.pipe()
    t0 = time.time_ns()
    pid = os.posix_spawn(DATE_ARGV[0], DATE_ARGV, PATH_ENV, file_actions=[(os.POSIX_SPAWN_DUP2, w, 1)])
    os.close(w)
    out = os.read(r, 64)
    os.close(r)
    os.waitpid(pid, 0)
    return int(out) - t0


def latency(base, rounds):
    """dispatch→exec: from the call to the moment the task prints its clock (date +%s%N)."""
    argv = DATE_ARGV

    def via_shim():
        spec = new_run(base, 4096, argv)
        t0 = time.time_ns()
        run_python_shim(spec)
        with open(spec["artifact_path"]) as f:
            return int(f.read()) - t0

    def via_sh():
        spec = new_run(base, 4096, argv)
        t0 = time.time_ns()
        run_sh_shim(spec)
        with open(spec["artifact_path"]) as f:
            return int(f.read()) - t0

    def true_round_trip():
        t0 = time.perf_counter_ns()
        os.waitpid(os.posix_spawn("/bin/true", ["/bin/true"], {}), 0)
        return time.perf_counter_ns() - t0

    def shim_true_round_trip():
        spec = new_run(base, 4096, ["/bin/true"])
        t0 = time.perf_counter_ns()
        run_python_shim(spec)
        return time.perf_counter_ns() - t0

    def python_pass():
        t0 = time.perf_counter_ns()
        subprocess.run([sys.executable, "-I", "-S", "-c", "pass"], env={}, check=True)
        return time.perf_counter_ns() - t0

    paths = {"posix_spawn": via_posix_spawn, "shim": via_shim, "sh": via_sh,
             "true": true_round_trip, "shim_true": shim_true_round_trip, "pass": python_pass}
    samples = {name: [] for name in paths}
    for name, fn in paths.items():
        fn()  # warm caches
    for _ in range(rounds):  # round-robin so machine noise hits every path alike
        for name, fn in paths.items():
            samples[name].append(fn())
    med = {name: statistics.median(v) / 1e6 for name, v in samples.items()}
    print(f"\n## Dispatch→exec latency (median of {rounds}, interleaved, ms)")
    print("| path | ms | vs bare posix_spawn |")
    print("|---|---:|---:|")
    print(f"| bare os.posix_spawn of `date +%s%N` (baseline) | {med['posix_spawn']:.2f} | 1.00x |")
    print(f"| spawn_shim (python -I -S) → task exec | {med['shim']:.2f} | "
          f"{med['shim'] / med['posix_spawn']:.1f}x |")
    print(f"| sh shim → task exec | {med['sh']:.2f} | {med['sh'] / med['posix_spawn']:.1f}x |")
    print(f"| bare posix_spawn+wait of /bin/true (baseline) | {med['true']:.2f} | 1.00x |")
    print(f"| spawn_shim of /bin/true until receipt (fsyncs included) | {med['shim_true']:.2f} | "
          f"{med['shim_true'] / med['true']:.1f}x |")
    print(f"| reference: `python3 -I -S -c pass` start+exit | {med['pass']:.2f} | "
          f"{med['pass'] / med['true']:.1f}x |")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=256, help="MiB pushed through the drainer")
    ap.add_argument("--rounds", type=int, default=15, help="latency samples per path")
    args = ap.parse_args()
    base = tempfile.mkdtemp(prefix="qlagent-bench-")
    try:
        print(f"python {sys.version.split()[0]}, {os.uname().release}, {os.cpu_count()} CPUs, "
              f"tmp on {base}")
        throughput(base, args.mib)
        overhead(base)
        latency(base, args.rounds)
    finally:
        shutil.rmtree(base)


if __name__ == "__main__":
    main()
