"""The SQLite authority and its migrations on real database files (issue 2 §2, ADR-0071 §2-3)."""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import subprocess
import threading

import msgspec
import pytest
from qlcli import cli

from qlagent.adapters.rows import definitions as defs
from qlagent.adapters.sqlite import migrations
from qlagent.application.definitions import DefinitionWriter
from qlagent.adapters.sqlite.store import SqliteStore
from qlagent.core.clock import now_us
from qlagent.core.errors import ConflictError, StoreIntegrityError, UnavailableError
from kit import clean_env, qlagent_argv, run_cli

TASK = {"task": [{"name": "t", "command": ["/bin/echo", "one"], "env": {"A": "1"}}]}


def prepared(name="t", argv=("/bin/echo", "one"), env=None):
    data = {"task": [{"name": name, "command": list(argv), "env": env if env is not None else {"A": "1"}}]}
    return DefinitionWriter.prepare_file(data)[0]


def count(db: str, table: str) -> int:
    with sqlite3.connect(db) as c:
        return c.execute(f"SELECT count(*) FROM {table}").fetchone()[0]


@pytest.fixture
def db(workdir):
    return os.path.join(workdir, "state", "qlagent.db")


@pytest.fixture
def store(db):
    s = SqliteStore(db)
    yield s
    s.close()


# ---- migrations ----------------------------------------------------------------------------

def test_fresh_database_gets_every_migration_with_checksums(db):
    s = SqliteStore(db)
    try:
        known = migrations.known_migrations()
        assert s.applied == [f"{m.version:04d}_{m.name}" for m in known]
        history = s.read(lambda c: [tuple(r) for r in c.execute(
            "SELECT version, name, checksum FROM schema_migrations ORDER BY version")])
        assert history == [(m.version, m.name, m.checksum) for m in known]
        assert [m.version for m in known] == sorted({m.version for m in known})      # no duplicate numbers
        assert s.capabilities()["local-control-core"] >= 3 and s.capabilities()["local_dispatch_plan"] >= 1
    finally:
        s.close()
    assert oct(os.stat(db).st_mode & 0o777) == "0o600"
    assert oct(os.stat(os.path.dirname(db)).st_mode & 0o777) == "0o700"


def test_reopen_is_idempotent(db):
    SqliteStore(db).close()
    before = count(db, "schema_migrations"), count(db, "capabilities"), count(db, "projects")
    s = SqliteStore(db)
    try:
        assert s.applied == []
    finally:
        s.close()
    assert (count(db, "schema_migrations"), count(db, "capabilities"), count(db, "projects")) == before


@pytest.mark.parametrize("tamper, words", [
    ("UPDATE schema_migrations SET checksum = 'deadbeef' || substr(checksum, 9) WHERE version = 2",
     ("0002_runs", "differs", "refusing")),
    ("UPDATE schema_migrations SET name = 'renamed' WHERE version = 1", ("0001_renamed", "refusing")),
    ("INSERT INTO schema_migrations VALUES (9999, 'from_the_future', 'x', 0)",
     ("9999_from_the_future", "does not know", "refusing")),
])
def test_altered_or_unknown_history_is_refused(db, workdir, tamper, words):
    SqliteStore(db).close()
    with sqlite3.connect(db) as c:
        c.execute(tamper)
    tasks_before = count(db, "tasks")
    with pytest.raises(StoreIntegrityError) as ei:
        SqliteStore(db)
    for w in words:
        assert w in str(ei.value)
    p = cli(os.path.dirname(db), "task", "ls")
    assert p.returncode == 5, p.stderr
    err = p.stderr.decode()
    assert "Traceback" not in err and all(w in err for w in words) and len(err.strip().splitlines()) == 1
    assert count(db, "tasks") == tasks_before
    p = cli(os.path.dirname(db), "doctor", "--json")
    assert p.returncode == 5
    schema = [c for c in json.loads(p.stdout)["checks"] if c["name"] == "schema"][0]
    assert schema["ok"] is False and all(w in schema["detail"] for w in words)


def test_capability_rows_exist_only_after_their_migration(db, monkeypatch):
    """ADR-0071 §2: DDL first, capability declaration in a later, separate migration."""
    every = migrations.known_migrations()
    cap_versions = [m.version for m in every if "capabilities" in m.sql and "INSERT" in m.sql.upper()]
    assert cap_versions, "no migration declares a capability"
    ddl_only = [m for m in every if m.version < min(cap_versions)]
    assert ddl_only and all("capabilities" not in m.sql for m in ddl_only)

    monkeypatch.setattr(migrations, "known_migrations", lambda: ddl_only)
    with pytest.raises(UnavailableError, match="capability local-control-core"):
        SqliteStore(db)                                  # DDL applied, readiness refuses
    with sqlite3.connect(db) as c:
        assert not c.execute("SELECT 1 FROM sqlite_master WHERE name = 'capabilities'").fetchone()
        assert c.execute("SELECT 1 FROM sqlite_master WHERE name = 'execution_revisions'").fetchone()
    monkeypatch.undo()
    s = SqliteStore(db)
    try:
        assert s.applied == [f"{m.version:04d}_{m.name}" for m in every if m.version >= min(cap_versions)]
        declared_by = dict(s.read(lambda c: [tuple(r) for r in c.execute("SELECT name, declared_by FROM capabilities")]))
        assert set(declared_by.values()) <= set(cap_versions)
    finally:
        s.close()


