"""A run's log on the Worker (issue 11 §4–5): offset-addressed chunks up to the control plane,
the local log store bounded."""

from __future__ import annotations

from ..core.cluster import MAX_CHUNK_BYTES
from ..core.control import ChunkConflict
from ..core.inbox_states import InboxState
from .job import Job, Owed


class LogDuty:
    """One duty of ``worker.runtime.WorkerRuntime`` (a mixin over the runtime's state: ``jobs``,
    ``inbox``, ``runs``, ``client``, ``session``): log upload."""

    def log_store_used(self) -> int:
        """Bytes of the logs not yet uploaded, a live run counted at its quota."""
        return sum(j.spec.log_quota_bytes if j.live else self.runs.log_size(j.attempt_id)
                   for j in self.jobs.values() if not j.log_done)

    def _bound_log_store(self, need: int) -> None:
        """Issue 11 §5: a partition must not fill the flash. Before a spawn, the Artifacts not yet
        uploaded (a live run counted at its quota) plus ``need`` bytes must fit ``log_store_bytes``;
        otherwise the oldest completed runs' bytes the control plane does not hold yet are cut,
        each cut recorded (``worker.log_truncated``: attempt, bytes dropped, bytes the control
        plane keeps)."""
        over = self.log_store_used() + need - self.log_store_bytes
        for j in list(self.jobs.values()):
            if over <= 0:
                return
            if j.entry.state == InboxState.COMPLETED and not j.log_done:
                freed = self.runs.truncate_log(j.attempt_id, max(j.uploaded, self.runs.log_size(j.attempt_id) - over))
                if freed:
                    over -= freed
                    self.log("warning", "worker.log_truncated", attempt=j.attempt_id, bytes_dropped=freed,
                             bytes_kept=self.runs.log_size(j.attempt_id))

    def _upload(self, j: Job, final: bool) -> None:
        """Log chunks from ``j.uploaded``; while running only whole chunks (bounded), at the end
        everything. ``log_done`` once the control plane holds every byte of the Artifact."""
        o = j.entry.offer
        size = self.runs.log_size(j.attempt_id)
        while size - j.uploaded >= (1 if final else MAX_CHUNK_BYTES):
            data = self.runs.read_log(j.attempt_id, j.uploaded, MAX_CHUNK_BYTES)
            if not data:
                break
            try:
                ans, _, _ = self._rpc(lambda t: self.client.upload_chunk(
                    session_id=j.session[0], generation=j.session[1], attempt_id=j.attempt_id,
                    lease_generation=o.lease_generation, lease_token=o.lease_token, offset=j.uploaded, data=data,
                    timeout_s=t))
                j.uploaded = ans.next_offset
            except ChunkConflict as e:
                if e.next_offset is None:
                    raise
                j.uploaded = e.next_offset      # resume where the control plane says it is
            if not final:
                break                           # one chunk per pass while the run goes on
        if final and j.uploaded >= size:
            j.owed.discard(Owed.LOG)

