"""States are named by their constants, never written as string literals, anywhere in qlagent/
(the agent, the cluster, the fleet Worker, the adapters, top-level modules): a mistyped literal
compares false for ever where a mistyped constant fails at import. The state modules are
``core/states.py`` (Run, Attempt, Worker, Session, Lease), ``core/inbox_states.py`` (the Worker
inbox) and ``fleet/job.py`` (a Job's Lease hold and what it owes). Docstrings may name states;
the SQL of the named queries and migrations is the stores' own spelling (the CHECK constraints
are compared with the namespaces below)."""

from __future__ import annotations

import ast
import os
import re

import qlagent
from qlagent.core.inbox_states import InboxState
from qlagent.core.states import AttemptState, LeaseState, RunState, SessionState, WorkerState
from qlagent.fleet.job import LeaseHold, Owed

ROOT = os.path.dirname(qlagent.__file__)
STATE_MODULES = {"core/states.py", "core/inbox_states.py", "fleet/job.py"}
NAMES = (frozenset(RunState.ALL_CLUSTER) | frozenset(AttemptState.ALL) | frozenset(WorkerState.ALL)
         | frozenset(SessionState.ALL) | frozenset(LeaseState.ALL) | frozenset(InboxState.ALL)
         | {LeaseHold.HELD, LeaseHold.LOST_KEPT, LeaseHold.FENCED, LeaseHold.GONE, LeaseHold.FENCED_GONE}
         | {Owed.RUNNING_ACK, Owed.COMPLETION_ACK, Owed.LOG})
# The same words where they are not a state (file, word).
NOT_STATES = {
    # counts and counters: `qlagent status`'s JSON, the Worker's and the overview's figures
    ("cli/status.py", "queued"), ("cli/status.py", "replaced"), ("adapters/postgres/overview.py", "queued"),
    ("adapters/postgres/overview.py", "replaced"), ("fleet/runtime.py", "completed"), ("fleet/runtime.py", "fenced"),
    ("fleet/spawn.py", "completed"), ("fleet/spawn.py", "fenced"), ("fleet/stops.py", "fenced"),
    ("http/worker_status.py", "completed"), ("http/worker_status.py", "fenced"),
    # the agent's or a Worker's own draining (readiness, admission, the Pull's reason code)
    ("http/api.py", "draining"), ("http/worker_status.py", "draining"), ("dispatch/admission.py", "draining"),
    ("service/main.py", "draining"), ("cluster/pull.py", "draining"), ("fleet/runtime.py", "draining"),
    # the Worker's status document: how many inbox rows are open; a journal counter of re-attach
    ("fleet/runtime.py", "open"), ("fleet/recovery.py", "lost"),
    # the Worker's start error code for a cancelled start
    ("fleet/spawn.py", "cancelled"),
    # a certificate's validity in an error message; a Project's or binding's `active` column
    ("adapters/control_client.py", "expired"), ("adapters/rows/policy.py", "active"),
    # a connection's flag in the HTTP loop's __slots__; a Run's `held` column; a fire's outcome
    ("http/server.py", "started"), ("adapters/rows/runs.py", "held"), ("adapters/postgres/dispatch.py", "held"),
    ("adapters/row_store.py", "gone"),
    # the wire values of ACK kinds and claim outcomes
    ("core/cluster.py", "starting"), ("core/cluster.py", "running"), ("core/cluster.py", "claimed"),
}


def literals(path: str) -> list[tuple[int, str]]:
    tree = ast.parse(open(path, encoding="utf-8").read())
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr)
                  and isinstance(node.body[0].value, ast.Constant)}
    return [(node.lineno, node.value) for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in NAMES
            and id(node) not in docstrings]


def test_no_state_name_is_a_string_literal_outside_the_state_modules():
    found, seen = [], set()
    for dirpath, _, files in os.walk(ROOT):
        for f in sorted(files):
            rel = os.path.relpath(os.path.join(dirpath, f), ROOT)
            if f.endswith(".py") and rel not in STATE_MODULES:
                for line, word in literals(os.path.join(dirpath, f)):
                    if (rel, word) in NOT_STATES:
                        seen.add((rel, word))
                    else:
                        found.append(f"qlagent/{rel}:{line}: {word!r}")
    assert found == []
    assert seen == NOT_STATES, f"exceptions no longer needed: {NOT_STATES - seen}"


def test_the_cluster_namespaces_are_the_check_constraints_of_their_tables():
    sql = open(os.path.join(ROOT, "adapters", "postgres", "migrations", "0002_cluster.sql"), encoding="utf-8").read()
    checks = {table: tuple(re.findall(r"'([a-z_]+)'", body))
              for table, body in re.findall(r"CREATE TABLE (\w+) \((?:(?!CREATE TABLE).)*?state\s+text NOT NULL CHECK \(state IN \(([^)]*)\)",
                                            sql, re.S)}
    assert checks == {"workers": WorkerState.ALL, "worker_sessions": SessionState.ALL, "run_leases": LeaseState.ALL}
