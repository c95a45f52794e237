"""The Worker routes of docs/worker-protocol.md over real HTTP on loopback and a real
PostgreSQL authority: each route's success path, every error row of the protocol, the bad
input of issues 10/11 with nothing written (checked in the database), lost-answer Pull
retries, long-polls that never block the server loop, and TLS pinned to the right CA."""

from __future__ import annotations

import json
import ssl
import threading
import time
import warnings
from dataclasses import replace

import pytest

from cpkit import BASE, Client, ControlPlane, make_ca
from pgkit import COMMAND_MARK, token
from qlagent.core.cluster import MAX_CHUNK_BYTES
from qlagent.cluster.registry import credential_digest, new_credential
from qlagent.core.ids import new_id
from qlagent.http.auth import AuthError, authorize
from qlagent.http.worker_routes import MAX_JSON_BYTES, WorkerRouteLimits
from kit import wait_until

_TABLES = ("workers", "worker_sessions", "run_leases", "attempts", "runs", "run_events", "log_chunks",
           "truncation_facts")


def snapshot(kit) -> dict:
    """Every row of the tables a Worker route may write."""
    return {t: kit.sql(f"SELECT row_to_json(x)::text FROM {t} x ORDER BY 1") for t in _TABLES}


@pytest.fixture
def cp(kit, pg_url):
    plane = ControlPlane(kit, pg_url)
    yield plane
    plane.close()


def enrolled(kit, name: str = "edge-1", slots: int = 1, labels: dict | None = None) -> dict:
    worker_id, credential = kit.registry.enroll(name, labels or {}, ("local_process",), slots)
    return {"worker_id": worker_id, "credential": credential}


def session(c: Client) -> dict:
    status, headers, body, _ = c.post("sessions", {})
    assert status == 201, body
    c.worker.update(session_id=body["sessionId"], generation=body["generation"])
    return body


def pull_body(w: dict, pull_id: str | None = None, tok: str | None = None) -> dict:
    return {"sessionId": w["session_id"], "generation": w["generation"], "pullId": pull_id or new_id(),
            "leaseToken": tok or token()}


def ack_body(offer: dict, kind: str, **facts) -> dict:
    return {"sessionId": offer["sessionId"], "generation": offer["generation"], "attemptId": offer["attemptId"],
            "leaseGeneration": offer["leaseGeneration"], "leaseToken": offer["leaseToken"], "kind": kind, **facts}


def put_log(c: Client, offer: dict, offset: int, data: bytes, **override):
    headers = {"X-Qlagent-Session": offer["sessionId"], "X-Qlagent-Generation": str(offer["generation"]),
               "X-Qlagent-Lease-Generation": str(offer["leaseGeneration"]),
               "X-Qlagent-Lease-Token": offer["leaseToken"], **override}
    status, hdrs, raw = c.call("PUT", f"{BASE}/{c.worker['worker_id']}/attempts/{offer['attemptId']}/log"
                                      f"?offset={offset}", raw=data, headers=headers,
                               content_type="application/octet-stream")
    return status, hdrs, json.loads(raw)


def offered(kit, c: Client) -> dict:
    kit.queue(kit.task(f"job-{new_id()[:8]}", secrets_={"API_KEY": "api-key"}))
    status, _, body, _ = c.post("pull", pull_body(c.worker))
    assert status == 200 and body["status"] == "offered", body
    return body["offer"]


def refused(resp, status: int, code: str, field: str | None = None) -> dict:
    st, headers, body, _ = resp
    assert (st, body["error"], body["field"]) == (status, code, field), body
    assert set(body) >= {"error", "field", "message"} and int(headers["x-qlagent-server-now-us"]) > 0
    return body


# -- success paths ---------------------------------------------------------------------------------
def test_every_route_answers_its_documented_success(kit, cp):
    c = Client(cp.port, enrolled(kit))
    grant = session(c)
    assert (grant["generation"], grant["slots"], grant["executorTypes"]) == (1, 1, ["local_process"])
    status, headers, hb, _ = c.post("heartbeat", {"sessionId": grant["sessionId"], "generation": 1})
    db_now = kit.one("SELECT ql_now_us()")
    assert status == 200 and hb["cancel"] == [] and hb["expiresAtUs"] > db_now
    # The server clock header is the database's (µs), not some other epoch or unit.
    assert abs(int(headers["x-qlagent-server-now-us"]) - db_now) < 5_000_000

    offer = offered(kit, c)
    assert offer["workerId"] == c.worker["worker_id"] and offer["spec"]["argv"][0] == COMMAND_MARK
    for kind, states in (("starting", ["starting", "starting"]), ("running", ["running", "running"])):
        status, _, body, _ = c.post("acks", ack_body(offer, kind))
        assert (status, [body["attemptState"], body["runState"]], body["replay"]) == (200, states, False)
    status, _, body, _ = c.post("acks", ack_body(offer, "running"))
    assert (status, body["replay"]) == (200, True)
    assert put_log(c, offer, 0, b"hello ")[::2] == (200, {"nextOffset": 6, "truncated": False})
    assert put_log(c, offer, 6, b"world\n")[::2] == (200, {"nextOffset": 12, "truncated": False})
    assert put_log(c, offer, 0, b"hello ")[::2] == (200, {"nextOffset": 12, "truncated": False})  # resend
    status, _, body, _ = c.post("acks", ack_body(offer, "completion", exitCode=0, bytesKept=12, bytesDropped=0))
    assert (status, body["attemptState"], body["runState"]) == (200, "succeeded", "succeeded")
    assert kit.logs.read(offer["attemptId"], 0, 100) == b"hello world\n"
    assert kit.one("SELECT state FROM runs WHERE run_id = %s", (offer["runId"],)) == "succeeded"
    c.close()


