-- The local store's domain on PostgreSQL (mirrors qlagent/adapters/sqlite/migrations 0001–0010).
-- Times are bigint µs since the Unix epoch, taken from the database clock (ql_now_us) wherever
-- the authority decides time. Idempotency keys live on runs (project_id, idempotency_key), as
-- ADR-0376 §4 requires: no separate ledger.
CREATE FUNCTION ql_now_us() RETURNS bigint LANGUAGE sql VOLATILE AS
$$ SELECT (EXTRACT(EPOCH FROM clock_timestamp()) * 1000000)::bigint $$;

CREATE FUNCTION ql_refuse_change() RETURNS trigger LANGUAGE plpgsql AS
$$ BEGIN RAISE EXCEPTION '% is append-only', TG_TABLE_NAME; END $$;

CREATE TABLE projects (
    project_id      text PRIMARY KEY,
    name            text NOT NULL UNIQUE,
    project_version integer NOT NULL DEFAULT 1,
    active          boolean NOT NULL DEFAULT true,
    created_at_us   bigint NOT NULL
);

CREATE TABLE role_bindings (
    binding_id      text PRIMARY KEY,
    project_id      text NOT NULL REFERENCES projects(project_id),
    subject         text NOT NULL,
    role            text NOT NULL CHECK (role IN ('owner','admin','operator','viewer')),
    binding_version integer NOT NULL CHECK (binding_version >= 1),
    active          boolean NOT NULL DEFAULT true,
    created_at_us   bigint NOT NULL,
    UNIQUE (project_id, subject, binding_version)
);

CREATE TABLE api_tokens (
    token_digest    text PRIMARY KEY CHECK (length(token_digest) = 64),  -- SHA-256 hex; never the token
    token_id        text NOT NULL UNIQUE,
    project_id      text NOT NULL REFERENCES projects(project_id),
    subject         text NOT NULL,
    created_at_us   bigint NOT NULL,
    revoked_at_us   bigint
);

CREATE TABLE tasks (
    task_id         text PRIMARY KEY,
    project_id      text NOT NULL REFERENCES projects(project_id),
    name            text NOT NULL,
    head_revision   integer NOT NULL CHECK (head_revision BETWEEN 1 AND 2147483647),
    enabled         boolean NOT NULL DEFAULT true,
    skipped_fires   integer NOT NULL DEFAULT 0,
    created_at_us   bigint NOT NULL,
    updated_at_us   bigint NOT NULL,
    deleted_at_us   bigint
);
CREATE UNIQUE INDEX tasks_live_name ON tasks(project_id, name) WHERE deleted_at_us IS NULL;

CREATE TABLE task_revisions (
    task_id         text NOT NULL REFERENCES tasks(task_id),
    revision        integer NOT NULL CHECK (revision BETWEEN 1 AND 2147483647),
    content_digest  text NOT NULL CHECK (content_digest ~ '^[0-9a-f]{64}$'),
    definition_json text NOT NULL,                   -- canonical JSON; contentDigest hashes these bytes
    created_at_us   bigint NOT NULL,
    PRIMARY KEY (task_id, revision)
);
CREATE TRIGGER task_revisions_append_only BEFORE UPDATE OR DELETE ON task_revisions
    FOR EACH ROW EXECUTE FUNCTION ql_refuse_change();

CREATE TABLE context_recipes (
    recipe_ref      text PRIMARY KEY,                -- localctx:sha256:<digest>
    recipe_json     text NOT NULL,                   -- public values and SecretRef names, never secret values
    created_at_us   bigint NOT NULL
);
CREATE TRIGGER context_recipes_append_only BEFORE UPDATE OR DELETE ON context_recipes
    FOR EACH ROW EXECUTE FUNCTION ql_refuse_change();

CREATE TABLE execution_revisions (
    task_id         text NOT NULL REFERENCES tasks(task_id),
    revision        integer NOT NULL CHECK (revision BETWEEN 1 AND 2147483647),
    kind            text NOT NULL CHECK (kind IN ('local_process','shell')),
    execution_digest text NOT NULL CHECK (execution_digest ~ '^[0-9a-f]{64}$'),
    spec_json       text NOT NULL,
    recipe_ref      text NOT NULL REFERENCES context_recipes(recipe_ref),
    published_at_us bigint NOT NULL,
    PRIMARY KEY (task_id, revision)
);
CREATE TRIGGER execution_revisions_append_only BEFORE UPDATE OR DELETE ON execution_revisions
    FOR EACH ROW EXECUTE FUNCTION ql_refuse_change();

CREATE TABLE secrets (
    project_id      text NOT NULL REFERENCES projects(project_id),
    name            text NOT NULL,
    ciphertext      bytea NOT NULL,                  -- AES-256-GCM; the key never enters the database
    key_id          text NOT NULL,
    updated_at_us   bigint NOT NULL,
    PRIMARY KEY (project_id, name)
);

