"""Attacks on a TLS replica (issue 21 §5–9), each against a real ``qlagent serve`` with
``[cluster]`` over HTTPS on loopback (a throwaway CA) and a fresh PostgreSQL database: a peer
flooding half-open TLS connections, a Worker flooding long-polls, and what a replica tells
about and gives to a peer it refuses."""

from __future__ import annotations

import http.client
import json
import os
import shutil
import socket
import ssl
import threading
import time

import pytest

from cpkit import make_ca
from pgkit import token
from qlagent.core.ids import new_id
from test_cluster_e2e import sql, start_replica
from kit import free_port, scratch_dir, wait_until

WORKERS = "/api/v3/cluster/workers"
TASKS = """
[[task]]
name = "greet"
shell = "/bin/sh"
script = "echo hello"
"""


@pytest.fixture(scope="module")
def plane(pg_url):
    root = scratch_dir("qlagent-attacks-")
    ca, cert, key = make_ca(root, "cp")
    port = free_port()
    cp, replica = start_replica(root, f'[cluster]\ndatabase = "{pg_url}"\npool_size = 6\nsweep_interval_s = 0.5\n'
                                      f'tls_cert = "{cert}"\ntls_key = "{key}"\n', TASKS, port)
    replica.wait_line("service.ready")
    yield {"root": root, "ca": ca, "cert": cert, "key": key, "port": port, "cp": cp, "replica": replica,
           "url": pg_url}
    replica.stop()
    shutil.rmtree(root, ignore_errors=True)


class Worker:
    """A Worker's side of the protocol over its own TLS connection (reconnecting as needed)."""

    def __init__(self, plane, name: str, *enroll_args: str) -> None:
        doc = json.loads(plane["cp"].ok("workers", "enroll", name, *enroll_args, "--json"))
        self.worker_id, self.credential = doc["workerId"], doc["credential"]
        self.port, self.ctx = plane["port"], ssl.create_default_context(cafile=plane["ca"])
        self.session_id, self.generation = "", 0

    def call(self, route: str, body: dict, timeout: float = 10, query: str = ""):
        """POST ``route`` on a new connection; (status, headers, JSON body)."""
        conn = http.client.HTTPSConnection("localhost", self.port, timeout=timeout, context=self.ctx)
        try:
            conn.request("POST", f"{WORKERS}/{self.worker_id}/{route}{query}", body=json.dumps(body).encode(),
                         headers={"Authorization": f"Worker {self.credential}", "Content-Type": "application/json"})
            r = conn.getresponse()
            return r.status, {k.lower(): v for k, v in r.getheaders()}, json.loads(r.read() or b"null")
        finally:
            conn.close()

    def hello(self) -> dict:
        status, _, grant = self.call("sessions", {})
        assert status == 201, grant
        self.session_id, self.generation = grant["sessionId"], grant["generation"]
        return grant

    def pull_body(self) -> dict:
        return {"sessionId": self.session_id, "generation": self.generation, "pullId": new_id(),
                "leaseToken": token()}

    def pull(self, wait_s: int = 0, timeout: float = 10):
        return self.call("pull", self.pull_body(), timeout=timeout, query=f"?waitS={wait_s}")


def probe(plane, timeout: float = 5) -> int:
    conn = http.client.HTTPSConnection("localhost", plane["port"], timeout=timeout,
                                       context=ssl.create_default_context(cafile=plane["ca"]))
    try:
        conn.request("GET", "/healthz")
        r = conn.getresponse()
        r.read()
        return r.status
    finally:
        conn.close()


def test_200_half_open_tls_connections_renewed_every_2_s_never_silence_probes_or_a_worker_pull(plane):
    # Connections that never finish the TLS handshake cannot take every slot: a stalled handshake
    # is evicted rather than the newcomer, so /healthz probes and a Worker's requests are answered.
    w = Worker(plane, "flooded")
    w.hello()
    stop = threading.Event()
    opened = []

    def flood() -> None:
        held: list[socket.socket] = []
        while not stop.is_set():
            fresh = []
            for _ in range(200):
                try:
                    fresh.append(socket.create_connection(("127.0.0.1", plane["port"]), timeout=5))
                except OSError:
                    pass
            for s in held:
                s.close()
            held = fresh
            opened.append(len(fresh))
            stop.wait(2)
        for s in held:
            s.close()

    attacker = threading.Thread(target=flood, daemon=True)
    attacker.start()
    failures, answered = [], 0
    try:
        time.sleep(1)                        # the first 200 are in
        end = time.monotonic() + 12
        while time.monotonic() < end:
            try:
                assert probe(plane) == 200
                status, _, answer = w.pull()
                assert status == 200 and answer["status"] == "idle", answer
                answered += 1
            except (OSError, AssertionError) as e:
                failures.append(repr(e))
            time.sleep(0.3)
    finally:
        stop.set()
        attacker.join(30)
    assert not failures, (failures, answered)
    assert answered >= 10 and len(opened) >= 5 and min(opened) >= 150, (answered, opened)


