"""The values of a claimed offer (``core.cluster.SecretResolver``): ciphertext rows opened with
the control plane's SecretBox key (which never enters the database). The Secret rows of
``core.ports.SecretStore`` are ``adapters.rows.secrets``."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ...core.errors import UnavailableError
from .connection import read
from .queries import SECRETS_FOR_OFFER

if TYPE_CHECKING:   # annotations only: psycopg loads where a connection is opened
    from psycopg_pool import ConnectionPool


class PgSecretResolver:
    """``core.cluster.SecretResolver``: ``box`` is the control plane's ``adapters.secretbox.SecretBox``."""

    def __init__(self, pool: ConnectionPool, box) -> None:
        self._pool, self._box = pool, box

    def resolve(self, project_id: str, names: list[str]) -> dict[str, bytes]:
        """Plaintext of each named Secret of the Project. UnavailableError ``secret_missing``
        for the first absent one, ``secret_unreadable`` for the first that does not decrypt,
        each with ``field`` = that name (the Pull turns them into the Attempt's reason)."""
        rows = read(self._pool, lambda cur: cur.execute(SECRETS_FOR_OFFER, (project_id, list(names))).fetchall())
        blobs = {r["name"]: bytes(r["ciphertext"]) for r in rows}
        for name in names:
            if name not in blobs:
                raise UnavailableError(f"secret {name!r} does not exist in this Project", code="secret_missing",
                                       field=name)
        out = {}
        for name in names:
            try:
                out[name] = self._box.open(project_id, name, blobs[name])
            except UnavailableError as e:
                raise UnavailableError(e.message, code="secret_unreadable", field=name) from None
        return out