CREATE TABLE runs (
    run_id              text PRIMARY KEY,
    project_id          text NOT NULL REFERENCES projects(project_id),
    task_id             text NOT NULL REFERENCES tasks(task_id),
    task_revision       integer NOT NULL,
    task_snapshot_ref   text NOT NULL,               -- qltd:v1:{revision}:{contentDigest}
    state               text NOT NULL CHECK (state IN ('queued','dispatching','starting','running',
                            'succeeded','failed','timed_out','cancelled','lost')),
    priority            integer NOT NULL DEFAULT 0,
    execution_origin    text NOT NULL,
    execution_owner     text NOT NULL,
    trigger_type        text NOT NULL,
    idempotency_key     text NOT NULL,
    requested_by        text NOT NULL,
    scheduled_for_us    bigint,
    version             integer NOT NULL,
    event_sequence      integer NOT NULL,
    cancel_requested_at_us bigint,
    latest_attempt_id   text,
    latest_attempt_created_at_us bigint,
    single_instance     boolean NOT NULL DEFAULT false,
    held                boolean NOT NULL DEFAULT false,
    exit_code           integer,
    exit_signal         integer,
    created_at_us       bigint NOT NULL,
    updated_at_us       bigint NOT NULL,
    ended_at_us         bigint,
    UNIQUE (project_id, idempotency_key)
);
-- Keyset order of cluster candidates: priority desc, Run created, Attempt created, Attempt ID.
CREATE INDEX runs_dispatch_candidates ON runs((-priority), created_at_us, latest_attempt_created_at_us,
    latest_attempt_id) WHERE state = 'queued' AND cancel_requested_at_us IS NULL AND NOT held;
CREATE INDEX runs_by_task ON runs(task_id, created_at_us);
CREATE INDEX runs_project_order ON runs(project_id, created_at_us DESC, run_id DESC);

CREATE TABLE attempts (
    attempt_id          text PRIMARY KEY,
    run_id              text NOT NULL REFERENCES runs(run_id),
    attempt_no          integer NOT NULL CHECK (attempt_no >= 1),
    state               text NOT NULL CHECK (state IN ('claimed','starting','running','succeeded','failed',
                            'timed_out','cancelled','lost','start_failed')),
    executor_type       text NOT NULL CHECK (executor_type IN ('local_process','remote_worker')),
    worker_executor     text NOT NULL DEFAULT 'local_process',   -- what a remote Worker runs
    version             integer NOT NULL DEFAULT 1,
    not_before_us       bigint,
    deadline_at_us      bigint,
    exit_code           integer,
    exit_signal         integer,
    bytes_kept          bigint,
    bytes_dropped       bigint,
    peak_rss_bytes      bigint,
    cpu_time_us         bigint,
    failure_reason      text,
    created_at_us       bigint NOT NULL,
    started_at_us       bigint,
    ended_at_us         bigint,
    UNIQUE (run_id, attempt_no)
);

CREATE TABLE run_events (
    run_id          text NOT NULL REFERENCES runs(run_id),
    sequence        integer NOT NULL CHECK (sequence >= 1),
    event_id        text NOT NULL UNIQUE,
    type            text NOT NULL,
    actor           text NOT NULL,
    payload_json    jsonb NOT NULL,
    created_at_us   bigint NOT NULL,
    PRIMARY KEY (run_id, sequence)
);
CREATE TRIGGER run_events_append_only BEFORE UPDATE OR DELETE ON run_events
    FOR EACH ROW EXECUTE FUNCTION ql_refuse_change();

-- Write-once, low-sensitivity record that the log quota was reached: byte counts only.
CREATE TABLE truncation_facts (
    attempt_id      text PRIMARY KEY REFERENCES attempts(attempt_id),
    quota_bytes     bigint NOT NULL,
    bytes_kept      bigint NOT NULL,
    recorded_at_us  bigint NOT NULL
);
CREATE TRIGGER truncation_facts_write_once BEFORE UPDATE OR DELETE ON truncation_facts
    FOR EACH ROW EXECUTE FUNCTION ql_refuse_change();

-- One row per (Task, scheduled instant): whichever replica fires first creates the Run; every
-- other replica's insert conflicts, so an instant yields exactly one Run across replicas.
CREATE TABLE schedule_fires (
    task_id         text NOT NULL REFERENCES tasks(task_id),
    instant_us      bigint NOT NULL,
    run_id          text REFERENCES runs(run_id),    -- NULL: the instant was skipped
    fired_at_us     bigint NOT NULL,
    PRIMARY KEY (task_id, instant_us)
);
