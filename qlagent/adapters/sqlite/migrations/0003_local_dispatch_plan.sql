-- ADR-0071 §2 migration 0005-local-dispatch-plan: the two immutable definition tables.
CREATE TABLE execution_revisions (
    task_id         TEXT NOT NULL REFERENCES tasks(task_id),
    revision        INTEGER NOT NULL CHECK (revision BETWEEN 1 AND 2147483647),
    kind            TEXT NOT NULL CHECK (kind IN ('local_process','shell')),
    execution_digest TEXT NOT NULL CHECK (length(execution_digest) = 64),
    spec_json       TEXT NOT NULL,                   -- argv/shell/script/cwd + context recipe ref; never secret values
    recipe_ref      TEXT NOT NULL REFERENCES context_recipes(recipe_ref),
    published_at_us INTEGER NOT NULL,
    PRIMARY KEY (task_id, revision)
);
CREATE TRIGGER execution_revisions_immutable BEFORE UPDATE ON execution_revisions
BEGIN SELECT RAISE(ABORT, 'execution revisions are append-only'); END;

CREATE TABLE context_recipes (
    recipe_ref      TEXT PRIMARY KEY,                -- localctx:sha256:<digest>
    recipe_json     TEXT NOT NULL,                   -- public values and SecretRef names, never secret values
    created_at_us   INTEGER NOT NULL
);
CREATE TRIGGER context_recipes_immutable BEFORE UPDATE ON context_recipes
BEGIN SELECT RAISE(ABORT, 'context recipes are append-only'); END;

CREATE TABLE secrets (
    project_id      TEXT NOT NULL REFERENCES projects(project_id),
    name            TEXT NOT NULL,
    ciphertext      BLOB NOT NULL,                   -- AES-256-GCM; key lives in a 0600 file outside the database
    key_id          TEXT NOT NULL,
    updated_at_us   INTEGER NOT NULL,
    PRIMARY KEY (project_id, name)
);
