-- Projects, policy, task definitions (ADR-0071 §2, ADR-0376 §2). Times are integer µs since the Unix epoch.
CREATE TABLE projects (
    project_id      TEXT PRIMARY KEY,
    name            TEXT NOT NULL UNIQUE,
    project_version INTEGER NOT NULL DEFAULT 1,
    active          INTEGER NOT NULL DEFAULT 1,
    created_at_us   INTEGER NOT NULL
);

CREATE TABLE role_bindings (
    binding_id      TEXT PRIMARY KEY,
    project_id      TEXT NOT NULL REFERENCES projects(project_id),
    subject         TEXT NOT NULL,
    role            TEXT NOT NULL CHECK (role IN ('owner','admin','operator','viewer')),
    binding_version INTEGER NOT NULL CHECK (binding_version >= 1),
    active          INTEGER NOT NULL DEFAULT 1,
    created_at_us   INTEGER NOT NULL,
    UNIQUE (project_id, subject, binding_version)
);

CREATE TABLE api_tokens (
    token_digest    TEXT PRIMARY KEY,            -- SHA-256 hex of the bearer token; the token itself is never stored
    token_id        TEXT NOT NULL UNIQUE,
    project_id      TEXT NOT NULL REFERENCES projects(project_id),
    subject         TEXT NOT NULL,
    created_at_us   INTEGER NOT NULL,
    revoked_at_us   INTEGER
);

-- The Task row is the TaskDefinition head: it points at the current revision.
CREATE TABLE tasks (
    task_id         TEXT PRIMARY KEY,
    project_id      TEXT NOT NULL REFERENCES projects(project_id),
    name            TEXT NOT NULL,
    head_revision   INTEGER NOT NULL CHECK (head_revision BETWEEN 1 AND 2147483647),
    enabled         INTEGER NOT NULL DEFAULT 1,
    skipped_fires   INTEGER NOT NULL DEFAULT 0,
    created_at_us   INTEGER NOT NULL,
    updated_at_us   INTEGER NOT NULL,
    deleted_at_us   INTEGER
);
-- A name is unique among live tasks of a project; a removed task frees its name.
CREATE UNIQUE INDEX tasks_live_name ON tasks(project_id, name) WHERE deleted_at_us IS NULL;

-- Append-only definition history; the canonical JSON is what contentDigest hashes.
CREATE TABLE task_revisions (
    task_id         TEXT NOT NULL REFERENCES tasks(task_id),
    revision        INTEGER NOT NULL CHECK (revision BETWEEN 1 AND 2147483647),
    content_digest  TEXT NOT NULL CHECK (length(content_digest) = 64),
    definition_json TEXT NOT NULL,
    created_at_us   INTEGER NOT NULL,
    PRIMARY KEY (task_id, revision)
);
