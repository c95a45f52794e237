"""The cluster authority's statements that differ from the local store's, under the names
``adapters/sqlite/queries.py`` gives them (the shared ones: ``adapters.rows.queries``), and
those only it runs (its clock, cron fires, an offer's Secrets), then every statement of the
cluster-only modules (``dispatch``, ``transitions``, ``leases``, ``registry``, ``logs``, …), a
section each.

Row locks the local store needs not (its write transaction excludes every other writer), text
ordered by byte (``COLLATE "C"``, SQLite's order) and parameters typed where PostgreSQL cannot
infer them."""

from ...core import states
from ..rows import queries as shared
from ..rows.queries import format_marks, sql_in

# A ``PgStore`` write that creates Runs, in one round trip after its BEGIN: planned without
# sequential scans (their predicate lock covers the whole table, so any other Task's Run insert
# would fail it), waiting at most 5 s for a row lock (its Task's head row) before
# UnavailableError, and leaving the Pulls' NOTIFY to the store after its commit (migration 0015).
CREATING_RUNS_SETTINGS = ("SET LOCAL enable_seqscan = off; SET LOCAL lock_timeout = 5000; "
                          "SET LOCAL qlagent.notify_after_commit = on")

# ADR-0376 §2 Task Start in one call (migration 0016): project, task, subject, mutationId, expected
# revision and digest, admitted project and binding versions (NULL: not re-verified), the start
# roles, the Attempt's executor, the time (NULL: the database clock). One row: its outcome and
# the Run's identities (``postgres.runs.task_start`` maps it).
TASK_START = ("SELECT * FROM ql_task_start(%s, %s, %s, %s, %s, %s, %s::integer, %s::integer, %s::text[], %s, "
              "%s::bigint)")
# ... as ONE simple query (client-side binding): its SERIALIZABLE transaction, then after the
# commit the Pulls' wake-up if a queued unheld Run is under the key (params: TASK_START's, then
# the Project and the idempotency key).
TASK_START_ROUND_TRIP = ("BEGIN ISOLATION LEVEL SERIALIZABLE; " + TASK_START + "; COMMIT; "
                         "SELECT ql_wake_for_key(%s, %s)")

# The database clock (µs since the epoch): the time of the cluster's store writes.
DB_NOW = "SELECT ql_now_us() AS now"
PROJECT_BY_NAME_OR_ID_FOR_SHARE = "SELECT * FROM projects WHERE name = %s OR project_id = %s FOR SHARE"
# An API request's authentication in one call (migration 0017; params: Project name, Project ID,
# token digest): one row, NULLs where the Project, the live token or its binding is absent.
ADMISSION = "SELECT * FROM ql_admission(%s, %s, %s)"
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

_R = states.RunState
# Runs that occupy a single-instance Task: leased to a Worker (``dispatching``) or started.
OCCUPYING = tuple(s for s in _R.ALL_CLUSTER if s == _R.DISPATCHING or s in _R.ACTIVE)
_RUN_OCCUPYING = sql_in(frozenset(OCCUPYING), OCCUPYING)
_RUN_ACTIVE = sql_in(_R.ACTIVE, _R.ALL)

# Runs not ended: the local live set plus the cluster's ``dispatching`` (a Lease is being offered).
RUN_LIVE_COUNT = f"SELECT count(*) AS n FROM runs WHERE task_id = %s AND state IN {sql_in(_R.LIVE_CLUSTER, _R.ALL_CLUSTER)}"
TASK_OCCUPIED = ("SELECT EXISTS (SELECT 1 FROM runs WHERE task_id = %s "
                 f"AND state IN {_RUN_OCCUPYING}) AS live")
# (held, task, not held). Rows another transaction has locked are skipped, never waited for: a
# Pull holding its candidate page while it queues on the Task's row would otherwise deadlock
# with the claim that holds the row (the Pull's own claim guard then holds what it locked), and
# a hold left by a concurrent transaction is released by the sweeper (``PgLeaseStore.release_holds``).
RUNS_HOLD = ("UPDATE runs SET held = %s WHERE run_id IN (SELECT run_id FROM runs WHERE task_id = %s"
             " AND state = 'queued' AND single_instance AND held = %s FOR NO KEY UPDATE SKIP LOCKED)")
