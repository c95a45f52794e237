"""README "JSON output" (issue 20 §9): every ``--json`` command and every HTTP JSON route answers
in one list shape and one time convention, and durations read back in the task file's unit.
Real CLI processes, a real ``qlagent serve --listen`` on loopback; a command the CLI grows must be
placed in one of the sets below, so it cannot drift unchecked."""

from __future__ import annotations

import argparse
import json
import os
import uuid

from jsonshape import check_conventions, check_list
from qlcli import cli, ok
from servehelp import runs_of
from test_http_api import BASE, Agent, start_body, token
from test_import_qinglong import make_panel

from qlagent.application import presenter
from qlagent.cli.main import build_parser
from qlagent.core.models import RunEvent
from kit import wait_until

TASKS = """
[[task]]
name = "tick"
schedule = "* * * * * *"
timeout_s = 90
grace_s = 2.5
catch_up_within_s = 600
retry = { max_attempts = 2, backoff_s = 3 }
shell = "/bin/sh"
script = "echo tick"

[[task]]
name = "once"
timeout_s = 30
command = ["/bin/echo", "once"]
secrets = { TOKEN = "s1" }
"""

LIST_COMMANDS = {("task", "add"), ("task", "ls"), ("secret", "ls"), ("token", "ls"), ("run", "ls")}
PAGED_COMMANDS = {("run", "ls")}
# Print one line of text (or nothing), with or without --json.
TEXT_ONLY = {("task", "enable"), ("task", "disable"), ("task", "rm"), ("secret", "set"), ("secret", "rm"),
             ("run", "cancel"), ("token", "create"), ("token", "revoke"), ("role", "set"), ("serve",)}
# Need [cluster] (PostgreSQL): tests/cluster/test_cluster_serve.py::test_workers_enroll_ls_drain_rm.
CLUSTER_ONLY = {("workers", "enroll"), ("workers", "ls"), ("workers", "drain"), ("workers", "resume"),
                ("workers", "rm"), ("workers", "rotate-credential"), ("status",)}
# Write files, checked with --json in their own modules: tests/test_tls_cli.py, tests/cluster/test_join.py.
FILE_MAKING = {("tls", "ca"), ("tls", "cert"), ("worker", "join")}


def cli_commands() -> set[tuple[str, ...]]:
    """Every (command, subcommand) the parser knows."""
    def subs(parser):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                return action.choices
        return {}
    return {(name, *((s,) if s else ())) for name, p in subs(build_parser()).items() for s in (subs(p) or [None])}