def test_a_pull_retried_after_a_lost_answer_gets_a_byte_identical_body(kit, cp):
    c = Client(cp.port, enrolled(kit, slots=2))
    session(c)
    kit.queue(kit.task(secrets_={"API_KEY": "api-key"}))
    kit.queue(kit.task("other"))
    req = pull_body(c.worker)
    first = c.post("pull", req)
    again = Client(cp.port, c.worker).post("pull", req)        # a new connection, as after a lost answer
    assert first[0] == again[0] == 200 and first[2]["status"] == "offered"
    assert first[3] == again[3]
    assert kit.one("SELECT count(*) FROM run_leases") == 1
    before = snapshot(kit)
    refused(c.post("pull", {**req, "leaseToken": token()}), 409, "pull_token_mismatch")
    assert snapshot(kit) == before


# -- credentials -----------------------------------------------------------------------------------
def test_credential_kinds_are_separate_and_bound_to_their_worker(kit, cp):
    a, b = enrolled(kit, "edge-a"), enrolled(kit, "edge-b")
    ca = Client(cp.port, a)
    session(ca)
    offer = offered(kit, ca)
    before = snapshot(kit)
    api_token = "Bearer qlt_" + "A" * 43
    for route, body in (("sessions", {}), ("heartbeat", {"sessionId": a["session_id"], "generation": 1}),
                        ("pull", pull_body(a)), ("acks", ack_body(offer, "starting"))):
        refused(ca.post(route, body, auth=api_token), 401, "worker_unauthenticated")
        refused(ca.post(route, body, auth=""), 401, "worker_unauthenticated")
        refused(ca.post(route, body, auth=f"Worker {new_credential()}"), 401, "worker_unauthenticated")
        # A's credential on B's routes: 403, and B's Session/generation untouched.
        refused(ca.post(route, body, worker_id=b["worker_id"]), 403, "worker_mismatch")
    status, _, body = put_log(ca, offer, 0, b"x", Authorization=f"Worker {b['credential']}")
    assert (status, body["error"]) == (403, "worker_mismatch")          # B's credential on A's route
    status, headers, body = put_log(ca, offer, 0, b"x", Authorization=api_token)
    assert (status, body["error"], headers["www-authenticate"]) == (401, "worker_unauthenticated", "Worker")
    assert snapshot(kit) == before

    class NoStore:
        def lookup_token(self, digest):
            raise AssertionError("a Worker credential must not reach the API token store")
        latest_binding = lookup_token
    with pytest.raises(AuthError) as e:
        authorize({"authorization": f"Worker {a['credential']}"}, NoStore(), new_id(), "run.read")
    assert e.value.status == 401


def test_a_credential_is_qlw_plus_256_bits_and_only_its_digest_is_stored(kit):
    creds = {new_credential() for _ in range(64)}
    assert len(creds) == 64 and all(c.startswith("qlw_") and len(c) == 47 for c in creds)
    w = enrolled(kit)
    assert kit.one("SELECT credential_digest FROM workers") == credential_digest(w["credential"])
    assert kit.registry.credential_owner(w["credential"]) == w["worker_id"]
    assert kit.registry.credential_owner(new_credential()) is None


