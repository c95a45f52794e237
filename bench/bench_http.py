"""HTTP server benchmark: qlagent's bounded selectors server vs stdlib ThreadingHTTPServer.

Same run, same client, same trivial JSON route (``GET /api/v3/ping``), 4 concurrent keep-alive
clients. Each server runs in its own child process so its RSS and thread count are its own.
Prints requests/s, p50/p99 latency (µs), non-200 answers, server peak RSS and threads, the
ratio against the stdlib baseline, and the import RSS of the server module vs h11 (the
measurement that decides stdlib vs sans-IO library, issue 5 §1).

Usage: python3 bench/bench_http.py [--seconds 3] [--clients 4]
"""

from __future__ import annotations

import argparse
import array
import http.client
import importlib.util
import multiprocessing as mp
import multiprocessing.synchronize
import os
import statistics
import subprocess
import sys
import tempfile
import time

import psutil

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Children run from bytecode as an installed package would (a .deb compiles .pyc files);
# without it the compiler's own allocations would dominate the import RSS figures.
CHILD_ENV = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
CHILD_ENV.update(PYTHONPATH=ROOT, PYTHONPYCACHEPREFIX=os.path.join(tempfile.gettempdir(), "qlagent-bench-pyc"))
PAYLOAD = {"ok": True, "service": "qlagent", "items": [1, 2, 3]}


