"""A netlink socket used only as a wake-up for the network gate (issue 14).

An ``AF_NETLINK``/``NETLINK_ROUTE`` socket bound to the link and IPv4/IPv6 route multicast
groups becomes readable whenever the kernel reports a link or route change. The datagrams are
never decoded: any of them (or an overrun, ``ENOBUFS``) only means "re-read the state", which
``qlagent.adapters.netstate`` does from /proc and /sys. Stdlib only, so the resident agent does
not carry pyroute2 (+23 MiB RSS with its asyncio; bench/README.md).
"""

from __future__ import annotations

import errno
import socket

# Multicast group bits of <linux/rtnetlink.h> (the stdlib socket module does not export them).
RTMGRP_LINK = 0x1
RTMGRP_IPV4_ROUTE = 0x40
RTMGRP_IPV6_ROUTE = 0x400
GROUPS = RTMGRP_LINK | RTMGRP_IPV4_ROUTE | RTMGRP_IPV6_ROUTE
RECV_BYTES = 65536          # one read drains a whole datagram; contents are discarded


class NetlinkWake:
    """Non-blocking, close-on-exec netlink route socket for a selector.

    Raises OSError if the kernel has no netlink (never on Linux ≥ 2.2).
    """

    def __init__(self) -> None:
        self._sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC,
                                   socket.NETLINK_ROUTE)
        self._sock.bind((0, GROUPS))

    def fileno(self) -> int:
        return self._sock.fileno()

    def drain(self) -> int:
        """Discard every pending datagram; returns how many were read (an overrun counts as one,
        since changes were lost and the state must be re-read all the same)."""
        n = 0
        while True:
            try:
                self._sock.recv(RECV_BYTES)
            except BlockingIOError:
                return n
            except OSError as e:
                if e.errno != errno.ENOBUFS:
                    raise
            n += 1

    def close(self) -> None:
        self._sock.close()
