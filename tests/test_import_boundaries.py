"""Import boundaries (ADR-0071 verification 8; docs/ARCHITECTURE.md "Layers").

Two checks over every module under ``qlagent/`` (found by walking the package, so new modules
are covered without editing this file):

1. **AST edges.** Every ``import``/``from … import`` in the source — at module level or inside a
   function — is resolved to an absolute module and checked against ``ALLOWED``, the table of
   docs/ARCHITECTURE.md: which qlagent layers a layer may import, and which drivers
   (sqlite3, psycopg, pyroute2, psutil, cryptography) only adapters may touch. A lazy import in a
   function is still an edge.
2. **Import-time load.** Each module is imported alone in a FRESH interpreter (a child forked
   from one interpreter that loaded only what the probe needs, so no start-up is paid per
   module): the pure core loads no I/O module and nothing loads a heavy dependency (pyroute2,
   cryptography) just by being imported — only the call that needs it does.
"""

from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys

import pytest

import qlagent

ROOT = os.path.dirname(qlagent.__file__)

# Layer → the qlagent layers its modules may import (its own included), as in
# docs/ARCHITECTURE.md "Layers". ``qlagent.bootstrap`` is the composition root: the only module
# above the adapters that may import them.
ALLOWED: dict[str, frozenset[str]] = {
    "qlagent.core": frozenset({"qlagent.core"}),
    "qlagent.adapters": frozenset({"qlagent.core", "qlagent.adapters"}),
    "qlagent.execution": frozenset({"qlagent.core", "qlagent.execution"}),
    "qlagent.dispatch": frozenset({"qlagent.core", "qlagent.execution", "qlagent.dispatch"}),
    # The fleet Worker's policy (issue 11): pure decisions its runtime applies.
    "qlagent.worker.policy": frozenset({"qlagent.core", "qlagent.worker.policy"}),
    # Cluster policy (ADR-0014) sees only core's records and ports; PostgreSQL is an adapter.
    "qlagent.cluster": frozenset({"qlagent.core", "qlagent.cluster"}),
    # The fleet Worker's runtime (issue 11): its loop over core's ports and its policy.
    "qlagent.worker": frozenset({"qlagent.core", "qlagent.worker.policy", "qlagent.worker"}),
    "qlagent.application": frozenset({"qlagent.core", "qlagent.execution", "qlagent.dispatch", "qlagent.application"}),
    "qlagent.bootstrap": frozenset({"qlagent.core", "qlagent.adapters", "qlagent.application", "qlagent.cluster",
                                    "qlagent.worker", "qlagent.bootstrap"}),
    "qlagent.http": frozenset({"qlagent.core", "qlagent.application", "qlagent.cluster", "qlagent.http"}),
    "qlagent.service": frozenset({"qlagent.core", "qlagent.application", "qlagent.bootstrap", "qlagent.http",
                                  "qlagent.service"}),
    # The CLI reads the package's version (``qlagent --version``).
    "qlagent.cli": frozenset({"qlagent.core", "qlagent.application", "qlagent.bootstrap", "qlagent.service",
                              "qlagent.cli", "qlagent"}),
    "qlagent": frozenset(),
}
# Drivers and OS bindings: only these layers may import them (anywhere in a module).
DRIVERS: dict[str, frozenset[str]] = {
    "sqlite3": frozenset({"qlagent.adapters"}),
    "psycopg": frozenset({"qlagent.adapters"}),
    "psycopg_pool": frozenset({"qlagent.adapters"}),
    "pyroute2": frozenset({"qlagent.adapters"}),
    "psutil": frozenset({"qlagent.adapters"}),
    "cryptography": frozenset({"qlagent.adapters"}),
}
PURE_LAYERS = ("qlagent.core", "qlagent.worker.policy")
# The pure layers do no I/O: none of these may be loaded by importing them.
CORE_FORBIDDEN = ("sqlite3", "_sqlite3", "psycopg", "psycopg2", "pyroute2", "http", "socket", "subprocess",
                  "cryptography", "urllib.request", "selectors", "psutil")
# Heavy dependencies are lazy everywhere (pyroute2 +23 MiB, cryptography +7.5 MiB, PyNaCl
# +2 MiB; bench/README.md; psycopg: never on a local agent): importing a module must not load
# them; only the call that needs them does (doctor's network check, reading an old-format
# Secret, sealing/opening a Secret). What a running service loads per configuration:
# tests/test_service_imports.py.
LAZY_EVERYWHERE = ("pyroute2", "cryptography", "nacl", "psycopg", "psycopg_pool")
LAZY_OWNERS = {"qlagent.adapters.netlink"}        # importing it is what "lazily" means
SHIM = "qlagent.adapters.shim"    # runs as `python3 -I -S shim/main.py`: stdlib and its own modules only


