"""``--project NAME`` never creates a Project by accident (`qlagent --project zz1 run start
one` exits 4 and leaves no Project zz1 behind). Through the real CLI on a real state
dir: a command that only acts on what a Project holds refuses an unknown one (exit 4, one line,
nothing written); a command that defines things in a Project creates it only when it succeeds."""

from __future__ import annotations

import os
import sqlite3

from qlcli import cli, ok

TASK = '[[task]]\nname = "one"\ncommand = ["/bin/true"]\n'
# Refused after the store is open (the local authority runs no remote_worker Task).
REMOTE = '[[task]]\nname = "one"\nshell = "/bin/sh"\nscript = "true"\nexecutor = "remote_worker"\n'
FENCE = ("--expect-revision", "1", "--expect-digest", "0" * 64)


def acting_commands(task_file: str) -> list[tuple[str, ...]]:
    """Commands that act on what a Project already holds (never create it)."""
    return [("run", "start", "one"), ("run", "cancel", "01JAAAAAAAAAAAAAAAAAAAAAAA"), ("run", "ls"),
            ("run", "show", "01JAAAAAAAAAAAAAAAAAAAAAAA"), ("run", "logs", "01JAAAAAAAAAAAAAAAAAAAAAAA"),
            ("task", "rm", "one"), ("task", "edit", "one", "-f", task_file, *FENCE), ("task", "enable", "one"),
            ("task", "disable", "one"), ("task", "show", "one"), ("task", "ls"), ("secret", "rm", "S1"),
            ("secret", "ls"), ("token", "ls"), ("token", "revoke", "01JAAAAAAAAAAAAAAAAAAAAAAA"),
            ("role", "set", "alice", "none")]


def projects(state: str) -> list[tuple]:
    with sqlite3.connect(os.path.join(state, "qlagent.db")) as c:
        return c.execute("SELECT * FROM projects ORDER BY name").fetchall()


def _write(workdir: str, name: str, text: str) -> str:
    path = os.path.join(workdir, name)
    with open(path, "w") as f:
        f.write(text)
    return path


def test_commands_acting_in_an_unknown_project_are_not_found_and_create_none(state, workdir):
    task_file = _write(workdir, "one.toml", TASK)
    before = projects(state)
    assert [p[1] for p in before] == ["default"]
    for args in acting_commands(task_file):
        p = cli(state, "--project", "zz1", *args)
        assert (p.returncode, p.stdout, p.stderr) == (4, b"", b"qlagent: error: project 'zz1' does not exist\n"), args
        assert projects(state) == before, args


def test_defining_commands_create_the_project_only_when_they_succeed(state, workdir):
    bad = _write(workdir, "bad.toml", '[[task]]\nname = "one"\n')
    remote = _write(workdir, "remote.toml", REMOTE)
    good = _write(workdir, "one.toml", TASK)
    before = projects(state)
    refused = [(("task", "add", "-f", bad), None, 2), (("task", "add", "-f", remote), None, 2),
               (("secret", "set", "S1"), b"", 2), (("token", "create", "--subject", "", "--role", "viewer"), None, 2),
               (("token", "create", "--subject", "x" * 129, "--role", "viewer"), None, 2),
               (("role", "set", "", "viewer"), None, 2)]
    for args, stdin, code in refused:
        p = cli(state, "--project", "nosuch8", *args, stdin=stdin)
        assert p.returncode == code and len(p.stderr.splitlines()) == 1, (args, p.stderr)
        assert b"Traceback" not in p.stderr
        assert projects(state) == before, args
    # A malformed Project name is refused before anything is written, as before.
    p = cli(state, "--project", "no such", "task", "add", "-f", good)
    assert p.returncode == 2 and b"project" in p.stderr and projects(state) == before

    ok(state, "--project", "p-task", "task", "add", "-f", good)
    assert [h.split()[0] for h in ok(state, "--project", "p-task", "task", "ls").stdout.decode().splitlines()] \
        == ["NAME", "one"]
    ok(state, "--project", "p-secret", "secret", "set", "S1", stdin=b"v")
    assert b"S1" in ok(state, "--project", "p-secret", "secret", "ls").stdout
    ok(state, "--project", "p-token", "token", "create", "--subject", "alice", "--role", "viewer")
    assert b"alice" in ok(state, "--project", "p-token", "token", "ls").stdout
    ok(state, "--project", "p-role", "role", "set", "alice", "viewer")
    assert [p[1] for p in projects(state)] == ["default", "p-role", "p-secret", "p-task", "p-token"]
    # An existing Project is used as it is, not created again.
    ok(state, "--project", "p-task", "secret", "set", "S2", stdin=b"v")
    assert [p[1] for p in projects(state)] == ["default", "p-role", "p-secret", "p-task", "p-token"]


def test_init_creates_the_configured_project_as_before(workdir):
    s = os.path.join(workdir, "fresh")
    ok(s, "init")
    assert [p[1] for p in projects(s)] == ["default"]
    assert ok(s, "task", "ls").returncode == 0
