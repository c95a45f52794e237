"""Task definitions through the real CLI (subprocess) on a real SQLite file (issue 2 §4, §5).

Exit codes per docs/ARCHITECTURE.md: 0 ok, 2 bad input, 3 conflict, 4 not found, 5 unavailable.
"""

from __future__ import annotations

import json
import os
import sqlite3
from datetime import datetime

import pytest
from qlcli import cli, js, ok, rows

THREE_TASKS = """
[[task]]
name = "alpha"
schedule = "*/5 * * * *"
command = ["/bin/echo", "alpha"]
timeout_s = 30

[[task]]
name = "beta"
schedule = ["0 3 * * *", "@boot"]
shell = "/bin/sh"
script = "echo beta"
env = { GREETING = "hello" }

[[task]]
name = "gamma"
command = ["/bin/true"]
concurrency = "parallel"
"""


@pytest.fixture
def loaded(state, workdir):
    f = os.path.join(workdir, "three.toml")
    open(f, "w").write(THREE_TASKS)
    ok(state, "task", "add", "-f", f)
    return state


def write(workdir, name: str, text: str) -> str:
    p = os.path.join(workdir, name)
    with open(p, "w") as f:
        f.write(text)
    return p


def test_init_creates_store_and_is_repeatable(workdir):
    s = os.path.join(workdir, "st")
    first = json.loads(ok(s, "init", "--json").stdout)
    assert first["keyCreated"] is True and first["migrationsApplied"]
    again = json.loads(ok(s, "init", "--json").stdout)
    assert again["keyCreated"] is False and again["migrationsApplied"] == []
    assert os.path.isfile(os.path.join(s, "qlagent.db"))


def test_commands_before_init_are_unavailable(workdir):
    p = cli(os.path.join(workdir, "none"), "task", "ls")
    assert p.returncode == 5 and b"qlagent init" in p.stderr and b"Traceback" not in p.stderr


def test_add_file_with_several_tasks_then_ls_and_show(loaded):
    heads = js(loaded, "task", "ls")["items"]
    assert [h["name"] for h in heads] == ["alpha", "beta", "gamma"]
    for h in heads:
        assert h["revision"] == 1 and h["enabled"] is True
        assert len(h["contentDigest"]) == 64 and h["contentDigest"] == h["contentDigest"].lower()
    assert len({h["contentDigest"] for h in heads}) == 3
    alpha = js(loaded, "task", "show", "alpha")
    assert [s["cron"] for s in alpha["schedules"]] == ["*/5 * * * *"]
    assert len(alpha["nextFires"]) == 5 and alpha["nextFires"] == sorted(alpha["nextFires"])
    assert alpha["definition"]["timeoutS"] == 30 and "timeoutMs" not in alpha["definition"]
    beta = js(loaded, "task", "show", "beta")
    assert [s["cron"] for s in beta["schedules"]] == ["0 3 * * *", "@boot"]
    fires = [datetime.fromisoformat(t.replace("Z", "+00:00")) for t in beta["nextFires"]]
    assert len(fires) == 5 and {(b - a).total_seconds() for a, b in zip(fires, fires[1:])} == {86400}
    assert js(loaded, "task", "show", "gamma")["nextFires"] == []      # @once: manual only
    assert rows(loaded, "tasks") == 3 and rows(loaded, "task_revisions") == 3
    assert rows(loaded, "execution_revisions") == 3
    text = ok(loaded, "task", "ls").stdout.decode()
    assert "alpha" in text and "*/5 * * * *" in text


def test_show_unknown_task_is_not_found(loaded):
    p = cli(loaded, "task", "show", "nope")
    assert p.returncode == 4 and b"nope" in p.stderr and b"Traceback" not in p.stderr


def test_fenced_edit_stale_conflicts_and_writes_nothing(loaded, workdir):
    head = js(loaded, "task", "show", "alpha")
    f = write(workdir, "edit.toml", '[[task]]\nname = "alpha"\ncommand = ["/bin/echo", "v2"]\n')
    before = rows(loaded, "task_revisions"), rows(loaded, "execution_revisions")
    wrong_digest = "0" * 64
    for rev, dig in ((head["revision"], wrong_digest), (head["revision"] + 1, head["contentDigest"])):
        p = cli(loaded, "task", "edit", "alpha", "-f", f, "--expect-revision", str(rev), "--expect-digest", dig)
        assert p.returncode == 3, p.stderr
        assert b"revision 1" in p.stderr and b"Traceback" not in p.stderr
    assert (rows(loaded, "task_revisions"), rows(loaded, "execution_revisions")) == before
    assert js(loaded, "task", "show", "alpha")["contentDigest"] == head["contentDigest"]


