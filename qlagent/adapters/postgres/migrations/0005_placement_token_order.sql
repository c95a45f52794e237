-- A queued remote_worker Run is checked once against the enrolled Workers: when none could ever
-- satisfy its Placement (required labels, executor) it gets a run.unplaceable event instead of
-- waiting silently (issue 10 §5). The flag bounds each pass to Runs not yet checked.
ALTER TABLE runs ADD COLUMN placement_checked boolean NOT NULL DEFAULT false;
CREATE INDEX runs_placement_unchecked ON runs(created_at_us) WHERE state = 'queued' AND NOT placement_checked;
-- Tokens listed in the order they were created, also within one µs (the local store's rowid order).
ALTER TABLE api_tokens ADD COLUMN seq bigint GENERATED ALWAYS AS IDENTITY;
