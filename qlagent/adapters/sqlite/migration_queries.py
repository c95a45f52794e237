"""The SQLite migration runner's statements (``adapters.sqlite.migrations``), by name: its
history table and the capabilities it checks, run on both SQLite files (the store and the
Worker's inbox), so a module of their own: the inbox loads none of the store's statements."""

MIGRATIONS_TABLE_CREATE = """CREATE TABLE IF NOT EXISTS schema_migrations (
        version INTEGER PRIMARY KEY, name TEXT NOT NULL, checksum TEXT NOT NULL,
        applied_at_us INTEGER NOT NULL)"""
MIGRATIONS_APPLIED = "SELECT version, name, checksum FROM schema_migrations ORDER BY version"
MIGRATION_RECORD = "INSERT INTO schema_migrations(version, name, checksum, applied_at_us) VALUES (?, ?, ?, ?)"
CAPABILITIES = "SELECT name, version FROM capabilities"
# One migration file and its history row, one transaction (``executescript`` takes no parameters:
# the file's version, name and SHA-256 checksum and the time in µs are formatted in).
MIGRATION_APPLY = ("BEGIN IMMEDIATE;\n{sql}\n;INSERT INTO schema_migrations(version, name, checksum, applied_at_us) "
                   "VALUES ({version}, '{name}', '{checksum}', {applied_at_us});\nCOMMIT;")
