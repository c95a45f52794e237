-- One row the service rewrites to learn whether the store takes writes again after a full or
-- failing file system (service.main: a full state file system is a condition, not a crash).
CREATE TABLE store_probe (
    id            INTEGER PRIMARY KEY CHECK (id = 1),
    written_at_us INTEGER NOT NULL
);
