"""Worker inbox cost (ADR-0021): what the durable inbox adds to pull-to-exec latency and memory.

Usage: ``python3 bench/bench_inbox.py [--offers N] [--dir DIR] [--write bench/results/inbox.md]``

- receipt + barrier: ``receive`` and ``advance(barrier)`` of one offer — the two fsync'd
  commits that sit between a Pull answer and the spawn — p50/p99 per offer;
- full lifecycle: the five commits of one offer (received … acked), offers per second;
- baseline in the same run, same directory, interleaved offer by offer: one bare ``INSERT``
  commit in WAL with ``synchronous=FULL`` (the floor of one durable commit here), p50/p99;
- peak RSS of a child that imports the inbox and opens it, against ``import sqlite3, msgspec``;
- the files' size after the run (row cap 64, as the edge Profile).

Ratios are against this run's baseline; absolute times depend on the disk's fsync.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
import uuid

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from qlagent.adapters.sqlite.inbox import FILENAME, SqliteInbox  # noqa: E402
from qlagent.core.canonical import content_digest  # noqa: E402
from qlagent.core.inbox_states import InboxOffer  # noqa: E402
from qlagent.core.profiles import EDGE  # noqa: E402


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def offer() -> InboxOffer:
    attempt = str(uuid.uuid4())
    spec = {"attemptId": attempt, "kind": "shell", "shell": "/bin/sh", "script": "echo chatty; " * 20,
            "env": {"PATH": "/usr/bin:/bin", "MODE": "bench"}, "secretRefs": {"TOKEN": "api-token"},
            "timeoutMs": 60_000, "logQuotaBytes": 4_194_304}
    return InboxOffer(offer_id=str(uuid.uuid4()), attempt_id=attempt, session_id=str(uuid.uuid4()), generation=1,
                      lease_generation=1, lease_expires_at_us=time.time_ns() // 1000 + 30_000_000,
                      lease_token=uuid.uuid4().hex + uuid.uuid4().hex, spec_digest=content_digest(spec), spec=spec)


def baseline_db(path: str) -> sqlite3.Connection:
    c = sqlite3.connect(path, isolation_level=None)
    c.execute("PRAGMA journal_mode=WAL")
    c.execute("PRAGMA synchronous=FULL")
    c.execute("CREATE TABLE t (k TEXT PRIMARY KEY, v BLOB)")
    return c


def baseline_commit(c: sqlite3.Connection) -> float:
    t0 = time.perf_counter()
    c.execute("BEGIN IMMEDIATE")
    c.execute("INSERT INTO t VALUES (?, ?)", (str(uuid.uuid4()), b"x" * 600))
    c.execute("COMMIT")
    return (time.perf_counter() - t0) * 1e6


def peak_rss_mib(code: str) -> float:
    env = dict(os.environ, PYTHONPATH=REPO)
    p = subprocess.Popen([sys.executable, "-c", code], env=env)
    _, status, usage = os.wait4(p.pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"child failed: {code}")
    return usage.ru_maxrss / 1024


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--offers", type=int, default=300)
    ap.add_argument("--dir", help="directory on the disk to measure (default: a temp dir)")
    ap.add_argument("--write", metavar="FILE", help="also write the table as Markdown")
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="qlagent-bench-inbox-", dir=args.dir)
    try:
        bdb = baseline_db(os.path.join(tmp, "baseline.sqlite3"))
        base = []
        box = SqliteInbox.for_profile(tmp, EDGE)
        offers = [offer() for _ in range(args.offers)]
        gate, full = [], []
        t_all = time.perf_counter()
        for o in offers:
            # Interleaved with the inbox so that both see the same disk and CPU load.
            base.append(baseline_commit(bdb))
            t0 = time.perf_counter()
            box.receive(o)
            box.advance(o.offer_id, "barrier")
            gate.append((time.perf_counter() - t0) * 1e6)
            box.advance(o.offer_id, "started")
            box.advance(o.offer_id, "completed", {"exitCode": 0, "bytesKept": 4096})
            box.advance(o.offer_id, "acked")
            full.append((time.perf_counter() - t0) * 1e6)
        per_s = args.offers / (time.perf_counter() - t_all - sum(base) / 1e6)
        box.close()
        bdb.close()
        size = sum(os.path.getsize(os.path.join(tmp, f)) for f in os.listdir(tmp) if f.startswith(FILENAME))
        rss_base = peak_rss_mib("import sqlite3, msgspec")
        rss_inbox = peak_rss_mib("import tempfile; from qlagent.adapters.sqlite.inbox import SqliteInbox; "
                                 "SqliteInbox(tempfile.mkdtemp() + '/i.sqlite3', max_rows=64, max_bytes=4194304)")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    b50 = statistics.median(base)
    rows = [
        ("baseline: one durable SQLite commit (WAL, FULL)", f"p50 {b50:,.0f} µs, p99 {pct(base, .99):,.0f} µs", "1.00×"),
        ("receipt + barrier (2 commits, before spawn)",
         f"p50 {statistics.median(gate):,.0f} µs, p99 {pct(gate, .99):,.0f} µs", f"{statistics.median(gate) / b50:.2f}×"),
        ("full lifecycle (5 commits)", f"p50 {statistics.median(full):,.0f} µs; {per_s:,.0f} offers/s",
         f"{statistics.median(full) / b50:.2f}×"),
        ("peak RSS: import + open the inbox", f"{rss_inbox:.1f} MiB", f"{rss_inbox / rss_base:.2f}× "
         f"(`import sqlite3, msgspec` {rss_base:.1f} MiB)"),
        (f"files after {args.offers} offers (cap 64 rows)", f"{size / 1024:,.0f} KiB", "—"),
    ]
    head = (f"Inbox bench, {time.strftime('%Y-%m-%d')}, CPython {platform.python_version()}, "
            f"{os.cpu_count()} CPUs, {args.offers} offers\n\n"
            "| measure | figure | vs baseline |\n|---|---|---|\n")
    table = head + "".join(f"| {a} | {b} | {c} |\n" for a, b, c in rows)
    print(table)
    if args.write:
        with open(args.write, "w") as f:
            f.write("# Worker inbox (ADR-0021)\n\n" + (__doc__.split("\n\n", 1)[1]) + "\n" + table)


if __name__ == "__main__":
    main()
