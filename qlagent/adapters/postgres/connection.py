"""Connections to the cluster authority (psycopg 3, imported only when a connection is made).

``check_url`` accepts libpq URLs ``postgresql://`` / ``postgres://`` including multi-host lists
(``postgresql://a:5432,b:5432/db?target_session_attrs=read-write``): failover is libpq's, the
control plane only insists on a read-write session when more than one host is named.
``open_pool`` returns a bounded psycopg_pool ConnectionPool; ``transaction`` runs one unit of
work, retrying a bounded number of times on serialization failures and deadlocks.

Transaction-mode poolers (PgBouncer ``pool_mode = transaction``) are supported: nothing here
prepares statements (``prepare_threshold=None``: psycopg would prepare after 5 executions, and
the next transaction on another server backend would find ``_pg3_0`` there already or missing),
and no lock outlives its transaction (migrations and Run creation lock per transaction).

Waiting for a pooled connection: a request waits at most ``POOL_WAIT_S``; code running under
``bounded_wait(s)`` (the control-plane loop's own duties, which share a thread with HTTP)
waits at most ``s``. While the database is unreachable the pool retries a connection with
psycopg_pool's doubling back-off but gives up after ``RECONNECT_S``, so the next caller starts a
fresh attempt and a returning database is used within seconds, not after a back-off grown
during a long outage.

Bounded waits (issue 21 §2): besides the pool wait, every unit of work (``transaction``,
``read``, ``PgStore``'s) holds its connection at most ``UNIT_DEADLINE_S``, then the socket is cut
(a frozen or unreachable server never hangs a request); each pooled session has a
``statement_timeout``, ``lock_timeout`` and ``idle_in_transaction_session_timeout``, and every
connection TCP keepalives and ``tcp_user_timeout``.
"""

from __future__ import annotations

import os
import re
import socket
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager
from contextvars import ContextVar
from typing import TYPE_CHECKING
from urllib.parse import parse_qs, urlsplit

from ...core.errors import UnavailableError, ValidationError

if TYPE_CHECKING:   # annotations only: psycopg loads where a connection is opened
    from psycopg import Connection
    from psycopg_pool import ConnectionPool

_SCHEMES = ("postgresql", "postgres")
_SESSION_ATTRS = ("any", "read-write", "primary", "read-only", "standby", "prefer-standby")
_HOST = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]*)(:\d{1,5})?$")
MAX_URL_BYTES = 4096
MAX_POOL = 64
TX_RETRIES = 5
POOL_WAIT_S = 5.0            # longest wait for a pooled connection by default (s): then 503 + Retry-After
RECONNECT_S = 2.0            # the pool's reconnect attempts give up after this (s); the next caller retries
UNIT_DEADLINE_S = 10.0       # longest one unit of work may hold its connection (s): then it is cut
# Server-side bounds of every pooled session (ms): a statement, a lock wait, an open transaction idle.
SESSION_TIMEOUTS_MS = {"statement_timeout": 10_000, "lock_timeout": 10_000,
                       "idle_in_transaction_session_timeout": 10_000}
# libpq: a peer that stops answering (a cut link, a dead host) is noticed within ~10 s.
TCP_KWARGS = {"keepalives": 1, "keepalives_idle": 5, "keepalives_interval": 2, "keepalives_count": 3,
              "tcp_user_timeout": 10_000}
_NEVER = float("inf")      # a deadline thread with nothing armed looks again only when woken
_WAIT: ContextVar[float] = ContextVar("qlagent_pool_wait", default=POOL_WAIT_S)
# libpq's fallback_application_name of this process's sessions (an application_name in the URL
# wins): pg_stat_activity, and so ``qlagent status``, tells a replica from a CLI.
_APPLICATION = {"fallback_application_name": "qlagent"}
REPLICA_APPLICATION = "qlagent replica "


def name_sessions(replica: str) -> None:
    """Sessions opened from now on by this process show as ``qlagent replica REPLICA`` (e.g.
    ``HOST/PID``, ≤ 63 bytes kept by PostgreSQL) in ``pg_stat_activity.application_name``."""
    _APPLICATION["fallback_application_name"] = REPLICA_APPLICATION + replica


@contextmanager
def bounded_wait(seconds: float):
    """Within the block (this thread/context only), ``transaction`` and ``read`` wait at most
    ``seconds`` for a pooled connection, then raise UnavailableError."""
    token = _WAIT.set(seconds)
    try:
        yield
    finally:
        _WAIT.reset(token)