# -- fences ----------------------------------------------------------------------------------------
def test_old_generation_pull_and_replayed_acks_are_stale_and_write_nothing(kit, cp):
    c = Client(cp.port, enrolled(kit, slots=2))
    session(c)
    offer = offered(kit, c)
    old = dict(c.worker)
    assert c.post("acks", ack_body(offer, "starting"))[0] == 200
    session(c)                          # generation 2: the starting Lease of generation 1 is fenced
    assert c.worker["generation"] == 2
    before = snapshot(kit)
    refused(c.post("acks", ack_body(offer, "running")), 409, "stale_generation")
    refused(c.post("acks", ack_body(offer, "starting")), 409, "stale_generation")      # replay
    refused(c.post("pull", pull_body(old)), 409, "stale_generation")                    # forged old offer
    refused(c.post("heartbeat", {"sessionId": old["session_id"], "generation": 1}), 409, "stale_generation")
    assert put_log(c, offer, 0, b"late")[0] == 409
    # An ACK carrying the current generation with the fenced Lease: not this Session's Lease.
    refused(c.post("acks", {**ack_body(offer, "running"), "sessionId": c.worker["session_id"], "generation": 2}),
            409, "stale_generation")
    # The current generation with a wrong token or an unknown Attempt: the Lease fence answers.
    current = {"sessionId": c.worker["session_id"], "generation": 2}
    refused(c.post("acks", {**ack_body(offer, "running"), **current, "leaseToken": token()}),
            409, "lease_token_mismatch")
    refused(c.post("acks", {**ack_body(offer, "running"), **current, "attemptId": new_id()}),
            404, "attempt_not_found")
    assert snapshot(kit) == before


def test_an_old_generation_ack_is_stale_whatever_its_lease_token_or_attempt(kit, cp):
    """Issue 10 §7: the generation is judged first, so a replay from an older generation gets the
    distinct reason and learns nothing about the Lease (its token, its existence)."""
    c = Client(cp.port, enrolled(kit, slots=2))
    session(c)
    offer = offered(kit, c)
    assert c.post("acks", ack_body(offer, "starting"))[0] == 200
    claim = {"attemptId": offer["attemptId"], "leaseGeneration": offer["leaseGeneration"],
             "leaseToken": offer["leaseToken"]}
    assert c.post("sessions", {"adopt": [claim]})[0] == 201      # generation 2 adopts the Lease
    before = snapshot(kit)
    for override in ({}, {"leaseToken": token()}, {"attemptId": new_id()}, {"leaseGeneration": 7},
                     {"leaseToken": token(), "attemptId": new_id()}):
        refused(c.post("acks", {**ack_body(offer, "running"), **override}), 409, "stale_generation")
        refused(c.post("acks", {**ack_body(offer, "completion", exitCode=0), **override}), 409, "stale_generation")
    assert snapshot(kit) == before


def test_lease_and_session_rows_of_the_error_table(kit, cp):
    c = Client(cp.port, enrolled(kit, slots=3))
    session(c)
    # lease_ended: the Lease ran out before the starting ACK.
    offer = offered(kit, c)
    kit.expire_lease(offer["attemptId"])
    before = snapshot(kit)
    refused(c.post("acks", ack_body(offer, "starting")), 409, "lease_ended")
    assert snapshot(kit) == before
    # lease_not_active: the sweeper ended it.
    kit.leases.sweep_expired(8)
    before = snapshot(kit)
    refused(c.post("acks", ack_body(offer, "starting")), 409, "lease_not_active")
    assert snapshot(kit) == before
    # ack_out_of_order: running before starting.
    second = offered(kit, c)
    before = snapshot(kit)
    refused(c.post("acks", ack_body(second, "running")), 409, "ack_out_of_order")
    assert snapshot(kit) == before
    # chunk_gap / chunk_mismatch name the offset to resume from.
    assert put_log(c, second, 0, b"abc")[0] == 200
    before = snapshot(kit)
    status, _, body = put_log(c, second, 10, b"def")
    assert (status, body["error"], body["nextOffset"]) == (409, "chunk_gap", 3)
    status, _, body = put_log(c, second, 0, b"xyz")
    assert (status, body["error"], body["nextOffset"]) == (409, "chunk_mismatch", 3)
    assert snapshot(kit) == before
    # session_expired.
    kit.sql("UPDATE worker_sessions SET expires_at_us = ql_now_us() - 1")
    before = snapshot(kit)
    refused(c.post("heartbeat", {"sessionId": c.worker["session_id"], "generation": 1}), 409, "session_expired")
    refused(c.post("pull", pull_body(c.worker)), 409, "session_expired")
    assert snapshot(kit) == before


def test_a_heartbeat_past_the_instant_the_worker_stopped_waiting_is_refused_and_renews_nothing(kit, cp):
    """renewUntilUs (docs/worker-protocol.md): a heartbeat the replica would apply after it is
    refused heartbeat_late, nothing written; before it, it renews as usual."""
    c = Client(cp.port, enrolled(kit))
    session(c)
    now = kit.one("SELECT ql_now_us()")
    before = snapshot(kit)
    refused(c.post("heartbeat", {"sessionId": c.worker["session_id"], "generation": 1, "renewUntilUs": now - 1}),
            409, "heartbeat_late")
    assert snapshot(kit) == before
    refused(c.post("heartbeat", {"sessionId": c.worker["session_id"], "generation": 1, "renewUntilUs": -1}),
            400, "invalid_request", "renewUntilUs")
    refused(c.post("heartbeat", {"sessionId": c.worker["session_id"], "generation": 1, "renewUntilUs": "soon"}),
            400, "invalid_request", "renewUntilUs")
    assert snapshot(kit) == before
    status, _, hb, _ = c.post("heartbeat", {"sessionId": c.worker["session_id"], "generation": 1,
                                            "renewUntilUs": now + 60_000_000})
    assert status == 200 and hb["expiresAtUs"] > now


