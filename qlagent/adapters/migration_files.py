"""The migration files and history rule shared by the SQLite and PostgreSQL migrators.

A build ships ``NNNN_name.sql`` files beside its migrator; each is identified by version, name
and the SHA-256 of its text. A store's recorded history (version, name, checksum) must be a
subset of what the build knows, byte for byte: an unknown version (a newer or different build
wrote it) or an altered file is refused before anything is applied (ADR-0071 §2).
"""

from __future__ import annotations

import os
import re

import msgspec

from ..core.canonical import sha256_hex
from ..core.errors import StoreIntegrityError

_NAME = re.compile(r"^(\d{4})_([a-z0-9_]+)\.sql$")


class Migration(msgspec.Struct, frozen=True):
    version: int
    name: str
    sql: str
    checksum: str           # SHA-256 hex of ``sql`` (UTF-8)


def read_migrations(directory: str) -> list[Migration]:
    """The ``NNNN_name.sql`` files of ``directory`` in version order. Read with ``os``, not
    importlib.resources, whose zipfile/pathlib/tempfile imports cost the agent ~1 MiB RSS."""
    out = []
    for name in os.listdir(directory):
        m = _NAME.match(name)
        if m:
            with open(os.path.join(directory, name), encoding="utf-8") as f:
                sql = f.read()
            out.append(Migration(int(m.group(1)), m.group(2), sql, sha256_hex(sql.encode())))
    out.sort(key=lambda x: x.version)
    return out


def pending(applied: list[tuple[int, str, str]], known: list[Migration]) -> list[Migration]:
    """The migrations of ``known`` not in ``applied`` (rows of version, name, checksum).

    Raises StoreIntegrityError naming the first applied migration this build does not know or
    whose name/checksum differs.
    """
    by_version = {m.version: m for m in known}
    for version, name, checksum in applied:
        m = by_version.get(version)
        if m is None:
            raise StoreIntegrityError(
                f"database history has migration {version:04d}_{name} which this qlagent does not know; "
                "it was written by a newer or different build — refusing to start")
        if m.checksum != checksum or m.name != name:
            raise StoreIntegrityError(
                f"migration {version:04d}_{name} in the database differs from this build's "
                f"(checksum {checksum[:12]}… vs {m.checksum[:12]}…) — refusing to start")
    done = {v for v, _, _ in applied}
    return [m for m in known if m.version not in done]
