"""Flash wear of the local store (issue 22 §4): bytes written and fsyncs per Run.

Usage: ``python3 bench/bench_flash.py [--runs N] [--dir DIR] [--write bench/results/flash.md]``

``qlagent serve`` runs a Task scheduled every second (``/bin/true``; the same writes per Run as a
minute cron, 60× faster) under ``strace -f``, which records every ``write``/``pwrite64`` and
``fsync``/``fdatasync`` of the agent and its shims with the file it went to. The agent is run
twice in the same session: as this tree has it (``synchronous = FULL``) and with the one pragma
set back to ``NORMAL`` (what main had). Baseline in the same run: a bare SQLite loop with the
same settings (WAL, FULL, 4 KiB pages) committing one 200-byte row per transaction, as many
transactions as the agent commits per Run (its WAL fsyncs under FULL).

Figures are logical (what the processes hand the kernel): a flash translation layer rewrites
at least one page (typically 4–16 KiB) per fsync'd write, so fsyncs are the wear figure that
matters; ``-shm`` is memory-mapped and shows no write calls. DIR must be on a real disk, not
tmpfs (default /var/tmp).
"""

from __future__ import annotations

import argparse
import collections
import os
import platform
import re
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PER_DAY = 1440              # Runs a day of a minute cron

# `serve` with the authority's one pragma set back to NORMAL (main before issue 22).
NORMAL_WRAPPER = """
import sqlite3, sys
class C(sqlite3.Connection):
    def execute(self, sql, *a):
        return super().execute(sql.replace("synchronous = FULL", "synchronous = NORMAL"), *a)
_connect = sqlite3.connect
sqlite3.connect = lambda *a, **k: _connect(*a, factory=C, **k)
from qlagent.cli.main import main
sys.exit(main(sys.argv[1:]))
"""

LINE = re.compile(r'^\d+ +(write|pwrite64|fsync|fdatasync)\((\d+)<([^>]*)>.*\) += (\d+)')


def category(path: str) -> str:
    base = os.path.basename(path)
    for db in ("qlagent.db", "bare.db"):
        if base.startswith(db):
            return base.replace(db, "db")
    if "/artifacts/" in path:
        return "log artifact"
    if "/runs/" in path or path.endswith("/runs"):
        return "run dir"
    if os.path.isdir(path):
        return "directory"
    return "other"


def parse(trace: str) -> tuple[collections.Counter, collections.Counter]:
    """(bytes by file category, fsyncs by file category) of a ``strace -y`` file."""
    written: collections.Counter = collections.Counter()
    synced: collections.Counter = collections.Counter()
    with open(trace) as f:
        for line in f:
            m = LINE.match(line)
            if not m or m.group(3).startswith(("pipe:", "socket:", "/dev/")):
                continue
            call, path, ret = m.group(1), m.group(3), int(m.group(4))
            if call in ("write", "pwrite64"):
                written[category(path)] += ret
            else:
                synced[category(path)] += 1
    return written, synced


