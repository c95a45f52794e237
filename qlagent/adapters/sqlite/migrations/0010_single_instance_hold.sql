-- A queued Run of a single-instance Task whose Task already has a starting/running Run is
-- "held": it cannot start, so it leaves the dispatch index. Without this, a backlog of such
-- Runs would be read and skipped page after page; with it a dispatcher pass stays O(page).
-- single_instance is copied from the Run's pinned revision when the Run is created.
ALTER TABLE runs ADD COLUMN single_instance INTEGER NOT NULL DEFAULT 0;
ALTER TABLE runs ADD COLUMN held INTEGER NOT NULL DEFAULT 0;
DROP INDEX runs_dispatch_candidates;
CREATE INDEX runs_dispatch_candidates ON runs(
    priority DESC, created_at_us, latest_attempt_created_at_us, latest_attempt_id
) WHERE state = 'queued' AND cancel_requested_at_us IS NULL AND held = 0;
-- A Task's Runs in one state, straight to the single-instance ones (equality seeks only).
CREATE INDEX runs_by_task_state ON runs(task_id, state, single_instance);
