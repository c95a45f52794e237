"""The network state the gate admits on, read from procfs and sysfs (issue 14).

- default route: an IPv4 route 0.0.0.0/0 in ``/proc/net/route`` (the main table) or an IPv6
  route ::/0 in ``/proc/net/ipv6_route``, up and not a reject route (``unreachable``,
  ``prohibit``; the kernel's own IPv6 null entry on ``lo`` is one);
- interface NAME: ``/sys/class/net/NAME/flags`` has IFF_UP and ``operstate`` is ``up``, or
  ``unknown`` for links that report no carrier (``lo``, tunnels).

Both files are per network namespace (procfs follows the reader, ``ip netns exec`` remounts
sysfs), plain text, and cost no import: the resident agent needs no netlink decoder.
"""

from __future__ import annotations

import os

RTF_UP = 0x0001
RTF_REJECT = 0x0200
IFF_UP = 0x1
SYS_CLASS_NET = "/sys/class/net"


def _lines(path: str) -> list[str]:
    try:
        with open(path) as f:
            return f.read().splitlines()
    except OSError:            # no IPv6 (ipv6.disable=1) or no procfs: no route of that family
        return []


def has_default_route(proc_net: str = "/proc/net") -> bool:
    """True if an IPv4 or IPv6 default route is usable (see module doc)."""
    for line in _lines(os.path.join(proc_net, "route"))[1:]:
        f = line.split()
        # Iface Destination Gateway Flags RefCnt Use Metric Mask …  (hex, host byte order)
        if len(f) >= 8 and int(f[1], 16) == 0 and int(f[7], 16) == 0 \
                and int(f[3], 16) & (RTF_UP | RTF_REJECT) == RTF_UP:
            return True
    for line in _lines(os.path.join(proc_net, "ipv6_route")):
        f = line.split()
        # dest plen src src_plen next_hop metric refcnt use flags device
        if len(f) >= 10 and int(f[0], 16) == 0 and int(f[1], 16) == 0 \
                and int(f[8], 16) & (RTF_UP | RTF_REJECT) == RTF_UP:
            return True
    return False


def interface_up(name: str, sys_class_net: str = SYS_CLASS_NET) -> bool:
    """True if link ``name`` is administratively up and operationally up (or unknown)."""
    if not name or "/" in name or name in (".", ".."):
        return False
    base = os.path.join(sys_class_net, name)
    try:
        with open(os.path.join(base, "flags")) as f:
            flags = int(f.read(), 16)
        with open(os.path.join(base, "operstate")) as f:
            oper = f.read().strip()
    except (OSError, ValueError):      # no such link (yet)
        return False
    return bool(flags & IFF_UP) and oper in ("up", "unknown")
