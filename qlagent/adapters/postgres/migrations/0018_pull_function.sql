-- A Worker Pull's usual case as one function call (cluster/pull.py "quick claim"): the Session
-- authenticated and locked with its active Leases counted, then the first candidate (keyset
-- order, Runs other Pulls hold skipped, only that one Run locked) and, when the replica has
-- already prepared, sanitised and placed a plan of that candidate's (Task, revision, Project,
-- executor) for this Session (p_claimable: 'task:revision:project:executor' keys), its claim:
-- the same Attempt compare-and-set, Run move, RunEvent and Lease as queries.LEASE_CLAIM, with
-- the single-instance Task row lock before it and the holds after it. One statement: its
-- statements planned once per server session. Anything else (a Session not current or
-- expired, this pullId seen before, a candidate not prepared yet, a claim refused) answers
-- 'walk' having written nothing, and the replica runs the whole ADR-0014 walk instead.
-- Outcomes: leased (the candidate's columns, the new lease generation, now, expiry), no_offer
-- (reason draining / no_free_slot / NULL: no candidate; held: candidates other Pulls hold,
-- asked when p_waiting), walk.
-- rows/runs.py set_holds on the cluster: a Task's queued single-instance Runs held while a Run
-- occupies it (leased, starting or running), released when none does; rows another transaction
-- has locked are skipped, never waited for (queries.RUNS_HOLD).
CREATE FUNCTION ql_set_holds(p_task text) RETURNS void LANGUAGE plpgsql AS $$
DECLARE
    live boolean := EXISTS (SELECT 1 FROM runs o WHERE o.task_id = p_task
                            AND o.state IN ('dispatching', 'starting', 'running'));
BEGIN
    UPDATE runs y SET held = live WHERE y.run_id IN (
        SELECT q.run_id FROM runs q WHERE q.task_id = p_task AND q.state = 'queued' AND q.single_instance
        AND q.held = NOT live FOR NO KEY UPDATE SKIP LOCKED);
END $$;

CREATE FUNCTION ql_pull(
    p_worker text, p_credential text, p_session text, p_generation bigint, p_pull text, p_token_digest text,
    p_lease_ttl_us bigint, p_claimable text[], p_waiting boolean,
    OUT outcome text, OUT reason text, OUT held boolean, OUT run_id text, OUT attempt_id text, OUT project_id text,
    OUT task_id text, OUT task_revision integer, OUT worker_executor text, OUT version integer,
    OUT priority integer, OUT created_at_us bigint, OUT attempt_created_at_us bigint, OUT lease_generation bigint,
    OUT single_instance boolean, OUT new_lease_generation bigint, OUT now_us bigint, OUT expires_at_us bigint)
LANGUAGE plpgsql AS $$
DECLARE
    s record;
    c record;
BEGIN
    SELECT ws.slots, ws.state, ws.expires_at_us, ws.generation, w.generation AS worker_generation,
           w.state AS worker_state, w.projects, ql_now_us() AS now,
           (SELECT count(*) FROM run_leases l WHERE l.session_id = ws.session_id AND l.state = 'active') AS used,
           EXISTS (SELECT 1 FROM run_leases p WHERE p.session_id = ws.session_id AND p.pull_id = p_pull) AS prior
        INTO s
        FROM workers w JOIN worker_sessions ws ON ws.session_id = p_session AND ws.worker_id = w.worker_id
        WHERE w.worker_id = p_worker AND w.credential_digest = p_credential AND w.state <> 'removed'
        FOR NO KEY UPDATE OF ws;
    outcome := 'walk';
    IF NOT FOUND OR s.generation <> p_generation OR s.worker_generation <> p_generation OR s.state <> 'open'
            OR s.expires_at_us <= s.now OR s.prior THEN
        RETURN;
    END IF;
    now_us := s.now;
    IF s.worker_state = 'draining' OR s.used >= s.slots THEN
        outcome := 'no_offer';
        reason := CASE WHEN s.worker_state = 'draining' THEN 'draining' ELSE 'no_free_slot' END;
        RETURN;
    END IF;
    SELECT r.run_id, a.attempt_id, r.project_id, r.task_id, r.task_revision, a.worker_executor, r.version,
           r.priority, r.created_at_us, r.latest_attempt_created_at_us, a.lease_generation, r.single_instance
        INTO c
        FROM runs r JOIN attempts a ON a.attempt_id = r.latest_attempt_id
        WHERE r.state = 'queued' AND r.cancel_requested_at_us IS NULL AND NOT r.held AND a.state = 'claimed'
          AND a.executor_type = 'remote_worker' AND (a.not_before_us IS NULL OR a.not_before_us <= s.now)
          AND (cardinality(s.projects) = 0 OR r.project_id = ANY(s.projects))
        ORDER BY (-r.priority), r.created_at_us, r.latest_attempt_created_at_us, r.latest_attempt_id
        LIMIT 1 FOR NO KEY UPDATE OF r SKIP LOCKED;
    IF NOT FOUND THEN
        outcome := 'no_offer';
        -- every visible candidate is held by another Pull now (this one's read skipped them)
        held := p_waiting AND EXISTS (
            SELECT 1 FROM runs r JOIN attempts a ON a.attempt_id = r.latest_attempt_id
            WHERE r.state = 'queued' AND r.cancel_requested_at_us IS NULL AND NOT r.held AND a.state = 'claimed'
              AND a.executor_type = 'remote_worker' AND (a.not_before_us IS NULL OR a.not_before_us <= s.now)
              AND (cardinality(s.projects) = 0 OR r.project_id = ANY(s.projects)));
        RETURN;
    END IF;
    IF NOT (c.task_id || ':' || c.task_revision || ':' || c.project_id || ':' || c.worker_executor) = ANY(p_claimable) THEN
        RETURN;
    END IF;
    IF c.single_instance THEN
        -- claimers of one Task queue here; the guard below reads after that wait
        PERFORM 1 FROM tasks t WHERE t.task_id = c.task_id FOR NO KEY UPDATE;
    END IF;
    WITH a AS (UPDATE attempts x SET lease_generation = x.lease_generation + 1, worker_id = p_worker,
                   version = x.version + 1
               WHERE x.attempt_id = c.attempt_id AND x.state = 'claimed' AND x.lease_generation = c.lease_generation
                 AND EXISTS (SELECT 1 FROM runs y WHERE y.run_id = c.run_id AND y.version = c.version
                             AND y.state = 'queued' AND y.cancel_requested_at_us IS NULL
                             AND y.latest_attempt_id = c.attempt_id)
                 AND NOT EXISTS (SELECT 1 FROM run_leases l WHERE l.attempt_id = c.attempt_id AND l.state = 'active')
                 AND NOT (c.single_instance AND EXISTS (
                     SELECT 1 FROM runs o WHERE o.task_id = c.task_id AND o.run_id <> c.run_id
                     AND o.state IN ('dispatching', 'starting', 'running')))
               RETURNING x.lease_generation),
         r AS (UPDATE runs y SET state = 'dispatching', version = y.version + 1, event_sequence = y.event_sequence + 1,
                   updated_at_us = s.now
               WHERE y.run_id = c.run_id AND EXISTS (SELECT 1 FROM a) RETURNING y.event_sequence),
         e AS (INSERT INTO run_events(run_id, sequence, event_id, type, actor, payload_json, created_at_us)
               SELECT c.run_id, r.event_sequence, gen_random_uuid()::text, 'run.dispatching', 'control-plane',
                   jsonb_build_object('attemptId', c.attempt_id, 'workerId', p_worker, 'sessionId', p_session,
                                      'generation', p_generation, 'leaseGeneration', c.lease_generation + 1),
                   s.now FROM r)
    INSERT INTO run_leases(attempt_id, lease_generation, run_id, worker_id, session_id, worker_generation,
        token_digest, pull_id, state, claimed_at_us, expires_at_us)
        SELECT c.attempt_id, a.lease_generation, c.run_id, p_worker, p_session, p_generation, p_token_digest,
            p_pull, 'active', s.now, s.now + p_lease_ttl_us FROM a
        RETURNING run_leases.lease_generation INTO new_lease_generation;
    IF new_lease_generation IS NULL THEN
        RETURN;             -- refused: the walk tries it again, holds the Task's Runs and answers for it
    END IF;
    IF c.single_instance THEN
        PERFORM ql_set_holds(c.task_id);        -- claimed: the Task's other queued Runs wait
    END IF;
    outcome := 'leased';
    run_id := c.run_id;
    attempt_id := c.attempt_id;
    project_id := c.project_id;
    task_id := c.task_id;
    task_revision := c.task_revision;
    worker_executor := c.worker_executor;
    version := c.version;
    priority := c.priority;
    created_at_us := c.created_at_us;
    attempt_created_at_us := c.latest_attempt_created_at_us;
    lease_generation := c.lease_generation;
    single_instance := c.single_instance;
    expires_at_us := s.now + p_lease_ttl_us;
END $$;
