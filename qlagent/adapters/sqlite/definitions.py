"""Task definitions in the local store: heads, append-only revisions, execution revisions and
context recipes (ADR-0071 §2: same content idempotent, different content conflict).

All functions take a connection inside the caller's transaction (``authority.write``).
"""

from __future__ import annotations

import sqlite3

import msgspec

from ...core.canonical import canonical_json
from ...core.definitions import PreparedTask, definition_document, execution_document, recipe_document
from ...core.errors import ConflictError, NotFoundError, ValidationError
from ...core.ids import new_id
from ...core.limits import REVISION_MAX
from ...core.models import ContextRecipe, TaskDefinition, TaskHead

_dec = msgspec.json.Decoder(TaskDefinition)


def append_recipe(conn: sqlite3.Connection, prepared: PreparedTask, now_us: int) -> bool:
    """Append the context recipe; True if inserted, False if the same content was there.

    A ref is a content digest, so the same ref with other JSON means a corrupted row:
    raises ConflictError.
    """
    doc = canonical_json(recipe_document(prepared.recipe)).decode()
    row = conn.execute("SELECT recipe_json FROM context_recipes WHERE recipe_ref = ?",
                       (prepared.recipe_ref,)).fetchone()
    if row is not None:
        if row[0] != doc:
            raise ConflictError(f"context recipe {prepared.recipe_ref} exists with other content",
                                code="recipe_conflict")
        return False
    conn.execute("INSERT INTO context_recipes VALUES (?, ?, ?)", (prepared.recipe_ref, doc, now_us))
    return True


def get_recipe(conn: sqlite3.Connection, recipe_ref: str) -> ContextRecipe:
    """The context recipe ``recipe_ref`` (public values and SecretRef names; no Secret value is
    ever in it). NotFoundError if the store lacks it."""
    row = conn.execute("SELECT recipe_json FROM context_recipes WHERE recipe_ref = ?", (recipe_ref,)).fetchone()
    if row is None:
        raise NotFoundError(f"context recipe {recipe_ref} is missing", code="recipe_not_found")
    doc = msgspec.json.decode(row[0])
    return ContextRecipe(public=doc["public"], secret_refs=doc["secretRefs"])


def append_execution_revision(conn: sqlite3.Connection, task_id: str, revision: int,
                              prepared: PreparedTask, now_us: int) -> bool:
    """Publish the execution revision keyed by (task, revision).

    True if inserted; False if the identical content was already published; raises
    ConflictError (code ``execution_revision_conflict``) for different content.
    """
    ex = prepared.definition.execution
    row = conn.execute("SELECT execution_digest FROM execution_revisions WHERE task_id = ? AND revision = ?",
                       (task_id, revision)).fetchone()
    if row is not None:
        if row[0] != prepared.execution_digest:
            raise ConflictError(f"execution revision {revision} of task {task_id} exists with other content",
                                code="execution_revision_conflict")
        return False
    spec = canonical_json(execution_document(ex, prepared.recipe_ref)).decode()
    conn.execute("INSERT INTO execution_revisions VALUES (?, ?, ?, ?, ?, ?, ?)",
                 (task_id, revision, ex.kind, prepared.execution_digest, spec, prepared.recipe_ref, now_us))
    return True


def _append_revision(conn, task_id: str, revision: int, prepared: PreparedTask, now_us: int) -> None:
    doc = canonical_json(definition_document(prepared.definition)).decode()
    row = conn.execute("SELECT content_digest FROM task_revisions WHERE task_id = ? AND revision = ?",
                       (task_id, revision)).fetchone()
    if row is not None:
        if row[0] != prepared.content_digest:
            raise ConflictError(f"revision {revision} of task {task_id} exists with other content",
                                code="revision_conflict")
        return
    conn.execute("INSERT INTO task_revisions VALUES (?, ?, ?, ?, ?)",
                 (task_id, revision, prepared.content_digest, doc, now_us))
    append_recipe(conn, prepared, now_us)
    append_execution_revision(conn, task_id, revision, prepared, now_us)


def add_task(conn: sqlite3.Connection, project_id: str, prepared: PreparedTask, now_us: int) -> TaskHead:
    """Create a Task at revision 1. ConflictError (``task_exists``) if the name is taken."""
    name = prepared.definition.name
    if conn.execute("SELECT 1 FROM tasks WHERE project_id = ? AND name = ? AND deleted_at_us IS NULL",
                    (project_id, name)).fetchone():
        raise ConflictError(f"task {name!r} already exists in this project; use `task edit`",
                            code="task_exists")
    task_id = new_id()
    conn.execute("INSERT INTO tasks(task_id, project_id, name, head_revision, enabled, created_at_us, "
                 "updated_at_us) VALUES (?, ?, ?, 1, ?, ?, ?)",
                 (task_id, project_id, name, int(prepared.enabled), now_us, now_us))
    _append_revision(conn, task_id, 1, prepared, now_us)
    return get_head(conn, project_id, task_id)


