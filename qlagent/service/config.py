"""Agent configuration: ``/etc/qlagent/qlagent.toml`` validated strictly with msgspec.

Precedence (lowest → highest): built-in defaults, the config file (``--config`` or
``QLAGENT_CONFIG``, default ``/etc/qlagent/qlagent.toml`` if it exists), environment
(``QLAGENT_STATE_DIR``, ``QLAGENT_PROFILE``), command-line flags. Unknown keys are errors
that name the key. Durations in seconds, sizes in bytes.
"""

from __future__ import annotations

import os
import re
from typing import Annotated

import msgspec

from ..core import limits as L
from ..core.definitions import check_project_name
from ..core.errors import ValidationError, from_msgspec
from ..core.profiles import Profile, get_profile
from .tomlfile import read_toml
from .trust import TrustedPath, require_trusted, trusted_paths

DEFAULT_CONFIG = "/etc/qlagent/qlagent.toml"
DEFAULT_HTTP_PORT = 7380
MAX_CONFIG_BYTES = 65_536     # a config file is a few hundred bytes; refuse anything that is not
MAX_CONTROL_URLS = 8           # worker.control_url: replicas of one control plane


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
    """``[cluster.dispatcher]``: ADR-0014 §1 per-cycle budgets. Ceilings (page size 64, pages
    16, Workers per cycle 64, claim tries 64) are refused at start-up naming the field."""

    recovery_page_size: int = 8
    recovery_pages: int = 2
    candidate_page_size: int = 8
    candidate_pages: int = 2
    worker_page_size: int = 8
    worker_pages: int = 2
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


def state_space_problem(state_dir: str) -> str | None:
    """Why no Run may start for lack of room on the state directory's file system (free bytes
    for this user below ``core.limits.STATE_MIN_FREE_BYTES``, or statvfs failing), else None.
    One rule for the service's admission, ``/readyz``, ``run show`` and ``doctor``."""
    try:
        v = os.statvfs(state_dir)
    except OSError as e:
        return f"state directory {state_dir}: {e.strerror}"
    free = v.f_bavail * v.f_frsize
    if free < L.STATE_MIN_FREE_BYTES:
        return (f"the state file system is full: {free} bytes free on {state_dir}, "
                f"below {L.STATE_MIN_FREE_BYTES}")
    return None


def default_state_dir() -> str:
    """``/var/lib/qlagent`` for root, else ``$XDG_STATE_HOME/qlagent`` (``~/.local/state/qlagent``)."""
    if os.geteuid() == 0:
        return "/var/lib/qlagent"
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return os.path.join(base, "qlagent")


def load_config(path: str | None, *, trust: bool = True) -> tuple[Config, str | None]:
    """Parse and validate a config file (``path=None``: the default if present, else defaults).

    Raises ValidationError naming the file and key for unknown keys, wrong types or bad values;
    with ``trust`` (all but ``doctor``, which lists it instead) UntrustedPathError (exit 5) for
    a file another user could write (service.trust), before reading it.
    """
    explicit = path is not None
    path = path or os.environ.get("QLAGENT_CONFIG") or DEFAULT_CONFIG
    explicit = explicit or "QLAGENT_CONFIG" in os.environ
    if not explicit and not os.path.exists(path):
        return Config(), None
    if trust:
        require_trusted([TrustedPath("config file", path)])
    data = read_toml(path, "config", MAX_CONFIG_BYTES)
    try:
        cfg = msgspec.convert(data, Config, strict=True)
    except msgspec.ValidationError as e:
        raise from_msgspec(e, root="config", where=path, data=data, type_=Config) from None
    validate(cfg)
    return cfg, path


def parse_listen(value: str, field: str = "http.listen") -> tuple[str, int]:
    """``"HOST:PORT"`` or ``"[IPv6]:PORT"`` (config ``http.listen``, ``serve --listen``) → (host,
    port). Port 0..65535 in ASCII digits (0 binds a free port); a host is required. Raises
    ValidationError naming ``field`` (``http.listen`` or ``--listen``) and the rule."""
    m = re.fullmatch(r"\[([0-9a-fA-F:.]+)\]:([0-9]{1,5})", value) or re.fullmatch(r"([^:\[\]]+):([0-9]{1,5})", value)
    if not m or int(m.group(2)) > 65535:
        raise ValidationError(field, f"{value!r} is not HOST:PORT with port 0..65535", limit="0..65535")
    return m.group(1), int(m.group(2))


def validate(cfg: Config) -> None:
    get_profile(cfg.profile)
    check_project_name(cfg.project)
    if cfg.http is not None and cfg.http.listen:
        parse_listen(cfg.http.listen)
    if cfg.worker is not None and cfg.cluster is not None:
        raise ValidationError("worker", "a fleet Worker is not a control-plane replica: give [worker] or [cluster]")
    if cfg.worker is not None:
        validate_worker(cfg.worker, get_profile(cfg.profile))
    for key in ("state_dir", "artifact_dir", "secret_key_file"):
        v = getattr(cfg, key)
        if v is not None and not os.path.isabs(v):
            raise ValidationError(key, f"{v!r} must be an absolute path")
    if cfg.cluster is not None:
        _validate_cluster(cfg.cluster)


