-- An API request's authentication in one call (rows/policy.py admission): the Project named by
-- the path (by name or ID), the live token with this digest and its subject's latest
-- RoleBinding in the token's Project, each NULL when absent. One round trip instead of three
-- transactions, its statements planned once per server session. Always one row.
CREATE FUNCTION ql_admission(
    p_name text, p_project_id text, p_token_digest text,
    OUT project_id text, OUT name text, OUT project_version integer, OUT active boolean,
    OUT token_project text, OUT subject text, OUT role text, OUT binding_version integer,
    OUT binding_active boolean)
LANGUAGE plpgsql STABLE AS $$
DECLARE
    tok record;
BEGIN
    SELECT p.project_id, p.name, p.project_version, p.active INTO project_id, name, project_version, active
        FROM projects p WHERE p.name = p_name OR p.project_id = p_project_id;
    SELECT t.project_id, t.subject INTO tok FROM api_tokens t
        WHERE t.token_digest = p_token_digest AND t.revoked_at_us IS NULL;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    token_project := tok.project_id;
    subject := tok.subject;
    SELECT b.role, b.binding_version, b.active INTO role, binding_version, binding_active FROM role_bindings b
        WHERE b.project_id = tok.project_id AND b.subject = tok.subject ORDER BY b.binding_version DESC LIMIT 1;
END $$;
