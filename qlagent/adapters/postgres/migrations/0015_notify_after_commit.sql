-- A transaction that creates Runs (Task Start, schedule fires) wakes the Pulls after its commit
-- instead (PgStore): a NOTIFY inside a transaction takes the one notify lock of the server at
-- commit and holds it through the commit's WAL flush, so every Run creation of every Task would
-- queue on it. Such a transaction says so with qlagent.notify_after_commit; every other writer
-- still wakes them from here.
DROP TRIGGER runs_notify_candidate ON runs;
CREATE TRIGGER runs_notify_candidate AFTER INSERT OR UPDATE OF state, held ON runs
    FOR EACH ROW WHEN (NEW.state = 'queued' AND NOT NEW.held
                       AND current_setting('qlagent.notify_after_commit', true) IS DISTINCT FROM 'on')
    EXECUTE FUNCTION ql_notify_candidate();
