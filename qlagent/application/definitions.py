"""The frozen definition writer: the only way definitions change (ADR-0071 §1 "冻结 writer facade").

It appends Task revisions, execution revisions and context recipes; it cannot launch,
read candidates or touch Runs other than cancelling queued ones of a disabled/removed Task.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from ..core import limits as L
from ..core.definitions import PreparedTask, parse_task_file, prepare_task
from ..core.errors import ValidationError
from ..core.models import LOCAL_SUBJECT, TaskHead

if TYPE_CHECKING:   # ports are annotations only: no Protocol class at run time
    from ..core.ports import Store

_DIGEST = re.compile(r"^[0-9a-f]{64}\Z")


def check_fence(revision: int, digest: str, *, revision_field: str = "expectedRevision",
                digest_field: str = "expectedDigest") -> None:
    """Refuse a malformed fence as bad input before any store access (ADR-0376 §1).

    ``revision`` must be 1..2147483647 and ``digest`` 64 lowercase hex characters; raises
    ValidationError naming the field and the limit.
    """
    if isinstance(revision, bool) or not (L.REVISION_MIN <= revision <= L.REVISION_MAX):
        raise ValidationError(revision_field, f"{revision} is outside {L.REVISION_MIN}..{L.REVISION_MAX}",
                              limit=f"{L.REVISION_MIN}..{L.REVISION_MAX}")
    if not _DIGEST.match(digest):
        raise ValidationError(digest_field, f"{digest!r} is not {L.DIGEST_HEX_LEN} lowercase hex characters",
                              limit=L.DIGEST_HEX_LEN)


class DefinitionWriter:
    """Over the store's DefinitionStore port, in the Project the store acts in (``store.project``)."""

    __slots__ = ("_store", "_pid")

    def __init__(self, store: Store) -> None:
        self._pid = store.project.project_id
        self._store = store

    def __setattr__(self, name, value):
        if hasattr(self, "_store"):
            raise AttributeError("DefinitionWriter is frozen")
        object.__setattr__(self, name, value)

    @staticmethod
    def prepare_file(data: dict) -> list[PreparedTask]:
        """Validate a whole task file (pure); ValidationError names ``task[i].field``."""
        return [prepare_task(t, i) for i, t in enumerate(parse_task_file(data))]

    def add(self, prepared: list[PreparedTask]) -> list[TaskHead]:
        """Create every Task of a file in ONE transaction: all or nothing."""
        return self._store.add_tasks(self._pid, prepared)

    def edit(self, name: str, expected_revision: int, expected_digest: str, prepared: PreparedTask) -> TaskHead:
        """Fenced edit (revision+1); ConflictError(definition_changed) on a stale fence,
        ValidationError for a malformed fence (see ``check_fence``)."""
        check_fence(expected_revision, expected_digest)
        return self._store.edit_task(self._pid, name, expected_revision, expected_digest, prepared)

    def set_enabled(self, name: str, enabled: bool) -> tuple[TaskHead, int]:
        """Enable/disable; disabling cancels the Task's queued Runs. Returns (head, cancelled)."""
        return self._store.set_enabled(self._pid, name, enabled, LOCAL_SUBJECT)

    def remove(self, name: str) -> tuple[TaskHead, int, int]:
        """Soft-delete; cancels queued Runs and asks active ones to stop (a removed Task must not
        keep running unseen). Returns (last head, queued cancelled, active asked to stop)."""
        return self._store.remove_task(self._pid, name, LOCAL_SUBJECT)
