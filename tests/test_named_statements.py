"""Every SQL statement of the stores has a name (docs/ARCHITECTURE.md "adapters"; issue 23 §1).

A string literal that starts with an SQL verb passed to ``.execute(``/``.executemany(`` anywhere
under ``qlagent/adapters/`` fails this test, except in the modules of named statements
(``queries.py``, ``*_queries.py``) and ``adapters/qinglong.py``, which reads another program's
database with columns it probes at run time. The migration runners' file-driven statements are
passed by variable, never as a literal. PRAGMAs, BEGIN/COMMIT/ROLLBACK, SET, LOCK and LISTEN stay
at their call sites, as ``sqlite/store.py`` keeps them.
"""

from __future__ import annotations

import ast
import os
import re

import qlagent

ADAPTERS = os.path.join(os.path.dirname(qlagent.__file__), "adapters")
VERB = re.compile(r"\s*\(*\s*(SELECT|INSERT|UPDATE|DELETE|WITH|CREATE|ALTER|DROP)\b", re.IGNORECASE)
EXEMPT = {"qinglong.py"}


def _leading_text(node: ast.AST) -> str | None:
    """The text a statement argument starts with: a literal, an f-string's literal parts, the
    left operand of ``+`` or either branch of ``a if c else b``."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return _leading_text(node.left)
    if isinstance(node, ast.IfExp):
        return _leading_text(node.body) or _leading_text(node.orelse)
    return None


def inline_statements(source: str, filename: str) -> list[str]:
    """``file:line: statement start`` of each inline SQL statement in ``source``."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr in ("execute", "executemany") and node.args):
            texts = [_leading_text(node.args[0])]
            if isinstance(node.args[0], ast.IfExp):
                texts = [_leading_text(node.args[0].body), _leading_text(node.args[0].orelse)]
            if any(t and VERB.match(t) for t in texts):
                found.append(f"{filename}:{node.lineno}: {next(t for t in texts if t)[:60]!r}")
    return found


def _modules():
    for folder, _, files in os.walk(ADAPTERS):
        for name in sorted(files):
            if name.endswith(".py") and name not in EXEMPT and name != "queries.py" \
                    and not name.endswith("_queries.py"):
                yield os.path.join(folder, name)


def test_no_inline_statement_under_adapters():
    found = []
    for path in _modules():
        with open(path, encoding="utf-8") as f:
            found += inline_statements(f.read(), os.path.relpath(path, ADAPTERS))
    assert not found, "statements not named in a queries module:\n" + "\n".join(found)


def test_the_check_finds_each_inline_form():
    source = '''
def f(cur, c, lock, t):
    cur.execute("SELECT 1 FROM runs WHERE run_id = %s", (1,))
    cur.execute("UPDATE runs SET held = %s" + (" WHERE x" if lock else ""))
    c.executemany("delete from offers where seq = ?", [])
    cur.execute(f"WITH a AS (SELECT 1) SELECT * FROM {t}")
    cur.execute(NAMED if lock else "INSERT INTO t VALUES (1)")
    c.execute("PRAGMA journal_mode=WAL")
    c.execute("BEGIN IMMEDIATE")
    cur.execute(NAMED, (1,))
'''
    lines = [f.split(":")[1] for f in inline_statements(source, "sample.py")]
    assert lines == ["3", "4", "5", "6", "7"]


def test_a_dialect_replaces_a_shared_statement_only_where_meant():
    """A statement named in a dialect's module like one of ``rows/queries.py`` replaces the shared
    one in every row function (``rows.dialect.Dialect``): only PostgreSQL's Run moves do (they
    return the event sequence they took); a cluster-only statement must take a name of its own."""
    from qlagent.adapters.postgres import queries as postgres
    from qlagent.adapters.rows import queries as shared
    from qlagent.adapters.rows.dialect import _statements
    from qlagent.adapters.sqlite import queries as sqlite

    common = set(_statements(shared))
    assert sorted(common & set(_statements(postgres))) == [
        "RUN_MOVE", "RUN_MOVE_AT_VERSION", "RUN_MOVE_END", "RUN_MOVE_REQUEUE", "RUN_NEXT_ATTEMPT", "RUN_NEXT_EVENT"]
    assert not common & set(_statements(sqlite))
