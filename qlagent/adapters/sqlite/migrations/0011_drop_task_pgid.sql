-- attempts.task_pgid was never written: the agent reads the task's process group from the
-- shim's run directory (task.pid), which exists before any store write could record it.
ALTER TABLE attempts DROP COLUMN task_pgid;
