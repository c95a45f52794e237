"""Where a Worker Pull's PostgreSQL CPU goes, statement by statement (issue 10 "Bench").

One puller calls ``WorkerPull.pull`` directly (no HTTP) over a pool of ONE connection, so one
PostgreSQL backend serves every statement; that backend's CPU (user + system, ``psutil``, clock
ticks of 10 ms: each figure is a sum of many samples, unbiased but ±10 % over 1,000 claims) is
read around every statement and attributed to it: the Session statement (authentication, the
Session lock, the active-Lease count), the candidate page, the claim (``queries.LEASE_CLAIM``), the rest
(BEGIN/COMMIT with its WAL flush, the pool's reset). Then the same for the baseline's bare
``SELECT … FOR UPDATE SKIP LOCKED LIMIT 1`` + ``UPDATE`` of ``bench_cluster.py``. Sessions have
``--slots`` slots each: a Pull counts its Session's active Leases, so the Session statement
grows with them.

Usage: python3 bench/bench_pull_statements.py [--claims 1000] [--slots 256]
Needs PostgreSQL at $QLAGENT_TEST_PG (default postgresql://postgres@127.0.0.1:5432/postgres).
"""

from __future__ import annotations

import argparse
import collections
import os
import secrets
import sys
import uuid

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests", "cluster"), os.path.join(ROOT, "bench")]

import psutil  # noqa: E402
import psycopg  # noqa: E402

import bench_cluster  # noqa: E402  (its queue seeding)
import pgkit  # noqa: E402
from conftest import create_database, db_url, drop_database  # noqa: E402
from qlagent.adapters.postgres.connection import autocommit, open_pool  # noqa: E402
from qlagent.adapters.postgres.migrations import migrate  # noqa: E402
from qlagent.core.cluster import PullRequest  # noqa: E402


def kind(query) -> str:
    q = query if isinstance(query, str) else str(query)
    if q.startswith("WITH a AS"):
        return "claim (LEASE_CLAIM)"
    if "credential_digest" in q:
        return "Session (PULL_SESSION)"
    if "ORDER BY" in q:
        return "candidate page"
    return "other: " + q[:40]


def pulls(kit, claims: int, slots: int, cpu) -> tuple[float, collections.Counter]:
    """(backend CPU s of ``claims`` Pulls, CPU s by statement kind)."""
    ws = [kit.worker(f"w{j}", slots=slots) for j in range(claims // slots + 2)]
    by = collections.Counter()
    execute = psycopg.Cursor.execute

    def timed(self, query, params=None, **kw):
        c0 = cpu()
        try:
            return execute(self, query, params, **kw)
        finally:
            by[kind(query)] += cpu() - c0
    pull, i, done = kit.pull(), 0, 0
    psycopg.Cursor.execute = timed
    try:
        c0 = cpu()
        while done < claims:
            w = ws[i]
            a = pull.pull(w["worker_id"], w["credential"], PullRequest(
                session_id=w["session_id"], generation=w["generation"], pull_id=str(uuid.uuid4()),
                lease_token=secrets.token_urlsafe(32)))
            if a.status == "offered":
                done += 1
            elif a.reason == "no_free_slot":
                i += 1
            else:
                raise RuntimeError(f"unexpected answer {a}")
        return cpu() - c0, by
    finally:
        psycopg.Cursor.execute = execute


def bare(conn, claims: int, cpu) -> float:
    """Backend CPU s of ``claims`` bare claims (bench_cluster.baseline's transaction)."""
    c0 = cpu()
    for _ in range(claims):
        with conn.transaction():
            row = conn.execute("SELECT run_id FROM runs WHERE state = 'queued' AND cancel_requested_at_us IS NULL"
                               " AND NOT held ORDER BY (-priority), created_at_us, latest_attempt_created_at_us,"
                               " latest_attempt_id LIMIT 1 FOR UPDATE SKIP LOCKED").fetchone()
            conn.execute("UPDATE runs SET state = 'dispatching', version = version + 1 WHERE run_id = %s", (row[0],))
    return cpu() - c0


def hot(kit) -> str:
    """HOT updates / all updates of the claim's updated tables since the last reset."""
    kit.sql("SELECT pg_stat_force_next_flush()")
    kit.one("SELECT 1")   # the statistics of the transactions so far are flushed at this one's end
    rows = kit.sql("SELECT relname, n_tup_hot_upd, n_tup_upd FROM pg_stat_user_tables"
                   " WHERE relname IN ('attempts', 'runs') ORDER BY relname")
    return ", ".join(f"{name} {h:,} / {n:,}" for name, h, n in rows)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--claims", type=int, default=1000)
    ap.add_argument("--slots", type=int, default=256)
    args = ap.parse_args()
    name = create_database(f"bench_pull_statements_{os.getpid()}")
    url = db_url(name)
    try:
        with autocommit(url) as conn:
            migrate(conn)
        pool = open_pool(url, 1)
        kit = pgkit.Kit(pool)
        bench_cluster.reset(kit, args.claims + 10)
        backend = psutil.Process(kit.one("SELECT pg_backend_pid()"))
        cpu = lambda: sum(backend.cpu_times()[:2])  # noqa: E731
        total, by = pulls(kit, args.claims, args.slots, cpu)
        per = 1e6 / args.claims
        print(f"Pull, {args.slots} slots per Session: {total * per:,.0f} µs of PostgreSQL CPU per claim")
        for k, v in by.most_common():
            print(f"  {k:<40} {v * per:>6,.0f}")
        print(f"  {'BEGIN/COMMIT, pool reset':<40} {(total - sum(by.values())) * per:>6,.0f}")
        print("  HOT updates (no index entry written) / updates: " + hot(kit))
        bench_cluster.reset(kit, args.claims + 10)
        pool.close()
        with psycopg.connect(url) as conn:
            base = psutil.Process(conn.info.backend_pid)
            spent = bare(conn, args.claims, lambda: sum(base.cpu_times()[:2]))
            print(f"baseline (SKIP LOCKED + UPDATE): {spent * per:,.0f} µs of PostgreSQL CPU per claim")
    finally:
        drop_database(name)


if __name__ == "__main__":
    main()
