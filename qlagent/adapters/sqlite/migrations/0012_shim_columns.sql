-- One name for the per-run process: the shim (docs/ARCHITECTURE.md). Its PID and start time
-- keep their meaning and values.
ALTER TABLE attempts RENAME COLUMN wrapper_pid TO shim_pid;
ALTER TABLE attempts RENAME COLUMN wrapper_start_time TO shim_start_time;
-- attempts.task_pgid was never written: the agent reads the task's process group from the
-- shim's run directory (task.pid), which exists before any store write could record it.
ALTER TABLE attempts DROP COLUMN task_pgid;
