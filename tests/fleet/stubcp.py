"""A STUB of the control plane's Worker protocol (docs/worker-protocol.md), for the fleet
Worker's tests until the real routes (issue 10, `qlagent serve` with `[cluster]`) land; the
fleet integration test replaces it with real replicas on PostgreSQL.

Real HTTP/1.1 over loopback, real TLS with a throwaway CA made at test time (``cryptography``),
in-memory state guarded by one lock. It follows the protocol page and the rules of the real
control plane that a Worker can observe: Sessions and generations (a new Session adopts the
Leases its hello names and may keep, and fences every other Lease of the older ones), a
heartbeat renewing only the Leases it names (≤ 64; an unnamed one runs out, and the sweep,
run before each request, re-queues its Attempt), Pull
retried by (Session, pullId) with the token checked, Lease fence on ACKs and chunks (token,
Session, generation), ACK replays, offset-addressed chunks with the quota and a truncation
flag, ``X-Qlagent-Server-Now-Us`` on every answer, the documented error codes. It is not a
scheduler: the test queues Runs with ``add_run``.

Test handles: ``partition(True)`` (every request is dropped unanswered and nothing is written),
``rotate_credential(worker)`` (the Worker's credential refused from then on),
``drop_next_pull_answer()`` (the claim commits, the answer is lost), ``drop_ack_answers`` (every ACK is applied,
its answer lost), ``refuse_chunks`` (503), ``cancel(attempt)``, ``pull_bodies`` (raw request
bodies), ``heartbeats`` (decoded requests), ``chunk_times``, ``acks``, ``logs``, ``lease()``, ``hellos``,
``expire_lease(attempt)``.
"""

from __future__ import annotations

import datetime
import hashlib
import http.server
import json
import os
import secrets
import ssl
import threading
import time
import urllib.parse
import uuid

import msgspec

from qlagent.core.canonical import content_digest
from qlagent.core.cluster import (Ack, AckResult, AdoptedLease, AdoptRefusal, ChunkAnswer, ClaimedExecutionOffer,
                                  ExecutionSpec, Heartbeat, HeartbeatRequest, Hello, LeaseExpiry, PullAnswer,
                                  PullRequest, SessionGrant)

OFFER_NAMESPACE = uuid.UUID("4d2b8a8e-1f0c-5a7e-9b61-0c1a7e3f5d20")     # as cluster.offer
MAX_JSON = 16_384
MAX_CHUNK = 262_144


def now_us() -> int:
    return time.time_ns() // 1_000


