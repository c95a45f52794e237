"""``POSTGRES``: the cluster authority's ``rows.dialect.Dialect`` (its statements: ``queries``)."""

from __future__ import annotations

from ...core import states
from ..rows.dialect import Dialect
from . import queries


def _jsonb(doc: dict):
    from psycopg.types.json import Jsonb        # psycopg loads only with a cluster store
    return Jsonb(doc)


# A unique violation re-runs the transaction (``PgStore``); RunEvent payloads are jsonb, read as dicts.
POSTGRES = Dialect(queries, paramstyle="format", run_states=states.RunState.ALL_CLUSTER,
                   encode_json=_jsonb, decode_json=lambda doc: doc)
