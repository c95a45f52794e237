-- ADR-0071 §2 migration 0006-capability-v3: written only after the DDL above is durable history.
CREATE TABLE IF NOT EXISTS capabilities (
    name            TEXT PRIMARY KEY,
    version         INTEGER NOT NULL,
    declared_by     INTEGER NOT NULL
);
INSERT INTO capabilities(name, version, declared_by) VALUES ('local-control-core', 3, 4);
INSERT INTO capabilities(name, version, declared_by) VALUES ('local_dispatch_plan', 1, 4);
