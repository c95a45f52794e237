"""The one JSON shape of every record the HTTP API and the CLI's ``--json`` print (the
conventions are README "JSON output"; the shapes docs/ARCHITECTURE.md "JSON shapes"; the HTTP
schemas ``http/openapi.json``).

Names are camelCase; instants are RFC 3339 UTC strings with µs (``createdAt``); durations a
user wrote read back in the unit the task file names (``timeoutS`` for ``timeout_s``); sizes
bytes, measured CPU time µs (``cpuTimeUs``); absent values are ``null``, never omitted. A list
is ``{"items": [...]}`` (``page``). The store's µs integers never reach these shapes.
"""

from __future__ import annotations

import msgspec

from ..core.canonical import snapshot_ref
from ..core.models import Attempt, CreatedRun, Run, RunEvent, TaskDefinition, TaskHead, TokenInfo
from ..core.taskstart import rfc3339_from_us

NEXT_FIRES = 5              # merged upcoming fire instants on a Task head


# RunEvent payload keys the store writes in µs since the epoch → their public instant names.
PAYLOAD_INSTANTS = {"deadlineUs": "deadlineAt", "scheduledForUs": "scheduledFor", "notBeforeUs": "notBefore"}
# TaskDefinition durations (ms in the canonical document) → the task file's unit, seconds.
DEFINITION_SECONDS = {"timeoutMs": "timeoutS", "graceMs": "graceS", "catchUpWithinMs": "catchUpWithinS"}


def instant(us: int | None) -> str | None:
    """RFC 3339 UTC of ``us`` (µs since the epoch), or None."""
    return None if us is None else rfc3339_from_us(us)


def page(items: list[dict], next_cursor: str | None = None, *, pages: bool = False) -> dict:
    """A list: ``{"items": [...]}``, plus ``nextCursor`` (None on the last page) when it ``pages``."""
    return {"items": items, "nextCursor": next_cursor} if pages else {"items": items}


def _seconds(ms: int | None) -> int | float | None:
    """ms → seconds as the task file wrote them: ``3600``, not ``3600.0``; ``2.5`` stays."""
    if ms is None:
        return None
    return ms // 1000 if ms % 1000 == 0 else ms / 1000


def attempt(a: Attempt) -> dict:
    return {"attemptId": a.attempt_id, "attemptNo": a.attempt_no, "state": a.state,
            "executorType": a.executor_type, "exitCode": a.exit_code, "signal": a.exit_signal,
            "bytesKept": a.bytes_kept, "bytesDropped": a.bytes_dropped, "truncated": a.truncated,
            "truncationReason": a.truncation_reason,
            "peakRssBytes": a.peak_rss_bytes, "cpuTimeUs": a.cpu_time_us,
            "failureReason": a.failure_reason, "startError": a.start_error, "orphansStopped": a.orphans_stopped,
            "workerId": a.worker_id, "workerName": a.worker_name,
            "startedAt": instant(a.started_at_us),
            "endedAt": instant(a.ended_at_us)}


def run(r: Run, latest: Attempt | None = None, *, with_attempt: bool = False) -> dict:
    """A Run; given its ``latest`` Attempt, also ``workerId``/``workerName``: the Worker that
    ran it (cluster; null on a local agent or before a Worker leased it); ``with_attempt`` adds
    ``latestAttempt`` (an Attempt or null)."""
    d = {"runId": r.run_id, "projectId": r.project_id, "taskId": r.task_id, "taskName": r.task_name,
         "state": r.state, "taskRevision": r.task_revision, "taskSnapshotRef": r.task_snapshot_ref,
         "executionOrigin": r.execution_origin, "executionOwner": r.execution_owner,
         "triggerType": r.trigger_type, "requestedBy": r.requested_by, "priority": r.priority,
         "version": r.version, "eventSequence": r.event_sequence, "cancelRequested": r.cancel_requested,
         "latestAttemptId": r.latest_attempt_id,
         "exitCode": r.exit_code, "signal": r.exit_signal, "scheduledFor": instant(r.scheduled_for_us),
         "createdAt": instant(r.created_at_us), "updatedAt": instant(r.updated_at_us),
         "endedAt": instant(r.ended_at_us)}
    if latest is not None:
        d["workerId"], d["workerName"] = latest.worker_id, latest.worker_name
    if with_attempt:
        d["latestAttempt"] = None if latest is None else attempt(latest)
    return d


