"""Fleet Worker figures (issue 11 "Bench"); 1–3 against the Worker-protocol stub over loopback
TLS (tests/fleet/stubcp.py), 5 against the real control plane on PostgreSQL:

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

5. With ``--control-plane real`` (instead of 1–3): pull-to-exec against the REAL control plane
   on loopback: ``qlagent serve`` with ``[cluster]`` (TLS from a throwaway openssl CA) on a fresh
   PostgreSQL database (127.0.0.1:5432, created and dropped here) and one Worker (``qlagent
   serve`` with ``[worker]``, credential from ``qlagent workers enroll``) long-polling; the
   helpers of tests/cluster/test_cluster_e2e.py start them. N sequential runs (after a warm-up,
   0.2 s apart so the Worker is back in its long poll), in ms, p50/p99/max: from sending the HTTP
   Task Start (new mutationId, keep-alive HTTPS) to the task's first instruction (``date
   +%s%N``). Baseline, same runs: Task Start sent → the Run's Attempt leased
   (``run_leases.claimed_at_us``, database clock, same host), i.e. the control plane's share
   (Task Start transaction, NOTIFY wake, the parked Pull's claim); total / baseline is what the
   Worker adds once its Pull holds the Run (answer over TLS, inbox commits, ACK ``starting``,
   shim start; the ``run.starting`` event's time splits it). Also a bare fork+exec of the same
   ``/bin/sh -c 'date +%s%N > file'``, interleaved: the floor of the Worker's share. RSS of the
   Worker and of the replica, the Worker tree's PIDs idle and during a run, the load average.

Run from the repository root: ``python3 bench/bench_worker.py [--runs 40] [--shim-base main]
[--control-plane real]``.
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
# This tree, its test helpers (tests/kit.py) and the Worker-protocol stub, in that order.
sys.path[:0] = [REPO, os.path.join(REPO, "tests"), os.path.join(REPO, "tests", "fleet")]
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

    def compiled(shim_dir: str, name: str) -> str:
        dest = os.path.join(root, name + ".pyc")
        subprocess.run([sys.executable, "-I", "-S", os.path.join(shim_dir, "main.py"), "--compile", dest], check=True)
        return dest

    this = compiled(os.path.join(REPO, "qlagent", "adapters", "shim"), "this")
    # The base's whole shim directory: main.py compiles its sibling modules with it.
    archive = subprocess.run(["git", "archive", base_ref, "qlagent/adapters/shim"], cwd=REPO,
                             capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", root], input=archive, check=True)
    base = compiled(os.path.join(root, "qlagent", "adapters", "shim"), "base")

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


def real_control_plane(runs: int) -> None:
    """Figure 5 (module docstring)."""
    import http.client
    import json
    import ssl
    import uuid
    import psycopg
    sys.path.insert(0, os.path.join(REPO, "tests", "cluster"))
    from conftest import create_database, db_url, drop_database
    from cpkit import make_ca
    from test_cluster_e2e import BASE, start_replica, start_worker

    load0 = os.getloadavg()
    name = create_database("bench_worker")          # qlt_<branch>_<pid>_bench_worker
    url = db_url(name)
    root = tempfile.mkdtemp(prefix="bench-worker-real-")
    mark, bare = os.path.join(root, "mark"), os.path.join(root, "bare")
    tasks = (f'[[task]]\nname = "mark"\nshell = "/bin/sh"\nscript = "date +%s%N > {mark}"\n'
             '[[task]]\nname = "hold"\nshell = "/bin/sh"\nscript = "sleep 2"\n')
    ca, cert, key = make_ca(root, "cp")
    plane = {"root": root, "port": free_port(), "workers": []}
    replica = None
    try:
        plane["cp"], replica = start_replica(root, f'[cluster]\ndatabase = "{url}"\npool_size = 6\n'
                                                   f'tls_cert = "{cert}"\ntls_key = "{key}"\n', tasks, plane["port"])
        replica.wait_line("service.ready")
        worker, _ = start_worker(plane, "bench-1", ca)
        worker.wait_line("worker.ready")
        token = plane["cp"].ok("token", "create", "--subject", "bench", "--role", "operator").strip()
        api = http.client.HTTPSConnection("127.0.0.1", plane["port"], timeout=30,
                                          context=ssl.create_default_context(cafile=ca))
        db = psycopg.connect(url, autocommit=True)

        def call(method: str, path: str, body: bytes | None = None) -> tuple[int, dict]:
            api.request(method, path, body=body, headers={"Authorization": f"Bearer {token}",
                                                          "Content-Type": "application/json"})
            r = api.getresponse()
            return r.status, json.loads(r.read())

        def stamp(path: str) -> int:
            """The ns written by ``date +%s%N`` into ``path`` (waits for the whole line)."""
            end = time.monotonic() + 30
            while time.monotonic() < end:
                try:
                    with open(path) as f:
                        text = f.read()
                    if text.endswith("\n"):
                        return int(text)
                except FileNotFoundError:
                    pass
                time.sleep(0.005)
            raise AssertionError(f"no mark in 30 s; Worker: {worker.lines[-5:]}")

        heads = {t: call("GET", f"{BASE}/tasks/{t}")[1] for t in ("mark", "hold")}

        def start(task: str) -> tuple[int, int, str]:
            """(ns before sending, ns at the 202, runId) of one Task Start."""
            head = heads[task]
            body = json.dumps({"schema": "qinglong/task-start@v1", "mutationId": str(uuid.uuid4()),
                               "expectedRevision": head["revision"],
                               "expectedContentDigest": head["contentDigest"]}).encode()
            if api.sock is None:
                api.connect()                           # no TLS handshake inside the measured span
            t0 = time.time_ns()
            status, doc = call("POST", f"{BASE}/tasks/{task}/runs", body)
            assert status == 202, doc
            return t0, time.time_ns(), doc["runId"]

        def ended(run_id: str) -> None:
            end = time.monotonic() + 30
            while db.execute("SELECT state FROM runs WHERE run_id = %s", (run_id,)).fetchone()[0] != "succeeded":
                assert time.monotonic() < end, f"run {run_id} did not succeed"
                time.sleep(0.01)

        wp, rp = psutil.Process(worker.proc.pid), psutil.Process(replica.proc.pid)
        total, cp_part, worker_part, to_starting, answered, floor = [], [], [], [], [], []
        rss_w = rss_r = 0
        for i in range(runs + 1):
            for f in (mark, bare):
                if os.path.exists(f):
                    os.unlink(f)
            time.sleep(0.2)                             # the Worker is back in its long poll
            t0, t202, run_id = start("mark")
            exec_ns = stamp(mark)
            ended(run_id)
            claimed_us, starting_us = db.execute(
                "SELECT l.claimed_at_us, e.created_at_us FROM run_leases l JOIN run_events e ON e.run_id = l.run_id"
                " AND e.type = 'run.starting' WHERE l.run_id = %s", (run_id,)).fetchone()
            tb = time.time_ns()
            subprocess.run(["/bin/sh", "-c", f"date +%s%N > {bare}"], check=True)
            if i == 0:
                idle_w, idle_r = wp.memory_info().rss, rp.memory_info().rss
                idle_tree = 1 + len(wp.children(recursive=True))
                continue                                # warm-up
            total.append((exec_ns - t0) / 1e6)
            cp_part.append((claimed_us * 1000 - t0) / 1e6)
            worker_part.append((exec_ns - claimed_us * 1000) / 1e6)
            to_starting.append((starting_us - claimed_us) / 1e3)
            answered.append((t202 - t0) / 1e6)
            floor.append((stamp(bare) - tb) / 1e6)
            rss_w, rss_r = max(rss_w, wp.memory_info().rss), max(rss_r, rp.memory_info().rss)
        # The Worker tree while a run is live (a 2 s ``sleep``).
        _, _, run_id = start("hold")
        time.sleep(1.0)
        busy = [q.name() for q in wp.children(recursive=True)]
        ended(run_id)
        load1 = os.getloadavg()

        def ms(xs: list[float]) -> str:
            return f"p50 {pct(xs, .5):.1f}, p99 {pct(xs, .99):.1f}, max {max(xs):.1f} ms"
        print(f"REAL control plane (qlagent serve [cluster] on PostgreSQL, TLS) + 1 Worker, {runs} runs; "
              f"load average {load0[0]:.2f} before, {load1[0]:.2f} after")
        print(f"Task Start sent → task's first instruction: {ms(total)}, mean {statistics.mean(total):.1f} ms")
        print(f"  baseline, Task Start sent → Attempt leased (run_leases.claimed_at_us): {ms(cp_part)}; "
              f"ratio {pct(total, .5) / pct(cp_part, .5):.2f}x at p50")
        print(f"  Worker's share, leased → exec: {ms(worker_part)}, of which leased → ACK starting applied "
              f"(run.starting event) {ms(to_starting)}; the 202 answered after {ms(answered)}")
        print(f"  floor: bare fork+exec of /bin/sh -c 'date +%s%N > file' (subprocess.run): {ms(floor)}; "
              f"Worker's share {pct(worker_part, .5) / pct(floor, .5):.1f}x it at p50")
        print(f"Worker RSS {idle_w / MiB:.1f} MiB idle, {rss_w / MiB:.1f} max after a run; replica RSS "
              f"{idle_r / MiB:.1f} idle, {rss_r / MiB:.1f} max ({rp.num_threads()} threads); Worker tree PIDs: "
              f"{idle_tree} idle ({wp.num_threads()} threads), {1 + len(busy)} during a run ({', '.join(busy)})")
        api.close()
        db.close()
    finally:
        for p in plane["workers"]:
            p.stop()
        if replica is not None:
            replica.stop()
        shutil.rmtree(root, ignore_errors=True)
        drop_database(name)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=40)
    ap.add_argument("--shim-base", help="git ref whose shim is measured against this tree's")
    ap.add_argument("--control-plane", choices=("stub", "real"), default="stub",
                    help="stub: figures 1-3 against tests/fleet/stubcp.py; real: figure 5")
    a = ap.parse_args()
    if a.shim_base:
        shim_ab(a.shim_base)
    if a.control_plane == "real":
        real_control_plane(a.runs)
        return
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
