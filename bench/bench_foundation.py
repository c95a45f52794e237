"""Foundation footprint: peak RSS (and wall time) of importing each core module and of the CLI's
``task ls`` over 1,000 tasks, against ``python -c pass`` measured in the same run.

Usage: ``python3 bench/bench_foundation.py [--runs N] [--write bench/results/foundation.md]``

Peak RSS is the child's ``ru_maxrss`` from ``os.wait4`` (KiB on Linux, printed as MiB); each
figure is the median of N runs. Ratios are against the baseline of this run, so figures from
different machines stay comparable. Prints one table; ``--write`` also stores it as Markdown.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CORE = os.path.join(REPO, "qlagent", "core")


def measure(argv: list[str], runs: int, env: dict | None = None) -> tuple[float, float]:
    """Median (peak RSS MiB, wall ms) of ``argv`` over ``runs`` runs; the command must exit 0."""
    rss, wall = [], []
    for _ in range(runs):
        t0 = time.perf_counter()
        p = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env, cwd=REPO)
        _, status, usage = os.wait4(p.pid, 0)
        wall.append((time.perf_counter() - t0) * 1000)
        p.returncode = os.waitstatus_to_exitcode(status)
        err = p.stderr.read()
        p.stderr.close()
        if p.returncode != 0:
            raise SystemExit(f"{argv} failed ({p.returncode}): {err.decode(errors='replace')}")
        rss.append(usage.ru_maxrss / 1024)
    return statistics.median(rss), statistics.median(wall)


def core_modules() -> list[str]:
    return sorted(f"qlagent.core.{f[:-3]}" for f in os.listdir(CORE) if f.endswith(".py") and f != "__init__.py")


def task_file(n: int) -> str:
    parts = []
    for i in range(n):
        sched = ("*/5 * * * *", "0 3 * * *", "@once", "30 */2 * * 1-5")[i % 4]
        parts.append(f'[[task]]\nname = "task-{i:04d}"\nschedule = "{sched}"\n'
                     f'command = ["/bin/echo", "{i}"]\nenv = {{ N = "{i}" }}\n')
    return "".join(parts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--tasks", type=int, default=1000)
    ap.add_argument("--write", metavar="FILE", help="also write the table as Markdown")
    args = ap.parse_args()
    py = sys.executable
    env = {k: v for k, v in os.environ.items() if not k.startswith("QLAGENT_")}
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")

    rows: list[tuple[str, float, float]] = []
    base_rss, base_ms = measure([py, "-c", "pass"], args.runs, env)
    rows.append(("python -c pass (baseline)", base_rss, base_ms))
    mods = core_modules()
    for m in mods:
        rows.append((f"import {m}", *measure([py, "-c", f"import {m}"], args.runs, env)))
    rows.append(("import all core modules", *measure([py, "-c", "import " + ", ".join(mods)], args.runs, env)))

    tmp = tempfile.mkdtemp(prefix="qlagent-bench-")
    try:
        state = os.path.join(tmp, "state")
        cli = [py, "-m", "qlagent.cli.main", "--state-dir", state]
        subprocess.run(cli + ["init"], check=True, stdout=subprocess.DEVNULL, env=env, cwd=REPO)
        tf = os.path.join(tmp, "tasks.toml")
        with open(tf, "w") as f:
            f.write(task_file(args.tasks))
        rows.append((f"qlagent task add -f ({args.tasks} tasks; 1 run)", *measure(cli + ["task", "add", "-f", tf], 1, env)))
        rows.append((f"qlagent task ls ({args.tasks} tasks)", *measure(cli + ["task", "ls"], args.runs, env)))
        rows.append((f"qlagent task ls --json ({args.tasks} tasks)",
                     *measure(cli + ["task", "ls", "--json"], args.runs, env)))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    lines = [f"Python {platform.python_version()} on {platform.machine()}, {os.cpu_count()} CPUs; "
             f"median of {args.runs} runs; one process per command (no children; the CLI adds one store thread).", "",
             "| command | peak RSS MiB | RSS ratio | wall ms | time ratio |", "|---|---:|---:|---:|---:|"]
    for name, rss, ms in rows:
        lines.append(f"| `{name}` | {rss:.1f} | {rss / base_rss:.2f} | {ms:.0f} | {ms / base_ms:.2f} |")
    table = "\n".join(lines)
    print(table)
    if args.write:
        with open(args.write, "w") as f:
            f.write("# Foundation footprint (bench/bench_foundation.py)\n\n"
                    "Peak RSS of a fresh interpreter importing each `qlagent.core` module, and of the CLI's\n"
                    "`task ls` over a store of 1,000 tasks, against `python -c pass` measured in the same run.\n"
                    "Regenerate: `python3 bench/bench_foundation.py --write bench/results/foundation.md`.\n\n"
                    + table + "\n")


if __name__ == "__main__":
    main()