def test_a_pull_whose_secret_is_missing_is_answered_lease_ended_not_503(kit, cp):
    c = Client(cp.port, enrolled(kit))
    session(c)
    kit.queue(kit.task("needs-absent", secrets_={"TOKEN": "absent"}))
    req = pull_body(c.worker)
    status, _, body, _ = c.post("pull", req)
    assert (status, body["status"], body["reason"]) == (200, "lease_ended", "secret_missing:absent"), body
    status, _, body, _ = c.post("pull", req)             # the same pull again: no 503 loop
    assert (status, body["status"], body["reason"]) == (200, "lease_ended", "lease_completed"), body
    assert kit.sql("SELECT state FROM run_leases") == [("completed",)]
    assert kit.sql("SELECT state FROM runs") == [("failed",)]


@pytest.mark.parametrize("route, body, field", [
    ("sessions", {"bogus": 1}, "bogus"),
    ("sessions", {"slots": "2"}, "slots"),
    ("sessions", {"labels": {"site": 7}}, "labels"),
    ("heartbeat", {"generation": 1}, "sessionId"),
    ("pull", {"sessionId": "S", "generation": 1, "pullId": "P", "leaseToken": "t" * 43, "offerId": "x"}, "offerId"),
    ("acks", {"kind": "starting"}, "sessionId"),
    ("acks", "[]", "body"),
])
def test_unknown_or_mistyped_fields_are_400_naming_the_field_and_write_nothing(kit, cp, route, body, field):
    c = Client(cp.port, enrolled(kit))
    session(c)
    before = snapshot(kit)
    if body == "[]":
        resp = c.post(route, None, raw=b"[]")
    else:
        resp = c.post(route, {k: (c.worker["session_id"] if v == "S" else new_id() if v == "P" else v)
                              for k, v in body.items()})
    refused(resp, 400, "invalid_request", field)
    assert snapshot(kit) == before


def test_every_bounded_field_at_its_limit_is_taken_and_one_over_is_400_writing_nothing(kit, cp):
    """Hello labels (32, 128-byte names/values) and slots (256), lease token length (32..256),
    generation (2^63-1), waitS (30), startError (64), exitCode (255), signal (64), figures (2^62),
    log offset (≥ 0): at the limit accepted, one over refused naming the field."""
    labels = {f"l{i:02d}": "x" for i in range(31)} | {"k" * 128: "v" * 128}
    c = Client(cp.port, enrolled(kit, slots=256, labels=labels))

    def over(route, body, field):
        before = snapshot(kit)
        refused(c.post(route, body), 400, "invalid_request", field)
        assert snapshot(kit) == before

    over("sessions", {"labels": {**labels, "l31": "x"}}, "hello.labels")            # 33 labels
    over("sessions", {"labels": {"k" * 129: "v"}}, "hello.labels." + "k" * 129)
    over("sessions", {"labels": {"k" * 128: "v" * 129}}, "hello.labels." + "k" * 128)
    over("sessions", {"slots": 257}, "hello.slots")
    over("sessions", {"slots": 0}, "hello.slots")
    status, _, grant, _ = c.post("sessions", {"labels": labels, "slots": 256})
    assert (status, len(grant["labels"]), grant["slots"]) == (201, 32, 256), grant
    c.worker.update(session_id=grant["sessionId"], generation=grant["generation"])

    over("pull", pull_body(c.worker, tok="t" * 31), "leaseToken")
    over("pull", pull_body(c.worker, tok="t" * 257), "leaseToken")
    over("pull", {**pull_body(c.worker), "generation": 2**63}, "generation")
    refused(c.post("pull", {**pull_body(c.worker), "generation": 2**63 - 1}), 409, "stale_generation")
    assert c.post("pull", pull_body(c.worker, tok="t" * 32))[2]["status"] == "idle"
    kit.queue(kit.task("edge-a"))
    kit.queue(kit.task("edge-b"))
    status, _, first = c.call("POST", f"{BASE}/{c.worker['worker_id']}/pull?waitS=30",
                              pull_body(c.worker, tok="t" * 256))
    assert (status, json.loads(first)["status"]) == (200, "offered")
    a = json.loads(first)["offer"]
    b = c.post("pull", pull_body(c.worker))[2]["offer"]

    over("acks", ack_body(a, "start_failure", startError="e" * 65), "startError")
    assert c.post("acks", ack_body(a, "start_failure", startError="e" * 64))[0] == 200
    for kind in ("starting", "running"):
        assert c.post("acks", ack_body(b, kind))[0] == 200
    for facts, field in (({"exitCode": 256}, "exitCode"), ({"exitCode": -1}, "exitCode"),
                         ({"signal": 65}, "signal"), ({"signal": 0}, "signal"),
                         ({"exitCode": 0, "bytesKept": 2**62 + 1}, "bytesKept"),
                         ({"exitCode": 0, "cpuTimeUs": 2**62 + 1}, "cpuTimeUs")):
        over("acks", ack_body(b, "completion", **facts), field)
    before = snapshot(kit)
    status, _, body = put_log(c, b, -1, b"x")
    assert (status, body["field"]) == (400, "offset") and snapshot(kit) == before
    status, _, done, _ = c.post("acks", ack_body(b, "completion", signal=64, cpuTimeUs=2**62, bytesKept=0))
    assert (status, done["attemptState"]) == (200, "failed"), done
    assert kit.sql("SELECT failure_reason, exit_signal, cpu_time_us FROM attempts WHERE attempt_id IN (%s, %s) "
                   "ORDER BY exit_signal NULLS FIRST", (a["attemptId"], b["attemptId"])) == \
        [("e" * 64, None, None), (None, 64, 2**62)]


