"""``qlagent doctor``: trusted paths, schema history, capability, integrity, key file, free
space, dirs. Before ``init`` it reports only what is missing (no ``ok`` line among them)."""

from __future__ import annotations

import os
import stat

from ..adapters.secretbox import check_key_file
from ..adapters.sqlite import migrations
from ..adapters.sqlite.authority import SqliteAuthority
from ..adapters.sqlite.secrets import secret_uses
from ..adapters.trust import check as check_trust
from ..adapters.trust import trusted_paths
from ..core.errors import QlError
from .config import Settings

MiB = 1_048_576


def run_checks(s: Settings) -> list[dict]:
    """Each check: ``{"name", "ok", "detail"}``. Never raises for what it inspects.

    Untrusted paths (adapters.trust) are listed first, one ``trust`` line each; the database is
    then not opened. Before ``init`` only the missing database and key file are listed."""
    out: list[dict] = []

    def add(name: str, ok: bool, detail: str) -> None:
        out.append({"name": name, "ok": ok, "detail": detail})

    untrusted = check_trust(trusted_paths(s))
    for _, text in untrusted:
        add("trust", False, text)
    if not os.path.exists(s.db_path):
        add("database", False, f"{s.db_path} does not exist (run `qlagent init`)")
        problem = check_key_file(s.key_file)
        if problem:
            add("key file", False, problem)
        return out
    if untrusted:           # a database another user may have written is not opened
        return out
    add("trust", True, f"config, state dir, database, key file, artifacts and runs dirs owned by uid "
                       f"{os.geteuid()}" + (" or root" if os.geteuid() else "") + ", none group/world-writable")
    _store_checks(s, add)
    problem = check_key_file(s.key_file)
    add("key file", problem is None, problem or f"{s.key_file} (0600, 32 bytes)")
    probe = s.artifact_dir if os.path.exists(s.artifact_dir) else s.state_dir
    try:
        v = os.statvfs(probe)
        free = v.f_bavail * v.f_frsize
        need = s.profile.fs_reserve_bytes + s.profile.log_max_bytes
        add("free space", free >= need, f"{free // MiB} MiB free on {probe}; the {s.profile.name} profile needs "
                                         f"{need // MiB} MiB (reserve + one log)")
    except OSError as e:
        add("free space", False, f"{probe}: {e.strerror}")
    for name, path in (("state dir", s.state_dir), ("artifact dir", s.artifact_dir)):
        try:
            st = os.lstat(path)
            ok = stat.S_ISDIR(st.st_mode) and not (st.st_mode & 0o077)
            add(name, ok, f"{path} mode {oct(st.st_mode & 0o777)}" + ("" if ok else "; expected a 0700 directory"))
        except FileNotFoundError:
            add(name, name == "artifact dir", f"{path} not created yet")
    return out


def _store_checks(s: Settings, add) -> None:
    auth = SqliteAuthority(s.db_path)
    try:
        try:
            pending = auth.raw(lambda c: migrations.verify_history(c, migrations.known_migrations()))
            add("schema", not pending, "up to date" if not pending else
                f"{len(pending)} migration(s) pending: {', '.join(f'{m.version:04d}_{m.name}' for m in pending)}")
        except QlError as e:
            add("schema", False, str(e))
        try:
            caps = auth.read(migrations.check_capabilities)
            add("capability", True, ", ".join(f"{k}:{v}" for k, v in sorted(caps.items())))
        except QlError as e:
            add("capability", False, str(e))
        res = auth.read(lambda c: [r[0] for r in c.execute("PRAGMA integrity_check")])
        add("integrity", res == ["ok"], "; ".join(res[:5]))
        missing = [(t, n) for t, n, stored in auth.read(lambda c: secret_uses(c, None)) if not stored]
        for task, name in missing:
            add("secrets", False, f"task {task} uses secret {name!r}, which is not set "
                                  f"(`qlagent secret set {name}`); its runs fail secret_missing:{name}")
        if not missing:
            add("secrets", True, "every secret a task uses is set")
    finally:
        auth.close()
