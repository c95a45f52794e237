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


def held(state_dir: str) -> bool:
    """True while a service holds ``state_dir/service.lock`` (started by systemd, procd or by
    hand); creates and writes nothing (``doctor``): a missing lock file is held by nobody."""
    try:
        fd = os.open(os.path.join(state_dir, "service.lock"), os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