RUNS_QUEUED_OF_TASK_FOR_UPDATE = ("SELECT run_id, event_sequence, version FROM runs WHERE task_id = %s "
                                  "AND state = 'queued' ORDER BY run_id FOR UPDATE")
RUNS_ACTIVE_OF_TASK = ("SELECT run_id FROM runs WHERE task_id = %s "
                       f"AND state IN {_RUN_OCCUPYING} ORDER BY run_id")
# A log retention deleted: an ended local Attempt of the Run kept bytes (a Worker's log is uploaded).
ATTEMPT_LOG_PRUNED = ("SELECT 1 FROM attempts WHERE run_id = %s AND ended_at_us IS NOT NULL AND bytes_kept > 0 "
                      "AND worker_id IS NULL LIMIT 1")
# Row-locked so concurrent replicas compare-and-set the cursor in turn.
SCHEDULE_CURSOR_FOR_UPDATE = ("SELECT last_instant_us, observed_wall_us FROM schedule_cursors WHERE task_id = %s "
                              "FOR UPDATE")
# The (Task, instant) of a cron fire: a second replica's fire of it conflicts on the primary key.
SCHEDULE_FIRE_INSERT = "INSERT INTO schedule_fires VALUES (%s, %s, %s, %s)"

RUNS_ACTIVE_COUNT = f"SELECT count(*) AS n FROM runs WHERE state IN {_RUN_ACTIVE}"
TASK_RUNS_ACTIVE_COUNT = ("SELECT count(*) AS n FROM runs WHERE task_id = %s "
                          f"AND state IN {_RUN_ACTIVE}")
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
                 f"{sql_in(states.AttemptState.ACTIVE, states.AttemptState.ALL)} AND a.worker_id IS NULL "
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
ATTEMPTS_OF_RUN = ("SELECT a.*, (f.attempt_id IS NOT NULL) AS truncated, f.reason AS truncation_reason, w.name AS worker_name "
                   "FROM attempts a "
                   "LEFT JOIN truncation_facts f ON f.attempt_id = a.attempt_id "
                   "LEFT JOIN workers w ON w.worker_id = a.worker_id WHERE a.run_id = %s ORDER BY a.attempt_no")

# ``transitions``: RunEvents, an Attempt's end and retry, a Lease's end, adoption and fence.
# The database functions of migration 0019 (one round trip each): a RunEvent with the Run's next
# sequence (run, type, actor, payload, now); the Lease fence (worker, credential digest, Session,
# generation, Attempt, lease generation, token digest: its code, the Worker's current Session
# and generation, the Lease's columns); an Attempt's end (run, Attempt, state, now, reason,
# exit code, signal, bytes kept, bytes dropped, peak RSS, CPU µs: the retry decision's facts);
# the Run's next step as decided (run, Attempt, its state, actor, now, reason, retry?, the Run's
# state, Attempt number, Worker executor, not-before µs, exit code, signal, Task: the new state).
EVENT_APPEND = "SELECT ql_event(%s, %s, %s, %s, %s)"
LEASE_FENCE = "SELECT * FROM ql_lease_fence(%s, %s, %s, %s::bigint, %s, %s::bigint, %s)"
WORKER_ATTEMPT_END = ("SELECT * FROM ql_attempt_end(%s, %s, %s, %s, %s, %s::integer, %s::integer, %s::bigint, %s::bigint, "
                      "%s::bigint, %s::bigint)")
RUN_AFTER_ATTEMPT = ("SELECT ql_after_attempt(%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s::bigint, %s::integer, "
                     "%s::integer, %s) AS state")
LEASE_END = "UPDATE run_leases SET state = %s, ended_at_us = %s WHERE attempt_id = %s AND lease_generation = %s"
LEASE_ATTEMPT_RUN_FOR_NO_KEY_UPDATE = (
    "SELECT a.state, r.cancel_requested_at_us FROM attempts a JOIN runs r ON r.run_id = a.run_id "
    "WHERE a.attempt_id = %s FOR NO KEY UPDATE OF a, r")
RUN_REQUEUE_DISPATCHING = (
    "UPDATE runs SET state = 'queued', version = version + 1, updated_at_us = %s "
    "WHERE run_id = %s AND state = 'dispatching' RETURNING task_id")
