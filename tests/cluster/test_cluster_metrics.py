"""GET /metrics on a control-plane replica (issue 26 §3): a real ``qlagent serve`` with
``[cluster]`` on PostgreSQL, scraped over loopback, read by prometheus_client's parser and linted
by ``promtool check metrics``."""

from __future__ import annotations

import http.client
import json
import os
import secrets
import shutil
import tempfile
import threading
import time
import urllib.parse
import uuid

import psycopg
import pytest
from prometheus_client.parser import text_string_to_metric_families

from conftest import ADMIN_URL
from cpkit import Client
from kit import promtool_check, wait_until
from qlagent.core.metrics import CONTENT_TYPE
from qlagent.core.states import RunState
from test_cluster_serve import BASE, TASKS, Env, Replica, _head, body

FAMILIES = ("qlagent_runs", "qlagent_task_starts", "qlagent_offers", "qlagent_queue_depth",
            "qlagent_queue_oldest_age_seconds", "qlagent_pulls_waiting", "qlagent_sweeper_passes",
            "qlagent_lease_expiries", "qlagent_session_expiries", "qlagent_pool_connections", "qlagent_pool_in_use",
            "qlagent_pool_waiting", "qlagent_store_errors")


@pytest.fixture(scope="module")
def replica(pg_url):
    base = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
    root = tempfile.mkdtemp(prefix="qlagent-cpm-", dir=base)
    # Short Session and Lease lives: a Worker that stops heartbeating is expired within seconds.
    env = Env(root, pg_url, "sweep_interval_s = 0.5\nsession_ttl_s = 10\nlease_ttl_s = 12\n[http]\nmetrics = true\n")
    env.define(TASKS)
    tok = env.ok("token", "create", "--subject", "alice", "--role", "operator").strip()
    r = Replica(env)
    yield r, tok, env
    assert r.stop() == 0
    shutil.rmtree(root, ignore_errors=True)


def scrape(replica) -> dict:
    conn = http.client.HTTPConnection("127.0.0.1", replica.port, timeout=30)
    try:
        conn.request("GET", "/metrics")
        resp = conn.getresponse()
        data = resp.read()
        assert resp.status == 200, data
        assert resp.getheader("Content-Type") == CONTENT_TYPE
    finally:
        conn.close()
    promtool_check(data.decode())
    return {f.name: f for f in text_string_to_metric_families(data.decode())}


def value(fams, name: str, **labels) -> float:
    return sum(s.value for s in fams[name].samples
               if s.name in (name, name + "_total") and all(s.labels.get(k) == v for k, v in labels.items()))


def test_replica_metrics_are_present_and_move_with_a_task_start(replica):
    r, tok, _ = replica
    before = scrape(r)
    for name in FAMILIES:
        assert name in before, name
    assert {s.labels["state"] for s in before["qlagent_runs"].samples} == set(RunState.ALL_CLUSTER)
    assert value(before, "qlagent_pool_connections") >= 1
    status, doc = r.request("POST", f"{BASE}/tasks/hello/runs", body(_head(r, tok, "hello")), tok)
    assert status == 202, doc
    time.sleep(1.2)     # two sweeper passes at sweep_interval_s = 0.5; the queued Run ages
    after = scrape(r)
    assert value(after, "qlagent_task_starts", code="202") == value(before, "qlagent_task_starts", code="202") + 1
    assert value(after, "qlagent_runs", state=RunState.QUEUED) == value(before, "qlagent_runs",
                                                                        state=RunState.QUEUED) + 1
    assert value(after, "qlagent_queue_depth") == value(before, "qlagent_queue_depth") + 1
    assert value(after, "qlagent_queue_oldest_age_seconds") >= 1.0
    assert value(after, "qlagent_sweeper_passes") > value(before, "qlagent_sweeper_passes")


