"""The statements both stores run alike, by name (``?`` marks; ``rows.dialect`` turns them into
``%s`` for PostgreSQL). A statement that differs between the stores is not here but in
``adapters/sqlite/queries.py`` and ``adapters/postgres/queries.py`` under one name."""


def sql_in(values: frozenset, order: tuple[str, ...]) -> str:
    """``('a','b')``: a state set (core.states) as a SQL ``IN`` list, in lifecycle ``order`` so the
    text is stable (SQLite picks a partial index only when a query repeats its WHERE verbatim)."""
    return "(" + ",".join(f"'{v}'" for v in order if v in values) + ")"


def format_marks(sql: str) -> str:
    """``sql`` with psycopg's marks: every ``?`` as ``%s``, a literal ``%`` as ``%%``."""
    return sql.replace("%", "%%").replace("?", "%s")


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

# ---- runs: creation, cancels of queued Runs, reads, schedule cursors ---------------------------
EVENT_INSERT = ("INSERT INTO run_events(run_id, sequence, event_id, type, actor, payload_json, created_at_us) "
                "VALUES (?, ?, ?, ?, ?, ?, ?)")
# A new Run's first two events in one statement: EVENT_INSERT's values twice.
EVENTS_FIRST_TWO_INSERT = EVENT_INSERT + ", (?, ?, ?, ?, ?, ?, ?)"
# A Run whose (project, idempotency key) exists is not inserted (rowcount 0): the key is claimed
# by the write itself, not by a read before it (a read's predicate lock on the key index would
# make every concurrent creation a SERIALIZABLE conflict).
RUN_INSERT = (
    "INSERT INTO runs(run_id, project_id, task_id, task_revision, task_snapshot_ref, state, priority, "
    "execution_origin, execution_owner, trigger_type, idempotency_key, requested_by, scheduled_for_us, "
    "version, event_sequence, latest_attempt_id, latest_attempt_created_at_us, created_at_us, updated_at_us, "
    "single_instance, held) VALUES (?, ?, ?, ?, ?, 'queued', ?, ?, 'runtime', ?, ?, ?, ?, 2, 2, ?, ?, ?, ?, ?, ?) "
    "ON CONFLICT (project_id, idempotency_key) DO NOTHING")
ATTEMPT_FIRST_INSERT = ("INSERT INTO attempts(attempt_id, run_id, attempt_no, state, executor_type, created_at_us) "
                        "VALUES (?, ?, 1, 'claimed', ?, ?)")
EXECUTION_REVISION = ("SELECT kind, execution_digest, spec_json FROM execution_revisions "
                      "WHERE task_id = ? AND revision = ?")
FIRST_ATTEMPT_ID = "SELECT attempt_id FROM attempts WHERE run_id = ? AND attempt_no = 1"
FIRST_EVENT_IDS = "SELECT event_id FROM run_events WHERE run_id = ? AND sequence <= 2 ORDER BY sequence"
RUN_CANCEL_QUEUED = ("UPDATE runs SET state = 'cancelled', version = version + 1, event_sequence = ?, "
                     "cancel_requested_at_us = coalesce(cancel_requested_at_us, ?), updated_at_us = ?, "
                     "ended_at_us = ? WHERE run_id = ? AND version = ? AND state = 'queued'")
ATTEMPT_CANCEL_CLAIMED = ("UPDATE attempts SET state = 'cancelled', ended_at_us = ? "
                          "WHERE run_id = ? AND state = 'claimed'")
# Runs with their Task's name; the statements below extend it.
RUNS_WITH_TASK_NAME = "SELECT r.*, t.name AS task_name FROM runs r JOIN tasks t ON t.task_id = r.task_id "
RUN_BY_KEY = RUNS_WITH_TASK_NAME + "WHERE r.project_id = ? AND r.idempotency_key = ?"
RUN_IN_PROJECT = RUNS_WITH_TASK_NAME + "WHERE r.run_id = ? AND r.project_id = ?"
RUN_BY_PREFIX = RUNS_WITH_TASK_NAME + "WHERE r.run_id >= ? AND r.run_id < ? ORDER BY r.run_id LIMIT 2"