SESSIONS_CLOSE_OTHERS = (
    "UPDATE worker_sessions SET state = %s WHERE worker_id = %s AND state = 'open' "
    "AND session_id IS DISTINCT FROM %s")
LEASES_OF_OTHER_SESSIONS_FOR_UPDATE = (
    "SELECT * FROM run_leases WHERE worker_id = %s AND state = 'active' "
    "AND session_id IS DISTINCT FROM %s ORDER BY attempt_id FOR UPDATE")
LEASE_TO_ADOPT_FOR_UPDATE = (
    "SELECT l.*, a.state AS attempt_state, r.cancel_requested_at_us FROM run_leases l"
    " JOIN attempts a ON a.attempt_id = l.attempt_id JOIN runs r ON r.run_id = l.run_id"
    " WHERE l.attempt_id = %s AND l.lease_generation = %s AND l.worker_id = %s"
    " FOR UPDATE OF l")
LEASE_ADOPT = (
    "UPDATE run_leases SET session_id = %s, worker_generation = %s"
    " WHERE attempt_id = %s AND lease_generation = %s")
WORKER_BY_CREDENTIAL = "SELECT * FROM workers WHERE worker_id = %s AND credential_digest = %s AND state <> 'removed'"
# NO KEY UPDATE: a concurrent claim's foreign-key check (KEY SHARE) on this row must not wait.
WORKER_BY_CREDENTIAL_FOR_NO_KEY_UPDATE = WORKER_BY_CREDENTIAL + " FOR NO KEY UPDATE"

# ``dispatch``: a Worker Pull and its claim, an offer's definition.
_PULL_CANDIDATE_COLS = """r.run_id, a.attempt_id, r.project_id, r.task_id, r.task_revision, a.worker_executor,
    r.version, r.priority, r.created_at_us, r.latest_attempt_created_at_us, a.lease_generation, r.single_instance"""
PULL_CANDIDATES = (f"SELECT {_PULL_CANDIDATE_COLS} FROM runs r JOIN attempts a ON a.attempt_id = r.latest_attempt_id"
                   " WHERE r.state = 'queued' AND r.cancel_requested_at_us IS NULL AND NOT r.held"
                   " AND a.state = 'claimed' AND a.executor_type = 'remote_worker'"
                   " AND (a.not_before_us IS NULL OR a.not_before_us <= %s)")
PULL_PRIOR = (f"SELECT {_PULL_CANDIDATE_COLS}, l.*, a.state AS attempt_state FROM run_leases l"
              " JOIN attempts a ON a.attempt_id = l.attempt_id JOIN runs r ON r.run_id = l.run_id"
              " WHERE l.session_id = %s AND l.pull_id = %s")
# The Pull's Session: authenticated, current, locked for the unit, its active Leases counted
# under that lock, the database clock, and whether this pullId already has a Lease.
PULL_SESSION = (
    "SELECT s.labels, s.executor_types, s.slots, s.state, s.expires_at_us, s.generation,"
    " w.generation AS worker_generation, w.state AS worker_state, w.projects, ql_now_us() AS now,"
    " (SELECT count(*) FROM run_leases l WHERE l.session_id = s.session_id AND l.state = 'active') AS used,"
    " EXISTS (SELECT 1 FROM run_leases p WHERE p.session_id = s.session_id AND p.pull_id = %(pull)s) AS prior"
    " FROM workers w JOIN worker_sessions s ON s.session_id = %(session)s AND s.worker_id = w.worker_id"
    " WHERE w.worker_id = %(worker)s AND w.credential_digest = %(credential)s AND w.state <> 'removed'"
    " FOR NO KEY UPDATE OF s")
