"""Opening the local store: migrations, capability readiness, the default Project."""

from __future__ import annotations

import time

from ..adapters.sqlite import migrations, policy
from ..adapters.sqlite.authority import SqliteAuthority
from ..core.models import Project


def now_us() -> int:
    """Wall-clock time in µs since the Unix epoch."""
    return time.time_ns() // 1000


class LocalStore:
    """The migrated, capability-checked SQLite authority plus the active Project.

    Raises StoreIntegrityError for an unknown/altered migration history and UnavailableError
    if the file cannot be opened or a required capability is missing.
    """

    def __init__(self, db_path: str, project: str = "default", *, migrate: bool = True) -> None:
        self.authority = SqliteAuthority(db_path)
        try:
            if migrate:
                self.applied = self.authority.raw(migrations.migrate)
            else:
                self.applied = []
                self.authority.raw(lambda c: migrations.verify_history(c, migrations.known_migrations()))
            self.capabilities = self.authority.read(migrations.check_capabilities)
            self.project: Project = self.authority.write(lambda c: policy.ensure_project(c, project, now_us()))
        except BaseException:
            self.authority.close()
            raise

    def read(self, fn):
        return self.authority.read(fn)

    def write(self, fn):
        return self.authority.write(fn)

    def close(self) -> None:
        self.authority.close()
