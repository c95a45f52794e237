-- Fewer index writes per claim (issue 10 bench). attempts_by_run repeated the index of the
-- UNIQUE (run_id, attempt_no) constraint, column for column: every Attempt insert and every
-- non-HOT Attempt update wrote both.
DROP INDEX attempts_by_run;
-- The claim's Attempt update (lease_generation, worker_id, version) changes no indexed column,
-- so it can be a HOT update — no index entry at all — when the row's page has room for the new
-- version: keep 20 % of each new attempts page free for it (applies to pages written from now on).
ALTER TABLE attempts SET (fillfactor = 80);