# ADR-0014 §2 step 8 in one statement; the caller holds the Run's row lock, so the guards read
# in ``a`` still hold when ``r`` writes. No row back: the Attempt is no longer claimable.
LEASE_CLAIM = (
    "WITH a AS (UPDATE attempts SET lease_generation = lease_generation + 1, worker_id = %(worker)s,"
    "   version = version + 1 WHERE attempt_id = %(attempt)s AND state = 'claimed' AND lease_generation = %(lg)s"
    "   AND EXISTS (SELECT 1 FROM runs WHERE run_id = %(run)s AND version = %(version)s AND state = 'queued'"
    "     AND cancel_requested_at_us IS NULL AND latest_attempt_id = %(attempt)s)"
    "   AND NOT EXISTS (SELECT 1 FROM run_leases WHERE attempt_id = %(attempt)s AND state = 'active')"
    "   AND NOT (%(single)s AND EXISTS (SELECT 1 FROM runs WHERE task_id = %(task)s AND run_id <> %(run)s"
    "     AND state = ANY(%(occupying)s)))"
    "   RETURNING lease_generation),"
    " r AS (UPDATE runs SET state = 'dispatching', version = version + 1, event_sequence = event_sequence + 1,"
    "   updated_at_us = %(now)s WHERE run_id = %(run)s AND EXISTS (SELECT 1 FROM a) RETURNING event_sequence),"
    " e AS (INSERT INTO run_events(run_id, sequence, event_id, type, actor, payload_json, created_at_us)"
    "   SELECT %(run)s, r.event_sequence, %(event)s, 'run.dispatching', 'control-plane', %(payload)s, %(now)s"
    "   FROM r)"
    " INSERT INTO run_leases(attempt_id, lease_generation, run_id, worker_id, session_id, worker_generation,"
    " token_digest, pull_id, state, claimed_at_us, expires_at_us)"
    " SELECT %(attempt)s, a.lease_generation, %(run)s, %(worker)s, %(session)s, %(generation)s, %(digest)s,"
    " %(pull)s, 'active', %(now)s, %(expires)s FROM a RETURNING lease_generation")
# A Worker Pull's candidate page (%s: observed µs; ``_SCOPED``: then the Worker's Projects;
# ``_AFTER``: then the keyset, negated priority first; then the limit), Runs another Pull holds skipped.
_PULL_SCOPED = " AND r.project_id = ANY(%s)"
_PULL_AFTER = f" AND ({_KEY}) > (%s, %s, %s, %s)"
_PULL_PAGE = f" ORDER BY {_KEY} LIMIT %s FOR NO KEY UPDATE OF r SKIP LOCKED"
PULL_CANDIDATE_PAGE = PULL_CANDIDATES + _PULL_PAGE
PULL_CANDIDATE_PAGE_AFTER = PULL_CANDIDATES + _PULL_AFTER + _PULL_PAGE
PULL_CANDIDATE_PAGE_SCOPED = PULL_CANDIDATES + _PULL_SCOPED + _PULL_PAGE
PULL_CANDIDATE_PAGE_SCOPED_AFTER = PULL_CANDIDATES + _PULL_SCOPED + _PULL_AFTER + _PULL_PAGE
# A claimable candidate the Pull's pages skipped (%s: observed µs, the Attempts returned[, Projects]).
PULL_HELD_ELSEWHERE = f"SELECT EXISTS ({PULL_CANDIDATES} AND a.attempt_id <> ALL(%s)) AS held"
PULL_HELD_ELSEWHERE_SCOPED = f"SELECT EXISTS ({PULL_CANDIDATES} AND a.attempt_id <> ALL(%s){_PULL_SCOPED}) AS held"
TASK_FOR_NO_KEY_UPDATE = "SELECT 1 FROM tasks WHERE task_id = %s FOR NO KEY UPDATE"
# A Pull's usual case in one call (migration 0018; params: worker, credential digest, Session,
# generation, pullId, token digest, Lease TTL µs, claimable keys, waiting): one row.
PULL_QUICK = "SELECT * FROM ql_pull(%s, %s, %s, %s::bigint, %s, %s, %s::bigint, %s::text[], %s)"
LEASE_ACTIVE_ATTEMPT_FOR_UPDATE = (
    "SELECT l.run_id, a.state FROM run_leases l JOIN attempts a USING (attempt_id)"
    " WHERE l.attempt_id = %s AND l.lease_generation = %s AND l.state = 'active'"
    " FOR UPDATE OF l, a")
LEASE_COMPLETE = (
    "UPDATE run_leases SET state = 'completed', ended_at_us = %s"
    " WHERE attempt_id = %s AND lease_generation = %s")
OFFER_DEFINITION = (
    "SELECT t.project_id, tr.definition_json, er.spec_json, cr.recipe_json FROM tasks t"
    " JOIN task_revisions tr ON tr.task_id = t.task_id AND tr.revision = %s"
    " JOIN execution_revisions er ON er.task_id = t.task_id AND er.revision = tr.revision"
    " JOIN context_recipes cr ON cr.recipe_ref = er.recipe_ref WHERE t.task_id = %s")

