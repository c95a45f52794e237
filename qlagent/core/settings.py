"""The agent's configuration as typed records (the ``qlagent.toml`` schema): what the service,
the composition root, the HTTP surfaces and the cluster services read. Pure: parsing and
resolving the file is ``service.config``'s. Durations in seconds, sizes in bytes; every range
is a ``msgspec.Meta`` bound, enforced when the file is converted."""

# No ``from __future__ import annotations``: msgspec would compile and evaluate each field's
# annotation string the first time a config file is converted (~1 ms on every command and
# start that reads one; bench/results/cli.md).
from typing import Annotated

import msgspec

from .profiles import Profile

DEFAULT_HTTP_PORT = 7380


class HttpConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    listen: str = f"127.0.0.1:{DEFAULT_HTTP_PORT}"   # "HOST:PORT"; "" keeps TCP off (unix socket only)
    unix_socket: str | None = None
    max_in_flight: int | None = None       # default: the Profile's
    max_body_bytes: int | None = None      # default: the Profile's
    read_timeout_s: float = 5.0
    metrics: bool = False                  # GET /metrics (Prometheus text, no token): opt-in


class RetentionConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    keep_per_task: Annotated[int, msgspec.Meta(ge=1)] = 20     # newest log Artifacts kept per Task
    max_total_bytes: Annotated[int, msgspec.Meta(ge=0)] | None = None   # default: the Profile's


class WorkerConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """``[worker]``: run as a fleet Worker (issue 11; docs/worker-protocol.md). Local tasks and
    schedules are off; the local HTTP API stays optional."""

    worker_id: str                          # the enrolled Worker's UUID (`qlagent workers enroll`)
    # https://HOST[:PORT] (http:// to loopback only), or a list of the control plane's replicas
    # (1..8): a request without an answer moves the Worker to the next one.
    control_url: str | list[str]
    credential_file: str                    # 0600, owned by the agent: qlw_… from the enrolment
    ca_file: str | None = None              # PEM CA of the control plane (required for https)
    labels: dict[str, str] = {}
    executors: list[str] = msgspec.field(default_factory=lambda: ["local_process"])
    slots: int = 1                          # runs at once: 1..max_concurrent_runs of the Profile
    heartbeat_interval_s: Annotated[float, msgspec.Meta(ge=1, le=60)] = 5.0      # s
    pull_wait_s: Annotated[int, msgspec.Meta(ge=0, le=30)] = 20                   # long-poll, s
    # Logs not yet uploaded (bytes): worker.slots × the Profile's log_max_bytes (live runs' logs
    # at their quota) .. the Profile's artifact_total_bytes; default the latter.
    log_store_bytes: Annotated[int, msgspec.Meta(ge=1)] | None = None

    @property
    def urls(self) -> list[str]:
        """``control_url`` as a list (one URL or several replicas)."""
        return [self.control_url] if isinstance(self.control_url, str) else list(self.control_url)


class DispatcherConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """``[cluster.dispatcher]``: ADR-0014 §1 budgets of one Worker Pull. Ceilings (page size 64,
    pages 16, claim tries 64) are refused at start-up naming the field."""

    candidate_page_size: int = 8
    candidate_pages: int = 2
    claim_tries: int = 8


class ClusterConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """``[cluster]``: this process acts on the PostgreSQL authority (control-plane replica for
    ``serve``, the CLI against it). The one table of the cluster's times: Session and Lease
    lifetimes (s) and the lease sweeper's cadence (s) and batch."""

    database: str                           # libpq URL; several hosts need target_session_attrs=read-write
    # libpq URL straight to PostgreSQL for the replica's LISTEN connection, when ``database``
    # goes through a transaction-mode pooler (PgBouncer), where LISTEN hears nothing; default ``database``
    listen_database: str | None = None
    pool_size: Annotated[int, msgspec.Meta(ge=1, le=64)] = 8
    session_ttl_s: Annotated[int, msgspec.Meta(ge=5, le=3600)] = 30
    lease_ttl_s: int = 30                   # 6..3600 (core.leasefit: grace_s = 0 must fit), via check_cluster
    sweep_interval_s: Annotated[float, msgspec.Meta(ge=0.5, le=300)] = 5.0
    sweep_batch: Annotated[int, msgspec.Meta(ge=1, le=64)] = 32
    dispatcher: DispatcherConfig = DispatcherConfig()
    tls_cert: str | None = None             # PEM files; both or neither (HTTPS on the control plane)
    tls_key: str | None = None
    # Worker routes (docs/worker-protocol.md): database threads (default pool_size − 2, at most
    # 4; pool_size must be ≥ threads + 2), Pulls long-polling at once (503 beyond), and the
    # longest a route's database work may take before a 503 (s; a long-poll adds its waitS).
    threads: Annotated[int, msgspec.Meta(ge=1, le=64)] | None = None
    max_long_polls: Annotated[int, msgspec.Meta(ge=1, le=256)] = 32
    answer_timeout_s: Annotated[float, msgspec.Meta(ge=1, le=300)] = 30.0


class Config(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """Every range is a ``msgspec.Meta`` bound, enforced when the file is converted."""

    profile: str = "edge"
    project: str = "default"
    state_dir: str | None = None
    artifact_dir: str | None = None
    secret_key_file: str | None = None
    drain_grace_s: Annotated[float, msgspec.Meta(ge=0, le=600)] = 20.0      # s
    kill_grace_s: Annotated[float, msgspec.Meta(ge=0, le=60)] = 5.0         # s
    max_concurrent_runs: Annotated[int, msgspec.Meta(ge=1, le=64)] | None = None
    # How long a store write waits for another process's lock before "store_busy" (s).
    busy_timeout_s: Annotated[float, msgspec.Meta(ge=0.05, le=60)] = 5.0
    http: HttpConfig | None = None
    retention: RetentionConfig = RetentionConfig()
    worker: WorkerConfig | None = None
    cluster: ClusterConfig | None = None


class Settings(msgspec.Struct, frozen=True):
    """Resolved configuration with every path absolute."""

    config: Config
    config_path: str | None
    profile: Profile
    state_dir: str
    db_path: str
    artifact_dir: str
    runs_dir: str
    key_file: str
    control_socket: str
