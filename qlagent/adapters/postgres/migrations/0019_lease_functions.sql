-- The Lease facts of the Worker protocol as database functions (adapters/postgres/transitions.py,
-- leases.py): a RunEvent appended with its Run's next sequence, the ADR-0109 Lease fence, an
-- Attempt's end and the Run's next step after it, and a whole ACK. Each is one round trip with
-- its statements planned once per server session; the replica keeps every decision that is
-- policy (the retry decision, the error each refusal answers) and passes it in or maps what
-- comes back. Same statements, same order as the Python path they replace.

-- One RunEvent with the Run's next event sequence (payload: identities, fences, figures only).
CREATE FUNCTION ql_event(p_run text, p_type text, p_actor text, p_payload jsonb, p_now bigint)
RETURNS void LANGUAGE plpgsql AS $$
DECLARE
    seq integer;
BEGIN
    UPDATE runs r SET event_sequence = r.event_sequence + 1 WHERE r.run_id = p_run RETURNING r.event_sequence INTO seq;
    INSERT INTO run_events(run_id, sequence, event_id, type, actor, payload_json, created_at_us)
        VALUES (p_run, seq, gen_random_uuid()::text, p_type, p_actor, p_payload, p_now);
END $$;

-- ADR-0109's fence of a Worker fact on one Lease, in transitions.fenced_lease's order: the
-- credential (code worker_unauthorized), the Worker's current generation (stale_generation:
-- its current Session and generation returned), the Lease of this Worker locked FOR UPDATE
-- (lease_not_found), its token digest (lease_token_mismatch), its Session and generation
-- (lease_elsewhere); 'ok' with the Lease's columns.
CREATE FUNCTION ql_lease_fence(
    p_worker text, p_credential text, p_session text, p_generation bigint, p_attempt text, p_lease_generation bigint,
    p_token_digest text,
    OUT code text, OUT current_session_id text, OUT current_generation bigint, OUT attempt_id text,
    OUT lease_generation bigint, OUT run_id text, OUT worker_id text, OUT session_id text,
    OUT worker_generation bigint, OUT token_digest text, OUT pull_id text, OUT state text, OUT claimed_at_us bigint,
    OUT expires_at_us bigint, OUT ended_at_us bigint)
LANGUAGE plpgsql AS $$
DECLARE
    w record;
    l record;
BEGIN
    SELECT x.generation, x.current_session_id INTO w FROM workers x
        WHERE x.worker_id = p_worker AND x.credential_digest = p_credential AND x.state <> 'removed';
    IF NOT FOUND THEN
        code := 'worker_unauthorized';
        RETURN;
    END IF;
    current_session_id := w.current_session_id;
    current_generation := w.generation;
    IF w.generation <> p_generation THEN
        code := 'stale_generation';
        RETURN;
    END IF;
    SELECT * INTO l FROM run_leases y
        WHERE y.attempt_id = p_attempt AND y.lease_generation = p_lease_generation AND y.worker_id = p_worker
        FOR UPDATE;
    IF NOT FOUND THEN
        code := 'lease_not_found';
        RETURN;
    END IF;
    IF l.token_digest <> p_token_digest THEN
        code := 'lease_token_mismatch';
        RETURN;
    END IF;
    attempt_id := l.attempt_id;
    lease_generation := l.lease_generation;
    run_id := l.run_id;
    worker_id := l.worker_id;
    session_id := l.session_id;
    worker_generation := l.worker_generation;
    token_digest := l.token_digest;
    pull_id := l.pull_id;
    state := l.state;
    claimed_at_us := l.claimed_at_us;
    expires_at_us := l.expires_at_us;
    ended_at_us := l.ended_at_us;
    code := CASE WHEN l.session_id <> p_session OR l.worker_generation <> p_generation THEN 'lease_elsewhere'
                 ELSE 'ok' END;
END $$;

-- An Attempt ends in p_state (with its figures and reason) and its Run is locked: returns what
-- the retry decision needs (the Attempt's number and executor, whether the Run was asked to
-- cancel, its Task, the retry policy of its revision: max_attempts NULL when that revision is
-- gone).
CREATE FUNCTION ql_attempt_end(
    p_run text, p_attempt text, p_state text, p_now bigint, p_reason text, p_exit_code integer, p_signal integer,
    p_bytes_kept bigint, p_bytes_dropped bigint, p_peak_rss_bytes bigint, p_cpu_time_us bigint,
    OUT attempt_no integer, OUT worker_executor text, OUT cancel_requested boolean, OUT task_id text,
    OUT max_attempts integer, OUT backoff_ms bigint)