# ``placement``: the unplaceable sweep (a queued Run no Worker can take).
PLACEMENT_UNCHECKED_FOR_UPDATE = (
    "SELECT r.run_id, r.project_id, a.attempt_id, a.worker_executor, tr.definition_json FROM runs r"
    " JOIN attempts a ON a.attempt_id = r.latest_attempt_id"
    " JOIN task_revisions tr ON tr.task_id = r.task_id AND tr.revision = r.task_revision"
    " WHERE r.state = 'queued' AND NOT r.placement_checked AND a.executor_type = 'remote_worker'"
    " ORDER BY r.created_at_us LIMIT %s FOR UPDATE OF r SKIP LOCKED")
PLACEMENT_CHECKED = "UPDATE runs SET placement_checked = true WHERE run_id = %s"
PLACEMENT_WORKER_FITS = (
    "SELECT EXISTS (SELECT 1 FROM workers WHERE state <> 'removed'"
    " AND labels @> %s AND %s = ANY(executor_types)"
    " AND (projects = '{}' OR %s = ANY(projects))) AS ok")

# ``leases``: ACKs, the expired-Lease sweep, held Runs released.
# One ACK (migration 0019; worker, credential digest, Session, generation, Attempt, lease
# generation, token digest, target state, Lease TTL µs, reason, exit code, signal, bytes kept,
# bytes dropped, peak RSS, CPU µs): one row, its code and facts.
ACK = ("SELECT * FROM ql_ack(%s, %s, %s, %s::bigint, %s, %s::bigint, %s, %s, %s::bigint, %s, %s::integer, "
       "%s::integer, %s::bigint, %s::bigint, %s::bigint, %s::bigint)")
RUNS_RELEASE_HOLDS = (
    "UPDATE runs SET held = false WHERE run_id IN ("
    " SELECT r.run_id FROM runs r WHERE r.held AND r.state = 'queued' AND NOT EXISTS ("
    "  SELECT 1 FROM runs o WHERE o.task_id = r.task_id AND o.state = ANY(%s))"
    " ORDER BY r.created_at_us LIMIT %s FOR NO KEY UPDATE OF r SKIP LOCKED) RETURNING run_id")
LEASES_EXPIRED_FOR_UPDATE = (
    "SELECT * FROM run_leases WHERE state = 'active' AND expires_at_us <= %s"
    " ORDER BY expires_at_us, attempt_id LIMIT %s FOR UPDATE SKIP LOCKED")

# ``registry``: Workers, Sessions, heartbeats.
PROJECTS_BY_NAMES = "SELECT name, project_id FROM projects WHERE name = ANY(%s)"
WORKER_INSERT = (
    "INSERT INTO workers(worker_id, name, credential_digest, labels, executor_types, slots,"
    " state, enrolled_at_us, updated_at_us, projects)"
    " VALUES (%s, %s, %s, %s, %s, %s, 'active', %s, %s, %s)")
WORKER_BY_CREDENTIAL_DIGEST = "SELECT worker_id FROM workers WHERE credential_digest = %s AND state <> 'removed'"
SESSION_INSERT = (
    "INSERT INTO worker_sessions(session_id, worker_id, generation, labels, executor_types, slots,"
    " state, opened_at_us, last_heartbeat_us, expires_at_us)"
    " VALUES (%s, %s, %s, %s, %s, %s, 'open', %s, %s, %s)")
WORKER_SESSION_SET = (
    "UPDATE workers SET generation = %s, current_session_id = %s, updated_at_us = %s "
    "WHERE worker_id = %s")
SESSIONS_PRUNE = (
    "DELETE FROM worker_sessions WHERE session_id IN (SELECT s.session_id FROM worker_sessions s"
    " WHERE s.worker_id = %s AND s.generation <= %s AND s.state <> 'open'"
    " AND NOT EXISTS (SELECT 1 FROM run_leases l WHERE l.session_id = s.session_id)"
    " ORDER BY s.generation LIMIT %s)")
SESSION_OF_WORKER_FOR_NO_KEY_UPDATE = (
    "SELECT * FROM worker_sessions WHERE session_id = %s AND worker_id = %s"
    " FOR NO KEY UPDATE")
