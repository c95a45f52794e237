"""Agent configuration: ``/etc/qlagent/qlagent.toml`` validated strictly with msgspec.

Precedence (lowest → highest): built-in defaults, the config file (``--config`` or
``QLAGENT_CONFIG``, default ``/etc/qlagent/qlagent.toml`` if it exists), environment
(``QLAGENT_STATE_DIR``, ``QLAGENT_PROFILE``), command-line flags. Unknown keys are errors
that name the key. Durations in seconds, sizes in bytes.
"""

from __future__ import annotations

import os
import re
import sys

import msgspec

from ..core import limits as L
from ..core.definitions import check_project_name
from ..core.errors import ValidationError, from_msgspec
from ..core.profiles import AGENT_PIDS, PIDS_PER_RUN, Profile, get_profile, max_runs_in_pids
from ..core.settings import ClusterConfig, Config, Settings, WorkerConfig
from .trust import TrustedPath, require_trusted, trusted_paths

DEFAULT_CONFIG = "/etc/qlagent/qlagent.toml"
MAX_CONFIG_BYTES = 65_536     # a config file is a few hundred bytes; refuse anything that is not
MAX_CONTROL_URLS = 8           # worker.control_url: replicas of one control plane

# Keys of [cluster.dispatcher] that budgeted a dispatch cycle no process runs (a Worker Pull is
# the only claimer): a file that still sets one is read with a warning, never refused.
RETIRED_DISPATCHER_KEYS = ("recovery_page_size", "recovery_pages", "worker_page_size", "worker_pages")


def _drop_retired(data: dict, path: str) -> None:
    """Remove ``RETIRED_DISPATCHER_KEYS`` from the parsed file, one warning line on stderr each."""
    d = data.get("cluster", {}).get("dispatcher") if isinstance(data.get("cluster"), dict) else None
    if not isinstance(d, dict):
        return
    for key in RETIRED_DISPATCHER_KEYS:
        if key in d:
            del d[key]
            print(f"qlagent: warning: {path}: cluster.dispatcher.{key} is no longer used (ignored); remove it",
                  file=sys.stderr)


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
    from .tomlfile import read_toml         # tomllib only where there is a file to read
    data = read_toml(path, "config", MAX_CONFIG_BYTES)
    _drop_retired(data, path)
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
    profile = get_profile(cfg.profile)
    most = max_runs_in_pids(profile)
    if cfg.max_concurrent_runs is not None and cfg.max_concurrent_runs > most:
        raise ValidationError("max_concurrent_runs",
                              f"{cfg.max_concurrent_runs} Runs do not fit the {profile.name} Profile's {profile.pids} "
                              f"PIDs ({PIDS_PER_RUN} a Run beside the agent's {AGENT_PIDS}): at most {most}",
                              limit=f"1..{most}")
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


def restart_keys(old: Settings, new: Settings, live: frozenset[str] = frozenset()) -> list[str]:
    """The configuration keys that differ between ``old`` (running) and ``new`` (re-read) and
    take effect on a restart only, in the file's order: a table's keys as ``table.key``
    (``http.listen``, ``worker.slots``), ``profile`` and ``state_dir`` as resolved (a flag or
    the environment wins over the file). ``live``: the keys, so spelt, the caller applies at once.
    The one rule of a reload's ``config.reload_needs_restart changed=…`` line."""
    out = []
    for f in msgspec.structs.fields(Config):
        a, b = getattr(old.config, f.name), getattr(new.config, f.name)
        if f.name == "profile":
            a, b = old.profile.name, new.profile.name
        elif f.name == "state_dir":
            a, b = old.state_dir, new.state_dir
        if a == b:
            continue
        if isinstance(a, msgspec.Struct) and isinstance(b, msgspec.Struct):
            keys = [f"{f.name}.{g.name}" for g in msgspec.structs.fields(a) if getattr(a, g.name) != getattr(b, g.name)]
        elif isinstance(a, msgspec.Struct) or isinstance(b, msgspec.Struct):
            # a table added or removed: each key it sets that is not its default
            t = a if isinstance(a, msgspec.Struct) else b
            keys = [f"{f.name}.{g.name}" for g in msgspec.structs.fields(t)
                    if g.required or getattr(t, g.name) != (g.default if g.default_factory is msgspec.NODEFAULT
                                                             else g.default_factory())] or [f.name]
        else:
            keys = [f.name]
        out += [k for k in keys if k not in live]
    return out


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
