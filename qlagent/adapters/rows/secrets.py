"""Secret rows of ``core.ports.SecretStore`` on either store: names and ciphertext only
(plaintext never reaches a database). Every function takes the ``rows.dialect.Db`` of the
caller's transaction."""

from __future__ import annotations

import msgspec

from ...core.errors import ConflictError, NotFoundError
from ...core.text import quote_bounded
from .dialect import Db


def put_secret(db: Db, project_id: str, name: str, ciphertext: bytes, key_id: str, now_us: int) -> None:
    """Set Secret ``name`` (created or replaced) to ``ciphertext`` sealed with ``key_id``."""
    db.run("SECRET_PUT", (project_id, name, ciphertext, key_id, now_us))


def secret_names(db: Db, project_id: str) -> list[tuple[str, int]]:
    """(name, updated_at_us) pairs, by name (bytewise)."""
    return [(r["name"], r["updated_at_us"]) for r in db.all("SECRET_NAMES", (project_id,))]


def ciphertexts(db: Db, project_id: str, names: list[str]) -> dict[str, bytes]:
    """Ciphertext of each present name (missing names are simply absent)."""
    if not names:
        return {}
    return {r["name"]: bytes(r["ciphertext"]) for r in db.run_in("SECRETS_CIPHERTEXT", (project_id,), names)}


def secret_uses(db: Db, project_id: str | None) -> list[tuple[str, str, bool]]:
    """(task name, Secret name, stored?) for each SecretRef of each live Task head of the
    Project (every Project when None), by task then Secret name (names only: a recipe never
    holds a value)."""
    # Tuples, not the driver's row objects: an sqlite3.Row never equals a tuple.
    stored = {(r["project_id"], r["name"]) for r in db.all("SECRETS_STORED")}
    out = []
    for r in db.all("SECRET_USES", (project_id, project_id)):
        for name in sorted(set(msgspec.json.decode(r["recipe_json"]).get("secretRefs", {}).values())):
            out.append((r["name"], name, (r["project_id"], name) in stored))
    return out


def delete_secret(db: Db, project_id: str, name: str, *, force: bool = False) -> list[str]:
    """Delete Secret ``name``; returns the live Tasks that still refer to it (their Runs will
    fail ``secret_missing:NAME``). Without ``force`` a used Secret is refused (ConflictError
    ``secret_in_use`` naming the Tasks, nothing deleted); NotFoundError ``secret_not_found``."""
    users = [t for t, n, _ in secret_uses(db, project_id) if n == name]
    if users and not force:
        raise ConflictError(f"secret {name!r} is used by task(s) {', '.join(users)}; edit them first, "
                            "or pass --force to remove it anyway (their runs then fail secret_missing)",
                            code="secret_in_use", field="name")
    if db.run("SECRET_DELETE", (project_id, name)).rowcount == 0:
        raise NotFoundError(f"secret {quote_bounded(name)} does not exist", code="secret_not_found")
    return users


def legacy_ciphertexts(db: Db, magic: bytes) -> list[tuple[str, str, bytes]]:
    """(project_id, name, ciphertext) of every row whose ciphertext starts with ``magic``."""
    return [(r["project_id"], r["name"], bytes(r["ciphertext"]))
            for r in db.all("SECRETS_WITH_PREFIX", (len(magic), magic))]


def replace_ciphertext(db: Db, project_id: str, name: str, old: bytes, new: bytes, key_id: str) -> bool:
    """Swap ``old`` for ``new`` (same value, re-encrypted) unless the row changed meanwhile;
    ``updated_at_us`` stays: the value is the one the operator set then. True if swapped."""
    return db.run("SECRET_REPLACE_CIPHERTEXT", (new, key_id, project_id, name, old)).rowcount == 1
