"""What a CLI answer and a ``serve`` start cost against a bare interpreter start, in the same run
(issue 24 §3, §4): the installed ``qlagent`` as a user runs it, each source tree given measured
the same way, interleaved round by round so they share the machine's load.

Forms (``--forms``), each a way qlagent is installed:

- ``pip``: ``pip install TREE`` into a fresh venv of this interpreter; the console script pip
  writes (``venv/bin/qlagent``; pip's own wrapper imports ``re``) with ``--state-dir``.
- ``debian13``: the trixie rootfs of ``packaging/e2e-systemd`` (Debian's python3 3.13 with
  python3-msgspec & co.; bench_idle.TrixieRoot), ``/usr/bin/qlagent`` as packaging/build-deb
  writes it and the package's ``/etc/qlagent/qlagent.toml`` (its ``state_dir`` pointed at the
  bench's store), so every command reads that file as on an installed box; the tree on
  PYTHONPATH, all of it run through ``chroot``.

Per form and round: ``python3 -I -S -c pass`` (the goal's interpreter start, "pass"),
``python3 -c pass`` (the interpreter as the script runs it: site included), and per command each
tree's ``qlagent CMD`` beside a bare script that does the command's own work with the same
libraries under ``python3 -I -S``: print the same bytes (``--version``, ``--help``); read the
same rows of the same SQLite file with ``sqlite3`` and print the same lines (``run ls``: the
tree's RUNS_PAGE statement over 1,000 Runs, the newest 50; ``task ls``: the 50 heads, their
documents with ``json``, each next fire with ``cronsim`` in its ``zoneinfo`` zone). The bench
checks that a bare script prints exactly what qlagent printed. Own work = bare − pass;
**overhead = (qlagent − own work) / pass**, the figure the goal (≤ 1.5) is about. ``--help`` is
also set beside an argparse script of the same grammar (argparse's formatting as the own work),
and every round times the libraries qlagent builds on, imported alone (the CLI's; serve's).
Each figure is the median and the least of N, every ratio by the same statistic; each child runs
under GNU time (its peak RSS, ``%M``; the wrapper's fork is in every arm alike).

``serve`` to READY: ``qlagent serve`` on the edge Profile over 50 cron Tasks, from the spawn to
the ``READY=1`` datagram on a NOTIFY_SOCKET the bench owns (``WATCHDOG_USEC`` set as systemd
does), its VmRSS then, SIGTERM after; the ratio is to "pass" of the same round (goal ≤ 2).

``--cpu-quota PCT`` runs everything in a new cgroup with PCT % of one CPU (v2 ``cpu.max``, v1
``cpu.cfs_quota_us``; root; bench_forkserver.throttle): a slow CPU.

    python3 bench/bench_cli.py [-n 15] [--tree main=/work/main] [--forms pip,debian13] [--cpu-quota 10]
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
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path[:0] = [REPO, HERE]
TASKS = 50
RUNS = 1000
TIME = "/usr/bin/time"      # GNU time: the child's own peak RSS
COMMANDS = {"--version": ["--version"], "--help": ["--help"], f"run ls ({RUNS} Runs)": ["run", "ls"],
            f"task ls ({TASKS} Tasks)": ["task", "ls"]}
HELP_ARGPARSE = "--help, argparse"     # its own work done with argparse (the library that formats it)
PASS, SITE, LIBS, SERVE_LIBS = "python3 -I -S -c pass", "python3 -c pass", "CLI libraries", "serve libraries"
TASK_FILE = "".join(f'[[task]]\nname = "t{i:02d}"\nschedule = "{i} 3 * * *"\ncommand = ["/bin/true"]\n'
                    'concurrency = "parallel"\n\n' for i in range(TASKS))
SEED = ("import sys\nfrom qlagent import bootstrap\nfrom qlagent.application.runs import RunService\n"
        "from qlagent.service.config import resolve\n"
        "s = resolve(None, state_dir=sys.argv[1])\nstore = bootstrap.open_store(s, None)\n"
        f"svc = RunService(store)\nfor i in range({RUNS}):\n    svc.start(f't{{i % {TASKS}:02d}}')\n"
        "store.close()\n")



def argparse_help_script() -> str:
    """A script printing ``qlagent --help`` with argparse alone: the common options and the
    command list read from this tree's grammar, nothing of qlagent imported when it runs."""
    import argparse
    from qlagent.cli.main import COMMANDS
    from qlagent.cli.common import options
    opts = []
    for a in options()._actions:
        if a.option_strings and not isinstance(a, argparse._HelpAction):
            kw = {"help": a.help, "default": argparse.SUPPRESS}
            if a.nargs == 0:
                kw["action"] = "store_true"
            if a.choices:
                kw["choices"] = list(a.choices)
            opts.append((a.option_strings, kw))
    from qlagent import __version__
    return ("import argparse\n"
            "p = argparse.ArgumentParser(prog='qlagent', description='Schedule and run tasks on routers and edge boxes.')\n"
            f"for o, kw in {opts!r}:\n    kw['default'] = argparse.SUPPRESS\n    p.add_argument(*o, **kw)\n"
            f"p.add_argument('--version', action='version', version='qlagent {__version__}')\n"
            "sub = p.add_subparsers(dest='command', required=True, metavar='COMMAND')\n"
            f"for name, (_, h) in {COMMANDS!r}.items():\n    sub.add_parser(name, help=h)\n"
            "p.parse_args(['--help'])\n")


