"""Drive an ``HttpServer`` from a selectors loop of its own in a thread, as the agent's main loop
drives it (``register``, ``owns``/``handle_event`` per ready key, ``timeouts`` each turn)."""

from __future__ import annotations

import selectors
import socket
import threading
import time


class LoopThread:
    """Starts serving ``server`` at once; ``poll_s``: the longest one select waits. ``stop()``
    (any thread) ends the loop, closes the server and joins the thread."""

    def __init__(self, server, poll_s: float = 0.05) -> None:
        self.server, self._poll_s = server, poll_s
        self._stopping = False
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._wake_r, selectors.EVENT_READ, None)
        server.register(self._sel)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        srv = self.server
        try:
            while not self._stopping:
                deadline = srv.timeouts(time.monotonic())
                timeout = self._poll_s if deadline is None else max(0.0, min(self._poll_s,
                                                                             deadline - time.monotonic()))
                for key, mask in self._sel.select(timeout):
                    if key.data is None:
                        self._wake_r.recv(64)
                    elif srv.owns(key):
                        srv.handle_event(key, mask)
        finally:
            srv.close()
            self._sel.close()
            self._wake_r.close()

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stopping = True
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        self._thread.join(timeout_s)
        self._wake_w.close()

    def is_alive(self) -> bool:
        return self._thread.is_alive()