def _runs_page(task: bool = False, state: bool = False, before: bool = False) -> str:
    where = ["r.project_id = ?"] + ["r.task_id = ?"] * task + ["r.state = ?"] * state + [
        "(r.created_at_us < ? OR (r.created_at_us = ? AND r.run_id < ?))"] * before
    return (RUNS_WITH_TASK_NAME + "WHERE " + " AND ".join(where)
            + " ORDER BY r.created_at_us DESC, r.run_id DESC LIMIT ?")


# A keyset page of a Project's Runs, newest first: optionally of one Task (_TASK), in one state
# (_STATE), before a cursor (_BEFORE: created_at_us, created_at_us, run_id).
RUNS_PAGE = _runs_page()
RUNS_PAGE_BEFORE = _runs_page(before=True)
RUNS_PAGE_STATE = _runs_page(state=True)
RUNS_PAGE_STATE_BEFORE = _runs_page(state=True, before=True)
RUNS_PAGE_TASK = _runs_page(task=True)
RUNS_PAGE_TASK_BEFORE = _runs_page(task=True, before=True)
RUNS_PAGE_TASK_STATE = _runs_page(task=True, state=True)
RUNS_PAGE_TASK_STATE_BEFORE = _runs_page(task=True, state=True, before=True)
EVENTS_OF_RUN = ("SELECT run_id, sequence, event_id, type, actor, payload_json, created_at_us FROM run_events "
                 "WHERE run_id = ? ORDER BY sequence")
ATTEMPT_LATEST_LOG = ("SELECT a.artifact_path, f.quota_bytes, f.bytes_kept, f.bytes_dropped, f.reason FROM attempts a "
                      "LEFT JOIN truncation_facts f ON f.attempt_id = a.attempt_id WHERE a.run_id = ? "
                      "AND a.artifact_path IS NOT NULL ORDER BY a.attempt_no DESC LIMIT 1")
RUNS_QUEUED_COUNT = "SELECT count(*) AS n FROM runs WHERE state = 'queued'"
RUNS_OLDEST_QUEUED = "SELECT min(created_at_us) AS t FROM runs WHERE state = 'queued'"
RUN_STATE_COUNTS = "SELECT state, count(*) AS n FROM runs GROUP BY state"
RUN_ID_FOR_KEY = "SELECT run_id FROM runs WHERE project_id = ? AND idempotency_key = ?"
SCHEDULE_CURSORS = "SELECT task_id, last_instant_us, observed_wall_us FROM schedule_cursors"
SCHEDULE_CURSOR_PUT = ("INSERT INTO schedule_cursors VALUES (?, ?, ?) ON CONFLICT (task_id) DO UPDATE SET "
                       "last_instant_us = excluded.last_instant_us, observed_wall_us = excluded.observed_wall_us")

# ---- execution: Attempt/Run transitions, plans, recovery and retention reads --------------------
NEXT_BACKOFF = ("SELECT min(a.not_before_us) AS t FROM runs r JOIN attempts a ON a.attempt_id = r.latest_attempt_id "
                "WHERE r.state = 'queued' AND a.state = 'claimed' AND a.not_before_us > ?")
CANDIDATE_STILL_QUEUED = (
    "SELECT 1 AS still FROM runs r JOIN attempts a ON a.attempt_id = r.latest_attempt_id WHERE r.run_id = ? "
    "AND r.version = ? AND r.state = 'queued' AND r.cancel_requested_at_us IS NULL AND a.attempt_id = ? "
    "AND a.state = 'claimed'")
PLAN = ("SELECT x.spec_json, x.recipe_ref, d.definition_json, cr.recipe_json FROM execution_revisions x "
        "JOIN task_revisions d ON d.task_id = x.task_id AND d.revision = x.revision "
        "LEFT JOIN context_recipes cr ON cr.recipe_ref = x.recipe_ref WHERE x.task_id = ? AND x.revision = ?")
