-- Cluster tables (ADR-0014 §5, ADR-0108, ADR-0109). No offers table: the Run Lease is the authority.
ALTER TABLE attempts ADD COLUMN lease_generation bigint NOT NULL DEFAULT 0;
ALTER TABLE attempts ADD COLUMN worker_id text;
-- Received end of the offset-addressed log upload (bytes past the quota advance it, not the chunks).
ALTER TABLE attempts ADD COLUMN log_next_offset bigint NOT NULL DEFAULT 0;

CREATE TABLE workers (
    worker_id          text PRIMARY KEY,
    name               text NOT NULL,
    credential_digest  text NOT NULL UNIQUE CHECK (credential_digest ~ '^[0-9a-f]{64}$'),
    labels             jsonb NOT NULL,
    executor_types     text[] NOT NULL,
    slots              integer NOT NULL CHECK (slots BETWEEN 1 AND 256),
    state              text NOT NULL CHECK (state IN ('active','draining','removed')),
    generation         bigint NOT NULL DEFAULT 0,
    current_session_id text,
    enrolled_at_us     bigint NOT NULL,
    updated_at_us      bigint NOT NULL
);
CREATE UNIQUE INDEX workers_live_name ON workers(name) WHERE state <> 'removed';

CREATE TABLE worker_sessions (
    session_id         text PRIMARY KEY,
    worker_id          text NOT NULL REFERENCES workers(worker_id),
    generation         bigint NOT NULL,
    labels             jsonb NOT NULL,              -- hello, narrowed to the enrolment
    executor_types     text[] NOT NULL,
    slots              integer NOT NULL CHECK (slots >= 1),
    state              text NOT NULL CHECK (state IN ('open','replaced','expired','closed')),
    opened_at_us       bigint NOT NULL,
    last_heartbeat_us  bigint NOT NULL,
    expires_at_us      bigint NOT NULL,
    UNIQUE (worker_id, generation)
);
CREATE INDEX worker_sessions_open ON worker_sessions(expires_at_us) WHERE state = 'open';

CREATE TABLE run_leases (
    attempt_id         text NOT NULL REFERENCES attempts(attempt_id),
    lease_generation   bigint NOT NULL CHECK (lease_generation >= 1),
    run_id             text NOT NULL REFERENCES runs(run_id),
    worker_id          text NOT NULL REFERENCES workers(worker_id),
    session_id         text NOT NULL REFERENCES worker_sessions(session_id),
    worker_generation  bigint NOT NULL,
    token_digest       text NOT NULL CHECK (token_digest ~ '^[0-9a-f]{64}$'),   -- never the token
    pull_id            text,                                     -- the Worker's Pull request ID (ADR-0108)
    state              text NOT NULL CHECK (state IN ('active','completed','expired','fenced')),
    claimed_at_us      bigint NOT NULL,
    expires_at_us      bigint NOT NULL,
    ended_at_us        bigint,
    PRIMARY KEY (attempt_id, lease_generation)
);
-- At most one active Lease per Attempt: the database refuses a double claim.
CREATE UNIQUE INDEX run_leases_one_active ON run_leases(attempt_id) WHERE state = 'active';
CREATE UNIQUE INDEX run_leases_pull ON run_leases(session_id, pull_id) WHERE pull_id IS NOT NULL;
CREATE INDEX run_leases_expiry ON run_leases(expires_at_us) WHERE state = 'active';
CREATE INDEX run_leases_session ON run_leases(session_id) WHERE state = 'active';

CREATE TABLE log_chunks (
    attempt_id         text NOT NULL REFERENCES attempts(attempt_id),
    offset_bytes       bigint NOT NULL CHECK (offset_bytes >= 0),
    data               bytea NOT NULL CHECK (length(data) BETWEEN 1 AND 1048576),
    PRIMARY KEY (attempt_id, offset_bytes)
);
CREATE TRIGGER log_chunks_write_once BEFORE UPDATE OR DELETE ON log_chunks
    FOR EACH ROW EXECUTE FUNCTION ql_refuse_change();

-- A Run entering 'queued' wakes long-polling Worker Pulls on every replica (LISTEN
-- qlagent_candidates); NOTIFY is delivered at commit, and identical ones in a transaction fold.
CREATE FUNCTION ql_notify_candidate() RETURNS trigger LANGUAGE plpgsql AS
$$ BEGIN PERFORM pg_notify('qlagent_candidates', ''); RETURN NULL; END $$;
CREATE TRIGGER runs_notify_candidate AFTER INSERT OR UPDATE OF state ON runs
    FOR EACH ROW WHEN (NEW.state = 'queued') EXECUTE FUNCTION ql_notify_candidate();
