"""Log upload into the authority (issue 10 §9): the Worker sends its Artifact in
offset-addressed chunks (1..262144 bytes) under its Lease fence. A chunk at the received end is
appended; the same chunk again is an idempotent no-op (resumable after a lost answer); other
bytes at a received offset or a gap are refused. Bytes past the Profile's log quota advance the
offset but are not kept, and a write-once truncation fact records the quota.
"""

from __future__ import annotations

from ..core.cluster import MAX_CHUNK_BYTES, ChunkAnswer
from ..core.errors import ValidationError
from ..core.ports import LogChunkStore
from ..core.profiles import Profile
from .acks import lease_fence

MAX_OFFSET = 2**62


class LogUpload:
    """Over the log chunk store (``core.ports.LogChunkStore``); the quota is
    ``profile.log_max_bytes``."""

    def __init__(self, store: LogChunkStore, profile: Profile) -> None:
        self._store, self._quota = store, profile.log_max_bytes

    def append(self, worker_id: str, credential: str, *, session_id: str, generation: int, attempt_id: str,
               lease_generation: int, lease_token: str, offset: int, data: bytes) -> ChunkAnswer:
        """Store one chunk. ValidationError (offset, data), WorkerAuthError, ConflictError
        (chunk_gap, chunk_mismatch, lease_not_active, stale_generation, lease_token_mismatch)."""
        fence = lease_fence(worker_id, credential, session_id, generation, attempt_id, lease_generation, lease_token)
        if not isinstance(offset, int) or isinstance(offset, bool) or not 0 <= offset <= MAX_OFFSET:
            raise ValidationError("offset", f"must be 0..{MAX_OFFSET}", limit=MAX_OFFSET)
        if not isinstance(data, bytes) or not 1 <= len(data) <= MAX_CHUNK_BYTES:
            raise ValidationError("data", f"a chunk is 1..{MAX_CHUNK_BYTES} bytes", limit=MAX_CHUNK_BYTES)
        next_offset, truncated = self._store.append(fence, offset, data, self._quota)
        return ChunkAnswer(next_offset, truncated)