# What serve imports before READY=1 that is not qlagent's: the models' msgspec, the store's sqlite3
# and thread, the loop's selectors and signals (psutil and subprocess wait for the first Run or a
# stray found at the start). Its time beside serve's says how much of the start is qlagent's own.
SERVE_LIBRARIES = "msgspec, sqlite3, threading, queue, selectors, socket, signal"

# The bare scripts: the command's own work with the libraries it needs, nothing of qlagent.
TABLE = '''
def table(rows, header):
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    for r in [header, *rows]:
        print("  ".join(str(x).ljust(w) for x, w in zip(r, widths)).rstrip())
def fmt(us):
    import datetime as dt
    return "-" if us is None else dt.datetime.fromtimestamp(us / 1e6, dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
'''
BARE = {
    "--version": "import sys\nsys.stdout.buffer.write(open(sys.argv[1], 'rb').read())\n",
    "--help": "import sys\nsys.stdout.buffer.write(open(sys.argv[1], 'rb').read())\n",
    "run ls": TABLE + '''
import sqlite3, sys
c = sqlite3.connect(sys.argv[1])
c.row_factory = sqlite3.Row
(project,) = c.execute("SELECT project_id FROM projects WHERE name = 'default'").fetchone()
rows = c.execute(sys.argv[2], (project, 51)).fetchall()
table([[r["run_id"], r["task_name"], r["state"], r["trigger_type"], fmt(r["created_at_us"]),
        str(r["exit_code"]) if r["exit_code"] is not None else f"sig{r['exit_signal']}" if r["exit_signal"] else "-"]
       for r in rows[:50]], ["RUN", "TASK", "STATE", "TRIGGER", "CREATED", "EXIT"])
if len(rows) > 50:
    print(f"(more: --cursor {rows[49]['created_at_us']}.{rows[49]['run_id']})")
''',
    "task ls": TABLE + '''
import datetime as dt, json, sqlite3, sys, time, zoneinfo
sys.path.append(sys.argv[4])                      # cronsim, where the interpreter's packages are
from cronsim import CronSim
c = sqlite3.connect(sys.argv[1])
c.row_factory = sqlite3.Row
(project,) = c.execute("SELECT project_id FROM projects WHERE name = 'default'").fetchone()
now = time.time()
rows = []
for h in c.execute(sys.argv[2], (project, project)):
    d = json.loads(h["definition_json"])
    zone = zoneinfo.ZoneInfo(d.get("timezone") or sys.argv[3])
    start = dt.datetime.fromtimestamp(now, zone).replace(microsecond=0)
    nxt = min(next(CronSim(s, start)) for s in d["schedules"]) if h["enabled"] else None
    rows.append([h["name"], str(h["head_revision"]), h["content_digest"][:12], "yes" if h["enabled"] else "no",
                 " | ".join(d["schedules"]), fmt(int(nxt.timestamp() * 1e6)) if nxt else "-"])
table(rows, ["NAME", "REV", "DIGEST", "ENABLED", "SCHEDULE", "NEXT"])
''',
}


