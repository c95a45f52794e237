"""One open inbox row as the Worker's loop sees it (``Job``).
"""

from __future__ import annotations

from ..core.cluster import ExecutionSpec
from ..core.leasefit import KILL_REAP_US          # after SIGKILL: reaping the tree (fencing's kill grace adds it)
from ..core.inbox_states import InboxEntry
from ..worker import fencing


class Job:
    """The loop's view of one open inbox row (the inbox stays the authority)."""

    __slots__ = ("entry", "spec", "secrets", "session", "handle", "renewal", "ttl_us", "deadline_us", "kill_reason",
                 "kill_at_us", "fenced", "keep_reported", "cancel", "running_owed", "completion_owed", "uploaded",
                 "log_done", "gone", "refetched", "stop_at_us")

    def __init__(self, entry: InboxEntry, spec: ExecutionSpec, secrets: dict[str, bytes] | None = None) -> None:
        self.entry, self.spec, self.secrets = entry, spec, secrets
        # (Session ID, generation) the Lease is fenced by: the offer's, or the Session that adopted it.
        self.session = (entry.offer.session_id, entry.offer.generation)
        self.handle = None                        # WorkerRunsPort handle of the live shim
        self.renewal: fencing.Renewal | None = None
        # A re-attached run's stop instant read back from its shim's lease file (the Worker's
        # monotonic µs, kept across a restart), until a renewal of this process replaces it.
        self.stop_at_us: int | None = None
        self.ttl_us = 0
        self.deadline_us: int | None = None       # the spec's timeout, Worker monotonic µs
        self.kill_reason: str | None = None       # timeout | cancel | shutdown | None
        self.kill_at_us: int | None = None        # SIGKILL due (after the grace)
        self.fenced = False                       # stopped (or dropped) because the Lease was lost
        self.keep_reported = False
        self.cancel = False
        self.running_owed = False
        self.completion_owed = False
        self.uploaded = 0                         # bytes the control plane acknowledged
        self.log_done = False
        self.gone = False                         # the Lease is gone: nothing more is sent
        self.refetched = False                    # its Pull was sent again for the secret values

    @property
    def attempt_id(self) -> str:
        return self.entry.offer.attempt_id

    @property
    def offer_id(self) -> str:
        return self.entry.offer.offer_id

    @property
    def kill_grace_us(self) -> int:
        return min(self.spec.grace_ms * 1000 + KILL_REAP_US, fencing.MAX_KILL_GRACE_US)

    def __repr__(self) -> str:
        return f"Job(attempt={self.attempt_id}, state={self.entry.state})"

