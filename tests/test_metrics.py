"""GET /metrics (issue 26 §3): our Prometheus text writer read back by prometheus_client's parser,
a real ``qlagent serve`` whose figures move when a Run runs, its document passing Prometheus's
own linter (``promtool check metrics``: names, units, ``_total``) and scraped by a real
Prometheus server (Debian's ``prometheus``, which tests/run installs)."""

from __future__ import annotations

import http.client
import json
import os
import shutil
import signal
import subprocess
import tempfile
import urllib.parse
import uuid

import pytest
from prometheus_client.parser import text_string_to_metric_families

from qlagent.core.metrics import CONTENT_TYPE, COUNTER, GAUGE, Family, render
from qlagent.core.states import RunState
from kit import free_port, promtool_check, wait_until
from qlcli import ok
from test_http_api import BASE, Agent, await_state, head, start_body, token

TASK = """
[[task]]
name = "tick"
schedule = "0 3 * * *"
timeout_s = 30
shell = "/bin/sh"
script = 'echo tick'

[[task]]
name = "wide"
concurrency = "parallel"
memory_max = "50M"
shell = "/bin/sh"
script = 'sleep 2'

[[task]]
name = "hog"
memory_max = "70M"
shell = "/bin/sh"
script = 'x=$(head -c 24000000 /dev/zero | tr "\\0" x); sleep 4; echo ${#x}'
"""


def parse(text: str) -> dict[str, list]:
    """name (as the parser names it: a counter without ``_total``) → its samples."""
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


def test_writer_output_parses_with_escaped_label_values_and_help():
    odd = 'a "quoted" \\ back\nslash'
    text = render([
        Family("x_runs", GAUGE, "Runs by state\nsecond line \\ kept").add(3, state=odd).add(0, state="b"),
        Family("x_refusals_total", COUNTER, "Refusals").add(7, reason="pids"),
        Family("x_rss_bytes", GAUGE, "Bytes").add(1.5e9),
    ]).decode()
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    assert fams["x_runs"].documentation == "Runs by state\nsecond line \\ kept"
    assert [(s.labels["state"], s.value) for s in fams["x_runs"].samples] == [(odd, 3), ("b", 0)]
    assert fams["x_refusals"].type == "counter"
    assert [(s.name, s.value) for s in fams["x_refusals"].samples] == [("x_refusals_total", 7)]
    assert fams["x_rss_bytes"].samples[0].value == 1.5e9
    with pytest.raises(ValueError):
        Family("x_refusals", COUNTER, "a counter must end in _total")
    with pytest.raises(ValueError):
        Family("x_total", GAUGE, "a gauge must not")
    with pytest.raises(ValueError):
        Family("x", GAUGE, "h").add(1, **{"bad-name": "v"})


@pytest.fixture(scope="module")
def agent_env():
    base = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
    root = tempfile.mkdtemp(prefix="qlagent-metrics-", dir=base)
    state = os.path.join(root, "state")
    ok(state, "init")
    tf = os.path.join(root, "tasks.toml")
    with open(tf, "w") as f:
        f.write(TASK)
    ok(state, "task", "add", "-f", tf)
    tok = token(state, "alice", "operator")
    cfg = os.path.join(root, "qlagent.toml")
    with open(cfg, "w") as f:
        # edge: Runs may hold 80 MiB, so two "wide" Runs (50 MiB each) cannot run at once.
        f.write('profile = "edge"\n[http]\nmetrics = true\n')
    agent = Agent(state, config=cfg)
    yield agent, state, tok, root
    agent.stop()
    shutil.rmtree(root, ignore_errors=True)


def scrape(agent: Agent) -> dict[str, list]:
    status, headers, data = agent.request("GET", "/metrics")
    assert status == 200, data
    assert headers["content-type"] == CONTENT_TYPE
    promtool_check(data.decode())
    return parse(data.decode())


def by_label(samples, label: str) -> dict[str, float]:
    return {s.labels[label]: s.value for s in samples}


def test_local_agent_metrics_are_present_and_move_with_a_run(agent_env):
    agent, state, tok, _ = agent_env
    before = scrape(agent)
    for name in ("qlagent_runs", "qlagent_runs_live", "qlagent_artifact_bytes", "qlagent_service_memory_bytes",
                 "qlagent_service_memory_limit_bytes", "qlagent_service_pids", "qlagent_service_pids_limit"):
        assert name in before, name
    assert "qlagent_admission_refusals" in before
    runs = by_label(before["qlagent_runs"], "state")
    assert set(runs) == set(RunState.ALL)
    assert before["qlagent_service_memory_bytes"][0].value > 1_000_000
    assert before["qlagent_service_pids"][0].value >= 1

    h = head(agent, tok, "tick")
    status, doc = agent.json("POST", f"{BASE}/tasks/tick/runs", tok,
                             start_body(h["revision"], h["contentDigest"], str(uuid.uuid4())))
    assert status == 202, doc
    await_state(agent, tok, doc["runId"], {RunState.SUCCEEDED})
    after = scrape(agent)
    moved = by_label(after["qlagent_runs"], "state")
    assert moved[RunState.SUCCEEDED] == runs[RunState.SUCCEEDED] + 1
    assert after["qlagent_artifact_bytes"][0].value > before["qlagent_artifact_bytes"][0].value