# Run moves, compare-and-set on the source state (params: dst, now, ..., run, src[, version]);
# each also takes the next event sequence, which the PostgreSQL forms return.
RUN_MOVE = ("UPDATE runs SET state = ?, version = version + 1, event_sequence = event_sequence + 1, "
            "updated_at_us = ? WHERE run_id = ? AND state = ?")
RUN_MOVE_AT_VERSION = RUN_MOVE + " AND version = ?"
RUN_MOVE_REQUEUE = ("UPDATE runs SET state = ?, version = version + 1, event_sequence = event_sequence + 1, "
                    "updated_at_us = ?, latest_attempt_id = ?, latest_attempt_created_at_us = ? "
                    "WHERE run_id = ? AND state = ?")
RUN_MOVE_END = ("UPDATE runs SET state = ?, version = version + 1, event_sequence = event_sequence + 1, "
                "updated_at_us = ?, exit_code = ?, exit_signal = ?, ended_at_us = ? WHERE run_id = ? AND state = ?")
# A queued Run's next Attempt (it never left the queue): params latest attempt, its time, now, run.
RUN_NEXT_ATTEMPT = ("UPDATE runs SET version = version + 1, event_sequence = event_sequence + 1, "
                    "latest_attempt_id = ?, latest_attempt_created_at_us = ?, updated_at_us = ? WHERE run_id = ?")
RUN_NEXT_EVENT = "UPDATE runs SET event_sequence = event_sequence + 1 WHERE run_id = ?"
RUN_EVENT_SEQUENCE = "SELECT event_sequence FROM runs WHERE run_id = ?"
ATTEMPT_START = ("UPDATE attempts SET state = 'starting', artifact_path = ?, version = version + 1 "
                 "WHERE attempt_id = ? AND state = 'claimed'")
ATTEMPT_RUNNING = ("UPDATE attempts SET state = 'running', shim_pid = ?, shim_start_time = ?, deadline_at_us = ?, "
                   "started_at_us = ?, version = version + 1 WHERE attempt_id = ? AND state = 'starting'")
ATTEMPT_END = ("UPDATE attempts SET state = ?, exit_code = ?, exit_signal = ?, bytes_kept = ?, bytes_dropped = ?, "
               "peak_rss_bytes = ?, cpu_time_us = ?, failure_reason = ?, ended_at_us = ?, start_error = ?, "
               "orphans_stopped = ?, version = version + 1 WHERE attempt_id = ?")
ATTEMPT_RETRY_INSERT = ("INSERT INTO attempts(attempt_id, run_id, attempt_no, state, executor_type, not_before_us, "
                        "created_at_us) VALUES (?, ?, ?, 'claimed', ?, ?, ?)")
TRUNCATION_PUT = ("INSERT INTO truncation_facts(attempt_id, quota_bytes, bytes_kept, bytes_dropped, reason, "
                  "recorded_at_us) VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT (attempt_id) DO UPDATE SET bytes_dropped = "
                  "coalesce(truncation_facts.bytes_dropped, excluded.bytes_dropped)")
ATTEMPT_REVISION = ("SELECT r.task_id, r.task_revision FROM attempts a JOIN runs r ON r.run_id = a.run_id "
                    "WHERE a.attempt_id = ?")
RUN_CANCEL_REQUEST = ("UPDATE runs SET cancel_requested_at_us = ?, event_sequence = event_sequence + 1, "
                      "updated_at_us = ? WHERE run_id = ?")
RETENTION_ENTRIES = ("SELECT a.attempt_id, r.task_id, a.artifact_path, a.ended_at_us FROM attempts a JOIN runs r "
                     "ON r.run_id = a.run_id WHERE a.artifact_path IS NOT NULL AND a.ended_at_us IS NOT NULL "
                     "ORDER BY a.ended_at_us, a.attempt_id")
ARTIFACTS_FORGET = "UPDATE attempts SET artifact_path = NULL WHERE attempt_id IN ({values})"