def discover(root: str = ROOT) -> dict[str, str]:
    """module name → file path for every module of the package at ``root``."""
    mods = {}
    base = os.path.dirname(root)
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d != "__pycache__"]
        rel = os.path.relpath(dirpath, base).replace(os.sep, ".")
        for f in filenames:
            if f.endswith(".py") and f != "__main__.py":
                mods[rel if f == "__init__.py" else f"{rel}.{f[:-3]}"] = os.path.join(dirpath, f)
    return dict(sorted(mods.items()))


MODULES = discover()


def layer_of(module: str) -> str:
    """The layer of ``module``: the longest entry of the table it is, or is inside of (a
    subpackage may be a layer of its own, as ``qlagent.worker.policy`` inside ``qlagent.worker``)."""
    parts = module.split(".")
    for n in range(len(parts), 1, -1):
        if ".".join(parts[:n]) in ALLOWED:
            return ".".join(parts[:n])
    if module == "qlagent":
        return module
    raise AssertionError(f"{module}: package {'.'.join(parts[:2])} is not in the layer table of "
                         "docs/ARCHITECTURE.md; add it there and here")


def imports_of(module: str, path: str, known: dict[str, str]) -> list[tuple[int, str]]:
    """(line, absolute module) of every import statement in the file, function bodies included.
    ``from pkg import name`` counts ``pkg.name`` when that is a module, else ``pkg``."""
    tree = ast.parse(open(path, encoding="utf-8").read(), path)
    package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                base = ".".join(base_parts + ([node.module] if node.module else []))
            else:
                base = node.module
            for a in node.names:
                sub = f"{base}.{a.name}"
                out.append((node.lineno, sub if sub in known else base))
    return out


def violations(root: str = ROOT) -> list[str]:
    """Every import edge of the package at ``root`` that the table forbids, as readable lines."""
    known = discover(root)
    bad = []
    for module, path in known.items():
        layer = layer_of(module)
        for line, target in imports_of(module, path, known):
            where = f"{os.path.relpath(path, os.path.dirname(root))}:{line}"
            if target == "qlagent" or target.startswith("qlagent."):
                target_layer = layer_of(target) if target != "qlagent" else "qlagent"
                if target_layer not in ALLOWED[layer]:
                    bad.append(f"{where}: {layer} must not import {target}")
                continue
            top = target.split(".")[0]
            if top in DRIVERS and layer not in DRIVERS[top]:
                bad.append(f"{where}: {layer} must not import the driver {target}")
    return bad


def test_discovery_covers_the_package():
    for expected in ("qlagent.core.canonical", "qlagent.core.ports", "qlagent.adapters.sqlite.store",
                     "qlagent.adapters.rows.runs", "qlagent.adapters.postgres.store", "qlagent.worker.runtime",
                     "qlagent.worker.policy.fencing", "qlagent.cluster.pull", "qlagent.http.wire",
                     "qlagent.bootstrap", "qlagent.cli.main", "qlagent.dispatch.admission", SHIM + ".main"):
        assert expected in MODULES
    for m in MODULES:
        layer_of(m)


def test_every_import_edge_is_in_the_layer_table():
    assert violations() == []


# Inside the adapters: the row logic both stores share (adapters.rows, over the Dialect seam)
# sees no driver and neither store; each store sees neither the other's driver nor the other.
# package → (drivers it must not import, qlagent packages it must not import)
DIALECT_WALLS = {
    "qlagent.adapters.rows": ({"sqlite3", "psycopg", "psycopg_pool"}, {"qlagent.adapters.sqlite", "qlagent.adapters.postgres"}),
    "qlagent.adapters.sqlite": ({"psycopg", "psycopg_pool"}, {"qlagent.adapters.postgres"}),
    "qlagent.adapters.postgres": ({"sqlite3"}, {"qlagent.adapters.sqlite"}),
}


def test_the_shared_row_logic_and_each_store_stay_apart():
    bad = []
    for package, (drivers, packages) in DIALECT_WALLS.items():
        inside = {m: p for m, p in MODULES.items() if m == package or m.startswith(package + ".")}
        assert inside, f"{package} has no module"
        for module, path in inside.items():
            for line, target in imports_of(module, path, MODULES):
                if target.split(".")[0] in drivers or any(target == q or target.startswith(q + ".") for q in packages):
                    bad.append(f"{os.path.relpath(path, os.path.dirname(ROOT))}:{line}: {package} must not import {target}")
    assert bad == []


