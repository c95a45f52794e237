"""examples/router-tasks.toml: loads, every task valid, one Task per script of
examples/router-tasks/ named after it, each inlined script is that script, and it works from any
directory (issue 2 §6)."""

from __future__ import annotations

import json
import os
import subprocess
import tomllib

import pytest
from qlcli import js, ok

from qlagent.application.definitions import DefinitionWriter
from qlagent.core.limits import DEFAULT_PATH

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(REPO, "examples", "router-tasks.toml")
SCRIPTS = os.path.join(REPO, "examples", "router-tasks")


def load() -> dict:
    with open(EXAMPLE, "rb") as f:
        return tomllib.load(f)


def prepared() -> dict:
    return {p.definition.name: p for p in DefinitionWriter.prepare_file(load())}


def code_lines(text: str) -> list[str]:
    """Lines that carry behaviour: no shebang, comments, docstring or blank lines; trailing space cut."""
    out = []
    for line in text.splitlines():
        s = line.rstrip()
        if s and not s.lstrip().startswith("#") and not s.startswith('"""'):
            out.append(s)
    return out


def test_every_task_is_valid_and_names_match_the_scripts():
    names = list(prepared())
    scripts = sorted(os.path.splitext(f)[0] for f in os.listdir(SCRIPTS) if f.endswith((".sh", ".py")))
    assert sorted(names) == scripts
    assert set(scripts) == {"heartbeat", "backup-config", "wan-check", "ddns-update", "chatty", "no-newline",
                            "hang", "spawn-tree", "fail", "slow"}


def test_inlined_scripts_are_the_fixture_scripts():
    tasks = {t["name"]: t for t in load()["task"]}
    for name, t in tasks.items():
        assert t["shell"] == "/bin/sh" and "command" not in t, name
        path = os.path.join(SCRIPTS, name + (".py" if name == "wan-check" else ".sh"))
        with open(path) as f:
            expected = code_lines(f.read())
        got = code_lines(t["script"])
        if name == "wan-check":
            assert got[0] == "exec python3 - <<'PY'" and got[-1] == "PY"
            got = got[1:-1]
        assert got == expected, name


def test_schedules_timeouts_secrets_and_network_follow_the_readme():
    p = prepared()

    def d(n):
        return p[n].definition
    assert d("heartbeat").schedules == ("* * * * *",)
    assert d("backup-config").schedules == ("30 3 * * *",)
    assert p["backup-config"].recipe.public == {"BACKUP_DIR": "/tmp/qlagent-backup", "PATH": DEFAULT_PATH}
    assert d("wan-check").schedules == ("*/5 * * * *",) and d("wan-check").network.require == "default_route"
    assert d("ddns-update").schedules == ("*/10 * * * *",) and d("ddns-update").network.require == "default_route"
    assert p["ddns-update"].recipe.secret_refs == {"DDNS_TOKEN": "ddns_token"}
    assert p["ddns-update"].recipe.public == {"PATH": DEFAULT_PATH}
    for manual in ("chatty", "no-newline", "hang", "spawn-tree"):
        assert d(manual).schedules == ("@once",), manual
    assert d("hang").timeout_ms == 2000
    assert d("fail").schedules == ("0 * * * *",)
    assert d("slow").schedules == ("* * * * *",) and d("slow").concurrency == "single"
    assert d("slow").timeout_ms > 90_000                  # it sleeps 90 s and must finish


def test_adds_through_the_cli_from_another_directory(state, workdir, monkeypatch):
    monkeypatch.chdir(workdir)            # the child inherits this cwd
    ok(state, "task", "add", "-f", EXAMPLE)
    heads = js(state, "task", "ls")["items"]
    assert sorted(h["name"] for h in heads) == sorted(prepared())
    assert all(h["revision"] == 1 for h in heads)


def _sh(script: str, env: dict, cwd: str) -> subprocess.CompletedProcess:
    """The launch argv of a shell task (``shell -c script``) with only the recipe's environment."""
    return subprocess.run(["/bin/sh", "-c", script], env=env, cwd=cwd, capture_output=True, timeout=30)


@pytest.mark.parametrize("name", ["heartbeat", "fail", "ddns-update", "wan-check", "backup-config"])
def test_inlined_scripts_run_from_anywhere(name, workdir):
    p = prepared()[name]
    env = dict(p.recipe.public)
    if name == "ddns-update":
        env["DDNS_TOKEN"] = "t0k3n"
    if name == "backup-config":
        src = os.path.join(workdir, "etc")
        os.mkdir(src)
        with open(os.path.join(src, "network"), "w") as f:
            f.write("config interface 'wan'\n")
        env.update(BACKUP_DIR=os.path.join(workdir, "backups"), CONFIG_DIR=src)
    r = _sh(p.definition.execution.script, env, workdir)
    out = r.stdout.decode()
    if name == "fail":
        assert r.returncode == 3 and b"about to fail" in r.stderr
        return
    assert r.returncode == 0, r.stderr
    if name == "heartbeat":
        assert out.startswith("heartbeat ") and "load=" in out
    elif name == "ddns-update":
        assert out == "ddns: token present (5 chars), host=unset\n" and "t0k3n" not in out
    elif name == "wan-check":
        assert set(json.loads(out)) == {"default_route"}
    elif name == "backup-config":
        assert out.startswith("wrote ") and len(os.listdir(os.path.join(workdir, "backups"))) == 1
