"""Fleet Worker figures (issue 11 "Bench"), against the Worker-protocol stub over loopback TLS
(tests/fleet/stubcp.py; the real control plane replaces it in the fleet integration test):

1. RSS of ``qlagent serve`` as a Worker, idle (Session open, long-polling over TLS, inbox open)
   and the peak while 4 ``chatty`` runs (router task set, ~9.7 MB of output each, quota 4 MiB)
   execute, Worker process alone and its whole tree (shims + tasks); ratio to an idle LOCAL agent
   (``qlagent serve`` without ``[worker]``) measured in the same run. With cgroup v1 (root, the
   machine's cgroup2 lacks the memory/pids controllers) the Worker runs in its own edge cgroup
   (128 MiB / 64 PIDs, tests/fleet/harness.py ``Cgroup``): the cgroup's peak memory (page cache
   included) and PIDs (``pids.current`` sampled), OOM kills and refused forks. A second Worker with
   ``[http] listen`` (the read-only status surface, polled during the runs) gives the surface's
   RSS cost in the same run. Two of the chatty runs use ``on_lease_loss = "kill"`` (the shim
   watches its lease file), two ``"keep"`` (no lease file): shim USS of each kind, same run.
2. Pull-to-exec latency: from the stub queueing a Run (the Worker already long-polling) to the
   task's first instruction (it writes ``date +%s%N``), N sequential runs, p50/p99.
3. Log upload throughput: 4 MiB of kept log from first to last chunk received by the stub, vs
   ``cat`` of the same 4 MiB file into a plain loopback TCP socket in the same run.

4. With ``--shim-base REF``: USS/RSS of the shim of this tree (with and without a lease file)
   against the shim of git REF, each compiled as the agent does and run alone with a 1 s task,
   interleaved, median of 7.

Run from the repository root: ``python3 bench/bench_worker.py [--runs 40] [--shim-base main]``.
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
from harness import Cgroup, cgroup_v1_available, free_port, spawn_in  # noqa: E402
from stubcp import StubControlPlane, worker_config, write_credential  # noqa: E402

MiB = 1024 * 1024
CHATTY = "/work/shared/fixtures/router-tasks/chatty.sh"


def clean_env() -> dict:
    return {k: v for k, v in os.environ.items()
            if not k.startswith(("QLAGENT_", "NOTIFY_SOCKET", "WATCHDOG_", "JOURNAL_STREAM"))}


def serve(args: list[str], err: str, cgroup: Cgroup | None = None) -> subprocess.Popen:
    return spawn_in([sys.executable, "-m", "qlagent.cli.main", *args, "serve"], cgroup=cgroup, cwd=REPO,
                    env=clean_env(), stdout=subprocess.DEVNULL, stderr=open(err, "w"))


def shim_uss(pid: int) -> dict[int, int]:
    """USS (bytes) of each live shim below ``pid``, by the shim's PID."""
    out = {}
    for q in psutil.Process(pid).children(recursive=True):
        try:
            cmd = q.cmdline()
            if len(cmd) >= 4 and ".shim-" in cmd[-1]:
                out[q.pid] = q.memory_full_info().uss
        except psutil.Error:
            pass
    return out


def lease_shims(pid: int, runs_dir: str) -> set[int]:
    """The shims below ``pid`` whose run directory under ``runs_dir`` holds a lease file
    (``on_lease_loss = "kill"``)."""
    found = set()
    for q in psutil.Process(pid).children(recursive=True):
        try:
            if ".shim-" in q.cmdline()[-1]:
                for c in q.children():
                    env = c.environ()
                    aid = env.get("QL3_ATTEMPT_ID")
                    if aid and os.path.exists(os.path.join(runs_dir, aid, "lease")):
                        found.add(q.pid)
        except (psutil.Error, IndexError):
            pass
    return found



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


def pids_current(cg: Cgroup | None) -> int | None:
    """Tasks (threads included) in the cgroup now, as ``pids.max`` counts them."""
    return None if cg is None else int(cg._read(cg.pids, "pids.current"))


