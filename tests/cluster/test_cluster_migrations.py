"""PostgreSQL migrations and connections (issue 10 "Shape"): checksummed history applied once
under an advisory lock by concurrent replicas, altered/unknown history refused, libpq multi-host
URLs, and psycopg never loaded by a local agent."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import create_database, db_url, drop_database
from qlagent.adapters.postgres.connection import autocommit, check_url, connect
from qlagent.adapters.postgres.migrations import check_capabilities, known_migrations, migrate
from qlagent.core.errors import StoreIntegrityError, UnavailableError, ValidationError

MIGRATOR = """
import json, sys, time
from qlagent.adapters.postgres.connection import autocommit
from qlagent.adapters.postgres.migrations import migrate
deadline = float(sys.argv[2])
while time.time() < deadline:      # start together: every process is connected before any migrates
    time.sleep(0.005)
with autocommit(sys.argv[1]) as conn:
    print(json.dumps(migrate(conn)))
"""


@pytest.fixture
def fresh_db(request):
    name = create_database(f"mig_{request.node.name[-20:]}")
    yield db_url(name)
    drop_database(name)


def test_four_concurrent_migrators_apply_each_migration_once(fresh_db):
    import time
    start = time.time() + 1.5
    procs = [subprocess.Popen([sys.executable, "-c", MIGRATOR, fresh_db, str(start)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(4)]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=60)
        assert p.returncode == 0, err
        results.append(json.loads(out))
    applied = sorted(name for r in results for name in r)
    expected = sorted(f"{m.version:04d}_{m.name}" for m in known_migrations())
    # Each migration applied by exactly one replica (the lock is taken per migration's
    # transaction, so another replica may carry on the sequence).
    assert applied == expected
    with autocommit(fresh_db) as conn:
        assert conn.execute("SELECT count(*) FROM schema_migrations").fetchone()[0] == len(expected)
        assert check_capabilities(conn) == {"cluster-control-core": 1, "store-ports": 1}
        assert migrate(conn) == []                  # a later start finds nothing pending


def test_altered_or_unknown_history_is_refused(fresh_db):
    with autocommit(fresh_db) as conn:
        migrate(conn)
        conn.execute("UPDATE schema_migrations SET checksum = repeat('0', 64) WHERE version = 2")
        with pytest.raises(StoreIntegrityError, match="0002_cluster in the database differs"):
            migrate(conn)
        conn.execute("UPDATE schema_migrations SET checksum = %s WHERE version = 2", (known_migrations()[1].checksum,))
        conn.execute("INSERT INTO schema_migrations VALUES (9999, 'from_the_future', repeat('a', 64), 0)")
        with pytest.raises(StoreIntegrityError, match="9999_from_the_future which this qlagent does not know"):
            migrate(conn)


def test_capabilities_missing_before_migration(fresh_db):
    with autocommit(fresh_db) as conn, pytest.raises(UnavailableError, match="cluster-control-core"):
        check_capabilities(conn)


def test_multi_host_url_needs_read_write_and_fails_over(fresh_db):
    with pytest.raises(ValidationError, match="cluster.database.target_session_attrs"):
        check_url("postgresql://a:5432,b:5432/db")
    with pytest.raises(ValidationError, match="cluster.database"):
        check_url("mysql://x/db")
    with pytest.raises(ValidationError, match="port 1..65535"):
        check_url("postgresql://a:70000/db")
    # libpq tries the first host (nothing listens on port 1), then the second, read-write one.
    host, _, name = fresh_db.rpartition("/")
    url = host.replace("127.0.0.1:5432", "127.0.0.1:1,127.0.0.1:5432") + f"/{name}?target_session_attrs=read-write"
    assert check_url(url) == url
    with connect(url, autocommit=True) as conn:
        assert conn.execute("SELECT current_database()").fetchone()[0] == name
    with pytest.raises(UnavailableError, match="unreachable"):
        connect("postgresql://postgres@127.0.0.1:1/x")


PROBE = ("import json, sys, importlib\n"
         "for m in sys.argv[1:]: importlib.import_module(m)\n"
         "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in ('psycopg', 'psycopg_pool'))))")


def test_local_agent_never_loads_psycopg(pg_url):
    local = ["qlagent.service.main", "qlagent.http.api", "qlagent.cli.main", "qlagent.application.engine"]
    out = subprocess.run([sys.executable, "-c", PROBE, *local], capture_output=True, text=True, check=True).stdout
    assert json.loads(out) == []
    # The cluster modules themselves load psycopg only when a connection is made.
    cluster = ["qlagent.adapters.postgres.dispatch", "qlagent.adapters.postgres.migrations",
               "qlagent.cluster.dispatcher", "qlagent.cluster.pull"]
    out = subprocess.run([sys.executable, "-c", PROBE, *cluster], capture_output=True, text=True, check=True).stdout
    assert json.loads(out) == []
    code = PROBE.replace("print(", f"from qlagent.adapters.postgres.connection import connect; "
                                   f"connect({pg_url!r}).close(); print(", 1)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "psycopg" in json.loads(out)             # the probe does see psycopg once it is used
