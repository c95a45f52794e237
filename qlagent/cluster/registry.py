"""Worker registry policy (issue 10 §3): enrolment, Sessions, heartbeats, drain, removal.

A Worker is enrolled once (name, labels, executor types, slots) and receives a credential
``qlw_`` + 43 URL-safe characters (256 bits), shown once: only its SHA-256 is stored. Each
Session it opens increments the Worker's generation and fences every Lease of older Sessions.
The Session hello may narrow, never widen, what the enrolment allows: a subset of its labels
(same values), of its executor types, and at most its slots. Heartbeats extend the Session by
``session_ttl_s`` and, by ``lease_ttl_s``, exactly the Leases of that Session the heartbeat names
as still held (``leases``, ≤ ``MAX_HELD``) whose Attempts are starting/running; they return the
cancel intents of its Attempts. A Lease the Worker no longer names (its run self-fenced or
dropped, issue 11 §6) is not renewed: it runs out and the lease sweeper ends it (Attempt
``lost``, the retry policy decides). A Session past its expiry is offline.

Adoption (issue 11 "a Worker restart re-attaches live shims"; docs/worker-protocol.md): the
hello may name up to ``MAX_ADOPT`` Leases of this Worker's older Sessions with their tokens. In
the transaction that opens the new Session, each one that is still the Worker's, proven by its
token digest, and either ``completed`` (its log chunks and a replayed completion still need a
fence) or active, unexpired by the database clock, its Attempt ``starting``/``running`` and its
Run not asked to cancel, is re-bound to the new Session and generation (RunEvent
``lease.adopted``); every other active Lease of the older Sessions is fenced as before. A
``claimed`` Attempt is never adopted: the Worker writes its crash barrier only after the
``starting`` ACK was applied, so an Attempt still claimed was never spawned, and ADR-0014 ends
its re-delivery with the Session replacement (it is re-offered).
"""

from __future__ import annotations

import base64
import os
import re

import msgspec

from ..core.canonical import sha256_hex
from ..core.cluster import (MAX_ADOPT, MAX_HELD, Enrolment, Heartbeat, HeldLease, Hello, LeaseExpiry, SessionGrant,
                            WorkerAuthError, WorkerInfo)
from ..core.errors import ValidationError
from ..core.executors import WORKER_EXECUTORS
from ..core.inbox_states import MAX_GENERATION, MAX_LEASE_TOKEN, MIN_LEASE_TOKEN
from ..core.leasefit import check_lease_ttl
from ..core.ports import WorkerRegistryStore
from ..core.states import WorkerState
from .placement import check_labels

CREDENTIAL_PREFIX = "qlw_"
_CREDENTIAL = re.compile(r"^qlw_[A-Za-z0-9_-]{43}\Z")
WORKER_NAME = re.compile(r"^[a-z0-9][a-z0-9._-]{0,63}\Z")
MAX_SLOTS = 256
MAX_PROJECTS = 32              # Projects one Worker may be scoped to at enrolment
UUID = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}\Z")


def new_credential() -> str:
    """``qlw_`` + 43 URL-safe characters: 256 bits from ``os.urandom`` (docs/worker-protocol.md)."""
    return CREDENTIAL_PREFIX + base64.urlsafe_b64encode(os.urandom(32)).rstrip(b"=").decode("ascii")


def credential_digest(credential: str) -> str:
    """SHA-256 hex of a well-formed Worker credential; WorkerAuthError for any other string."""
    if not isinstance(credential, str) or not _CREDENTIAL.match(credential):
        raise WorkerAuthError("not a Worker credential")
    return sha256_hex(credential.encode())


def check_uuid(field: str, value) -> str:
    if not isinstance(value, str) or not UUID.fullmatch(value):
        raise ValidationError(field, "must be a lowercase canonical UUID")
    return value


def check_name(value) -> str:
    """A Worker name: 1..64 of [a-z0-9._-], starting alphanumeric; ValidationError ``name``."""
    if not isinstance(value, str) or not WORKER_NAME.fullmatch(value):
        raise ValidationError("name", "must be 1..64 of [a-z0-9._-], starting alphanumeric", limit=64)
    return value