def test_path_query_and_header_input_is_checked_before_the_database(kit, cp):
    c = Client(cp.port, enrolled(kit))
    session(c)
    offer = offered(kit, c)
    before = snapshot(kit)
    refused(c.post("pull", pull_body(c.worker), worker_id="not-a-uuid"), 400, "invalid_request", "workerId")
    for q in ("waitS=31", "waitS=-1", "waitS=x", "wait=1"):
        st, h, raw = c.call("POST", f"{BASE}/{c.worker['worker_id']}/pull?{q}", pull_body(c.worker))
        assert st == 400 and json.loads(raw)["field"] in ("waitS", "wait"), raw
    refused(c.post("heartbeat", {"sessionId": c.worker["session_id"], "generation": 1},
                   content_type="text/plain"), 400, "invalid_request", "Content-Type")
    assert put_log(c, offer, 0, b"x", **{"X-Qlagent-Generation": "one"})[2]["field"] == "X-Qlagent-Generation"
    assert put_log(c, offer, 0, b"")[2]["field"] == "data"
    st, _, raw = c.call("PUT", f"{BASE}/{c.worker['worker_id']}/attempts/{offer['attemptId']}/log",
                        raw=b"x", content_type="application/octet-stream")
    assert (st, json.loads(raw)["field"]) == (400, "offset")
    assert snapshot(kit) == before


def test_a_hello_adopts_a_started_lease_over_http_and_a_full_adopt_list_fits_its_body(kit, cp):
    c = Client(cp.port, enrolled(kit, slots=2))
    session(c)
    offer = offered(kit, c)
    assert c.post("acks", ack_body(offer, "starting"))[0] == 200
    # 64 claims with 256-character tokens (the largest hello the protocol allows) plus the real one.
    fillers = [{"attemptId": new_id(), "leaseGeneration": 1, "leaseToken": "t" * 256} for _ in range(63)]
    claim = {"attemptId": offer["attemptId"], "leaseGeneration": offer["leaseGeneration"],
             "leaseToken": offer["leaseToken"]}
    assert len(json.dumps({"adopt": [claim, *fillers]})) > MAX_JSON_BYTES      # over the other routes' limit
    status, _, grant, raw = c.post("sessions", {"adopt": [claim, *fillers]})
    assert status == 201, grant
    assert [(a["attemptId"], a["leaseGeneration"]) for a in grant["adopted"]] == [(offer["attemptId"], 1)]
    assert {r["reason"] for r in grant["refused"]} == {"lease_not_found"} and len(grant["refused"]) == 63
    assert offer["leaseToken"] not in raw.decode()
    moved = {**offer, "sessionId": grant["sessionId"], "generation": grant["generation"]}
    refused(c.post("acks", ack_body(offer, "running")), 409, "stale_generation")
    assert c.post("acks", ack_body(moved, "running"))[2]["attemptState"] == "running"
    before = snapshot(kit)
    refused(c.post("sessions", {"adopt": [claim] * 2}), 400, "invalid_request", "hello.adopt")
    assert snapshot(kit) == before


