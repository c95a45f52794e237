"""Secret rows of ``core.ports.SecretStore`` (names and ciphertext only; plaintext never reaches
the database) and the values of a claimed offer (``core.cluster.SecretResolver``): ciphertext
rows opened with the control plane's SecretBox key (which never enters the database)."""

from __future__ import annotations

import msgspec

from ...core.errors import ConflictError, NotFoundError, UnavailableError
from .connection import read


class PgSecretResolver:
    """``core.cluster.SecretResolver``: ``box`` is the control plane's ``adapters.secretbox.SecretBox``."""

    def __init__(self, pool, box) -> None:
        self._pool, self._box = pool, box

    def resolve(self, project_id: str, names: list[str]) -> dict[str, bytes]:
        """Plaintext of each named Secret of the Project. UnavailableError ``secret_missing``
        for the first absent one, ``secret_unreadable`` for the first that does not decrypt,
        each with ``field`` = that name (the Pull turns them into the Attempt's reason)."""
        rows = read(self._pool, lambda cur: cur.execute(
            "SELECT name, ciphertext FROM secrets WHERE project_id = %s AND name = ANY(%s)",
            (project_id, list(names))).fetchall())
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


# ---- Secret rows (SecretStore): names and ciphertext only, inside the caller's transaction ----

def put_secret(cur, project_id: str, name: str, ciphertext: bytes, key_id: str, now_us: int) -> None:
    cur.execute("INSERT INTO secrets VALUES (%s, %s, %s, %s, %s) ON CONFLICT (project_id, name) DO UPDATE SET "
                "ciphertext = excluded.ciphertext, key_id = excluded.key_id, updated_at_us = excluded.updated_at_us",
                (project_id, name, ciphertext, key_id, now_us))


def secret_names(cur, project_id: str) -> list[tuple[str, int]]:
    return [(r["name"], r["updated_at_us"]) for r in cur.execute(
        "SELECT name, updated_at_us FROM secrets WHERE project_id = %s ORDER BY name COLLATE \"C\"", (project_id,))]


def ciphertexts(cur, project_id: str, names: list[str]) -> dict[str, bytes]:
    if not names:
        return {}
    return {r["name"]: bytes(r["ciphertext"]) for r in cur.execute(
        "SELECT name, ciphertext FROM secrets WHERE project_id = %s AND name = ANY(%s)", (project_id, list(names)))}


def secret_uses(cur, project_id: str | None) -> list[tuple[str, str, bool]]:
    """(task name, Secret name, stored?) per SecretRef of each live Task head, by task then name."""
    stored = {(r["project_id"], r["name"]) for r in cur.execute("SELECT project_id, name FROM secrets")}
    out = []
    for r in cur.execute(
            "SELECT t.project_id, t.name, cr.recipe_json FROM tasks t JOIN execution_revisions e "
            "ON e.task_id = t.task_id AND e.revision = t.head_revision JOIN context_recipes cr "
            "ON cr.recipe_ref = e.recipe_ref WHERE (%(p)s::text IS NULL OR t.project_id = %(p)s) "
            "AND t.deleted_at_us IS NULL ORDER BY t.name COLLATE \"C\"", {"p": project_id}).fetchall():
        for name in sorted(set(msgspec.json.decode(r["recipe_json"]).get("secretRefs", {}).values())):
            out.append((r["name"], name, (r["project_id"], name) in stored))
    return out


def legacy_ciphertexts(cur, magic: bytes) -> list[tuple[str, str, bytes]]:
    """(project_id, name, ciphertext) of every row whose ciphertext starts with ``magic``."""
    return [(r["project_id"], r["name"], bytes(r["ciphertext"])) for r in cur.execute(
        "SELECT project_id, name, ciphertext FROM secrets WHERE substr(ciphertext, 1, %s) = %s "
        "ORDER BY project_id, name", (len(magic), magic))]


def replace_ciphertext(cur, project_id: str, name: str, old: bytes, new: bytes, key_id: str) -> bool:
    """Swap ``old`` for ``new`` (the same value re-encrypted) unless the row changed meanwhile;
    ``updated_at_us`` stays. True if swapped."""
    return cur.execute("UPDATE secrets SET ciphertext = %s, key_id = %s WHERE project_id = %s AND name = %s "
                       "AND ciphertext = %s", (new, key_id, project_id, name, old)).rowcount == 1


def delete_secret(cur, project_id: str, name: str, *, force: bool = False) -> list[str]:
    """Delete; returns the live Tasks still using it. ConflictError ``secret_in_use`` without
    ``force``; NotFoundError ``secret_not_found``."""
    users = [t for t, n, _ in secret_uses(cur, project_id) if n == name]
    if users and not force:
        raise ConflictError(f"secret {name!r} is used by task(s) {', '.join(users)}; edit them first, "
                            "or pass --force to remove it anyway (their runs then fail secret_missing)",
                            code="secret_in_use", field="name")
    if cur.execute("DELETE FROM secrets WHERE project_id = %s AND name = %s", (project_id, name)).rowcount == 0:
        raise NotFoundError(f"secret {name!r} does not exist", code="secret_not_found")
    return users