def serve(kind: str) -> None:
    """Child process: serve GET /api/v3/ping on an ephemeral loopback port; print the port."""
    import msgspec

    if kind == "qlagent":
        from qlagent.core.profiles import EDGE
        from qlagent.http.routing import Router
        from qlagent.http.server import HttpServer
        from qlagent.http.wire import HttpLimits, Response

        router = Router()
        router.add("GET", "/api/v3/ping", lambda req, p: Response.json(200, PAYLOAD))
        srv = HttpServer(HttpLimits.for_profile(EDGE), router)
        _, port = srv.listen_tcp("127.0.0.1", 0)
        print(port, flush=True)
        import selectors
        import time
        sel = selectors.DefaultSelector()
        srv.register(sel)
        while True:            # the agent's loop, reduced to the server (killed by the parent)
            deadline = srv.timeouts(time.monotonic())
            for key, mask in sel.select(None if deadline is None else max(0.0, deadline - time.monotonic())):
                srv.handle_event(key, mask)
    else:
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        body = msgspec.json.encode(PAYLOAD)

        class H(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(msgspec.json.encode(PAYLOAD))

            # Without this the stdlib answer (head and body in two writes) meets Nagle +
            # delayed ACK and stalls 40 ms per request: an unfair baseline.
            disable_nagle_algorithm = True

            def log_message(self, *args: object) -> None:
                pass

        httpd = ThreadingHTTPServer(("127.0.0.1", 0), H)
        print(httpd.server_address[1], flush=True)
        httpd.serve_forever()


def _client(port: int, seconds: float, go: mp.synchronize.Event, out: mp.Queue) -> None:
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    lat, bad = array.array("q"), 0
    go.wait()
    stop = time.perf_counter() + seconds
    while time.perf_counter() < stop:
        t0 = time.perf_counter_ns()
        c.request("GET", "/api/v3/ping")
        r = c.getresponse()
        r.read()
        lat.append(time.perf_counter_ns() - t0)
        bad += r.status != 200
    c.close()
    out.put((lat.tobytes(), bad))


def load(port: int, clients: int, seconds: float, proc: psutil.Process) -> dict[str, float]:
    """``clients`` client processes (so the client's GIL is not the bottleneck), one keep-alive
    connection each, for ``seconds``; samples the server's RSS and threads every 50 ms."""
    ctx = mp.get_context("fork")
    go, out = ctx.Event(), ctx.Queue()
    workers = [ctx.Process(target=_client, args=(port, seconds, go, out)) for _ in range(clients)]
    for w in workers:
        w.start()
    go.set()
    peak_rss, peak_threads = 0, 0
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        peak_rss = max(peak_rss, proc.memory_info().rss)
        peak_threads = max(peak_threads, proc.num_threads())
        time.sleep(0.05)
    lat, bad = array.array("q"), 0
    for _ in workers:
        raw, b = out.get(timeout=30)
        lat.frombytes(raw)
        bad += b
    for w in workers:
        w.join()
    q = statistics.quantiles(sorted(lat), n=100)
    return {
        "rps": len(lat) / seconds,
        "p50_us": q[49] / 1000,
        "p99_us": q[98] / 1000,
        "non200": bad,
        "peak_rss_mib": peak_rss / 2**20,
        "peak_threads": peak_threads,
    }


def run_server(kind: str, clients: int, seconds: float) -> dict[str, float]:
    child = subprocess.Popen([sys.executable, __file__, "--serve", kind], stdout=subprocess.PIPE,
                             cwd=ROOT, env=CHILD_ENV)
    try:
        port = int(child.stdout.readline())
        proc = psutil.Process(child.pid)
        idle = proc.memory_info().rss / 2**20
        load(port, clients, min(0.5, seconds), proc)  # warm-up
        res = load(port, clients, seconds, proc)
        res["idle_rss_mib"] = idle
        return res
    finally:
        child.terminate()
        child.wait(10)


def import_rss(stmt: str) -> float:
    """RSS growth (MiB) of a fresh interpreter from ``stmt`` after msgspec/selectors/socket."""
    code = (
        "import psutil, msgspec, selectors, socket, os\n"
        "p = psutil.Process(); a = p.memory_info().rss\n"
        f"{stmt}\n"
        "print((p.memory_info().rss - a) / 2**20)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                         env=CHILD_ENV, check=True)
    return float(out.stdout)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--serve", choices=["qlagent", "stdlib"])
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--clients", type=int, default=4)
    args = ap.parse_args()
    if args.serve:
        serve(args.serve)
        return
    # Compile every module's bytecode once so no child pays for the compiler.
    import_rss("import qlagent.http.routing, http.server, http.client, argparse, statistics, "
               "subprocess, tempfile")
    results = {kind: run_server(kind, args.clients, args.seconds) for kind in ("qlagent", "stdlib")}
    print(f"{os.cpu_count()} CPUs; clients and server share them")
    print(f"{args.clients} concurrent keep-alive client processes, {args.seconds:g} s, GET /api/v3/ping")
    print(f"{'server':<10}{'req/s':>10}{'p50 µs':>10}{'p99 µs':>10}{'non-200':>9}"
          f"{'idle RSS MiB':>14}{'peak RSS MiB':>14}{'threads':>9}")
    for kind, r in results.items():
        print(f"{kind:<10}{r['rps']:>10.0f}{r['p50_us']:>10.0f}{r['p99_us']:>10.0f}{r['non200']:>9}"
              f"{r['idle_rss_mib']:>14.1f}{r['peak_rss_mib']:>14.1f}{r['peak_threads']:>9}")
    q, s = results["qlagent"], results["stdlib"]
    print(f"ratio qlagent/stdlib: req/s {q['rps'] / s['rps']:.2f}x, p50 {q['p50_us'] / s['p50_us']:.2f}x, "
          f"p99 {q['p99_us'] / s['p99_us']:.2f}x, peak RSS {q['peak_rss_mib'] / s['peak_rss_mib']:.2f}x")
    stmts = {"qlagent.http server+routing": "import qlagent.http.server, qlagent.http.routing",
             "http.server (baseline)": "import http.server"}
    if importlib.util.find_spec("h11") is not None:  # measured only; never a runtime dependency
        stmts["h11"] = "import h11"
    else:
        print("h11 is not installed: `pip install h11` to repeat the h11 measurement")
    print("import RSS over python+msgspec+selectors+socket, median of 5 fresh interpreters:")
    for name, stmt in stmts.items():
        print(f"  {name:<28}{statistics.median(import_rss(stmt) for _ in range(5)):>6.2f} MiB")
    print("  (an h11 server would still need this module's loop, limits and framing checks)")


if __name__ == "__main__":
    main()
