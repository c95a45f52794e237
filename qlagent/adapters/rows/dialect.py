"""``Dialect`` and ``Db``: the seam between the shared row functions and one store's driver.

A ``Dialect`` is built once per store module from ``rows.queries`` (the statements both stores
run alike, ``?`` marks) and the dialect's own ``queries`` module (the statements that differ,
under the same names). A ``{values}`` in a statement is an ``IN`` list that ``Db.run_in`` fills
with one mark per value. ``paramstyle="format"`` (psycopg) turns every ``?`` of a shared
statement into ``%s`` (a literal ``%`` into ``%%``). ``Db`` wraps the connection (sqlite3,
``sqlite3.Row`` rows) or cursor (psycopg, dict rows) of one transaction: ``one``/``all``/``run`` execute a
statement by name; anything else (``execute`` of a dialect module's own SQL, ``rowcount``)
reaches the wrapped object unchanged. Rows are read by column name, which both row types allow.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

from . import queries as shared


def _statements(module: ModuleType) -> dict[str, str]:
    """The module's statements: its public upper-case string constants (``_FRAGMENT``s are parts)."""
    return {k: v for k, v in vars(module).items() if k.isupper() and not k.startswith("_") and isinstance(v, str)}


class Dialect:
    """``Dialect(own, *, paramstyle="qmark"|"format", duplicate_key=(), run_states, encode_json,
    decode_json)``: ``own`` the dialect's ``queries`` module; ``duplicate_key`` the driver exceptions for a unique-key violation that a
    row function turns into ConflictError (empty where the store's transaction re-runs on them
    instead, as ``PgStore``'s does); ``run_states`` the Run states the store holds (the cluster's
    add ``dispatching``); ``encode_json``/``decode_json`` a RunEvent payload (dict) to and from
    its column (SQLite: text, PostgreSQL: jsonb)."""

    def __init__(self, own: ModuleType, *, paramstyle: str = "qmark",
                 duplicate_key: tuple[type[BaseException], ...] = (), run_states: frozenset[str],
                 encode_json: Callable[[dict], Any], decode_json: Callable[[Any], dict]) -> None:
        self.paramstyle = paramstyle
        self.duplicate_key, self.run_states = duplicate_key, run_states
        self.encode_json, self.decode_json = encode_json, decode_json
        common = _statements(shared)
        if paramstyle == "format":
            common = {k: shared.format_marks(v) for k, v in common.items()}
        self.statements = {**common, **_statements(own)}

    def db(self, raw: Any) -> Db:
        """``raw`` (a connection or cursor) as a ``Db`` of this dialect; a ``Db`` as it is."""
        return raw if isinstance(raw, Db) else Db(raw, self)


class Db:
    """One transaction's connection or cursor ``raw`` with the statements of ``dialect``."""

    __slots__ = ("raw", "dialect", "_sql")

    def __init__(self, raw: Any, dialect: Dialect) -> None:
        self.raw, self.dialect, self._sql = raw, dialect, dialect.statements

    def run_in(self, name: str, params: tuple, values: list):
        """Execute statement ``name`` whose ``{values}`` is an ``IN`` list of ``values``
        (non-empty), bound after ``params``; returns the driver's cursor."""
        mark = "%s" if self.dialect.paramstyle == "format" else "?"
        sql = self._sql[name].format(values=", ".join([mark] * len(values)))
        return self.raw.execute(sql, (*params, *values))

    def run(self, name: str, params: Any = ()):
        """Execute statement ``name``; returns the driver's cursor (``rowcount``, ``fetch…``)."""
        return self.raw.execute(self._sql[name], params)

    def one(self, name: str, params: Any = ()):
        """The first row of statement ``name``, or None."""
        return self.raw.execute(self._sql[name], params).fetchone()

    def all(self, name: str, params: Any = ()) -> list:
        """Every row of statement ``name``."""
        return self.raw.execute(self._sql[name], params).fetchall()

    def execute(self, *args, **kwargs):
        """A dialect module's own statement, passed to the driver as it is."""
        return self.raw.execute(*args, **kwargs)

    def __getattr__(self, attr: str):
        return getattr(self.raw, attr)
