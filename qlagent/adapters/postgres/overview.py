"""``qlagent status`` on PostgreSQL (issue 26): what the fleet's authority says of itself in one
read — the server's role and its standbys' replay lag, who is connected to the database, the
queue, and Workers whose Sessions keep replacing each other."""

from __future__ import annotations

from .connection import read

# A Worker whose Sessions were replaced this often within the window: more than one process
# says hello with one credential (each hello fences the other's Session).
CLASH_WINDOW_US = 600 * 1_000_000
CLASH_REPLACED = 3


def fleet_overview(pool) -> dict:
    """{``standby`` (bool: this server is in recovery), ``version``, ``standbys`` [{name, addr,
    state, replayLagS}], ``clients`` [{addr, connections}] (other sessions on this database, by
    host: the replicas and CLIs), ``queued``, ``oldestQueuedUs`` (created_at of the oldest queued
    Run, µs, or None), ``unplaceable`` (queued Runs with a ``run.unplaceable`` event), ``nowUs``,
    ``clashes`` [{name, replaced}]}. UnavailableError when the database does not answer."""
    def fn(cur):
        db = cur.execute("SELECT pg_is_in_recovery() AS standby, current_setting('server_version') AS version,"
                         " ql_now_us() AS now").fetchone()
        standbys = cur.execute("SELECT application_name AS name, client_addr::text AS addr, state,"
                               " extract(epoch FROM replay_lag)::float8 AS lag FROM pg_stat_replication"
                               " ORDER BY 1").fetchall()
        clients = cur.execute("SELECT coalesce(client_addr::text, 'local') AS addr, count(*) AS n FROM pg_stat_activity"
                              " WHERE datname = current_database() AND pid <> pg_backend_pid()"
                              " AND backend_type = 'client backend' GROUP BY 1 ORDER BY 1").fetchall()
        runs = cur.execute("SELECT count(*) AS queued, min(created_at_us) AS oldest,"
                           " count(*) FILTER (WHERE EXISTS (SELECT 1 FROM run_events e WHERE e.run_id = r.run_id"
                           "   AND e.type = 'run.unplaceable')) AS unplaceable"
                           " FROM runs r WHERE r.state = 'queued'").fetchone()
        clashes = cur.execute("SELECT w.name, count(*) AS replaced FROM worker_sessions s JOIN workers w"
                              " ON w.worker_id = s.worker_id WHERE s.state = 'replaced' AND s.opened_at_us > %s"
                              " AND w.state <> 'removed' GROUP BY w.name HAVING count(*) >= %s ORDER BY 1",
                              (db["now"] - CLASH_WINDOW_US, CLASH_REPLACED)).fetchall()
        return {"standby": db["standby"], "version": db["version"], "nowUs": db["now"],
                "standbys": [{"name": s["name"], "addr": s["addr"], "state": s["state"], "replayLagS": s["lag"]}
                             for s in standbys],
                "clients": [{"addr": c["addr"], "connections": c["n"]} for c in clients],
                "queued": runs["queued"], "oldestQueuedUs": runs["oldest"], "unplaceable": runs["unplaceable"],
                "clashes": [{"name": c["name"], "replaced": c["replaced"]} for c in clashes]}
    return read(pool, fn)
