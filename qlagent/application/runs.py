"""Run use cases shared by the CLI and HTTP: Task Start (ADR-0376), cancel, reads, log reads."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from ..core.errors import NotFoundError, ValidationError
from ..core.ids import new_id
from ..core.models import LOCAL_SUBJECT, Attempt, CreatedRun, Run, RunEvent
from ..core.receipt import TruncationFact

if TYPE_CHECKING:   # ports are annotations only: no Protocol class at run time
    from ..core.ports import Store

MAX_LOG_READ = 1_048_576     # bytes per log read (CLI pages through; HTTP answers one page)
MAX_LOG_OFFSET = 2**62       # bytes: a larger offset or limit is bad input, never an OverflowError


class RunService:
    """Run use cases over the store's RunStore/DefinitionStore/PolicyStore ports."""

    def __init__(self, store: Store) -> None:
        self._store = store

    def start(self, task: str, *, subject: str = LOCAL_SUBJECT, mutation_id: str | None = None,
              expected_revision: int | None = None, expected_digest: str | None = None,
              project: str | None = None, admitted_project_version: int | None = None,
              admitted_binding_version: int | None = None) -> CreatedRun:
        """Task Start in one transaction. Without explicit fences (the CLI) they are read from the
        current head first, exactly as an API client would, and a new mutationId is generated."""
        project = project or self._store.project.project_id
        if expected_revision is None or expected_digest is None:
            proj = self._store.get_project(project)
            head = self._store.get_head(proj.project_id, task)
            expected_revision, expected_digest = head.revision, head.content_digest
        return self._store.task_start(
            project=project, task=task, subject=subject, mutation_id=mutation_id or new_id(),
            expected_revision=expected_revision, expected_digest=expected_digest,
            admitted_project_version=admitted_project_version, admitted_binding_version=admitted_binding_version)

    def get(self, run_id: str, project_id: str | None = None) -> Run:
        return self._store.get_run(run_id, project_id)

    def list(self, *, task: str | None = None, state: str | None = None, limit: int = 50,
             cursor: str | None = None, project_id: str | None = None) -> tuple[list[Run], str | None]:
        pid = project_id or self._store.project.project_id
        task_id = self._store.get_head(pid, task).task_id if task else None
        return self._store.list_runs(pid, task_id=task_id, state=state, limit=limit, cursor=cursor)

    def events(self, run_id: str) -> list[RunEvent]:
        return self._store.list_events(run_id)

    def attempts(self, run_id: str) -> list[Attempt]:
        return self._store.list_attempts(run_id)

    def log_source(self, run_id: str) -> tuple[str | None, TruncationFact | None]:
        """(artifact path or None, truncation fact or None) of the Run's latest Attempt."""
        return self._store.latest_artifact(run_id)


def log_page_json(run_id: str, path: str | None, fact: TruncationFact | None, offset: int, limit: int) -> dict:
    """One page of a Run's log as a JSON object (``run logs --json``; README "Logs").

    ``{"runId", "offset", "length", "size", "nextOffset", "eof", "encoding", "data",
    "truncated", "truncation"}``: ``length`` bytes read at ``offset`` of a ``size``-byte log;
    ``encoding`` is ``"utf-8"`` when those bytes are valid UTF-8 (``data`` is then the text)
    and ``"base64"`` otherwise (``data`` is RFC 4648 base64 of the exact bytes); ``truncation``
    is the truncation fact (``quotaBytes``, ``bytesKept``, ``bytesDropped``, ``reason``: ``quota``
    or ``write_error: ENOSPC (No space left on device)``) or null.
    """
    chunk, size = read_log_range(path, offset, limit)
    return log_page(run_id, chunk, size, offset, fact)


def log_page(run_id: str, chunk: bytes, size: int, offset: int, fact: TruncationFact | None) -> dict:
    """The page object of :func:`log_page_json` for ``chunk`` read at ``offset`` of a
    ``size``-byte log (wherever it is kept: a local file, the cluster's chunks)."""
    try:
        encoding, data = "utf-8", chunk.decode("utf-8")
    except UnicodeDecodeError:
        import base64
        encoding, data = "base64", base64.b64encode(chunk).decode("ascii")
    return {"runId": run_id, "offset": offset, "length": len(chunk), "size": size,
            "nextOffset": offset + len(chunk), "eof": offset + len(chunk) >= size, "encoding": encoding,
            "data": data, "truncated": fact is not None, "truncation": fact}


def read_log_range(path: str | None, offset: int, limit: int) -> tuple[bytes, int]:
    """Read at most ``limit`` (≤ MAX_LOG_READ) bytes at ``offset`` of a log Artifact without
    loading the rest. Returns (bytes, file size). The file is opened O_NOFOLLOW."""
    if not 0 <= offset <= MAX_LOG_OFFSET:
        raise ValidationError("offset", f"outside 0..{MAX_LOG_OFFSET}", limit=MAX_LOG_OFFSET)
    if not (1 <= limit <= MAX_LOG_READ):
        raise ValidationError("limit", f"{limit} outside 1..{MAX_LOG_READ}", limit=MAX_LOG_READ)
    if path is None:
        return b"", 0
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        raise NotFoundError("the log of this run was pruned by retention", code="log_not_found") from None
    try:
        size = os.fstat(fd).st_size
        return os.pread(fd, min(limit, max(0, size - offset)), offset), size
    finally:
        os.close(fd)
