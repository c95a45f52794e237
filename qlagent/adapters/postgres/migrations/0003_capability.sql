-- Capabilities are declared only after the DDL they depend on is durable history (ADR-0071 §2).
CREATE TABLE capabilities (
    name            text PRIMARY KEY,
    version         integer NOT NULL,
    declared_by     integer NOT NULL
);
INSERT INTO capabilities(name, version, declared_by) VALUES ('cluster-control-core', 1, 3);