class Form:
    """One way of installing qlagent: how to run each tree's ``qlagent`` and its interpreter.
    ``scratch`` is a directory as the interpreter sees it; ``root`` prefixes it outside."""

    def __init__(self, name: str, python: list[str], root: str, scratch: str) -> None:
        self.name, self.python, self.root, self.scratch = name, python, root, scratch
        os.makedirs(self.outside(scratch), exist_ok=True)
        self.state = f"{scratch}/state"            # the CLI's store: 50 Tasks, 1,000 queued Runs
        self.serve_state = f"{scratch}/serve"      # serve's: the 50 cron Tasks only

    def outside(self, inner: str) -> str:
        return self.root + inner

    def qlagent(self, tree: str, *args: str, state: str | None = None) -> tuple[list[str], dict]:
        """argv and environment of ``qlagent ARGS`` (over ``state``, default the CLI's store)."""
        raise NotImplementedError

    def python_argv(self, tree: str, *args: str) -> tuple[list[str], dict]:
        raise NotImplementedError

    def run(self, tree: str, *args: str, code: str | None = None, state: str | None = None) -> bytes:
        argv, env = self.qlagent(tree, *args, state=state) if code is None else self.python_argv(tree, "-c", code,
                                                                                                   *args)
        p = subprocess.run(argv, env=env, capture_output=True, cwd="/")
        if p.returncode != 0:
            raise SystemExit(f"{self.name} {tree}: {' '.join(args)} exited {p.returncode}: {p.stderr.decode()[-800:]}")
        return p.stdout


class PipForm(Form):
    def __init__(self, tmp: str, trees: dict[str, str]) -> None:
        self.venvs = {}
        for name, path in trees.items():
            src = os.path.join(tmp, f"src-{name}")        # a copy: pip builds in the tree it is given
            os.makedirs(src)
            for f in ("pyproject.toml", "README.md"):
                shutil.copy(os.path.join(path, f), src)
            shutil.copytree(os.path.join(path, "qlagent"), os.path.join(src, "qlagent"),
                            ignore=shutil.ignore_patterns("__pycache__"))
            venv = os.path.join(tmp, f"venv-{name}")
            subprocess.run([sys.executable, "-m", "venv", venv], check=True)
            subprocess.run([f"{venv}/bin/pip", "install", "-q", "--disable-pip-version-check", src], check=True,
                           capture_output=True)
            self.venvs[name] = venv
        super().__init__("pip", [f"{next(iter(self.venvs.values()))}/bin/python"], "", os.path.join(tmp, "pip"))
        self.libraries = "argparse, msgspec, sqlite3"
        self.serve_libraries = SERVE_LIBRARIES
        for venv in self.venvs.values():       # bytecode as a package ships it (PYTHONDONTWRITEBYTECODE may be set)
            self.packages = subprocess.run([f"{venv}/bin/python", "-c", "import sysconfig; print(sysconfig.get_paths()"
                                            "['purelib'])"], check=True, capture_output=True, text=True).stdout.strip()
            subprocess.run([f"{venv}/bin/python", "-m", "compileall", "-q", f"{self.packages}/qlagent"], check=True)

    def qlagent(self, tree, *args, state=None):
        return [f"{self.venvs[tree]}/bin/qlagent", "--state-dir", state or self.state, *args], clean_env()

    def python_argv(self, tree, *args):
        return [f"{self.venvs[tree]}/bin/python", *args], clean_env()