class HandWorker:
    """A Worker driven by hand over HTTP: enrolled by the CLI as ``name`` with 8 slots (a Worker
    without a free slot is answered at once), its Session open. ``beat()`` heartbeats naming no
    Lease; ``pull(wait_s)`` beats, then Pulls (the Session, 10 s, lives while a test drives it);
    ``pull_on(link, wait_s)`` Pulls on another connection (``link()``) without the beat;
    ``remove()`` closes the Session at once (``workers rm``) rather than leaving it to expire
    during a later test."""

    def __init__(self, r, env, name: str) -> None:
        enrolled = json.loads(env.ok("workers", "enroll", name, "--slots", "8", "--json"))
        self.worker_id, self.name, self.env, self.port = enrolled["workerId"], name, env, r.port
        self.creds = {"worker_id": self.worker_id, "credential": enrolled["credential"]}
        self.c = self.link()
        status, _, grant, _ = self.c.post("sessions", {})
        assert status == 201, grant
        self.fence = {"sessionId": grant["sessionId"], "generation": grant["generation"]}

    def beat(self) -> None:
        st, _, answer, _ = self.c.post("heartbeat", {**self.fence, "leases": []})
        assert st == 200, answer

    def link(self) -> Client:
        return Client(self.port, self.creds)

    def pull(self, wait_s: int) -> dict:
        self.beat()
        return self.pull_on(self.c, wait_s)

    def pull_on(self, link: Client, wait_s: int) -> dict:
        st, _, raw = link.call("POST", f"/api/v3/cluster/workers/{self.worker_id}/pull?waitS={wait_s}",
                               {**self.fence, "pullId": str(uuid.uuid4()), "leaseToken": secrets.token_urlsafe(32)})
        assert st == 200, raw
        return json.loads(raw)

    def remove(self) -> None:
        self.env.ok("workers", "rm", self.name)

    def close(self) -> None:
        self.c.close()


def test_replica_metrics_move_with_a_worker_pulling_then_going_silent(replica):
    """A Worker over HTTP (enrolled by the CLI): its waiting long-poll is counted, each claim is
    an offer, and once it stops heartbeating the sweeper expires its Session and its Leases."""
    r, tok, env = replica
    w = HandWorker(r, env, "metrics-w")
    try:
        before = scrape(r)
        # Two Tasks of their own: a Task's next Run waits while its last one holds a Lease
        # (concurrency = "single", the default).
        assert r.request("POST", f"{BASE}/tasks/racer/runs", body(_head(r, tok, "racer")), tok)[0] == 202
        claimed = 0
        while w.pull(0)["status"] == "offered":    # this Run and any an earlier test left queued
            claimed += 1
        assert claimed >= 1
        answer: dict = {}
        waiter = threading.Thread(target=lambda: answer.update(w.pull(20)))
        waiter.start()
        wait_until(lambda: value(scrape(r), "qlagent_pulls_waiting") == 1, 10, "one Pull long-polling",
                   detail=lambda: answer)
        assert r.request("POST", f"{BASE}/tasks/fenced/runs", body(_head(r, tok, "fenced")), tok)[0] == 202
        waiter.join(20)
        assert answer.get("status") == "offered", answer      # the thread failed otherwise (its warning)
        claimed += 1
        after = scrape(r)
        assert value(after, "qlagent_offers") == value(before, "qlagent_offers") + claimed
        assert value(after, "qlagent_pulls_waiting") == 0
        assert value(after, "qlagent_queue_depth") == 0
        # No heartbeat from here: the Session (10 s) and then each Lease (12 s, which the Tasks'
        # 5 s grace must fit in) run out.
        wait_until(lambda: value(scrape(r), "qlagent_lease_expiries") >= value(before, "qlagent_lease_expiries")
                   + claimed, 30, "the silent Worker's Leases expired")
        final = scrape(r)
        assert value(final, "qlagent_session_expiries") > value(before, "qlagent_session_expiries")
        assert value(final, "qlagent_store_errors") == value(before, "qlagent_store_errors")
    finally:
        w.close()


LOOP_DUTIES = ("scheduler", "sweeper", "placement_report", "task_reload")


