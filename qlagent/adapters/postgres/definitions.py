"""Task heads, append-only revisions, execution revisions and context recipes on the cluster
authority (ADR-0071 §2: same content idempotent, different content ConflictError); the
PostgreSQL twin of ``adapters.sqlite.definitions``. Functions take a dict-row cursor inside the
caller's transaction."""

from __future__ import annotations

import msgspec

from ...core.canonical import canonical_json
from ...core.definitions import PreparedTask, definition_document, execution_document, recipe_document
from ...core.errors import ConflictError, NotFoundError, ValidationError
from ...core.ids import new_id
from ...core.limits import REVISION_MAX
from ...core.models import ContextRecipe, TaskDefinition, TaskHead

_dec = msgspec.json.Decoder(TaskDefinition)


def append_recipe(cur, prepared: PreparedTask, now_us: int) -> None:
    """Append the context recipe; the same ref with other content is ConflictError ``recipe_conflict``."""
    doc = canonical_json(recipe_document(prepared.recipe)).decode()
    row = cur.execute("SELECT recipe_json FROM context_recipes WHERE recipe_ref = %s",
                      (prepared.recipe_ref,)).fetchone()
    if row is not None:
        if row["recipe_json"] != doc:
            raise ConflictError(f"context recipe {prepared.recipe_ref} exists with other content",
                                code="recipe_conflict")
        return
    cur.execute("INSERT INTO context_recipes VALUES (%s, %s, %s)", (prepared.recipe_ref, doc, now_us))


def get_recipe(cur, recipe_ref: str) -> ContextRecipe:
    row = cur.execute("SELECT recipe_json FROM context_recipes WHERE recipe_ref = %s", (recipe_ref,)).fetchone()
    if row is None:
        raise NotFoundError(f"context recipe {recipe_ref} is missing", code="recipe_not_found")
    doc = msgspec.json.decode(row["recipe_json"])
    return ContextRecipe(public=doc["public"], secret_refs=doc["secretRefs"])


def _append_revision(cur, task_id: str, revision: int, prepared: PreparedTask, now_us: int) -> None:
    row = cur.execute("SELECT content_digest FROM task_revisions WHERE task_id = %s AND revision = %s",
                      (task_id, revision)).fetchone()
    if row is not None:
        if row["content_digest"] != prepared.content_digest:
            raise ConflictError(f"revision {revision} of task {task_id} exists with other content",
                                code="revision_conflict")
        return
    doc = canonical_json(definition_document(prepared.definition)).decode()
    cur.execute("INSERT INTO task_revisions VALUES (%s, %s, %s, %s, %s)",
                (task_id, revision, prepared.content_digest, doc, now_us))
    append_recipe(cur, prepared, now_us)
    ex = prepared.definition.execution
    spec = canonical_json(execution_document(ex, prepared.recipe_ref)).decode()
    cur.execute("INSERT INTO execution_revisions VALUES (%s, %s, %s, %s, %s, %s, %s)",
                (task_id, revision, ex.kind, prepared.execution_digest, spec, prepared.recipe_ref, now_us))


def add_task(cur, project_id: str, prepared: PreparedTask, now_us: int) -> TaskHead:
    """Create at revision 1; ConflictError ``task_exists`` if the live name is taken."""
    name = prepared.definition.name
    if cur.execute("SELECT 1 FROM tasks WHERE project_id = %s AND name = %s AND deleted_at_us IS NULL",
                   (project_id, name)).fetchone():
        raise ConflictError(f"task {name!r} already exists in this project; use `task edit`", code="task_exists")
    task_id = new_id()
    cur.execute("INSERT INTO tasks(task_id, project_id, name, head_revision, enabled, created_at_us, updated_at_us) "
                "VALUES (%s, %s, %s, 1, %s, %s, %s)", (task_id, project_id, name, prepared.enabled, now_us, now_us))
    _append_revision(cur, task_id, 1, prepared, now_us)
    return get_head(cur, project_id, task_id)


