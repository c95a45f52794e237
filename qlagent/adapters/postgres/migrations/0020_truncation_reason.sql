-- Why a log lost bytes: 'quota', or 'write_error: ENOSPC (No space left on device)' when a
-- failed write of the Artifact (a full file system on the Worker) cut it; an errno and its text,
-- never a path or user output (core.receipt.TruncationFact). Write-once like the figures beside
-- it (mirrors the local store's 0014).
ALTER TABLE truncation_facts ADD COLUMN reason text NOT NULL DEFAULT 'quota' CHECK (length(reason) <= 160);
DROP TRIGGER truncation_facts_write_once ON truncation_facts;
CREATE TRIGGER truncation_facts_write_once BEFORE UPDATE OF quota_bytes, bytes_kept, reason OR DELETE ON truncation_facts
    FOR EACH ROW EXECUTE FUNCTION ql_refuse_change();
