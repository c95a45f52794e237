"""The single SQLite authority: one connection, owned by one thread, fed by one operation queue.

Every read and write of the local store goes through ``SqliteAuthority.read``/``write``; callers
on any thread submit a function and block until the owner thread has run it (ADR-0071 §3, "唯一
SQLite authority / operation queue"). Mutations run inside ``BEGIN IMMEDIATE`` so that a
writer takes the lock before it reads the facts it fences on; WAL lets readers in other
processes (the CLI) proceed meanwhile. ``synchronous = FULL``: in WAL mode each COMMIT
fsyncs the WAL, so a write has reached stable storage when ``write`` returns — before a 202 or
a CLI's answer is sent, before a claimed Attempt's task is spawned (a power cut lost
acknowledged Runs under NORMAL, which syncs only at checkpoints; cost in bench/README.md).

Driver errors stop here: SQLite's "database is locked"/"busy" (another process held the lock
past the busy timeout) becomes ``UnavailableError(code="store_busy")`` and an I/O, full-disk,
read-only or corrupt file ``UnavailableError(code="store_unavailable")``; nothing above the
adapter inspects ``sqlite3`` exceptions.
"""

from __future__ import annotations

import os
import queue
import sqlite3
import threading
from collections.abc import Callable
from typing import TypeVar

from ...core.errors import UnavailableError

T = TypeVar("T")

BUSY_TIMEOUT_MS = 5_000          # default wait for another process's write lock (config busy_timeout_s)
# OperationalError texts that mean the file, not the statement, is the problem.
_UNAVAILABLE = ("disk i/o error", "database or disk is full", "readonly database", "unable to open",
                "disk image is malformed", "file is not a database")


def domain_error(e: sqlite3.Error) -> BaseException:
    """The core error for a driver error, or ``e`` itself when it is a programming error."""
    msg = str(e).lower()
    if isinstance(e, sqlite3.OperationalError) and ("locked" in msg or "busy" in msg):
        return UnavailableError(f"store is busy ({e}); retry later", code="store_busy")
    if isinstance(e, (sqlite3.OperationalError, sqlite3.DatabaseError)) and any(t in msg for t in _UNAVAILABLE):
        return UnavailableError(f"store is unavailable ({e})", code="store_unavailable")
    return e


class _Op:
    __slots__ = ("fn", "write", "done", "result", "error")

    def __init__(self, fn, write: bool) -> None:
        self.fn = fn
        self.write = write
        self.done = threading.Event()
        self.result = None
        self.error: BaseException | None = None


class SqliteAuthority:
    """Owns ``path`` (created 0600 if missing, parent 0700). Thread-safe facade.

    ``read(fn)``/``write(fn)`` run ``fn(conn)`` on the owner thread and return its result or
    re-raise its exception in the caller. ``write`` commits on success and rolls back on any
    exception, so a refused mutation writes nothing.
    """

    def __init__(self, path: str, busy_timeout_ms: int = BUSY_TIMEOUT_MS) -> None:
        self.path = path
        self.busy_timeout_ms = busy_timeout_ms
        parent = os.path.dirname(os.path.abspath(path))
        os.makedirs(parent, mode=0o700, exist_ok=True)
        if not os.path.exists(path):
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW, 0o600))
        self._ops: queue.SimpleQueue[_Op | None] = queue.SimpleQueue()
        self._ready = threading.Event()
        self._open_error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="sqlite-authority", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._open_error is not None:
            raise UnavailableError(f"cannot open store {path}: {self._open_error}")

    def _run(self) -> None:
        try:
            conn = sqlite3.connect(self.path, isolation_level=None, check_same_thread=True)
            conn.row_factory = sqlite3.Row
            conn.execute(f"PRAGMA busy_timeout = {int(self.busy_timeout_ms)}")
            conn.execute("PRAGMA journal_mode = WAL")
            conn.execute("PRAGMA foreign_keys = ON")
            conn.execute("PRAGMA synchronous = FULL")
        except BaseException as e:  # reported to the constructor's caller
            self._open_error = e
            self._ready.set()
            return
        self._ready.set()
        while True:
            op = self._ops.get()
            if op is None:
                break
            try:
                if op.write:
                    conn.execute("BEGIN IMMEDIATE")
                    try:
                        op.result = op.fn(conn)
                        conn.execute("COMMIT")
                    except BaseException:
                        conn.execute("ROLLBACK")
                        raise
                else:
                    op.result = op.fn(conn)
            except BaseException as e:
                op.error = e
            op.done.set()
        conn.close()

    def _submit(self, fn: Callable[[sqlite3.Connection], T], write: bool) -> T:
        if threading.current_thread() is self._thread:
            raise RuntimeError("nested store operation from the authority thread")
        if not self._thread.is_alive():
            raise UnavailableError("store is closed")
        op = _Op(fn, write)
        self._ops.put(op)
        op.done.wait()
        if op.error is not None:
            if isinstance(op.error, sqlite3.Error):
                err = domain_error(op.error)
                if err is not op.error:
                    raise err from None
            raise op.error
        return op.result

    def read(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        """Run ``fn(conn)`` on the owner thread outside a transaction; return its result."""
        return self._submit(fn, write=False)

    def write(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        """Run ``fn(conn)`` inside BEGIN IMMEDIATE … COMMIT (ROLLBACK on error); on return the
        commit is on stable storage (the WAL fsync'd)."""
        return self._submit(fn, write=True)

    def raw(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        """Run ``fn(conn)`` with no transaction handling (migrations manage their own)."""
        return self._submit(fn, write=False)

    def close(self) -> None:
        """Finish queued operations, then close the connection and stop the thread."""
        if self._thread.is_alive():
            self._ops.put(None)
            self._thread.join()
