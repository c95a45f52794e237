-- Why a log lost bytes: 'quota', or 'write_error: ENOSPC (No space left on device)' when a
-- failed write of the Artifact (a full file system) cut it; an errno and its text, never a path
-- or user output (core.receipt.TruncationFact). Write-once like the figures beside it.
ALTER TABLE truncation_facts ADD COLUMN reason TEXT NOT NULL DEFAULT 'quota' CHECK (length(reason) <= 160);
DROP TRIGGER truncation_facts_write_once_u;
CREATE TRIGGER truncation_facts_write_once_u BEFORE UPDATE OF quota_bytes, bytes_kept, reason ON truncation_facts
BEGIN SELECT RAISE(ABORT, 'truncation facts are write-once'); END;
