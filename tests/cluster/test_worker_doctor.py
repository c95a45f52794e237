"""``qlagent doctor`` on a fleet Worker against a real control-plane replica (real processes,
HTTPS from a throwaway CA, PostgreSQL), and the read-only route it asks,
``GET /api/v3/cluster/workers/{workerId}``: all ok next to a running Worker whose Session it
leaves alone; a wrong CA, an unreachable URL, another Worker's credential, a removed Worker's
credential are FAIL lines naming the URL; a control plane without the route (404) is a
non-failing line. The replica and Worker helpers are tests/cluster/test_cluster_e2e.py's."""

from __future__ import annotations

import json
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from test_cluster_e2e import Node, enroll, https, plane, sql, start_worker  # noqa: F401  (fixture)
from kit import free_port

ROUTE = "/api/v3/cluster/workers/{}"


def worker_config(plane, name: str, worker_id: str, cred: str, *, ca: str | None = None,  # noqa: F811
                  urls: list[str] | None = None) -> Node:
    urls = urls or [f"https://127.0.0.1:{plane['port']}"]
    return Node(plane["root"], name, f'[worker]\nworker_id = "{worker_id}"\ncontrol_url = {json.dumps(urls)}\n'
                                     f'credential_file = "{cred}"\nca_file = "{ca or plane["ca"]}"\n')


def doctor(node: Node) -> tuple[int, dict[str, list[dict]], str]:
    """(exit code, checks by name, text output) of ``doctor`` (``--json`` and plain)."""
    p = node.cli("doctor", "--json")
    assert b"Traceback" not in p.stderr, p.stderr
    by: dict[str, list[dict]] = {}
    for c in json.loads(p.stdout)["checks"]:
        by.setdefault(c["name"], []).append(c)
    text = node.cli("doctor")
    assert text.returncode == p.returncode
    return p.returncode, by, text.stdout.decode()


def footprint(url: str) -> list:
    """What a read-only route must leave as it was: Sessions, Leases, events, Worker rows."""
    return [sql(url, "SELECT count(*) FROM worker_sessions"), sql(url, "SELECT count(*) FROM run_leases"),
            sql(url, "SELECT count(*) FROM run_events"),
            sql(url, "SELECT worker_id, generation, current_session_id, state, updated_at_us FROM workers "
                     "ORDER BY worker_id"),
            sql(url, "SELECT session_id, state, expires_at_us, last_heartbeat_us FROM worker_sessions "
                     "WHERE state = 'open' ORDER BY session_id")]


def test_doctor_next_to_a_running_worker_is_all_ok_and_leaves_its_session_alone(plane):  # noqa: F811
    proc, worker_id = start_worker(plane, "doc-run", plane["ca"], "--label", "site=lab", "--slots", "2")
    proc.wait_line("worker.session_opened")
    node = Node.__new__(Node)                      # the running Worker's own state dir and config
    node.state, node.config = (os.path.join(plane["root"], f"doc-run{s}") for s in ("-state", ".toml"))
    before = sql(plane["url"], "SELECT generation, current_session_id FROM workers WHERE worker_id = %s",
                 (worker_id,))
    rc, checks, text = doctor(node)
    assert rc == 0, text
    assert all(c["ok"] for cs in checks.values() for c in cs), text
    assert set(checks) == {"trust", "state dir", "credential", "ca file", "control", "worker", "heartbeat", "inbox",
                           "log store", "certificate", "free space"}, text
    url = f"https://127.0.0.1:{plane['port']}"
    assert checks["control"][0]["detail"].startswith(f"{url}: TLS ok, GET /healthz 200 in "), text
    assert checks["worker"][0]["detail"].startswith(f"{url}: known as doc-run, state active, generation "
                                                    f"{before[0][0]}; enrolled labels site=lab"), text
    assert "slots 2" in checks["worker"][0]["detail"] and "quick_check ok" in checks["inbox"][0]["detail"], text
    assert "qlagent init" not in text and "key file" not in text, text
    # No hello: the running Worker's Session and generation are untouched, and it carries on.
    assert sql(plane["url"], "SELECT generation, current_session_id FROM workers WHERE worker_id = %s",
               (worker_id,)) == before
    time.sleep(1.5)
    assert [ln for ln in proc.lines if "worker.session" in ln] == [proc.wait_line("worker.session_opened")], \
        proc.lines
    assert proc.proc.poll() is None
    # Stopped, its inbox has no -wal/-shm: doctor reads it without creating them (doctor run as
    # root would leave root-owned files that lock the Worker out).
    assert proc.stop() == 0
    listing = sorted(os.listdir(node.state))
    assert "inbox.sqlite3" in listing and "inbox.sqlite3-shm" not in listing, listing
    rc, checks, text = doctor(node)
    assert rc == 0 and "quick_check ok" in checks["inbox"][0]["detail"], text
    assert sorted(os.listdir(node.state)) == listing