def _tls12(plane, ciphers: str) -> str:
    ctx = ssl.create_default_context(cafile=plane["ca"])
    ctx.maximum_version = ssl.TLSVersion.TLSv1_2
    ctx.set_ciphers(ciphers)
    with socket.create_connection(("127.0.0.1", plane["port"]), timeout=10) as raw:
        with ctx.wrap_socket(raw, server_hostname="localhost") as s:
            return s.cipher()[0]


def test_tls_1_2_takes_only_aead_suites_and_tls_1_3_is_unchanged(plane):
    # A client offering only a CBC-mode suite is refused the handshake.
    with pytest.raises(ssl.SSLError):
        _tls12(plane, "ECDHE-ECDSA-AES128-SHA256")
    with pytest.raises(ssl.SSLError):
        _tls12(plane, "ECDHE-ECDSA-AES256-SHA")
    assert _tls12(plane, "ECDHE-ECDSA-AES128-GCM-SHA256") == "ECDHE-ECDSA-AES128-GCM-SHA256"
    assert _tls12(plane, "ECDHE-ECDSA-CHACHA20-POLY1305") == "ECDHE-ECDSA-CHACHA20-POLY1305"
    ctx = ssl.create_default_context(cafile=plane["ca"])
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    with socket.create_connection(("127.0.0.1", plane["port"]), timeout=10) as raw:
        with ctx.wrap_socket(raw, server_hostname="localhost") as s:
            assert s.version() == "TLSv1.3"


def test_one_worker_flooding_long_polls_never_starves_another_workers_pull(plane):
    # One (compromised) Worker opening long-polls without end cannot hold all max_long_polls
    # slots with its own Session: another Worker's pull?waitS=5 is still served by that replica.
    greedy, other = Worker(plane, "greedy"), Worker(plane, "patient")
    greedy.hello()
    other.hello()
    answers: list[tuple[int, str, str | None]] = []
    lock = threading.Lock()

    def hog() -> None:
        status, headers, body = greedy.pull(wait_s=8, timeout=30)
        with lock:
            answers.append((status, (body or {}).get("error") or body.get("status"), headers.get("retry-after")))

    hogs = [threading.Thread(target=hog, daemon=True) for _ in range(40)]
    for t in hogs:
        t.start()
    time.sleep(2)                                    # the greedy Pulls are parked or refused
    t0 = time.monotonic()
    status, _, body = other.pull(wait_s=3, timeout=30)
    assert (status, body.get("status")) == (200, "idle"), body     # it waited its 3 s like any long-poll
    assert time.monotonic() - t0 >= 2.5
    for t in hogs:
        t.join(30)
    refused = [a for a in answers if a[0] == 503]
    assert sorted(set(refused)) == [(503, "long_polls_full", "1")], answers
    assert len(answers) == 40 and len(refused) == 38, answers      # two long-polls per Worker at most


def _get(plane, path: str, authorization: str, method: str = "GET", body: bytes | None = None):
    conn = http.client.HTTPSConnection("localhost", plane["port"], timeout=10,
                                       context=ssl.create_default_context(cafile=plane["ca"]))
    try:
        conn.request(method, path, body=body, headers={"Authorization": authorization,
                                                       "Content-Type": "application/json"})
        r = conn.getresponse()
        return r.status, json.loads(r.read() or b"null")
    finally:
        conn.close()