LANGUAGE plpgsql AS $$
DECLARE
    retry json;
BEGIN
    UPDATE attempts a SET state = p_state, ended_at_us = p_now, failure_reason = p_reason, exit_code = p_exit_code,
        exit_signal = p_signal, bytes_kept = p_bytes_kept, bytes_dropped = p_bytes_dropped,
        peak_rss_bytes = p_peak_rss_bytes, cpu_time_us = p_cpu_time_us, version = a.version + 1
        WHERE a.attempt_id = p_attempt RETURNING a.attempt_no, a.worker_executor INTO attempt_no, worker_executor;
    SELECT r.cancel_requested_at_us IS NOT NULL, r.task_id INTO cancel_requested, task_id FROM runs r
        WHERE r.run_id = p_run FOR NO KEY UPDATE;
    SELECT coalesce(tr.definition_json::json -> 'retry', '{}') INTO retry FROM runs r JOIN task_revisions tr
        ON tr.task_id = r.task_id AND tr.revision = r.task_revision WHERE r.run_id = p_run;
    IF FOUND THEN
        max_attempts := coalesce((retry ->> 'maxAttempts')::integer, 1);
        backoff_ms := coalesce((retry ->> 'backoffMs')::bigint, 0);
    END IF;
END $$;

-- The Run's next step after its Attempt ended, as the replica decided it: the attempt event,
-- then either a new claimed Attempt not before p_not_before_us (the Run queued again,
-- run.retrying) or the Run's end in p_run_state (run.<state>); the Task's holds follow.
-- Returns the Run's new state.
CREATE FUNCTION ql_after_attempt(
    p_run text, p_attempt text, p_attempt_state text, p_actor text, p_now bigint, p_reason text, p_retry boolean,
    p_run_state text, p_attempt_no integer, p_worker_executor text, p_not_before_us bigint, p_exit_code integer,
    p_signal integer, p_task text)
RETURNS text LANGUAGE plpgsql AS $$
DECLARE
    nxt text := gen_random_uuid()::text;
BEGIN
    PERFORM ql_event(p_run, 'attempt.' || p_attempt_state, p_actor,
                     jsonb_build_object('attemptId', p_attempt)
                     || CASE WHEN coalesce(p_reason, '') <> '' THEN jsonb_build_object('reason', p_reason)
                             ELSE '{}'::jsonb END, p_now);
    IF p_retry THEN
        INSERT INTO attempts(attempt_id, run_id, attempt_no, state, executor_type, worker_executor, not_before_us,
            created_at_us) VALUES (nxt, p_run, p_attempt_no + 1, 'claimed', 'remote_worker', p_worker_executor,
            p_not_before_us, p_now);
        UPDATE runs r SET state = 'queued', latest_attempt_id = nxt, latest_attempt_created_at_us = p_now,
            version = r.version + 1, updated_at_us = p_now WHERE r.run_id = p_run;
        PERFORM ql_event(p_run, 'run.retrying', p_actor,
                         jsonb_build_object('attemptId', nxt, 'attemptNo', p_attempt_no + 1,
                                            'notBeforeUs', p_not_before_us), p_now);
        PERFORM ql_set_holds(p_task);
        RETURN 'queued';
    END IF;
    UPDATE runs r SET state = p_run_state, exit_code = p_exit_code, exit_signal = p_signal, ended_at_us = p_now,
        version = r.version + 1, updated_at_us = p_now WHERE r.run_id = p_run;
    PERFORM ql_event(p_run, 'run.' || p_run_state, p_actor, jsonb_build_object('attemptId', p_attempt), p_now);
    PERFORM ql_set_holds(p_task);      -- the Task's single instance is free again
    RETURN p_run_state;
END $$;

-- One ACK (leases.apply_ack) of a Worker on its Lease asking the Attempt to move to p_target,
-- after ql_lease_fence: a Lease ended or superseded answers lease_not_active; a step already
-- taken answers replay (or ack_conflict for another terminal state); then the Lease must be
-- active (lease_not_active) and unexpired (lease_expired), and the Attempt in a state the step
-- follows (ack_out_of_order). starting / running: the Attempt and Run move, the Lease extends
-- to now + p_lease_ttl_us at least, run.<target> is appended ('applied'). A terminal target:
-- the Lease completes and the Attempt ends with the figures ('ended', with ql_attempt_end's
-- facts): the replica decides the Run's next step in the same transaction (ql_after_attempt).
CREATE FUNCTION ql_ack(
    p_worker text, p_credential text, p_session text, p_generation bigint, p_attempt text, p_lease_generation bigint,
    p_token_digest text, p_target text, p_lease_ttl_us bigint, p_reason text, p_exit_code integer, p_signal integer,
    p_bytes_kept bigint, p_bytes_dropped bigint, p_peak_rss_bytes bigint, p_cpu_time_us bigint,
    OUT code text, OUT current_session_id text, OUT current_generation bigint, OUT session_id text,
    OUT worker_generation bigint, OUT lease_state text, OUT attempt_state text, OUT run_state text,
    OUT run_id text, OUT now_us bigint, OUT attempt_no integer, OUT worker_executor text,
    OUT cancel_requested boolean, OUT task_id text, OUT max_attempts integer, OUT backoff_ms bigint)
