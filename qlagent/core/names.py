"""The Task name rule, shared by the task file (core.definitions), the CLI's arguments and the
HTTP API's ``{taskId}``: 1..``MAX_TASK_NAME`` characters of ``[a-z0-9._-]``, starting
alphanumeric. A Task ID (a lowercase UUID, 36 characters) follows the same rule, so a
reference that breaks it names no Task and is bad input, not "not found"."""

from __future__ import annotations

import re

from .limits import MAX_TASK_NAME

TASK_NAME = re.compile(r"^[a-z0-9][a-z0-9._-]*\Z")


def task_ref_problem(value: str) -> str | None:
    """Why ``value`` can be neither a Task's name nor its ID (a phrase such as ``is 65
    characters (limit 64)``), else None."""
    if len(value) > MAX_TASK_NAME:
        return f"is {len(value)} characters (limit {MAX_TASK_NAME})"
    if not TASK_NAME.match(value):
        return "is not a task name or ID ([a-z0-9._-], starting alphanumeric)"
    return None
