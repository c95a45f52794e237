"""The CLI on a router configured as a fleet Worker (``[worker]``), through the real command on
real files: the commands that act on the local store (task, secret, run, token, role, import)
are refused before anything is opened (exit 2, one stderr line naming ``[worker]`` and the
control plane, ``--json`` the usual error object, the state tree unchanged); ``init`` creates
the state directory only (exit 0: the package's postinst runs it) and no database or key file.
The doctor of a Worker against a real control plane is in tests/cluster/test_worker_doctor.py."""

from __future__ import annotations

import json
import os

import pytest
from qlcli import cli
from test_cli_errors import tree_digest

WORKER_ID = "3f0c0000-0000-4000-8000-000000000001"
TASK = '[[task]]\nname = "t"\ncommand = ["/bin/true"]\n'


@pytest.fixture
def worker(workdir):
    """(state dir, config path, scratch dir) of a Worker whose control plane is not running."""
    cred = os.path.join(workdir, "worker.credential")
    fd = os.open(cred, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.write(fd, b"qlw_" + b"a" * 43 + b"\n")
    os.close(fd)
    config = os.path.join(workdir, "w.toml")
    with open(config, "w") as f:
        f.write(f'[worker]\nworker_id = "{WORKER_ID}"\ncontrol_url = ["http://127.0.0.1:9", "http://[::1]:9"]\n'
                f'credential_file = "{cred}"\n')
    os.chmod(config, 0o600)
    with open(os.path.join(workdir, "t.toml"), "w") as f:
        f.write(TASK)
    return os.path.join(workdir, "state"), config, workdir


# One command of every local-store group (and the trap of the field report: task add, run start).
REFUSED = [("task", "add", "-f", "{dir}/t.toml"), ("task", "ls"), ("task", "show", "t"),
           ("secret", "set", "TOKEN"), ("secret", "ls"), ("secret", "rm", "TOKEN"),
           ("run", "start", "t"), ("run", "ls"), ("run", "show", "r"), ("run", "logs", "r"), ("run", "cancel", "r"),
           ("token", "create", "--subject", "a", "--role", "viewer"), ("token", "ls"), ("token", "revoke", "x"),
           ("role", "set", "a", "viewer"), ("import", "qinglong", "{dir}/panel")]


@pytest.mark.parametrize("as_json", [False, True], ids=["text", "json"])
@pytest.mark.parametrize("argv", REFUSED, ids=[" ".join(a[:2]) for a in REFUSED])
def test_a_local_store_command_on_a_worker_is_refused_and_writes_nothing(worker, argv, as_json):
    state, config, d = worker
    assert cli(state, "--config", config, "init").returncode == 0
    before = tree_digest(d)
    args = (["--json"] if as_json else []) + [a.format(dir=d) for a in argv]   # (secret set swallows what follows)
    p = cli(state, "--config", config, *args, stdin=b"value")
    err = p.stderr.decode()
    assert p.returncode == 2, (args, p.stdout, err)
    assert err.count("\n") == 1 and err.startswith("qlagent: error: worker: ") and "Traceback" not in err, err
    assert "[worker]" in err and "control plane" in err and "http://127.0.0.1:9, http://[::1]:9" in err, err
    assert f"`qlagent {argv[0]} {argv[1]}`" in err, err
    if as_json:
        doc = json.loads(p.stdout)
        assert doc["error"]["code"] == "worker_mode" and doc["error"]["field"] == "worker", doc
        assert doc["error"]["message"] == err[len("qlagent: error: "):].rstrip("\n")
    else:
        assert p.stdout == b""
    assert tree_digest(d) == before
    assert sorted(os.listdir(state)) == []         # no qlagent.db, no secret.key, no inbox


def test_the_refusal_comes_before_the_state_dir_is_even_created(worker):
    state, config, d = worker
    p = cli(state, "--config", config, "run", "start", "t")
    assert p.returncode == 2 and not os.path.exists(state), p.stderr


def test_init_on_a_worker_creates_the_state_dir_only_and_exits_0(worker):
    state, config, _ = worker
    p = cli(state, "--config", config, "init")
    out = p.stdout.decode()
    assert p.returncode == 0 and p.stderr == b"", (out, p.stderr)
    assert "fleet Worker" in out and WORKER_ID in out and "http://127.0.0.1:9, http://[::1]:9" in out, out
    assert "no database, no key file" in out and f"{state} (created)" in out, out
    assert os.stat(state).st_mode & 0o777 == 0o700
    assert os.listdir(state) == []
    again = cli(state, "--config", config, "init", "--json")       # postinst runs it on every upgrade
    assert again.returncode == 0, again.stderr
    doc = json.loads(again.stdout)
    assert doc == {"stateDir": state, "stateDirCreated": False, "database": None, "keyFile": None,
                   "keyCreated": False, "migrationsApplied": [], "profile": "edge", "secretsReencrypted": 0,
                   "role": "worker", "workerId": WORKER_ID,
                   "controlUrls": ["http://127.0.0.1:9", "http://[::1]:9"]}
    assert os.listdir(state) == []


def test_config_check_and_the_workers_command_are_not_local_store_commands(worker):
    state, config, _ = worker
    assert cli(state, "--config", config, "config", "check").returncode == 0
    p = cli(state, "--config", config, "workers", "ls")         # its own refusal: no [cluster]
    assert p.returncode == 2 and b"[cluster]" in p.stderr and not os.path.exists(state), p.stderr


def test_doctor_on_a_worker_checks_the_worker_not_a_local_store(worker):
    state, config, _ = worker
    assert cli(state, "--config", config, "init").returncode == 0
    p = cli(state, "--config", config, "doctor")
    out = p.stdout.decode()
    assert p.returncode == 5, out
    assert "qlagent init" not in out and "key file" not in out and "database" not in out, out
    lines = {ln.split()[1]: ln for ln in out.splitlines()}
    assert lines["credential"].startswith("ok") and lines["inbox"].startswith("ok"), out
    fails = [ln for ln in out.splitlines() if ln.startswith("FAIL")]
    assert [ln.split()[1] for ln in fails] == ["control", "control"], out
    assert "http://127.0.0.1:9:" in fails[0] and "http://[::1]:9:" in fails[1], out
    assert os.listdir(state) == []              # doctor creates nothing (no inbox)
