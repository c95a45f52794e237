"""POSIX signals into a selectors loop (the self-pipe of ``signal.set_wakeup_fd``), for the
three loops of ``qlagent serve``: the local agent (``service.main``), the control-plane replica
(``service.controlplane``) and the fleet Worker (``worker.runtime``, installed by
``service.worker_mode``)."""

from __future__ import annotations

import selectors
import signal
import socket
from collections.abc import Callable, Iterable


# Signals no qlagent service acts on whose default action ends the process (a stray `kill -USR1`,
# a script's alarm): each loop catches them with its others and drops them. A handler, not
# SIG_IGN, which the Runs' processes would inherit across exec. (SIGPIPE: Python ignores it.)
UNUSED_SIGNALS = (signal.SIGALRM, signal.SIGUSR1, signal.SIGUSR2)


class SignalWakeup:
    """Each signal of ``signals`` calls ``on_signal(signum)`` from its handler (it should only
    record the signal: the handler runs between two bytecodes of the loop) and wakes ``sel``'s
    ``select`` through a socket registered with ``data``; the loop then calls ``drain`` and
    handles what was recorded. ``signal.set_wakeup_fd(-1)`` ends the wake-ups."""

    def __init__(self, sel: selectors.BaseSelector, signals: Iterable[int], on_signal: Callable[[int], None],
                 data) -> None:
        r, w = socket.socketpair()
        r.setblocking(False)
        w.setblocking(False)
        self._r, self._w = r, w
        signal.set_wakeup_fd(w.fileno(), warn_on_full_buffer=False)
        for sig in signals:
            signal.signal(sig, lambda n, f: on_signal(n))
        sel.register(r, selectors.EVENT_READ, data)

    def drain(self) -> None:
        """Read every wake byte written so far (the loop's socket is readable)."""
        try:
            while self._r.recv(64):
                pass
        except BlockingIOError:
            pass
