"""Idle cost of ``qlagent serve`` (issues 4 §1, §6 and 14), on two interpreters: this dev venv's
and Debian 13's ``/usr/bin/python3`` in the trixie rootfs ``packaging/e2e-systemd`` builds
(run through ``chroot`` with Debian's own python3-msgspec, -psutil, -nacl, … and the working
tree's ``qlagent`` copied in). Per interpreter, measured in the same window:

- **plain**: 50 scheduled Tasks that never fire in the window (``0 3 * * *``);
- **router**: ``serve --profile edge --listen 127.0.0.1:PORT`` with ``examples/router-tasks.toml``
  (its network-gated ``wan-check``/``ddns-update``) + the 50 Tasks and ``[http] metrics = true``
  (issue 26: the goal holds with metrics on), after one ``run start ddns-update`` (resolves a
  Secret), one ``chatty`` Run (9.7 MB of output), one authenticated HTTP request and three
  ``GET /metrics``; the set's own ``* * * * *`` Tasks keep firing meanwhile;
- **plain + metrics**: the plain agent with ``--listen`` and ``[http] metrics = true``, after
  three ``GET /metrics`` (what a scraped plain agent costs: the HTTP API is what serves them),
  and in the pip-installed venv the same with metrics off (three 404s) to tell the HTTP API's
  share from the metrics';
- **worker** (issue 11 "Budgets"): ``serve`` with ``[worker]`` against the Worker-protocol stub
  (tests/fleet/stubcp.py, TLS on loopback, CA pinned, 0600 credential): idle with its Session open
  and long-polling, then the peak while 4 ``chatty`` Runs (quota 4 MiB, two with a lease file)
  and one Run with a Secret execute, then idle again after their logs are uploaded;
- baselines: an idle ``supervisord`` with one program, and ``python3 -c pass`` (RSS/PSS read
  by the interpreter itself at exit).

Every figure is RSS and PSS (``/proc/PID/smaps_rollup``) of the one process, and its ratio to
the supervisord anchor of the same interpreter. Wake-ups (dev interpreter, plain agent): voluntary
context switches over every thread (``/proc/PID/task/*/status``) between two reads a window
apart, and the WATCHDOG=1 datagrams received on a real NOTIFY_SOCKET.

``--against DIR`` runs the plain and router agents of another checkout (e.g. /work/main) beside
this tree's, in the same window on each interpreter (its ``qlagent`` first on PYTHONPATH; in the
trixie rootfs under /opt/against): a before/after measured in the same run.

Run as root from the repository root: ``python3 bench/bench_idle.py [--seconds 60] [--no-trixie]
[--against DIR]``.
supervisord is pip-installed into a temporary directory; the rootfs tarball is built (or found
cached) with ``QLAGENT_E2E_BUILD_ONLY=1 packaging/e2e-systemd``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

import psutil

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# This tree, its test helpers (tests/kit.py) and the Worker-protocol stub, in that order.
sys.path[:0] = [REPO, os.path.join(REPO, "tests"), os.path.join(REPO, "tests", "fleet")]
KiB = 1024
MiB = 1024 * KiB
CHATTY = os.path.join(REPO, "examples", "router-tasks", "chatty.sh")
WATCHDOG_USEC = 30_000_000
MEM_PROBE = ("import sys\n"
             "s = dict(l.split(':', 1) for l in open('/proc/self/status'))\n"
             "r = dict(l.split(':', 1) for l in open('/proc/self/smaps_rollup') if ':' in l and 'Pss' in l)\n"
             "print(int(s['VmRSS'].split()[0]), int(r['Pss'].split()[0]))\n")


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


def mem_kib(pid: int) -> tuple[int, int]:
    """(RSS, PSS) of one process in KiB."""
    rss = psutil.Process(pid).memory_info().rss // KiB
    with open(f"/proc/{pid}/smaps_rollup") as f:
        pss = next(int(ln.split()[1]) for ln in f if ln.startswith("Pss:"))
    return rss, pss


def clean_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("QLAGENT_", "NOTIFY_SOCKET", "WATCHDOG_", "JOURNAL_STREAM", "PYTHON"))}
    env.update(extra)
    return env


class Interpreter:
    """How to start a python (and qlagent) and where its files are seen from outside."""

    def __init__(self, name: str, argv: list[str], entry: str, root: str = "", pythonpath: str = "",
                 site_dir: str = "") -> None:
        self.name, self.argv, self.root, self.pythonpath, self.site_dir = name, argv, root, pythonpath, site_dir
        self.entry = entry          # the installed `qlagent` script, run as the package runs it

    def outside(self, inner: str) -> str:
        return self.root + inner

    def against(self, tree: str) -> Interpreter:
        """The same interpreter running another checkout's ``qlagent`` (``--against``)."""
        return Interpreter(f"{self.name}, against", self.argv, self.entry, self.root,
                           "/opt/against" if self.root else tree, self.site_dir)

    def env(self, **extra) -> dict:
        env = clean_env(**extra)
        if self.pythonpath:
            env["PYTHONPATH"] = self.pythonpath
        return env

    def python(self, *args: str, **kw) -> subprocess.CompletedProcess:
        return subprocess.run([*self.argv, *args], capture_output=True, cwd=REPO if not self.root else "/",
                              env=self.env(), **kw)

    def cli(self, state: str, *args: str, stdin: bytes | None = None) -> bytes:
        p = self.python(self.entry, "--state-dir", state, *args, input=stdin)
        if p.returncode != 0:
            raise SystemExit(f"{self.name}: qlagent {' '.join(args)} exited {p.returncode}: {p.stderr.decode()}")
        return p.stdout

    def popen(self, args: list[str], err: str | None = None, **env) -> subprocess.Popen:
        """``err``: a file (outside path) for the process's stderr (its journal)."""
        return subprocess.Popen([*self.argv, *args], cwd=REPO if not self.root else "/", env=self.env(**env),
                                stdout=subprocess.DEVNULL,
                                stderr=open(err, "wb") if err else subprocess.DEVNULL)


