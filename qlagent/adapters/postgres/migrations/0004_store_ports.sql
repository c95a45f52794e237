-- The store ports of core.ports on PostgreSQL (issue 9's contract; mirrors the local store's
-- 0002 schedule_cursors, 0011 start_error/orphans_stopped, 0012 shim columns).
-- The last scheduled instant acted on per Task, so no replica fires an instant twice.
CREATE TABLE schedule_cursors (
    task_id          text PRIMARY KEY REFERENCES tasks(task_id),
    last_instant_us  bigint,
    observed_wall_us bigint
);
-- The shim's identity and log path of an Attempt the authority's own engine launched.
ALTER TABLE attempts ADD COLUMN artifact_path text;
ALTER TABLE attempts ADD COLUMN shim_pid integer;
ALTER TABLE attempts ADD COLUMN shim_start_time double precision;
ALTER TABLE attempts ADD COLUMN start_error text CHECK (start_error IS NULL OR length(start_error) <= 512);
ALTER TABLE attempts ADD COLUMN orphans_stopped integer CHECK (orphans_stopped IS NULL OR orphans_stopped >= 0);
CREATE INDEX runs_live_by_task ON runs(task_id, state) WHERE state IN ('queued','dispatching','starting','running');
CREATE INDEX attempts_by_run ON attempts(run_id, attempt_no);
-- The truncation fact stays write-once in what it states (quota, bytes kept); the dropped byte
-- count may be filled in once when the Attempt ends (the local store's rule).
ALTER TABLE truncation_facts ADD COLUMN bytes_dropped bigint;
DROP TRIGGER truncation_facts_write_once ON truncation_facts;
CREATE TRIGGER truncation_facts_write_once BEFORE UPDATE OF quota_bytes, bytes_kept OR DELETE ON truncation_facts
    FOR EACH ROW EXECUTE FUNCTION ql_refuse_change();
INSERT INTO capabilities(name, version, declared_by) VALUES ('store-ports', 1, 4);
