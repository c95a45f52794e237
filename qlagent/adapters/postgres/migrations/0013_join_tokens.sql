-- Join tokens (issue 26): `workers enroll --join-token` records one per token (its ID, never the
-- credential it carries), `worker join` redeems it once before its expiry.
CREATE TABLE join_tokens (
    token_id       text PRIMARY KEY,
    worker_id      text NOT NULL REFERENCES workers(worker_id),
    issued_at_us   bigint NOT NULL,
    expires_at_us  bigint NOT NULL,
    used_at_us     bigint
);
CREATE INDEX join_tokens_worker ON join_tokens(worker_id);
