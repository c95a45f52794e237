"""Pure builders for the contract suite (no store access)."""

from __future__ import annotations

import msgspec

from qlagent.core.definitions import PreparedTask, TaskInput, prepare_task


def prepared(name: str, **kw) -> PreparedTask:
    """A validated ``/bin/sh`` Task ``name`` (manual by default); ``kw`` are task-file fields."""
    kw.setdefault("shell", "/bin/sh")
    kw.setdefault("script", f"echo {name}")
    return prepare_task(msgspec.convert({"name": name, **kw}, TaskInput))
