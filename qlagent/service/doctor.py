"""``qlagent doctor``: trusted paths, schema history, capability, integrity, key file, free
space, dirs, network. Before ``init`` it reports only what is missing (no ``ok`` line among them)."""

from __future__ import annotations

import os
import socket
import stat

from ..adapters.secretbox import check_key_file
from ..adapters.sqlite import migrations
from ..adapters.sqlite.authority import SqliteAuthority
from ..adapters.sqlite.secrets import secret_uses
from ..adapters.trust import check as check_trust
from ..adapters.trust import trusted_paths
from ..core.errors import QlError
from .config import Settings

MiB = 1_048_576


def run_checks(s: Settings) -> list[dict]:
    """Each check: ``{"name", "ok", "detail"}``. Never raises for what it inspects.

    Untrusted paths (adapters.trust) are listed first, one ``trust`` line each; the database is
    then not opened. Before ``init`` only the missing database and key file are listed."""
    out: list[dict] = []

    def add(name: str, ok: bool, detail: str) -> None:
        out.append({"name": name, "ok": ok, "detail": detail})

    untrusted = check_trust(trusted_paths(s))
    for _, text in untrusted:
        add("trust", False, text)
    if not os.path.exists(s.db_path):
        add("database", False, f"{s.db_path} does not exist (run `qlagent init`)")
        problem = check_key_file(s.key_file)
        if problem:
            add("key file", False, problem)
        return out
    if untrusted:           # a database another user may have written is not opened
        return out
    add("trust", True, f"config, state dir, database, key file, artifacts and runs dirs owned by uid "
                       f"{os.geteuid()}" + (" or root" if os.geteuid() else "") + ", none group/world-writable")
    _store_checks(s, add)
    problem = check_key_file(s.key_file)
    add("key file", problem is None, problem or f"{s.key_file} (0600, 32 bytes)")
    probe = s.artifact_dir if os.path.exists(s.artifact_dir) else s.state_dir
    try:
        v = os.statvfs(probe)
        free = v.f_bavail * v.f_frsize
        need = s.profile.fs_reserve_bytes + s.profile.log_max_bytes
        add("free space", free >= need, f"{free // MiB} MiB free on {probe}; the {s.profile.name} profile needs "
                                         f"{need // MiB} MiB (reserve + one log)")
    except OSError as e:
        add("free space", False, f"{probe}: {e.strerror}")
    for name, path in (("state dir", s.state_dir), ("artifact dir", s.artifact_dir)):
        try:
            st = os.lstat(path)
            ok = stat.S_ISDIR(st.st_mode) and not (st.st_mode & 0o077)
            add(name, ok, f"{path} mode {oct(st.st_mode & 0o777)}" + ("" if ok else "; expected a 0700 directory"))
        except FileNotFoundError:
            add(name, name == "artifact dir", f"{path} not created yet")
    add("network", *network_check())
    return out


def _store_checks(s: Settings, add) -> None:
    auth = SqliteAuthority(s.db_path)
    try:
        try:
            pending = auth.raw(lambda c: migrations.verify_history(c, migrations.known_migrations()))
            add("schema", not pending, "up to date" if not pending else
                f"{len(pending)} migration(s) pending: {', '.join(f'{m.version:04d}_{m.name}' for m in pending)}")
        except QlError as e:
            add("schema", False, str(e))
        try:
            caps = auth.read(migrations.check_capabilities)
            add("capability", True, ", ".join(f"{k}:{v}" for k, v in sorted(caps.items())))
        except QlError as e:
            add("capability", False, str(e))
        res = auth.read(lambda c: [r[0] for r in c.execute("PRAGMA integrity_check")])
        add("integrity", res == ["ok"], "; ".join(res[:5]))
        missing = [(t, n) for t, n, stored in auth.read(lambda c: secret_uses(c, None)) if not stored]
        for task, name in missing:
            add("secrets", False, f"task {task} uses secret {name!r}, which is not set "
                                  f"(`qlagent secret set {name}`); its runs fail secret_missing:{name}")
        if not missing:
            add("secrets", True, "every secret a task uses is set")
    finally:
        auth.close()


RT_TABLE_MAIN = 254
RTN_UNREACHABLE, RTN_PROHIBIT = 7, 8


def network_check() -> tuple[bool, str]:
    """The default routes as netlink reports them (decoded by pyroute2, imported only here:
    ``doctor`` is short-lived, the service never loads it), next to what the network gate
    reads from /proc (``adapters.netstate``). Not ok when the two disagree or netlink cannot
    be read."""
    from pyroute2 import IPRoute

    from ..adapters import netstate
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
