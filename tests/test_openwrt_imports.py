"""The OpenWrt package depends on exactly what qlagent imports (issue 13 §1).

Every module qlagent imports (its AST, all files) must have a row in openwrt/python3-modules.txt,
which names the OpenWrt package that ships it (taken from the packages feed's python3
subpackage lists).  Standard-library modules are followed further: what they import at module
level, unconditionally, must be installed too (e.g. a module in python3-light that imports one in
python3-urllib).  The Depends of openwrt/qlagent/Makefile, and so of the .ipk, must be exactly the
resulting set.  sdnotify is the one systemd-only import: procd sets no NOTIFY_SOCKET; cryptography
the one upgrade-only import (it reads Secrets an earlier version stored, to re-encrypt them).
"""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TABLE = REPO / "openwrt" / "python3-modules.txt"
MAKEFILE = REPO / "openwrt" / "qlagent" / "Makefile"
PACKAGE = REPO / "qlagent"


def table() -> dict[str, str]:
    rows = {}
    for line in TABLE.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            module, package = line.split()
            assert module not in rows, f"{module} twice in {TABLE.name}"
            rows[module] = package
    return rows


def imports_of(tree: ast.AST) -> set[str]:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return names


def qlagent_imports() -> dict[str, set[str]]:
    """Top-level module name -> files of qlagent importing it (qlagent's own modules left out)."""
    found: dict[str, set[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        for name in imports_of(ast.parse(path.read_text())):
            top = name.split(".")[0]
            # The shim's own files import each other by their plain names (adapters/shim).
            if top != "qlagent" and not (path.parent / f"{top}.py").exists():
                found.setdefault(top, set()).add(str(path.relative_to(REPO)))
    return found


def unconditional_stdlib_closure(roots: set[str]) -> set[str]:
    """Stdlib modules imported, transitively, by module-level statements of ROOTS' sources
    (imports inside try/if/def are optional or lazy and are not followed)."""
    seen: set[str] = set()
    todo = list(roots)
    while todo:
        name = todo.pop()
        if name in seen or name.split(".")[0] not in sys.stdlib_module_names:
            continue
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            continue
        if spec is None:
            continue
        seen.add(name)
        if "." in name:
            todo.append(name.rsplit(".", 1)[0])
        if spec.origin and spec.origin.endswith(".py"):
            for node in ast.parse(Path(spec.origin).read_bytes()).body:
                if isinstance(node, ast.Import):
                    todo.extend(a.name for a in node.names)
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    todo.append(node.module)
    return seen


# Files only a control-plane replica (serve with [cluster]) imports.
CONTROL_PLANE = ("qlagent/adapters/postgres/", "qlagent/http/worker_routes.py", "qlagent/http/tls.py")


def makefile_depends() -> set[str]:
    text = MAKEFILE.read_text()
    block = re.search(r"define Package/qlagent\n(.*?)\nendef", text, re.S).group(1)
    deps = re.search(r"DEPENDS:=(.*?)(?:\n\s*[A-Z]+:=|\Z)", block, re.S).group(1)
    return {d.lstrip("+") for d in deps.replace("\\", " ").split()}


def test_every_module_qlagent_imports_is_mapped_to_an_openwrt_package():
    rows = table()
    unmapped = {m: sorted(files) for m, files in qlagent_imports().items() if m not in rows}
    assert not unmapped, f"add these modules to {TABLE.relative_to(REPO)}: {unmapped}"
    for m, files in qlagent_imports().items():     # the control plane's driver stays off routers
        if rows[m] == "cluster-only":
            assert all(f.startswith("qlagent/adapters/postgres/") for f in files), (m, files)


def test_depends_are_exactly_the_packages_of_the_imports():
    rows = table()
    # What only the control plane's files import never loads on a router.
    direct = {m for m, files in qlagent_imports().items() if not all(f.startswith(CONTROL_PLANE) for f in files)}
    closure = {m.split(".")[0] for m in unconditional_stdlib_closure({m for m in direct if m in sys.stdlib_module_names})}
    # A stdlib module not listed is in python3-light: the table lists every module of every
    # other python3-* subpackage (python3-light = the stdlib minus those).
    needed = {rows.get(m, "python3-light") for m in direct | closure} - {"systemd-only", "cluster-only", "upgrade-only"}
    assert makefile_depends() == needed
    # The agent's own imports named by issue 13 beyond python3-light:
    assert {"python3-uuid", "python3-codecs", "python3-logging", "python3-urllib", "python3-sqlite3"} <= needed


def test_sdnotify_is_imported_only_when_systemd_gives_a_notify_socket():
    def outside_functions(node):  # statements executed at import time (class bodies included)
        for child in ast.iter_child_nodes(node):
            if not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                yield child
                yield from outside_functions(child)

    for path in PACKAGE.rglob("*.py"):
        at_import = set().union(*(imports_of(n) for n in outside_functions(ast.parse(path.read_text()))
                                  if isinstance(n, (ast.Import, ast.ImportFrom))))
        assert "sdnotify" not in {n.split(".")[0] for n in at_import}, path
    env = {k: v for k, v in os.environ.items() if k != "NOTIFY_SOCKET"}
    probe = ("import sys; from qlagent.service.notify import Notifier; Notifier(); "
             "print('sdnotify' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_scripts_run_by_path_keep_their_source_in_the_package():
    """Py3Package deletes .py files after compiling; a module the agent executes by its path
    (``python3 -I -S <dir>/<name>.py``) must be in QLAGENT_KEEP_SOURCE."""
    kept = re.search(r"^QLAGENT_KEEP_SOURCE:=(\S+)$", MAKEFILE.read_text(), re.M).group(1)
    run_by_path = set()
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "join":
                parts = [a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
                if parts and parts[-1].endswith(".py"):
                    script = (path.parent / Path(*parts)).resolve()
                    assert script.is_file(), script
                    run_by_path.add(str(script.parent.relative_to(REPO)))
    assert run_by_path == {kept}


def test_feed_packages_satisfy_the_agents_requirements():
    """openwrt/python-*: a PyPI source pinned by hash, a package and its -src split, and a version
    that satisfies the requirement in pyproject.toml; qlagent's PKG_VERSION is the project's."""
    import tomllib

    from packaging.requirements import Requirement

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    wanted = {Requirement(r).name: Requirement(r) for r in project["dependencies"]}
    assert re.search(r"^PKG_VERSION:=(.+)$", MAKEFILE.read_text(), re.M).group(1) == project["version"]
    feed = sorted((REPO / "openwrt").glob("python-*/Makefile"))
    assert [m.parent.name for m in feed] == ["python-cronsim", "python-msgspec"]
    for mk in feed:
        text = mk.read_text()
        var = lambda name: re.search(rf"^{name}:=(.+)$", text, re.M).group(1)  # noqa: E731
        name, version = var("PYPI_NAME"), var("PKG_VERSION")
        assert re.fullmatch(r"[0-9a-f]{64}", var("PKG_HASH")), mk
        assert version in wanted[name].specifier, f"{mk}: {name} {version} does not satisfy {wanted[name]}"
        for line in (f"$(eval $(call Py3Package,python3-{name}))", f"$(eval $(call BuildPackage,python3-{name}))",
                     f"$(eval $(call BuildPackage,python3-{name}-src))"):
            assert line in text, (mk, line)
        assert f"+python3-{name}" in MAKEFILE.read_text()