def test_bodies_at_and_over_their_limits(kit, cp):
    c = Client(cp.port, enrolled(kit))
    session(c)
    offer = offered(kit, c)
    hb = json.dumps({"sessionId": c.worker["session_id"], "generation": 1}).encode()
    at_limit = hb + b" " * (MAX_JSON_BYTES - len(hb))
    st, _, raw = c.call("POST", f"{BASE}/{c.worker['worker_id']}/heartbeat", raw=at_limit)
    assert st == 200, raw
    before = snapshot(kit)
    st, h, raw = c.call("POST", f"{BASE}/{c.worker['worker_id']}/heartbeat", raw=at_limit + b" ")
    assert (st, json.loads(raw)["error"]) == (413, "body_too_large") and "x-qlagent-server-now-us" in h
    assert snapshot(kit) == before
    assert put_log(c, offer, 0, b"a" * MAX_CHUNK_BYTES)[::2] == (200, {"nextOffset": MAX_CHUNK_BYTES,
                                                                     "truncated": False})
    before = snapshot(kit)
    big = Client(cp.port, c.worker)
    st, h, body = put_log(big, offer, MAX_CHUNK_BYTES, b"b" * (MAX_CHUNK_BYTES + 1))
    # Refused from Content-Length, before any body byte is read, in the protocol's shape.
    assert (st, body["error"]) == (413, "body_too_large") and "x-qlagent-server-now-us" in h
    assert snapshot(kit) == before


# -- long-polls ------------------------------------------------------------------------------------
def test_a_waiting_pull_is_answered_when_a_run_is_queued(kit, cp):
    c = Client(cp.port, enrolled(kit))
    session(c)
    task = kit.task()
    out = {}

    def waiter():
        st, _, raw = c.call("POST", f"{BASE}/{c.worker['worker_id']}/pull?waitS=10", pull_body(c.worker))
        out["answer"], out["at"] = (st, json.loads(raw)), time.monotonic()
    t0 = time.monotonic()
    t = threading.Thread(target=waiter)
    t.start()
    wait_until(lambda: cp.server.in_flight == 1)
    time.sleep(0.3)
    assert "answer" not in out               # still waiting: nothing was queued
    queued_at = time.monotonic()
    run_id, _ = kit.queue(task)
    t.join(15)
    st, body = out["answer"]
    # "offered" after a 10 s wait can only come from the NOTIFY wake-up: at the deadline no
    # second read is made. The answer follows the queueing and well precedes the bound.
    assert (st, body["status"], body["offer"]["runId"]) == (200, "offered", run_id)
    assert queued_at < out["at"] < t0 + 10


def test_eight_waiting_pulls_do_not_block_other_requests(kit, cp):
    clients = [Client(cp.port, enrolled(kit, f"edge-{i}")) for i in range(8)]
    for c in clients:
        session(c)
    answers: list = []

    def waiter(c):
        st, _, raw = c.call("POST", f"{BASE}/{c.worker['worker_id']}/pull?waitS=10", pull_body(c.worker))
        answers.append((st, json.loads(raw)["status"]))
    threads = [threading.Thread(target=waiter, args=(c,)) for c in clients]
    for t in threads:
        t.start()
    wait_until(lambda: cp.server.in_flight == 8)
    other = Client(cp.port, enrolled(kit, "edge-other"))
    assert session(other)["generation"] == 1                        # answered while eight wait
    st, _, hb, _ = other.post("heartbeat", {"sessionId": other.worker["session_id"], "generation": 1})
    assert st == 200 and answers == [] and cp.server.in_flight >= 8
    task = kit.task()
    for _ in range(8):
        kit.queue(task)
    for t in threads:
        t.join(15)
    assert sorted(answers) == [(200, "offered")] * 8


def test_long_polls_beyond_the_bound_are_503_with_retry_after(kit, pg_url):
    plane = ControlPlane(kit, pg_url, limits=replace(WorkerRouteLimits(), max_long_polls=2))
    try:
        clients = [Client(plane.port, enrolled(kit, f"edge-{i}")) for i in range(3)]
        for c in clients:
            session(c)
        # The two long-polls wait far longer than a loaded machine needs for the third call; two
        # queued Runs end them afterwards.
        threads = [threading.Thread(target=c.call, args=("POST", f"{BASE}/{c.worker['worker_id']}/pull?waitS=30",
                                                         pull_body(c.worker))) for c in clients[:2]]
        for t in threads:
            t.start()
        wait_until(lambda: plane.server.in_flight == 2)
        st, h, raw = clients[2].call("POST", f"{BASE}/{clients[2].worker['worker_id']}/pull?waitS=3",
                                     pull_body(clients[2].worker))
        assert (st, json.loads(raw).get("error"), h.get("retry-after")) == (503, "long_polls_full", "1"), raw
        st, _, body, _ = clients[2].post("pull", pull_body(clients[2].worker))    # waitS=0 still served
        assert (st, body["status"]) == (200, "idle")
        task = kit.task()
        for _ in threads:
            kit.queue(task)
        for t in threads:
            t.join(20)
            assert not t.is_alive()
    finally:
        plane.close()


