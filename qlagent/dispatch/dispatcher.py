"""LocalRunDispatcher: one explicit, bounded pass (ADR-0071 §3).

``dispatch_once()`` reads ONE keyset page of candidates (edge 4, standalone 16; ``limit + 1``
rows, the extra one only as truncation evidence), materialises them in order and activates at
most ONE Run, then returns. It owns no timer, thread or queue: the caller decides when to call
again. A candidate lost to a race or that must wait is skipped; a launch failure is returned,
never retried here. When a whole page is skipped, the next pass continues after it (a keyset
cursor, never OFFSET) so that waiting Runs cannot starve the ones behind them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..core.dispatch import DispatchResult
from ..execution.coordinator import LocalExecutionCoordinator
from .admission import Admission
from .materializer import Materializer

if TYPE_CHECKING:   # ports are annotations only: no Protocol class at run time
    from ..core.ports import DispatchStore


class LocalRunDispatcher:
    def __init__(self, store: DispatchStore, materializer: Materializer, coordinator: LocalExecutionCoordinator,
                 admission: Admission, page_size: int) -> None:
        if not (1 <= page_size <= 64):
            raise ValueError("page_size must be 1..64")
        self._store = store
        self._materializer = materializer
        self._coordinator = coordinator
        self._admission = admission
        self._page = page_size
        self._after: tuple | None = None

    def dispatch_once(self) -> DispatchResult:
        """One pass; see the module docstring. Never raises for a candidate's problems."""
        limited = self._admission.global_block()
        if limited:
            return DispatchResult("limited", limited)
        rows = self._store.candidate_page(self._page, self._after)
        page, truncated = rows[:self._page], len(rows) > self._page
        if not page:
            wrapped = self._after is not None
            self._after = None
            return DispatchResult("more" if wrapped else "no_candidate", rows_read=len(rows))
        skipped = 0
        for c in page:
            prepared = self._materializer.prepare(c)
            if prepared.kind == "skip":
                skipped += 1
                continue
            if prepared.kind == "unavailable":
                return DispatchResult("unavailable", prepared.reason, c.run_id, len(rows), skipped,
                                      prepared.refusal)
            outcome, reason = self._coordinator.start(prepared.command)
            if outcome == "race_lost":
                self._materializer.discard(prepared.command.artifact_path)
                skipped += 1
                continue
            self._after = None
            return DispatchResult(outcome, reason, c.run_id, len(rows), skipped)
        self._after = page[-1].key() if truncated else None
        return DispatchResult("more" if truncated else "no_candidate", rows_read=len(rows), skipped=skipped)