def test_fenced_edit_exact_appends_next_revision_and_keeps_old(loaded, workdir):
    head = js(loaded, "task", "show", "alpha")
    f = write(workdir, "edit.toml", '[[task]]\nname = "alpha"\ncommand = ["/bin/echo", "v2"]\n')
    new = json.loads(ok(loaded, "task", "edit", "alpha", "-f", f, "--expect-revision", "1",
                        "--expect-digest", head["contentDigest"], "--json").stdout)
    assert new["revision"] == 2 and new["contentDigest"] != head["contentDigest"]
    shown = js(loaded, "task", "show", "alpha")
    assert shown["revision"] == 2 and shown["definition"]["execution"]["argv"] == ["/bin/echo", "v2"]
    with sqlite3.connect(os.path.join(loaded, "qlagent.db")) as c:
        revs = c.execute("SELECT r.revision, r.content_digest FROM task_revisions r JOIN tasks t USING (task_id) "
                         "WHERE t.name = 'alpha' ORDER BY r.revision").fetchall()
        execs = c.execute("SELECT e.revision FROM execution_revisions e JOIN tasks t USING (task_id) "
                          "WHERE t.name = 'alpha' ORDER BY e.revision").fetchall()
    assert revs == [(1, head["contentDigest"]), (2, new["contentDigest"])]
    assert execs == [(1,), (2,)]
    # the fence that just succeeded is now stale
    p = cli(loaded, "task", "edit", "alpha", "-f", f, "--expect-revision", "1", "--expect-digest", head["contentDigest"])
    assert p.returncode == 3


def test_edit_cannot_rename(loaded, workdir):
    head = js(loaded, "task", "show", "alpha")
    f = write(workdir, "r.toml", '[[task]]\nname = "other"\ncommand = ["/bin/true"]\n')
    p = cli(loaded, "task", "edit", "alpha", "-f", f, "--expect-revision", "1", "--expect-digest", head["contentDigest"])
    assert p.returncode == 2 and b"name" in p.stderr      # bad input: a rename is not an edit
    assert rows(loaded, "task_revisions") == 3


def test_enable_disable_keep_revision(loaded):
    digest = js(loaded, "task", "show", "beta")["contentDigest"]
    ok(loaded, "task", "disable", "beta")
    h = js(loaded, "task", "show", "beta")
    assert h["enabled"] is False and h["revision"] == 1 and h["contentDigest"] == digest
    p = cli(loaded, "run", "start", "beta")
    assert p.returncode == 3 and b"disabled" in p.stderr
    ok(loaded, "task", "enable", "beta")
    assert js(loaded, "task", "show", "beta")["enabled"] is True
    assert cli(loaded, "task", "disable", "nope").returncode == 4


def test_rm_frees_the_name_and_keeps_history(loaded, workdir):
    ok(loaded, "task", "rm", "gamma")
    assert [h["name"] for h in js(loaded, "task", "ls")["items"]] == ["alpha", "beta"]
    assert cli(loaded, "task", "show", "gamma").returncode == 4
    assert cli(loaded, "task", "rm", "gamma").returncode == 4
    assert rows(loaded, "task_revisions") == 3          # history stays for audit
    ok(loaded, "task", "add", "-f", write(workdir, "g.toml", '[[task]]\nname = "gamma"\ncommand = ["/bin/true"]\n'))
    assert js(loaded, "task", "show", "gamma")["revision"] == 1


def test_duplicate_name_in_file_is_bad_input(state, workdir):
    f = write(workdir, "dup.toml", THREE_TASKS + '\n[[task]]\nname = "beta"\ncommand = ["/bin/true"]\n')
    p = cli(state, "task", "add", "-f", f)
    assert p.returncode == 2 and b"task[3].name" in p.stderr and b"beta" in p.stderr
    assert rows(state, "tasks") == 0


def test_duplicate_name_against_store_conflicts_all_or_nothing(loaded, workdir):
    f = write(workdir, "more.toml", '[[task]]\nname = "delta"\ncommand = ["/bin/true"]\n'
                                     '[[task]]\nname = "alpha"\ncommand = ["/bin/true"]\n')
    p = cli(loaded, "task", "add", "-f", f)
    assert p.returncode == 3 and b"alpha" in p.stderr and b"already exists" in p.stderr
    assert b"Traceback" not in p.stderr
    assert rows(loaded, "tasks") == 3 and rows(loaded, "task_revisions") == 3      # delta not written either