def test_store_errors_count_the_duties_and_requests_failed_while_the_database_was_gone(replica):
    """PostgreSQL ends every backend of the replica and takes no new one for a while (as a
    restart does): the loop duties failing meanwhile, and a Worker's heartbeat, a Task Start
    and a scrape answered 503 for want of the database, are counted by source and error code,
    seen at the first scrape once the database is back (a scrape needs it: 503
    ``store_unavailable`` while it is gone, which Prometheus records as the target down), and
    the sweeper goes on."""
    r, tok, env = replica
    w = HandWorker(r, env, "outage-w")
    start = body(_head(r, tok, "hello"))
    before = scrape(r)
    name = urllib.parse.urlsplit(env.url).path.lstrip("/")
    seen = len(r.lines)
    try:
        with psycopg.connect(ADMIN_URL, autocommit=True) as admin:
            # Refused to every role, superusers too, until allowed again: the pool cannot reconnect.
            admin.execute(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS false')
            try:
                admin.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s", (name,))
                wait_until(lambda: any("store.unavailable" in ln for ln in r.lines[seen:]), 20,
                           "a loop duty failing while the database is gone", detail=lambda: "".join(r.lines[seen:]))
                conn = http.client.HTTPConnection("127.0.0.1", r.port, timeout=30)
                try:
                    conn.request("GET", "/metrics")
                    resp = conn.getresponse()
                    assert (resp.status, json.loads(resp.read())["code"]) == (503, "store_unavailable")
                finally:
                    conn.close()
                st, _, answer, _ = w.c.post("heartbeat", {**w.fence, "leases": []})
                assert (st, answer["error"]) == (503, "cluster_unavailable"), answer
                st, answer = r.request("POST", f"{BASE}/tasks/hello/runs", start, tok)
                assert (st, answer["code"]) == (503, "task_start_unavailable"), answer
                # The cause, as the read routes name it: not a bare "retry later".
                assert "store_unavailable: cluster database unavailable" in answer["message"], answer
            finally:
                admin.execute(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS true')

        def back() -> dict | None:
            try:
                fams = scrape(r)
            except AssertionError:          # a pooled connection from the outage, not yet replaced
                return None
            return fams if value(fams, "qlagent_sweeper_passes") > value(before, "qlagent_sweeper_passes") + 1 \
                else None
        after = wait_until(back, 30, "the sweeper passing again", detail=lambda: "".join(r.lines[seen:]))
    finally:
        w.close()
        w.remove()

    def failed(fams, *sources: str) -> float:
        return sum(value(fams, "qlagent_store_errors", source=s) for s in sources)
    assert failed(after, *LOOP_DUTIES) > failed(before, *LOOP_DUTIES)
    for source in ("heartbeat", "task_start", "metrics"):
        assert failed(after, source) == failed(before, source) + 1, source
    codes = {s.labels["code"] for s in after["qlagent_store_errors"].samples if s.labels["source"] == "heartbeat"}
    assert codes <= {"unavailable", "store_unavailable"}, codes


def test_pool_in_use_counts_a_task_start_parked_on_its_tasks_row(replica):
    """A Task Start waiting in PostgreSQL (its Task's row held by this test) holds a pooled
    connection: a scrape meanwhile shows one more in use, and one fewer once it is answered."""
    r, tok, env = replica
    req = body(_head(r, tok, "hello"))
    # A sweeper pass or a Pull may hold a connection for a moment: the baseline is the least seen.
    idle = min(value(scrape(r), "qlagent_pool_in_use") for _ in range(5))
    with psycopg.connect(env.url) as holder:
        holder.execute("SELECT 1 FROM tasks WHERE name = 'hello' FOR UPDATE")
        answer: dict = {}
        t = threading.Thread(target=lambda: answer.update(
            start=r.request("POST", f"{BASE}/tasks/hello/runs", req, tok)))
        t.start()
        parked = ("SELECT 1 FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND datname = current_database()"
                  " AND pid <> pg_backend_pid()")
        wait_until(lambda: env.sql(parked), 10, "the Task Start parked on the Task's row")
        assert value(scrape(r), "qlagent_pool_in_use") >= idle + 1
        holder.commit()
    t.join(30)
    assert answer["start"][0] == 202, answer
    wait_until(lambda: value(scrape(r), "qlagent_pool_in_use") <= idle, 10, "the parked connection back in the pool")


def test_pool_waiting_counts_requests_queued_for_a_connection_while_long_polls_hold_the_pool(replica):
    """Four long-polling Pulls (two Workers, two each) parked on their Sessions' rows, which this
    test holds, take the whole pool (pool_size = 4); a fifth Pull, of a third Worker, then waits
    for a connection. Two scrapes meanwhile (the route threads' other two) report it waiting:
    the pool figures are read as a scrape arrives, before it waits for a connection itself (and
    whichever scrape re-reads the database clock first waits there, the other reads on). Once
    the rows are let go every request is answered and nothing waits."""
    r, _, env = replica
    workers = [HandWorker(r, env, f"pool-w{i}") for i in range(3)]
    parked_links = [(w, w.link()) for w in workers[:2] for _ in range(2)]
    waiter_link = workers[2].link()
    answers: dict = {}
    seen: list[dict] = []
    threads = [threading.Thread(target=lambda i=i, w=w, link=link: answers.update({i: w.pull_on(link, 1)}))
               for i, (w, link) in enumerate(parked_links)]
    threads.append(threading.Thread(target=lambda: answers.update(waiter=workers[2].pull_on(waiter_link, 1))))
    scrapes = [threading.Thread(target=lambda: seen.append(scrape(r))) for _ in range(2)]
    try:
        wait_until(lambda: value(scrape(r), "qlagent_pool_waiting") == 0, 10, "no request waiting for a connection")
        parked = ("SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND datname = current_database()"
                  " AND pid <> pg_backend_pid()")
        with psycopg.connect(env.url) as holder:
            holder.execute("SELECT 1 FROM worker_sessions WHERE session_id = ANY(%s) FOR UPDATE",
                           ([w.fence["sessionId"] for w in workers[:2]],))
            for t in threads[:4]:
                t.start()
            wait_until(lambda: env.sql(parked)[0][0] == 4, 20, "the pool's four connections parked on the Sessions")
            threads[4].start()
            # The loop hands each request to a thread; a sweeper pass may hold the loop meanwhile
            # for DUTY_WAIT_S (1 s) waiting for a connection too. Every wait ends at 5 s: the rows
            # are let go well before.
            time.sleep(1.5)
            for t in scrapes:
                t.start()
            time.sleep(1.5)
        for t in threads + scrapes:
            t.join(30)
        assert sorted(answers, key=str) == [0, 1, 2, 3, "waiter"], answers
        assert len(seen) == 2, "a scrape failed (its warning)"
        assert max(value(fams, "qlagent_pool_waiting") for fams in seen) >= 1
        assert max(value(fams, "qlagent_pool_in_use") for fams in seen) == 4
        wait_until(lambda: value(scrape(r), "qlagent_pool_waiting") == 0, 10, "nothing waiting once the rows are free")
    finally:
        for w in workers:
            w.close()
            w.remove()
        for _, link in parked_links:
            link.close()
        waiter_link.close()


def test_a_lease_its_worker_stops_naming_expires_and_is_counted_while_the_session_lives(replica):
    """A Worker that self-fences its run stops naming the Lease in its heartbeats and goes on
    heartbeating: the sweeper expires the Lease (``qlagent_lease_expiries_total``), not the
    Session — the replica's view of a self-fence."""
    r, tok, env = replica
    w = HandWorker(r, env, "fencer")
    try:
        assert r.request("POST", f"{BASE}/tasks/fenced/runs", body(_head(r, tok, "fenced")), tok)[0] == 202
        before = scrape(r)
        claimed = 0
        while w.pull(0)["status"] == "offered":     # this Run and any an earlier test left queued
            claimed += 1
        assert claimed >= 1

        def expired() -> dict | None:
            w.beat()                                # names no Lease: every run of this Worker self-fenced
            fams = scrape(r)
            return fams if value(fams, "qlagent_lease_expiries") >= value(before, "qlagent_lease_expiries") \
                + claimed else None
        after = wait_until(expired, 40, "the unnamed Leases expired (12 s)", step=1)
        assert value(after, "qlagent_session_expiries") == value(before, "qlagent_session_expiries")
        w.beat()                                    # the Session is still open
    finally:
        w.close()
