"""Network-gated admission over netlink (pyroute2): a Run that needs the network waits in the
queue, without polling, until the condition holds.

Conditions: ``default_route`` — an IPv4 or IPv6 default route in the main table;
``interface`` — the named link is administratively up with a carrier (operstate UP, or
UNKNOWN for links that do not report one, like ``lo`` and tunnels). One netlink socket is
subscribed to link and route changes and sits in the service's selector; a second one answers
dumps. This module is imported only when an enabled task needs the gate (pyroute2 costs
≈ 18 MB RSS; bench/README.md).
"""

from __future__ import annotations

from pyroute2 import IPRoute
from pyroute2.netlink.rtnl import RTMGRP_IPV4_ROUTE, RTMGRP_IPV6_ROUTE, RTMGRP_LINK

IFF_UP = 0x1
RT_TABLE_MAIN = 254


class NetworkGate:
    def __init__(self) -> None:
        self._events = IPRoute()
        self._events.bind(groups=RTMGRP_LINK | RTMGRP_IPV4_ROUTE | RTMGRP_IPV6_ROUTE)
        self._query = IPRoute()
        self._default_route = False
        self._up: set[str] = set()
        self.refresh()

    def fileno(self) -> int:
        return self._events.fileno()

    def refresh(self) -> None:
        """Re-read default routes and link states (after a netlink event)."""
        default = False
        for family in (2, 10):
            for r in self._query.route("dump", family=family):
                if r.get("dst_len") == 0 and r.get_attr("RTA_TABLE", r.get("table")) == RT_TABLE_MAIN \
                        and r.get("type", 1) == 1:
                    default = True
                    break
            if default:
                break
        up = set()
        for link in self._query.link("dump"):
            if link["flags"] & IFF_UP and link.get_attr("IFLA_OPERSTATE") in ("UP", "UNKNOWN"):
                up.add(link.get_attr("IFLA_IFNAME"))
        self._default_route, self._up = default, up

    def process(self) -> bool:
        """Consume pending netlink events and refresh; True if any condition changed."""
        self._events.get()
        before = (self._default_route, frozenset(self._up))
        self.refresh()
        return before != (self._default_route, frozenset(self._up))

    def satisfied(self, require: str, interface: str | None) -> bool:
        if require == "default_route":
            return self._default_route
        if require == "interface":
            return interface in self._up
        return True

    def close(self) -> None:
        self._events.close()
        self._query.close()
