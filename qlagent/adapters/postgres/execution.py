"""Dispatch candidates of the cluster authority's local executor: a keyset page in
``Candidate.key()`` order with ``limit + 1`` rows over ``runs_dispatch_candidates``, never
OFFSET. The transitions both stores share are ``adapters.rows.execution``."""

from __future__ import annotations

from ...core.dispatch import Candidate
from ..rows.dialect import Db


def candidate_page(db: Db, limit: int, after: tuple | None, now_us: int, executor_type: str) -> list[Candidate]:
    """Up to ``limit + 1`` candidates of ``executor_type`` strictly after keyset ``after``
    (a ``Candidate.key()``: priority, created, attempt created, attempt ID)."""
    args = {"ex": executor_type, "now": now_us, "lim": limit + 1}
    if after is None:
        return [Candidate(*r.values()) for r in db.all("CANDIDATES", args)]
    p, c, ac, aid = after
    return [Candidate(*r.values()) for r in db.all("CANDIDATES_AFTER", {**args, "p": -p, "c": c, "ac": ac,
                                                                        "aid": aid})]