def measure_agent(base: str, runs: int, normal: bool) -> dict:
    state = os.path.join(base, "normal" if normal else "full")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("QLAGENT_", "NOTIFY_SOCKET", "WATCHDOG_"))}
    env["PYTHONPATH"] = REPO
    cli = [sys.executable, "-m", "qlagent.cli.main", "--state-dir", state]
    subprocess.run([*cli, "init"], check=True, capture_output=True, env=env)
    tasks = os.path.join(base, "tasks.toml")
    with open(tasks, "w") as f:
        f.write('[[task]]\nname = "tick"\nschedule = "* * * * * *"\ncommand = ["/bin/true"]\n')
    subprocess.run([*cli, "task", "add", "-f", tasks], check=True, capture_output=True, env=env)
    trace = os.path.join(base, f"trace-{'normal' if normal else 'full'}")
    serve = ([sys.executable, "-c", NORMAL_WRAPPER] if normal else [sys.executable, "-m", "qlagent.cli.main"])
    p = subprocess.Popen(["strace", "-f", "-qq", "-y", "-o", trace, "-e", "trace=write,pwrite64,fsync,fdatasync",
                          *serve, "--state-dir", state, "serve"], env=env,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    db = os.path.join(state, "qlagent.db")
    done_at = time.monotonic() + runs * 3 + 60
    # Count from the first finished Run to the (runs+1)-th: start-up writes are not per Run.
    first = None
    while time.monotonic() < done_at:
        time.sleep(0.5)
        try:
            with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as c:
                n = c.execute("SELECT count(*) FROM runs WHERE state = 'succeeded'").fetchone()[0]
        except sqlite3.Error:
            continue
        if first is None and n >= 1:
            first = (n, parse(trace))
        elif first is not None and n >= first[0] + runs:
            last = (n, parse(trace))
            break
    else:
        p.kill()
        raise SystemExit("the agent did not finish the Runs in time")
    # SIGTERM to the agent (strace's child), not to strace: the agent drains and exits, then strace.
    os.kill(int(subprocess.check_output(["pgrep", "-P", str(p.pid)]).split()[0]), 15)
    p.wait(60)
    (n0, (w0, s0)), (n1, (w1, s1)) = first, last
    done = n1 - n0
    written = {k: (w1[k] - w0[k]) / done for k in set(w1) | set(w0)}
    synced = {k: (s1[k] - s0[k]) / done for k in set(s1) | set(s0)}
    # Under FULL each commit fsyncs the WAL once (checkpoints sync the database file instead).
    return {"runs": done, "written": written, "synced": synced, "commits": round(synced.get("db-wal", 0))}


def measure_bare(base: str, commits: int) -> dict:
    """One 200-byte row per commit, WAL + FULL, traced the same way."""
    db = os.path.join(base, "bare.db")
    code = ("import sqlite3, sys\n"
            "c = sqlite3.connect(sys.argv[1], isolation_level=None)\n"
            "c.execute('PRAGMA journal_mode=WAL'); c.execute('PRAGMA synchronous=FULL')\n"
            "c.execute('CREATE TABLE t (k INTEGER PRIMARY KEY, v BLOB)')\n"
            "for i in range(int(sys.argv[2])):\n"
            "    c.execute('BEGIN IMMEDIATE'); c.execute('INSERT INTO t(v) VALUES (?)', (bytes(200),));"
            " c.execute('COMMIT')\n")
    trace = os.path.join(base, "trace-bare")
    subprocess.run(["strace", "-f", "-qq", "-y", "-o", trace, "-e", "trace=write,pwrite64,fsync,fdatasync",
                    sys.executable, "-c", code, db, str(commits)], check=True)
    w, s = parse(trace)
    return {"written": dict(w), "synced": dict(s)}


def table(name: str, r: dict, per: int) -> list[str]:
    w, s = r["written"], r["synced"]
    keys = sorted(k for k in set(w) | set(s) if w.get(k, 0) or s.get(k, 0))
    rows = [f"| {name}: {k} | {w.get(k, 0) / per:,.0f} | {s.get(k, 0) / per:.1f} |" for k in keys]
    tw, ts = sum(w.values()) / per, sum(s.values()) / per
    rows.append(f"| **{name}: total** | **{tw:,.0f}** | **{ts:.1f}** |")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--dir", default="/var/tmp")
    ap.add_argument("--write")
    a = ap.parse_args()
    if shutil.which("strace") is None:
        raise SystemExit("needs strace")
    base = tempfile.mkdtemp(prefix="qlagent-flash-", dir=a.dir)
    try:
        full = measure_agent(base, a.runs, normal=False)
        normal = measure_agent(base, a.runs, normal=True)
        bare = measure_bare(base, full["commits"] * a.runs)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    for r in (full, normal):
        r["day_bytes"] = sum(r["written"].values()) * PER_DAY
        r["day_fsyncs"] = sum(r["synced"].values()) * PER_DAY
    out = [f"# Flash writes per Run ({time.strftime('%Y-%m-%d')}, {platform.python_implementation()} "
           f"{platform.python_version()}, SQLite {sqlite3.sqlite_version}, {full['runs']} scheduled Runs of "
           f"/bin/true each; {full['commits']} store commits per Run)", "",
           "| what | bytes per Run | fsyncs per Run |", "|---|---:|---:|"]
    out += table("FULL (this tree)", full, 1)
    out += table("NORMAL (main)", normal, 1)
    out += table(f"bare SQLite loop, {full['commits']} commits", bare, a.runs)
    out += ["", f"Minute cron, per day ({PER_DAY} Runs): FULL {full['day_bytes'] / 2**20:.1f} MiB, "
                f"{full['day_fsyncs']:,.0f} fsyncs; NORMAL {normal['day_bytes'] / 2**20:.1f} MiB, "
                f"{normal['day_fsyncs']:,.0f} fsyncs."]
    text = "\n".join(out) + "\n"
    print(text)
    if a.write:
        with open(a.write, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