def test_wal_busy_timeout_and_foreign_keys(store, db):
    assert store.read(lambda c: c.execute("PRAGMA journal_mode").fetchone()[0]) == "wal"
    assert store.read(lambda c: c.execute("PRAGMA foreign_keys").fetchone()[0]) == 1
    assert store.read(lambda c: c.execute("PRAGMA busy_timeout").fetchone()[0]) > 0
    with pytest.raises(sqlite3.IntegrityError):
        store.write(lambda c: c.execute("INSERT INTO tasks(task_id, project_id, name, head_revision, created_at_us, "
                                        "updated_at_us) VALUES ('x', 'no-such-project', 'n', 1, 0, 0)"))
    assert count(db, "tasks") == 0


def test_every_commit_is_synced_full(store):
    """synchronous = FULL (2): in WAL mode each COMMIT fsyncs the WAL (NORMAL, 1, lost acknowledged
    Runs in a power cut: issue 22 §4)."""
    assert store.read(lambda c: c.execute("PRAGMA synchronous").fetchone()[0]) == 2


@pytest.mark.skipif(shutil.which("strace") is None, reason="needs strace")
def test_run_start_answers_only_after_its_run_is_on_stable_storage(workdir):
    """`qlagent run start` next to a running service prints the Run ID (its acknowledgement) only
    after an fsync/fdatasync of the WAL that holds the new Run. Under synchronous=NORMAL there was
    none: the service's open connection keeps the WAL from being checkpointed when the CLI exits."""
    state = os.path.join(workdir, "state")
    assert cli(state, "init").returncode == 0
    service = sqlite3.connect(os.path.join(state, "qlagent.db"))      # holds the WAL open, as serve does
    service.execute("SELECT count(*) FROM runs").fetchone()
    path = os.path.join(workdir, "t.toml")
    with open(path, "w") as f:
        f.write('[[task]]\nname = "t"\ncommand = ["/bin/true"]\n')
    assert cli(state, "task", "add", "-f", path).returncode == 0
    trace = os.path.join(workdir, "trace")
    try:
        p = subprocess.run(["strace", "-f", "-qq", "-y", "-s", "128", "-o", trace, "-e", "trace=fsync,fdatasync,write",
                            *qlagent_argv("--state-dir", state, "run", "start", "t")],
                           capture_output=True, env=clean_env(), timeout=60)
        assert p.returncode == 0, p.stderr
        run_id = p.stdout.decode().strip()
        lines = open(trace).read().splitlines()
        answer = next(i for i, ln in enumerate(lines) if 'write(1<' in ln and run_id in ln)
        synced = [ln for ln in lines[:answer] if ("fsync(" in ln or "fdatasync(" in ln) and "qlagent.db-wal>" in ln]
    finally:
        service.close()
    assert synced, "the Run ID was printed before the WAL holding the Run was synced"


def test_a_lock_held_past_the_busy_timeout_is_store_busy_and_writes_nothing(db):
    """SQLite's "database is locked" never leaves the adapter: it is UnavailableError(store_busy),
    after the injected busy timeout (50 ms here, not the 5 s default)."""
    s = SqliteStore(db, busy_timeout_ms=50)
    holder = sqlite3.connect(db, isolation_level=None)
    try:
        holder.execute("BEGIN IMMEDIATE")
        with pytest.raises(UnavailableError) as e:
            s.add_tasks(s.project.project_id, [prepared("a")])
        assert e.value.code == "store_busy" and e.value.exit_code == 5
        assert not isinstance(e.value.__cause__, sqlite3.Error) and e.value.__suppress_context__
        holder.execute("ROLLBACK")
        assert [h.name for h in s.add_tasks(s.project.project_id, [prepared("a")])] == ["a"]
    finally:
        holder.close()
        s.close()


def test_failed_write_rolls_back_everything(store, db):
    def tx(c):
        defs.add_task(c, store.project.project_id, prepared("a"), now_us())
        raise RuntimeError("boom")
    with pytest.raises(RuntimeError):
        store.write(tx)
    assert count(db, "tasks") == count(db, "task_revisions") == count(db, "context_recipes") == 0


# ---- append-only definitions ---------------------------------------------------------------