SESSION_HEARTBEAT = "UPDATE worker_sessions SET last_heartbeat_us = %s, expires_at_us = %s WHERE session_id = %s"
LEASES_RENEW = (
    "UPDATE run_leases l SET expires_at_us = %s FROM attempts a,"
    " unnest(%s::text[], %s::bigint[]) AS h(attempt_id, lease_generation)"
    " WHERE l.attempt_id = h.attempt_id AND l.lease_generation = h.lease_generation"
    " AND l.session_id = %s AND l.state = 'active' AND a.attempt_id = l.attempt_id"
    " AND a.state IN ('starting', 'running') AND l.expires_at_us > %s"
    " RETURNING l.attempt_id, l.expires_at_us")
LEASES_CANCEL_REQUESTED = (
    "SELECT l.attempt_id FROM run_leases l JOIN runs r ON r.run_id = l.run_id"
    " WHERE l.session_id = %s AND l.state = 'active'"
    " AND r.cancel_requested_at_us IS NOT NULL ORDER BY l.attempt_id")
WORKER_BY_NAME_FOR_NO_KEY_UPDATE = (
    "SELECT worker_id FROM workers WHERE name = %s AND state <> 'removed' FOR NO KEY UPDATE")
WORKER_STATE_SET = "UPDATE workers SET state = %s, updated_at_us = %s WHERE worker_id = %s"
WORKER_SESSION_CLEAR = "UPDATE workers SET current_session_id = NULL WHERE worker_id = %s"
SESSIONS_EXPIRE = (
    "UPDATE worker_sessions SET state = 'expired' WHERE session_id IN (SELECT session_id FROM worker_sessions"
    " WHERE state = 'open' AND expires_at_us <= ql_now_us() ORDER BY expires_at_us LIMIT %s"
    " FOR UPDATE SKIP LOCKED)")
WORKERS_PAGE = (
    "SELECT w.name, w.worker_id, w.generation, s.session_id, s.last_heartbeat_us, w.slots, w.labels,"
    " ARRAY(SELECT p.name FROM projects p WHERE p.project_id = ANY(w.projects) ORDER BY p.name) AS projects,"
    " CASE WHEN s.state = 'open' AND s.expires_at_us > ql_now_us()"
    "      THEN CASE w.state WHEN 'draining' THEN 'draining' ELSE 'online' END ELSE 'offline' END AS state,"
    " coalesce(s.slots, w.slots) - (SELECT count(*) FROM run_leases l WHERE l.worker_id = w.worker_id"
    "      AND l.state = 'active') AS free_slots"
    " FROM workers w LEFT JOIN worker_sessions s ON s.session_id = w.current_session_id"
    " WHERE w.state <> 'removed' AND w.name > %s ORDER BY w.name LIMIT %s")

# ``logs``: uploaded log chunks and truncation facts.
ATTEMPT_LOG_NEXT_FOR_NO_KEY_UPDATE = "SELECT log_next_offset FROM attempts WHERE attempt_id = %s FOR NO KEY UPDATE"
TRUNCATION_FACT_EXISTS = "SELECT 1 FROM truncation_facts WHERE attempt_id = %s"
LOG_CHUNK_AT = "SELECT data FROM log_chunks WHERE attempt_id = %s AND offset_bytes = %s"
LOG_CHUNK_INSERT = "INSERT INTO log_chunks(attempt_id, offset_bytes, data) VALUES (%s, %s, %s)"
TRUNCATION_FACT_INSERT = (
    "INSERT INTO truncation_facts(attempt_id, quota_bytes, bytes_kept, reason, recorded_at_us)"
    " VALUES (%s, %s, %s, %s, %s)")
ATTEMPT_LOG_NEXT_SET = "UPDATE attempts SET log_next_offset = %s WHERE attempt_id = %s"
LOG_CHUNKS_RANGE = (
    "SELECT offset_bytes, data FROM log_chunks WHERE attempt_id = %s"
    " AND offset_bytes + length(data) > %s AND offset_bytes < %s ORDER BY offset_bytes")
