"""The statements both stores run alike, by name (``?`` marks; ``rows.dialect`` turns them into
``%s`` for PostgreSQL). A statement that differs between the stores is not here but in
``adapters/sqlite/queries.py`` and ``adapters/postgres/queries.py`` under one name."""

# ---- policy: Projects, RoleBindings, API tokens ------------------------------------------------
PROJECT_BY_NAME = "SELECT * FROM projects WHERE name = ?"
PROJECT_BY_ID = "SELECT * FROM projects WHERE project_id = ?"
PROJECT_BY_NAME_OR_ID = "SELECT * FROM projects WHERE name = ? OR project_id = ?"
PROJECT_INSERT = ("INSERT INTO projects(project_id, name, project_version, active, created_at_us) "
                  "VALUES (?, ?, 1, ?, ?)")
BINDING_LATEST = ("SELECT role, binding_version, active FROM role_bindings WHERE project_id = ? AND subject = ? "
                  "ORDER BY binding_version DESC LIMIT 1")
BINDING_INSERT = "INSERT INTO role_bindings VALUES (?, ?, ?, ?, ?, ?, ?)"
TOKEN_INSERT = "INSERT INTO api_tokens VALUES (?, ?, ?, ?, ?, NULL)"
TOKEN_REVOKE = "UPDATE api_tokens SET revoked_at_us = coalesce(revoked_at_us, ?) WHERE token_id = ?"
TOKEN_LIVE = "SELECT project_id, subject FROM api_tokens WHERE token_digest = ? AND revoked_at_us IS NULL"
TOKEN_ID_OF_DIGEST = "SELECT token_id FROM api_tokens WHERE token_digest = ?"

# ---- secrets: names and ciphertext only ---------------------------------------------------------
SECRET_PUT = ("INSERT INTO secrets VALUES (?, ?, ?, ?, ?) ON CONFLICT (project_id, name) DO UPDATE SET "
              "ciphertext = excluded.ciphertext, key_id = excluded.key_id, updated_at_us = excluded.updated_at_us")
SECRETS_CIPHERTEXT = "SELECT name, ciphertext FROM secrets WHERE project_id = ? AND name IN ({values})"
SECRETS_STORED = "SELECT project_id, name FROM secrets"
SECRET_DELETE = "DELETE FROM secrets WHERE project_id = ? AND name = ?"
SECRETS_WITH_PREFIX = ("SELECT project_id, name, ciphertext FROM secrets WHERE substr(ciphertext, 1, ?) = ? "
                       "ORDER BY project_id, name")
SECRET_REPLACE_CIPHERTEXT = ("UPDATE secrets SET ciphertext = ?, key_id = ? WHERE project_id = ? AND name = ? "
                             "AND ciphertext = ?")

# ---- definitions: Task heads, revisions, execution revisions, context recipes ------------------
RECIPE_JSON = "SELECT recipe_json FROM context_recipes WHERE recipe_ref = ?"
RECIPE_INSERT = "INSERT INTO context_recipes VALUES (?, ?, ?)"
EXECUTION_REVISION_DIGEST = "SELECT execution_digest FROM execution_revisions WHERE task_id = ? AND revision = ?"
EXECUTION_REVISION_INSERT = "INSERT INTO execution_revisions VALUES (?, ?, ?, ?, ?, ?, ?)"
TASK_REVISION_DIGEST = "SELECT content_digest FROM task_revisions WHERE task_id = ? AND revision = ?"
TASK_REVISION_INSERT = "INSERT INTO task_revisions VALUES (?, ?, ?, ?, ?)"
TASK_NAME_LIVE = "SELECT task_id FROM tasks WHERE project_id = ? AND name = ? AND deleted_at_us IS NULL"
TASK_INSERT = ("INSERT INTO tasks(task_id, project_id, name, head_revision, enabled, created_at_us, updated_at_us) "
               "VALUES (?, ?, ?, 1, ?, ?, ?)")
TASK_MOVE_HEAD = "UPDATE tasks SET head_revision = ?, updated_at_us = ? WHERE task_id = ? AND head_revision = ?"
TASK_SET_ENABLED = "UPDATE tasks SET enabled = ?, updated_at_us = ? WHERE task_id = ?"
TASK_REMOVE = "UPDATE tasks SET deleted_at_us = ?, enabled = ?, updated_at_us = ? WHERE task_id = ?"
TASK_SKIPPED_FIRES = "SELECT skipped_fires FROM tasks WHERE task_id = ?"
TASK_COUNT_SKIPPED_FIRE = "UPDATE tasks SET skipped_fires = skipped_fires + 1 WHERE task_id = ?"
# Every Task head with its revision's digest and document (deleted ones too); the head
# statements below and the dialects' ``HEAD_LIVE_FOR_UPDATE``/``HEADS_LIVE`` extend it.
TASK_HEADS = ("SELECT t.task_id, t.project_id, t.name, t.head_revision, t.enabled, t.created_at_us, "
              "t.updated_at_us, r.content_digest, r.definition_json FROM tasks t "
              "JOIN task_revisions r ON r.task_id = t.task_id AND r.revision = t.head_revision ")
HEAD_LIVE = TASK_HEADS + "WHERE t.project_id = ? AND (t.name = ? OR t.task_id = ?) AND t.deleted_at_us IS NULL"