def test_the_ast_checker_fails_on_a_planted_forbidden_import(tmp_path):
    """A copy of the package with an HTTP module that reaches the store driver and an adapter
    from inside a function — exactly what an import-time probe cannot see — is refused, and so
    is the Worker's pure policy reaching up into its runtime."""
    copy = tmp_path / "qlagent"
    shutil.copytree(ROOT, copy, ignore=shutil.ignore_patterns("__pycache__"))
    (copy / "http" / "planted.py").write_text(
        '"""planted by the test"""\n\n\ndef handler():\n    import sqlite3\n'
        '    from ..adapters.sqlite import store\n    return sqlite3, store\n')
    (copy / "service" / "planted.py").write_text("from qlagent.adapters import processes\n")
    (copy / "worker" / "policy" / "planted.py").write_text("from .. import runtime\n")
    assert sorted(violations(str(copy))) == [
        "qlagent/http/planted.py:5: qlagent.http must not import the driver sqlite3",
        "qlagent/http/planted.py:6: qlagent.http must not import qlagent.adapters.sqlite.store",
        "qlagent/service/planted.py:1: qlagent.service must not import qlagent.adapters.processes",
        "qlagent/worker/policy/planted.py:1: qlagent.worker.policy must not import qlagent.worker.runtime",
    ]


def test_the_table_is_the_one_in_architecture_md():
    """docs/ARCHITECTURE.md states the same edges: each row lists what its layer may import."""
    doc = open(os.path.join(os.path.dirname(ROOT), "docs", "ARCHITECTURE.md"), encoding="utf-8").read()
    table = {}
    for line in doc.split("## Layers", 1)[1].split("\n## ", 1)[0].splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0].startswith("`qlagent"):
            layer = cells[0].strip("`")
            names = [x.split()[0].strip("`") for x in cells[2].split(",") if x.strip() not in ("", "—")]
            may = {n if n == "qlagent" else f"qlagent.{n}" for n in names}
            table[layer] = frozenset(may | ({layer} if layer != "qlagent" else set()))
    assert table == ALLOWED


# ---- import-time load, in fresh interpreters ----------------------------------------------------

# ``python -c PROBE WIDTH MODULE…``: with nothing loaded but importlib, json, os and sys, fork a
# child per module (WIDTH at a time) that imports it and writes {"modules": sorted sys.modules}
# or {"error": traceback} to its pipe; print {module: that} as JSON.
PROBE = r"""
import importlib, json, os, sys

def probe(module, w):
    try:
        importlib.import_module(module)
        out = {"modules": sorted(sys.modules)}
    except BaseException:
        import traceback
        out = {"error": traceback.format_exc()}
    os.write(w, json.dumps(out).encode())
    os._exit(0)

width, pending, live, found = int(sys.argv[1]), sys.argv[2:], [], {}
while pending or live:
    while pending and len(live) < width:
        module = pending.pop(0)
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            probe(module, w)
        os.close(w)
        live.append((module, pid, r))
    module, pid, r = live.pop(0)
    chunks = []
    while data := os.read(r, 65536):
        chunks.append(data)
    os.close(r)
    os.waitpid(pid, 0)
    found[module] = json.loads(b"".join(chunks) or b'{"error": "the child wrote nothing"}')
print(json.dumps(found))
"""


@pytest.fixture(scope="module")
def loaded() -> dict[str, dict]:
    """module → {"modules": its sys.modules after importing it alone} or {"error": traceback}."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONSTARTUP",)}
    width = min(16, (os.cpu_count() or 2) * 2)
    p = subprocess.run([sys.executable, "-c", PROBE, str(width), *MODULES], capture_output=True, text=True, env=env,
                       timeout=300)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


def _hits(modules: list[str], prefixes) -> list[str]:
    return sorted(m for m in modules if any(m == p or m.startswith(p + ".") for p in prefixes))


@pytest.mark.parametrize("module", list(MODULES))
def test_import_alone_loads_nothing_it_must_not(loaded, module):
    assert "error" not in loaded[module], f"importing {module} alone failed:\n{loaded[module]['error']}"
    mods = loaded[module]["modules"]
    layer = layer_of(module)
    # A module's own enclosing packages load with it (``qlagent.worker`` for ``worker.policy.x``).
    others = [m for m in _hits(mods, set(ALLOWED) - {"qlagent"})
              if layer_of(m) not in ALLOWED[layer] and not module.startswith(m + ".")]
    assert others == [], f"{module} ({layer}) loads {others} at import time"
    if layer in PURE_LAYERS:
        assert _hits(mods, CORE_FORBIDDEN) == [], f"pure module {module} loads I/O modules"
    if module not in LAZY_OWNERS:
        assert _hits(mods, LAZY_EVERYWHERE) == [], f"{module} loads a lazy dependency at import time"


def test_shim_is_stdlib_only():
    shim = {m: path for m, path in MODULES.items() if m.startswith(SHIM + ".")}
    siblings = {m.rsplit(".", 1)[1] for m in shim}
    assert {"main", "drainer", "leftovers", "oom", "forkserver"} <= siblings
    for module, path in shim.items():
        names = set()
        for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
            if isinstance(node, ast.Import):
                names |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                assert node.level == 0, f"{path} has a relative import (line {node.lineno}); the shim runs as a script"
                names.add(node.module.split(".")[0])
        assert names - set(sys.stdlib_module_names) - {"__future__"} - siblings == set(), module
