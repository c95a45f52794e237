"""Files the agent trusts: refuse a state file another user could have written (issue 12 §3).

The agent runs its database's ``@boot`` Tasks, decrypts with its key file and follows its
config file. If another local user can replace or rewrite any of them, they choose what the
agent (often root) runs. So each of these paths must be owned by the agent's effective uid or
by root (root can already act as any user; a root agent so accepts root-owned only) and must
not be group- or world-writable: the state directory,
the database and its ``-wal``/``-shm`` files, the secret key file, the artifacts and runs
directories, the config file and a control-plane replica's TLS certificate and key (the key,
a secret, must moreover be readable by its owner alone); nor may a directory or symlink on the way to them be another
user's or writable by others (without the sticky bit). A path that does not exist yet is not a problem (``init``
and the service create them private). Pure ``stat`` checks: nothing is created or changed.
"""

from __future__ import annotations

import os
import stat
from typing import TYPE_CHECKING, NamedTuple

from ..core.errors import UnavailableError

if TYPE_CHECKING:
    from ..core.settings import Settings


class UntrustedPathError(UnavailableError):
    """A trusted path is group/world-writable or owned by another uid (exit 5); ``field`` is
    the path's role (``state dir``, ``database``, ``key file`` …); the message names the path,
    the owner and mode found, and the ``chmod``/``chown`` that fixes it."""

    code = "untrusted_path"


class TrustedPath(NamedTuple):
    """One path the agent trusts: its role (shown to the operator), absolute path, and whether
    it holds a secret nobody else may read (``private``)."""

    role: str
    path: str
    private: bool = False


def trusted_paths(settings: Settings) -> list[TrustedPath]:
    """Every path of ``settings`` (``core.settings.Settings``) the agent trusts, in check order."""
    out = []
    if settings.config_path:
        out.append(TrustedPath("config file", settings.config_path))
    out += [TrustedPath("state dir", settings.state_dir), TrustedPath("database", settings.db_path),
            TrustedPath("database wal", settings.db_path + "-wal"),
            TrustedPath("database shm", settings.db_path + "-shm"),
            TrustedPath("key file", settings.key_file), TrustedPath("artifacts dir", settings.artifact_dir),
            TrustedPath("runs dir", settings.runs_dir)]
    cluster = settings.config.cluster
    if cluster is not None and cluster.tls_cert and cluster.tls_key:
        out += [TrustedPath("cluster.tls_cert", cluster.tls_cert),
                TrustedPath("cluster.tls_key", cluster.tls_key, private=True)]
    return out


def worker_paths(settings: Settings) -> list[TrustedPath]:
    """The paths a fleet Worker (``[worker]``) trusts, for ``doctor``: the config file, the state
    directory, the credential and CA files, the inbox (and its ``-wal``/``-shm``) and the run
    directories."""
    w = settings.config.worker
    inbox = os.path.join(settings.state_dir, "inbox.sqlite3")
    out = [TrustedPath("config file", settings.config_path)] if settings.config_path else []
    out += [TrustedPath("state dir", settings.state_dir), TrustedPath("credential file", w.credential_file)]
    if w.ca_file:
        out.append(TrustedPath("ca file", w.ca_file))
    out += [TrustedPath("inbox", inbox), TrustedPath("inbox wal", inbox + "-wal"),
            TrustedPath("inbox shm", inbox + "-shm"),
            TrustedPath("worker runs dir", os.path.join(settings.state_dir, "worker-runs"))]
    return out


def problem(role: str, path: str, euid: int | None = None, private: bool = False) -> str | None:
    """One line naming ``path``, what is wrong (owner uid / mode found) and the fix, or None.
    ``private``: any group or world permission is wrong too (fix ``chmod 600``).

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
    if private and mode & 0o077:
        who = " and ".join(w for bit, w in ((0o070, "group"), (0o007, "world")) if mode & bit)
        wrong.append(f"mode {mode:04o} gives {who} access to a private key")
        fixes.append(f"chmod 600 {path}")
    elif mode & 0o022:
        who = " and ".join(w for bit, w in ((0o020, "group"), (0o002, "world")) if mode & bit)
        wrong.append(f"mode {mode:04o} is {who}-writable")
        fixes.append(f"chmod go-w {path}")
    if not wrong:
        return None
    why = "another user could read it or replace what the agent serves" if private \
        else "another user could replace what the agent runs"
    return f"untrusted {role} {path}: {'; '.join(wrong)} ({why}); fix: {' && '.join(fixes)}"


def ancestry_problem(role: str, path: str, euid: int | None = None) -> tuple[str, str] | None:
    """(component, one line) for the first component on the way to an existing ``path`` that
    another user could change, or None: a symlink not owned by ``euid`` or root (its owner can
    point it elsewhere between the check and the open), or a parent directory owned by another
    uid, or group/world-writable without the sticky bit (its writers could rename ``path`` away
    and put their own in its place; /tmp's sticky bit keeps them to their own entries). Both
    the path as given and its resolved form are walked up to ``/``."""
    euid = os.geteuid() if euid is None else euid
    if not os.path.lexists(path):
        return None
    seen = set()
    for start in (os.path.abspath(path), os.path.realpath(path)):
        p = start
        while p not in seen:
            seen.add(p)
            try:
                st = os.lstat(p)
            except OSError:
                st = None
            found = None
            if st is None:
                pass
            elif stat.S_ISLNK(st.st_mode):
                if st.st_uid not in (euid, 0):
                    found = (f"symlink {p} is owned by uid {st.st_uid}, not the agent's uid {euid}"
                             + (" or root" if euid else ""), f"chown -h {euid} {p}")
            elif p != start and stat.S_ISDIR(st.st_mode):
                mode = stat.S_IMODE(st.st_mode)
                if st.st_uid not in (euid, 0):
                    found = (f"directory {p} is owned by uid {st.st_uid}, not the agent's uid {euid}"
                             + (" or root" if euid else ""), f"chown {euid} {p}")
                elif mode & 0o022 and not mode & stat.S_ISVTX:
                    who = " and ".join(w for bit, w in ((0o020, "group"), (0o002, "world")) if mode & bit)
                    found = (f"directory {p} mode {mode:04o} is {who}-writable without the sticky bit",
                             f"chmod go-w {p}")
            if found:
                return p, (f"untrusted {role} {path}: {found[0]} (another user could replace what the agent "
                           f"runs); fix: {found[1]}")
            parent = os.path.dirname(p)
            if parent == p:
                break
            p = parent
    return None


def check(paths: list[TrustedPath], euid: int | None = None) -> list[tuple[TrustedPath, str]]:
    """The problems of ``paths``, in order: (path, one-line problem); an unsafe parent directory
    or symlink is reported once (for the first path under it), and not at all when it is itself
    a reported path."""
    out = []
    reported = set()
    for tp in paths:
        p = problem(tp.role, tp.path, euid, private=tp.private)
        if p:
            out.append((tp, p))
            reported.update((os.path.abspath(tp.path), os.path.realpath(tp.path)))
            continue
        a = ancestry_problem(tp.role, tp.path, euid)
        if a and a[0] not in reported:
            reported.add(a[0])
            out.append((tp, a[1]))
    return out


def require_trusted(paths: list[TrustedPath], euid: int | None = None) -> None:
    """Raise UntrustedPathError for the first untrusted path of ``paths`` as the agent running
    with ``euid`` (default: this process's) would see them; nothing is changed."""
    found = check(paths, euid)
    if found:
        tp, text = found[0]
        raise UntrustedPathError(text, field=tp.role)