def edit_task(cur, project_id: str, name_or_id: str, expected_revision: int, expected_digest: str,
              prepared: PreparedTask, now_us: int) -> TaskHead:
    """Fenced edit → revision+1; ConflictError ``definition_changed`` on a stale fence; the
    head's own content is a no-op; ValidationError(``name``) for a rename."""
    head = get_head(cur, project_id, name_or_id, lock=True)
    if (head.revision, head.content_digest) != (expected_revision, expected_digest):
        raise ConflictError(
            f"task {head.name!r} is at revision {head.revision} ({head.content_digest[:12]}…), not "
            f"{expected_revision} ({expected_digest[:12]}…); re-read it and retry", code="definition_changed")
    if prepared.definition.name != head.name:
        raise ValidationError("name", f"a task edit cannot rename {head.name!r}; add a new task and remove this one")
    if prepared.content_digest == head.content_digest:
        return head
    if head.revision >= REVISION_MAX:
        raise ConflictError("task revision would pass 2147483647", limit=REVISION_MAX, code="revision_exhausted")
    rev = head.revision + 1
    _append_revision(cur, head.task_id, rev, prepared, now_us)
    cur.execute("UPDATE tasks SET head_revision = %s, updated_at_us = %s WHERE task_id = %s AND head_revision = %s",
                (rev, now_us, head.task_id, head.revision))
    return get_head(cur, project_id, head.task_id)


_HEAD_SQL = ("SELECT t.task_id, t.project_id, t.name, t.head_revision, t.enabled, t.created_at_us, "
             "t.updated_at_us, r.content_digest, r.definition_json FROM tasks t "
             "JOIN task_revisions r ON r.task_id = t.task_id AND r.revision = t.head_revision ")


def _head(row: dict) -> TaskHead:
    return TaskHead(task_id=row["task_id"], project_id=row["project_id"], name=row["name"],
                    revision=row["head_revision"], enabled=bool(row["enabled"]), created_at_us=row["created_at_us"],
                    updated_at_us=row["updated_at_us"], content_digest=row["content_digest"],
                    definition=_dec.decode(row["definition_json"]))


def get_head(cur, project_id: str, name_or_id: str, *, lock: bool = False) -> TaskHead:
    """The live head by name or ID (``lock``: the Task row FOR UPDATE, ADR-0376 §2 step 4);
    NotFoundError ``task_not_found``."""
    row = cur.execute(_HEAD_SQL + "WHERE t.project_id = %s AND (t.name = %s OR t.task_id = %s) "
                      "AND t.deleted_at_us IS NULL" + (" FOR UPDATE OF t" if lock else ""),
                      (project_id, name_or_id, name_or_id)).fetchone()
    if row is None:
        raise NotFoundError(f"task {name_or_id!r} does not exist", code="task_not_found")
    return _head(row)


def list_heads(cur, project_id: str | None) -> list[TaskHead]:
    """Live heads (of one Project, or all), by name."""
    return [_head(r) for r in cur.execute(
        _HEAD_SQL + "WHERE (%(p)s::text IS NULL OR t.project_id = %(p)s) AND t.deleted_at_us IS NULL "
        "ORDER BY t.name COLLATE \"C\", t.task_id", {"p": project_id})]


def set_enabled(cur, project_id: str, name_or_id: str, enabled: bool, now_us: int) -> TaskHead:
    head = get_head(cur, project_id, name_or_id, lock=True)
    cur.execute("UPDATE tasks SET enabled = %s, updated_at_us = %s WHERE task_id = %s", (enabled, now_us, head.task_id))
    return get_head(cur, project_id, head.task_id)


def remove_task(cur, project_id: str, name_or_id: str, now_us: int) -> TaskHead:
    """Soft-delete: revisions and Runs stay for audit; the name becomes free."""
    head = get_head(cur, project_id, name_or_id, lock=True)
    cur.execute("UPDATE tasks SET deleted_at_us = %s, enabled = false, updated_at_us = %s WHERE task_id = %s",
                (now_us, now_us, head.task_id))
    return head


def skipped_fires(cur, task_id: str) -> int:
    row = cur.execute("SELECT skipped_fires FROM tasks WHERE task_id = %s", (task_id,)).fetchone()
    return row["skipped_fires"] if row else 0


def count_skipped_fire(cur, task_id: str) -> None:
    cur.execute("UPDATE tasks SET skipped_fires = skipped_fires + 1 WHERE task_id = %s", (task_id,))
