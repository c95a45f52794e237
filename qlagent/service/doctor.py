"""``qlagent doctor``: schema history, capability, integrity, key file, free space, dirs."""

from __future__ import annotations

import os
import stat

from .. import bootstrap
from .config import Settings

MiB = 1_048_576


def run_checks(s: Settings) -> list[dict]:
    """Each check: ``{"name", "ok", "detail"}``. Never raises for what it inspects."""
    out: list[dict] = []

    def add(name: str, ok: bool, detail: str) -> None:
        out.append({"name": name, "ok": ok, "detail": detail})

    if not os.path.exists(s.db_path):
        add("database", False, f"{s.db_path} does not exist (run `qlagent init`)")
    else:
        for name, ok, detail in bootstrap.store_checks(s.db_path):
            add(name, ok, detail)
    problem = bootstrap.key_file_problem(s.key_file)
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
