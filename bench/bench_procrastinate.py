"""procrastinate, the side-by-side anchor of ``bench_cluster.py`` (issue 25 §4): a Python peer
that writes a row per job on the same PostgreSQL server, measured in the same run.

* defer: ``clients`` threads, each deferring no-op jobs one by one (one transaction each, its
  own pooled connection) for ``seconds``: jobs/s;
* fetch+finish: ``workers`` worker processes (``run_worker(concurrency=1, wait=False)``) drain
  the deferred jobs: jobs/s from the first job started to the last one done (the events' times).

Runs in its own venv (procrastinate is no dependency of qlagent): ``bench_cluster.py
--procrastinate-python .bench-venv/bin/python`` starts it; alone:

    .bench-venv/bin/python bench/bench_procrastinate.py URL [--seconds 3] [--clients 4] [--workers 4]

Prints one JSON line: {"defer_per_s", "deferred", "done_per_s", "done", "version"}.
"""

from __future__ import annotations

import argparse
import json
import logging
import subprocess
import sys
import threading
import time

import procrastinate

QUEUE = "bench"


def make_app(url: str) -> procrastinate.App:
    app = procrastinate.App(connector=procrastinate.PsycopgConnector(conninfo=url, min_size=1, max_size=8))

    @app.task(name="noop", queue=QUEUE)
    def noop() -> None:
        return None
    return app


def work(url: str) -> None:
    """Child: one worker process, one job at a time, until the queue is empty."""
    logging.getLogger("procrastinate").setLevel(logging.ERROR)     # not its top-level-app advice
    make_app(url).run_worker(queues=[QUEUE], concurrency=1, wait=False, install_signal_handlers=False,
                             listen_notify=False, delete_jobs="never")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("url")
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--work", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.work:
        work(args.url)
        return
    logging.getLogger("procrastinate").setLevel(logging.ERROR)
    app = make_app(args.url)
    with app.open():
        app.schema_manager.apply_schema()
        task = app.tasks["noop"]
        counts = [0] * args.clients
        stop = time.monotonic() + args.seconds

        def defer(i: int) -> None:
            while time.monotonic() < stop:
                task.defer()
                counts[i] += 1
        threads = [threading.Thread(target=defer, args=(i,)) for i in range(args.clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    deferred = sum(counts)
    procs = [subprocess.Popen([sys.executable, __file__, args.url, "--work"]) for _ in range(args.workers)]
    for p in procs:
        p.wait()
    import psycopg
    with psycopg.connect(args.url) as conn:
        done = conn.execute("SELECT count(*) FROM procrastinate_jobs WHERE status = 'succeeded'").fetchone()[0]
        # From the first job started to the last one finished: the workers' start-up is not timed.
        took = conn.execute("SELECT extract(epoch FROM max(at) FILTER (WHERE type = 'succeeded')"
                            " - min(at) FILTER (WHERE type = 'started')) FROM procrastinate_events").fetchone()[0]
        took = float(took)
    print(json.dumps({"defer_per_s": deferred / args.seconds, "deferred": deferred, "done_per_s": done / took,
                      "done": done, "version": procrastinate.__version__}))


if __name__ == "__main__":
    main()
