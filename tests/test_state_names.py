"""States are named by their constants (``RunState.X``, ``AttemptState.X`` of ``core.states``),
never written as string literals, in the local agent's packages: a mistyped literal compares
false for ever where a mistyped constant fails at import. Docstrings may name states."""

from __future__ import annotations

import ast
import os

import qlagent
from qlagent.core.states import AttemptState, RunState

ROOT = os.path.dirname(qlagent.__file__)
PACKAGES = ("http", "cli", "application", "dispatch", "execution", "service")
# The Worker's and the control plane's own modules keep their wire codecs (ACK kinds share names
# with states) and are checked with the cluster.
OUTSIDE = {"http/worker_routes.py", "http/worker_status.py", "application/fleet_worker.py",
           "service/worker_mode.py", "service/controlplane.py"}
NAMES = frozenset(RunState.ALL_CLUSTER) | frozenset(AttemptState.ALL)


def literals(path: str) -> list[str]:
    tree = ast.parse(open(path, encoding="utf-8").read())
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr)
                  and isinstance(node.body[0].value, ast.Constant)}
    return [f"{node.lineno}: {node.value!r}" for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in NAMES
            and id(node) not in docstrings]


def test_no_state_name_is_a_string_literal_in_the_local_agent():
    found = []
    for pkg in PACKAGES:
        for dirpath, _, files in os.walk(os.path.join(ROOT, pkg)):
            for f in sorted(files):
                rel = os.path.relpath(os.path.join(dirpath, f), ROOT)
                if f.endswith(".py") and rel not in OUTSIDE:
                    found += [f"qlagent/{rel}:{hit}" for hit in literals(os.path.join(dirpath, f))]
    assert found == []