def test_an_unreachable_authority_is_503_cluster_unavailable_with_retry_after(kit, pg_url):
    from pgkit import Kit
    from qlagent.adapters.postgres.connection import open_pool
    own = open_pool(pg_url, 2)
    plane = ControlPlane(Kit(own), pg_url)
    try:
        c = Client(plane.port, enrolled(kit))
        session(c)
        own.close()                     # the replica loses its database
        st, h, body, _ = c.post("heartbeat", {"sessionId": c.worker["session_id"], "generation": 1})
        assert (st, body["error"], h["retry-after"]) == (503, "cluster_unavailable", "1")
    finally:
        plane.close()


# -- TLS -------------------------------------------------------------------------------------------
def test_tls_client_pinned_to_the_right_ca_succeeds_and_another_ca_fails(kit, pg_url, tmp_path):
    ca, cert, key = make_ca(str(tmp_path), "right")
    other_ca, _, _ = make_ca(str(tmp_path), "wrong")
    plane = ControlPlane(kit, pg_url, tls=(cert, key))
    try:
        w = enrolled(kit)
        good = ssl.create_default_context(cafile=ca)
        bad = ssl.create_default_context(cafile=other_ca)
        with pytest.raises(ssl.SSLCertVerificationError):
            Client(plane.port, w, ssl_context=bad).post("sessions", {})
        plain = Client(plane.port, w, timeout=5)
        with pytest.raises(ConnectionError):        # plaintext on the TLS port: closed in the handshake
            plain.post("sessions", {})
        assert kit.one("SELECT generation FROM workers") == 0          # nothing reached the routes
        c = Client(plane.port, w, ssl_context=good)
        grant = session(c)
        assert grant["generation"] == 1
        st, _, hb, _ = c.post("heartbeat", {"sessionId": grant["sessionId"], "generation": 1})
        assert st == 200 and c.conn.sock.version() in ("TLSv1.2", "TLSv1.3")
        offer = offered(kit, c)                 # a full-size chunk spans many TLS records
        assert put_log(c, offer, 0, b"t" * MAX_CHUNK_BYTES)[::2] == (200, {"nextOffset": MAX_CHUNK_BYTES,
                                                                         "truncated": False})
        old = ssl.create_default_context(cafile=ca)
        with warnings.catch_warnings():       # TLS 1.1 is deprecated: the point is that it is refused
            warnings.simplefilter("ignore", DeprecationWarning)
            old.maximum_version = ssl.TLSVersion.TLSv1_1
            old.minimum_version = ssl.TLSVersion.MINIMUM_SUPPORTED
        with pytest.raises(ssl.SSLError):
            Client(plane.port, w, ssl_context=old).post("heartbeat", {})
    finally:
        plane.close()


def test_a_stalled_tls_handshake_is_closed_at_its_bound_and_blocks_nobody(kit, pg_url, tmp_path):
    import socket
    ca, cert, key = make_ca(str(tmp_path), "hs")
    plane = ControlPlane(kit, pg_url, tls=(cert, key), read_timeout_s=1.0)
    try:
        silent = socket.create_connection(("127.0.0.1", plane.port), timeout=10)
        half = socket.create_connection(("127.0.0.1", plane.port), timeout=10)
        half.sendall(b"\x16\x03\x01\x00\xff")      # the start of a ClientHello, then nothing
        c = Client(plane.port, enrolled(kit), ssl_context=ssl.create_default_context(cafile=ca))
        assert session(c)["generation"] == 1               # served while two handshakes stall
        t0 = time.monotonic()
        assert silent.recv(1) == b"" and half.recv(1) == b""  # closed by the server ...
        assert time.monotonic() - t0 < 8                   # ... at its bound, not at the client's timeout
        silent.close()
        half.close()
    finally:
        plane.close()