def edit_task(conn: sqlite3.Connection, project_id: str, name_or_id: str, expected_revision: int,
              expected_digest: str, prepared: PreparedTask, now_us: int) -> TaskHead:
    """Fenced edit: append revision+1 if the head is exactly (expected_revision, expected_digest).

    A stale fence raises ConflictError (``definition_changed``) and writes nothing. An edit
    with the same content as the head is a no-op returning the head. Renaming is refused.
    """
    head = get_head(conn, project_id, name_or_id)
    if (head.revision, head.content_digest) != (expected_revision, expected_digest):
        raise ConflictError(
            f"task {head.name!r} is at revision {head.revision} ({head.content_digest[:12]}…), not "
            f"{expected_revision} ({expected_digest[:12]}…); re-read it and retry",
            code="definition_changed")
    if prepared.definition.name != head.name:
        raise ValidationError("name", f"a task edit cannot rename {head.name!r}; add a new task and remove this one")
    if prepared.content_digest == head.content_digest:
        return head
    if head.revision >= REVISION_MAX:
        raise ConflictError("task revision would pass 2147483647", limit=REVISION_MAX, code="revision_exhausted")
    rev = head.revision + 1
    _append_revision(conn, head.task_id, rev, prepared, now_us)
    conn.execute("UPDATE tasks SET head_revision = ?, updated_at_us = ? WHERE task_id = ? AND head_revision = ?",
                 (rev, now_us, head.task_id, head.revision))
    return get_head(conn, project_id, head.task_id)


_HEAD_SQL = ("SELECT t.task_id, t.project_id, t.name, t.head_revision, t.enabled, t.created_at_us, "
             "t.updated_at_us, r.content_digest, r.definition_json FROM tasks t "
             "JOIN task_revisions r ON r.task_id = t.task_id AND r.revision = t.head_revision ")


def _head(row) -> TaskHead:
    return TaskHead(task_id=row[0], project_id=row[1], name=row[2], revision=row[3], enabled=bool(row[4]),
                    created_at_us=row[5], updated_at_us=row[6], content_digest=row[7],
                    definition=_dec.decode(row[8]))


def get_head(conn: sqlite3.Connection, project_id: str, name_or_id: str) -> TaskHead:
    """The live head of a Task by name or ID in the Project; raises NotFoundError (``task_not_found``)."""
    row = conn.execute(_HEAD_SQL + "WHERE t.project_id = ? AND (t.name = ? OR t.task_id = ?) "
                       "AND t.deleted_at_us IS NULL", (project_id, name_or_id, name_or_id)).fetchone()
    if row is None:
        raise NotFoundError(f"task {name_or_id!r} does not exist", code="task_not_found")
    return _head(row)


def list_heads(conn: sqlite3.Connection, project_id: str | None = None) -> list[TaskHead]:
    """All live Task heads (of one Project, or of all), ordered by name."""
    if project_id is None:
        rows = conn.execute(_HEAD_SQL + "WHERE t.deleted_at_us IS NULL ORDER BY t.name")
    else:
        rows = conn.execute(_HEAD_SQL + "WHERE t.project_id = ? AND t.deleted_at_us IS NULL ORDER BY t.name",
                            (project_id,))
    return [_head(r) for r in rows]


def set_enabled(conn: sqlite3.Connection, project_id: str, name_or_id: str, enabled: bool, now_us: int) -> TaskHead:
    """Enable or disable a Task (head state, not content: the revision does not change)."""
    head = get_head(conn, project_id, name_or_id)
    conn.execute("UPDATE tasks SET enabled = ?, updated_at_us = ? WHERE task_id = ?",
                 (int(enabled), now_us, head.task_id))
    return get_head(conn, project_id, head.task_id)


def remove_task(conn: sqlite3.Connection, project_id: str, name_or_id: str, now_us: int) -> TaskHead:
    """Soft-delete a Task: its revisions and Runs stay for audit; the name becomes free."""
    head = get_head(conn, project_id, name_or_id)
    conn.execute("UPDATE tasks SET deleted_at_us = ?, enabled = 0, updated_at_us = ? WHERE task_id = ?",
                 (now_us, now_us, head.task_id))
    return head


def skipped_fires(conn: sqlite3.Connection, task_id: str) -> int:
    """Schedule fires skipped for the Task because a single-instance Run was live."""
    row = conn.execute("SELECT skipped_fires FROM tasks WHERE task_id = ?", (task_id,)).fetchone()
    return row[0] if row else 0


def count_skipped_fire(conn: sqlite3.Connection, task_id: str) -> None:
    conn.execute("UPDATE tasks SET skipped_fires = skipped_fires + 1 WHERE task_id = ?", (task_id,))
