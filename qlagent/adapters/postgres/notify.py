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
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from ...core.errors import UnavailableError
from .connection import connect

CHANNEL = "qlagent_candidates"
RECHECK_S = 0.5        # while LISTEN is down, a waiting Pull re-reads the queue this often (s)
BACKOFF_MIN_S = 0.25   # first pause before reopening a lost LISTEN connection (s)
BACKOFF_MAX_S = 4.0    # the pause doubles up to this (s)


class PgCandidateSignal:
    """Opens its own LISTEN connection to ``url`` (UnavailableError when unreachable at start) and
    keeps it open. ``log(priority, event, **fields)`` (optional) hears ``listen.lost`` (with the
    error) when the connection breaks and ``listen.restored`` (with ``down_s``) when it is back."""

    def __init__(self, url: str, log: Callable[..., None] | None = None) -> None:
        self._url = url
        self._log = log or (lambda *a, **k: None)
        self._cond = threading.Condition()
        self._seq = 0
        self._stop = False
        self._closed = threading.Event()
        self._conn = self._open()
        self._thread = threading.Thread(target=self._listen, name="qlagent-candidate-listener", daemon=True)
        self._thread.start()

    def _open(self):
        conn = connect(self._url, autocommit=True)
        try:
            conn.execute(f"LISTEN {CHANNEL}")
        except Exception as e:
            conn.close()
            raise UnavailableError(f"LISTEN {CHANNEL}: {str(e).splitlines()[0] if str(e) else type(e).__name__}") \
                from None
        return conn

    def _listen(self) -> None:
        delay, lost_at = BACKOFF_MIN_S, None
        while not self._stop:
            if self._conn is None:
                try:
                    conn = self._open()
                except Exception:
                    self._closed.wait(delay)
                    delay = min(delay * 2, BACKOFF_MAX_S)
                    continue
                with self._cond:
                    self._conn = conn
                delay = BACKOFF_MIN_S
                self._log("info", "listen.restored", channel=CHANNEL, down_s=round(time.monotonic() - lost_at, 1))
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

    @property
    def listening(self) -> bool:
        """Whether the LISTEN connection is open right now."""
        with self._cond:
            return self._conn is not None and not self._stop

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


def _close_quietly(conn) -> None:
    if conn is not None:
        try:
            conn.close()
        except Exception:
            pass
