"""The CLI loads only what the command needs (issue 24 §3).

Each case runs the real ``qlagent`` entry in a fresh interpreter over a real state directory and
prints ``sys.modules`` at exit (``--help`` and ``--version`` leave through SystemExit), so every
module a command loaded on its way — parser, configuration, store, use case, output — is seen.
A read command on a router must not pay for the HTTP server, the dispatcher, the execution
engine, the service loop, the cluster or the fleet Worker; nor for what only other commands use:
``--version`` answers before anything is imported, ``--help`` builds no store, ``run ls`` parses
no cron line (bench/bench_cli.py has the times).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from qlcli import ok

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FORBIDDEN = ("qlagent.http", "qlagent.dispatch", "qlagent.execution", "qlagent.application.engine",
             "qlagent.service.main", "qlagent.service.controlplane", "qlagent.service.worker_mode",
             "qlagent.cluster", "qlagent.core.cluster", "qlagent.worker",
             "qlagent.adapters.postgres", "qlagent.adapters.control_client", "qlagent.adapters.processes",
             "psycopg", "http.server", "socketserver", "selectors", "ssl",
             # what argparse would load to size its help (cli.common.help_width) and the budget's meter
             "shutil", "bz2", "lzma", "psutil")
# Beyond FORBIDDEN, per command: the other commands' libraries. No config file here, so no tomllib.
ALSO_FORBIDDEN = {
    "--version": ("argparse", "re", "typing", "msgspec", "qlagent.core", "qlagent.cli.common"),
    "--help": ("msgspec", "sqlite3", "tomllib", "typing", "zoneinfo", "cronsim", "qlagent.core.models",
               "qlagent.adapters", "qlagent.service", "qlagent.cli.run", "qlagent.cli.task"),
    "run ls": ("tomllib", "zoneinfo", "cronsim", "qlagent.core.schedule", "qlagent.cli.task"),
    "task ls": ("tomllib", "qlagent.cli.run"),
}
# The probe itself imports nothing the interpreter has not loaded (json would bring re).
BARE = 'import atexit, os, sys\natexit.register(lambda: open(os.environ["MODULES_OUT"], "w").write(" ".join(sys.modules)))\n'
PROBE = BARE + "from qlagent.cli.main import main\nsys.exit(main(sys.argv[1:]))\n"
TASK = b'''
[[task]]
name = "t"
schedule = "0 3 * * *"
command = ["/bin/true"]
'''


def _run(code: str, *args: str) -> tuple[subprocess.CompletedProcess, set[str]]:
    out = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"modules-{os.getpid()}.txt")
    env = {k: v for k, v in os.environ.items() if not k.startswith("QLAGENT_")}
    p = subprocess.run([sys.executable, "-c", code, *args], cwd=REPO, env={**env, "MODULES_OUT": out},
                       capture_output=True, timeout=60)
    try:
        with open(out) as f:
            return p, set(f.read().split())
    finally:
        os.unlink(out)


def modules_of(state: str | None, *args: str) -> tuple[subprocess.CompletedProcess, list[str]]:  # noqa: F811
    """Run ``qlagent [--state-dir STATE] ARGS``; (the process, the modules loaded by its exit
    that the interpreter had not loaded by itself: site, a dev install's path hooks)."""
    p, loaded = _run(PROBE, *(["--state-dir", state] if state else []), *args)
    return p, sorted(loaded - _run(BARE)[1])


@pytest.mark.parametrize("args,shows", [
    (["--version"], b"qlagent "),
    (["--help"], b"run "),
    (["run", "ls"], b"task_start"),
    (["task", "ls"], b"0 3 * * *"),
], ids=["--version", "--help", "run ls", "task ls"])
def test_a_read_command_loads_no_server_dispatcher_cluster_or_worker(state, tmp_path, args, shows):  # noqa: F811
    task = tmp_path / "t.toml"
    task.write_bytes(TASK)
    ok(state, "task", "add", "-f", str(task))
    ok(state, "run", "start", "t")
    # `qlagent --version` as typed: alone (with any other word argparse answers it)
    p, loaded = modules_of(None if args == ["--version"] else state, *args)
    assert p.returncode == 0 and shows in p.stdout, p.stderr
    forbidden = FORBIDDEN + ALSO_FORBIDDEN[" ".join(args)]
    assert [m for m in loaded if any(m == f or m.startswith(f + ".") for f in forbidden)] == []


def test_version_is_the_packages_and_exits_0():
    from qlagent import __version__
    p = subprocess.run([sys.executable, "-m", "qlagent.cli.main", "--version"], capture_output=True, timeout=60)
    assert (p.returncode, p.stdout, p.stderr) == (0, f"qlagent {__version__}\n".encode(), b"")


# Command lines the first-word scan reads differently from argparse (an abbreviated option, an
# option's value that names a command, --help after a command) or not at all.
ARGV = [
    ["run", "ls", "--limit", "5"],
    ["--state-dir", "/s", "task", "show", "x"],
    ["--state-dir", "run", "task", "ls"],
    ["--state", "/s", "run", "ls"],
    ["--stat=/s", "--json", "secret", "ls"],
    ["--proj", "p", "token", "create", "--subject", "s", "--role", "viewer"],
    ["--config=/c.toml", "workers", "ls"],
    ["--json", "role", "set", "alice", "none"],
    ["config", "check", "--as-user", "nobody"],
]


@pytest.mark.parametrize("argv", ARGV, ids=" ".join)
def test_a_command_line_parses_as_with_the_whole_grammar(argv):
    from qlagent.cli.main import build_parser, parse
    _, args = parse(argv)
    assert vars(args) == vars(build_parser().parse_args(argv))


@pytest.mark.parametrize("argv", [["run", "--help"], ["--state", "/s", "run", "ls", "--help"], ["--help"]],
                         ids=" ".join)
def test_help_is_the_whole_grammars(argv, capsys):
    from qlagent.cli.main import build_parser, parse
    with pytest.raises(SystemExit) as e:
        parse(argv)
    ours = capsys.readouterr().out
    with pytest.raises(SystemExit):
        build_parser().parse_args(argv)
    assert (e.value.code, ours) == (0, capsys.readouterr().out) and "usage: qlagent" in ours
