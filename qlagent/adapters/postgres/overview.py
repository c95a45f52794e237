"""``qlagent status`` on PostgreSQL (issue 26): what the fleet's authority says of itself in one
read — the server's role and its standbys' replay lag, who is connected to the database, the
queue, and Workers whose Sessions keep replacing each other."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .connection import REPLICA_APPLICATION, read
from .queries import OVERVIEW_CLIENTS, OVERVIEW_QUEUE, OVERVIEW_REPLICATION, OVERVIEW_SERVER, OVERVIEW_SESSION_CHURN

if TYPE_CHECKING:   # annotations only: psycopg loads where a connection is opened
    from psycopg_pool import ConnectionPool

# A Worker whose Sessions were replaced this often within the window: more than one process
# says hello with one credential (each hello fences the other's Session).
CLASH_WINDOW_US = 600 * 1_000_000
CLASH_REPLACED = 3


def fleet_overview(pool: ConnectionPool) -> dict:
    """{``standby`` (bool: this server is in recovery), ``version``, ``standbys`` [{name, addr,
    state, replayLagS}], ``replicas`` [{name (``HOST/PID``), addr, connections}] (the sessions of
    control-plane replicas: ``connection.name_sessions``), ``clients`` [{addr, application,
    connections}] (the other sessions on this database: CLIs, tools), ``queued``, ``oldestQueuedUs`` (created_at of the oldest queued
    Run, µs, or None), ``unplaceable`` (queued Runs with a ``run.unplaceable`` event), ``nowUs``,
    ``clashes`` [{name, replaced}]}. UnavailableError when the database does not answer."""
    def fn(cur):
        db = cur.execute(OVERVIEW_SERVER).fetchone()
        standbys = cur.execute(OVERVIEW_REPLICATION).fetchall()
        clients = cur.execute(OVERVIEW_CLIENTS).fetchall()
        runs = cur.execute(OVERVIEW_QUEUE).fetchone()
        clashes = cur.execute(OVERVIEW_SESSION_CHURN, (db["now"] - CLASH_WINDOW_US, CLASH_REPLACED)).fetchall()
        return {"standby": db["standby"], "version": db["version"], "nowUs": db["now"],
                "standbys": [{"name": s["name"], "addr": s["addr"], "state": s["state"], "replayLagS": s["lag"]}
                             for s in standbys],
                "replicas": [{"name": c["app"][len(REPLICA_APPLICATION):], "addr": c["addr"], "connections": c["n"]}
                             for c in clients if (c["app"] or "").startswith(REPLICA_APPLICATION)],
                "clients": [{"addr": c["addr"], "application": c["app"], "connections": c["n"]}
                            for c in clients if not (c["app"] or "").startswith(REPLICA_APPLICATION)],
                "queued": runs["queued"], "oldestQueuedUs": runs["oldest"], "unplaceable": runs["unplaceable"],
                "clashes": [{"name": c["name"], "replaced": c["replaced"]} for c in clashes]}
    return read(pool, fn)
