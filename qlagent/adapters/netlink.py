"""``qlagent doctor``'s netlink view of the default routes, next to the network gate's /proc
view (``adapters.netstate``). pyroute2 is imported inside the call only: doctor is short-lived
and the service never loads it."""

from __future__ import annotations

import socket

RT_TABLE_MAIN = 254
RTN_UNREACHABLE, RTN_PROHIBIT = 7, 8


def network_check() -> tuple[bool, str]:
    """The default routes as netlink reports them (decoded by pyroute2, imported only here:
    ``doctor`` is short-lived, the service never loads it), next to what the network gate
    reads from /proc (``adapters.netstate``). Not ok when the two disagree or netlink cannot
    be read."""
    from pyroute2 import IPRoute

    from . import netstate
    gate = netstate.has_default_route()
    found = []
    try:
        with IPRoute() as ipr:
            names = {link["index"]: link.get_attr("IFLA_IFNAME") for link in ipr.get_links()}
            for family, label in ((socket.AF_INET, "IPv4"), (socket.AF_INET6, "IPv6")):
                for r in ipr.get_routes(family=family):
                    # /proc/net/route lists the main table only, /proc/net/ipv6_route every table.
                    main_only = family == socket.AF_INET and r.get_attr("RTA_TABLE", r["table"]) != RT_TABLE_MAIN
                    if r["dst_len"] != 0 or main_only or r["type"] in (RTN_UNREACHABLE, RTN_PROHIBIT):
                        continue
                    gw, dev = r.get_attr("RTA_GATEWAY"), names.get(r.get_attr("RTA_OIF"))
                    found.append(f"{label} default" + (f" via {gw}" if gw else "") + (f" dev {dev}" if dev else ""))
    except OSError as e:
        return False, f"netlink: {e.strerror or e}; the network gate reads {'a' if gate else 'no'} default route"
    seen = "; ".join(found) if found else "no default route (Runs gated on default_route wait)"
    if bool(found) != gate:
        return False, (f"netlink reports {seen}, but the network gate reads "
                       f"{'a default route' if gate else 'none'} from /proc/net")
    return True, seen