LANGUAGE plpgsql AS $$
DECLARE
    f record;
    a record;
    e record;
    rank_of constant jsonb := '{"claimed": 0, "starting": 1, "running": 2}';
    terminal constant text[] := ARRAY['succeeded', 'failed', 'timed_out', 'cancelled', 'lost', 'start_failed'];
BEGIN
    SELECT * INTO f FROM ql_lease_fence(p_worker, p_credential, p_session, p_generation, p_attempt,
                                        p_lease_generation, p_token_digest);
    code := f.code;
    current_session_id := f.current_session_id;
    current_generation := f.current_generation;
    session_id := f.session_id;
    worker_generation := f.worker_generation;
    lease_state := f.state;
    run_id := f.run_id;
    IF code <> 'ok' THEN
        RETURN;
    END IF;
    SELECT x.state, x.lease_generation INTO a FROM attempts x WHERE x.attempt_id = p_attempt FOR NO KEY UPDATE;
    attempt_state := a.state;
    IF f.state IN ('expired', 'fenced') OR a.lease_generation <> p_lease_generation THEN
        code := 'lease_not_active';
        RETURN;
    END IF;
    IF a.state = ANY(terminal) OR (rank_of ? p_target
            AND coalesce((rank_of ->> a.state)::integer, 3) >= (rank_of ->> p_target)::integer) THEN
        code := CASE WHEN p_target = ANY(terminal) AND a.state <> p_target THEN 'ack_conflict' ELSE 'replay' END;
        SELECT r.state INTO run_state FROM runs r WHERE r.run_id = f.run_id;
        RETURN;
    END IF;
    IF f.state <> 'active' THEN
        code := 'lease_not_active';
        RETURN;
    END IF;
    now_us := ql_now_us();
    IF f.expires_at_us <= now_us THEN
        code := 'lease_expired';
        RETURN;
    END IF;
    IF NOT a.state = ANY(CASE p_target WHEN 'starting' THEN ARRAY['claimed']
                                       WHEN 'running' THEN ARRAY['starting']
                                       WHEN 'start_failed' THEN ARRAY['claimed', 'starting']
                                       ELSE ARRAY['starting', 'running'] END) THEN
        code := 'ack_out_of_order';
        RETURN;
    END IF;
    IF rank_of ? p_target THEN
        UPDATE attempts x SET state = p_target, started_at_us = coalesce(x.started_at_us, now_us),
            version = x.version + 1 WHERE x.attempt_id = p_attempt;
        UPDATE runs r SET state = p_target, version = r.version + 1, updated_at_us = now_us WHERE r.run_id = f.run_id;
        UPDATE run_leases l SET expires_at_us = greatest(l.expires_at_us, now_us + p_lease_ttl_us)
            WHERE l.attempt_id = p_attempt AND l.lease_generation = p_lease_generation;
        PERFORM ql_event(f.run_id, 'run.' || p_target, 'worker:' || p_worker,
                         jsonb_build_object('attemptId', p_attempt, 'leaseGeneration', p_lease_generation), now_us);
        code := 'applied';
        attempt_state := p_target;
        run_state := p_target;
        RETURN;
    END IF;
    UPDATE run_leases l SET state = 'completed', ended_at_us = now_us
        WHERE l.attempt_id = p_attempt AND l.lease_generation = p_lease_generation;
    SELECT * INTO e FROM ql_attempt_end(f.run_id, p_attempt, p_target, now_us, p_reason, p_exit_code, p_signal,
                                        p_bytes_kept, p_bytes_dropped, p_peak_rss_bytes, p_cpu_time_us);
    code := 'ended';
    attempt_no := e.attempt_no;
    worker_executor := e.worker_executor;
    cancel_requested := e.cancel_requested;
    task_id := e.task_id;
    max_attempts := e.max_attempts;
    backoff_ms := e.backoff_ms;
END $$;
