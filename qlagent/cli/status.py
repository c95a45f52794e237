"""``qlagent status`` (issue 26): the fleet at a glance on the control plane — the database
(primary or standby, the standbys' replay lag), the replicas connected to it (``HOST/PID``,
address, sessions) and its other clients (CLIs, tools) by host, Workers by state with their
free slots, queued and unplaceable Runs with the oldest queued age, and credential clashes (a
Worker whose Sessions keep replacing each other: two processes with one credential). Needs
``[cluster]`` (exit 2); the database unreachable is exit 5.

``--json``: {database: {role, version, standbys}, replicas, clients, workers: {STATE: {count,
freeSlots}}, runs: {queued, unplaceable, oldestQueuedAgeS}, clashes}."""

from __future__ import annotations


def cmd_status(ctx) -> int:
    from .. import bootstrap
    from .common import print_json as _print_json
    from .workers import _registry
    registry = _registry(ctx)
    o = bootstrap.fleet_overview(ctx.store)
    workers: dict[str, dict] = {}
    after = None
    while True:
        page = registry.list(64, after)
        for w in page:
            s = workers.setdefault(w["state"], {"count": 0, "freeSlots": 0})
            s["count"] += 1
            s["freeSlots"] += max(0, w["free_slots"]) if w["state"] == "online" else 0
        if len(page) < 64:
            break
        after = page[-1]["name"]
    age = None if o["oldestQueuedUs"] is None else round((o["nowUs"] - o["oldestQueuedUs"]) / 1e6, 1)
    out = {"database": {"role": "standby" if o["standby"] else "primary", "version": o["version"],
                        "standbys": o["standbys"]},
           "replicas": o["replicas"], "clients": o["clients"], "workers": workers,
           "runs": {"queued": o["queued"], "unplaceable": o["unplaceable"], "oldestQueuedAgeS": age},
           "clashes": o["clashes"]}
    if ctx.args.json:
        _print_json(out)
        return 0
    lag = ", ".join(f"{s['name'] or s['addr']} {s['state']} lag {s['replayLagS'] or 0:.1f} s" for s in o["standbys"])
    print(f"database   {out['database']['role']} (PostgreSQL {o['version']}); standbys: {lag or 'none'}")
    print("replicas   " + (", ".join(f"{r['name']} ({r['addr']}) ×{r['connections']}" for r in o["replicas"])
                             or "none connected"))
    print("clients    " + (", ".join(f"{c['application'] or '-'} ({c['addr']}) ×{c['connections']}"
                                     for c in o["clients"]) or "none"))
    print("workers    " + (", ".join(f"{n} {s['count']}" + (_free_slots(s["freeSlots"]) if n == "online" else "")
                                     for n, s in sorted(workers.items())) or "none enrolled"))
    print(f"runs       {o['queued']} queued ({o['unplaceable']} unplaceable)"
          + (f", oldest queued {age} s" if age is not None else ""))
    print("clashes    " + (", ".join(f"{c['name']} ({c['replaced']} Sessions replaced in 10 min: two processes "
                                     "with one credential?)" for c in o["clashes"]) or "none"))
    return 0


def _free_slots(n: int) -> str:
    return f" ({n} free slot{'' if n == 1 else 's'})"


def register(sub, name: str, help_: str) -> None:
    """Add ``status`` to ``sub`` (the top-level subparsers)."""
    from .common import command
    command(sub, name, cmd_status, help_)
