"""States are named by their constants (``RunState.X``, ``AttemptState.X`` of ``core.states``),
never written as string literals, in the agent, the cluster and the fleet Worker: a mistyped
literal compares false for ever where a mistyped constant fails at import. Docstrings may name
states."""

from __future__ import annotations

import ast
import os

import qlagent
from qlagent.core.states import AttemptState, RunState

ROOT = os.path.dirname(qlagent.__file__)
PACKAGES = ("http", "cli", "application", "dispatch", "execution", "service", "fleet", "cluster", "worker",
            "adapters", "core")
# The same words that are not a state: counts in `qlagent status`'s JSON, the Worker's start
# error code for a cancelled start, a journal counter of re-attach.
NOT_STATES = {("cli/status.py", "queued"), ("fleet/spawn.py", "cancelled"), ("fleet/recovery.py", "lost"),
              ("adapters/postgres/overview.py", "queued"),
              # the wire values of ACK kinds, claim outcomes and a completed inbox row's outcome
              ("core/cluster.py", "starting"), ("core/cluster.py", "running"), ("core/cluster.py", "claimed"),
              ("core/inbox_states.py", "lost")}
STATE_MODULE = "core/states.py"
NAMES = frozenset(RunState.ALL_CLUSTER) | frozenset(AttemptState.ALL)


def literals(path: str) -> list[str]:
    tree = ast.parse(open(path, encoding="utf-8").read())
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr)
                  and isinstance(node.body[0].value, ast.Constant)}
    return [(node.lineno, node.value) for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in NAMES
            and id(node) not in docstrings]


def test_no_state_name_is_a_string_literal_outside_the_state_modules():
    found = []
    for pkg in PACKAGES:
        for dirpath, _, files in os.walk(os.path.join(ROOT, pkg)):
            for f in sorted(files):
                rel = os.path.relpath(os.path.join(dirpath, f), ROOT)
                if f.endswith(".py") and rel != STATE_MODULE:
                    found += [f"qlagent/{rel}:{line}: {word!r}" for line, word in literals(os.path.join(dirpath, f))
                              if (rel, word) not in NOT_STATES]
    assert found == []
