"""Candidate wake-ups for long-polling Worker Pulls (issue 10 §6): one LISTEN connection per
control-plane replica, fanned out to any number of waiting Pulls (``core.cluster.CandidateSignal``).

The migration's trigger NOTIFYs ``qlagent_candidates`` when a Run enters ``queued``. A listener
thread blocks on the connection (waking every 0.5 s only to notice ``close()``: the database is
never polled) and bumps a sequence number; a Pull takes ``seq()`` before it reads candidates and
then ``wait(seq, timeout_s)``s, so a NOTIFY between its read and its wait is never missed.
"""

from __future__ import annotations

import threading

from .connection import connect

CHANNEL = "qlagent_candidates"


class PgCandidateSignal:
    """Opens its own LISTEN connection to ``url`` (UnavailableError when unreachable)."""

    def __init__(self, url: str) -> None:
        self._conn = connect(url, autocommit=True)
        self._conn.execute(f"LISTEN {CHANNEL}")
        self._cond = threading.Condition()
        self._seq = 0
        self._stop = False
        self._thread = threading.Thread(target=self._listen, name="qlagent-candidate-listener", daemon=True)
        self._thread.start()

    def _listen(self) -> None:
        while not self._stop:
            try:
                # Wake the waiters at each notification as it arrives: the generator itself
                # runs until its timeout, so counting it first would delay every wake-up.
                for _ in self._conn.notifies(timeout=0.5):
                    self._bump()
            except Exception:
                # The connection broke: wake every waiter so it re-reads (and sees the store error).
                self._stop = True
                self._bump()

    def _bump(self) -> None:
        with self._cond:
            self._seq += 1
            self._cond.notify_all()

    def seq(self) -> int:
        """The current wake-up number."""
        with self._cond:
            return self._seq

    def wait(self, seq: int, timeout_s: float) -> bool:
        """Block until a wake-up after ``seq`` or ``timeout_s`` seconds; True if woken."""
        with self._cond:
            return self._cond.wait_for(lambda: self._seq != seq or self._stop, timeout_s) and not self._stop

    def close(self) -> None:
        """Stop listening and wake every waiter (``wait`` then returns False at once, now and
        later). Idempotent."""
        self._stop = True
        self._bump()
        if self._thread.is_alive():
            self._thread.join(5)
        self._conn.close()
