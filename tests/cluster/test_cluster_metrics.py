"""GET /metrics on a control-plane replica (issue 26 §3): a real ``qlagent serve`` with
``[cluster]`` on PostgreSQL, scraped over loopback, read by prometheus_client's parser and linted
by ``promtool check metrics``."""

from __future__ import annotations

import http.client
import os
import shutil
import tempfile
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kit import promtool_check
from qlagent.core.metrics import CONTENT_TYPE
from qlagent.core.states import RunState
from test_cluster_serve import BASE, TASKS, Env, Replica, _head, body

FAMILIES = ("qlagent_runs", "qlagent_task_starts", "qlagent_offers", "qlagent_queue_depth", "qlagent_queue_oldest_age_seconds",
            "qlagent_pulls_waiting", "qlagent_sweeper_passes", "qlagent_lease_expiries",
            "qlagent_session_expiries", "qlagent_pool_connections", "qlagent_pool_in_use", "qlagent_pool_waiting",
            "qlagent_store_errors")


@pytest.fixture(scope="module")
def replica(pg_url):
    base = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
    root = tempfile.mkdtemp(prefix="qlagent-cpm-", dir=base)
    env = Env(root, pg_url, "sweep_interval_s = 0.5\n[http]\nmetrics = true\n")
    env.define(TASKS)
    tok = env.ok("token", "create", "--subject", "alice", "--role", "operator").strip()
    r = Replica(env)
    yield r, tok
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
    r, tok = replica
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
