"""Reading a qinglong 2.x data directory, strictly read-only (issue 15).

The 2.x database is never opened in a way that could change it or its directory:
- under an OFD read lock on SQLite's own lock bytes (the SHARED range, taken the way SQLite
  takes SHARED: PENDING first), so a 2.x writer cannot write the file while we read it, and a
  writer holding the file (EXCLUSIVE/PENDING) makes us wait up to LOCK_WAIT_S, then refuse
  (UnavailableError ``source_locked``). OFD locks, unlike POSIX locks, survive SQLite closing
  its own descriptor of the same file in this process;
- without ``-wal``/``-journal`` beside it: opened ``mode=ro&immutable=1`` (SQLite then creates
  no ``-wal``/``-shm`` and takes no lock; a plain ``mode=ro`` open of a WAL database creates
  both);
- with a non-empty ``-wal`` or ``-journal`` (a live panel, or one that crashed), or on a file
  system without OFD locks: the file and its side files are copied into a private 0700
  temporary directory, the copy is opened (SQLite replays the WAL / rolls back the journal
  there) and removed; a copy during which any of them changed (inode, size, mtime) is retried,
  COPY_TRIES times, then refused (``source_busy``).
Returns the plain facts of ``core.qinglong``; nothing here decides what is imported.
"""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
import sqlite3
import stat
import struct
import tempfile
import time
import urllib.parse

from ..core import limits as L
from ..core.errors import UnavailableError, ValidationError
from ..core.qinglong import (BASH, INTERPRETERS, MAX_CONFIG_BYTES, MAX_CRONS, QlConfig, QlCron, QlEnv, QlPanel,
                             Toolset, parse_config_sh)

HEADER = b"SQLite format 3\x00"
# SQLite's lock bytes (os_unix.c): PENDING at 1 GiB, RESERVED after it, then the SHARED range.
PENDING_BYTE = 0x4000_0000
SHARED_FIRST = PENDING_BYTE + 2
SHARED_SIZE = 510
LOCK_WAIT_S = 2.0
"""How long a 2.x writer holding the database may keep us waiting (s)."""
COPY_TRIES = 3
MAX_ENV_ROWS = 10_000
"""Most ``Envs`` rows read."""


def _utf8_path(path: str, field: str) -> str:
    # Task cwd/command and the report are UTF-8 text; argv keeps other bytes as surrogates.
    try:
        path.encode("utf-8")
    except UnicodeEncodeError:
        raise ValidationError(field, f"{os.fsencode(path)!r} is not valid UTF-8; rename it") from None
    return path


def locate(path: str, scripts_dir: str | None) -> tuple[str, str | None, str, str | None]:
    """Resolve (database, data dir or None, scripts dir, config.sh or None), all absolute.

    ``path`` is a 2.x data directory (holding ``db/database.sqlite``) or the database file.
    Raises ValidationError (``PATH``, ``scripts-dir``) for a missing or non-2.x path, a path
    that is not UTF-8 and a scripts dir that is missing or not readable and searchable by this
    process.
    """
    p = _utf8_path(os.path.abspath(path), "PATH")
    if os.path.isdir(p):
        db, data_dir = os.path.join(p, "db", "database.sqlite"), p
        if not os.path.isfile(db):
            older = os.path.exists(os.path.join(p, "db", "crontab.db"))
            raise ValidationError("PATH", f"{p} is not a qinglong 2.x data directory: no db/database.sqlite"
                                  + ("; its db/crontab.db is the NeDB store of an older 2.x: upgrade the panel "
                                     "once, then import" if older else ""))
    elif os.path.isfile(p):
        db = p
        parent = os.path.dirname(p)
        data_dir = os.path.dirname(parent) if os.path.basename(parent) == "db" else None
    elif os.path.exists(p):
        raise ValidationError("PATH", f"{p} is not a regular file or a directory")
    else:
        raise ValidationError("PATH", f"{p} does not exist")
    if scripts_dir is not None:
        scripts = os.path.abspath(scripts_dir)
    elif data_dir is not None:
        scripts = os.path.join(data_dir, "scripts")
    else:
        raise ValidationError("scripts-dir", f"{db} is not inside a data directory (…/db/database.sqlite); "
                              "give --scripts-dir")
    _utf8_path(scripts, "scripts-dir")
    if not os.path.isdir(scripts):
        raise ValidationError("scripts-dir", f"{scripts} is not a directory")
    if not os.access(scripts, os.R_OK | os.X_OK):
        raise ValidationError("scripts-dir", f"{scripts} is not readable by uid {os.geteuid()}")
    config = os.path.join(data_dir, "config", "config.sh") if data_dir else None
    return db, data_dir, scripts, (config if config and os.path.lexists(config) else None)


