-- Runs, Attempts, RunEvents, truncation facts, schedule cursors.
CREATE TABLE runs (
    run_id              TEXT PRIMARY KEY,
    project_id          TEXT NOT NULL REFERENCES projects(project_id),
    task_id             TEXT NOT NULL REFERENCES tasks(task_id),
    task_revision       INTEGER NOT NULL,
    task_snapshot_ref   TEXT NOT NULL,               -- qltd:v1:{revision}:{contentDigest}
    state               TEXT NOT NULL,
    priority            INTEGER NOT NULL DEFAULT 0,
    execution_origin    TEXT NOT NULL,               -- schedule | manual | retry
    execution_owner     TEXT NOT NULL,               -- runtime
    trigger_type        TEXT NOT NULL,               -- cron | boot | once | task_start | cli
    idempotency_key     TEXT NOT NULL,
    requested_by        TEXT NOT NULL,               -- subject that created it ('scheduler' for cron)
    scheduled_for_us    INTEGER,
    version             INTEGER NOT NULL,
    event_sequence      INTEGER NOT NULL,
    cancel_requested_at_us INTEGER,
    latest_attempt_id   TEXT,
    latest_attempt_created_at_us INTEGER,
    exit_code           INTEGER,
    exit_signal         INTEGER,
    created_at_us       INTEGER NOT NULL,
    updated_at_us       INTEGER NOT NULL,
    ended_at_us         INTEGER,
    UNIQUE (project_id, idempotency_key)
);
-- Serves the dispatcher's keyset order (ADR-0071 §3): priority desc, Run created asc,
-- Attempt created asc, Attempt ID asc, only over live candidates.
CREATE INDEX runs_dispatch_candidates ON runs(
    priority DESC, created_at_us, latest_attempt_created_at_us, latest_attempt_id
) WHERE state = 'queued' AND cancel_requested_at_us IS NULL;
CREATE INDEX runs_by_task ON runs(task_id, created_at_us);
CREATE INDEX runs_by_state ON runs(state) WHERE state IN ('queued','starting','running');
CREATE INDEX runs_project_order ON runs(project_id, created_at_us DESC, run_id DESC);

CREATE TABLE attempts (
    attempt_id          TEXT PRIMARY KEY,
    run_id              TEXT NOT NULL REFERENCES runs(run_id),
    attempt_no          INTEGER NOT NULL CHECK (attempt_no >= 1),
    state               TEXT NOT NULL,
    executor_type       TEXT NOT NULL CHECK (executor_type IN ('local_process','remote_worker')),
    version             INTEGER NOT NULL DEFAULT 1,
    not_before_us       INTEGER,                     -- retry backoff: not a candidate before this time
    deadline_at_us      INTEGER,
    artifact_path       TEXT,
    wrapper_pid         INTEGER,
    wrapper_start_time  REAL,                        -- psutil create_time, seconds; guards PID reuse
    task_pgid           INTEGER,
    exit_code           INTEGER,
    exit_signal         INTEGER,
    bytes_kept          INTEGER,
    bytes_dropped       INTEGER,
    peak_rss_bytes      INTEGER,
    cpu_time_us         INTEGER,
    failure_reason      TEXT,
    created_at_us       INTEGER NOT NULL,
    started_at_us       INTEGER,
    ended_at_us         INTEGER,
    UNIQUE (run_id, attempt_no)
);
CREATE INDEX attempts_live ON attempts(state) WHERE state IN ('starting','running');

CREATE TABLE run_events (
    run_id          TEXT NOT NULL REFERENCES runs(run_id),
    sequence        INTEGER NOT NULL CHECK (sequence >= 1),
    event_id        TEXT NOT NULL UNIQUE,
    type            TEXT NOT NULL,
    actor           TEXT NOT NULL,
    payload_json    TEXT NOT NULL,
    created_at_us   INTEGER NOT NULL,
    PRIMARY KEY (run_id, sequence)
);
CREATE TRIGGER run_events_append_only_u BEFORE UPDATE ON run_events
BEGIN SELECT RAISE(ABORT, 'run_events are append-only'); END;

-- Write-once, low-sensitivity record that the log quota was reached: byte counts only.
CREATE TABLE truncation_facts (
    attempt_id      TEXT PRIMARY KEY REFERENCES attempts(attempt_id),
    quota_bytes     INTEGER NOT NULL,
    bytes_kept      INTEGER NOT NULL,
    bytes_dropped   INTEGER,
    recorded_at_us  INTEGER NOT NULL
);
CREATE TRIGGER truncation_facts_write_once_u BEFORE UPDATE OF quota_bytes, bytes_kept ON truncation_facts
BEGIN SELECT RAISE(ABORT, 'truncation facts are write-once'); END;
CREATE TRIGGER truncation_facts_write_once_d BEFORE DELETE ON truncation_facts
BEGIN SELECT RAISE(ABORT, 'truncation facts are write-once'); END;

-- The last scheduled instant acted on per task, so a restart never fires it twice.
CREATE TABLE schedule_cursors (
    task_id         TEXT PRIMARY KEY REFERENCES tasks(task_id),
    last_instant_us INTEGER NOT NULL,
    observed_wall_us INTEGER NOT NULL
);
