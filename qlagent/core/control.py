"""A fleet Worker's view of its control plane (docs/worker-protocol.md "Errors"): the answer of
one request, the typed errors the documented codes map to and the ports the Worker's loop
uses (its client, its local runs), so the Worker's loop
(``worker.runtime``) decides by type without importing the HTTP client
(``adapters.control_client``, which raises them). Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import msgspec

from .cluster import (Ack, AckResult, ChunkAnswer, ExecutionSpec, Heartbeat, HeartbeatRequest, Hello, PullAnswer,
                      SessionGrant)
from .errors import EXIT_CONFLICT, EXIT_NOT_FOUND, EXIT_UNAVAILABLE, EXIT_USAGE, QlError


class Answer(msgspec.Struct, frozen=True):
    """A success: HTTP status, body (bytes) and the database clock from
    ``X-Qlagent-Server-Now-Us`` (µs since the epoch), or None when it was missing."""

    status: int
    body: bytes
    server_now_us: int | None


class ControlError(QlError):
    """An answer of the control plane that is not a success; ``status`` its HTTP status."""

    code = "control_error"
    exit_code = EXIT_UNAVAILABLE

    def __init__(self, message: str, *, code: str | None = None, field: str | None = None, status: int = 0,
                 retry_after_s: float | None = None, next_offset: int | None = None) -> None:
        super().__init__(message, field=field, code=code)
        self.status, self.retry_after_s, self.next_offset = status, retry_after_s, next_offset


class ControlUnreachable(ControlError):
    """No answer: connection refused/reset, DNS, timeout, or (code ``clock_not_set``) a
    certificate outside its dates by a clock that is not set. Retry with backoff."""

    code = "control_unreachable"


class ControlTlsError(ControlError):
    """The control plane's certificate is not signed by the pinned CA (or names another host)."""

    code = "control_tls_refused"
    exit_code = EXIT_USAGE


class ControlAuthError(ControlError):
    """401 ``worker_unauthenticated`` / 403 ``worker_mismatch``: stop pulling, retry with backoff."""

    code = "worker_unauthenticated"
    exit_code = EXIT_USAGE


class SessionGone(ControlError):
    """409 ``stale_generation`` / ``session_expired``: open a new Session."""

    code = "session_expired"
    exit_code = EXIT_CONFLICT


class LeaseGone(ControlError):
    """409 ``lease_ended`` / ``lease_token_mismatch`` / ``lease_not_active``: self-fence."""

    code = "lease_ended"
    exit_code = EXIT_CONFLICT


class ChunkConflict(ControlError):
    """409 ``chunk_gap`` / ``chunk_mismatch``: resume from ``next_offset`` when it is named."""

    code = "chunk_gap"
    exit_code = EXIT_CONFLICT


class PullTokenMismatch(ControlError):
    """409 ``pull_token_mismatch``: forget that pullId."""

    code = "pull_token_mismatch"
    exit_code = EXIT_CONFLICT


class AttemptNotFound(ControlError):
    """404 ``attempt_not_found`` (or ``lease_not_found``): drop what was queued for it."""

    code = "attempt_not_found"
    exit_code = EXIT_NOT_FOUND


class RequestRefused(ControlError):
    """400 ``invalid_request`` / 413 ``body_too_large``: a bug; never retry the same body."""

    code = "invalid_request"
    exit_code = EXIT_USAGE


class ControlBusy(ControlError):
    """503 ``cluster_unavailable`` (``retry_after_s`` from Retry-After) or another 5xx."""

    code = "cluster_unavailable"


BY_CODE = {"worker_unauthenticated": ControlAuthError,
            "lease_expired": LeaseGone, "ack_conflict": RequestRefused, "ack_out_of_order": RequestRefused, "worker_mismatch": ControlAuthError,
            "worker_unauthorized": ControlAuthError,
            "stale_generation": SessionGone, "session_expired": SessionGone,
            "lease_ended": LeaseGone, "lease_token_mismatch": LeaseGone, "lease_not_active": LeaseGone,
            "chunk_gap": ChunkConflict, "chunk_mismatch": ChunkConflict,
            "pull_token_mismatch": PullTokenMismatch,
            "attempt_not_found": AttemptNotFound, "lease_not_found": AttemptNotFound,
            "invalid_request": RequestRefused, "body_too_large": RequestRefused,
            "cluster_unavailable": ControlBusy}


