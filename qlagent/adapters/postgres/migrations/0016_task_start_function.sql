-- Task Start (ADR-0376 §2) as one function call inside the caller's SERIALIZABLE transaction:
-- one round trip instead of eleven, and its statements planned once per server session (the
-- replicas prepare nothing, so that a transaction-mode pooler works; PL/pgSQL keeps its plans).
-- Same order of decisions and same rows as adapters/rows/runs.py task_start (the local store's
-- path): Policy fence, definition fence, execution revision, idempotency by the unique
-- (project_id, idempotency_key) written with ON CONFLICT (the key is read only when that insert
-- finds it taken or an earlier step refuses), then the queued Run, its claimed Attempt and
-- run.created + run.queued with server IDs and the database's time. The outcome is returned,
-- never raised: the replica maps it to the same answers (adapters/postgres/runs.py).
-- Planned without sequential scans and with a 5 s lock wait, leaving the Pulls' NOTIFY to the
-- replica after the commit (0015), as the Python path's SET LOCALs did.

-- The persisted identity of the Run under (project, key), for an exact replay of the request
-- (task by ID or name, snapshot ref, subject, trigger); 'mutation_conflict' for any drift, NULL
-- outcome when the Project has no Run under the key.
CREATE FUNCTION ql_task_start_prior(
    p_project_id text, p_key text, p_task text, p_snapshot_ref text, p_subject text,
    OUT outcome text, OUT run_id text, OUT attempt_id text, OUT event_ids text[], OUT task_revision integer,
    OUT task_snapshot_ref text, OUT state text, OUT created_at_us bigint)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    prior record;
BEGIN
    SELECT r.*, t.name AS task_name INTO prior FROM runs r JOIN tasks t ON t.task_id = r.task_id
        WHERE r.project_id = p_project_id AND r.idempotency_key = p_key;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    IF p_task NOT IN (prior.task_id, prior.task_name) OR prior.task_snapshot_ref <> p_snapshot_ref
            OR prior.requested_by <> p_subject OR prior.trigger_type <> 'task_start' THEN
        outcome := 'mutation_conflict';
        RETURN;
    END IF;
    outcome := 'existing';
    run_id := prior.run_id;
    task_revision := prior.task_revision;
    task_snapshot_ref := prior.task_snapshot_ref;
    state := prior.state;
    created_at_us := prior.created_at_us;
    SELECT a.attempt_id INTO attempt_id FROM attempts a WHERE a.run_id = prior.run_id AND a.attempt_no = 1;
    event_ids := ARRAY(SELECT e.event_id FROM run_events e WHERE e.run_id = prior.run_id AND e.sequence <= 2
                       ORDER BY e.sequence);
END $$;

