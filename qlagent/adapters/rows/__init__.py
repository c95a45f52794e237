"""The row logic both store dialects share (ADR-0014 "only the Repository and transport change").

``dialect`` is the seam: a ``Dialect`` holds one store's named statements (``queries`` here,
written once with ``?`` marks, plus the statements of ``adapters/sqlite/queries.py`` or
``adapters/postgres/queries.py`` that really differ, under the same names) and ``Db`` runs them
by name on one transaction's connection or cursor. The row modules (``policy``, ``secrets``,
``definitions``) take a ``Db`` and read rows by column name only. Nothing here imports a driver.
"""
