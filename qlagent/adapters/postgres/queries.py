"""The cluster authority's statements that differ from the local store's, under the names
``adapters/sqlite/queries.py`` gives them (the shared ones: ``adapters.rows.queries``).

Row locks the local store needs not (its write transaction excludes every other writer), text
ordered by byte (``COLLATE "C"``, SQLite's order) and parameters typed where PostgreSQL cannot
infer them."""

from ..rows import queries as shared

PROJECT_BY_NAME_OR_ID_FOR_SHARE = "SELECT * FROM projects WHERE name = %s OR project_id = %s FOR SHARE"
TOKENS_OF_PROJECT = ("SELECT token_id, subject, created_at_us, revoked_at_us FROM api_tokens WHERE project_id = %s "
                     "ORDER BY created_at_us, seq")

SECRET_NAMES = "SELECT name, updated_at_us FROM secrets WHERE project_id = %s ORDER BY name COLLATE \"C\""
# (task, recipe) of each live Task head; the Project bound twice (NULL: every Project).
SECRET_USES = ("SELECT t.project_id, t.name, cr.recipe_json FROM tasks t JOIN execution_revisions e "
               "ON e.task_id = t.task_id AND e.revision = t.head_revision JOIN context_recipes cr "
               "ON cr.recipe_ref = e.recipe_ref WHERE (%s::text IS NULL OR t.project_id = %s) "
               "AND t.deleted_at_us IS NULL ORDER BY t.name COLLATE \"C\"")
# The offer's Secrets (``PgSecretResolver``): every named one of the Project.
SECRETS_FOR_OFFER = "SELECT name, ciphertext FROM secrets WHERE project_id = %s AND name = ANY(%s)"

HEAD_LIVE_FOR_UPDATE = shared.TASK_HEADS + ("WHERE t.project_id = %s AND (t.name = %s OR t.task_id = %s) "
                                            "AND t.deleted_at_us IS NULL FOR UPDATE OF t")
# Live heads of one Project (bound twice; NULL: of every Project).
HEADS_LIVE = shared.TASK_HEADS + ("WHERE (%s::text IS NULL OR t.project_id = %s) AND t.deleted_at_us IS NULL "
                                  "ORDER BY t.name COLLATE \"C\", t.task_id")