RUN_LOG_LATEST_ATTEMPT = (
    "SELECT a.attempt_id, f.quota_bytes, f.bytes_kept, f.bytes_dropped, f.reason,"
    " (SELECT coalesce(max(c.offset_bytes + length(c.data)), 0) FROM log_chunks c"
    "  WHERE c.attempt_id = a.attempt_id) AS size FROM attempts a"
    " LEFT JOIN truncation_facts f ON f.attempt_id = a.attempt_id"
    " WHERE a.run_id = %s ORDER BY a.attempt_no DESC LIMIT 1")

# ``credentials``: a Worker's credential rotated.
WORKER_CREDENTIAL_SET = (
    "UPDATE workers SET credential_digest = %s, updated_at_us = %s"
    " WHERE name = %s AND state <> 'removed' RETURNING worker_id")

# ``join_tokens``: one-use join tokens.
JOIN_TOKEN_INSERT = (
    "INSERT INTO join_tokens(token_id, worker_id, issued_at_us, expires_at_us)"
    " VALUES (%s, %s, %s, %s)")
JOIN_TOKEN_FOR_UPDATE = (
    "SELECT expires_at_us, used_at_us FROM join_tokens WHERE token_id = %s AND worker_id = %s"
    " FOR UPDATE")
JOIN_TOKEN_USE = "UPDATE join_tokens SET used_at_us = %s WHERE token_id = %s"

# ``overview``: ``qlagent status`` (the server, its replication and clients, the queue, Session churn).
OVERVIEW_SERVER = (
    "SELECT pg_is_in_recovery() AS standby, current_setting('server_version') AS version,"
    " ql_now_us() AS now")
OVERVIEW_REPLICATION = (
    "SELECT application_name AS name, client_addr::text AS addr, state,"
    " extract(epoch FROM replay_lag)::float8 AS lag FROM pg_stat_replication"
    " ORDER BY 1")
OVERVIEW_CLIENTS = (
    "SELECT coalesce(client_addr::text, 'local') AS addr, application_name AS app, count(*) AS n"
    " FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid()"
    " AND backend_type = 'client backend' GROUP BY 1, 2 ORDER BY 2, 1")
OVERVIEW_QUEUE = (
    "SELECT count(*) AS queued, min(created_at_us) AS oldest,"
    " count(*) FILTER (WHERE EXISTS (SELECT 1 FROM run_events e WHERE e.run_id = r.run_id"
    "   AND e.type = 'run.unplaceable')) AS unplaceable"
    " FROM runs r WHERE r.state = 'queued'")
OVERVIEW_SESSION_CHURN = (
    "SELECT w.name, count(*) AS replaced FROM worker_sessions s JOIN workers w"
    " ON w.worker_id = s.worker_id WHERE s.state = 'replaced' AND s.opened_at_us > %s"
    " AND w.state <> 'removed' GROUP BY w.name HAVING count(*) >= %s ORDER BY 1")

# ``notify``: the candidates channel's wake-up.
NOTIFY = "SELECT pg_notify(%s, '')"

# ``store``: the clock check and the standby probe at connect.
CLOCK_US = "SELECT (extract(epoch FROM clock_timestamp()) * 1000000)::bigint"
IS_STANDBY = "SELECT pg_is_in_recovery()"

# ``migrations``: the history table, the advisory lock and who holds it, the capabilities.
MIGRATIONS_TABLE_CREATE = """CREATE TABLE IF NOT EXISTS schema_migrations (
        version integer PRIMARY KEY, name text NOT NULL, checksum text NOT NULL,
        applied_at_us bigint NOT NULL)"""
MIGRATIONS_APPLIED = "SELECT version, name, checksum FROM schema_migrations ORDER BY version"
ADVISORY_XACT_LOCK = "SELECT pg_advisory_xact_lock(%s)"
MIGRATION_RECORD = (
    "INSERT INTO schema_migrations(version, name, checksum, applied_at_us) "
    "VALUES (%s, %s, %s, ql_now_us())")
MIGRATION_LOCK_HOLDERS = (
    "SELECT l.pid, a.application_name, a.client_addr::text, a.state FROM pg_locks l "
    "LEFT JOIN pg_stat_activity a USING (pid) WHERE l.locktype = 'advisory' AND l.granted "
    "AND l.classid = %s AND l.objid = %s AND l.objsubid = 1")
CAPABILITIES = "SELECT name, version FROM capabilities"
