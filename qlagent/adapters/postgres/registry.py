"""The Worker registry on PostgreSQL: enrolment (credential SHA-256 only), Sessions with a
per-Worker generation and Lease adoption at hello, heartbeats, drain, removal and Session expiry
(ADR-0014 §2, issue 10 §3, issue 11 restart)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ...core.cluster import Enrolment, SessionGrant, WorkerInfo
from ...core.errors import ConflictError, NotFoundError
from ...core.ids import new_id
from ...core.states import SessionState, WorkerState
from .connection import read, transaction
from .queries import (LEASES_CANCEL_REQUESTED, LEASES_RENEW, PROJECTS_BY_NAMES, SESSIONS_EXPIRE, SESSIONS_PRUNE,
                      SESSION_HEARTBEAT, SESSION_INSERT, SESSION_OF_WORKER_FOR_NO_KEY_UPDATE, WORKERS_PAGE,
                      WORKER_BY_CREDENTIAL_DIGEST, WORKER_BY_NAME_FOR_NO_KEY_UPDATE, WORKER_INSERT,
                      WORKER_SESSION_CLEAR, WORKER_SESSION_SET, WORKER_STATE_SET)
from .transitions import adopt_leases, authenticate, fence_sessions, now_us, stale_session

if TYPE_CHECKING:   # annotations only: psycopg loads where a connection is opened
    from psycopg_pool import ConnectionPool

# Ended Sessions a hello keeps per Worker (the newest; any a Lease names is kept too), and how
# many older ones one hello deletes: a Worker saying hello in a loop leaves a bounded table.
SESSION_HISTORY = 8
PRUNE_PER_HELLO = 4


class PgWorkerRegistry:
    """Worker and Session rows over a psycopg pool (policy: ``cluster.registry``)."""

    def __init__(self, pool: ConnectionPool) -> None:
        self._pool = pool

    def enroll(self, name: str, labels: dict[str, str], executor_types: tuple[str, ...], slots: int,
               credential_digest: str, projects: tuple[str, ...] = ()) -> str:
        """Insert a Worker scoped to the Projects named ``projects`` (stored by Project ID; none:
        every Project); return its Worker ID. NotFoundError(project_not_found) naming the first
        unknown Project; ConflictError(worker_exists) for a live name."""
        from psycopg import errors
        from psycopg.types.json import Jsonb
        worker_id = new_id()

        def tx(cur):
            now = now_us(cur)
            found = {r["name"]: r["project_id"] for r in cur.execute(
                PROJECTS_BY_NAMES, (list(projects),)).fetchall()}
            for p in projects:
                if p not in found:
                    raise NotFoundError(f"no Project named {p!r} (a Project exists once a Task is defined in it)",
                                        code="project_not_found")
            cur.execute(WORKER_INSERT,
                        (worker_id, name, credential_digest, Jsonb(labels), list(executor_types), slots, now, now,
                         [found[p] for p in projects]))
            return worker_id
        try:
            return transaction(self._pool, tx)
        except errors.UniqueViolation:
            raise ConflictError(f"a Worker named {name!r} is already enrolled", code="worker_exists") from None

    def enrolment(self, worker_id: str, credential_digest: str) -> Enrolment:
        """The enrolment this credential proves; WorkerAuthError otherwise."""
        row = transaction(self._pool, lambda cur: authenticate(cur, worker_id, credential_digest))
        return Enrolment(row["worker_id"], row["name"], row["labels"], tuple(row["executor_types"]), row["slots"],
                         row["state"])

    def describe(self, worker_id: str, credential_digest: str) -> WorkerInfo:
        """The Worker this credential proves, read only (no lock, no write: it neither opens a
        Session nor touches a Lease); WorkerAuthError otherwise."""
        row = read(self._pool, lambda cur: authenticate(cur, worker_id, credential_digest))
        return WorkerInfo(row["worker_id"], row["name"], row["state"], row["generation"], row["labels"],
                          tuple(row["executor_types"]), row["slots"])

    def worker_for_credential(self, credential_digest: str) -> str | None:
        """The live Worker ID holding this credential digest, else None."""
        row = transaction(self._pool, lambda cur: cur.execute(
            WORKER_BY_CREDENTIAL_DIGEST, (credential_digest,)).fetchone())
        return None if row is None else row["worker_id"]

    def open_session(self, worker_id: str, credential_digest: str, labels: dict[str, str],
                     executor_types: tuple[str, ...], slots: int, ttl_us: int,
                     adopt: list[tuple[str, int, str]] = ()) -> SessionGrant:
        """New Session with generation + 1; the Leases of ``adopt`` ((Attempt ID, lease
        generation, token digest), Attempt ID order) that qualify move to it (``adopt_leases``),
        then every older Session closes and its remaining active Leases are fenced. Up to
        ``PRUNE_PER_HELLO`` ended Sessions of the Worker older than its newest
        ``SESSION_HISTORY`` that no Lease names are deleted."""
        from psycopg.types.json import Jsonb
        session_id = new_id()

        def tx(cur):
            w = authenticate(cur, worker_id, credential_digest, lock=True)
            now = now_us(cur)
            gen = w["generation"] + 1
            cur.execute(SESSION_INSERT,
                        (session_id, worker_id, gen, Jsonb(labels), list(executor_types), slots, now, now,
                         now + ttl_us))
            cur.execute(WORKER_SESSION_SET, (gen, session_id, now, worker_id))
            adopted, refused = adopt_leases(cur, worker_id, session_id, gen, adopt, now)
            fence_sessions(cur, worker_id, session_id, "session_replaced", now)
            cur.execute(SESSIONS_PRUNE, (worker_id, gen - SESSION_HISTORY, PRUNE_PER_HELLO))
            return SessionGrant(worker_id, session_id, gen, labels, executor_types, slots, now + ttl_us,
                                tuple(adopted), tuple(refused))
        return transaction(self._pool, tx)

    def heartbeat(self, worker_id: str, credential_digest: str, session_id: str, generation: int,
                  held: list[tuple[str, int]], session_ttl_us: int, lease_ttl_us: int,
                  renew_until_us: int | None = None) -> tuple[int, list[str], list[tuple[str, int]]]:
        """Extend the Session, and the Leases of this Session that ``held`` names ((Attempt ID,
        lease generation)), are active and unexpired and whose Attempt is starting/running; a
        Lease of the Session not named keeps its expiry (the sweeper ends it). Return (Session
        expiry µs, Attempt IDs whose Run asked to be cancelled, (Attempt ID, new Lease expiry
        µs) of each renewed Lease). ConflictError stale_generation / session_expired, and
        heartbeat_late past ``renew_until_us`` (database clock µs; the Worker gave up on it)."""
        def tx(cur):
            w = authenticate(cur, worker_id, credential_digest)
            s = cur.execute(SESSION_OF_WORKER_FOR_NO_KEY_UPDATE, (session_id, worker_id)).fetchone()
            if s is None or s["generation"] != generation or w["generation"] != generation:
                raise stale_session(session_id, generation, w)
            now = now_us(cur)
            if s["state"] != SessionState.OPEN or s["expires_at_us"] <= now:
                raise ConflictError("the Session expired; open a new one", code="session_expired")
            if renew_until_us is not None and now > renew_until_us:
                raise ConflictError(f"heartbeat arrived {now - renew_until_us} µs after the Worker stopped waiting "
                                    "for it; nothing renewed", code="heartbeat_late")
            cur.execute(SESSION_HEARTBEAT, (now, now + session_ttl_us, session_id))
            # Only the Leases the Worker names: one it let go must run out (issue 11 §6).
            renewed = cur.execute(LEASES_RENEW,
                                  (now + lease_ttl_us, [a for a, _ in held], [g for _, g in held], session_id,
                                   now)).fetchall()
            cancel = cur.execute(LEASES_CANCEL_REQUESTED, (session_id,)).fetchall()
            return (now + session_ttl_us, [r["attempt_id"] for r in cancel],
                    sorted((r["attempt_id"], r["expires_at_us"]) for r in renewed))
        return transaction(self._pool, tx)

    def set_state(self, name: str, state: str) -> str:
        """``draining`` (no new claims; Leases run on), ``active`` (claims again: undoes a drain)
        or ``removed`` (Sessions closed, Leases fenced, name freed). Returns the Worker ID; NotFoundError for no live Worker of that name."""
        def tx(cur):
            w = cur.execute(WORKER_BY_NAME_FOR_NO_KEY_UPDATE, (name,)).fetchone()
            if w is None:
                raise NotFoundError(f"no Worker named {name!r}", code="worker_not_found")
            now = now_us(cur)
            cur.execute(WORKER_STATE_SET, (state, now, w["worker_id"]))
            if state == WorkerState.REMOVED:
                cur.execute(WORKER_SESSION_CLEAR, (w["worker_id"],))
                fence_sessions(cur, w["worker_id"], None, "worker_removed", now)
            return w["worker_id"]
        return transaction(self._pool, tx)

    def expire_sessions(self, limit: int) -> int:
        """Mark up to ``limit`` open Sessions past their expiry ``expired`` (offline); their Leases
        run out on their own expiry (the lease sweeper)."""
        return transaction(self._pool, lambda cur: cur.execute(
            SESSIONS_EXPIRE, (limit,)).rowcount)

    def workers(self, limit: int, after: str | None = None) -> list[dict]:
        """Up to ``limit`` live Workers in name order: name, Worker ID, state online/draining/offline,
        generation, Session ID, last heartbeat (µs), slots, labels (as enrolled), free slots, the
        names of the Projects it is scoped to (empty: every Project)."""
        return transaction(self._pool, lambda cur: cur.execute(
            WORKERS_PAGE, (after or "", limit)).fetchall())