def test_refused_credentials_leave_a_rate_limited_audit_line_that_never_quotes_them(plane):
    # A 401 and a 403 worker_mismatch each leave an audit line in the journal.
    replica = plane["replica"]
    mine, other = Worker(plane, "audited"), Worker(plane, "victim")
    api_token = plane["cp"].ok("token", "create", "--subject", "auditor", "--role", "viewer").strip()
    wrong_token = "qlt_" + "x" * 43
    before = len(replica.lines)
    assert _get(plane, "/api/v3/projects/default/tasks/greet", f"Bearer {wrong_token}")[0] == 401
    assert _get(plane, f"{WORKERS}/{mine.worker_id}", f"Bearer {api_token}")[0] == 401
    status, body = _get(plane, f"{WORKERS}/{other.worker_id}", f"Worker {mine.credential}")
    assert (status, body["error"]) == (403, "worker_mismatch")
    replica.wait_line("reason=worker_mismatch")
    lines = [ln for ln in replica.lines[before:] if "http.refused" in ln]
    assert len(lines) == 3, replica.lines[before:]
    assert "peer=127.0.0.1:" in lines[0] and "route=/api/v3/projects/default/tasks/greet" in lines[0] \
        and "status=401" in lines[0] and "reason=unauthorized" in lines[0], lines
    assert f"route={WORKERS}/{mine.worker_id} " in lines[1] and "reason=worker_unauthenticated" in lines[1], lines
    assert "status=403" in lines[2] and "WARNING" in lines[2], lines
    for secret in (wrong_token, api_token, mine.credential, mine.credential[4:]):
        assert not any(secret in ln for ln in replica.lines), secret
    for _ in range(40):                          # a credential-guessing peer: the journal stays bounded
        assert _get(plane, f"{WORKERS}/{mine.worker_id}", "Worker qlw_" + "y" * 43)[0] == 401
    assert _get(plane, "/healthz", "")[0] == 200
    time.sleep(0.5)
    assert 3 < sum("http.refused" in ln for ln in replica.lines[before:]) <= 20


def test_a_worker_enrolled_for_a_project_is_never_offered_another_projects_run(plane):
    # Workers are scoped to Projects: a compromised Worker never receives the Run (and its
    # Secrets) of another Project's Task, even one without a placement requirement.
    cp, root = plane["cp"], plane["root"]
    tasks = os.path.join(root, "scoped.toml")
    with open(tasks, "w") as f:
        f.write(TASKS.replace("greet", "job") + 'concurrency = "parallel"\n')
    for project in ("alpha", "beta"):
        cp.ok("--project", project, "task", "add", "-f", tasks)
    p = cp.cli("workers", "enroll", "nowhere", "--project", "gamma")     # unknown Project: nothing enrolled
    lines = p.stderr.decode().strip().splitlines()
    assert p.returncode == 4 and len(lines) == 1 and "'gamma'" in lines[0], p.stderr
    assert "nowhere" not in cp.ok("workers", "ls")
    scoped = Worker(plane, "alpha-only", "--project", "alpha", "--slots", "4")
    anyone = Worker(plane, "any-project", "--slots", "4")
    listed = {w["name"]: w["projects"] for w in json.loads(cp.ok("workers", "ls", "--json"))["items"]}
    assert (listed["alpha-only"], listed["any-project"]) == (["alpha"], [])
    scoped.hello()
    anyone.hello()
    beta_runs = [cp.ok("--project", "beta", "run", "start", "job").strip() for _ in range(3)]
    for _ in range(3):                          # B's Runs queued: never offered to the alpha Worker
        status, _, answer = scoped.pull()
        assert (status, answer["status"]) == (200, "idle"), answer
    offered = []
    for _ in range(3):                          # ... but to a Worker that may take them
        status, _, answer = anyone.pull()
        assert (status, answer["status"]) == (200, "offered"), answer
        offered.append(answer["offer"]["runId"])
    assert sorted(offered) == sorted(beta_runs)
    alpha_run = cp.ok("--project", "alpha", "run", "start", "job").strip()
    status, _, answer = scoped.pull()
    assert (status, answer["status"], answer["offer"]["runId"]) == (200, "offered", alpha_run), answer


def test_a_run_only_workers_of_other_projects_could_take_is_reported_unplaceable(plane):
    cp, root = plane["cp"], plane["root"]
    tasks = os.path.join(root, "zoned.toml")
    with open(tasks, "w") as f:
        f.write(TASKS.replace("greet", "zoned") + 'placement = { required = { zone = "z9" } }\n')
    for project in ("alpha", "delta"):
        cp.ok("--project", project, "task", "add", "-f", tasks)
    Worker(plane, "z9-alpha", "--label", "zone=z9", "--project", "alpha")
    delta, alpha = (cp.ok("--project", p, "run", "start", "zoned").strip() for p in ("delta", "alpha"))
    # the replica's sweep pass (every 0.5 s) checks them
    wait_until(lambda: "run.unplaceable" in cp.ok("--project", "delta", "run", "show", delta), 20,
               "the delta Run reported unplaceable", step=0.2)
    shown = json.loads(cp.ok("--project", "delta", "run", "show", delta, "--json"))
    assert [e["payload"]["reason"] for e in shown["events"] if e["type"] == "run.unplaceable"] \
        == ["no_enrolled_worker_matches"], shown
    wait_until(lambda: sql(plane["url"], "SELECT placement_checked FROM runs WHERE run_id = %s", (alpha,)) == [(True,)],
               20, "the alpha Run's placement checked", step=0.2)
    assert "run.unplaceable" not in cp.ok("--project", "alpha", "run", "show", alpha)   # its Worker can take it