-- Outcomes: accepted, existing, task_not_found, project_changed / binding_changed (both
-- authorization_changed), definition_changed (with the head's revision and digest),
-- task_disabled, task_not_executable, mutation_conflict, execution_corrupt, key_unreadable.
-- p_project_version / p_binding_version: the admission's (NULL: not re-verified); p_now NULL:
-- the database clock; p_start_roles: the roles that grant run.start.
CREATE FUNCTION ql_task_start(
    p_project text, p_task text, p_subject text, p_mutation_id text, p_revision integer, p_digest text,
    p_project_version integer, p_binding_version integer, p_start_roles text[], p_executor text, p_now bigint,
    OUT outcome text, OUT run_id text, OUT attempt_id text, OUT event_ids text[], OUT task_revision integer,
    OUT task_snapshot_ref text, OUT state text, OUT created_at_us bigint, OUT head_revision integer,
    OUT head_digest text)
LANGUAGE plpgsql
SET enable_seqscan = off SET lock_timeout = 5000 SET qlagent.notify_after_commit = on
AS $$
#variable_conflict use_column
DECLARE
    proj record;
    binding record;
    head record;
    ex record;
    refused text;
    k text := 'ql3:task-start:v1:' || p_mutation_id;
    ref text := 'qltd:v1:' || p_revision || ':' || p_digest;
    now_us bigint := coalesce(p_now, ql_now_us());
    single boolean;
    new_run text := gen_random_uuid()::text;
    new_attempt text := gen_random_uuid()::text;
    e1 text := gen_random_uuid()::text;
    e2 text := gen_random_uuid()::text;
BEGIN
    -- 1. the active Project and its version, locked against change until the commit
    SELECT p.project_id, p.project_version, p.active INTO proj FROM projects p
        WHERE p.name = p_project OR p.project_id = p_project FOR SHARE;
    IF NOT FOUND THEN
        outcome := 'task_not_found';
        RETURN;
    END IF;
    IF NOT proj.active OR proj.project_version <> coalesce(p_project_version, proj.project_version) THEN
        outcome := 'project_changed';
        RETURN;
    END IF;
    -- 2. the subject's latest RoleBinding: active, a start role, the admitted version
    SELECT b.role, b.binding_version, b.active INTO binding FROM role_bindings b
        WHERE b.project_id = proj.project_id AND b.subject = p_subject ORDER BY b.binding_version DESC LIMIT 1;
    IF NOT FOUND OR NOT binding.active OR NOT binding.role = ANY(p_start_roles)
            OR binding.binding_version <> coalesce(p_binding_version, binding.binding_version) THEN
        outcome := 'binding_changed';
        RETURN;
    END IF;
    -- 4. the Task's head, locked (one Task's starts queue here, other Tasks' never)
    SELECT t.task_id, t.head_revision, t.enabled, r.content_digest, r.definition_json INTO head
        FROM tasks t JOIN task_revisions r ON r.task_id = t.task_id AND r.revision = t.head_revision
        WHERE t.project_id = proj.project_id AND (t.name = p_task OR t.task_id = p_task)
        AND t.deleted_at_us IS NULL FOR UPDATE OF t;
    IF NOT FOUND THEN
        refused := 'task_not_found';
    ELSIF head.head_revision <> p_revision OR head.content_digest <> p_digest THEN
        refused := 'definition_changed';
        head_revision := head.head_revision;
        head_digest := head.content_digest;
    ELSIF NOT head.enabled THEN
        refused := 'task_disabled';
    ELSE
        -- 5. its published execution revision, whose spec must hash to its digest
        SELECT x.kind, x.execution_digest, x.spec_json INTO ex FROM execution_revisions x
            WHERE x.task_id = head.task_id AND x.revision = head.head_revision;
        IF NOT FOUND THEN
            refused := 'task_not_executable';
        ELSIF ex.kind NOT IN ('local_process', 'shell')
                OR encode(sha256(convert_to(ex.spec_json, 'UTF8')), 'hex') <> ex.execution_digest THEN
            refused := 'execution_corrupt';
        END IF;
    END IF;
    IF refused IS NOT NULL THEN
        -- 3. decided first: a Run already under the key is an exact replay or a conflict
        SELECT * INTO outcome, run_id, attempt_id, event_ids, task_revision, task_snapshot_ref, state,
            created_at_us FROM ql_task_start_prior(proj.project_id, k, p_task, ref, p_subject);
        outcome := coalesce(outcome, refused);
        RETURN;
    END IF;
    -- 6. the queued Run (held while its single-instance Task is occupied: read through an index
    -- no queued Run enters), its claimed Attempt and its first two events
    single := (head.definition_json::json ->> 'concurrency') = 'single';
    INSERT INTO runs(run_id, project_id, task_id, task_revision, task_snapshot_ref, state, priority,
        execution_origin, execution_owner, trigger_type, idempotency_key, requested_by, version, event_sequence,
        latest_attempt_id, latest_attempt_created_at_us, created_at_us, updated_at_us, single_instance, held)
    VALUES (new_run, proj.project_id, head.task_id, p_revision, ref, 'queued', 0, 'manual', 'runtime',
        'task_start', k, p_subject, 2, 2, new_attempt, now_us, now_us, now_us, single,
        single AND EXISTS (SELECT 1 FROM runs o WHERE o.task_id = head.task_id
                           AND o.state IN ('dispatching', 'starting', 'running')))
    ON CONFLICT (project_id, idempotency_key) DO NOTHING;
    IF NOT FOUND THEN
        SELECT * INTO outcome, run_id, attempt_id, event_ids, task_revision, task_snapshot_ref, state,
            created_at_us FROM ql_task_start_prior(proj.project_id, k, p_task, ref, p_subject);
        -- the insert met a key this snapshot cannot read: no serial order holds
        outcome := coalesce(outcome, 'key_unreadable');
        RETURN;
    END IF;
    INSERT INTO attempts(attempt_id, run_id, attempt_no, state, executor_type, created_at_us)
        VALUES (new_attempt, new_run, 1, 'claimed', p_executor, now_us);
    INSERT INTO run_events(run_id, sequence, event_id, type, actor, payload_json, created_at_us) VALUES
        (new_run, 1, e1, 'run.created', p_subject,
         jsonb_build_object('taskSnapshotRef', ref, 'contentDigest', p_digest,
                            'executionDigest', ex.execution_digest, 'trigger', 'task_start',
                            'mutationId', p_mutation_id, 'projectVersion', proj.project_version,
                            'bindingVersion', binding.binding_version), now_us),
        (new_run, 2, e2, 'run.queued', p_subject,
         jsonb_build_object('attemptId', new_attempt, 'executorType', p_executor), now_us);
    outcome := 'accepted';
    run_id := new_run;
    attempt_id := new_attempt;
    event_ids := ARRAY[e1, e2];
    task_revision := p_revision;
    task_snapshot_ref := ref;
    state := 'queued';
    created_at_us := now_us;
END $$;

-- After a Task Start's commit, in the same round trip: wake the long-polling Pulls (the channel
-- of ql_notify_candidate) when the Project has a queued Run under the key that is not held, as
-- the trigger would have for it (0015 moved that NOTIFY out of the transaction).
CREATE FUNCTION ql_wake_for_key(p_project text, p_key text) RETURNS void LANGUAGE plpgsql AS $$
BEGIN
    IF EXISTS (SELECT 1 FROM runs r JOIN projects p ON p.project_id = r.project_id
               WHERE (p.name = p_project OR p.project_id = p_project) AND r.idempotency_key = p_key
               AND r.state = 'queued' AND NOT r.held) THEN
        PERFORM pg_notify('qlagent_candidates', '');
    END IF;
END $$;