def pool_wait() -> float:
    """Seconds the current context waits for a pooled connection (``bounded_wait``)."""
    return _WAIT.get()


def check_url(url: str, field: str = "cluster.database") -> str:
    """Validate a libpq URL; return it unchanged. Raises ValidationError naming ``field``.

    Rules: scheme postgresql/postgres, ≤ 4096 bytes, each host ``name[:port]`` (port 1..65535),
    ``target_session_attrs`` one of libpq's values and ``read-write`` (or ``primary``) when the
    URL names several hosts, so a replica never becomes the authority after a failover.
    """
    if not isinstance(url, str) or not url or len(url.encode()) > MAX_URL_BYTES:
        raise ValidationError(field, "must be a postgresql:// URL", limit=MAX_URL_BYTES)
    parts = urlsplit(url)
    if parts.scheme not in _SCHEMES:
        raise ValidationError(field, f"scheme {parts.scheme!r} is not postgresql:// or postgres://")
    hostlist = parts.netloc.rpartition("@")[2]
    hosts = hostlist.split(",") if hostlist else []
    for h in hosts:
        m = _HOST.match(h)
        if not m or (m.group(2) and not 1 <= int(m.group(2)[1:]) <= 65535):
            raise ValidationError(field, f"host {h!r} is not name[:port] with port 1..65535")
    query = parse_qs(parts.query, keep_blank_values=True)
    attrs = query.get("target_session_attrs", [None])[-1]
    if attrs is not None and attrs not in _SESSION_ATTRS:
        raise ValidationError(f"{field}.target_session_attrs", f"{attrs!r} is not one of {list(_SESSION_ATTRS)}")
    if len(hosts) > 1 and attrs not in ("read-write", "primary"):
        raise ValidationError(f"{field}.target_session_attrs",
                              "several hosts need target_session_attrs=read-write (the authority is the primary)")
    return url


def connect(url: str, *, autocommit: bool = False):
    """One psycopg connection (loads psycopg). Raises UnavailableError when unreachable."""
    import psycopg
    try:
        return psycopg.connect(check_url(url), autocommit=autocommit, connect_timeout=10, prepare_threshold=None,
                               **TCP_KWARGS, **_APPLICATION)
    except psycopg.OperationalError as e:
        raise UnavailableError(f"cluster database unreachable: {str(e).splitlines()[0]}") from None


def open_pool(url: str, size: int = 4) -> ConnectionPool:
    """A bounded pool of 1..``size`` connections (``size`` ≤ 64); loads psycopg_pool."""
    if not 1 <= size <= MAX_POOL:
        raise ValidationError("cluster.pool_size", f"{size} outside 1..{MAX_POOL}", limit=MAX_POOL)
    from psycopg_pool import ConnectionPool
    pool = ConnectionPool(check_url(url), min_size=1, max_size=size, open=False, timeout=POOL_WAIT_S,
                          reconnect_timeout=RECONNECT_S, configure=_configure,
                          kwargs={"connect_timeout": 10, "prepare_threshold": None, **TCP_KWARGS, **_APPLICATION})
    try:
        pool.open(wait=True, timeout=10)
    except Exception as e:
        pool.close()
        raise UnavailableError(f"cluster database unreachable: {str(e).splitlines()[0]}") from None
    return pool


def _configure(conn: Connection) -> None:
    """Every pooled session gets the server-side bounds (``SESSION_TIMEOUTS_MS``). Behind a
    transaction-mode pooler they stay on the server backend for the next client: the same values."""
    conn.execute("; ".join(f"SET {k} = {v}" for k, v in SESSION_TIMEOUTS_MS.items()))
    conn.commit()


