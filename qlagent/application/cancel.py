"""Cancellation (idempotent): queued → cancelled at once; an active Run gets a cancellation
intent that the service's coordinator carries out on the whole process tree."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..core.models import Run

if TYPE_CHECKING:   # ports are annotations only: no Protocol class at run time
    from ..core.ports import RunStore


def request_cancel(store: RunStore, run_id: str, actor: str, project_id: str | None = None) -> Run:
    """Record the intent and return the Run as it now stands. NotFoundError for unknown Runs."""
    return store.request_cancel(run_id, actor, project_id)
