"""Import boundaries (ADR-0071 verification 8; docs/ARCHITECTURE.md "Layers").

Every module under ``qlagent/`` is found by walking the package directory (new modules are
covered without editing this file), imported alone in a FRESH interpreter, and the resulting
``sys.modules`` is checked against its layer's rules. Imports point downwards only.
"""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

import qlagent

ROOT = os.path.dirname(qlagent.__file__)

# Layer → qlagent packages it must never load (directly or transitively). Order of the table
# in docs/ARCHITECTURE.md: core < adapters < execution < dispatch < application < service < http < cli.
ENTRY_POINTS = ("qlagent.service", "qlagent.http", "qlagent.cli")
UPWARD = {
    "qlagent.core": ("qlagent.adapters", "qlagent.execution", "qlagent.dispatch", "qlagent.application",
                     *ENTRY_POINTS),
    "qlagent.adapters": ("qlagent.execution", "qlagent.dispatch", "qlagent.application", *ENTRY_POINTS),
    "qlagent.execution": ("qlagent.adapters", "qlagent.dispatch", "qlagent.application", *ENTRY_POINTS),
    "qlagent.dispatch": ("qlagent.adapters", "qlagent.application", *ENTRY_POINTS),
    "qlagent.application": ENTRY_POINTS,
    "qlagent.service": ("qlagent.http", "qlagent.cli"),
    "qlagent.http": ("qlagent.service", "qlagent.cli"),
    "qlagent.cli": (),
    "qlagent": ("qlagent.core", "qlagent.adapters", "qlagent.execution", "qlagent.dispatch", "qlagent.application",
                *ENTRY_POINTS),
}
# The pure core does no I/O: none of these may be loaded by importing it.
CORE_FORBIDDEN = ("sqlite3", "_sqlite3", "psycopg", "psycopg2", "pyroute2", "http", "socket", "subprocess",
                  "cryptography", "urllib.request", "selectors", "psutil")
# Heavy dependencies are lazy everywhere (pyroute2 ~18 MB, cryptography): importing a module
# must not load them; only the call that needs them does.
LAZY_EVERYWHERE = ("pyroute2", "cryptography")
# The modules that wrap a lazy dependency load it; importing them is what "lazily" means.
LAZY_OWNERS = {"qlagent.service.netgate", "qlagent.adapters.netlink"}
SHIM = "qlagent.adapters.shim"      # runs as `python3 -I -S shim.py`: stdlib only


def discover() -> list[str]:
    mods = []
    for dirpath, dirnames, filenames in os.walk(ROOT):
        dirnames[:] = [d for d in dirnames if d != "__pycache__"]
        rel = os.path.relpath(dirpath, os.path.dirname(ROOT)).replace(os.sep, ".")
        for f in filenames:
            if f.endswith(".py") and f != "__main__.py":
                mods.append(rel if f == "__init__.py" else f"{rel}.{f[:-3]}")
    return sorted(mods)


MODULES = discover()
PROBE = ("import importlib, json, sys; importlib.import_module(sys.argv[1]); "
         "print(json.dumps(sorted(sys.modules)))")


def layer_of(module: str) -> str:
    parts = module.split(".")
    key = ".".join(parts[:2])
    if key not in UPWARD:
        raise AssertionError(f"{module}: package {key} is not in the layer table of docs/ARCHITECTURE.md; "
                             "add it there and here")
    return key


def _probe(module: str):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONSTARTUP",)}
    p = subprocess.run([sys.executable, "-c", PROBE, module], capture_output=True, text=True, env=env, timeout=60)
    return p.returncode, p.stdout, p.stderr


@pytest.fixture(scope="module")
def loaded() -> dict[str, tuple[int, str, str]]:
    """module → (returncode, json list of sys.modules, stderr), probed in parallel fresh interpreters."""
    with ThreadPoolExecutor(max_workers=min(16, (os.cpu_count() or 2) * 2)) as pool:
        return dict(zip(MODULES, pool.map(_probe, MODULES)))


def _missing_sibling(stderr: str) -> str | None:
    """The qlagent module an import failed on, if its file is absent from this tree (else None)."""
    m = (re.search(r"cannot import name '(\w+)' from '(qlagent[\w.]*)'", stderr)
         or re.search(r"No module named '(qlagent[\w.]*)'", stderr))
    if not m:
        return None
    name = f"{m.group(2)}.{m.group(1)}" if m.lastindex == 2 else m.group(1)
    rel = os.path.join(os.path.dirname(ROOT), *name.split("."))
    return None if os.path.exists(rel + ".py") or os.path.isdir(rel) else name


def _hits(modules: list[str], prefixes) -> list[str]:
    return sorted(m for m in modules if any(m == p or m.startswith(p + ".") for p in prefixes))


def test_discovery_covers_the_package():
    for expected in ("qlagent.core.canonical", "qlagent.core.definitions", "qlagent.adapters.sqlite.authority",
                     "qlagent.application.store", "qlagent.cli.main", "qlagent.dispatch.dispatcher"):
        assert expected in MODULES
    for m in MODULES:
        layer_of(m)


@pytest.mark.parametrize("module", MODULES)
def test_layer_rules(loaded, module):
    rc, out, err = loaded[module]
    missing = _missing_sibling(err) if rc else None
    if missing:
        pytest.skip(f"{module} needs {missing}, which is not in this build yet (lands from another branch)")
    assert rc == 0, f"importing {module} alone failed:\n{err}"
    mods = json.loads(out)
    assert module in mods
    layer = layer_of(module)
    own_parents = {".".join(module.split(".")[:i]) for i in range(1, module.count(".") + 1)}
    upward = [m for m in _hits(mods, UPWARD[layer]) if m not in own_parents and m != module]
    assert upward == [], f"{module} ({layer}) imports upward: {upward}"
    if layer == "qlagent.core":
        assert _hits(mods, CORE_FORBIDDEN) == [], f"core module {module} loads I/O modules"
    if module not in LAZY_OWNERS:
        assert _hits(mods, LAZY_EVERYWHERE) == [], f"{module} loads a lazy dependency at import time"


def test_shim_shim_is_stdlib_only():
    path = os.path.join(ROOT, "adapters", "shim.py")
    if not os.path.exists(path):
        pytest.skip("shim not in this build yet")
    tree = ast.parse(open(path, encoding="utf-8").read())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"shim.py has a relative import (line {node.lineno}); it runs as a script"
            names.add(node.module.split(".")[0])
    assert names - set(sys.stdlib_module_names) - {"__future__"} == set()


def test_the_checker_catches_a_violation(tmp_path):
    """A probe of a module that imports upward is flagged (the rules are not vacuous)."""
    pkg = tmp_path / "probe_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "bad.py").write_text("import qlagent.core.models\nimport qlagent.adapters.sqlite.authority\n")
    env = dict(os.environ, PYTHONPATH=f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    p = subprocess.run([sys.executable, "-c", PROBE, "probe_pkg.bad"], capture_output=True, text=True, env=env)
    mods = json.loads(p.stdout)
    assert _hits(mods, UPWARD["qlagent.core"]) == ["qlagent.adapters", "qlagent.adapters.sqlite",
                                                   "qlagent.adapters.sqlite.authority"]
    assert "sqlite3" in _hits(mods, CORE_FORBIDDEN)
