"""ADR-0071 §4 step 4: decrypt the de-duplicated SecretRefs of one launch."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..core.errors import UnavailableError

if TYPE_CHECKING:   # ports are annotations only: no Protocol class at run time
    from ..core.ports import CipherFactory, SecretStore


def resolve_secrets(store: SecretStore, cipher: CipherFactory, project_id: str, names: list[str]) -> dict[str, bytes]:
    """Plaintext of each of ``names`` (de-duplicated). Raises UnavailableError(code
    ``secret_missing``, field the name) for the first missing Secret. The plaintext returned
    must live only in the caller's stack; the cipher is opened only when a Secret is needed."""
    wanted = sorted(set(names))
    if not wanted:
        return {}
    blobs = store.ciphertexts(project_id, wanted)
    missing = [n for n in wanted if n not in blobs]
    if missing:
        raise UnavailableError(f"secret {missing[0]!r} is not set", code="secret_missing", field=missing[0])
    box = cipher()
    return {n: box.open(project_id, n, blobs[n]) for n in wanted}