def test_every_json_command_and_api_route_lists_as_items_with_rfc3339_instants(state, workdir):
    tasks = os.path.join(workdir, "tasks.toml")
    with open(tasks, "w") as f:
        f.write(TASKS)
    added = json.loads(ok(state, "task", "add", "-f", tasks, "--json").stdout)
    ok(state, "secret", "set", "s1", stdin=b"v")
    tok = token(state, "op", "operator")
    agent = Agent(state)
    try:
        wait_until(lambda: "succeeded" in {s for _, s in runs_of(state, "tick")}, timeout=30)
        ok(state, "task", "disable", "tick")
        tick_run = next(r for r, s in runs_of(state, "tick") if s == "succeeded")
        waited = json.loads(ok(state, "run", "start", "once", "--wait", "--timeout", "30", "--json").stdout)
        api = _walk_api(agent, tok, tick_run)
    finally:
        agent.stop()

    outputs = {("run", "start", "--wait"): waited, ("task", "add"): added}
    head = json.loads(ok(state, "task", "show", "once", "--json").stdout)
    edit = os.path.join(workdir, "edit.toml")
    with open(edit, "w") as f:
        f.write(TASKS[TASKS.index('[[task]]\nname = "once"'):].replace("/bin/echo", "/bin/printf"))
    panel = make_panel(workdir, [{"name": "c", "command": "task a.sh", "schedule": "0 1 * * *"}],
                       [{"name": "K", "value": "v", "status": 0, "position": 1}], config=None, scripts={"a.sh": ""})
    runs_page = json.loads(ok(state, "run", "ls", "--limit", "1", "--json").stdout)
    calls = {
        ("init",): ["init"], ("doctor",): ["doctor"], ("config", "check"): ["config", "check"],
        ("task", "ls"): ["task", "ls"], ("task", "show"): ["task", "show", "tick"],
        ("task", "edit"): ["task", "edit", "once", "-f", edit, "--expect-revision", str(head["revision"]),
                           "--expect-digest", head["contentDigest"]],
        ("secret", "ls"): ["secret", "ls"], ("token", "ls"): ["token", "ls"],
        ("run", "start"): ["run", "start", "once"], ("run", "ls"): ["run", "ls", "--cursor", runs_page["nextCursor"]],
        ("run", "show"): ["run", "show", tick_run], ("run", "logs"): ["run", "logs", tick_run],
        ("import", "qinglong"): ["import", "qinglong", panel, "--dry-run"],
    }
    assert set(calls) | {("task", "add")} | TEXT_ONLY | CLUSTER_ONLY | FILE_MAKING == cli_commands()
    for command, argv in calls.items():
        p = cli(state, *argv, "--json")
        assert p.returncode in (0, 5) and p.stdout, (argv, p.stderr)     # doctor: 5 when a check fails
        outputs[command] = json.loads(p.stdout)
    for command, doc in outputs.items():
        if command in LIST_COMMANDS:
            check_list(doc, " ".join(command), pages=command in PAGED_COMMANDS)
        else:
            check_conventions(doc, " ".join(command))
    assert check_list(runs_page, "run ls --limit 1", pages=True) and runs_page["nextCursor"]
    for where, doc in api.items():
        check_conventions(doc, where)

    # What a user sees of the values: the instants of a scheduled Run, the units of the file.
    tick = next(h for h in outputs[("task", "ls")]["items"] if h["name"] == "tick")["definition"]
    assert (tick["timeoutS"], tick["graceS"], tick["catchUpWithinS"], tick["retry"]) == \
        (90, 2.5, 600, {"maxAttempts": 2, "backoffS": 3})
    once = outputs[("task", "edit")]["definition"]        # defaults shown, absent ones null, not left out
    assert (once["timeoutS"], once["graceS"], once["catchUp"], once["catchUpWithinS"], once["placement"]) == \
        (30, 5, "latest", None, None)
    shown = outputs[("run", "show")]
    created = next(e for e in shown["events"] if e["type"] == "run.created")["payload"]
    running = next(e for e in shown["events"] if e["type"] == "run.running")["payload"]
    assert created["scheduledFor"] == shown["scheduledFor"] and running["deadlineAt"] > shown["createdAt"]
    assert outputs[("token", "ls")]["items"][0]["createdAt"] and outputs[("run", "start")]["createdAt"]


def _walk_api(agent: Agent, tok: str, run_id: str) -> dict[str, dict]:
    """Every JSON route once, the two lists paged to their end; returns each answer by route."""
    out = {}
    status, out["GET task"] = agent.json("GET", f"{BASE}/tasks/once", tok)
    assert status == 200
    body = start_body(out["GET task"]["revision"], out["GET task"]["contentDigest"], str(uuid.uuid4()))
    status, out["POST task start"] = agent.json("POST", f"{BASE}/tasks/once/runs", tok, body)
    assert status == 202
    for name, path in (("runs", f"{BASE}/runs?limit=2"), ("events", f"{BASE}/runs/{run_id}/events?limit=2")):
        pages, cursor = 0, None
        while pages == 0 or cursor:
            status, doc = agent.json("GET", path + (f"&cursor={cursor}" if cursor else ""), tok)
            assert status == 200, doc
            check_list(doc, f"GET {name}", pages=True)
            out[f"GET {name} page {pages}"] = doc
            pages, cursor = pages + 1, doc["nextCursor"]
        assert pages >= 2, name                         # the cursor was followed to the last page
    status, out["GET run"] = agent.json("GET", f"{BASE}/runs/{run_id}", tok)
    status, out["POST cancel"] = agent.json("POST", f"{BASE}/runs/{run_id}/cancel", tok)
    for route in ("/healthz", "/readyz"):
        out[f"GET {route}"] = agent.json("GET", route)[1]
    return out


def test_every_stored_payload_instant_is_rendered_rfc3339():
    # The cluster's run.retrying (notBeforeUs) is written only by the PostgreSQL authority; the
    # walk above meets scheduledForUs and deadlineUs on a local agent.
    us = 1_786_528_800_000_001
    for stored, shown in presenter.PAYLOAD_INSTANTS.items():
        e = RunEvent(run_id="r", sequence=1, event_id="e", type="t", actor="a", payload={stored: us, "n": 1},
                     created_at_us=us)
        doc = presenter.event(e)
        check_conventions(doc, stored)
        assert doc["payload"] == {shown: "2026-08-12T10:00:00.000001Z", "n": 1}
