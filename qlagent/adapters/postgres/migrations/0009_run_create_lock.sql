-- The Run-creating writes (Task Start, schedule fires) queue on this table's lock instead of a
-- session advisory lock: `LOCK TABLE` is transaction-scoped, so it stays on the one server
-- backend a transaction-mode pooler (PgBouncer) gives the transaction and ends with it, and it
-- takes no snapshot, so a SERIALIZABLE transaction that locks first reads after its wait. The
-- table holds no rows.
CREATE TABLE run_create_lock ();
