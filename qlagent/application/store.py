"""Opening the local store: migrations, capability readiness, the default Project."""

from __future__ import annotations

import time

from ..adapters.sqlite import migrations, policy
from ..adapters.sqlite.authority import SqliteAuthority
from ..core.errors import UnavailableError
from ..core.models import Project


def now_us() -> int:
    """Wall-clock time in µs since the Unix epoch."""
    return time.time_ns() // 1000


class LocalStore:
    """The migrated, capability-checked SQLite authority plus the active Project.

    Only the service (and ``init``) migrate (``migrate=True``); other CLI commands open with
    ``migrate=False`` and refuse a store whose schema is behind, so a newer CLI never changes
    the schema under an older running service.

    Raises StoreIntegrityError for an unknown/altered migration history and UnavailableError
    if the file cannot be opened or a required capability is missing.
    """

    def __init__(self, db_path: str, project: str = "default", *, migrate: bool = True,
                 create_project: bool = True) -> None:
        self.authority = SqliteAuthority(db_path)
        try:
            if migrate:
                self.applied = self.authority.raw(migrations.migrate)
            else:
                self.applied = []
                pending = self.authority.raw(lambda c: migrations.verify_history(c, migrations.known_migrations()))
                if pending:
                    raise UnavailableError(
                        f"the store at {db_path} needs {len(pending)} migration(s) from this qlagent; "
                        "restart the service (it migrates at start) or run `qlagent init`",
                        code="store_not_migrated")
            self.capabilities = self.authority.read(migrations.check_capabilities)
            if create_project:
                self.project: Project = self.authority.write(lambda c: policy.ensure_project(c, project, now_us()))
            else:       # a read must not write: an unknown (or mistyped) Project is an error
                self.project = self.authority.read(lambda c: policy.get_project(c, project))
        except BaseException:
            self.authority.close()
            raise

    def read(self, fn):
        return self.authority.read(fn)

    def write(self, fn):
        return self.authority.write(fn)

    def close(self) -> None:
        self.authority.close()
