"""Network-gated admission: a Run that needs the network waits in the queue, without polling,
until the condition holds.

Conditions: ``default_route`` — an IPv4 or IPv6 default route; ``interface`` — the named link
is administratively up with a carrier (operstate UP, or UNKNOWN for links that do not report
one, like ``lo`` and tunnels). A netlink socket subscribed to link and route changes sits in
the service's selector as a wake-up only (``adapters.netlink_wake``); on each wake the state is
re-read from /proc and /sys (``adapters.netstate``). Nothing here decodes netlink or imports
pyroute2: the gate costs a socket, not the +23 MiB pyroute2 would keep resident (issue 14).
"""

from __future__ import annotations

from . import netstate
from .netlink_wake import NetlinkWake


class NetworkGate:
    def __init__(self) -> None:
        self._events = NetlinkWake()        # subscribed before the first read: no change is missed
        self._default_route = False
        self._interfaces: dict[str, bool] = {}
        self.refresh()

    def fileno(self) -> int:
        return self._events.fileno()

    def refresh(self) -> None:
        """Re-read the default route and the state of every interface asked about so far."""
        self._default_route = netstate.has_default_route()
        self._interfaces = {name: netstate.interface_up(name) for name in self._interfaces}

    def process(self) -> bool:
        """Consume pending netlink events and refresh; True if any condition changed."""
        self._events.drain()
        before = (self._default_route, dict(self._interfaces))
        self.refresh()
        return before != (self._default_route, self._interfaces)

    def satisfied(self, require: str, interface: str | None) -> bool:
        if require == "default_route":
            return self._default_route
        if require == "interface":
            if interface not in self._interfaces:
                # First question about this link: read it now; later events keep it current.
                self._interfaces[interface] = netstate.interface_up(interface)
            return self._interfaces[interface]
        return True

    def close(self) -> None:
        self._events.close()
