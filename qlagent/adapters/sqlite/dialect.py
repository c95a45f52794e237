"""``SQLITE``: the local store's ``rows.dialect.Dialect`` (its statements: ``queries``)."""

from __future__ import annotations

import sqlite3

import msgspec

from ...core import states
from ..rows.dialect import Dialect
from . import queries

_enc = msgspec.json.Encoder(order="sorted")

# A duplicate token digest is ConflictError; RunEvent payloads are JSON text with sorted keys.
SQLITE = Dialect(queries, duplicate_key=(sqlite3.IntegrityError,), run_states=states.RunState.ALL,
                 encode_json=lambda doc: _enc.encode(doc).decode(), decode_json=msgspec.json.decode)
