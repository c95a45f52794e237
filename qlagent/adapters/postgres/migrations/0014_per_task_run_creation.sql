-- Run creation takes no cluster-wide lock any more: Task Starts and schedule fires of different
-- Tasks run side by side, each Task's rules kept by its own rows (its head row lock, its
-- schedule cursor, the unique idempotency key written with ON CONFLICT).
DROP TABLE run_create_lock;
-- Whether a Task is occupied (runs.set_holds, a single-instance Run's hold at creation) is read
-- through an index no queued Run enters: under SERIALIZABLE that read's predicate locks sit on
-- pages a Task Start's insert never touches, so starts of other Tasks do not fail its commit.
CREATE INDEX runs_occupying_by_task ON runs(task_id) WHERE state IN ('dispatching','starting','running');
