-- Why an Attempt's task could not start (paths and errno names, bounded to 512 characters;
-- never the environment), and how many processes its main process left behind were stopped
-- when it exited (issue 12 §1, §2). NULL on Attempts recorded before this migration.
ALTER TABLE attempts ADD COLUMN start_error TEXT CHECK (start_error IS NULL OR length(start_error) <= 512);
ALTER TABLE attempts ADD COLUMN orphans_stopped INTEGER CHECK (orphans_stopped IS NULL OR orphans_stopped >= 0);
