"""States are named by their constants, never written as string literals, anywhere in qlagent/
(the agent, the cluster, the Worker, the adapters, top-level modules): a mistyped literal
compares false for ever where a mistyped constant fails at import.

A state namespace is a class of named string constants, as ``core.states.RunState``: found by
reading every module, so a new one is covered without editing this file. Its words may be
written only inside its own class body. Docstrings may name states; the SQL of the named
queries and migrations is the stores' own spelling (the CHECK constraints are compared with the
namespaces below)."""

from __future__ import annotations

import ast
import os
import re

import qlagent
from qlagent.core.inbox_states import InboxState
from qlagent.core.states import AttemptState, LeaseState, RunState, SessionState, WorkerState

ROOT = os.path.dirname(qlagent.__file__)
# What the discovery must find at least (else it is broken and the test below proves nothing).
KNOWN_NAMESPACES = {"RunState", "AttemptState", "WorkerState", "SessionState", "LeaseState",   # core.states
                    "InboxState", "OutcomeKind",                     # the Worker inbox's rows and outcomes
                    "AckKind", "ClaimStatus",                        # core.cluster: ACK kinds, claim outcomes
                    "LeaseHold", "Owed",                             # a Worker Job's Lease and what it owes
                    "StartPhase",                                    # a fork-served shim start
                    "KillReason"}                                    # why a task was signalled
# The same words where they are not a state (file, word).
NOT_STATES = {
    # counts and counters: `qlagent status`'s JSON, the Worker's and the overview's figures
    ("cli/status.py", "queued"), ("cli/status.py", "replaced"), ("adapters/postgres/overview.py", "queued"),
    ("adapters/postgres/overview.py", "replaced"), ("worker/runtime.py", "completed"), ("worker/runtime.py", "fenced"),
    ("worker/spawn.py", "completed"), ("worker/spawn.py", "fenced"), ("worker/stops.py", "fenced"),
    ("http/worker_status.py", "completed"), ("http/worker_status.py", "fenced"),
    # the agent's or a Worker's own draining (readiness, admission, the Pull's reason code)
    ("http/api.py", "draining"), ("http/worker_status.py", "draining"), ("dispatch/admission.py", "draining"),
    ("service/main.py", "draining"), ("cluster/pull.py", "draining"), ("worker/runtime.py", "draining"),
    # the Worker's status document: how many inbox rows are open; a journal counter of re-attach
    ("worker/runtime.py", "open"), ("worker/recovery.py", "lost"),
    # the Worker's start error code for a cancelled start
    ("worker/spawn.py", "cancelled"),
    # `run cancel`, the command; a Worker Job's flag (a cancel heard) in its __slots__
    ("cli/run.py", "cancel"), ("worker/job.py", "cancel"),
    # a certificate's validity in an error message; a Project's or binding's `active` column
    ("adapters/control_client.py", "expired"), ("adapters/rows/policy.py", "active"),
    # a connection's flag in the HTTP loop's __slots__; a Run's `held` column; a fire's outcome
    ("http/server.py", "started"), ("adapters/rows/runs.py", "held"), ("adapters/postgres/dispatch.py", "held"),
    ("adapters/row_store.py", "gone"),
    # compile()'s mode and a receipt's start_error prefix
    ("adapters/shim/main.py", "exec"), ("core/receipt.py", "exec"),
}


def _sources() -> dict[str, ast.Module]:
    """path relative to qlagent/ → its parsed module, for every module."""
    out = {}
    for dirpath, dirnames, files in os.walk(ROOT):
        dirnames[:] = [d for d in dirnames if d != "__pycache__"]
        for f in sorted(files):
            if f.endswith(".py"):
                path = os.path.join(dirpath, f)
                out[os.path.relpath(path, ROOT)] = ast.parse(open(path, encoding="utf-8").read(), path)
    return out


SOURCES = _sources()


def _constants(cls: ast.ClassDef) -> list[str]:
    return [s.value.value for s in cls.body
            if isinstance(s, ast.Assign) and len(s.targets) == 1 and isinstance(s.targets[0], ast.Name)
            and s.targets[0].id.isupper() and isinstance(s.value, ast.Constant) and isinstance(s.value.value, str)]


def namespaces() -> dict[str, tuple[str, ast.ClassDef, list[str]]]:
    """class name → (file, class node, its words): every class without bases holding two or
    more ``UPPER = "word"`` constants."""
    found = {}
    for rel, tree in SOURCES.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and not node.bases and len(_constants(node)) >= 2:
                assert node.name not in found, f"two state namespaces named {node.name}"
                found[node.name] = (rel, node, _constants(node))
    return found


NAMESPACES = namespaces()
NAMES = frozenset(w for _, _, words in NAMESPACES.values() for w in words)


def literals(tree: ast.Module, skip: list[ast.ClassDef]) -> list[tuple[int, str]]:
    """(line, word) of every string constant equal to a state name, outside docstrings and the
    class bodies in ``skip``."""
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr)
                  and isinstance(node.body[0].value, ast.Constant)}
    inside = {id(n) for cls in skip for n in ast.walk(cls)}
    return [(node.lineno, node.value) for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in NAMES
            and id(node) not in docstrings and id(node) not in inside]


def test_every_state_namespace_is_found():
    assert KNOWN_NAMESPACES <= set(NAMESPACES), KNOWN_NAMESPACES - set(NAMESPACES)
    assert {"queued", "barrier", "completion", "worker_unavailable", "lost_kept", "running_ack", "timeout"} <= NAMES


def test_no_state_name_is_a_string_literal_outside_its_namespace():
    found, seen = [], set()
    for rel, tree in SOURCES.items():
        own = [cls for file, cls, _ in NAMESPACES.values() if file == rel]
        for line, word in literals(tree, own):
            if (rel, word) in NOT_STATES:
                seen.add((rel, word))
            else:
                found.append(f"qlagent/{rel}:{line}: {word!r}")
    assert found == []
    assert seen == NOT_STATES, f"exceptions no longer needed: {NOT_STATES - seen}"


def test_a_planted_state_literal_is_found():
    tree = ast.parse('"""doc: queued"""\nclass K:\n    A = "x"\n    B = "y"\n\n\ndef f(r):\n'
                     '    return r.state == "queued" or r.kind == "completion"\n')
    assert literals(tree, []) == [(8, "queued"), (8, "completion")]


def _checks(path: str) -> dict[str, tuple[str, ...]]:
    """table → the words of its ``state … CHECK (state IN (…))`` column, in order."""
    sql = open(os.path.join(ROOT, *path.split("/")), encoding="utf-8").read()
    return {table: tuple(re.findall(r"'([a-z_]+)'", body))
            for table, body in re.findall(r"CREATE TABLE (\w+) \((?:(?!CREATE TABLE).)*?state\s+\w+ NOT NULL "
                                          r"CHECK \(state IN \(([^)]*)\)", sql, re.S | re.I)}


def test_the_namespaces_are_the_check_constraints_of_their_tables():
    assert _checks("adapters/postgres/migrations/0001_core.sql") == {"runs": RunState.ALL_CLUSTER,
                                                                     "attempts": AttemptState.ALL}
    assert _checks("adapters/postgres/migrations/0002_cluster.sql") == {
        "workers": WorkerState.ALL, "worker_sessions": SessionState.ALL, "run_leases": LeaseState.ALL}
    assert _checks("adapters/sqlite/inbox_migrations/0001_offers.sql") == {"offers": InboxState.ALL}