def test_same_content_appended_twice_is_one_row(store, db):
    pid = store.project.project_id
    p = prepared()
    head = store.write(lambda c: defs.add_task(c, pid, p, now_us()))
    assert store.write(lambda c: defs.append_recipe(c, p, now_us())) is False
    assert store.write(lambda c: defs.append_execution_revision(c, head.task_id, 1, p, now_us())) is False
    store.write(lambda c: defs._append_revision(c, head.task_id, 1, p, now_us()))
    # an edit with identical content is a no-op: no revision 2
    same = DefinitionWriter(store).edit("t", 1, head.content_digest, prepared())
    assert same.revision == 1
    assert [count(db, t) for t in ("task_revisions", "execution_revisions", "context_recipes")] == [1, 1, 1]
    # another task with the same environment shares the content-addressed recipe row
    store.write(lambda c: defs.add_task(c, pid, prepared("u", argv=("/bin/true",)), now_us()))
    assert count(db, "context_recipes") == 1 and count(db, "task_revisions") == 2


def test_different_content_under_the_same_key_conflicts(store, db):
    pid = store.project.project_id
    head = store.write(lambda c: defs.add_task(c, pid, prepared(), now_us()))
    other = prepared(argv=("/bin/echo", "two"))
    before = [count(db, t) for t in ("task_revisions", "execution_revisions", "context_recipes")]
    with pytest.raises(ConflictError) as ei:
        store.write(lambda c: defs.append_execution_revision(c, head.task_id, 1, other, now_us()))
    assert ei.value.code == "execution_revision_conflict"
    with pytest.raises(ConflictError) as ei:
        store.write(lambda c: defs._append_revision(c, head.task_id, 1, other, now_us()))
    assert ei.value.code == "revision_conflict"
    forged = msgspec.structs.replace(prepared(env={"A": "2"}), recipe_ref=prepared().recipe_ref)
    with pytest.raises(ConflictError) as ei:
        store.write(lambda c: defs.append_recipe(c, forged, now_us()))
    assert ei.value.code == "recipe_conflict"
    assert [count(db, t) for t in ("task_revisions", "execution_revisions", "context_recipes")] == before


def test_immutable_tables_refuse_updates(store):
    pid = store.project.project_id
    store.write(lambda c: defs.add_task(c, pid, prepared(), now_us()))
    for sql in ("UPDATE execution_revisions SET spec_json = '{}'", "UPDATE context_recipes SET recipe_json = '{}'"):
        with pytest.raises(sqlite3.IntegrityError, match="append-only"):
            store.write(lambda c, q=sql: c.execute(q))


# ---- serialisation -------------------------------------------------------------------------

def test_concurrent_writers_from_threads_are_serialised(db):
    """Threads on one authority and a second authority (another 'process' view) on the same file:
    every write lands, none sees "database is locked"."""
    a, b = SqliteStore(db), SqliteStore(db)
    errors: list[BaseException] = []
    start = threading.Barrier(8)

    def worker(i: int) -> None:
        store = a if i % 2 else b
        writer = DefinitionWriter(store)
        start.wait()
        try:
            for j in range(15):
                writer.add([prepared(f"w{i}-{j}", argv=("/bin/echo", str(i), str(j)))])
        except BaseException as e:  # collected and asserted below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    a.close()
    b.close()
    assert errors == []
    assert count(db, "tasks") == 120 and count(db, "task_revisions") == 120


def test_authority_runs_every_operation_on_its_own_thread(store):
    names = {store.read(lambda c: threading.current_thread().name) for _ in range(3)}
    names |= {store.write(lambda c: threading.current_thread().name)}
    assert names == {"sqlite-authority"}
    with pytest.raises(RuntimeError, match="nested"):
        store.read(lambda c: store.read(lambda c2: 1))


def test_cli_never_migrates_under_a_running_service(db, monkeypatch, tmp_path):
    """Only `init` and the service migrate: a newer CLI refuses (exit 5, one clear line) a store
    whose schema is behind instead of changing it under an older running agent."""
    every = migrations.known_migrations()
    monkeypatch.setattr(migrations, "known_migrations", lambda: every[:-1])
    SqliteStore(db).close()                                # an "older" agent's store
    monkeypatch.undo()
    state = os.path.dirname(db)
    p = run_cli("--state-dir", state, "task", "ls", text=True)
    assert p.returncode == 5 and "Traceback" not in p.stderr, p.stderr
    assert "migration" in p.stderr and "qlagent init" in p.stderr
    with sqlite3.connect(db) as c:
        assert c.execute("SELECT max(version) FROM schema_migrations").fetchone()[0] == every[-2].version
    p = run_cli("--state-dir", state, "init", text=True)
    assert p.returncode == 0, p.stderr
    with sqlite3.connect(db) as c:
        assert c.execute("SELECT max(version) FROM schema_migrations").fetchone()[0] == every[-1].version
