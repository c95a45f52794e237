"""Secret values for a claimed offer (``core.cluster.SecretResolver``): ciphertext rows from
the authority, opened with the control plane's SecretBox key (which never enters the database)."""

from __future__ import annotations

from ...core.errors import UnavailableError
from .connection import transaction


class PgSecretResolver:
    """``core.cluster.SecretResolver``: ``box`` is the control plane's ``adapters.secretbox.SecretBox``."""

    def __init__(self, pool, box) -> None:
        self._pool, self._box = pool, box

    def resolve(self, project_id: str, names: list[str]) -> dict[str, bytes]:
        """Plaintext of each named Secret of the Project. UnavailableError ``secret_missing``
        naming the first absent one, ``secret_unreadable`` when a value does not decrypt."""
        rows = transaction(self._pool, lambda cur: cur.execute(
            "SELECT name, ciphertext FROM secrets WHERE project_id = %s AND name = ANY(%s)",
            (project_id, list(names))).fetchall())
        blobs = {r["name"]: bytes(r["ciphertext"]) for r in rows}
        for name in names:
            if name not in blobs:
                raise UnavailableError(f"secret {name!r} does not exist in this Project", code="secret_missing")
        return {name: self._box.open(project_id, name, blobs[name]) for name in names}