def test_doctor_names_the_url_of_a_wrong_ca_and_of_an_unreachable_replica(plane):  # noqa: F811
    worker_id, cred = enroll(plane, "doc-ca")
    good, dead = f"https://127.0.0.1:{plane['port']}", f"https://127.0.0.1:{free_port()}"
    rc, checks, text = doctor(worker_config(plane, "doc-ca", worker_id, cred, ca=plane["other_ca"]))
    assert rc == 5, text
    [control] = checks["control"]
    assert not control["ok"] and control["detail"].startswith(f"{good}: ") and "certificate refused" in \
        control["detail"], text
    assert f"FAIL  control        {good}: " in text, text
    rc, checks, text = doctor(worker_config(plane, "doc-dead", worker_id, cred, urls=[good, dead]))
    assert rc == 5, text
    first, second = checks["control"]
    assert first["ok"] and not second["ok"], text
    assert second["detail"].startswith(f"{dead}: ") and "refused" in second["detail"].lower(), text
    assert [c["ok"] for c in checks["worker"]] == [True], text      # asked of the replica that answered


def test_doctor_fails_another_workers_credential_and_a_removed_workers(plane):  # noqa: F811
    id_a, _ = enroll(plane, "doc-a")
    _, cred_b = enroll(plane, "doc-b")
    rc, checks, text = doctor(worker_config(plane, "doc-ab", id_a, cred_b))
    assert rc == 5 and checks["credential"][0]["ok"] and checks["control"][0]["ok"], text
    [w] = checks["worker"]
    assert not w["ok"] and "worker_mismatch" in w["detail"] and id_a in w["detail"], text
    id_c, cred_c = enroll(plane, "doc-c")
    node = worker_config(plane, "doc-c", id_c, cred_c)
    assert doctor(node)[1]["state dir"][0]["detail"].endswith("does not exist (run `qlagent init`)")
    node.ok("init")
    assert doctor(node)[0] == 0
    plane["cp"].ok("workers", "rm", "doc-c")
    rc, checks, text = doctor(node)
    [w] = checks["worker"]
    assert rc == 5 and not w["ok"] and "worker_unauthenticated" in w["detail"], text
    assert w["detail"].startswith(f"https://127.0.0.1:{plane['port']}: "), text


def test_the_describe_route_answers_its_own_worker_only_and_writes_nothing(plane):  # noqa: F811
    id_d, cred_d = enroll(plane, "doc-d", "--label", "zone=a", "--slots", "3")
    _, cred_e = enroll(plane, "doc-e")
    auth = {"Authorization": f"Worker {open(cred_d).read().strip()}"}
    before = footprint(plane["url"])
    status, headers, body = https(plane, ROUTE.format(id_d), "", auth)
    assert status == 200 and int(headers["x-qlagent-server-now-us"]) > 0, body
    assert json.loads(body) == {"workerId": id_d, "name": "doc-d", "state": "active", "generation": 0,
                                "labels": {"zone": "a"}, "executorTypes": ["local_process"], "slots": 3,
                                "sessionTtlS": 30}
    status, _, body = https(plane, ROUTE.format(id_d), "", {"Authorization": f"Worker {open(cred_e).read().strip()}"})
    assert (status, json.loads(body)["error"]) == (403, "worker_mismatch"), body
    token = plane["cp"].ok("token", "create", "--subject", "doc-api", "--role", "viewer").strip()
    before = footprint(plane["url"])            # (the token's rows are not the route's)
    status, headers, body = https(plane, ROUTE.format(id_d), token)
    assert (status, json.loads(body)["error"], headers["www-authenticate"]) == (401, "worker_unauthenticated",
                                                                                 "Worker"), body
    status, _, body = https(plane, ROUTE.format(id_d) + "?x=1", "", auth)
    assert (status, json.loads(body)["field"]) == (400, "x"), body
    plane["cp"].ok("workers", "drain", "doc-d")
    status, _, body = https(plane, ROUTE.format(id_d), "", auth)
    assert status == 200 and json.loads(body)["state"] == "draining", body
    plane["cp"].ok("workers", "resume", "doc-d")
    before = footprint(plane["url"])
    for _ in range(3):
        assert https(plane, ROUTE.format(id_d), "", auth)[0] == 200
    assert footprint(plane["url"]) == before


class _OldPlane(BaseHTTPRequestHandler):
    """A control plane from before the route: /healthz 200, everything else 404 (API shape)."""

    def do_GET(self):                       # noqa: N802
        status, body = (200, b'{"status":"ok"}') if self.path == "/healthz" else \
            (404, b'{"code":"not_found","message":"no route"}')
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_a_control_plane_without_the_route_is_a_non_failing_line(plane):  # noqa: F811
    worker_id, cred = enroll(plane, "doc-old")
    server = ThreadingHTTPServer(("127.0.0.1", 0), _OldPlane)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        node = worker_config(plane, "doc-old", worker_id, cred, urls=[url])
        node.ok("init")
        rc, checks, text = doctor(node)
        assert rc == 0, text
        [w] = checks["worker"]
        assert w["ok"] and w["detail"].startswith(f"{url}: credential check unavailable there"), text
        assert "ca file" not in checks, text
    finally:
        server.shutdown()
        server.server_close()