def read_config(path: str | None) -> QlConfig:
    """Parse config.sh (at most MAX_CONFIG_BYTES); QlConfig() when there is none."""
    if path is None:
        return QlConfig()
    try:
        # O_NONBLOCK: a FIFO in its place must not hang the import waiting for a writer.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        raise ValidationError("config.sh", f"{path} cannot be read: {e.strerror}") from None
    with open(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValidationError("config.sh", f"{path} is not a regular file")
        try:
            data = f.read(MAX_CONFIG_BYTES + 1)
        except OSError as e:
            raise ValidationError("config.sh", f"{path} cannot be read: {e.strerror}") from None
    if len(data) > MAX_CONFIG_BYTES:
        raise ValidationError("config.sh", f"{path} is longer than {MAX_CONFIG_BYTES} bytes", limit=MAX_CONFIG_BYTES)
    return parse_config_sh(data)


def _setlk(fd: int, kind: int, start: int, length: int) -> None:
    # struct flock: l_type, l_whence, l_start, l_len, l_pid (0 for OFD locks), native layout.
    fcntl.fcntl(fd, fcntl.F_OFD_SETLK, struct.pack("hhqqi", kind, os.SEEK_SET, start, length, 0))


def _shared_lock(fd: int, db: str) -> bool:
    """Hold SQLite's SHARED lock (as an OFD lock); False where the file system has no such
    locks (some network file systems): the caller then reads a verified private copy."""
    deadline = time.monotonic() + LOCK_WAIT_S
    while True:
        try:
            _setlk(fd, fcntl.F_RDLCK, PENDING_BYTE, 1)
            try:
                _setlk(fd, fcntl.F_RDLCK, SHARED_FIRST, SHARED_SIZE)
            finally:
                _setlk(fd, fcntl.F_UNLCK, PENDING_BYTE, 1)
            return True
        except OSError as e:
            if e.errno in (errno.EINVAL, errno.ENOLCK, errno.EOPNOTSUPP):
                return False
            if e.errno not in (errno.EAGAIN, errno.EACCES):
                raise UnavailableError(f"{db} cannot be locked for reading: {e.strerror}", code="source_locked",
                                       field="database") from None
        if time.monotonic() >= deadline:
            raise UnavailableError(f"{db} is locked by another process (the 2.x panel is writing); stop the panel "
                                   f"or retry (waited {LOCK_WAIT_S:g} s)", code="source_locked", field="database")
        time.sleep(0.05)


def _stats(paths: list[str]) -> list[tuple | None]:
    out = []
    for p in paths:
        try:
            st = os.stat(p)
            out.append((st.st_ino, st.st_size, st.st_mtime_ns))
        except FileNotFoundError:
            out.append(None)
    return out


def _text(b: bytes) -> str:
    return b.decode("utf-8", "surrogateescape")


def _cell(v) -> str | None:
    # SQLite keeps any type in any column: a BLOB or number where 2.x stores text is read as text.
    if isinstance(v, bytes):
        return _text(v)
    return v if v is None or isinstance(v, str) else str(v)


def _row_id(v, table: str) -> int:
    if not isinstance(v, int):
        raise ValidationError(table, f"a row's id is {type(v).__name__}, not an integer: not a qinglong 2.x table")
    return v


def _display(s: str | None) -> str:
    # Names are only shown and slugged: a stray non-UTF-8 byte (a GBK name typed into the
    # sqlite3 shell) becomes U+FFFD instead of breaking the report's UTF-8 output.
    return (s or "").encode("utf-8", "surrogateescape").decode("utf-8", "replace")


def _query(conn: sqlite3.Connection, db: str) -> tuple[tuple[QlCron, ...], tuple[QlEnv, ...]]:
    def columns(table: str) -> set[str]:
        return {r[1] for r in conn.execute(f'PRAGMA table_info("{table}")')}

    cron_cols = columns("Crontabs")
    if not {"id", "name", "command", "schedule"} <= cron_cols:
        raise ValidationError("database", f"{db} has no Crontabs table with id, name, command, schedule: "
                              "not a qinglong 2.x database")

    def col(name: str, cols: set[str]) -> str:
        return f'"{name}"' if name in cols else "NULL"

    crons = []
    for r in conn.execute(
            f'SELECT id, name, command, schedule, {col("isDisabled", cron_cols)}, {col("labels", cron_cols)}, '
            f'{col("extra_schedules", cron_cols)}, {col("task_before", cron_cols)}, '
            f'{col("task_after", cron_cols)}, {col("isSystem", cron_cols)} FROM Crontabs ORDER BY id '
            f'LIMIT {MAX_CRONS + 1}'):
        crons.append(QlCron(id=_row_id(r[0], "Crontabs"), name=_display(_cell(r[1])), command=_cell(r[2]) or "",
                            schedule=_cell(r[3]) or "", is_disabled=bool(r[4]), labels_json=_cell(r[5]),
                            extra_schedules_json=_cell(r[6]), task_before=_cell(r[7]), task_after=_cell(r[8]),
                            is_system=bool(r[9])))
    if len(crons) > MAX_CRONS:
        raise ValidationError("Crontabs", f"more than {MAX_CRONS} crons", limit=MAX_CRONS)
    env_cols = columns("Envs")
    envs = []
    if {"id", "name", "value"} <= env_cols:
        for r in conn.execute(
                f'SELECT id, name, CAST(value AS BLOB), {col("status", env_cols)}, {col("position", env_cols)}, '
                f'{col("createdAt", env_cols)} FROM Envs WHERE name IS NOT NULL ORDER BY id '
                f'LIMIT {MAX_ENV_ROWS + 1}'):
            envs.append(QlEnv(id=_row_id(r[0], "Envs"), name=_display(_cell(r[1])), value=r[2] or b"", enabled=not r[3],
                              position=float(r[4]) if isinstance(r[4], (int, float)) else None,
                              created_at=str(r[5]) if r[5] is not None else None))
        if len(envs) > MAX_ENV_ROWS:
            raise ValidationError("Envs", f"more than {MAX_ENV_ROWS} rows", limit=MAX_ENV_ROWS)
    return tuple(crons), tuple(envs)


def _open_and_query(uri: str, db: str):
    try:
        conn = sqlite3.connect(uri, uri=True, isolation_level=None, check_same_thread=False)
    except sqlite3.Error as e:
        raise ValidationError("database", f"{db} cannot be opened: {e}") from None
    conn.text_factory = _text
    try:
        return _query(conn, db)
    except sqlite3.OperationalError as e:
        if "locked" in str(e) or "busy" in str(e):
            raise UnavailableError(f"{db} is locked: {e}", code="source_locked", field="database") from None
        raise ValidationError("database", f"{db} cannot be read: {e} (corrupt?)") from None
    except sqlite3.DatabaseError as e:
        raise ValidationError("database", f"{db} cannot be read: {e} (corrupt?)") from None
    finally:
        conn.close()


def read_database(db: str) -> tuple[tuple[QlCron, ...], tuple[QlEnv, ...]]:
    """Crontabs and Envs of a 2.x database, never changing it (see the module docstring).

    Raises ValidationError(``database``) for a file that is not a readable SQLite database of
    2.x, UnavailableError (``source_locked``, ``source_busy``) while a 2.x writer holds it.
    """
    try:
        fd = os.open(db, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as e:
        raise ValidationError("database", f"{db} cannot be opened: {e.strerror}") from None
    try:
        if os.pread(fd, len(HEADER), 0) != HEADER:
            raise ValidationError("database", f"{db} is not a SQLite database")
        locked = _shared_lock(fd, db)
        sides = [db + "-wal", db + "-journal"]
        if locked and not any(s and s[1] > 0 for s in _stats(sides)):
            return _open_and_query(f"file:{urllib.parse.quote(db)}?mode=ro&immutable=1", db)
        tmp = tempfile.mkdtemp(prefix="qlagent-qinglong-")
        try:
            copy = os.path.join(tmp, "database.sqlite")
            for _ in range(COPY_TRIES):
                before = _stats([db, *sides])
                shutil.copyfile(db, copy)
                for side, suffix in zip(sides, ("-wal", "-journal")):
                    if os.path.exists(side):
                        shutil.copyfile(side, copy + suffix)
                if _stats([db, *sides]) == before:
                    return _open_and_query(f"file:{urllib.parse.quote(copy)}", db)
                for name in os.listdir(tmp):
                    os.unlink(os.path.join(tmp, name))
            raise UnavailableError(f"{db} kept changing while it was read (the 2.x panel is writing); stop the "
                                   "panel and retry", code="source_busy", field="database")
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    finally:
        os.close(fd)                  # releases the OFD lock


def read_panel(path: str, scripts_dir: str | None = None) -> QlPanel:
    """Everything an import needs from a 2.x data directory (see ``locate``, ``read_database``)."""
    db, _, scripts, config = locate(path, scripts_dir)
    conf = read_config(config)
    crons, envs = read_database(db)
    return QlPanel(database=db, scripts_dir=scripts, crons=crons, envs=envs, config=conf)


def readable_files(paths: frozenset[str]) -> frozenset[str]:
    """Those of ``paths`` that are regular files this process can read."""
    return frozenset(p for p in paths if os.path.isfile(p) and os.access(p, os.R_OK))


def find_tools() -> Toolset:
    """Interpreters on the PATH every Task gets (``limits.DEFAULT_PATH``), and ``/bin/bash``."""
    found = {}
    for name in sorted(set(INTERPRETERS.values())):
        p = shutil.which(name, path=L.DEFAULT_PATH)
        if p:
            found[name] = os.path.abspath(p)
    return Toolset(interpreters=found, bash_shell=os.access(BASH, os.X_OK))


class QinglongPanel:
    """``core.ports.PanelSource``: a 2.x data directory read through the functions above."""

    def read_panel(self, path: str, scripts_dir: str | None) -> QlPanel:
        return read_panel(path, scripts_dir)

    def readable_files(self, paths: frozenset[str]) -> frozenset[str]:
        return readable_files(paths)

    def find_tools(self) -> Toolset:
        return find_tools()
