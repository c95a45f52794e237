-- The Worker's inbox (ADR-0021): the offers received, in receipt order, and the one Pull in flight.
CREATE TABLE offers (
    seq                 INTEGER PRIMARY KEY AUTOINCREMENT,     -- receipt order
    offer_id            TEXT NOT NULL UNIQUE,
    attempt_id          TEXT NOT NULL,
    session_id          TEXT NOT NULL,
    generation          INTEGER NOT NULL,
    lease_generation    INTEGER NOT NULL,
    lease_expires_at_us INTEGER NOT NULL,
    lease_token         TEXT NOT NULL,
    spec_digest         TEXT NOT NULL,
    spec_json           BLOB NOT NULL,
    spec_bytes          INTEGER NOT NULL,
    state               TEXT NOT NULL CHECK (state IN ('received','barrier','started','completed','acked')),
    outcome_json        BLOB,
    received_at_us      INTEGER NOT NULL,
    updated_at_us       INTEGER NOT NULL,
    conflicts           INTEGER NOT NULL DEFAULT 0,
    last_conflict_digest TEXT,
    last_conflict_at_us INTEGER
);
CREATE INDEX offers_state ON offers (state, seq);
CREATE TABLE pending_pull (
    one           INTEGER PRIMARY KEY CHECK (one = 1),          -- at most one Pull in flight
    session_id    TEXT NOT NULL,
    generation    INTEGER NOT NULL,
    pull_id       TEXT NOT NULL,
    lease_token   TEXT NOT NULL,
    body          BLOB NOT NULL,
    created_at_us INTEGER NOT NULL
);
