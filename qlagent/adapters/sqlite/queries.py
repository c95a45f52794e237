"""The local store's statements that differ from the cluster authority's, under the names
``adapters/postgres/queries.py`` gives them (the shared ones: ``adapters.rows.queries``).

SQLite's write transaction (BEGIN IMMEDIATE) already excludes every other writer, so a
statement PostgreSQL runs with a row lock (``…_FOR_SHARE``, ``…_FOR_UPDATE``) is the plain read
here; names sort by SQLite's binary collation."""

from ..rows import queries as shared

PROJECT_BY_NAME_OR_ID_FOR_SHARE = shared.PROJECT_BY_NAME_OR_ID
TOKENS_OF_PROJECT = ("SELECT token_id, subject, created_at_us, revoked_at_us FROM api_tokens WHERE project_id = ? "
                     "ORDER BY created_at_us")

SECRET_NAMES = "SELECT name, updated_at_us FROM secrets WHERE project_id = ? ORDER BY name"
# (task, recipe) of each live Task head; the Project bound twice (NULL: every Project).
SECRET_USES = ("SELECT t.project_id, t.name, cr.recipe_json FROM tasks t JOIN execution_revisions e "
               "ON e.task_id = t.task_id AND e.revision = t.head_revision "
               "JOIN context_recipes cr ON cr.recipe_ref = e.recipe_ref "
               "WHERE (? IS NULL OR t.project_id = ?) AND t.deleted_at_us IS NULL ORDER BY t.name")

HEAD_LIVE_FOR_UPDATE = shared.HEAD_LIVE
# Live heads of one Project (bound twice; NULL: of every Project).
HEADS_LIVE = shared.TASK_HEADS + ("WHERE (? IS NULL OR t.project_id = ?) AND t.deleted_at_us IS NULL "
                                  "ORDER BY t.name, t.task_id")