def http_get(port: int, path: str) -> dict:
    import http.client
    import json
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        c.request("GET", path)
        r = c.getresponse()
        assert r.status == 200, r.status
        return json.loads(r.read())
    finally:
        c.close()


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


def shim_ab(base_ref: str, samples: int = 7) -> None:
    """Figure 4 (module docstring)."""
    import json
    root = tempfile.mkdtemp(prefix="bench-shim-")

    def compiled(source: str, name: str) -> str:
        src, dest = os.path.join(root, name + ".py"), os.path.join(root, name + ".pyc")
        with open(src, "w") as f:
            f.write(source)
        subprocess.run([sys.executable, "-I", "-S", src, "--compile", dest], check=True)
        return dest

    with open(os.path.join(REPO, "qlagent", "adapters", "shim", "main.py")) as f:
        this = compiled(f.read(), "this")
    base = compiled(subprocess.run(["git", "show", f"{base_ref}:qlagent/adapters/shim/main.py"], cwd=REPO,
                                   capture_output=True, text=True, check=True).stdout, "base")

    def one(program: str, lease: bool) -> tuple[int, int]:
        d = tempfile.mkdtemp(dir=root)
        art = os.path.join(d, "out")
        open(art, "w").close()
        spec = {"attempt_id": "a", "argv": ["/bin/sleep", "1"], "env": {}, "cwd": "/", "run_dir": d,
                "artifact_path": art, "quota_bytes": 1000, "linger_s": 0}
        if lease:
            spec["lease_file"] = os.path.join(d, "lease")
            with open(spec["lease_file"], "w") as f:
                f.write(str(time.monotonic_ns() // 1000 + 60_000_000))
        p = subprocess.Popen([sys.executable, "-I", "-S", program], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             start_new_session=True)
        p.stdin.write(json.dumps(spec).encode())
        p.stdin.close()
        p.stdout.readline()                 # "ok": the task was exec'd
        time.sleep(0.4)
        m = psutil.Process(p.pid).memory_full_info()
        p.wait()
        return m.uss, m.rss

    got: dict[str, list[tuple[int, int]]] = {f"{base_ref}": [], "this tree": [], "this tree + lease file": []}
    for _ in range(samples):
        got[base_ref].append(one(base, False))
        got["this tree"].append(one(this, False))
        got["this tree + lease file"].append(one(this, True))
    for k, v in got.items():
        print(f"shim {k}: USS {statistics.median(x[0] for x in v) / MiB:.3f} MiB, "
              f"RSS {statistics.median(x[1] for x in v) / MiB:.3f} MiB (median of {samples})")
    shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=40)
    ap.add_argument("--shim-base", help="git ref whose shim is measured against this tree's")
    a = ap.parse_args()
    if a.shim_base:
        shim_ab(a.shim_base)
    root = tempfile.mkdtemp(prefix="bench-worker-")
    cp = StubControlPlane(root, lease_ttl_s=30, session_ttl_s=30)
    url = cp.start()
    procs = []
    cgroups: list[Cgroup | None] = []
    try:
        # -- the local agent's idle figure, same run
        local_state = os.path.join(root, "local")
        subprocess.run([sys.executable, "-m", "qlagent.cli.main", "--state-dir", local_state, "init"], cwd=REPO,
                       env=clean_env(), check=True, capture_output=True)
        local = serve(["--state-dir", local_state], os.path.join(root, "local.err"))
        procs.append(local)
        # -- the Worker (in the edge cgroup when cgroup v1 is there) and one with the HTTP status surface
        cg = Cgroup(f"workerfx-bench-{os.getpid()}").create() if cgroup_v1_available() else None
        cgroups.append(cg)
        hid, hcred = cp.enrol()
        port = free_port()
        hcfg = worker_config(os.path.join(root, "h.toml"), state_dir=os.path.join(root, "h"), worker_id=hid, url=url,
                             credential_file=write_credential(os.path.join(root, "hcred"), hcred),
                             ca_file=cp.ca_file, slots=1, heartbeat_s=5.0, pull_wait_s=20,
                             extra=f'\n[http]\nlisten = "127.0.0.1:{port}"')
        h = serve(["--config", hcfg], os.path.join(root, "h.err"))
        procs.append(h)
        # It takes one endless run first, so every later run goes to the Worker measured below.
        assert cp.wait(lambda: len(cp.sessions) == 1, 30), "the HTTP Worker opened no Session"
        cp.add_run(argv=["/bin/sleep", "600"])
        assert cp.wait(lambda: sum(1 for x in cp.attempts.values() if x["state"] == "running") == 1, 30)
        wid, cred = cp.enrol()
        cfg = worker_config(os.path.join(root, "w.toml"), state_dir=os.path.join(root, "w"), worker_id=wid, url=url,
                            credential_file=write_credential(os.path.join(root, "cred"), cred),
                            ca_file=cp.ca_file, slots=4, heartbeat_s=5.0, pull_wait_s=20)
        w = serve(["--config", cfg], os.path.join(root, "w.err"), cg)
        procs.append(w)
        assert cp.wait(lambda: len(cp.sessions) == 2, 30), "the Workers opened no Session"
        status_body = http_get(port, "/api/v3/worker")
        time.sleep(5)
        idle_local, idle_worker, idle_http = rss(local.pid), rss(w.pid), rss(h.pid)
        idle_pids = pids_current(cg)

        # -- 4 chatty runs at once, all on the Worker in the cgroup (the other one is busy with its sleep)
        ids = [cp.add_run(argv=["/bin/sh", CHATTY], log_quota_bytes=4 * MiB, on_lease_loss=pol)
               for pol in ("kill", "kill", "keep", "keep")]
        peak_w = peak_tree = peak_pids = peak_http = 0
        uss_kill: list[int] = []
        uss_keep: list[int] = []
        end = time.monotonic() + 120
        while time.monotonic() < end:
            peak_w, peak_tree = max(peak_w, rss(w.pid)), max(peak_tree, rss(w.pid, tree=True))
            peak_pids = max(peak_pids, pids_current(cg) or 0)
            http_get(port, "/api/v3/worker")
            peak_http = max(peak_http, rss(h.pid))
            killers = lease_shims(w.pid, os.path.join(root, "w", "worker-runs"))
            for spid, uss in shim_uss(w.pid).items():
                (uss_kill if spid in killers else uss_keep).append(uss)
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
        print(f"Worker with [http] status surface, idle: {idle_http / MiB:.1f} MiB "
              f"(+{(idle_http - idle_worker) / MiB:.1f} MiB); polled during the runs, peak {peak_http / MiB:.1f} MiB; "
              f"status keys {sorted(status_body)}")
        print(f"Worker RSS with 4 chatty runs: peak {peak_w / MiB:.1f} MiB ({peak_w / idle_local:.2f}x local idle); "
              f"whole tree (Worker + 4 shims + tasks) peak {peak_tree / MiB:.1f} MiB")
        if uss_kill and uss_keep:
            print(f"shim USS with a lease file (kill): max {max(uss_kill) / MiB:.2f} MiB, median "
                  f"{statistics.median(uss_kill) / MiB:.2f}; without (keep): max {max(uss_keep) / MiB:.2f}, median "
                  f"{statistics.median(uss_keep) / MiB:.2f} ({len(uss_kill)}/{len(uss_keep)} samples)")
        if cg is not None:
            print(f"edge cgroup (128 MiB / 64 PIDs): PIDs idle {idle_pids}, peak {peak_pids}; peak memory "
                  f"{cg.peak_memory_bytes() / MiB:.1f} MiB (page cache included); OOM kills {cg.oom_kills()}, "
                  f"refused forks {cg.fork_failures()}")
        else:
            print("no cgroup v1 memory/pids here (needs root): cgroup figures not measured")
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
        for cg in cgroups:
            if cg is not None:
                cg.close()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
