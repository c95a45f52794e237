"""Helpers for tests that drive the real ``qlagent`` CLI in a subprocess over a real state dir
(the ``workdir`` and ``state`` fixtures in ``tests/conftest.py``).

State directories live on tmpfs (``kit.scratch_dir``) when it is writable: the SQLite files are
real, only the fsync cost of a slow disk is avoided so each CLI call stays ~0.2 s.
"""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess

from kit import run_cli


def cli(state: str, *args: str, stdin: bytes | None = None, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run ``qlagent --state-dir STATE ARGS`` (:func:`kit.run_cli`: never inherits QLAGENT_* vars)."""
    return run_cli("--state-dir", state, *args, stdin=stdin, env=env)


def ok(state: str, *args: str, stdin: bytes | None = None) -> subprocess.CompletedProcess:
    p = cli(state, *args, stdin=stdin)
    assert p.returncode == 0, (args, p.stdout, p.stderr)
    assert b"Traceback" not in p.stderr
    return p


def js(state: str, *args: str):
    return json.loads(ok(state, *args, "--json").stdout)


def rows(state: str, table: str) -> int:
    with sqlite3.connect(os.path.join(state, "qlagent.db")) as c:
        return c.execute(f"SELECT count(*) FROM {table}").fetchone()[0]
