"""The cluster authority's statements that differ from the local store's, under the names
``adapters/sqlite/queries.py`` gives them (the shared ones: ``adapters.rows.queries``), and
those only it runs (its clock, cron fires, an offer's Secrets).

Row locks the local store needs not (its write transaction excludes every other writer), text
ordered by byte (``COLLATE "C"``, SQLite's order) and parameters typed where PostgreSQL cannot
infer them."""

from ...core import states
from ..rows import queries as shared
from ..rows.queries import format_marks, sql_in

# The database clock (µs since the epoch): the time of the cluster's store writes.
DB_NOW = "SELECT ql_now_us() AS now"
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

# Runs not ended: the local live set plus the cluster's ``dispatching`` (a Lease is being offered).
LIVE = tuple(s for s in states.RunState.ALL_CLUSTER if s in states.RUN_LIVE_CLUSTER)
ACTIVE = tuple(s for s in states.RunState.ALL if s in states.RUN_ACTIVE)
# Runs that occupy a single-instance Task: leased to a Worker (``dispatching``) or started.
OCCUPYING = ("dispatching", *ACTIVE)

RUN_LIVE_COUNT = f"SELECT count(*) AS n FROM runs WHERE task_id = %s AND state IN {sql_in(frozenset(LIVE), LIVE)}"
TASK_OCCUPIED = ("SELECT EXISTS (SELECT 1 FROM runs WHERE task_id = %s "
                 f"AND state IN {sql_in(frozenset(OCCUPYING), OCCUPYING)}) AS live")
# (held, task, not held). Rows another transaction has locked are skipped, never waited for: a
# Pull holding its candidate page while it queues on the Task's row would otherwise deadlock
# with the claim that holds the row (the Pull's own claim guard then holds what it locked), and
# a hold left by a concurrent transaction is released by the sweeper (``PgLeaseStore.release_holds``).
RUNS_HOLD = ("UPDATE runs SET held = %s WHERE run_id IN (SELECT run_id FROM runs WHERE task_id = %s"
             " AND state = 'queued' AND single_instance AND held = %s FOR NO KEY UPDATE SKIP LOCKED)")
RUNS_QUEUED_OF_TASK_FOR_UPDATE = ("SELECT run_id, event_sequence, version FROM runs WHERE task_id = %s "
                                  "AND state = 'queued' ORDER BY run_id FOR UPDATE")
RUNS_ACTIVE_OF_TASK = ("SELECT run_id FROM runs WHERE task_id = %s "
                       f"AND state IN {sql_in(frozenset(OCCUPYING), OCCUPYING)} ORDER BY run_id")
# A log retention deleted: an ended local Attempt of the Run kept bytes (a Worker's log is uploaded).
ATTEMPT_LOG_PRUNED = ("SELECT 1 FROM attempts WHERE run_id = %s AND ended_at_us IS NOT NULL AND bytes_kept > 0 "
                      "AND worker_id IS NULL LIMIT 1")
# Row-locked so concurrent replicas compare-and-set the cursor in turn.
SCHEDULE_CURSOR_FOR_UPDATE = ("SELECT last_instant_us, observed_wall_us FROM schedule_cursors WHERE task_id = %s "
                              "FOR UPDATE")
# The (Task, instant) of a cron fire: a second replica's fire of it conflicts on the primary key.
SCHEDULE_FIRE_INSERT = "INSERT INTO schedule_fires VALUES (%s, %s, %s, %s)"

RUNS_ACTIVE_COUNT = f"SELECT count(*) AS n FROM runs WHERE state IN {sql_in(frozenset(ACTIVE), ACTIVE)}"
TASK_RUNS_ACTIVE_COUNT = ("SELECT count(*) AS n FROM runs WHERE task_id = %s "
                          f"AND state IN {sql_in(frozenset(ACTIVE), ACTIVE)}")
ATTEMPT_STATE_FOR_UPDATE = "SELECT state, attempt_no FROM attempts WHERE attempt_id = %s FOR UPDATE"
RUN_STATE_FOR_UPDATE = ("SELECT state, version, event_sequence, cancel_requested_at_us, task_id FROM runs "
                        "WHERE run_id = %s FOR UPDATE")
# The Run moves return the event sequence they took (the local store reads it back).
RUN_MOVE = format_marks(shared.RUN_MOVE) + " RETURNING event_sequence"
RUN_MOVE_AT_VERSION = format_marks(shared.RUN_MOVE_AT_VERSION) + " RETURNING event_sequence"
RUN_MOVE_REQUEUE = format_marks(shared.RUN_MOVE_REQUEUE) + " RETURNING event_sequence"
RUN_MOVE_END = format_marks(shared.RUN_MOVE_END) + " RETURNING event_sequence"
RUN_NEXT_ATTEMPT = format_marks(shared.RUN_NEXT_ATTEMPT) + " RETURNING event_sequence"
RUN_NEXT_EVENT = format_marks(shared.RUN_NEXT_EVENT) + " RETURNING event_sequence"
# This process's own Attempts only: a Worker's are recovered by the Lease sweeper.
LIVE_ATTEMPTS = ("SELECT r.run_id, a.attempt_id, r.task_id, r.task_revision, a.state, a.shim_pid, a.shim_start_time, "
                 "a.deadline_at_us, a.artifact_path, r.cancel_requested_at_us FROM attempts a JOIN runs r "
                 "ON r.run_id = a.run_id WHERE a.state IN "
                 f"{sql_in(states.ATTEMPT_ACTIVE, states.AttemptState.ALL)} AND a.worker_id IS NULL "
                 "ORDER BY a.attempt_id")
CLAIMED_ATTEMPT_IDS = ("SELECT attempt_id FROM attempts WHERE state = 'claimed' AND worker_id IS NULL "
                       "ORDER BY attempt_id")

# Dispatch candidates of executor %(ex)s due at %(now)s, in Candidate.key() order.
_CANDIDATE = ("SELECT r.run_id, r.latest_attempt_id, r.project_id, r.task_id, r.task_revision, r.version, "
              "r.priority, r.created_at_us, r.latest_attempt_created_at_us FROM runs r JOIN attempts a "
              "ON a.attempt_id = r.latest_attempt_id WHERE r.state = 'queued' AND r.cancel_requested_at_us IS NULL "
              "AND NOT r.held AND a.state = 'claimed' AND a.executor_type = %(ex)s "
              "AND (a.not_before_us IS NULL OR a.not_before_us <= %(now)s) ")
_KEY = "(-r.priority), r.created_at_us, r.latest_attempt_created_at_us, r.latest_attempt_id"
CANDIDATES = _CANDIDATE + f"ORDER BY {_KEY} LIMIT %(lim)s"
# ... strictly after the keyset (%(p)s negated priority, %(c)s, %(ac)s, %(aid)s).
CANDIDATES_AFTER = _CANDIDATE + f"AND ({_KEY}) > (%(p)s, %(c)s, %(ac)s, %(aid)s) ORDER BY {_KEY} LIMIT %(lim)s"
# The Worker that leased each Attempt, by name (None once removed).
ATTEMPTS_OF_RUN = ("SELECT a.*, (f.attempt_id IS NOT NULL) AS truncated, w.name AS worker_name FROM attempts a "
                   "LEFT JOIN truncation_facts f ON f.attempt_id = a.attempt_id "
                   "LEFT JOIN workers w ON w.worker_id = a.worker_id WHERE a.run_id = %s ORDER BY a.attempt_no")
