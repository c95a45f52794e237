"""One open inbox row as the Worker's loop sees it (``Job``)."""

from __future__ import annotations

from ..core.cluster import ExecutionSpec
from ..core.leasefit import KILL_REAP_US          # after SIGKILL: reaping the tree (fencing's kill grace adds it)
from ..core.inbox_states import InboxEntry
from .policy import fencing


class LeaseHold:
    """What the Worker knows of one row's Lease (``Job.lease``)::

        HELD → LOST_KEPT → HELD          (on_lease_loss = "keep": reported; a new Session adopts it)
        HELD | LOST_KEPT → FENCED        (self-fenced: stopped, or never started)
        HELD | LOST_KEPT → GONE          (the control plane no longer knows it)
        FENCED → FENCED_GONE,  GONE → FENCED_GONE

    A ``FENCED`` row's log still goes up while the Lease takes chunks; nothing more is sent for a
    ``GONE`` or ``FENCED_GONE`` one."""

    HELD = "held"
    LOST_KEPT = "lost_kept"
    FENCED = "fenced"
    GONE = "gone"
    FENCED_GONE = "fenced_gone"

    STOPPED = frozenset({FENCED, FENCED_GONE})
    DROPPED = frozenset({GONE, FENCED_GONE})


class Owed:
    """What a row still owes the control plane (``Job.owed``): the ``running`` ACK, the
    completion (or start failure) ACK, the rest of its log."""

    RUNNING_ACK = "running_ack"
    COMPLETION_ACK = "completion_ack"
    LOG = "log"


class Job:
    """The loop's view of one open inbox row (the inbox stays the authority)."""

    __slots__ = ("entry", "spec", "secrets", "session", "handle", "shim_start", "start_fd", "start_deadline_us",
                 "renewal", "ttl_us", "deadline_us", "kill_reason", "kill_at_us", "lease", "owed", "cancel", "uploaded",
                 "refetched", "stop_at_us")

    def __init__(self, entry: InboxEntry, spec: ExecutionSpec, secrets: dict[str, bytes] | None = None) -> None:
        self.entry, self.spec, self.secrets = entry, spec, secrets
        # (Session ID, generation) the Lease is fenced by: the offer's, or the Session that adopted it.
        self.session = (entry.offer.session_id, entry.offer.generation)
        self.handle = None                        # WorkerRunsPort handle of the live shim
        self.shim_start = None                    # its start in flight (WorkerRunsPort.begin), until exec'd
        self.start_fd: int | None = None          # the start's fd registered with the loop's selector
        self.start_deadline_us = 0                # the start's bound (core.limits.SHIM_START_BOUND_US)
        self.renewal: fencing.Renewal | None = None
        # A re-attached run's stop instant read back from its shim's lease file (the Worker's
        # monotonic µs, kept across a restart), until a renewal of this process replaces it.
        self.stop_at_us: int | None = None
        self.ttl_us = 0
        self.deadline_us: int | None = None       # the spec's timeout, Worker monotonic µs
        self.kill_reason: str | None = None       # a core.states.KillReason once signalled
        self.kill_at_us: int | None = None        # SIGKILL due (after the grace)
        self.lease = LeaseHold.HELD
        self.owed = {Owed.LOG}
        self.cancel = False                       # the control plane asked for the run to be cancelled
        self.uploaded = 0                         # bytes the control plane acknowledged
        self.refetched = False                    # its Pull was sent again for the secret values

    @property
    def attempt_id(self) -> str:
        return self.entry.offer.attempt_id

    @property
    def offer_id(self) -> str:
        return self.entry.offer.offer_id

    @property
    def fenced(self) -> bool:
        """Stopped (or never started) because the Lease was lost."""
        return self.lease in LeaseHold.STOPPED

    @property
    def gone(self) -> bool:
        """The control plane no longer knows the Lease: nothing more is sent."""
        return self.lease in LeaseHold.DROPPED

    @property
    def live(self) -> bool:
        """Its shim is starting or running."""
        return self.handle is not None or self.shim_start is not None

    @property
    def log_done(self) -> bool:
        """The control plane holds every byte of the log (or there is none to send)."""
        return Owed.LOG not in self.owed

    def fence(self) -> None:
        """Self-fenced: the run is stopped (or never started)."""
        self.lease = LeaseHold.FENCED_GONE if self.gone else LeaseHold.FENCED

    def drop(self) -> None:
        """The control plane no longer knows the Lease."""
        self.lease = LeaseHold.FENCED_GONE if self.fenced else LeaseHold.GONE

    @property
    def kill_grace_us(self) -> int:
        return min(self.spec.grace_ms * 1000 + KILL_REAP_US, fencing.MAX_KILL_GRACE_US)

    def __repr__(self) -> str:
        return f"Job(attempt={self.attempt_id}, state={self.entry.state}, lease={self.lease})"

