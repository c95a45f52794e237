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
