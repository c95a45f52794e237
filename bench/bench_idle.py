"""Idle cost of ``qlagent serve`` (issue 4 §1, §6): RSS and wake-ups over 60 s with 50 scheduled
Tasks that never fire in the window (``0 3 * * *``), with NOTIFY_SOCKET and WATCHDOG_USEC=30 s,
against an idle supervisord with one program measured in the same window (the anchor).

Also: the same agent with one network-gated Task (pyroute2 loaded), and the RSS of a bare
interpreter after ``import selectors`` vs ``import asyncio``.

Wake-ups: voluntary context switches summed over every thread of the process
(``/proc/PID/task/*/status``) between two reads 60 s apart; loop iterations are counted from
the WATCHDOG=1 datagrams received on a real NOTIFY_SOCKET (one per healthy iteration that was due).

Run from the repository root: ``python3 bench/bench_idle.py [--seconds 60]``.
supervisord is taken from PATH, else pip-installed into a temporary venv.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time

import psutil

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KiB = 1024
WATCHDOG_USEC = 30_000_000


def vol_switches(pid: int) -> int:
    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/status") as f:
                for line in f:
                    if line.startswith("voluntary_ctxt_switches:"):
                        total += int(line.split()[1])
        except OSError:
            continue
    return total


def rss_kib(pid: int) -> int:
    return psutil.Process(pid).memory_info().rss // KiB


def cli(state: str, *args: str, stdin: bytes | None = None) -> None:
    subprocess.run([sys.executable, "-m", "qlagent.cli.main", "--state-dir", state, *args], check=True,
                   capture_output=True, input=stdin, cwd=REPO, env=clean_env())


def clean_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("QLAGENT_", "NOTIFY_SOCKET", "WATCHDOG_", "JOURNAL_STREAM"))}
    env.update(extra)
    return env


def prepare_agent(root: str, name: str, gated: bool) -> tuple[str, str]:
    state = os.path.join(root, name)
    cli(state, "init")
    tasks = "".join(f'[[task]]\nname = "t{i:02d}"\nschedule = "0 3 * * *"\ncommand = ["/bin/true"]\n\n'
                    for i in range(50))
    if gated:
        tasks += '[[task]]\nname = "gated"\nschedule = "0 3 * * *"\nnetwork = "default_route"\ncommand = ["/bin/true"]\n'
    path = os.path.join(root, f"{name}.toml")
    with open(path, "w") as f:
        f.write(tasks)
    cli(state, "task", "add", "-f", path)
    sock_path = os.path.join(root, f"{name}.notify")
    return state, sock_path


class Notify:
    def __init__(self, path: str) -> None:
        self.s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.s.bind(path)
        self.s.setblocking(False)
        self.path = path
        self.lines: list[tuple[float, str]] = []

    def pump(self) -> None:
        while True:
            try:
                data = self.s.recv(65536)
            except BlockingIOError:
                return
            t = time.monotonic()
            self.lines += [(t, ln) for ln in data.decode().split("\n") if ln]

    def pings_between(self, a: float, b: float) -> int:
        return sum(1 for t, ln in self.lines if ln == "WATCHDOG=1" and a <= t < b)


def start_agent(state: str, notify: Notify, no_site: bool = False) -> subprocess.Popen:
    """``no_site``: ``python -S`` with PYTHONPATH = repo + site-packages, i.e. without this dev
    box's ``.pth`` hooks (editable-install finder, a CA bundle loader) that a packaged install
    does not run; the supervisord anchor runs from a venv that does not load them either."""
    env = clean_env(NOTIFY_SOCKET=notify.path, WATCHDOG_USEC=str(WATCHDOG_USEC))
    flags = []
    if no_site:
        import site
        env["PYTHONPATH"] = os.pathsep.join([REPO, *site.getsitepackages()])
        flags = ["-S"]
    p = subprocess.Popen([sys.executable, *flags, "-m", "qlagent.cli.main", "--state-dir", state, "serve"], cwd=REPO,
                         env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 20
    while not any(ln == "READY=1" for _, ln in notify.lines):
        if time.monotonic() > deadline or p.poll() is not None:
            raise SystemExit("agent did not become ready")
        time.sleep(0.05)
        notify.pump()
    return p


def supervisord_binary(root: str) -> str:
    found = shutil.which("supervisord")
    if found:
        return found
    venv = os.path.join(root, "venv")
    subprocess.run([sys.executable, "-m", "venv", venv], check=True)
    subprocess.run([os.path.join(venv, "bin", "pip"), "install", "-q", "supervisor"], check=True)
    return os.path.join(venv, "bin", "supervisord")


def start_supervisord(root: str) -> subprocess.Popen:
    conf = os.path.join(root, "supervisord.conf")
    with open(conf, "w") as f:
        f.write(f"[supervisord]\nnodaemon=true\nlogfile={root}/supervisord.log\npidfile={root}/supervisord.pid\n"
                f"childlogdir={root}\n\n[program:sleeper]\ncommand=/bin/sleep 3600\n")
    p = subprocess.Popen([supervisord_binary(root), "-c", conf], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 20
    while not psutil.Process(p.pid).children():
        if time.monotonic() > deadline or p.poll() is not None:
            raise SystemExit("supervisord did not start its program")
        time.sleep(0.05)
    return p


def import_rss(stmt: str) -> int:
    code = (f"{stmt}\n"
            "for line in open('/proc/self/status'):\n"
            "    if line.startswith('VmRSS:'): print(line.split()[1])\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, check=True, cwd=REPO, env=clean_env())
    return int(out.stdout)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=60.0)
    window = ap.parse_args().seconds
    root = tempfile.mkdtemp(prefix="qlbench-idle-", dir="/dev/shm" if os.access("/dev/shm", os.W_OK) else None)
    procs: list[subprocess.Popen] = []
    try:
        plain_state, plain_sock = prepare_agent(root, "plain", gated=False)
        gated_state, gated_sock = prepare_agent(root, "gated", gated=True)
        nosite_state, nosite_sock = prepare_agent(root, "nosite", gated=False)
        n_plain, n_gated, n_nosite = Notify(plain_sock), Notify(gated_sock), Notify(nosite_sock)
        sup = start_supervisord(root)
        procs.append(sup)
        plain = start_agent(plain_state, n_plain)
        procs.append(plain)
        gated = start_agent(gated_state, n_gated)
        procs.append(gated)
        nosite = start_agent(nosite_state, n_nosite, no_site=True)
        procs.append(nosite)
        time.sleep(2.0)                    # past start-up
        pids = {"qlagent serve, 50 tasks": plain.pid, "qlagent serve, 50 tasks + 1 gated": gated.pid,
                "qlagent serve, 50 tasks, python -S": nosite.pid, "supervisord + 1 program": sup.pid}
        before = {k: vol_switches(p) for k, p in pids.items()}
        t0 = time.monotonic()
        end = t0 + window
        while time.monotonic() < end:
            time.sleep(min(0.5, max(0.0, end - time.monotonic())))
            for n in (n_plain, n_gated, n_nosite):
                n.pump()
        t1 = time.monotonic()
        after = {k: vol_switches(p) for k, p in pids.items()}
        rss = {k: rss_kib(p) for k, p in pids.items()}
        threads = {k: psutil.Process(p).num_threads() for k, p in pids.items()}
        children = {k: len(psutil.Process(p).children(recursive=True)) for k, p in pids.items()}
        for n in (n_plain, n_gated, n_nosite):
            n.pump()
        pings = {"qlagent serve, 50 tasks": n_plain.pings_between(t0, t1),
                 "qlagent serve, 50 tasks + 1 gated": n_gated.pings_between(t0, t1),
                 "qlagent serve, 50 tasks, python -S": n_nosite.pings_between(t0, t1)}
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
        shutil.rmtree(root, ignore_errors=True)

    span = t1 - t0
    half = WATCHDOG_USEC / 2e6
    anchor = "supervisord + 1 program"
    print(f"idle window {span:.1f} s; WATCHDOG_USEC={WATCHDOG_USEC} (ping due every {half:g} s)")
    print(f"{'process':36} {'RSS KiB':>9} {'vs anchor':>9} {'vol. switches':>13} {'per half-int.':>13} "
          f"{'pings':>5} {'threads':>7} {'children':>8}")
    for k in pids:
        sw = after[k] - before[k]
        print(f"{k:36} {rss[k]:>9} {rss[k] / rss[anchor]:>8.2f}x {sw:>13} {sw / (span / half):>13.2f} "
              f"{pings.get(k, '-'):>5} {threads[k]:>7} {children[k]:>8}")
    gated_cost = rss["qlagent serve, 50 tasks + 1 gated"] - rss["qlagent serve, 50 tasks"]
    print(f"pyroute2 gate cost: +{gated_cost} KiB RSS")
    base = import_rss("pass")
    sel = import_rss("import selectors")
    aio = import_rss("import asyncio")
    svc = import_rss("import qlagent.service.main, qlagent.cli.main")
    hl = import_rss("import hashlib")
    print(f"RSS bare interpreter {base} KiB; import selectors {sel} KiB (+{sel - base}); "
          f"import asyncio {aio} KiB (+{aio - base}); import qlagent.service.main {svc} KiB (+{svc - base}); "
          f"import hashlib (OpenSSL) {hl} KiB (+{hl - base})")
    for k in ("qlagent serve, 50 tasks", "qlagent serve, 50 tasks, python -S"):
        print(f"goal idle RSS <= 20 MiB ({k}): {'met' if rss[k] <= 20 * 1024 else 'NOT met'}")


if __name__ == "__main__":
    main()