def check_generation(field: str, value) -> int:
    """A Session or Lease generation: 1..2^63-1 (a PostgreSQL bigint, as the Worker inbox checks)."""
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= MAX_GENERATION:
        raise ValidationError(field, "must be an integer 1..2^63-1", limit=MAX_GENERATION)
    return value


LEASE_TOKEN = re.compile(r"[A-Za-z0-9_-]+")


def check_token(field: str, token) -> str:
    """A lease token: 32..256 URL-safe characters (≥ 192 bits, the Worker inbox's own rule in
    ``core.inbox_states``); never echoed in the error."""
    if (not isinstance(token, str) or not MIN_LEASE_TOKEN <= len(token) <= MAX_LEASE_TOKEN
            or not LEASE_TOKEN.fullmatch(token)):
        raise ValidationError(field, f"must be {MIN_LEASE_TOKEN}..{MAX_LEASE_TOKEN} URL-safe characters",
                              limit=MAX_LEASE_TOKEN)
    return token


def adopt_claims(hello: Hello) -> list[tuple[str, int, str]]:
    """(Attempt ID, lease generation, token SHA-256 hex) of ``hello.adopt`` in Attempt ID order.
    ValidationError naming ``hello.adopt`` (over ``MAX_ADOPT``, an Attempt named twice) or
    ``hello.adopt[i].attemptId`` / ``.leaseGeneration`` / ``.leaseToken``."""
    if len(hello.adopt) > MAX_ADOPT:
        raise ValidationError("hello.adopt", f"{len(hello.adopt)} Leases; at most {MAX_ADOPT}", limit=MAX_ADOPT)
    out = {}
    for i, c in enumerate(hello.adopt):
        aid = check_uuid(f"hello.adopt[{i}].attemptId", c.attempt_id)
        if aid in out:
            raise ValidationError("hello.adopt", f"Attempt {aid} named twice")
        out[aid] = (aid, check_generation(f"hello.adopt[{i}].leaseGeneration", c.lease_generation),
                    sha256_hex(check_token(f"hello.adopt[{i}].leaseToken", c.lease_token).encode()))
    return [out[k] for k in sorted(out)]


def held_leases(leases: tuple[HeldLease, ...]) -> list[tuple[str, int]]:
    """(Attempt ID, lease generation) of a heartbeat's ``leases`` in Attempt ID order.
    ValidationError naming ``leases`` (over ``MAX_HELD``, an Attempt named twice) or
    ``leases[i].attemptId`` / ``leases[i].leaseGeneration``."""
    if len(leases) > MAX_HELD:
        raise ValidationError("leases", f"{len(leases)} Leases; at most {MAX_HELD}", limit=MAX_HELD)
    out = {}
    for i, h in enumerate(leases):
        aid = check_uuid(f"leases[{i}].attemptId", h.attempt_id)
        if aid in out:
            raise ValidationError("leases", f"Attempt {aid} named twice")
        out[aid] = (aid, check_generation(f"leases[{i}].leaseGeneration", h.lease_generation))
    return [out[k] for k in sorted(out)]


MAX_LIST = 256                 # Workers per page of ``WorkerRegistry.list``