class DebianForm(Form):
    def __init__(self, tmp: str, trees: dict[str, str]) -> None:
        from bench_idle import TrixieRoot
        self.trixie = TrixieRoot(tmp, None, trees)
        super().__init__("debian13", ["chroot", self.trixie.root, "/usr/bin/python3"], self.trixie.root,
                         "/tmp/qlbench-cli")
        self.packages = "/usr/lib/python3/dist-packages"
        self.libraries = "argparse, msgspec, sqlite3, tomllib"     # tomllib: the package's config file
        self.serve_libraries = SERVE_LIBRARIES + ", tomllib"
        os.makedirs(self.outside("/etc/qlagent"), exist_ok=True)
        with open(os.path.join(REPO, "packaging", "qlagent.toml")) as f:
            conf = f.read().replace('"/var/lib/qlagent', f'"{self.state}')
        with open(self.outside("/etc/qlagent/qlagent.toml"), "w") as f:
            f.write(conf)

    def qlagent(self, tree, *args, state=None):
        # The package's config names the CLI's store; serve's is given on the command line.
        return (["chroot", self.root, "/usr/bin/qlagent", *(["--state-dir", state] if state else []), *args],
                clean_env(PYTHONPATH=f"/opt/{tree}"))

    def python_argv(self, tree, *args):
        return [*self.python, *args], clean_env(PYTHONPATH=f"/opt/{tree}")

    def close(self) -> None:
        self.trixie.close()


class InstalledForm(Form):
    """The package as this box installed it (the router guest: apt install of build-deb's .deb):
    ``/usr/bin/qlagent`` reading ``/etc/qlagent/qlagent.toml``, which this rewrites with its
    ``state_dir`` pointed at the bench's store, as DebianForm does in its rootfs — so only on a box
    whose agent is stopped and whose configuration may go (the guest's throwaway overlay). One
    tree: what is installed, whatever ``tree`` says."""

    PYTHON, QLAGENT, CONFIG = "/usr/bin/python3", "/usr/bin/qlagent", "/etc/qlagent/qlagent.toml"
    PACKAGES = "/usr/lib/python3/dist-packages"

    def __init__(self, tmp: str) -> None:
        super().__init__("installed", [self.PYTHON], "", os.path.join(tmp, "installed"))
        self.packages = self.PACKAGES
        self.libraries = "argparse, msgspec, sqlite3, tomllib"     # tomllib: the package's config file
        self.serve_libraries = SERVE_LIBRARIES + ", tomllib"
        with open(self.CONFIG) as f:
            conf = f.read().replace('"/var/lib/qlagent', f'"{self.state}')
        with open(self.CONFIG, "w") as f:
            f.write(conf)

    def qlagent(self, tree, *args, state=None):
        return [self.QLAGENT, *(["--state-dir", state] if state else []), *args], clean_env()

    def python_argv(self, tree, *args):
        return [*self.python, *args], clean_env()


def clean_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("QLAGENT_", "NOTIFY_SOCKET", "WATCHDOG_", "PYTHON"))}
    return {**env, **extra}


def timed(argv: list[str], env: dict, rss_file: str, out: str | None = None) -> tuple[float, int | None]:
    """(wall seconds, peak RSS KiB) of one child; its stdout to ``out`` (a file) or nowhere.
    The RSS under GNU time (its fork in every arm alike); a box without it (the router guest has
    no `time` package) gives the time alone and None: wait4's ``ru_maxrss`` would carry this
    process's own high-water mark, which the child's first exec records from the mm it leaves."""
    with open(out or os.devnull, "wb") as f:
        t0 = time.perf_counter()
        if os.path.exists(TIME):
            rc = subprocess.run([TIME, "-f", "%M", "-o", rss_file, *argv], env=env, cwd="/", stdout=f,
                                stderr=subprocess.DEVNULL).returncode
        else:
            rc = subprocess.run(argv, env=env, cwd="/", stdout=f, stderr=subprocess.DEVNULL).returncode
        wall = time.perf_counter() - t0
    if rc != 0:
        raise SystemExit(f"{' '.join(argv)} exited {rc}")
    if not os.path.exists(TIME):
        return wall, None
    with open(rss_file) as f:
        return wall, int(f.read().split()[-1])


