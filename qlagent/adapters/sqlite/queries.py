"""The local store's statements that differ from the cluster authority's, under the names
``adapters/postgres/queries.py`` gives them (the shared ones: ``adapters.rows.queries``), and
those only it runs (the write probe).

SQLite's write transaction (BEGIN IMMEDIATE) already excludes every other writer, so a
statement PostgreSQL runs with a row lock (``…_FOR_SHARE``, ``…_FOR_UPDATE``) is the plain read
here; names sort by SQLite's binary collation."""

from ...core import states
from ..rows import queries as shared
from ..rows.queries import sql_in

# The local agent's write probe (``SqliteStore.probe_write``, migration 0013): one row, rewritten.
STORE_PROBE_PUT = ("INSERT INTO store_probe (id, written_at_us) VALUES (1, ?) "
                   "ON CONFLICT (id) DO UPDATE SET written_at_us = excluded.written_at_us")
PROJECT_BY_NAME_OR_ID_FOR_SHARE = shared.PROJECT_BY_NAME_OR_ID
# An API request's authentication (params: Project name, Project ID, token digest): one row, NULLs
# where the Project, the live token or its subject's binding (the latest) is absent.
ADMISSION = ("SELECT p.project_id, p.name, p.project_version, p.active, t.project_id AS token_project, t.subject, "
             "b.role, b.binding_version, b.active AS binding_active FROM (SELECT 1) q "
             "LEFT JOIN projects p ON p.name = ? OR p.project_id = ? "
             "LEFT JOIN api_tokens t ON t.token_digest = ? AND t.revoked_at_us IS NULL "
             "LEFT JOIN role_bindings b ON b.project_id = t.project_id AND b.subject = t.subject "
             "AND b.binding_version = (SELECT max(m.binding_version) FROM role_bindings m "
             "WHERE m.project_id = t.project_id AND m.subject = t.subject)")
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

_RUN_LIVE = sql_in(states.RunState.LIVE, states.RunState.ALL)     # ('queued','starting','running'): runs_by_state
_RUN_ACTIVE = sql_in(states.RunState.ACTIVE, states.RunState.ALL)
_ATTEMPT_ACTIVE = sql_in(states.AttemptState.ACTIVE, states.AttemptState.ALL)

RUN_LIVE_COUNT = f"SELECT count(*) AS n FROM runs WHERE task_id = ? AND state IN {_RUN_LIVE}"
# A Task's single instance is taken while it has a starting or running Run (two equality seeks
# on runs_by_task_state); the queued single-instance Runs are then held: (held, task, not held).
TASK_OCCUPIED = ("SELECT EXISTS (SELECT 1 FROM runs WHERE task_id = ?1 AND state = 'starting') "
                 "OR EXISTS (SELECT 1 FROM runs WHERE task_id = ?1 AND state = 'running') AS live")
RUNS_HOLD = "UPDATE runs SET held = ? WHERE task_id = ? AND state = 'queued' AND single_instance = 1 AND held = ?"
RUNS_QUEUED_OF_TASK_FOR_UPDATE = ("SELECT run_id, event_sequence, version FROM runs "
                                  "WHERE task_id = ? AND state = 'queued'")
RUNS_ACTIVE_OF_TASK = f"SELECT run_id FROM runs WHERE task_id = ? AND state IN {_RUN_ACTIVE}"
# A log retention deleted: an ended Attempt of the Run kept bytes.
ATTEMPT_LOG_PRUNED = "SELECT 1 FROM attempts WHERE run_id = ? AND ended_at_us IS NOT NULL AND bytes_kept > 0 LIMIT 1"
SCHEDULE_CURSOR_FOR_UPDATE = "SELECT last_instant_us, observed_wall_us FROM schedule_cursors WHERE task_id = ?"

# SQLite uses the partial index runs_by_state only when the query repeats its WHERE term
# verbatim; without it both counts scan every Run ever stored (the whole table, or the Task's
# whole history) on every dispatcher pass, so a pass would grow with the backlog.
_ACTIVE = f"state IN {_RUN_LIVE} AND state IN {_RUN_ACTIVE}"
RUNS_ACTIVE_COUNT = f"SELECT count(*) AS n FROM runs WHERE {_ACTIVE}"
TASK_RUNS_ACTIVE_COUNT = f"SELECT count(*) AS n FROM runs INDEXED BY runs_by_state WHERE {_ACTIVE} AND task_id = ?"
ATTEMPT_STATE_FOR_UPDATE = "SELECT state, attempt_no FROM attempts WHERE attempt_id = ?"
RUN_STATE_FOR_UPDATE = ("SELECT state, version, event_sequence, cancel_requested_at_us, task_id FROM runs "
                        "WHERE run_id = ?")
LIVE_ATTEMPTS = ("SELECT r.run_id, a.attempt_id, r.task_id, r.task_revision, a.state, a.shim_pid, a.shim_start_time, "
                 "a.deadline_at_us, a.artifact_path, r.cancel_requested_at_us FROM attempts a "
                 f"JOIN runs r ON r.run_id = a.run_id WHERE a.state IN {_ATTEMPT_ACTIVE}")
CLAIMED_ATTEMPT_IDS = "SELECT attempt_id FROM attempts WHERE state = 'claimed'"

# Dispatch candidates: queued, uncancelled, not held, their claimed local Attempt due.
_CANDIDATE = (
    "SELECT r.run_id, r.latest_attempt_id, r.project_id, r.task_id, r.task_revision, r.version, r.priority, "
    "r.created_at_us, r.latest_attempt_created_at_us FROM runs r INDEXED BY runs_dispatch_candidates "
    "JOIN attempts a ON a.attempt_id = r.latest_attempt_id "
    "WHERE r.state = 'queued' AND r.cancel_requested_at_us IS NULL "
    "AND a.state = 'claimed' AND a.executor_type = 'local_process' "
    "AND (a.not_before_us IS NULL OR a.not_before_us <= ?) AND r.held = 0 ")
_ORDER = "ORDER BY r.priority DESC, r.created_at_us, r.latest_attempt_created_at_us, r.latest_attempt_id LIMIT ?"
CANDIDATES = _CANDIDATE + _ORDER        # (now, limit)
# Keyset "after (p, c, ac, id)" for ORDER BY priority DESC, created ASC, attempt created ASC, attempt id ASC.
# One OR-chained predicate cannot seek the index (SQLite would scan from the first queued Run
# up to the cursor: an OFFSET in disguise), so the page is the union of two index seeks:
# the rest of priority p after (c, ac, id) as a row value, then the priorities below p.
CANDIDATES_AFTER = (
    "SELECT * FROM (" + _CANDIDATE + "AND r.priority = ? AND (r.created_at_us, r.latest_attempt_created_at_us, "
    "r.latest_attempt_id) > (?, ?, ?) ORDER BY r.created_at_us, r.latest_attempt_created_at_us, "
    "r.latest_attempt_id LIMIT ?) UNION ALL SELECT * FROM (" + _CANDIDATE + "AND r.priority < ? " + _ORDER + ") "
    "ORDER BY priority DESC, created_at_us, latest_attempt_created_at_us, latest_attempt_id LIMIT ?")
# A local Attempt has no Worker.
ATTEMPTS_OF_RUN = ("SELECT a.*, (f.attempt_id IS NOT NULL) AS truncated, f.reason AS truncation_reason, NULL AS worker_id, "
                   "NULL AS worker_name "
                   "FROM attempts a LEFT JOIN truncation_facts f ON f.attempt_id = a.attempt_id WHERE a.run_id = ? "
                   "ORDER BY a.attempt_no")