def _validate_cluster(c: ClusterConfig) -> None:
    """The ``[cluster]`` rules msgspec bounds cannot state; imports nothing of the cluster."""
    from .. import bootstrap
    bootstrap.check_cluster(c)
    if (c.tls_cert is None) != (c.tls_key is None):
        raise ValidationError("cluster.tls_key" if c.tls_key is None else "cluster.tls_cert",
                              "tls_cert and tls_key are set together")
    for key in ("tls_cert", "tls_key"):
        v = getattr(c, key)
        if v is not None and not os.path.isabs(v):
            raise ValidationError(f"cluster.{key}", f"{v!r} must be an absolute path")


def validate_worker(w: WorkerConfig, profile: Profile) -> None:
    """``[worker]`` rules; ValidationError naming ``worker.<key>`` and its limit."""
    if not re.fullmatch(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}", w.worker_id):
        raise ValidationError("worker.worker_id", "must be the enrolled Worker's lowercase UUID")
    urls = w.urls
    if not 1 <= len(urls) <= MAX_CONTROL_URLS or len(set(urls)) != len(urls):
        raise ValidationError("worker.control_url", f"one URL or a list of 1..{MAX_CONTROL_URLS} without repeats",
                              limit=MAX_CONTROL_URLS)
    from ..core.control_url import parse_control_url      # only with [worker]: a local agent never loads it
    for u in urls:
        try:
            parse_control_url(u)
        except ValidationError as e:
            which = "" if isinstance(w.control_url, str) else f" ({u!r})"
            raise ValidationError("worker.control_url", f"{e.message.partition(': ')[2]}{which}",
                                  limit=e.limit) from None
    if any(u.startswith("https://") for u in urls) and not w.ca_file:
        raise ValidationError("worker.ca_file", "required with an https:// control_url (the control plane's CA)")
    for key in ("credential_file", "ca_file"):
        v = getattr(w, key)
        if v is not None and not os.path.isabs(v):
            raise ValidationError(f"worker.{key}", f"{v!r} must be an absolute path")
    if not w.executors or len(set(w.executors)) != len(w.executors) or any(e != "local_process" for e in w.executors):
        raise ValidationError("worker.executors", "must be a non-empty list of [\"local_process\"] without repeats")
    if len(w.labels) > L.MAX_LABELS:
        raise ValidationError("worker.labels", f"{len(w.labels)} labels", limit=L.MAX_LABELS)
    for k, v in w.labels.items():
        # The control plane's rule (cluster.placement.check_labels): a hello it refuses is a bad config.
        if not k or len(k.encode()) > L.MAX_LABEL_BYTES or len(v.encode()) > L.MAX_LABEL_BYTES or "\x00" in k + v:
            raise ValidationError(f"worker.labels.{k}", "empty, too long or contains NUL", limit=L.MAX_LABEL_BYTES)
    if not 1 <= w.slots <= profile.max_concurrent_runs:
        raise ValidationError("worker.slots", f"outside 1..{profile.max_concurrent_runs} (the Profile's live runs)",
                              limit=profile.max_concurrent_runs)
    # The logs of live runs are never cut (only completed ones, oldest first): their quotas must
    # fit, or a partition would let the store grow past its bound.
    lo, hi = w.slots * profile.log_max_bytes, profile.artifact_total_bytes
    if w.log_store_bytes is not None and not lo <= w.log_store_bytes <= hi:
        raise ValidationError("worker.log_store_bytes", f"outside {lo}..{hi} bytes (at least worker.slots × the "
                              f"{profile.name} Profile's {profile.log_max_bytes}-byte log quota)", limit=f"{lo}..{hi}")


def resolve(config_path: str | None = None, *, state_dir: str | None = None, profile: str | None = None,
            trust: bool = True, trust_uid: int | None = None) -> Settings:
    """Load the config and apply environment and flag overrides; see the module docstring.

    With ``trust``, every path the agent trusts (service.trust.trusted_paths) is checked and
    UntrustedPathError (exit 5) raised for the first one another user could write — another
    than ``trust_uid`` (default: this process's uid; ``config check --as-user``)."""
    cfg, used = load_config(config_path, trust=trust)
    prof_name = profile or os.environ.get("QLAGENT_PROFILE") or cfg.profile
    if prof_name != cfg.profile:
        cfg = msgspec.structs.replace(cfg, profile=prof_name)
        validate(cfg)
    sd = os.path.abspath(state_dir or os.environ.get("QLAGENT_STATE_DIR") or cfg.state_dir or default_state_dir())
    settings = Settings(config=cfg, config_path=used, profile=get_profile(prof_name), state_dir=sd,
                    db_path=os.path.join(sd, "qlagent.db"),
                    artifact_dir=cfg.artifact_dir or os.path.join(sd, "artifacts"),
                    runs_dir=os.path.join(sd, "runs"),
                    key_file=cfg.secret_key_file or os.path.join(sd, "secret.key"),
                    control_socket=os.path.join(sd, "control.sock"))
    if trust:
        require_trusted(trusted_paths(settings), trust_uid)
    return settings
