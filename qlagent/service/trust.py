"""Files the agent trusts: refuse a state file another user could have written (issue 12 §3).

The agent runs its database's ``@boot`` Tasks, decrypts with its key file and follows its
config file. If another local user can replace or rewrite any of them, they choose what the
agent (often root) runs. So each of these paths must be owned by the agent's effective uid or
by root (root can already act as any user; a root agent so accepts root-owned only) and must
not be group- or world-writable: the state directory,
the database and its ``-wal``/``-shm`` files, the secret key file, the artifacts and runs
directories and the config file. A path that does not exist yet is not a problem (``init``
and the service create them private). Pure ``stat`` checks: nothing is created or changed.
"""

from __future__ import annotations

import os
import stat
from typing import NamedTuple

from ..core.errors import UnavailableError


class UntrustedPathError(UnavailableError):
    """A trusted path is group/world-writable or owned by another uid (exit 5); ``field`` is
    the path's role (``state dir``, ``database``, ``key file`` …); the message names the path,
    the owner and mode found, and the ``chmod``/``chown`` that fixes it."""

    code = "untrusted_path"


class TrustedPath(NamedTuple):
    """One path the agent trusts: its role (shown to the operator) and absolute path."""

    role: str
    path: str


def trusted_paths(settings) -> list[TrustedPath]:
    """Every path of ``settings`` (a service.config.Settings) the agent trusts, in check order."""
    out = []
    if settings.config_path:
        out.append(TrustedPath("config file", settings.config_path))
    out += [TrustedPath("state dir", settings.state_dir), TrustedPath("database", settings.db_path),
            TrustedPath("database wal", settings.db_path + "-wal"),
            TrustedPath("database shm", settings.db_path + "-shm"),
            TrustedPath("key file", settings.key_file), TrustedPath("artifacts dir", settings.artifact_dir),
            TrustedPath("runs dir", settings.runs_dir)]
    return out


def problem(role: str, path: str, euid: int | None = None) -> str | None:
    """One line naming ``path``, what is wrong (owner uid / mode found) and the fix, or None.

    The check follows a symlink (what SQLite or open() would use); a missing path is None.
    """
    euid = os.geteuid() if euid is None else euid
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    except OSError as e:
        return f"{role} {path}: cannot stat ({e.strerror})"
    if stat.S_ISCHR(st.st_mode) and (os.major(st.st_rdev), os.minor(st.st_rdev)) == (1, 3):
        return None     # /dev/null (``QLAGENT_CONFIG=/dev/null``: no config): writes to it change nothing
    mode = stat.S_IMODE(st.st_mode)
    wrong = []
    fixes = []
    if st.st_uid not in (euid, 0):
        wrong.append(f"owned by uid {st.st_uid}, not the agent's uid {euid}" + (" or root" if euid else ""))
        fixes.append(f"chown {euid} {path}")
    if mode & 0o022:
        who = " and ".join(w for bit, w in ((0o020, "group"), (0o002, "world")) if mode & bit)
        wrong.append(f"mode {mode:04o} is {who}-writable")
        fixes.append(f"chmod go-w {path}")
    if not wrong:
        return None
    return f"untrusted {role} {path}: {'; '.join(wrong)} (another user could replace what the agent runs); " \
           f"fix: {' && '.join(fixes)}"


def check(paths: list[TrustedPath]) -> list[tuple[TrustedPath, str]]:
    """The problems of ``paths``, in order: (path, one-line problem)."""
    out = []
    for tp in paths:
        p = problem(tp.role, tp.path)
        if p:
            out.append((tp, p))
    return out


def require_trusted(paths: list[TrustedPath]) -> None:
    """Raise UntrustedPathError for the first untrusted path of ``paths``; nothing is changed."""
    found = check(paths)
    if found:
        tp, text = found[0]
        raise UntrustedPathError(text, field=tp.role)
