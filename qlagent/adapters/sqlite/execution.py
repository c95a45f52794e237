"""Dispatch candidates of the local store (ADR-0071 §4): a keyset page over the
``runs_dispatch_candidates`` partial index with ``limit + 1`` rows, never OFFSET. The
transitions both stores share are ``adapters.rows.execution``."""

from __future__ import annotations

from ...core.dispatch import Candidate
from ..rows.dialect import Db


def candidate_page(db: Db, limit: int, after: tuple | None, now_us: int) -> list[Candidate]:
    """Up to ``limit + 1`` candidates after keyset ``after`` (None: from the start). A Run whose
    pinned revision is missing is still a candidate: the materialiser fails it with
    ``revision_missing`` rather than leaving it queued unseen."""
    if after is None:
        rows = db.all("CANDIDATES", (now_us, limit + 1))
    else:
        p, c, ac, aid = after
        rows = db.all("CANDIDATES_AFTER", (now_us, p, c, ac, aid, limit + 1, now_us, p, limit + 1, limit + 1))
    return [Candidate(*r) for r in rows]