def seed(form: Form, tree: str) -> dict[str, list[str]]:
    """The CLI's store (TASKS Tasks, RUNS queued Runs) and serve's (the TASKS cron Tasks); returns
    the bare scripts' argv per command."""
    with open(form.outside(f"{form.scratch}/tasks.toml"), "w") as f:
        f.write(TASK_FILE)
    for state in (form.state, form.serve_state):
        form.run(tree, "init", state=state)
        form.run(tree, "task", "add", "-f", f"{form.scratch}/tasks.toml", state=state)
    form.run(tree, form.state, code=SEED)
    from qlagent.adapters.rows.queries import RUNS_PAGE
    from qlagent.adapters.sqlite.queries import HEADS_LIVE
    zone = form.run(tree, code="from qlagent.application.schedules import system_timezone; print(system_timezone())")
    files = {}
    for args in (["--help"], ["--version"]):
        files[args[0]] = f"{form.scratch}/{args[0].strip('-')}.txt"
        with open(form.outside(files[args[0]]), "wb") as f:
            f.write(form.run(tree, *args))
    db = f"{form.state}/qlagent.db"
    args = {"--version": [files["--version"]], "--help": [files["--help"]], "run ls": [db, RUNS_PAGE],
            "task ls": [db, HEADS_LIVE, zone.decode().strip(), form.packages]}
    bare = {}
    for label in COMMANDS:
        key = label.split(" (")[0]
        path = f"{form.scratch}/bare-{key.strip('-').replace(' ', '-')}.py"
        with open(form.outside(path), "w") as f:
            f.write(BARE[key])
        bare[label] = [*form.python, "-I", "-S", path, *args[key]]
    path = f"{form.scratch}/bare-help-argparse.py"
    with open(form.outside(path), "w") as f:
        f.write(argparse_help_script())
    bare[HELP_ARGPARSE] = [*form.python, "-I", "-S", path]
    return bare


def check_same_output(form: Form, trees: list[str], bare: dict[str, list[str]]) -> None:
    """Each bare script prints exactly what every tree's qlagent prints (same job, same bytes)."""
    for label, args in [*COMMANDS.items(), (HELP_ARGPARSE, ["--help"])]:
        want = subprocess.run(bare[label], env=clean_env(), capture_output=True, check=True, cwd="/").stdout
        for tree in trees if not label.startswith("--") else trees[:1]:    # texts may differ between trees
            got = form.run(tree, *args)
            if got != want:
                raise SystemExit(f"{form.name}: the bare {label!r} printed other bytes than {tree}'s qlagent")


class Notify:
    """The NOTIFY_SOCKET a ``serve`` reports READY=1 to (bound outside, named as seen inside)."""

    def __init__(self, form: Form) -> None:
        self.inner = f"{form.scratch}/notify.sock"
        self.s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.s.bind(form.outside(self.inner))

    def wait_ready(self, p: subprocess.Popen, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            self.s.settimeout(max(0.01, min(0.5, deadline - time.monotonic())))
            try:
                if b"READY=1" in self.s.recv(65536).split(b"\n"):
                    return
            except TimeoutError:
                if p.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"serve exited {p.returncode} or never said READY=1") from None

    def drain(self) -> None:
        self.s.setblocking(False)
        try:
            while self.s.recv(65536):
                pass
        except BlockingIOError:
            pass