class ControlPort(Protocol):
    """The Worker's client (``adapters.control_client.ControlClient``). Every method raises a
    ControlError of this module when there is no success answer. ``replicas``: how many
    control-plane URLs it tries in turn (a request without an answer moves it to the next);
    ``urls``: those URLs (``scheme://host:port``), in that order. ``idle(fd, write, timeout_s)``,
    when set, is called instead of blocking whenever a call waits on its socket (the caller's
    loop goes on meanwhile; it returns once ``fd`` is ready or ``timeout_s`` s passed)."""

    timeout_s: float
    replicas: int
    urls: tuple[str, ...]
    idle: Callable[[int, bool, float], None] | None

    def hello(self, hello: Hello, timeout_s: float | None = None) -> tuple[SessionGrant, int | None]:
        """Open a Session. Like every call below: answered within ``timeout_s`` (s), returned with
        the answer's database clock (µs, None when missing); msgspec.DecodeError for an
        unreadable answer."""

    def heartbeat(self, beat: HeartbeatRequest, timeout_s: float | None = None) -> tuple[Heartbeat, int | None]:
        """Renew the Session and the Leases ``beat`` names."""

    def ack(self, ack: Ack, timeout_s: float | None = None) -> tuple[AckResult, int | None]:
        """One ACK of an offered Attempt."""

    def pull(self, body: bytes, timeout_s: float | None = None) -> tuple[PullAnswer, int | None]:
        """A kept Pull request (its exact bytes) answered at once, without the long poll."""

    def upload_chunk(self, *, session_id: str, generation: int, attempt_id: str, lease_generation: int,
                     lease_token: str, offset: int, data: bytes,
                     timeout_s: float | None = None) -> tuple[ChunkAnswer, int | None]:
        """``data`` at ``offset`` (bytes) of the Attempt's log under its Lease fence."""

    def start_pull(self, body: bytes, wait_s: int, timeout_s: float | None = None) -> int:
        """Send the long-poll Pull (``body``: the kept request's bytes, ``wait_s`` s; connecting
        and sending within ``timeout_s`` s); returns the fd to wait on."""

    def poll_pending(self) -> bool:
        """Decrypted answer bytes already buffered (the fd would not wake)."""

    def finish_pull(self) -> tuple[PullAnswer, int | None]:
        """The Pull's answer once the fd is readable, with its database clock (µs)."""

    def clock_plausible(self) -> bool:
        """Is the wall clock at or after the package's build date (a clock before it is not set)?"""

    def abort_poll(self, unanswered: bool = False) -> None:
        """Drop the Pull's connection (its answer is lost; the request is retried); with
        ``unanswered`` (its replica stopped answering), the next connections go to the next
        replica."""

    def close(self) -> None:
        """Close every connection."""


class WorkerRunsPort(Protocol):
    """The Worker's local runs (``adapters.worker_runs.WorkerRuns``): run directories (the crash
    barrier's evidence), the shim, the Artifact. ``handle`` values are opaque to the caller
    except ``pid``, ``create_time`` and ``pidfd`` (readable when the shim exits, or None)."""

    def exists(self, attempt_id: str) -> bool:
        """Does the Attempt's run directory exist?"""

    def make_run_dir(self, attempt_id: str) -> None:
        """Create and fsync it (StartError ``run_dir_unsafe``)."""

    def begin(self, spec: ExecutionSpec, secrets: dict[str, bytes], lease_stop_at_us: int | None = None):
        """Ask for the shim (self-fencing at ``lease_stop_at_us``, CLOCK_MONOTONIC µs, unless
        renewed) and return at once the start in flight: its ``fd`` (None: look again within a
        second) is watched by the loop; StartError when it cannot even be asked for."""

    def advance(self, attempt_id: str, start, expired: bool = False):
        """What the start reported, never waiting: None while it goes on, else the live shim's
        handle; ``expired`` (past ``SHIM_START_BOUND_US``) ends it. StartError whose message is
        the shim's start error."""

    def set_lease_deadline(self, attempt_id: str, stop_at_us: int) -> bool:
        """Renew the shim's self-fencing instant (µs); False if the lease file is not writable."""

    def lease_deadline(self, attempt_id: str) -> int | None:
        """The shim's self-fencing instant last written (CLOCK_MONOTONIC µs), or None."""

    def reattach(self, attempt_id: str):
        """The live shim of an earlier Worker process, or None."""

    def alive(self, handle) -> bool:
        """Is the shim still running?"""

    def signal(self, handle, sig: int) -> int:
        """Signal the run's whole process tree (never the shim); how many were signalled."""

    def finished(self, handle) -> None:
        """Reap the shim and release its pidfd."""

    def collect(self, attempt_id: str) -> tuple:
        """(receipt, truncation fact), None for each that is missing."""

    def has_receipt(self, attempt_id: str) -> bool:
        """Is a completion receipt there?"""

    def kill_orphans(self, attempt_id: str) -> None:
        """SIGKILL what is left of a run whose shim is gone."""

    def stop_strays(self, known: set[str], seen: set[str] | None = None) -> dict[str, int]:
        """SIGKILL this Worker's tasks of Attempts not in ``known`` (found by the tag every task
        carries, even after the state directory was wiped); {attempt ID: processes killed}.
        ``seen`` (if given) gets the attempt ID of every tagged process found, known or not."""

    def log_size(self, attempt_id: str) -> int:
        """Bytes in the Artifact."""

    def read_log(self, attempt_id: str, offset: int, size: int) -> bytes:
        """At most ``size`` bytes of the Artifact from ``offset``."""

    def truncate_log(self, attempt_id: str, size: int) -> int:
        """Cut the Artifact to ``size`` bytes; the bytes freed."""

    def prune(self, attempt_id: str) -> None:
        """Remove the run directory and its Artifact."""
