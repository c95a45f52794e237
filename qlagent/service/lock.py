"""The service lock: ``state_dir/service.lock`` held with flock while a service (a local agent,
an inline runner or a fleet Worker) owns the state directory. Its own module so that Worker
mode takes it without loading the local agent's loop."""

from __future__ import annotations

import fcntl
import os


class ServiceLock:
    """``state_dir/service.lock`` held with flock while a service (or inline runner) owns it."""

    def __init__(self, state_dir: str) -> None:
        os.makedirs(state_dir, mode=0o700, exist_ok=True)
        self.path = os.path.join(state_dir, "service.lock")
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)

    def try_acquire(self) -> bool:
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            return False

    def close(self) -> None:
        os.close(self.fd)
