"""Local control socket: a unix datagram socket the CLI pokes after it commits a change, so a
new Run starts at once instead of at the next due time. Best effort: no service, no poke."""

from __future__ import annotations

import os
import socket

POKE = b"poke"


def bind(path: str) -> socket.socket:
    """Bind the service's control socket (0600), replacing a stale one."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC)
    old = os.umask(0o177)
    try:
        s.bind(path)
    finally:
        os.umask(old)
    return s


def poke(path: str) -> bool:
    """Wake a running service; False if none listens (the CLI then works on the store alone)."""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
            s.sendto(POKE, path)
        return True
    except OSError:
        return False


def drain(s: socket.socket) -> int:
    """Read every pending datagram; returns how many (their content does not matter)."""
    n = 0
    while True:
        try:
            s.recv(64)
            n += 1
        except BlockingIOError:
            return n
