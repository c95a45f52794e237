-- The pullId of each offer, so a restarted Worker can send its Pull again (byte-identical,
-- ADR-0108) and get the secret values back before the spawn.
ALTER TABLE offers ADD COLUMN pull_id TEXT;
