"""Issue 21 §4: one time source for the cluster; a scheduled Run is never created before its
instant by the database's clock (ADR-0376 §2: the Run's time is the server's, from the database).

The replica's reading of the database clock can come back late (a slow return leg): a Scheduler
planning on that reading must still leave the instant to the authority, which refuses a fire
its own clock has not reached. Two real ``qlagent serve`` replicas on one
PostgreSQL database fire a ``*/5 * * * * *`` Task; one runs under libfaketime ``FAKETIME="+60s"``
(its wall clock 60 s ahead). No Run is created before its instant (database time), there is
one Run per instant, the healthy replica logs no ``clock.stepped_back``, and the skewed one
names itself and its offset (journal, ``/readyz``, ``doctor``).

libfaketime 0.9.10 fakes CLOCK_MONOTONIC with the same offset (its ``FAKETIME_DONT_FAKE_MONOTONIC``
mode makes Python's ``time.sleep`` fail with EINVAL) but does not wrap glibc's newer
``sem_clockwait``/``pthread_cond_clockwait``, so every timed wait of a thread would last 60 s
longer. A 30-line preload compiled here (``clockwait.c``) turns those absolute deadlines back to
the real clock before passing them on: the realtime clock stays faked, every wait keeps its length.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import tempfile
import time
import urllib.request

import msgspec
import psycopg
import pytest

from conftest import create_database, db_url, drop_database, sql
from test_cluster_e2e import Node, Proc
from kit import clean_env, free_port, run_cli, wait_until
from qlagent.adapters.postgres.store import PgStore
from qlagent.core.dbclock import DatabaseClock
from qlagent.core.definitions import TaskInput, prepare_task
from qlagent.service.scheduler import Scheduler

TASKS = """
[[task]]
name = "tick"
shell = "/bin/sh"
script = "true"
schedule = "*/5 * * * * *"
concurrency = "parallel"
"""
SKEW_S = 60
WATCH_S = 30

CLOCKWAIT_C = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <semaphore.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

/* The faked clock's absolute deadline as the real clock's. */
static struct timespec to_real(clockid_t clk, const struct timespec *abs) {
    struct timespec fake, real, out;
    clock_gettime(clk, &fake);                       /* through libfaketime */
    syscall(SYS_clock_gettime, clk, &real);          /* the kernel's */
    long long ns = (long long)abs->tv_sec * 1000000000LL + abs->tv_nsec
                 - ((long long)fake.tv_sec * 1000000000LL + fake.tv_nsec)
                 + ((long long)real.tv_sec * 1000000000LL + real.tv_nsec);
    out.tv_sec = ns / 1000000000LL;
    out.tv_nsec = ns % 1000000000LL;
    return out;
}

int sem_clockwait(sem_t *s, clockid_t clk, const struct timespec *abs) {
    int (*next)(sem_t *, clockid_t, const struct timespec *) = dlsym(RTLD_NEXT, "sem_clockwait");
    struct timespec r = to_real(clk, abs);
    return next(s, clk, &r);
}

int pthread_cond_clockwait(pthread_cond_t *c, pthread_mutex_t *m, clockid_t clk, const struct timespec *abs) {
    int (*next)(pthread_cond_t *, pthread_mutex_t *, clockid_t, const struct timespec *) =
        dlsym(RTLD_NEXT, "pthread_cond_clockwait");
    struct timespec r = to_real(clk, abs);
    return next(c, m, clk, &r);
}
"""


def _libfaketime() -> str:
    found = glob.glob("/usr/lib/*/faketime/libfaketime.so.1")
    if not found:
        pytest.fail("libfaketime not installed (apt-get install libfaketime)", pytrace=False)
    return found[0]


@pytest.fixture
def env():
    name = create_database("clock")
    root = tempfile.mkdtemp(prefix="qlagent-clock-")
    src = os.path.join(root, "clockwait.c")
    with open(src, "w") as f:
        f.write(CLOCKWAIT_C)
    shim = os.path.join(root, "clockwait.so")
    subprocess.run(["gcc", "-shared", "-fPIC", "-O2", "-o", shim, src, "-ldl"], check=True, capture_output=True,
                   timeout=60)
    skewed = {**clean_env(), "LD_PRELOAD": f"{shim} {_libfaketime()}", "FAKETIME": f"+{SKEW_S}s"}
    yield db_url(name), root, skewed
    shutil.rmtree(root, ignore_errors=True)
    drop_database(name)


LATE_S = 0.6      # the database takes its clock reading this long after the request left
LATE_READING = "SELECT pg_sleep(%s), ql_now_us()"   # the target list runs in order: hold, then read


@pytest.fixture
def late_clock():
    """A PgStore on a database of this test alone with one Task firing every second, and a
    ``DatabaseClock`` whose every reading is taken ``LATE_S`` into its round trip (a slow forward leg)."""
    name = create_database("early")
    store = PgStore(db_url(name), pool_size=2)
    store.add_tasks(store.project.project_id, [prepare_task(msgspec.convert(
        {"name": "tick", "shell": "/bin/sh", "script": "true", "schedule": "* * * * * *", "concurrency": "parallel"},
        TaskInput))])
    conn = psycopg.connect(db_url(name), autocommit=True)
    clock = DatabaseClock(lambda: conn.execute(LATE_READING, (LATE_S,)).fetchone()[1])
    try:
        yield store, clock, db_url(name)
    finally:
        conn.close()
        store.close()
        drop_database(name)