class Notify:
    def __init__(self, path: str) -> None:
        self.s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.s.bind(path)
        self.s.setblocking(False)
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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Agent:
    """One ``qlagent serve`` with its state in ``inner_dir`` (a path as the interpreter sees it)."""

    def __init__(self, interp: Interpreter, inner_dir: str, name: str, router: bool, metrics: bool = False,
                 listen: bool = False) -> None:
        self.interp, self.name, self.router, self.metrics = interp, name, router, metrics
        self.listen = listen or metrics
        self.state = f"{inner_dir}/{name}"
        interp.cli(self.state, "init")
        self.config = f"{inner_dir}/{name}-config.toml"
        if metrics:
            with open(interp.outside(self.config), "w") as f:
                f.write("[http]\nmetrics = true\n")
        tasks = "".join(f'[[task]]\nname = "t{i:02d}"\nschedule = "0 3 * * *"\ncommand = ["/bin/true"]\n\n'
                        for i in range(50))
        with open(interp.outside(f"{inner_dir}/{name}-50.toml"), "w") as f:
            f.write(tasks)
        interp.cli(self.state, "task", "add", "-f", f"{inner_dir}/{name}-50.toml")
        if router:
            shutil.copy(os.path.join(REPO, "examples", "router-tasks.toml"), interp.outside(f"{inner_dir}/router.toml"))
            interp.cli(self.state, "task", "add", "-f", f"{inner_dir}/router.toml")
            interp.cli(self.state, "secret", "set", "ddns_token", stdin=b"bench-ddns-token-0123456789\n")
            self.token = interp.cli(self.state, "token", "create", "--subject", "bench", "--role", "viewer").decode().strip()
        if router or self.listen:
            self.port = free_port()
        self.notify_inner = f"{inner_dir}/{name}.notify"
        self.notify = Notify(interp.outside(self.notify_inner))
        self.journal = interp.outside(f"{inner_dir}/{name}.journal")   # the agent's stderr
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        args = [self.interp.entry, "--state-dir", self.state] + (["--config", self.config] if self.metrics else [])
        if self.router:
            args += ["--profile", "edge", "serve", "--listen", f"127.0.0.1:{self.port}"]
        elif self.listen:
            args += ["serve", "--listen", f"127.0.0.1:{self.port}"]
        else:
            args += ["serve"]
        self.proc = self.interp.popen(args, self.journal, NOTIFY_SOCKET=self.notify_inner,
                                      WATCHDOG_USEC=str(WATCHDOG_USEC))
        deadline = time.monotonic() + 30
        while not any(ln == "READY=1" for _, ln in self.notify.lines):
            if time.monotonic() > deadline or self.proc.poll() is not None:
                self.fail("agent did not become ready")
            time.sleep(0.05)
            self.notify.pump()

    def scrape(self) -> None:
        """Three ``GET /metrics``, each a Prometheus text document naming the agent's Runs (a
        404 with metrics off)."""
        for _ in range(3):
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=10) as r:
                    ok = self.metrics and r.status == 200 and b"\nqlagent_runs{" in r.read()
            except urllib.error.HTTPError as e:
                ok = not self.metrics and e.code == 404
            if not ok:
                self.fail("GET /metrics answered otherwise")

    def exercise(self) -> None:
        """The router configuration's activity: a Secret Run, a chatty Run, one HTTP request and
        three scrapes of /metrics."""
        for task in ("ddns-update", "chatty"):
            p = self.interp.python(self.interp.entry, "--state-dir", self.state, "--json", "run", "start", task,
                                   "--wait", "--timeout", "120")
            state = json.loads(p.stdout)["state"] if p.returncode in (0, 6) else p.stderr.decode().strip()
            if state != "succeeded":
                self.fail(f"{task} ended {state}")
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/api/v3/projects/default/runs?limit=5",
                                     headers={"Authorization": f"Bearer {self.token}"})
        with urllib.request.urlopen(req, timeout=10) as r:
            if r.status != 200 or not json.loads(r.read())["items"]:
                self.fail("HTTP run list failed")
        self.scrape()

    def fail(self, what: str) -> None:
        """Stop the bench with what went wrong, whether the agent still runs and its journal's end."""
        alive = "running" if self.proc is not None and self.proc.poll() is None else \
            f"exited {self.proc.returncode if self.proc else None}"
        with open(self.journal, "rb") as f:
            tail = f.read()[-4000:].decode("utf-8", "replace")
        raise SystemExit(f"{self.interp.name} {self.name}: {what}; the agent {alive}; its journal ends:\n{tail}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()


class WorkerAgent:
    """One fleet Worker (``serve`` with ``[worker]``) of ``interp`` pulling from the stub ``cp``."""

    def __init__(self, interp: Interpreter, inner_dir: str, cp, url: str) -> None:
        from stubcp import worker_config, write_credential
        self.interp, self.cp, self.inner = interp, cp, inner_dir
        wid, cred = cp.enrol()
        shutil.copy(cp.ca_file, interp.outside(f"{inner_dir}/worker-ca.pem"))
        shutil.copy(CHATTY, interp.outside(f"{inner_dir}/chatty.sh"))
        write_credential(interp.outside(f"{inner_dir}/worker.credential"), cred)
        self.config = f"{inner_dir}/worker.toml"
        worker_config(interp.outside(self.config), state_dir=f"{inner_dir}/worker", worker_id=wid,
                      url=url, credential_file=f"{inner_dir}/worker.credential",
                      ca_file=f"{inner_dir}/worker-ca.pem", slots=4, heartbeat_s=5.0, pull_wait_s=20)
        self.notify_inner = f"{inner_dir}/worker.notify"
        self.notify = Notify(interp.outside(self.notify_inner))
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        err = self.interp.outside(f"{self.inner}/worker.err")
        self.proc = self.interp.popen([self.interp.entry, "--config", self.config, "serve"], err=err,
                                      NOTIFY_SOCKET=self.notify_inner, WATCHDOG_USEC=str(WATCHDOG_USEC))
        deadline = time.monotonic() + 30
        while not any(ln == "READY=1" for _, ln in self.notify.lines):       # READY=1 once a Session is open
            if time.monotonic() > deadline or self.proc.poll() is not None:
                with open(err) as f:
                    raise SystemExit(f"{self.interp.name} worker: no Session within 30 s: {f.read()[-1500:]}")
            time.sleep(0.05)
            self.notify.pump()

    def exercise(self) -> tuple[int, int]:
        """4 chatty Runs (2 ``kill`` with a lease file, 2 ``keep``: the edge Profile's 4 slots) and
        one Run resolving a Secret after them; (peak RSS, peak PSS) KiB of the Worker process until every log is uploaded."""
        chatty = f"{self.inner}/chatty.sh"
        ids = [self.cp.add_run(argv=["/bin/sh", chatty], log_quota_bytes=4 * MiB, on_lease_loss=pol)
               for pol in ("kill", "kill", "keep", "keep")]
        secret = self.cp.add_run(shell="/bin/sh", script='test -n "$DDNS_TOKEN" && echo token-set',
                                 secrets={"DDNS_TOKEN": b"bench-ddns-token-0123456789"})
        peak = (0, 0)
        deadline = time.monotonic() + 180
        while True:
            peak = max(peak, mem_kib(self.proc.pid))
            with self.cp.lock:
                done = (all(self.cp.log_ends.get(x) == 4 * MiB for x in ids)
                        and self.cp.log_ends.get(secret) == len(b"token-set\n"))
            if done:
                return peak
            if time.monotonic() > deadline or self.proc.poll() is not None:
                states = {a: (x["state"], self.cp.log_ends.get(a)) for a, x in self.cp.attempts.items()}
                raise SystemExit(f"{self.interp.name} worker: runs or their logs did not complete: {states}")
            time.sleep(0.05)
            self.notify.pump()

    stop = Agent.stop


def start_supervisord(interp: Interpreter, inner_dir: str) -> subprocess.Popen:
    conf = f"{inner_dir}/supervisord.conf"
    with open(interp.outside(conf), "w") as f:
        f.write(f"[supervisord]\nnodaemon=true\nlogfile={inner_dir}/supervisord.log\n"
                f"pidfile={inner_dir}/supervisord.pid\nchildlogdir={inner_dir}\n\n"
                "[program:sleeper]\ncommand=/bin/sleep 3600\n")
    p = subprocess.Popen([*interp.argv, "-c", "import sys; sys.path.insert(0, sys.argv.pop(1)); "
                          "from supervisor.supervisord import main; main()", interp.site_dir, "-c", conf],
                         cwd="/", env=clean_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 20
    while not psutil.Process(p.pid).children():
        if time.monotonic() > deadline or p.poll() is not None:
            raise SystemExit(f"{interp.name}: supervisord did not start its program")
        time.sleep(0.05)
    return p


def import_kib(interp: Interpreter, stmt: str) -> tuple[int, int]:
    out = interp.python("-c", stmt + "\n" + MEM_PROBE, check=True)
    rss, pss = out.stdout.split()[-2:]
    return int(rss), int(pss)


class TrixieRoot:
    """The e2e rootfs, extracted, with proc/sys/dev mounted and each tree's qlagent in
    ``/opt/NAME`` (``trees``: NAME → a source tree; default this one as ``/opt/qlagent``)."""

    def __init__(self, tmp: str, supervisor_src: str | None, trees: dict[str, str] | None = None) -> None:
        out = subprocess.run([os.path.join(REPO, "packaging", "e2e-systemd")], capture_output=True, text=True,
                             env=dict(os.environ, QLAGENT_E2E_BUILD_ONLY="1"))
        tarball = next((ln for ln in out.stdout.splitlines() if ln.endswith(".tar.gz")), "")
        if out.returncode != 0 or not tarball:
            raise SystemExit(f"e2e rootfs: {out.stdout}{out.stderr}")
        self.root = os.path.join(tmp, "rootfs")
        os.makedirs(self.root)
        subprocess.run(["tar", "-C", self.root, "--numeric-owner", "-xzf", tarball], check=True)
        self.trees = trees or {"qlagent": REPO}
        for name, path in self.trees.items():
            shutil.copytree(os.path.join(path, "qlagent"), os.path.join(self.root, f"opt/{name}/qlagent"),
                            ignore=shutil.ignore_patterns("__pycache__"))
        if supervisor_src is not None:
            shutil.copytree(supervisor_src, os.path.join(self.root, "opt/supervisor"))
        # /usr/bin/qlagent exactly as packaging/build-deb writes it; bytecode compiled as the
        # postinst does (a service compiling its modules at every start would not be measured).
        with open(os.path.join(REPO, "packaging", "build-deb")) as f:
            build_deb = f.read()
        script = build_deb.split("cat > \"$R/usr/bin/qlagent\" <<'PY'\n", 1)[1].split("\nPY\n", 1)[0] + "\n"
        with open(os.path.join(self.root, "usr/bin/qlagent"), "w") as f:
            f.write(script)
        os.chmod(os.path.join(self.root, "usr/bin/qlagent"), 0o755)
        for name in self.trees:
            subprocess.run(["chroot", self.root, "/usr/bin/python3", "-m", "compileall", "-q", f"/opt/{name}/qlagent"],
                           check=True)
        if not os.path.exists(os.path.join(self.root, "etc/hosts")):
            with open(os.path.join(self.root, "etc/hosts"), "w") as f:     # the stub's URL names localhost
                f.write("127.0.0.1 localhost\n")
        self.mounts = []
        for kind, target in (("proc", "proc"), ("/sys", "sys"), ("/dev", "dev")):
            path = os.path.join(self.root, target)
            cmd = ["mount", "-t", "proc", "proc", path] if kind == "proc" else ["mount", "--rbind", kind, path]
            subprocess.run(cmd, check=True)
            self.mounts.append(path)
        self.tarball = tarball

    def interpreter(self) -> Interpreter:
        return Interpreter("debian13", ["chroot", self.root, "/usr/bin/python3"], "/usr/bin/qlagent", root=self.root,
                           pythonpath="/opt/qlagent", site_dir="/opt/supervisor")

    def close(self) -> None:
        for path in reversed(self.mounts):
            subprocess.run(["umount", "-R", "-l", path], capture_output=True)


def measure(interp: Interpreter, inner_dir: str, window: float, wakeups: bool, cp, cp_url: str,
            installed: Interpreter | None = None, against: Interpreter | None = None) -> dict:
    """``cp``/``cp_url``: the Worker-protocol stub the Worker pulls from. ``installed``: the same
    interpreter in a venv holding only what ``pip install .`` brings (no editable-install finder,
    no test dependencies: typing_extensions, present in the dev venv for jsonschema, makes msgspec
    import inspect/ast/dis, +1.25 MiB); it runs the plain, plain + HTTP (metrics on, off) and router agents once more.
    ``against``: the interpreter with another checkout's qlagent, whose plain and router agents
    run in the same window (figures named ``…, against``)."""
    os.makedirs(interp.outside(inner_dir), exist_ok=True)
    plain = Agent(interp, inner_dir, "plain", router=False)
    router = Agent(interp, inner_dir, "router", router=True, metrics=True)
    scraped = Agent(interp, inner_dir, "plain-metrics", router=False, metrics=True)
    worker = WorkerAgent(interp, inner_dir, cp, cp_url)
    agents = [plain, router, scraped, worker]
    # The goals are judged as packages install: the pip-installed venv runs each local agent too.
    inst = ({} if installed is None else
            {"plain": Agent(installed, inner_dir, "plain-installed", router=False),
             "plain + HTTP + metrics, scraped": Agent(installed, inner_dir, "plain-metrics-installed", router=False,
                                                      metrics=True),
             "plain + HTTP, metrics off, asked": Agent(installed, inner_dir, "plain-http-installed", router=False,
                                                       listen=True),
             "router, metrics on, after Runs + HTTP + scrapes": Agent(installed, inner_dir, "router-installed",
                                                                      router=True, metrics=True)})
    agents += list(inst.values())
    other = ({} if against is None else
             {"plain, 50 cron tasks, against": Agent(against, inner_dir, "plain-against", router=False),
              "router, metrics on, after Runs + HTTP + scrapes, against": Agent(against, inner_dir, "router-against",
                                                                                router=True, metrics=True)})
    agents += list(other.values())
    procs = []
    try:
        sup = start_supervisord(interp, inner_dir)
        procs.append(sup)
        for a in agents:
            a.start()
        time.sleep(2.0)
        fig = {"router, right after start": mem_kib(router.proc.pid)}
        router.exercise()
        scraped.scrape()
        if inst:
            inst["router, metrics on, after Runs + HTTP + scrapes"].exercise()
            inst["plain + HTTP + metrics, scraped"].scrape()
            inst["plain + HTTP, metrics off, asked"].scrape()
        if other:
            other["router, metrics on, after Runs + HTTP + scrapes, against"].exercise()
        pid = plain.proc.pid
        before = vol_switches(pid)
        t0 = time.monotonic()
        end = t0 + window
        while time.monotonic() < end:
            time.sleep(min(0.5, max(0.0, end - time.monotonic())))
            for a in agents:
                a.notify.pump()
        t1 = time.monotonic()
        switches = vol_switches(pid) - before
        plain.notify.pump()
        fig["router, metrics on, after Runs + HTTP + scrapes"] = mem_kib(router.proc.pid)
        fig["plain, 50 cron tasks"] = mem_kib(plain.proc.pid)
        fig["plain + HTTP + metrics, scraped"] = mem_kib(scraped.proc.pid)
        for k, a in other.items():
            fig[k] = mem_kib(a.proc.pid)
        fig["worker, idle (Session, TLS, long-poll)"] = mem_kib(worker.proc.pid)
        fig["worker, peak: 4 chatty + 1 Secret Run"] = worker.exercise()
        time.sleep(2.0)
        fig["worker, after those Runs"] = mem_kib(worker.proc.pid)
        for k, a in inst.items():
            fig[f"{'plain, 50 cron tasks' if k == 'plain' else k}, pip-installed venv"] = mem_kib(a.proc.pid)
        fig["supervisord + 1 program"] = mem_kib(sup.pid)
        fig["python3 -c pass"] = import_kib(interp, "pass")
        result = {"figures": fig, "window": t1 - t0, "threads": psutil.Process(pid).num_threads()}
        if wakeups:
            result["switches"] = switches
            result["pings"] = plain.notify.pings_between(t0, t1)
        modules = interp.python("-c", "import sys, qlagent.service.main, qlagent.http.service; "
                                "print(' '.join(m for m in ('pyroute2', 'cryptography', 'nacl', '_hashlib', "
                                "'_ssl', 'asyncio') if m in sys.modules))", check=True)
        result["heavy modules in the HTTP service closure"] = modules.stdout.decode().strip() or "none"
        return result
    finally:
        for a in agents:
            a.stop()
        for p in procs:
            p.terminate()
            p.wait(30)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--no-trixie", action="store_true", help="only the dev interpreter")
    ap.add_argument("--against", help="another checkout whose plain and router agents run beside this tree's")
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="qlbench-idle-", dir="/var/tmp")
    trixie = None
    from stubcp import StubControlPlane
    cp = StubControlPlane(tmp, lease_ttl_s=30, session_ttl_s=30)
    cp_url = cp.start()
    try:
        sup_dir = os.path.join(tmp, "supervisor")
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", sup_dir, "supervisor"],
                       check=True, capture_output=True)
        interps = [Interpreter("dev venv", [sys.executable], os.path.join(os.path.dirname(sys.executable), "qlagent"),
                               site_dir=sup_dir)]
        if not args.no_trixie:
            trixie = TrixieRoot(tmp, sup_dir, {"qlagent": REPO, **({"against": args.against} if args.against else {})})
            interps.append(trixie.interpreter())
        results = {}
        for i, interp in enumerate(interps):
            inner = f"{tmp}/run" if not interp.root else "/tmp/qlbench"
            installed = None
            if not interp.root:
                venv = os.path.join(tmp, "installed-venv")
                subprocess.run([sys.executable, "-m", "venv", venv], check=True)
                subprocess.run([os.path.join(venv, "bin", "pip"), "install", "-q", "--disable-pip-version-check", REPO],
                               check=True, capture_output=True)
                installed = Interpreter("dev, pip-installed", [os.path.join(venv, "bin", "python")],
                                        os.path.join(venv, "bin", "qlagent"))
            results[interp.name] = measure(interp, inner, args.seconds, wakeups=(i == 0), cp=cp, cp_url=cp_url,
                                           installed=installed,
                                           against=interp.against(args.against) if args.against else None)
        dev = interps[0]
        extra = {stmt: import_kib(dev, stmt)[0] for stmt in (
            "pass", "import selectors", "import asyncio", "import pyroute2", "import hashlib",
            "from cryptography.hazmat.primitives.ciphers.aead import AESGCM", "import nacl.bindings",
            "import qlagent.service.main", "import qlagent.service.main, qlagent.http.service",
            "import qlagent.service.main, qlagent.http.service, qlagent.core.metrics")}
    finally:
        cp.stop()
        if trixie is not None:
            trixie.close()
        shutil.rmtree(tmp, ignore_errors=True)

    for name, r in results.items():
        fig = r["figures"]
        anchor = fig["supervisord + 1 program"]
        py = subprocess.run([*(i.argv for i in interps if i.name == name)][0] + ["--version"],
                            capture_output=True, text=True).stdout.strip() if name == "dev venv" else "Debian 13"
        print(f"\n== {name} ({py}); window {r['window']:.1f} s")
        print(f"{'process':44} {'RSS KiB':>8} {'PSS KiB':>8} {'RSS vs anchor':>13} {'vs -c pass':>10}")
        for k, (rss, pss) in fig.items():
            print(f"{k:44} {rss:>8} {pss:>8} {rss / anchor[0]:>12.2f}x {rss / fig['python3 -c pass'][0]:>9.2f}x")
        if "switches" in r:
            half = WATCHDOG_USEC / 2e6
            print(f"plain agent: {r['switches']} voluntary switches ({r['switches'] / (r['window'] / half):.2f} per "
                  f"{half:g} s watchdog half-interval), {r['pings']} WATCHDOG=1, {r['threads']} thread(s)")
        print(f"heavy modules in the service + HTTP import closure: {r['heavy modules in the HTTP service closure']}")
        worker, local = fig["worker, idle (Session, TLS, long-poll)"][0], fig["plain, 50 cron tasks"][0]
        print(f"worker idle vs the plain local agent, same run: {worker / local:.2f}x RSS")
        if args.against:
            print(f"against: {args.against}")
        for k, limit in (("router, metrics on, after Runs + HTTP + scrapes", 28), ("plain, 50 cron tasks", 20),
                         ("router, metrics on, after Runs + HTTP + scrapes, against", 28),
                         ("plain, 50 cron tasks, against", 20), ("plain + HTTP + metrics, scraped", 20),
                         ("plain, 50 cron tasks, pip-installed venv", 20),
                         ("plain + HTTP + metrics, scraped, pip-installed venv", 20),
                         ("router, metrics on, after Runs + HTTP + scrapes, pip-installed venv", 28)):
            if k in fig:
                print(f"goal {k} RSS <= {limit} MiB: {'met' if fig[k][0] <= limit * 1024 else 'NOT met'}")
    base = extra["pass"]
    print("\nimport cost, dev interpreter (VmRSS KiB over `pass`): " +
          "; ".join(f"{k} +{v - base}" for k, v in extra.items() if k != "pass"))


if __name__ == "__main__":
    main()
