"""What a CLI answer costs against a bare interpreter start, in the same run (issue 24 §3).

Times ``qlagent --version``, ``--help``, ``run ls`` (1,000 Runs in the store) and ``task ls``
(50 Tasks) as run from a package (``python3 -c 'from qlagent.cli.main import main; …'``, as
openwrt/ and packaging/ install it), each the median of N runs, as a ratio to the median of
``python3 -I -S -c pass`` measured interleaved with them; plus each command's peak RSS (KiB,
GNU time's ``%M``; every timing includes that wrapper). ``--tree DIR`` (repeatable) measures
another source tree (e.g. ``git archive main qlagent | tar -x -C /tmp/main``) over the same
state directory, interleaved, so a before/after comparison shares the machine's load. Every
tree is byte-compiled first, as a package ships.

    python bench/bench_cli.py [-n 15] [--tree /tmp/main]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENTRY = "import sys; from qlagent.cli.main import main; sys.exit(main())"    # as openwrt/, packaging/
TASKS = 50
RUNS = 1000
TIME = "/usr/bin/time"      # GNU time, for the child's own peak RSS


def _tree(env: dict) -> str:
    return env["PYTHONPATH"].split(":")[0]


def timed(argv: list[str], env: dict, rss_file: str) -> tuple[float, int, int]:
    """(wall seconds, peak RSS KiB, exit code) of one child, run in its tree (``-c`` puts the
    working directory first on sys.path). The RSS is GNU time's ``%M``: a child forked from this
    process would report this process's RSS as its own peak (Linux keeps the high-water mark
    across exec); time's own fork starts from its few hundred KiB."""
    t0 = time.perf_counter()
    p = subprocess.run([TIME, "-f", "%M", "-o", rss_file, *argv], env=env, cwd=_tree(env),
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wall = time.perf_counter() - t0
    with open(rss_file) as f:
        rss = int(f.read().split()[-1])
    return wall, rss, p.returncode


def seed(state: str, env: dict) -> None:
    """An initialised store with TASKS parallel Tasks and RUNS queued Runs (in-process, fast)."""
    subprocess.run([sys.executable, "-c", ENTRY, "--state-dir", state, "init"], env=env, cwd=_tree(env),
                   check=True, stdout=subprocess.DEVNULL)
    path = os.path.join(state, "tasks.toml")
    with open(path, "w") as f:
        for i in range(TASKS):
            f.write(f'[[task]]\nname = "t{i:02d}"\nschedule = "{i} 3 * * *"\ncommand = ["/bin/true"]\n'
                    'concurrency = "parallel"\n\n')
    subprocess.run([sys.executable, "-c", ENTRY, "--state-dir", state, "task", "add", "-f", path], env=env,
                   cwd=_tree(env), check=True, stdout=subprocess.DEVNULL)
    code = ("import sys\nfrom qlagent import bootstrap\nfrom qlagent.application.runs import RunService\n"
            "from qlagent.service.config import resolve\n"
            "s = resolve(None, state_dir=sys.argv[1])\nstore = bootstrap.open_store(s, None)\n"
            f"svc = RunService(store)\nfor i in range({RUNS}):\n    svc.start(f't{{i % {TASKS}:02d}}')\n"
            "store.close()\n")
    subprocess.run([sys.executable, "-c", code, state], env=env, cwd=_tree(env), check=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-n", type=int, default=15, help="runs per command (median)")
    ap.add_argument("--tree", action="append", default=[], help="another source tree to measure, interleaved")
    a = ap.parse_args()
    base = {k: v for k, v in os.environ.items() if not k.startswith("QLAGENT_")}
    trees = {"this tree": HERE, **{os.path.basename(t.rstrip("/")) or t: t for t in a.tree}}
    # As installed by a package: no editable-install finder in site (it alone costs ~35 ms here),
    # so the children run with -S and find msgspec & co. on PYTHONPATH.
    libs = sysconfig.get_paths()["purelib"]
    envs = {name: {**base, "PYTHONPATH": f"{path}:{libs}"} for name, path in trees.items()}
    for path in trees.values():      # bytecode as a package ships it (PYTHONDONTWRITEBYTECODE may be set here)
        subprocess.run([sys.executable, "-m", "compileall", "-q", os.path.join(path, "qlagent")], check=True)
    state = tempfile.mkdtemp(prefix="qlagent-bench-cli-", dir="/dev/shm" if os.access("/dev/shm", os.W_OK) else None)
    seed(state, envs["this tree"])
    commands = {"--version": ["--version"], "--help": ["--help"], f"run ls ({RUNS} Runs)": ["run", "ls"],
                f"task ls ({TASKS} Tasks)": ["task", "ls"]}
    baseline = [sys.executable, "-I", "-S", "-c", "pass"]
    times: dict[tuple[str, str], list[float]] = {}
    rss: dict[tuple[str, str], list[int]] = {}
    codes: dict[tuple[str, str], int] = {}
    for _ in range(a.n):
        for label, args in commands.items():
            for tree, env in envs.items():
                for key, argv in (((tree, label), [sys.executable, "-S", "-c", ENTRY, "--state-dir", state, *args]),
                                  (("baseline", "python3 -I -S -c pass"), baseline)):
                    w, r, codes[key] = timed(argv, env, os.path.join(state, "rss"))
                    times.setdefault(key, []).append(w)
                    rss.setdefault(key, []).append(r)
    ref = statistics.median(times[("baseline", "python3 -I -S -c pass")])
    print(f"{sys.version.split()[0]}, n={a.n}, state {state}")
    print(f"{'tree':<12} {'command':<22} {'median ms':>10} {'× pass':>7} {'RSS KiB':>8}  exit")
    for key in sorted(times, key=lambda k: (k[0] != "baseline", k[1], k[0])):
        med = statistics.median(times[key])
        rss_kib = statistics.median(rss[key])
        print(f"{key[0]:<12} {key[1]:<22} {med * 1000:>10.1f} {med / ref:>7.2f} {rss_kib:>8.0f}  {codes[key]}")


if __name__ == "__main__":
    main()