def event(e: RunEvent) -> dict:
    """A RunEvent; payload instants stored as µs (``PAYLOAD_INSTANTS``) are RFC 3339 here."""
    payload = {PAYLOAD_INSTANTS.get(k, k): instant(v) if k in PAYLOAD_INSTANTS else v for k, v in e.payload.items()}
    return {"eventId": e.event_id, "runId": e.run_id, "sequence": e.sequence, "type": e.type,
            "actor": e.actor, "createdAt": instant(e.created_at_us), "payload": payload}


def definition(d: TaskDefinition) -> dict:
    """The full revision as the task file names it: camelCase, durations in seconds
    (``timeoutS``, ``graceS``, ``retry.backoffS``, ``catchUpWithinS``: int when whole), every
    field present (the canonical document leaves out those at their defaults; a reader should
    not need to know them)."""
    raw = msgspec.to_builtins(d)
    for f in msgspec.structs.fields(d):
        raw.setdefault(f.encode_name, msgspec.to_builtins(getattr(d, f.name)))
    out = {DEFINITION_SECONDS.get(k, k): _seconds(v) if k in DEFINITION_SECONDS else v for k, v in raw.items()}
    retry = out["retry"]
    out["retry"] = {"maxAttempts": retry["maxAttempts"], "backoffS": _seconds(retry["backoffMs"])}
    return out


def created_run(c: CreatedRun) -> dict:
    """``run start`` without ``--wait``: the Run as created, the HTTP Task Start result's fields
    with ``existing`` (an exact replay) where that has ``outcome``."""
    return {"runId": c.run_id, "attemptId": c.attempt_id, "eventIds": list(c.event_ids),
            "taskRevision": c.task_revision, "taskSnapshotRef": c.task_snapshot_ref, "state": c.state,
            "createdAt": instant(c.created_at_us), "existing": c.existing}


def token(t: TokenInfo) -> dict:
    """An API token as listed: its ID and subject, never the token; ``revokedAt`` null while live."""
    return {"tokenId": t.token_id, "subject": t.subject, "createdAt": instant(t.created_at_us),
            "revokedAt": instant(t.revoked_at_us)}


def secret(name: str, updated_at_us: int) -> dict:
    """A Secret as listed: its name and when it was last set, never its value."""
    return {"name": name, "updatedAt": instant(updated_at_us)}


def worker(w: dict) -> dict:
    """A cluster Worker as ``WorkerRegistry.list`` gives it; ``lastHeartbeatAt`` null before its first
    Session, ``freeSlots`` never below 0, ``projects`` the Project IDs it is scoped to (empty:
    every Project), ``labels`` its enrolled Placement labels."""
    return {"name": w["name"], "workerId": w["worker_id"], "state": w["state"], "generation": w["generation"],
            "sessionId": w["session_id"], "lastHeartbeatAt": instant(w["last_heartbeat_us"]),
            "slots": w["slots"], "labels": w["labels"], "freeSlots": max(0, w["free_slots"]), "projects": w["projects"]}


def task_head(h: TaskHead, now_us: int) -> dict:
    """The head with each schedule's next fire and the merged ``nextFires`` after ``now_us``
    (none while disabled)."""
    # Here, not at the top: a Run's shape (``run ls --json``) needs no cron grammar nor zones.
    from ..core.schedule import next_fire, parse_schedule
    from .schedules import system_timezone, upcoming
    d = h.definition
    tz = d.timezone or system_timezone()
    schedules = []
    for line in d.schedules:
        nxt = next_fire(parse_schedule(line), now_us, tz) if h.enabled else None
        schedules.append({"cron": line, "timezone": tz, "nextFireAt": instant(nxt)})
    fires = upcoming(d, NEXT_FIRES, now_us) if h.enabled else []
    return {"projectId": h.project_id, "taskId": h.task_id, "name": h.name, "revision": h.revision,
            "contentDigest": h.content_digest, "taskSnapshotRef": snapshot_ref(h.revision, h.content_digest),
            "enabled": h.enabled, "schedules": schedules, "nextFires": [instant(t) for t in fires],
            "updatedAt": instant(h.updated_at_us)}
