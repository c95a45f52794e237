"""Cancellation (idempotent): queued → cancelled at once; a live Run gets a cancellation intent
that the service's coordinator carries out on the whole process tree."""

from __future__ import annotations

from ..adapters.sqlite import execution as ex
from ..adapters.sqlite import runs as runs_repo
from ..core.models import Run
from .store import LocalStore, now_us


def request_cancel(store: LocalStore, run_id: str, actor: str, project_id: str | None = None) -> Run:
    """Record the intent and return the Run as it now stands. NotFoundError for unknown Runs."""
    def tx(c):
        run = runs_repo.get_run(c, run_id, project_id)
        ex.request_cancel(c, run.run_id, actor, now_us())
        return runs_repo.get_run(c, run.run_id)
    return store.write(tx)
