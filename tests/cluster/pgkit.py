"""Helpers of the cluster tests: seed Tasks and queued Runs on the real PostgreSQL authority
(the Task Start / definition writer on PostgreSQL lands with the store ports), Workers with open
Sessions, and the cluster services wired over the real adapters."""

from __future__ import annotations

import json
import os
import secrets
import tempfile

from qlagent.adapters.postgres.dispatch import PgDispatchStore, PgPlanSource
from qlagent.adapters.postgres.leases import PgLeaseStore
from qlagent.adapters.postgres.logs import PgLogStore
from qlagent.adapters.postgres.registry import PgWorkerRegistry
from qlagent.adapters.postgres.secrets import PgSecretResolver
from qlagent.adapters.secretbox import SecretBox, create_key_file
from qlagent.cluster.acks import AckService
from qlagent.cluster.dispatcher import DispatcherBudgets
from qlagent.cluster.pull import WorkerPull
from qlagent.cluster.registry import Hello, WorkerRegistry
from qlagent.core.canonical import content_digest, snapshot_ref
from qlagent.core.cluster import Ack, PullRequest
from qlagent.core.definitions import (RetryInput, TaskInput, definition_document, execution_document, prepare_task,
                                     recipe_document)
from qlagent.core.ids import new_id
from qlagent.core.profiles import EDGE

COMMAND_MARK = "/usr/bin/printf-the-secret-command"


class Secrets:
    """The PostgreSQL SecretResolver with a real key file; counts calls (a value is resolved
    only after a claim)."""

    def __init__(self, pool) -> None:
        key = os.path.join(tempfile.mkdtemp(prefix="qlt-cluster-key-"), "secret.key")
        create_key_file(key)
        self.box = SecretBox(key)
        self.inner = PgSecretResolver(pool, self.box)
        self.calls = 0

    def resolve(self, project_id: str, names: list[str]) -> dict[str, bytes]:
        self.calls += 1
        return self.inner.resolve(project_id, names)


