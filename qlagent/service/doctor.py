"""``qlagent doctor``: trusted paths, schema history, capability, integrity, key file, free
space (the artifact directory's, and the state directory's: ``config.state_space_problem``), dirs, network. Before ``init`` it reports only what is missing (no ``ok`` line among
them). With ``[cluster]``: the database's reachability, schema, capability and Secrets, and the
key file. With ``[worker]`` (a fleet Worker has no local store): trusted paths, state dir,
credential and CA files, each control-plane URL (TLS + ``/healthz``) and whether it knows the
credential (read only: the running Worker's Session is not touched), inbox, log store and free
space (``bootstrap.worker_checks``)."""

from __future__ import annotations

import os
import stat

from .. import bootstrap
from ..core.errors import QlError
from ..core.limits import PRIVATE_DIR_MODE, RUN_INODES, STATE_DIR_MODE, STATE_MIN_FREE_BYTES
from ..core.profiles import fs_reserve
from ..core.settings import Settings
from . import lock
from .config import state_space_problem
from .trust import check as check_trust
from .trust import trusted_paths, worker_paths

MiB = 1_048_576


def run_checks(s: Settings) -> list[dict]:
    """Each check: ``{"name", "ok", "detail"}``. Never raises for what it inspects.

    Untrusted paths (service.trust) are listed first, one ``trust`` line each; the database is
    then not opened. Before ``init`` only the missing database and key file are listed."""
    out: list[dict] = []

    def add(name: str, ok: bool, detail: str) -> None:
        out.append({"name": name, "ok": ok, "detail": detail})

    if s.config.worker is not None:
        return _worker_checks(s, add, out)
    untrusted = check_trust(trusted_paths(s))
    for _, text in untrusted:
        add("trust", False, text)
    if s.config.cluster is not None:      # the authority is the cluster's database, not a file
        for name, ok, detail in bootstrap.cluster_store_checks(s):
            add(name, ok, detail)
        problem = bootstrap.key_file_problem(s.key_file)
        add("key file", problem is None, problem or f"{s.key_file} (0600, 32 bytes)")
        _expiry_checks(s, add)
        return out
    if not os.path.exists(s.db_path):
        add("database", False, f"{s.db_path} does not exist (run `qlagent init`)")
        problem = bootstrap.key_file_problem(s.key_file)
        if problem:
            add("key file", False, problem)
        return out
    if untrusted:           # a database another user may have written is not opened
        return out
    add("trust", True, f"config, state dir, database, key file, artifacts and runs dirs owned by uid "
                       f"{os.geteuid()}" + (" or root" if os.geteuid() else "") + ", none group/world-writable")
    try:
        for name, ok, detail in bootstrap.store_checks(s.db_path):
            add(name, ok, detail)
    except QlError as e:        # e.g. a full file system: the checks below say why
        add("database", False, str(e))
    problem = bootstrap.key_file_problem(s.key_file)
    add("key file", problem is None, problem or f"{s.key_file} (0600, 32 bytes)")
    probe = s.artifact_dir if os.path.exists(s.artifact_dir) else s.state_dir
    try:
        v = os.statvfs(probe)
        free = v.f_bavail * v.f_frsize
        need = fs_reserve(s.profile, v.f_blocks * v.f_frsize) + s.profile.log_max_bytes
        # f_files 0: the file system has no inode table to run out of (btrfs, some FUSE).
        inodes_ok = v.f_files == 0 or v.f_favail >= RUN_INODES
        add("free space", free >= need and inodes_ok,
            f"{free} bytes free on {probe}; the {s.profile.name} profile needs {need} (reserve + one log); "
            + (f"{v.f_favail} inodes free" if v.f_files else "no inode limit")
            + ("" if inodes_ok else f", a Run needs {RUN_INODES}"))
    except OSError as e:
        add("free space", False, f"{probe}: {e.strerror}")
    # The database's own file system: full, the store takes no writes and no Run starts.
    problem = state_space_problem(s.state_dir)
    add("state free space", problem is None, problem or f"{s.state_dir}: at least {STATE_MIN_FREE_BYTES} bytes free")
    for name, path, most in (("state dir", s.state_dir, STATE_DIR_MODE),
                             ("artifact dir", s.artifact_dir, PRIVATE_DIR_MODE)):
        try:
            add(name, *_dir_mode(path, most))
        except FileNotFoundError:
            add(name, name == "artifact dir", f"{path} not created yet")
    add("budget", *bootstrap.budget_check(s.profile, lock.held(s.state_dir)))
    add("network", *bootstrap.network_check())
    return out


def _dir_mode(path: str, most: int) -> tuple[bool, str]:
    """(ok, detail) for a directory whose mode may have no bit outside ``most`` (core.limits);
    raises FileNotFoundError."""
    st = os.lstat(path)
    mode = stat.S_IMODE(st.st_mode)
    ok = stat.S_ISDIR(st.st_mode) and not (mode & ~most)
    return ok, f"{path} mode {mode:04o}" + ("" if ok else f"; expected a directory of mode {most:04o} or stricter")


def _expiry_checks(s: Settings, add) -> None:
    """One ``certificate`` line per certificate the role relies on (``bootstrap.certificate_expiries``),
    failing from 30 days before its end (``core.certexpiry``)."""
    import time

    from ..core.certexpiry import expiry_note
    for field, path, end in bootstrap.certificate_expiries(s):
        good, detail = expiry_note(end, int(time.time()))
        add("certificate", good, f"{field} {path} {detail}" + ("" if good else "; renew it (`qlagent tls cert create`)"))


def _worker_checks(s: Settings, add, out: list[dict]) -> list[dict]:
    """A fleet Worker's checks (module docstring); nothing is created or written."""
    untrusted = check_trust(worker_paths(s))
    for _, text in untrusted:
        add("trust", False, text)
    if not untrusted:
        add("trust", True, "config, state dir, credential and CA files, inbox and run dirs owned by uid "
                           f"{os.geteuid()}" + (" or root" if os.geteuid() else "") + ", none group/world-writable")
    try:
        add("state dir", *_dir_mode(s.state_dir, STATE_DIR_MODE))
    except FileNotFoundError:
        add("state dir", False, f"{s.state_dir} does not exist (run `qlagent init`)")
    for name, ok, detail in bootstrap.worker_checks(s):
        add(name, ok, detail)
    _expiry_checks(s, add)
    w = s.config.worker
    logs = w.log_store_bytes or s.profile.artifact_total_bytes
    need = logs + s.profile.inbox_bytes
    probe = s.state_dir if os.path.isdir(s.state_dir) else os.path.dirname(os.path.abspath(s.state_dir))
    try:
        v = os.statvfs(probe)
        free = v.f_bavail * v.f_frsize
        add("free space", free >= need, f"{free // MiB} MiB free on {probe}; the Worker may write {need // MiB} MiB "
                                         f"(log store {logs // MiB} MiB + inbox {s.profile.inbox_bytes // MiB} MiB)")
    except OSError as e:
        add("free space", False, f"{probe}: {e.strerror}")
    return out
