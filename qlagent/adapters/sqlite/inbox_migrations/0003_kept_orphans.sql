-- The Attempts whose leftovers are kept on purpose (keepOrphans), which the Worker's stray scan
-- must spare once their acknowledged rows are pruned.
CREATE TABLE kept_orphans (attempt_id TEXT PRIMARY KEY, kept_at_us INTEGER NOT NULL);