class Kit:
    def __init__(self, pool) -> None:
        self.pool = pool
        self.plans = PgPlanSource(pool, EDGE)
        self.store = PgDispatchStore(pool, self.plans)
        self.registry_store = PgWorkerRegistry(pool)
        self.registry = WorkerRegistry(self.registry_store)
        self.leases = PgLeaseStore(pool)
        self.logs = PgLogStore(pool)
        self.acks = AckService(self.leases)
        self.secrets = Secrets(pool)
        self.project_id = None

    # --- SQL helpers -------------------------------------------------------------------------
    def sql(self, query: str, args=()) -> list[tuple]:
        with self.pool.connection() as conn:
            cur = conn.execute(query, args)
            return cur.fetchall() if cur.description else []

    def one(self, query: str, args=()):
        rows = self.sql(query, args)
        return rows[0][0] if rows else None

    def project(self) -> str:
        if self.project_id is None:
            self.project_id = new_id()
            self.sql("INSERT INTO projects(project_id, name, created_at_us) VALUES (%s, %s, ql_now_us())",
                     (self.project_id, f"p-{self.project_id[:8]}"))
            self.sql("INSERT INTO secrets VALUES (%s, 'api-key', %s, %s, ql_now_us())",
                     (self.project_id, self.secrets.box.seal(self.project_id, "api-key", b"s3cr3t"),
                      self.secrets.box.key_id))
        return self.project_id

    def task(self, name: str = "job", *, placement: dict | None = None, max_attempts: int = 1,
             command: list[str] | None = None, secrets_: dict[str, str] | None = None,
             on_lease_loss: str | None = None) -> dict:
        t = TaskInput(name=name, command=command or [COMMAND_MARK, "hello"], env={"GREETING": "hi"},
                      secrets=secrets_ or {}, retry=RetryInput(max_attempts=max_attempts, backoff_s=0),
                      on_lease_loss=on_lease_loss)
        prepared = prepare_task(t)
        doc = definition_document(prepared.definition)
        if placement is not None:
            doc["placement"] = placement
        digest = content_digest(doc)
        task_id, pid = new_id(), self.project()
        exec_doc = execution_document(prepared.definition.execution, prepared.recipe_ref)
        self.sql("INSERT INTO tasks(task_id, project_id, name, head_revision, created_at_us, updated_at_us)"
                 " VALUES (%s, %s, %s, 1, ql_now_us(), ql_now_us())", (task_id, pid, name))
        self.sql("INSERT INTO task_revisions VALUES (%s, 1, %s, %s, ql_now_us())", (task_id, digest, json.dumps(doc)))
        self.sql("INSERT INTO context_recipes VALUES (%s, %s, ql_now_us()) ON CONFLICT DO NOTHING",
                 (prepared.recipe_ref, json.dumps(recipe_document(prepared.recipe))))
        self.sql("INSERT INTO execution_revisions VALUES (%s, 1, %s, %s, %s, %s, ql_now_us())",
                 (task_id, exec_doc["kind"], content_digest(exec_doc), json.dumps(exec_doc), prepared.recipe_ref))
        return {"task_id": task_id, "project_id": pid, "digest": digest}

    def queue(self, task: dict, priority: int = 0) -> tuple[str, str]:
        """A queued Run with a claimed remote_worker Attempt and run.created + run.queued."""
        run_id, attempt_id = new_id(), new_id()
        with self.pool.connection() as conn:
            now = conn.execute("SELECT ql_now_us()").fetchone()[0]
            conn.execute(
                "INSERT INTO runs(run_id, project_id, task_id, task_revision, task_snapshot_ref, state, priority,"
                " execution_origin, execution_owner, trigger_type, idempotency_key, requested_by, version,"
                " event_sequence, latest_attempt_id, latest_attempt_created_at_us, created_at_us, updated_at_us)"
                " VALUES (%s, %s, %s, 1, %s, 'queued', %s, 'manual', 'runtime', 'task_start', %s, 'test', 2, 2,"
                " %s, %s, %s, %s)",
                (run_id, task["project_id"], task["task_id"], snapshot_ref(1, task["digest"]), priority,
                 f"ql3:task-start:v1:{new_id()}", attempt_id, now, now, now))
            conn.execute("INSERT INTO attempts(attempt_id, run_id, attempt_no, state, executor_type, created_at_us)"
                         " VALUES (%s, %s, 1, 'claimed', 'remote_worker', %s)", (attempt_id, run_id, now))
            for seq, type_ in ((1, "run.created"), (2, "run.queued")):
                conn.execute("INSERT INTO run_events VALUES (%s, %s, %s, %s, 'test', '{}', %s)",
                             (run_id, seq, new_id(), type_, now))
        return run_id, attempt_id

    def worker(self, name: str, labels: dict | None = None, slots: int = 1) -> dict:
        """An enrolled Worker with an open Session."""
        worker_id, credential = self.registry.enroll(name, labels or {}, ("local_process",), slots)
        grant = self.registry.open_session(worker_id, credential, Hello())
        return {"worker_id": worker_id, "credential": credential, "session_id": grant.session_id,
                "generation": grant.generation}

    def claim(self, w: dict, n: int = 1) -> list:
        """``n`` Pulls of the Worker ``w`` (the live claim path), each answered with an offer;
        return those offers."""
        out = []
        for _ in range(n):
            answer = self.pull().pull(w["worker_id"], w["credential"], PullRequest(
                session_id=w["session_id"], generation=w["generation"], pull_id=new_id(), lease_token=token()))
            assert answer.status == "offered", answer
            out.append(answer.offer)
        return out

    def pull(self, budgets: DispatcherBudgets = DispatcherBudgets(), signal=None) -> WorkerPull:
        return WorkerPull(self.store, self.secrets, budgets, signal)

    def ack(self, w: dict, offer, kind: str, **facts):
        return self.acks.ack(w["worker_id"], w["credential"], Ack(
            session_id=offer.session_id, generation=offer.generation, attempt_id=offer.attempt_id,
            lease_generation=offer.lease_generation, lease_token=offer.lease_token, kind=kind, **facts))

    def expire_lease(self, attempt_id: str) -> None:
        self.sql("UPDATE run_leases SET expires_at_us = ql_now_us() - 1 WHERE attempt_id = %s AND state = 'active'",
                 (attempt_id,))

    def events(self, run_id: str) -> list[str]:
        return [r[0] for r in self.sql("SELECT type FROM run_events WHERE run_id = %s ORDER BY sequence", (run_id,))]


def token() -> str:
    return secrets.token_urlsafe(32)