def test_the_local_http_surface_loads_no_tls_pool_or_cluster_module():
    import subprocess
    import sys
    code = ("import sys, qlagent.http.server, qlagent.http.service, qlagent.http.api; "
            "print([m for m in ('ssl', 'concurrent.futures', 'psycopg', 'qlagent.cluster', "
            "'qlagent.http.worker_routes', 'qlagent.http.tls') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]"


def test_a_pull_refused_for_want_of_long_poll_slots_moves_the_worker_to_its_next_replica(kit, pg_url, tmp_path):
    import os
    import select
    from qlagent.adapters.control_client import ControlClient
    from qlagent.core.control import ControlBusy
    full = ControlPlane(kit, pg_url, limits=replace(WorkerRouteLimits(), max_long_polls=1))
    free = ControlPlane(kit, pg_url)
    try:
        hog = Client(full.port, enrolled(kit, "hog"))
        session(hog)
        parked = threading.Thread(target=hog.call, args=("POST", f"{BASE}/{hog.worker['worker_id']}/pull?waitS=4",
                                                         pull_body(hog.worker)))
        parked.start()
        wait_until(lambda: full.server.in_flight == 1)
        w = enrolled(kit, "mover")
        cred = tmp_path / "cred"
        fd = os.open(cred, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.write(fd, w["credential"].encode())
        os.close(fd)
        client = ControlClient([f"http://127.0.0.1:{full.port}", f"http://127.0.0.1:{free.port}"],
                               w["worker_id"], str(cred), None)
        session(Client(free.port, w))
        body = json.dumps(pull_body(w)).encode()
        select.select([client.start_pull(body, 1)], [], [], 10)
        with pytest.raises(ControlBusy) as refused:
            client.finish_pull()
        assert (refused.value.code, refused.value.retry_after_s) == ("long_polls_full", 1.0)
        client.abort_poll()
        select.select([client.start_pull(body, 1)], [], [], 10)
        assert client.finish_pull()[0].status == "idle"    # answered by the other replica
        assert free.server.connections >= 1
        client.close()
        parked.join(10)
    finally:
        full.close()
        free.close()


def test_a_stale_session_is_answered_naming_the_session_it_carried_and_the_current_one(kit, cp):
    # An ACK of the current generation for a Lease of an older Session is refused naming the
    # Session the Lease is bound to and the one the request carried (never "generation 2 is
    # stale (current 2)").
    c = Client(cp.port, enrolled(kit, slots=2))
    session(c)
    offer = offered(kit, c)
    first = (c.worker["session_id"], 1)
    assert c.post("acks", ack_body(offer, "starting"))[0] == 200
    session(c)                          # generation 2: the Lease of generation 1 is fenced
    now = (c.worker["session_id"], 2)
    body = refused(c.post("acks", {**ack_body(offer, "running"), "sessionId": now[0], "generation": 2}),
                   409, "stale_generation")
    assert body["message"] == (f"the Lease is bound to Session {first[0]} (generation 1), not to Session {now[0]} "
                               "(generation 2) the request names"), body
    expected = f"Session {first[0]} (generation 1) is not the Worker's current one: Session {now[0]} (generation 2)"
    assert refused(c.post("acks", ack_body(offer, "running")), 409, "stale_generation")["message"] == expected
    assert refused(c.post("heartbeat", {"sessionId": first[0], "generation": 1}), 409,
                   "stale_generation")["message"] == expected
    assert refused(c.post("pull", pull_body({"session_id": first[0], "generation": 1})), 409,
                   "stale_generation")["message"] == expected
    st, _, raw = c.call("PUT", f"{BASE}/{c.worker['worker_id']}/attempts/{offer['attemptId']}/log?offset=0",
                        raw=b"late", content_type="application/octet-stream",
                        headers={"X-Qlagent-Session": first[0], "X-Qlagent-Generation": "1",
                                 "X-Qlagent-Lease-Generation": str(offer["leaseGeneration"]),
                                 "X-Qlagent-Lease-Token": offer["leaseToken"]})
    assert (st, json.loads(raw)["message"]) == (409, expected)


HELLOS = 2_000


def test_hellos_in_a_loop_from_one_credential_leave_a_bounded_session_table(kit, pg_url):
    # HELLOS hellos leave a bounded number of worker_sessions rows (old Sessions are deleted,
    # one a Lease names is kept): at most SESSION_HISTORY + 2 where a table that kept them would
    # hold HELLOS + 1. The store's hello, the one the route calls, in a loop (its commits not
    # waiting for the disk: thousands of fsyncs would take minutes on a shared box).
    from qlagent.adapters.postgres.connection import open_pool
    from qlagent.adapters.postgres.registry import SESSION_HISTORY, PgWorkerRegistry
    from qlagent.cluster.registry import WorkerRegistry
    from qlagent.core.cluster import Hello
    w = kit.worker("chatty", slots=2)
    kit.queue(kit.task("kept"))
    assert kit.claim(w)            # a Lease names generation 1's Session: that row stays
    fast = open_pool(pg_url + "?options=-c%20synchronous_commit%3Doff", 1)
    try:
        registry = WorkerRegistry(PgWorkerRegistry(fast))
        for _ in range(HELLOS):
            grant = registry.open_session(w["worker_id"], w["credential"], Hello())
    finally:
        fast.close()
    assert grant.generation == HELLOS + 1
    rows = kit.sql("SELECT generation FROM worker_sessions WHERE worker_id = %s ORDER BY generation",
                   (w["worker_id"],))
    assert len(rows) <= SESSION_HISTORY + 2, len(rows)
    assert rows[-1] == (HELLOS + 1,) and kit.one("SELECT count(*) FROM run_leases") >= 1
    assert kit.one("SELECT count(*) FROM run_leases l LEFT JOIN worker_sessions s USING (session_id) "
                   "WHERE s.session_id IS NULL") == 0           # every Lease's Session is kept
