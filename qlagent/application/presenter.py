"""The one JSON shape of a Task head, a Run, an Attempt and a RunEvent, shared by the HTTP API
and the CLI's ``--json`` (documented once in docs/ARCHITECTURE.md "JSON shapes"; the HTTP
schemas are in ``http/openapi.json``).

Names are camelCase; instants are RFC 3339 UTC strings with µs (``createdAt``), sizes bytes,
CPU time µs; absent values are ``null``, never omitted.
"""

from __future__ import annotations

from ..core.canonical import snapshot_ref
from ..core.models import Attempt, Run, RunEvent, TaskHead
from ..core.schedule import next_fire, parse_schedule
from ..core.taskstart import rfc3339_from_us
from .schedules import system_timezone, upcoming

NEXT_FIRES = 5              # merged upcoming fire instants on a Task head


def instant(us: int | None) -> str | None:
    """RFC 3339 UTC of ``us`` (µs since the epoch), or None."""
    return None if us is None else rfc3339_from_us(us)


def attempt(a: Attempt) -> dict:
    return {"attemptId": a.attempt_id, "attemptNo": a.attempt_no, "state": a.state,
            "executorType": a.executor_type, "exitCode": a.exit_code, "signal": a.exit_signal,
            "bytesKept": a.bytes_kept, "bytesDropped": a.bytes_dropped, "truncated": a.truncated,
            "peakRssBytes": a.peak_rss_bytes, "cpuTimeUs": a.cpu_time_us,
            "failureReason": a.failure_reason, "startError": a.start_error, "orphansStopped": a.orphans_stopped,
            "startedAt": instant(a.started_at_us),
            "endedAt": instant(a.ended_at_us)}


def run(r: Run, latest: Attempt | None = None, *, with_attempt: bool = False) -> dict:
    """A Run; ``with_attempt`` adds ``latestAttempt`` (an Attempt or null)."""
    d = {"runId": r.run_id, "projectId": r.project_id, "taskId": r.task_id, "taskName": r.task_name,
         "state": r.state, "taskRevision": r.task_revision, "taskSnapshotRef": r.task_snapshot_ref,
         "executionOrigin": r.execution_origin, "executionOwner": r.execution_owner,
         "triggerType": r.trigger_type, "requestedBy": r.requested_by, "priority": r.priority,
         "version": r.version, "eventSequence": r.event_sequence, "cancelRequested": r.cancel_requested,
         "latestAttemptId": r.latest_attempt_id,
         "exitCode": r.exit_code, "signal": r.exit_signal, "scheduledFor": instant(r.scheduled_for_us),
         "createdAt": instant(r.created_at_us), "updatedAt": instant(r.updated_at_us),
         "endedAt": instant(r.ended_at_us)}
    if with_attempt:
        d["latestAttempt"] = None if latest is None else attempt(latest)
    return d


def event(e: RunEvent) -> dict:
    return {"eventId": e.event_id, "runId": e.run_id, "sequence": e.sequence, "type": e.type,
            "actor": e.actor, "createdAt": instant(e.created_at_us), "payload": e.payload}


def task_head(h: TaskHead, now_us: int) -> dict:
    """The head with each schedule's next fire and the merged ``nextFires`` after ``now_us``
    (none while disabled)."""
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