def make_ca(dirpath: str, name: str = "stub", *, sans=("localhost", "127.0.0.1"),
            expired: bool = False) -> tuple[str, str, str]:
    """(ca.pem, server cert.pem, server key.pem) under ``dirpath``: a fresh CA and a server
    certificate for ``sans`` (host names and IP addresses) signed by it; ``expired``: the
    server certificate's validity ended yesterday."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID
    import ipaddress

    def name_of(cn):
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])
    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (x509.CertificateBuilder().subject_name(name_of(f"{name} CA")).issuer_name(name_of(f"{name} CA"))
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=365))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())

    def san(n):
        try:
            return x509.IPAddress(ipaddress.ip_address(n))
        except ValueError:
            return x509.DNSName(n)
    begins, ends = (now - datetime.timedelta(days=3), now - datetime.timedelta(days=1)) if expired else \
        (now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=365))
    cert = (x509.CertificateBuilder().subject_name(name_of(sans[0])).issuer_name(ca.subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(begins).not_valid_after(ends)
            .add_extension(x509.SubjectAlternativeName([san(n) for n in sans]), critical=False)
            .sign(ca_key, hashes.SHA256()))
    paths = tuple(os.path.join(dirpath, f"{name}-{n}.pem") for n in ("ca", "cert", "key"))
    with open(paths[0], "wb") as f:
        f.write(ca.public_bytes(serialization.Encoding.PEM))
    with open(paths[1], "wb") as f:
        f.write(cert.public_bytes(serialization.Encoding.PEM))
    with open(paths[2], "wb") as f:
        f.write(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                  serialization.NoEncryption()))
    return paths


class HttpError(Exception):
    def __init__(self, status: int, code: str, message: str = "", field: str | None = None, **extra) -> None:
        super().__init__(message)
        self.status, self.code, self.message, self.field, self.extra = status, code, message, field, extra


class Drop(Exception):
    """Close the connection without an answer."""


class StubControlPlane:
    def __init__(self, workdir: str, *, tls: bool = True, lease_ttl_s: float = 6.0, session_ttl_s: float = 6.0) -> None:
        self.workdir, self.tls = workdir, tls
        self.lease_ttl_us, self.session_ttl_us = int(lease_ttl_s * 1e6), int(session_ttl_s * 1e6)
        self.ca_file = self.cert = self.key = None
        if tls:
            self.ca_file, self.cert, self.key = make_ca(workdir)
        self.lock = threading.Condition()
        self.workers: dict[str, dict] = {}          # worker_id → {digest, generation, session}
        self.sessions: dict[str, dict] = {}         # session_id → {worker, generation, expires, slots, state}
        self.queue: list[str] = []                  # attempt IDs waiting for a Pull
        self.attempts: dict[str, dict] = {}         # attempt_id → {spec, secrets, state, lease, cancel}
        self.acks: list[Ack] = []
        self.logs: dict[str, bytearray] = {}
        self.log_ends: dict[str, int] = {}
        self.truncated: dict[str, bool] = {}
        self.pull_bodies: list[bytes] = []
        self.hellos: list[Hello] = []
        self.heartbeats: list[HeartbeatRequest] = []
        self.chunk_times: list[tuple[float, str, int]] = []     # (time.monotonic(), attempt, bytes) per chunk
        self.requests: list[tuple[str, str, int]] = []     # (method, route, status)
        self._partition = False
        self.refuse_chunks = False                  # answer log chunks 503 cluster_unavailable
        self.drop_ack_answers = False               # apply ACKs, then drop their answers
        self.adopt_left_us: int | None = None        # an adopted Lease has only this long left
        self._drop_pull = 0
        self.server = None

    # ---- test handles ------------------------------------------------------------------------
    def start(self) -> str:
        cp = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            disable_nagle_algorithm = True

            def log_message(self, *a):
                pass

            def _any(self):
                cp._handle(self)

            do_POST = do_PUT = do_GET = _any

        class Server(http.server.ThreadingHTTPServer):
            def handle_error(self, request, client_address):
                pass                # a peer that hung up (a dropped answer, a refused CA) is expected

        self.server = Server(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        if self.tls:
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            ctx.load_cert_chain(self.cert, self.key)
            self.server.socket = ctx.wrap_socket(self.server.socket, server_side=True)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        port = self.server.server_address[1]
        return f"{'https' if self.tls else 'http'}://{'localhost' if self.tls else '127.0.0.1'}:{port}"

    def stop(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()

    def enrol(self) -> tuple[str, str]:
        wid = str(uuid.uuid4())
        cred = "qlw_" + secrets.token_urlsafe(32)          # 43 URL-safe characters
        with self.lock:
            self.workers[wid] = {"digest": hashlib.sha256(cred.encode()).hexdigest(), "generation": 0,
                                 "session": None}
        return wid, cred

    def add_run(self, argv=None, *, shell=None, script=None, env=None, secrets=None, timeout_ms=60_000,
                grace_ms=1_000, log_quota_bytes=4_194_304, on_lease_loss="kill", keep_orphans=False) -> str:
        aid = str(uuid.uuid4())
        secret_refs = {k: k.lower() for k in (secrets or {})}
        spec = ExecutionSpec(run_id=str(uuid.uuid4()), attempt_id=aid, project_id=str(uuid.uuid4()),
                             task_id=str(uuid.uuid4()), task_revision=1, executor_type="local_process",
                             kind="shell" if shell else "local_process", argv=tuple(argv or ()), shell=shell,
                             script=script, env=dict(env or {}), secret_refs=secret_refs, timeout_ms=timeout_ms,
                             grace_ms=grace_ms, log_quota_bytes=log_quota_bytes, on_lease_loss=on_lease_loss,
                             keep_orphans=keep_orphans)
        with self.lock:
            self.attempts[aid] = {"spec": spec, "secrets": dict(secrets or {}), "state": "queued", "lease": None,
                                  "cancel": False, "lease_generation": 0}
            self.queue.append(aid)
            self.lock.notify_all()
        return aid

    def cancel(self, attempt_id: str) -> None:
        with self.lock:
            self.attempts[attempt_id]["cancel"] = True

    def rotate_credential(self, worker_id: str) -> str:
        """A new credential for ``worker_id``: the one it holds is refused (401) from now on."""
        cred = "qlw_" + secrets.token_urlsafe(32)
        with self.lock:
            self.workers[worker_id]["digest"] = hashlib.sha256(cred.encode()).hexdigest()
        return cred

    def expire_lease(self, attempt_id: str) -> None:
        """The Lease runs out now (as if its Worker had been down longer than the TTL)."""
        with self.lock:
            self.attempts[attempt_id]["lease"]["expires"] = now_us() - 1

    def partition(self, on: bool) -> None:
        with self.lock:
            self._partition = on

    def drop_next_pull_answer(self) -> None:
        with self.lock:
            self._drop_pull += 1

    def state(self, attempt_id: str) -> str:
        with self.lock:
            return self.attempts[attempt_id]["state"]

    def lease(self, attempt_id: str) -> dict | None:
        with self.lock:
            lease = self.attempts[attempt_id]["lease"]
            return dict(lease) if lease else None

    def acks_of(self, attempt_id: str) -> list[str]:
        with self.lock:
            return [a.kind for a in self.acks if a.attempt_id == attempt_id]

    def log_of(self, attempt_id: str) -> bytes:
        with self.lock:
            return bytes(self.logs.get(attempt_id, b""))

    def wait(self, predicate, timeout_s: float = 30.0) -> bool:
        """Block until ``predicate()`` (checked under the lock at every change) or the timeout."""
        end = time.monotonic() + timeout_s
        with self.lock:
            while not predicate():
                left = end - time.monotonic()
                if left <= 0:
                    return False
                self.lock.wait(min(left, 0.2))
            return True

    # ---- protocol ----------------------------------------------------------------------------
    def _handle(self, h: http.server.BaseHTTPRequestHandler) -> None:
        url = urllib.parse.urlsplit(h.path)
        length = int(h.headers.get("Content-Length") or 0)
        body = h.rfile.read(length) if length else b""
        parts = url.path.strip("/").split("/")
        route = "/".join(parts[5:]) if len(parts) > 5 else url.path
        try:
            with self.lock:
                if self._partition:
                    raise Drop()
            if parts[:4] != ["api", "v3", "cluster", "workers"] or len(parts) < 6:
                raise HttpError(404, "not_found")
            wid = parts[4]
            self._auth(h, wid)
            q = urllib.parse.parse_qs(url.query)
            if h.command == "POST" and parts[5:] == ["sessions"]:
                status, doc = 201, self._session(wid, self._decode(h, body, Hello))
            elif h.command == "POST" and parts[5:] == ["heartbeat"]:
                status, doc = 200, self._heartbeat(wid, self._decode(h, body, HeartbeatRequest))
            elif h.command == "POST" and parts[5:] == ["pull"]:
                self.pull_bodies.append(body)
                wait_s = float(q.get("waitS", ["0"])[0])
                if not 0 <= wait_s <= 30:
                    raise HttpError(400, "invalid_request", "waitS outside 0..30", field="waitS")
                status, doc = 200, self._pull(wid, self._decode(h, body, PullRequest), wait_s)
                with self.lock:
                    if self._drop_pull:
                        self._drop_pull -= 1
                        raise Drop()
            elif h.command == "POST" and parts[5:] == ["acks"]:
                status, doc = 200, self._ack(wid, self._decode(h, body, Ack))
                if self.drop_ack_answers:
                    raise Drop()
            elif h.command == "PUT" and len(parts) == 8 and parts[5] == "attempts" and parts[7] == "log":
                if self.refuse_chunks:
                    raise HttpError(503, "cluster_unavailable", "the database is not reachable")
                status, doc = 200, self._chunk(wid, parts[6], h, q, body)
            else:
                raise HttpError(404, "not_found")
        except Drop:
            self.requests.append((h.command, route, 0))
            h.close_connection = True
            return
        except HttpError as e:
            status, doc = e.status, {"error": e.code, "field": e.field, "message": e.message, **e.extra}
        data = msgspec.json.encode(doc)
        with self.lock:
            self.requests.append((h.command, route, status))
            self.lock.notify_all()
        h.send_response(status)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(data)))
        h.send_header("X-Qlagent-Server-Now-Us", str(now_us()))
        h.end_headers()
        h.wfile.write(data)

    def _decode(self, h, body: bytes, typ):
        if len(body) > MAX_JSON:
            raise HttpError(413, "body_too_large")
        if h.headers.get("Content-Type") != "application/json":
            raise HttpError(400, "invalid_request", "Content-Type", field="Content-Type")
        try:
            return msgspec.json.decode(body, type=typ)
        except msgspec.ValidationError as e:
            raise HttpError(400, "invalid_request", str(e).split(" - ")[0], field=str(e).rsplit("`$.", 1)[-1][:-1]
                            if "`$." in str(e) else None) from None
        except msgspec.DecodeError:
            raise HttpError(400, "invalid_request", "not JSON") from None

    def _auth(self, h, wid: str) -> None:
        auth = h.headers.get("Authorization") or ""
        kind, _, cred = auth.partition(" ")
        digest = hashlib.sha256(cred.encode()).hexdigest()
        with self.lock:
            owner = next((w for w, v in self.workers.items() if v["digest"] == digest), None)
        if kind != "Worker" or owner is None:
            raise HttpError(401, "worker_unauthenticated", "not a Worker credential")
        if owner != wid:
            raise HttpError(403, "worker_mismatch", "the credential belongs to another Worker")

    def _live_session(self, wid: str, sid: str, gen: int) -> dict:
        w = self.workers[wid]
        s = self.sessions.get(sid)
        if s is None or s["worker"] != wid or gen != w["generation"] or s["generation"] != gen:
            raise HttpError(409, "stale_generation", f"generation {gen} is stale (current {w['generation']})")
        if s["state"] != "open" or s["expires"] <= now_us():
            s["state"] = "expired"
            raise HttpError(409, "session_expired", "the Session expired")
        return s

    def _session(self, wid: str, hello: Hello) -> SessionGrant:
        with self.lock:
            self.hellos.append(hello)
            w = self.workers[wid]
            w["generation"] += 1
            sid = str(uuid.uuid4())
            for s in self.sessions.values():
                if s["worker"] == wid:
                    s["state"] = "closed"
            now = now_us()
            adopted, refused = [], []
            for c in sorted(hello.adopt, key=lambda c: c.attempt_id):
                a = self.attempts.get(c.attempt_id)
                lease = a["lease"] if a else None
                reason = self._adopt_refusal(wid, a, lease, c, now)
                if reason:
                    refused.append(AdoptRefusal(c.attempt_id, c.lease_generation, reason))
                    continue
                lease["session"], lease["worker_generation"] = sid, w["generation"]
                if self.adopt_left_us is not None:     # as if its last renewal were long ago
                    lease["expires"] = min(lease["expires"], now + self.adopt_left_us)
                adopted.append(AdoptedLease(c.attempt_id, c.lease_generation, lease["expires"]))
            for a in self.attempts.values():           # every other Lease of an older Session is fenced
                lease = a["lease"]
                if lease and lease["worker"] == wid and lease["state"] == "active" and lease["session"] != sid:
                    lease["state"] = "fenced"
                    self._requeue(a)
            self.sessions[sid] = {"worker": wid, "generation": w["generation"], "expires": now + self.session_ttl_us,
                                  "slots": hello.slots or 1, "state": "open"}
            w["session"] = sid
            return SessionGrant(worker_id=wid, session_id=sid, generation=w["generation"], labels=hello.labels or {},
                                executor_types=tuple(hello.executor_types or ("local_process",)),
                                slots=hello.slots or 1, expires_at_us=now + self.session_ttl_us,
                                adopted=tuple(adopted), refused=tuple(refused))

    @staticmethod
    def _adopt_refusal(wid: str, a: dict | None, lease: dict | None, c, now: int) -> str | None:
        if lease is None or lease["worker"] != wid or lease["generation"] != c.lease_generation:
            return "lease_not_found"
        if lease["digest"] != hashlib.sha256(c.lease_token.encode()).hexdigest():
            return "lease_token_mismatch"
        if lease["state"] in ("expired", "fenced"):
            return "lease_not_active"
        if lease["state"] == "active" and lease["expires"] <= now:
            return "lease_expired"
        if lease["state"] == "active" and a["state"] == "leased":
            return "not_started"
        if lease["state"] == "active" and a["cancel"]:
            return "run_cancelled"
        return None

    def _requeue(self, a: dict) -> None:
        if a["state"] in ("leased", "starting", "running"):
            a["state"] = "queued"
            self.queue.append(a["spec"].attempt_id)

    def _sweep(self) -> None:
        now = now_us()
        for a in self.attempts.values():
            lease = a["lease"]
            if lease and lease["state"] == "active" and lease["expires"] <= now:
                lease["state"] = "expired"
                self._requeue(a)

    def _heartbeat(self, wid: str, req: HeartbeatRequest) -> Heartbeat:
        if len(req.leases) > 64:
            raise HttpError(400, "invalid_request", f"{len(req.leases)} Leases; at most 64", field="leases")
        named = {(x.attempt_id, x.lease_generation) for x in req.leases}
        with self.lock:
            self.heartbeats.append(req)
            self._sweep()
            s = self._live_session(wid, req.session_id, req.generation)
            now = now_us()
            s["expires"] = now + self.session_ttl_us
            cancel, renewed = [], []
            for a in self.attempts.values():
                lease = a["lease"]
                if not lease or lease["session"] != req.session_id or lease["state"] != "active":
                    continue
                if a["cancel"]:
                    cancel.append(a["spec"].attempt_id)
                if (a["spec"].attempt_id, lease["generation"]) in named and a["state"] in ("starting", "running"):
                    lease["expires"] = max(lease["expires"], now + self.lease_ttl_us)
                    renewed.append(LeaseExpiry(a["spec"].attempt_id, lease["expires"]))
            self.lock.notify_all()
            return Heartbeat(expires_at_us=s["expires"], cancel=cancel, leases=renewed)

    def _offer(self, a: dict, wid: str, s_id: str, gen: int, token: str) -> ClaimedExecutionOffer:
        lease, spec = a["lease"], a["spec"]
        return ClaimedExecutionOffer(
            offer_id=str(uuid.uuid5(OFFER_NAMESPACE, f"{spec.attempt_id}:{lease['generation']}:{s_id}")),
            source="new_claim", run_id=spec.run_id, attempt_id=spec.attempt_id, project_id=spec.project_id,
            task_id=spec.task_id, task_revision=spec.task_revision, worker_id=wid, session_id=s_id, generation=gen,
            lease_generation=lease["generation"], lease_expires_at_us=lease["expires"], lease_token=token,
            spec_digest=content_digest(msgspec.to_builtins(spec)), spec=spec, placement_score=0,
            secrets=dict(a["secrets"]))

    def _pull(self, wid: str, req: PullRequest, wait_s: float) -> PullAnswer:
        digest = hashlib.sha256(req.lease_token.encode()).hexdigest()
        end = time.monotonic() + wait_s
        with self.lock:
            while True:
                self._sweep()
                s = self._live_session(wid, req.session_id, req.generation)
                for a in self.attempts.values():
                    lease = a["lease"]
                    if lease and lease["session"] == req.session_id and lease["pull_id"] == req.pull_id:
                        if lease["digest"] != digest:
                            raise HttpError(409, "pull_token_mismatch", "this pullId was answered with another token")
                        if lease["state"] != "active":
                            return PullAnswer(status="lease_ended", reason=f"lease_{lease['state']}")
                        if a["state"] not in ("leased", "starting"):       # as cluster.pull: not once running
                            return PullAnswer(status="lease_ended", reason=f"attempt_{a['state']}")
                        return PullAnswer(status="offered", reason="new_claim",
                                          offer=self._offer(a, wid, req.session_id, req.generation, req.lease_token))
                busy = sum(1 for a in self.attempts.values() if a["lease"] and a["lease"]["session"] == req.session_id
                           and a["lease"]["state"] == "active")
                if busy < s["slots"] and self.queue:
                    a = self.attempts[self.queue.pop(0)]
                    a["lease_generation"] += 1
                    a["state"] = "leased"
                    a["lease"] = {"generation": a["lease_generation"], "digest": digest, "session": req.session_id,
                                  "worker_generation": req.generation, "worker": wid, "state": "active",
                                  "expires": now_us() + self.lease_ttl_us, "pull_id": req.pull_id,
                                  "claimed_at": now_us()}
                    return PullAnswer(status="offered", reason="new_claim",
                                      offer=self._offer(a, wid, req.session_id, req.generation, req.lease_token))
                left = end - time.monotonic()
                if left <= 0:
                    return PullAnswer(status="idle", reason="no_candidate" if busy < s["slots"] else "no_free_slot")
                self.lock.wait(min(left, 0.5))

    def _fence(self, wid: str, attempt_id: str, sid: str, gen: int, lease_gen: int, token: str) -> dict:
        if self.workers[wid]["generation"] != gen:      # judged first, as fenced_lease does
            raise HttpError(409, "stale_generation", "stale generation")
        a = self.attempts.get(attempt_id)
        lease = a["lease"] if a else None
        if lease is None or lease["generation"] != lease_gen or lease["worker"] != wid:
            raise HttpError(404, "attempt_not_found", "no such Lease for this Worker")
        if lease["digest"] != hashlib.sha256(token.encode()).hexdigest():
            raise HttpError(409, "lease_token_mismatch", "lease token does not match the Lease")
        if lease["session"] != sid or lease["worker_generation"] != gen:
            raise HttpError(409, "stale_generation", "stale generation")
        return a

    def _ack(self, wid: str, ack: Ack) -> AckResult:
        with self.lock:
            self._sweep()
            a = self._fence(wid, ack.attempt_id, ack.session_id, ack.generation, ack.lease_generation,
                            ack.lease_token)
            lease = a["lease"]
            target = {"starting": "starting", "running": "running", "start_failure": "start_failed",
                      "completion": "ended"}.get(ack.kind)
            if target is None:
                raise HttpError(400, "invalid_request", "kind", field="kind")
            if ack.kind == "completion" and (ack.exit_code is None) == (ack.signal is None):
                raise HttpError(400, "invalid_request", "give exactly one of exitCode and signal", field="exitCode")
            order = ["leased", "starting", "running", "start_failed", "ended"]
            if order.index(a["state"]) >= order.index(target) or lease["state"] == "completed":
                return AckResult(attempt_state=a["state"], run_state=a["state"], replay=True)
            if lease["state"] != "active":
                raise HttpError(409, "lease_not_active", f"the Lease is {lease['state']}")
            a["state"] = target
            self.acks.append(ack)
            if target in ("starting", "running"):
                lease["expires"] = max(lease["expires"], now_us() + self.lease_ttl_us)
            else:
                lease["state"] = "completed"
            self.lock.notify_all()
            return AckResult(attempt_state=target, run_state=target)

    def _chunk(self, wid: str, attempt_id: str, h, q, body: bytes) -> ChunkAnswer:
        try:
            offset = int(q["offset"][0])
            sid, gen = h.headers["X-Qlagent-Session"], int(h.headers["X-Qlagent-Generation"])
            lgen, token = int(h.headers["X-Qlagent-Lease-Generation"]), h.headers["X-Qlagent-Lease-Token"]
        except (KeyError, ValueError, TypeError):
            raise HttpError(400, "invalid_request", "offset and fence headers", field="offset") from None
        if h.headers.get("Content-Type") != "application/octet-stream" or not 1 <= len(body) <= MAX_CHUNK:
            raise HttpError(400, "invalid_request", "1..262144 bytes of application/octet-stream", field="data")
        with self.lock:
            a = self._fence(wid, attempt_id, sid, gen, lgen, token)
            if a["lease"]["state"] not in ("active", "completed"):
                raise HttpError(409, "lease_not_active", f"the Lease is {a['lease']['state']}")
            kept = self.logs.setdefault(attempt_id, bytearray())
            end = self.log_ends.get(attempt_id, 0)
            quota = a["spec"].log_quota_bytes
            if offset > end:
                raise HttpError(409, "chunk_gap", f"next expected offset is {end}", field="offset", nextOffset=end)
            if offset < end:
                overlap = min(end, offset + len(body)) - offset
                have = bytes(kept[offset:offset + overlap])       # bytes past the quota are not kept
                if have != body[:len(have)]:
                    raise HttpError(409, "chunk_mismatch", "the offset holds other bytes", field="offset",
                                    nextOffset=end)
                body, offset = body[overlap:], offset + overlap
            self.chunk_times.append((time.monotonic(), attempt_id, len(body)))
            if body:
                room = max(0, quota - len(kept))
                kept += body[:room]
                if len(body) > room:
                    self.truncated[attempt_id] = True
                self.log_ends[attempt_id] = offset + len(body)
            self.lock.notify_all()
            return ChunkAnswer(self.log_ends.get(attempt_id, 0), self.truncated.get(attempt_id, False))


def write_credential(path: str, credential: str, mode: int = 0o600) -> str:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "w") as f:
        f.write(credential + "\n")
    os.chmod(path, mode)
    return path


def worker_config(path: str, *, state_dir: str, worker_id: str, url: str | list[str], credential_file: str,
                  ca_file: str | None, slots: int = 2, heartbeat_s: float = 1.0, pull_wait_s: int = 5,
                  extra: str = "", drain_grace_s: float | None = None) -> str:
    lines = [f'state_dir = "{state_dir}"', *([f"drain_grace_s = {drain_grace_s}"] if drain_grace_s is not None else []),
             "", "[worker]", f'worker_id = "{worker_id}"', "control_url = " + json.dumps(url),
             f'credential_file = "{credential_file}"', f"slots = {slots}", f"heartbeat_interval_s = {heartbeat_s}",
             f"pull_wait_s = {pull_wait_s}", 'labels = { site = "lab" }']
    if ca_file:
        lines.append(f'ca_file = "{ca_file}"')
    if extra:
        lines.append(extra)
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    os.chmod(path, 0o600)
    return path