class _Watchdog:
    """One thread cutting the socket of a connection whose unit of work outlived its deadline.
    A frozen server (SIGSTOP) or a silent network never answers, its kernel may even keep
    acknowledging, and libpq has no timeout of its own: shutting the socket down makes the
    blocked call fail at once (OperationalError), and the pool then drops the connection."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._armed: dict[int, tuple[float, object]] = {}
        self._next = 0
        self._thread: threading.Thread | None = None
        self._wake_at = _NEVER        # when the thread looks next (monotonic s)

    def arm(self, conn: Connection, seconds: float) -> int:
        with self._cond:
            self._next += 1
            due = time.monotonic() + seconds
            self._armed[self._next] = (due, conn)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="qlagent-db-deadline", daemon=True)
                self._thread.start()
            elif due < self._wake_at:
                # Only a deadline before the thread's next look wakes it: units arm one each,
                # nearly always later than an earlier unit's, so most arms switch to no thread.
                self._cond.notify()
            return self._next

    def disarm(self, token: int) -> None:
        with self._cond:
            self._armed.pop(token, None)

    def _run(self) -> None:
        while True:
            with self._cond:
                now = time.monotonic()
                for token, (due, conn) in list(self._armed.items()):
                    if due <= now:
                        del self._armed[token]
                        _cut(conn)       # under the lock: the unit cannot end and hand it on meanwhile
                soonest = min((due for due, _ in self._armed.values()), default=None)
                wait = None if soonest is None else max(0.01, soonest - now)
                self._wake_at = _NEVER if wait is None else now + wait
                self._cond.wait(wait)


def _cut(conn: Connection) -> None:
    try:
        s = socket.socket(fileno=os.dup(conn.pgconn.socket))
    except Exception:       # already closed: nothing to cut
        return
    try:
        s.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    finally:
        s.close()


_WATCHDOG = _Watchdog()


@contextmanager
def deadline(conn: Connection, seconds: float = UNIT_DEADLINE_S):
    """Within the block, ``conn`` is cut (its calls raise OperationalError) once ``seconds`` have
    passed: no database wait on a request path outlives it."""
    token = _WATCHDOG.arm(conn, seconds)
    try:
        yield conn
    finally:
        _WATCHDOG.disarm(token)


def transaction(pool: ConnectionPool, fn: Callable):
    """Run ``fn(cursor)`` (a dict-row cursor) in one transaction and return its result.

    Serialization failures and deadlocks are retried up to 5 times (the whole unit of work, so
    ``fn`` must only touch the database); still failing → UnavailableError. A QlError raised by
    ``fn`` rolls back and propagates unchanged.
    """
    import psycopg
    from psycopg import errors
    from psycopg.rows import dict_row
    for _ in range(TX_RETRIES):
        try:
            with pool.connection(timeout=_WAIT.get()) as conn, deadline(conn), conn.transaction(), \
                    conn.cursor(row_factory=dict_row) as cur:
                return fn(cur)
        except (errors.SerializationFailure, errors.DeadlockDetected):
            continue
        except psycopg.OperationalError as e:
            raise UnavailableError(f"cluster database unavailable: {str(e).splitlines()[0]}") from None
    raise UnavailableError("cluster database: transaction kept conflicting; retry later")


def read(pool: ConnectionPool, fn: Callable):
    """Run the read-only ``fn(cursor)`` (a dict-row cursor) without BEGIN/COMMIT and return its
    result. At READ COMMITTED every statement takes its own snapshot whether or not it is in a
    transaction block, so a read gains nothing from one but two round trips. ``fn`` must not
    write or lock rows. OperationalError → UnavailableError; a QlError propagates unchanged.
    """
    return _outside_transaction(pool, fn)


def statement(pool: ConnectionPool, fn: Callable):
    """Run ``fn(cursor)`` (a dict-row cursor), which executes ONE statement that may write (a
    database function's call), without BEGIN/COMMIT: outside a transaction block it is a
    transaction of its own, at READ COMMITTED, in one round trip. Serialization failures and
    deadlocks re-run it as ``transaction`` does; otherwise errors as ``read`` (a unique-key
    violation propagates as psycopg's)."""
    from psycopg import errors
    for _ in range(TX_RETRIES):
        try:
            return _outside_transaction(pool, fn)
        except (errors.SerializationFailure, errors.DeadlockDetected):
            continue
    raise UnavailableError("cluster database: transaction kept conflicting; retry later")


def _outside_transaction(pool: ConnectionPool, fn: Callable):
    import psycopg
    from psycopg import errors
    from psycopg.rows import dict_row
    try:
        with pool.connection(timeout=_WAIT.get()) as conn, deadline(conn):
            conn.autocommit = True
            try:
                with conn.cursor(row_factory=dict_row) as cur:
                    return fn(cur)
            finally:
                conn.autocommit = False     # the pool's next user expects a transaction per unit
    except (errors.SerializationFailure, errors.DeadlockDetected):
        raise                               # ``statement`` re-runs these
    except psycopg.OperationalError as e:
        raise UnavailableError(f"cluster database unavailable: {str(e).splitlines()[0]}") from None


@contextmanager
def autocommit(url: str):
    """A short-lived autocommit connection (migrations, administration)."""
    conn = connect(url, autocommit=True)
    try:
        yield conn
    finally:
        conn.close()