def ready_time(form: Form, tree: str, notify: Notify) -> tuple[float, int]:
    """(seconds from spawn to READY=1, VmRSS KiB then) of one ``serve``, drained by SIGTERM after."""
    argv, env = form.qlagent(tree, "--profile", "edge", "serve", state=form.serve_state)
    notify.drain()
    t0 = time.perf_counter()
    p = subprocess.Popen(argv, env={**env, "NOTIFY_SOCKET": notify.inner, "WATCHDOG_USEC": "30000000"},
                         cwd="/", stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        notify.wait_ready(p)
        wall = time.perf_counter() - t0
        with open(f"/proc/{p.pid}/status") as f:
            rss = next(int(ln.split()[1]) for ln in f if ln.startswith("VmRSS:"))
        p.send_signal(signal.SIGTERM)
        if p.wait(60) != 0:
            raise SystemExit(f"{form.name} {tree}: serve exited {p.returncode} after SIGTERM")
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    return wall, rss


def measure(form: Form, trees: list[str], n: int, serve: bool) -> dict:
    bare = seed(form, trees[0])
    check_same_output(form, trees, bare)
    rss_file = form.outside(f"{form.scratch}/rss")
    arms: dict[tuple[str, str], tuple[list[str], dict]] = {
        ("-", PASS): ([*form.python, "-I", "-S", "-c", "pass"], clean_env()),
        ("-", SITE): ([*form.python, "-c", "pass"], clean_env()),
        ("-", LIBS): ([*form.python, "-c", f"import {form.libraries}"], clean_env())}
    if serve:
        arms[("-", SERVE_LIBS)] = ([*form.python, "-c", f"import {form.serve_libraries}"], clean_env())
    arms[("bare", HELP_ARGPARSE)] = (bare[HELP_ARGPARSE], clean_env())
    for label, args in COMMANDS.items():
        arms[("bare", label)] = (bare[label], clean_env())
        for tree in trees:
            arms[(tree, label)] = form.qlagent(tree, *args)
    times: dict[tuple[str, str], list[float]] = {k: [] for k in arms}
    rss: dict[tuple[str, str], list[int]] = {k: [] for k in arms}
    notify = Notify(form) if serve else None
    for _ in range(n):
        for key, (argv, env) in arms.items():
            w, r = timed(argv, env, rss_file)
            times[key].append(w)
            rss[key].append(r)
        if notify is not None:
            for tree in trees:
                w, r = ready_time(form, tree, notify)
                times.setdefault((tree, "serve → READY"), []).append(w)
                rss.setdefault((tree, "serve → READY"), []).append(r)
    return {"times": times, "rss": rss}


def report(form: Form, trees: list[str], res: dict) -> dict:
    """Per arm the median and the least of the N times (the least is what the work costs when
    the shared machine's other load left it alone), each as a ratio to "pass" by the same
    statistic; own work and overhead likewise. Prints the table; returns its figures:
    {"pass_ms": [med, least], "<label>": {"<arm>": {"ms": [med, least], "x_pass": [med, least],
    "overhead": [med, least] (qlagent arms), "rss_kib": median peak RSS (None: not measured, see timed)}}}."""
    times, rss = res["times"], res["rss"]
    stats = {"med": {k: statistics.median(v) for k, v in times.items()}, "min": {k: min(v) for k, v in times.items()}}
    figures: dict = {"pass_ms": [stats[st][("-", PASS)] * 1e3 for st in ("med", "min")]}

    def x_pass(key, own_key=None) -> list[float]:
        out = []
        for st in ("med", "min"):
            t, ref = stats[st][key], stats[st][("-", PASS)]
            own = 0.0 if own_key is None else stats[st][own_key] - ref
            out.append((t - own) / ref)
        return out

    def ratios(key, own_key=None) -> str:
        return " / ".join(f"{r:5.2f}×" for r in x_pass(key, own_key))

    def ms(key) -> str:
        return f"{stats['med'][key] * 1e3:7.1f} / {stats['min'][key] * 1e3:6.1f}"

    def rss_kib(key) -> int | None:
        return None if None in rss[key] else round(statistics.median(rss[key]))

    def record(label, arm, key, own_key=None) -> None:
        fig = {"ms": [stats[st][key] * 1e3 for st in ("med", "min")], "x_pass": x_pass(key),
               "rss_kib": rss_kib(key)}
        if own_key is not None:
            fig["overhead"] = x_pass(key, own_key)
        figures.setdefault(label, {})[arm] = fig

    v = times[("-", PASS)]
    for key in [("-", SITE), ("-", LIBS), ("-", SERVE_LIBS)]:
        if key in times:
            record(key[1], "-", key)
    print(f"\n== {form.name}: pass {ms(('-', PASS))} ms (median / least; range {min(v) * 1e3:.1f}–"
          f"{max(v) * 1e3:.1f}); site {ratios(('-', SITE))}; `import {form.libraries}` {ratios(('-', LIBS))}")
    print(f"{'command':<22} {'arm':<9} {'ms med / least':>16} {'× pass':>15} {'own work ms':>15} {'overhead':>15} "
          f"{'RSS KiB':>8}")
    for label in [*COMMANDS, HELP_ARGPARSE]:
        bare = ("bare", label)
        own = " / ".join(f"{(stats[st][bare] - stats[st][('-', PASS)]) * 1e3:6.1f}" for st in ("med", "min"))
        record(label, "bare", bare)
        print(f"{label:<22} {'bare':<9} {ms(bare):>16} {ratios(bare):>15} {own:>15} {'':>15} "
              f"{rss_kib(bare) or '—':>8}")
        for tree in trees:
            key = (tree, label if label != HELP_ARGPARSE else "--help")
            record(label, tree, key, bare)
            print(f"{'':<22} {tree:<9} {ms(key):>16} {ratios(key):>15} {'':>15} {ratios(key, bare):>15} "
                  f"{rss_kib(key) or '—':>8}")
    if ("-", SERVE_LIBS) in times:
        print(f"`import {form.serve_libraries}`: {ratios(('-', SERVE_LIBS))}")
    for tree in trees:
        key = (tree, "serve → READY")
        if key in times:
            record("serve → READY", tree, key)
            print(f"{'serve → READY':<22} {tree:<9} {ms(key):>16} {ratios(key):>15} {'':>15} {'':>15} "
                  f"{rss_kib(key) or '—':>8}")
    return figures


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-n", type=int, default=15, help="rounds (medians over them)")
    ap.add_argument("--tree", action="append", default=[], metavar="NAME=DIR",
                    help="another source tree to measure beside this one, interleaved")
    ap.add_argument("--forms", default="pip,debian13", help="pip, debian13 or both (comma-separated)")
    ap.add_argument("--no-serve", action="store_true", help="only the CLI commands")
    ap.add_argument("--cpu-quota", type=int, default=0, help="run under this %% of one CPU (cgroup; root)")
    a = ap.parse_args()
    trees = {"this": REPO, **dict(t.split("=", 1) for t in a.tree)}
    cg = None
    if a.cpu_quota:
        from bench_forkserver import throttle
        cg = throttle(a.cpu_quota)
    tmp = tempfile.mkdtemp(prefix="qlbench-cli-", dir="/var/tmp")
    forms: list[Form] = []
    try:
        for name in a.forms.split(","):
            forms.append(PipForm(tmp, trees) if name == "pip" else DebianForm(tmp, trees))
        print(f"{sys.version.split()[0]} bench; n={a.n}; load average {os.getloadavg()[0]:.1f}"
              + (f"; cgroup {cg} at {a.cpu_quota} % of one CPU" if cg else ""))
        results = [(f, measure(f, list(trees), a.n, not a.no_serve)) for f in forms]
        for f, res in results:
            report(f, list(trees), res)
        print(f"\nload average at the end {os.getloadavg()[0]:.1f}")
    finally:
        for f in forms:
            if isinstance(f, DebianForm):
                f.close()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
