"""Candidate wake-ups for long-polling Worker Pulls (issue 10 §6): one LISTEN connection per
control-plane replica, fanned out to any number of waiting Pulls (``core.cluster.CandidateSignal``).

The migration's trigger NOTIFYs ``qlagent_candidates`` when a Run enters ``queued``. A listener
thread blocks on the connection (waking every 0.5 s only to notice ``close()``: the database is
never polled) and bumps a sequence number; a Pull takes ``seq()`` before it reads candidates and
then ``wait(seq, timeout_s)``s, so a NOTIFY between its read and its wait is never missed.

The connection is supervised (issue 21 §1): any error (a failover, a restart, a cut) closes it
and the thread opens a new one — the URL's hosts in order, so a multi-host URL with
``target_session_attrs=read-write`` lands on the new primary — after a back-off doubling from
``BACKOFF_MIN_S`` to ``BACKOFF_MAX_S``. While it is down no NOTIFY can arrive, so ``wait`` returns
True ("look again") after at most ``RECHECK_S``: a long-poll re-reads the queue that often instead
of sleeping out its wait. Once LISTEN is back every waiter is woken once, since a NOTIFY sent
while it was down is lost.

Each new LISTEN connection is proven first: a NOTIFY on a channel of its own, sent through the
store's URL (``notify_url``), must reach it within ``PROBE_S``. Behind a transaction-mode pooler
(PgBouncer) LISTEN runs on a server backend the pooler hands to others next and nothing arrives:
the replica then says so once (``listen.unavailable``, naming ``cluster.listen_database``, the
direct URL that fixes it), stays on the ``RECHECK_S`` re-checks and tries again every
``PROBE_RETRY_S``.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from ...core.errors import UnavailableError
from .connection import connect
from .queries import NOTIFY

if TYPE_CHECKING:   # annotations only: psycopg loads where a connection is opened
    from psycopg import Connection

CHANNEL = "qlagent_candidates"
RECHECK_S = 0.5        # while LISTEN is down, a waiting Pull re-reads the queue this often (s)
BACKOFF_MIN_S = 0.25   # first pause before reopening a lost LISTEN connection (s)
BACKOFF_MAX_S = 4.0    # the pause doubles up to this (s)
PROBE_S = 2.0          # a new LISTEN connection must hear its own probe NOTIFY within this (s)
PROBE_RETRY_S = 60.0   # after a probe went unheard (a pooler in between), the next try (s)


class _NotDelivered(Exception):
    """The probe NOTIFY did not reach the LISTEN connection."""


class PgCandidateSignal:
    """Opens its own LISTEN connection to ``url`` (UnavailableError when unreachable at start) and
    keeps it open; ``notify_url`` (default ``url``) is where the store's NOTIFYs are sent from,
    used for the probe. ``log(priority, event, **fields)`` (optional) hears ``listen.lost`` (with
    the error) when the connection breaks, ``listen.restored`` (with ``down_s``) when it is back
    and ``listen.unavailable`` once when NOTIFYs do not reach it (a pooler in between)."""

    def __init__(self, url: str, log: Callable[..., None] | None = None, notify_url: str | None = None) -> None:
        self._url = url
        self._notify_url = notify_url or url
        self._log = log or (lambda *a, **k: None)
        self._cond = threading.Condition()
        self._seq = 0
        self._stop = False
        self._closed = threading.Event()
        self._unheard = False           # listen.unavailable said (once per process)
        try:
            self._conn = self._open()
        except _NotDelivered:
            self._conn = None
            self._say_unheard()
        self._thread = threading.Thread(target=self._listen, name="qlagent-candidate-listener", daemon=True)
        self._thread.start()

    def _open(self):
        """A proven LISTEN connection; UnavailableError (unreachable) or _NotDelivered."""
        conn = connect(self._url, autocommit=True)
        try:
            conn.execute(f"LISTEN {CHANNEL}")
            heard = self._probe(conn)
        except Exception as e:
            conn.close()
            raise UnavailableError(f"LISTEN {CHANNEL}: {(str(e).splitlines() or [type(e).__name__])[0]}") from None
        if not heard:
            conn.close()
            raise _NotDelivered()
        return conn

    def _probe(self, conn: Connection) -> bool:
        """Whether a NOTIFY sent through ``notify_url`` reaches ``conn`` within ``PROBE_S``."""
        channel = f"qlagent_probe_{secrets.token_hex(8)}"
        conn.execute(f"LISTEN {channel}")
        sender = connect(self._notify_url, autocommit=True)
        try:
            sender.execute(NOTIFY, (channel,))
        finally:
            sender.close()
        deadline = time.monotonic() + PROBE_S
        heard = False
        while not heard and (left := deadline - time.monotonic()) > 0:
            for n in conn.notifies(timeout=left):
                if n.channel == channel:
                    heard = True
                    break
                self._bump()    # a candidate announced meanwhile
        conn.execute(f"UNLISTEN {channel}")
        return heard

    def _say_unheard(self) -> None:
        if not self._unheard:
            self._unheard = True
            self._log("warning", "listen.unavailable", channel=CHANNEL, recheck_s=RECHECK_S,
                      error="NOTIFY does not reach the LISTEN connection (a transaction-mode pooler such as "
                            "PgBouncer in between?); set cluster.listen_database to a direct PostgreSQL URL")

    def _listen(self) -> None:
        delay, lost_at = BACKOFF_MIN_S, None
        if self._conn is None:          # the first probe went unheard: not again at once
            self._closed.wait(PROBE_RETRY_S)
        while not self._stop:
            if self._conn is None:
                try:
                    conn = self._open()
                except _NotDelivered:
                    self._say_unheard()
                    self._closed.wait(PROBE_RETRY_S)
                    continue
                except Exception:
                    self._closed.wait(delay)
                    delay = min(delay * 2, BACKOFF_MAX_S)
                    continue
                with self._cond:
                    self._conn = conn
                delay = BACKOFF_MIN_S
                self._log("info", "listen.restored", channel=CHANNEL,
                          down_s=None if lost_at is None else round(time.monotonic() - lost_at, 1))
                self._bump()       # a NOTIFY sent while LISTEN was down is lost: every waiter looks again
            try:
                # Wake the waiters at each notification as it arrives: the generator itself
                # runs until its timeout, so counting it first would delay every wake-up.
                for _ in self._conn.notifies(timeout=0.5):
                    self._bump()
            except Exception as e:
                if self._stop:
                    break
                with self._cond:
                    conn, self._conn = self._conn, None
                _close_quietly(conn)
                lost_at = time.monotonic()
                self._log("warning", "listen.lost", channel=CHANNEL,
                          error=(str(e).splitlines() or [type(e).__name__])[0], recheck_s=RECHECK_S)
                self._bump()       # wake every waiter so it re-reads (and sees the store error)

    def _bump(self) -> None:
        with self._cond:
            self._seq += 1
            self._cond.notify_all()

    def seq(self) -> int:
        """The current wake-up number."""
        with self._cond:
            return self._seq

    def wait(self, seq: int, timeout_s: float) -> bool:
        """Block until a wake-up after ``seq`` or ``timeout_s`` seconds; True if woken. While the
        LISTEN connection is down, True after at most ``RECHECK_S`` (look again: nothing can
        wake the caller). False at once after ``close()``."""
        with self._cond:
            if self._stop:
                return False
            down = self._conn is None
            woken = self._cond.wait_for(lambda: self._seq != seq or self._stop,
                                        min(timeout_s, RECHECK_S) if down else timeout_s)
            return (woken or down) and not self._stop

    def close(self) -> None:
        """Stop listening and wake every waiter (``wait`` then returns False at once, now and
        later). Idempotent."""
        self._stop = True
        self._closed.set()
        self._bump()
        if self._thread.is_alive():
            self._thread.join(5)
        with self._cond:
            conn, self._conn = self._conn, None
        _close_quietly(conn)


def _close_quietly(conn: Connection) -> None:
    if conn is not None:
        try:
            conn.close()
        except Exception:
            pass