def _runs(url: str) -> list:
    return sql(url, "SELECT scheduled_for_us, created_at_us FROM runs ORDER BY scheduled_for_us")


def test_a_scheduler_planning_on_a_reading_taken_late_creates_no_run_before_its_instant(late_clock):
    """The estimate (``now_us``) runs ``LATE_S / 2`` ahead of the database: the Scheduler finds
    the instant due that early, the store refuses the fire (``early``, nothing written, the
    Task due again at that instant), and the Run it creates once the database's clock is there
    is stamped at or after its instant."""
    store, clock, url = late_clock
    assert clock.sync()
    journal: list[tuple] = []
    scheduler = Scheduler(store, "UTC", clock.now_us, lambda *e, **f: journal.append((e[1], f)))
    scheduler.reload()
    scheduler.fire_due()                   # first look: the cursor
    instant = scheduler.next_wake_us
    wait_until(lambda: clock.now_us() >= instant, what="the estimate at the instant")
    assert (scheduler.fire_due(), scheduler.clock_ahead, scheduler.next_wake_us) == (0, True, instant)
    assert ("schedule.early", {"task": "tick", "instant_us": instant}) in journal and _runs(url) == []
    wait_until(lambda: scheduler.fire_due(), what="the instant's Run")
    ((scheduled, created),) = _runs(url)
    assert scheduled == instant <= created and not scheduler.clock_ahead


def test_the_time_a_replica_plans_on_is_one_the_database_has_reached(late_clock):
    """``reached_us`` (the control plane's planning clock) of the same late reading is never
    ahead of the database's clock read after it, and the Scheduler planning on it fires the
    instant without a refusal."""
    store, clock, url = late_clock
    assert clock.sync()
    planned = clock.reached_us()
    assert planned <= sql(url, "SELECT ql_now_us()")[0][0]
    scheduler = Scheduler(store, "UTC", clock.reached_us)
    scheduler.reload()
    scheduler.fire_due()
    instant = scheduler.next_wake_us
    wait_until(lambda: scheduler.fire_due() or scheduler.clock_ahead, what="the instant fired or refused")
    assert not scheduler.clock_ahead
    ((scheduled, created),) = _runs(url)
    assert scheduled == instant <= created


@pytest.mark.slow
def test_a_replica_whose_clock_is_60_s_ahead_fires_nothing_early_and_names_itself(env):
    url, root, skewed_env = env
    cfg = f'[cluster]\ndatabase = "{url}"\npool_size = 4\nsweep_interval_s = 1\n'
    healthy_node, skewed_node = Node(root, "healthy", cfg), Node(root, "skewed", cfg)
    healthy_node.ok("init")
    with open(os.path.join(root, "tasks.toml"), "w") as f:
        f.write(TASKS)
    healthy_node.ok("task", "add", "-f", os.path.join(root, "tasks.toml"))
    skewed_port = free_port()
    healthy = Proc(healthy_node, "--listen", f"127.0.0.1:{free_port()}")
    skewed = Proc(skewed_node, "--listen", f"127.0.0.1:{skewed_port}", env=skewed_env)
    try:
        healthy.wait_line("service.ready")
        skewed.wait_line("service.ready")
        started = sql(url, "SELECT ql_now_us()")[0][0]
        time.sleep(WATCH_S)
        rows = sql(url, "SELECT scheduled_for_us, created_at_us FROM runs WHERE created_at_us >= %s "
                         "ORDER BY scheduled_for_us", (started,))
        early = [(s, c) for s, c in rows if c < s]
        instants = [s for s, _ in rows]
        assert len(rows) >= WATCH_S // 5 - 1 and not early, (rows, "".join(skewed.lines))
        assert len(set(instants)) == len(instants) and all(b - a == 5_000_000 for a, b in zip(instants, instants[1:])), \
            instants
        assert not [ln for ln in healthy.lines if "clock.stepped_back" in ln or "clock.skewed" in ln], healthy.lines
        line = skewed.wait_line("clock.skewed")
        assert f"replica={os.uname().nodename}/{skewed.proc.pid}" in line, line
        assert "offset_s=+60.0" in line or "offset_s=+59.9" in line, line
        assert len([ln for ln in skewed.lines if "clock.skewed" in ln]) == 1, "rate-limited: once per 5 minutes"
        with urllib.request.urlopen(f"http://127.0.0.1:{skewed_port}/readyz", timeout=10) as r:
            clock = json.loads(r.read())["clock"]
        assert clock["skewed"] and 59 <= clock["offsetS"] <= 61 and clock["boundS"] == 2, clock
        doctor = run_cli(*skewed_node.scope, "doctor", env=skewed_env)
        out = doctor.stdout.decode() + doctor.stderr.decode()
        assert doctor.returncode != 0 and ("+60.0" in out or "+59.9" in out) and "bound ±2 s" in out, out
        ok = run_cli(*healthy_node.scope, "doctor")
        assert "bound ±2 s" in ok.stdout.decode() + ok.stderr.decode()
    finally:
        healthy.stop()
        skewed.stop()