def test_run_start_creates_queued_run_with_claimed_attempt_and_two_events(loaded):
    head = js(loaded, "task", "show", "alpha")
    created = js(loaded, "run", "start", "alpha")
    run = js(loaded, "run", "show", created["runId"])
    assert run["state"] == "queued" and run["taskName"] == "alpha"
    assert run["taskRevision"] == 1
    assert run["taskSnapshotRef"] == f"qltd:v1:1:{head['contentDigest']}"
    assert run["version"] == 2 and run["eventSequence"] == 2
    assert run["triggerType"] == "task_start" and run["executionOwner"] == "runtime"
    assert [a["state"] for a in run["attempts"]] == ["claimed"]
    assert run["attempts"][0]["attemptId"] == run["latestAttemptId"]
    assert [(e["sequence"], e["type"]) for e in run["events"]] == [(1, "run.created"), (2, "run.queued")]
    assert run["events"][0]["payload"]["contentDigest"] == head["contentDigest"]
    assert cli(loaded, "run", "show", "00000000-0000-4000-8000-000000000000").returncode == 4
    assert cli(loaded, "run", "start", "nope").returncode == 4


def test_run_ls_keyset_pagination(loaded):
    started = [js(loaded, "run", "start", "gamma")["runId"] for _ in range(5)]
    seen, cursor, pages = [], None, 0
    while True:
        args = ["run", "ls", "--limit", "2"] + (["--cursor", cursor] if cursor else [])
        page = js(loaded, *args)
        pages += 1
        assert len(page["items"]) <= 2
        seen += [r["runId"] for r in page["items"]]
        cursor = page["nextCursor"]
        if cursor is None:
            break
    assert pages == 3
    assert sorted(seen) == sorted(started) and len(set(seen)) == 5
    created = [r["createdAt"] for r in js(loaded, "run", "ls")["items"]]
    assert created == sorted(created, reverse=True)
    assert [r["taskName"] for r in js(loaded, "run", "ls", "--task", "gamma")["items"]] == ["gamma"] * 5
    assert js(loaded, "run", "ls", "--task", "alpha")["items"] == []
    p = cli(loaded, "run", "ls", "--limit", "0")
    assert p.returncode == 2 and b"limit" in p.stderr
    p = cli(loaded, "run", "ls", "--cursor", "garbage")
    assert p.returncode == 2 and b"cursor" in p.stderr


def test_usage_errors_exit_2(state):
    p = cli(state, "task", "frobnicate")
    assert p.returncode == 2 and b"Traceback" not in p.stderr
    p = cli(state, "task", "edit", "alpha", "-f", "x.toml", "--expect-revision", "one", "--expect-digest", "0" * 64)
    assert p.returncode == 2 and b"--expect-revision" in p.stderr


def test_reads_never_create_a_project(state):
    """A mistyped --project is 'not found' for a read, and nothing is written; a malformed
    project name is bad input."""
    before = rows(state, "projects")
    p = cli(state, "--project", "readtypo", "task", "ls")
    assert p.returncode == 4 and b"readtypo" in p.stderr
    p = cli(state, "--project", "Bad Proj!", "secret", "rm", "x")
    assert p.returncode == 2 and b"project" in p.stderr and b"Traceback" not in p.stderr
    assert rows(state, "projects") == before


def test_token_revoke_by_id_or_token_and_ls(state):
    p = ok(state, "token", "create", "--subject", "ops", "--role", "viewer")
    token = p.stdout.decode().strip()
    assert token.startswith("qlt_") and "\n" not in token          # the token alone on stdout
    listed = js(state, "token", "ls")["items"]
    assert [t["subject"] for t in listed] == ["ops"] and token not in json.dumps(listed)
    assert listed[0]["tokenId"].encode() in p.stderr
    ok(state, "token", "revoke", token)                            # by the token itself
    assert listed[0]["revokedAt"] is None and js(state, "token", "ls")["items"][0]["revokedAt"] is not None
    assert cli(state, "token", "revoke", "no-such-id").returncode == 4


def test_cluster_fields_on_the_local_agent(state, workdir):
    """An empty ``placement`` leaves the contentDigest as it was before the field existed (it is
    out of the canonical document), a set one is content; a ``remote_worker`` executor is
    refused locally naming the field, nothing written."""
    def task_file(name: str, extra: str) -> str:
        path = os.path.join(workdir, f"{name}.toml")
        with open(path, "w") as f:
            f.write(f'[[task]]\nname = "t"\nshell = "/bin/sh"\nscript = "true"\n{extra}\n')
        return path
    ok(state, "task", "add", "-f", task_file("plain", ""))
    ok(state, "--project", "empty", "task", "add", "-f", task_file("empty", "placement = { required = {} }"))
    ok(state, "--project", "set", "task", "add",
       "-f", task_file("set", 'placement = { preferred = { site = "lab" } }\nexecutor = "local_process"'))
    digests = [js(state, "--project", p, "task", "show", "t")["contentDigest"] for p in ("default", "empty", "set")]
    assert digests[0] == digests[1] != digests[2]
    before = rows(state, "tasks")
    r = cli(state, "task", "add", "-f", task_file("remote", 'executor = "remote_worker"'))
    assert r.returncode == 2 and b"executor" in r.stderr and len(r.stderr.splitlines()) == 1
    assert rows(state, "tasks") == before