def test_admission_refusals_live_runs_and_the_service_tree_move_under_load(agent_env):
    """Two "wide" Runs at once: the second waits for the first's memory reservation
    (``run.waiting memory_reserved``), counted by reason while the first's process tree is
    live in the service's figures."""
    agent, _, tok, _ = agent_env
    before = scrape(agent)
    refusals = by_label(before["qlagent_admission_refusals"], "reason").get("memory_reserved", 0)
    pids = before["qlagent_service_pids"][0].value
    h = head(agent, tok, "wide")
    ids = []
    for _ in range(2):
        status, doc = agent.json("POST", f"{BASE}/tasks/wide/runs", tok,
                                 start_body(h["revision"], h["contentDigest"], str(uuid.uuid4())))
        assert status == 202, doc
        ids.append(doc["runId"])

    def busy():
        # (a Run is live from its activation, before its shim has forked the task; and the
        # baseline may still hold the previous test's shim, lingering for its output)
        m = scrape(agent)
        waited = by_label(m["qlagent_admission_refusals"], "reason").get("memory_reserved", 0)
        return m if waited == refusals + 1 and m["qlagent_runs_live"][0].value == 1 \
            and m["qlagent_service_pids"][0].value > pids else None
    during = wait_until(busy, 20, "one wide Run live, the other counted waiting for memory_reserved, "
                                  "the service tree holding more tasks")
    assert by_label(during["qlagent_runs"], "state")[RunState.QUEUED] >= 1
    for run_id in ids:
        await_state(agent, tok, run_id, {RunState.SUCCEEDED})
    after = scrape(agent)
    assert after["qlagent_runs_live"][0].value == 0


def test_service_memory_follows_a_run_holding_memory(agent_env):
    """A Run whose shell holds a 24 MB string: the service tree's memory (cgroup, else the PSS
    of the agent and its Runs) grows by most of it while it runs, and shrinks once it ends."""
    agent, _, tok, _ = agent_env
    idle = scrape(agent)["qlagent_service_memory_bytes"][0].value
    h = head(agent, tok, "hog")
    status, doc = agent.json("POST", f"{BASE}/tasks/hog/runs", tok,
                             start_body(h["revision"], h["contentDigest"], str(uuid.uuid4())))
    assert status == 202, doc
    wait_until(lambda: scrape(agent)["qlagent_service_memory_bytes"][0].value >= idle + 16_000_000, 20,
               "the service tree's memory up by the Run's 24 MB")
    await_state(agent, tok, doc["runId"], {RunState.SUCCEEDED})
    wait_until(lambda: scrape(agent)["qlagent_service_memory_bytes"][0].value < idle + 16_000_000, 20,
               "the memory given back once the Run ended")


def _query(port: int, promql: str) -> list[dict]:
    """The result vector of an instant query to Prometheus's HTTP API on ``port``."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", "/api/v1/query?" + urllib.parse.urlencode({"query": promql}))
        doc = json.loads(conn.getresponse().read())
    finally:
        conn.close()
    assert doc["status"] == "success", doc
    return doc["data"]["result"]


def _ready(port: int) -> bool:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", "/-/ready")
        return conn.getresponse().status == 200
    except ConnectionRefusedError:      # not listening yet
        return False
    finally:
        conn.close()


def test_a_prometheus_server_scrapes_the_local_agent(agent_env):
    agent, _, _, root = agent_env
    d = os.path.join(root, "prometheus")
    os.mkdir(d)
    port = free_port()
    with open(os.path.join(d, "prometheus.yml"), "w") as f:
        f.write("global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\nscrape_configs:\n  - job_name: qlagent\n"
                f"    static_configs:\n      - targets: ['127.0.0.1:{agent.port}']\n")
    log = open(os.path.join(d, "prometheus.log"), "wb")
    server = subprocess.Popen(["prometheus", f"--config.file={d}/prometheus.yml", f"--storage.tsdb.path={d}/data",
                               f"--web.listen-address=127.0.0.1:{port}"], stdout=log, stderr=log)
    try:
        detail = lambda: open(os.path.join(d, "prometheus.log"), errors="replace").read()[-2000:]  # noqa: E731
        def running() -> bool:
            assert server.poll() is None, detail()
            return True
        wait_until(lambda: running() and _ready(port), 60, "Prometheus ready", detail=detail)
        # up == 1: Prometheus fetched /metrics and its own parser took every line of it.
        up = wait_until(lambda: running() and _query(port, 'up{job="qlagent"}'), 60,
                        "Prometheus's first scrape of the agent", detail=detail)
        assert up[0]["value"][1] == "1", up
        assert up[0]["metric"]["instance"] == f"127.0.0.1:{agent.port}"
        (pids,) = wait_until(lambda: _query(port, "qlagent_service_pids"), 30, "qlagent_service_pids ingested",
                             detail=detail)
        assert float(pids["value"][1]) >= 1
        states = {r["metric"]["state"] for r in _query(port, "qlagent_runs")}
        assert states == set(RunState.ALL)
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(30)
        log.close()


def test_metrics_are_off_unless_configured(tmp_path):
    state = str(tmp_path / "state")
    ok(state, "init")
    agent = Agent(state)
    try:
        status, doc = agent.json("GET", "/metrics")
        assert status == 404 and doc["code"] == "not_found", doc
    finally:
        agent.stop()
