"""Task definitions on either store: heads, append-only revisions, execution revisions and
context recipes (ADR-0071 §2: same content idempotent, different content ConflictError). Every
function takes the ``rows.dialect.Db`` of the caller's transaction."""

from __future__ import annotations

import msgspec

from ...core.canonical import canonical_json
from ...core.definitions import PreparedTask, definition_document, execution_document, recipe_document
from ...core.errors import ConflictError, NotFoundError, ValidationError
from ...core.ids import new_id
from ...core.limits import REVISION_MAX
from ...core.models import ContextRecipe, TaskDefinition, TaskHead
from ...core.text import quote_bounded
from .dialect import Db

_dec = msgspec.json.Decoder(TaskDefinition)


def append_recipe(db: Db, prepared: PreparedTask, now_us: int) -> bool:
    """Append the context recipe; True if inserted, False if the same content was there.

    A ref is a content digest, so the same ref with other JSON means a corrupted row:
    ConflictError ``recipe_conflict``.
    """
    doc = canonical_json(recipe_document(prepared.recipe)).decode()
    row = db.one("RECIPE_JSON", (prepared.recipe_ref,))
    if row is not None:
        if row["recipe_json"] != doc:
            raise ConflictError(f"context recipe {prepared.recipe_ref} exists with other content",
                                code="recipe_conflict")
        return False
    db.run("RECIPE_INSERT", (prepared.recipe_ref, doc, now_us))
    return True


def get_recipe(db: Db, recipe_ref: str) -> ContextRecipe:
    """The context recipe ``recipe_ref`` (public values and SecretRef names; no Secret value is
    ever in it). NotFoundError ``recipe_not_found`` if the store lacks it."""
    row = db.one("RECIPE_JSON", (recipe_ref,))
    if row is None:
        raise NotFoundError(f"context recipe {recipe_ref} is missing", code="recipe_not_found")
    doc = msgspec.json.decode(row["recipe_json"])
    return ContextRecipe(public=doc["public"], secret_refs=doc["secretRefs"])


def append_execution_revision(db: Db, task_id: str, revision: int, prepared: PreparedTask, now_us: int) -> bool:
    """Publish the execution revision keyed by (task, revision).

    True if inserted; False if the identical content was already published; ConflictError
    ``execution_revision_conflict`` for different content.
    """
    ex = prepared.definition.execution
    row = db.one("EXECUTION_REVISION_DIGEST", (task_id, revision))
    if row is not None:
        if row["execution_digest"] != prepared.execution_digest:
            raise ConflictError(f"execution revision {revision} of task {task_id} exists with other content",
                                code="execution_revision_conflict")
        return False
    spec = canonical_json(execution_document(ex, prepared.recipe_ref)).decode()
    db.run("EXECUTION_REVISION_INSERT",
           (task_id, revision, ex.kind, prepared.execution_digest, spec, prepared.recipe_ref, now_us))
    return True


def _append_revision(db: Db, task_id: str, revision: int, prepared: PreparedTask, now_us: int) -> None:
    doc = canonical_json(definition_document(prepared.definition)).decode()
    row = db.one("TASK_REVISION_DIGEST", (task_id, revision))
    if row is not None:
        if row["content_digest"] != prepared.content_digest:
            raise ConflictError(f"revision {revision} of task {task_id} exists with other content",
                                code="revision_conflict")
        return
    db.run("TASK_REVISION_INSERT", (task_id, revision, prepared.content_digest, doc, now_us))
    append_recipe(db, prepared, now_us)
    append_execution_revision(db, task_id, revision, prepared, now_us)


def add_task(db: Db, project_id: str, prepared: PreparedTask, now_us: int) -> TaskHead:
    """Create a Task at revision 1. ConflictError ``task_exists`` if the live name is taken."""
    name = prepared.definition.name
    if db.one("TASK_NAME_LIVE", (project_id, name)):
        raise ConflictError(f"task {name!r} already exists in this project; use `task edit`", code="task_exists")
    task_id = new_id()
    db.run("TASK_INSERT", (task_id, project_id, name, prepared.enabled, now_us, now_us))
    _append_revision(db, task_id, 1, prepared, now_us)
    return get_head(db, project_id, task_id)


def edit_task(db: Db, project_id: str, name_or_id: str, expected_revision: int, expected_digest: str,
              prepared: PreparedTask, now_us: int) -> TaskHead:
    """Fenced edit: append revision+1 if the head is exactly (expected_revision, expected_digest).

    A stale fence raises ConflictError ``definition_changed`` and writes nothing. An edit with
    the same content as the head is a no-op returning the head. A rename is ValidationError
    (``name``); past ``REVISION_MAX`` ConflictError ``revision_exhausted``.
    """
    head = get_head(db, project_id, name_or_id, lock=True)
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
    _append_revision(db, head.task_id, rev, prepared, now_us)
    db.run("TASK_MOVE_HEAD", (rev, now_us, head.task_id, head.revision))
    return get_head(db, project_id, head.task_id)


def _head(row) -> TaskHead:
    return TaskHead(task_id=row["task_id"], project_id=row["project_id"], name=row["name"],
                    revision=row["head_revision"], enabled=bool(row["enabled"]), created_at_us=row["created_at_us"],
                    updated_at_us=row["updated_at_us"], content_digest=row["content_digest"],
                    definition=_dec.decode(row["definition_json"]))


def get_head(db: Db, project_id: str, name_or_id: str, *, lock: bool = False) -> TaskHead:
    """The live head of a Task by name or ID in the Project (``lock``: the Task row held until
    the transaction ends, ADR-0376 §2 step 4); NotFoundError ``task_not_found``."""
    row = db.one("HEAD_LIVE_FOR_UPDATE" if lock else "HEAD_LIVE", (project_id, name_or_id, name_or_id))
    if row is None:
        raise NotFoundError(f"task {quote_bounded(name_or_id)} does not exist", code="task_not_found")
    return _head(row)


def list_heads(db: Db, project_id: str | None = None) -> list[TaskHead]:
    """All live Task heads (of one Project, or of all), by name (bytewise)."""
    return [_head(r) for r in db.all("HEADS_LIVE", (project_id, project_id))]


def set_enabled(db: Db, project_id: str, name_or_id: str, enabled: bool, now_us: int) -> TaskHead:
    """Enable or disable a Task (head state, not content: the revision does not change)."""
    head = get_head(db, project_id, name_or_id, lock=True)
    db.run("TASK_SET_ENABLED", (enabled, now_us, head.task_id))
    return get_head(db, project_id, head.task_id)


def remove_task(db: Db, project_id: str, name_or_id: str, now_us: int) -> TaskHead:
    """Soft-delete a Task: its revisions and Runs stay for audit; the name becomes free."""
    head = get_head(db, project_id, name_or_id, lock=True)
    db.run("TASK_REMOVE", (now_us, False, now_us, head.task_id))
    return head


def skipped_fires(db: Db, task_id: str) -> int:
    """Schedule fires skipped for the Task because a single-instance Run was live."""
    row = db.one("TASK_SKIPPED_FIRES", (task_id,))
    return row["skipped_fires"] if row else 0


def count_skipped_fire(db: Db, task_id: str) -> None:
    """One more schedule fire skipped for the Task."""
    db.run("TASK_COUNT_SKIPPED_FIRE", (task_id,))
