"""Fleet Worker figures (issue 11 "Bench"), against the Worker-protocol stub over loopback TLS
(tests/fleet/stubcp.py; the real control plane replaces it in the fleet integration test):

1. RSS of ``qlagent serve`` as a Worker, idle (Session open, long-polling) and the peak while 4
   ``chatty`` runs (router task set, ~9.7 MB of output each, quota 4 MiB) execute, Worker
   process alone and its whole tree (shims + tasks); ratio to an idle LOCAL agent
   (``qlagent serve`` without ``[worker]``) measured in the same run.
2. Pull-to-exec latency: from the stub queueing a Run (the Worker already long-polling) to the
   task's first instruction (it writes ``date +%s%N``), N sequential runs, p50/p99.
3. Log upload throughput: 4 MiB of kept log from first to last chunk received by the stub, vs
   ``cat`` of the same 4 MiB file into a plain loopback TCP socket in the same run.

Run from the repository root: ``python3 bench/bench_worker.py [--runs 40]``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import psutil

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "tests", "fleet"))
from stubcp import StubControlPlane, worker_config, write_credential  # noqa: E402

MiB = 1024 * 1024
CHATTY = "/work/shared/fixtures/router-tasks/chatty.sh"


def clean_env() -> dict:
    return {k: v for k, v in os.environ.items()
            if not k.startswith(("QLAGENT_", "NOTIFY_SOCKET", "WATCHDOG_", "JOURNAL_STREAM"))}


def serve(args: list[str], err: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "qlagent.cli.main", *args, "serve"], cwd=REPO, env=clean_env(),
                            stdout=subprocess.DEVNULL, stderr=open(err, "w"))


def rss(pid: int, tree: bool = False) -> int:
    p = psutil.Process(pid)
    procs = [p, *p.children(recursive=True)] if tree else [p]
    total = 0
    for q in procs:
        try:
            total += q.memory_info().rss
        except psutil.Error:
            pass
    return total


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def cat_baseline(path: str) -> float:
    """Seconds for ``cat path > /dev/tcp/127.0.0.1/PORT`` until the sink has every byte."""
    size = os.path.getsize(path)
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    got = [0, 0.0]

    def sink():
        c, _ = srv.accept()
        while True:
            b = c.recv(1 << 16)
            if not b:
                break
            got[0] += len(b)
        got[1] = time.monotonic()
        c.close()
    t = threading.Thread(target=sink)
    t.start()
    t0 = time.monotonic()
    subprocess.run(["bash", "-c", f"cat {path} > /dev/tcp/127.0.0.1/{srv.getsockname()[1]}"], check=True)
    t.join()
    srv.close()
    assert got[0] == size
    return got[1] - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=40)
    a = ap.parse_args()
    root = tempfile.mkdtemp(prefix="bench-worker-")
    cp = StubControlPlane(root, lease_ttl_s=30, session_ttl_s=30)
    url = cp.start()
    procs = []
    try:
        # -- the local agent's idle figure, same run
        local_state = os.path.join(root, "local")
        subprocess.run([sys.executable, "-m", "qlagent.cli.main", "--state-dir", local_state, "init"], cwd=REPO,
                       env=clean_env(), check=True, capture_output=True)
        local = serve(["--state-dir", local_state], os.path.join(root, "local.err"))
        procs.append(local)
        # -- the Worker
        wid, cred = cp.enrol()
        cfg = worker_config(os.path.join(root, "w.toml"), state_dir=os.path.join(root, "w"), worker_id=wid, url=url,
                            credential_file=write_credential(os.path.join(root, "cred"), cred),
                            ca_file=cp.ca_file, slots=4, heartbeat_s=5.0, pull_wait_s=20)
        w = serve(["--config", cfg], os.path.join(root, "w.err"))
        procs.append(w)
        assert cp.wait(lambda: len(cp.sessions) == 1, 30), "the Worker opened no Session"
        time.sleep(5)
        idle_local, idle_worker = rss(local.pid), rss(w.pid)

        # -- 4 chatty runs at once
        ids = [cp.add_run(argv=["/bin/sh", CHATTY], log_quota_bytes=4 * MiB) for _ in range(4)]
        peak_w = peak_tree = 0
        end = time.monotonic() + 120
        while time.monotonic() < end:
            peak_w, peak_tree = max(peak_w, rss(w.pid)), max(peak_tree, rss(w.pid, tree=True))
            with cp.lock:
                done = all(cp.log_ends.get(x) == 4 * MiB for x in ids)
            if done:
                break
            time.sleep(0.05)
        assert done, "chatty logs incomplete"

        # -- pull-to-exec latency (the Worker is idle and long-polling)
        lat = []
        for i in range(a.runs):
            mark = os.path.join(root, f"t{i}")
            queued_ns = time.time_ns()
            aid = cp.add_run(argv=["/bin/sh", "-c", f"date +%s%N > {mark}"])
            assert cp.wait(lambda: any(k.attempt_id == aid and k.kind == "completion" for k in cp.acks), 30)
            with open(mark) as f:
                lat.append((int(f.read()) - queued_ns) / 1e6)

        # -- log upload throughput vs cat into a socket
        blob = os.path.join(root, "blob")
        with open(blob, "wb") as f:
            f.write(os.urandom(4 * MiB))
        aid = cp.add_run(argv=["/bin/cat", blob], log_quota_bytes=4 * MiB)
        assert cp.wait(lambda: cp.log_ends.get(aid) == 4 * MiB, 60)
        times = [t for t, x, _ in cp.chunk_times if x == aid]
        upload_s = times[-1] - times[0]
        n_chunks = len(times)
        cat_s = cat_baseline(blob)

        print(f"Worker RSS idle: {idle_worker / MiB:.1f} MiB; local agent idle (same run): {idle_local / MiB:.1f} MiB "
              f"({idle_worker / idle_local:.2f}x)")
        print(f"Worker RSS with 4 chatty runs: peak {peak_w / MiB:.1f} MiB ({peak_w / idle_local:.2f}x local idle); "
              f"whole tree (Worker + 4 shims + tasks) peak {peak_tree / MiB:.1f} MiB")
        print(f"pull-to-exec latency over {a.runs} runs: p50 {pct(lat, 0.5):.1f} ms, p99 {pct(lat, 0.99):.1f} ms, "
              f"max {max(lat):.1f} ms, mean {statistics.mean(lat):.1f} ms")
        mbps = 4 / upload_s if upload_s > 0 else float("inf")
        print(f"log upload: 4 MiB in {n_chunks} chunks over TLS, first→last chunk {upload_s * 1000:.1f} ms "
              f"({mbps:.1f} MiB/s); cat into a loopback socket {cat_s * 1000:.1f} ms ({4 / cat_s:.1f} MiB/s); "
              f"ratio {upload_s / cat_s:.1f}x the time of cat")
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(40)
            except subprocess.TimeoutExpired:
                p.kill()
        cp.stop()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