class Timings(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Seconds: Session lifetime without a heartbeat, running-Lease lifetime without one."""

    session_ttl_s: int = 30
    lease_ttl_s: int = 30


def check_executors(field: str, value) -> tuple[str, ...]:
    if not isinstance(value, (list, tuple)) or not value or len(set(value)) != len(value):
        raise ValidationError(field, "must be a non-empty list without repeats")
    for v in value:
        if v not in WORKER_EXECUTORS:
            raise ValidationError(field, f"{v!r} is not one of {list(WORKER_EXECUTORS)}")
    return tuple(sorted(value))


def check_projects(field: str, names) -> tuple[str, ...]:
    """At most ``MAX_PROJECTS`` distinct Project names (each 1..128 bytes, no NUL); ValidationError."""
    names = tuple(names)
    if len(names) > MAX_PROJECTS:
        raise ValidationError(field, f"{len(names)} Projects", limit=MAX_PROJECTS)
    for n in names:
        if not isinstance(n, str) or not n or len(n.encode()) > 128 or "\x00" in n:
            raise ValidationError(field, f"{n!r} is not a Project name (1..128 bytes, no NUL)", limit=128)
        if names.count(n) > 1:
            raise ValidationError(field, f"{n!r} is given twice")
    return names


def check_slots(field: str, value) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= MAX_SLOTS:
        raise ValidationError(field, f"{value!r} outside 1..{MAX_SLOTS}", limit=MAX_SLOTS)
    return value


def narrow(enrolment: Enrolment, hello: Hello) -> tuple[dict[str, str], tuple[str, ...], int]:
    """(labels, executor types, slots) of a Session: the hello within the enrolment.
    Raises ValidationError naming the ``hello.*`` field that would widen it."""
    labels = enrolment.labels
    if hello.labels is not None:
        labels = check_labels("hello.labels", hello.labels)
        for k, v in labels.items():
            if enrolment.labels.get(k) != v:
                raise ValidationError(f"hello.labels.{k}", "not granted by the enrolment (a hello may only narrow)")
    executors = enrolment.executor_types
    if hello.executor_types is not None:
        executors = check_executors("hello.executorTypes", hello.executor_types)
        if set(executors) - set(enrolment.executor_types):
            raise ValidationError("hello.executorTypes", "names an executor the enrolment does not grant")
    slots = enrolment.slots
    if hello.slots is not None:
        slots = check_slots("hello.slots", hello.slots)
        if slots > enrolment.slots:
            raise ValidationError("hello.slots", f"{slots} exceeds the enrolled {enrolment.slots}",
                                  limit=enrolment.slots)
    return dict(labels), tuple(executors), slots


class WorkerRegistry:
    """Worker enrolment and Sessions over the registry store (``core.ports.WorkerRegistryStore``)."""

    def __init__(self, store: WorkerRegistryStore, timings: Timings = Timings()) -> None:
        if not 5 <= timings.session_ttl_s <= 3600:
            raise ValidationError("cluster.session_ttl_s", f"{timings.session_ttl_s} outside 5..3600", limit=3600)
        check_lease_ttl("cluster.lease_ttl_s", timings.lease_ttl_s)
        self._store, self._t = store, timings

    def enroll(self, name: str, labels: dict[str, str] | None = None,
               executor_types: tuple[str, ...] = ("local_process",), slots: int = 1,
               projects: tuple[str, ...] = ()) -> tuple[str, str]:
        """Enroll a Worker; return (Worker ID, credential). The credential is not retrievable later.
        ``projects``: the names of the only Projects whose Runs it is offered (≤ ``MAX_PROJECTS``;
        none: every Project). ValidationError (name/labels/executor/slots/project),
        NotFoundError(project_not_found) or ConflictError(worker_exists)."""
        name = check_name(name)
        labels = check_labels("label", labels or {})
        executors = check_executors("executor", executor_types)
        slots = check_slots("slots", slots)
        projects = check_projects("project", projects)
        credential = new_credential()
        worker_id = self._store.enroll(name, labels, executors, slots, credential_digest(credential), projects)
        return worker_id, credential

    def open_session(self, worker_id: str, credential: str, hello: Hello = Hello()) -> SessionGrant:
        """Open a new Session (generation + 1): the Leases of ``hello.adopt`` that qualify (module
        docstring) are re-bound to it, every other active Lease of older Sessions is fenced, in
        one transaction. The grant lists each named Lease as adopted or refused (reason codes
        ``core.cluster.ADOPT_REFUSALS``). WorkerAuthError; ValidationError naming the ``hello.*``
        field (nothing written)."""
        digest = credential_digest(credential)
        claims = adopt_claims(hello)
        enrolment = self._store.enrolment(check_uuid("workerId", worker_id), digest)
        labels, executors, slots = narrow(enrolment, hello)
        return self._store.open_session(worker_id, digest, labels, executors, slots, self._t.session_ttl_s * 1_000_000,
                                        claims)

    def heartbeat(self, worker_id: str, credential: str, session_id: str, generation: int,
                  held: tuple[HeldLease, ...] = (), renew_until_us: int | None = None) -> Heartbeat:
        """Extend the Session, and of its Leases exactly those ``held`` names (≤ ``MAX_HELD``)
        that are active, unexpired and whose Attempt is starting/running (issue 11 §6: a Lease
        the Worker let go is not kept alive by its heartbeats). The answer names the Attempts to
        cancel and each renewed Lease's new expiry (µs, database clock). ``renew_until_us``
        (database clock µs, None for no limit): past it the Worker has given up on this
        heartbeat and may have stopped the runs it names, so nothing is renewed: ConflictError
        ``heartbeat_late`` (nothing written). ValidationError naming ``sessionId``/``generation``/
        ``renewUntilUs``/``leases…`` (nothing written); WorkerAuthError; ConflictError
        ``stale_generation`` / ``session_expired``."""
        digest = credential_digest(credential)
        named = held_leases(held)
        if renew_until_us is not None and (not isinstance(renew_until_us, int) or isinstance(renew_until_us, bool)
                                           or not 0 <= renew_until_us <= MAX_GENERATION):
            raise ValidationError("renewUntilUs", "must be an integer 0..2^63-1 (µs)", limit=MAX_GENERATION)
        expires, cancel, leases = self._store.heartbeat(check_uuid("workerId", worker_id), digest,
                                                check_uuid("sessionId", session_id),
                                                check_generation("generation", generation), named,
                                                self._t.session_ttl_s * 1_000_000, self._t.lease_ttl_s * 1_000_000,
                                                renew_until_us)
        return Heartbeat(expires, cancel, [LeaseExpiry(a, e) for a, e in leases])

    def describe(self, worker_id: str, credential: str) -> WorkerInfo:
        """What the control plane knows of this Worker (name, state, generation, enrolment), for
        ``qlagent doctor`` on the Worker: read only, so asking never fences the running Worker's
        Session (a hello would), with this replica's Session TTL. WorkerAuthError unless the
        credential is this live Worker's."""
        info = self._store.describe(check_uuid("workerId", worker_id), credential_digest(credential))
        return msgspec.structs.replace(info, session_ttl_s=self._t.session_ttl_s)

    def credential_owner(self, credential: str) -> str | None:
        """The live Worker ID this credential was issued to, else None (tells a credential used
        on another Worker's route, 403 ``worker_mismatch``, from an unknown one, 401)."""
        try:
            digest = credential_digest(credential)
        except WorkerAuthError:
            return None
        return self._store.worker_for_credential(digest)

    def drain(self, name: str) -> str:
        """No new claims for the Worker; its Leases run on. Returns the Worker ID.
        ValidationError for a name no Worker can have, NotFoundError(worker_not_found)."""
        return self._store.set_state(check_name(name), WorkerState.DRAINING)

    def resume(self, name: str) -> str:
        """Undo ``drain``: the Worker gets offers again (idempotent: an active Worker stays so).
        Returns the Worker ID. ValidationError for a name no Worker can have,
        NotFoundError(worker_not_found)."""
        return self._store.set_state(check_name(name), WorkerState.ACTIVE)

    def remove(self, name: str) -> str:
        """Remove the Worker: Sessions closed, Leases fenced, name freed. Returns the Worker ID.
        ValidationError for a name no Worker can have, NotFoundError(worker_not_found)."""
        return self._store.set_state(check_name(name), WorkerState.REMOVED)

    def list(self, limit: int = 64, after: str | None = None) -> list[dict]:
        """One page of live Workers in name order after ``after``: name, worker_id, state
        (online/draining/offline), generation, session_id, last_heartbeat_us (µs), slots, labels,
        free_slots, projects (the names it is scoped to; empty: every Project). ``limit``
        1..256 (ValidationError otherwise)."""
        if not 1 <= limit <= MAX_LIST:
            raise ValidationError("limit", f"{limit} outside 1..{MAX_LIST}", limit=MAX_LIST)
        return self._store.workers(limit, after)

    def expire_sessions(self, limit: int) -> int:
        """Mark up to ``limit`` (1..64) Sessions past their expiry offline."""
        if not 1 <= limit <= 64:
            raise ValidationError("limit", f"{limit} outside 1..64", limit=64)
        return self._store.expire_sessions(limit)
