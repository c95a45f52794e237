-- A held Run released (runs.held true → false once its single-instance Task is free) is a new
-- candidate too: wake the long-polling Pulls then, not only when a Run enters 'queued' (they
-- waited out their long-poll, up to 30 s per Run of a busy single-instance Task). A Run
-- queued held wakes nobody: no Pull could take it.
DROP TRIGGER runs_notify_candidate ON runs;
CREATE TRIGGER runs_notify_candidate AFTER INSERT OR UPDATE OF state, held ON runs
    FOR EACH ROW WHEN (NEW.state = 'queued' AND NOT NEW.held) EXECUTE FUNCTION ql_notify_candidate();
