"""The composition root: the one module above ``qlagent.adapters`` that imports them.

It builds the store, the engine's adapters, the secret cipher, the budget meter and the network
gate from the resolved configuration (``core.settings.Settings``) and hands the entry points
objects typed by ``core.ports``. Choosing another authority (the cluster's PostgreSQL) changes
this module, not the service, the HTTP API, the CLI or the application: with a ``[cluster]``
table ``open_store`` returns the PostgreSQL store and ``cluster_services`` the control plane's
Worker registry, Pull, ACKs, log upload and lease sweeper. Without one nothing of
``qlagent.cluster`` or psycopg is imported.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from .core.clock import now_us
from .core.profiles import Profile

if TYPE_CHECKING:   # ports are annotations only: no Protocol class at run time
    from .adapters.postgres.store import PgStore
    from .core.dispatch import Refusal
    from .core.ports import BudgetPort, CipherFactory, NetworkPort, PanelSource, SecretCipher, Store
    from .core.settings import ClusterConfig, Settings, WorkerConfig

WORKER_RUNS_DIR = "worker-runs"   # a fleet Worker's run directories, under its state directory
SHIM_LINGER_S = 2.0      # the shim drains output this long after its task exits (ARCHITECTURE.md)


def open_store(settings: Settings, project: str | None = None, *, migrate: bool = True, create_project: bool | str = True,
               clock_us: Callable[[], int] = now_us, replica: str | None = None) -> Store:
    """The authority acting in ``project`` (default: the config's): the local SQLite file at
    ``settings.db_path``, or with ``[cluster]`` the PostgreSQL database (whose own clock decides
    time; ``clock_us`` applies to the local store only). ``replica`` (``HOST/PID``): this process
    is a control-plane replica, and its database sessions say so (``qlagent status``).

    ``migrate=False`` refuses a schema behind this build (UnavailableError ``store_not_migrated``);
    ``create_project=False`` makes an unknown Project NotFoundError; ``"on_write"`` creates it
    inside the first write transaction that commits, so a refused command leaves none. Raises StoreIntegrityError,
    UnavailableError as ``SqliteStore`` / ``PgStore`` document."""
    cluster = settings.config.cluster
    if cluster is not None:
        require_cluster_driver()
        from .adapters.postgres.store import PgStore
        if replica is not None:
            from .adapters.postgres.connection import name_sessions
            name_sessions(replica)
        return PgStore(cluster.database, project or settings.config.project, migrate=migrate,
                       create_project=create_project, pool_size=cluster.pool_size)
    from .adapters.sqlite.store import SqliteStore
    return SqliteStore(settings.db_path, project or settings.config.project, migrate=migrate,
                       create_project=create_project, clock_us=clock_us,
                       busy_timeout_ms=int(settings.config.busy_timeout_s * 1000))


def open_cluster_store(settings: Settings) -> PgStore:
    """The ``[cluster]`` PostgreSQL store acting in no Project (``store.project`` is None), for
    what belongs to the cluster rather than to a Project (``qlagent workers``): it neither creates
    nor requires a Project. Not migrated here (UnavailableError ``store_not_migrated``); raises
    UnavailableError ``cluster_driver_missing`` (``require_cluster_driver``)."""
    require_cluster_driver()
    from .adapters.postgres.store import PgStore
    c = settings.config.cluster
    return PgStore(c.database, None, migrate=False, create_project=False, pool_size=c.pool_size)


def cipher_factory(key_file: str) -> CipherFactory:
    """Opens the secret key file on each call (UnavailableError ``secret_key_unavailable``);
    nothing of the cipher is imported until a Secret is sealed or opened."""
    def open_cipher() -> SecretCipher:
        from .adapters.secretbox import SecretBox
        return SecretBox(key_file)
    return open_cipher


def migrate_legacy_secrets(settings: Settings, store: Store) -> tuple[int, list[str]]:
    """Re-encrypt Secrets an earlier version stored (``qlsb1``, AES-GCM) with the current cipher
    (issue 14); see ``application.secrets.migrate_legacy_secrets``. (rows done, problem lines)."""
    from .adapters.secretbox import LEGACY_MAGIC
    from .application.secrets import migrate_legacy_secrets as migrate
    return migrate(store, cipher_factory(settings.key_file), LEGACY_MAGIC)


def create_key_file(path: str) -> bool:
    """Create the 32-byte secret key file (0600) if missing; True if it was created."""
    from .adapters.secretbox import create_key_file as create
    return create(path)


def budget_meter(profile: Profile) -> BudgetPort:
    """The service tree's memory/PID meter (cgroup files, else psutil)."""
    from .adapters.budget import BudgetMeter
    return BudgetMeter(profile)


def budget_check(profile: Profile, running: bool) -> tuple[bool, str]:
    """(ok, detail) of ``doctor``'s budget line: the running service's cgroup figures
    (``running``: a service holds the state directory)."""
    from .adapters.budget import budget_check as check
    return check(profile, running)


def network_gate() -> NetworkPort:
    """The netlink gate; imports pyroute2 (≈ 18 MB), so call it only once a Task needs it."""
    from .adapters.netgate import NetworkGate
    return NetworkGate()


def build_engine(settings: Settings, store: Store, *, max_concurrent: int, budget: BudgetPort | None,
                 clock_us: Callable[[], int], log, python: str | None = None):
    """An ``application.engine.Engine`` over ``store`` with the shim, artifact and cipher adapters
    of ``settings`` (artifact root, runs directory, key file, Profile) and the run user's
    baseline environment (HOME, USER, LOGNAME, SHELL)."""
    from .adapters.artifacts import ArtifactAllocator, Artifacts
    from .adapters.processes import ShimProcesses, baseline_env
    from .adapters.runcgroup import RunCgroups
    from .application.engine import Engine
    alloc = ArtifactAllocator(settings.artifact_dir, settings.profile, runs_root=settings.runs_dir)
    cgroups = RunCgroups.setup()
    if cgroups.enabled:
        log("info", "service.run_cgroups", detail=cgroups.reason)
    elif cgroups.service_dir is not None:   # a cgroup of its own, but no subtree to give Runs
        log("notice", "service.run_cgroups", detail=cgroups.reason, fallback="oom_score_adj")
    return Engine(store, procs=ShimProcesses(alloc, SHIM_LINGER_S, python, cgroups), artifacts=Artifacts(alloc),
                  cipher=cipher_factory(settings.key_file), profile=settings.profile,
                  max_concurrent=max_concurrent, budget=budget, clock_us=clock_us, baseline=baseline_env(),
                  log=log)


def artifact_refusal(settings: Settings) -> Refusal | None:
    """What the log Artifact's admission (ADR-0071 §4 step 6) answers for one full log now:
    None when it fits, else the refusal with its figures (``run show`` of a queued Run). Reads
    statvfs and the artifact root; creates nothing."""
    from .adapters.artifacts import Artifacts, ArtifactAllocator
    return Artifacts(ArtifactAllocator(settings.artifact_dir, settings.profile, runs_root=settings.runs_dir)) \
        .admit(settings.profile.log_max_bytes)


def panel_source() -> PanelSource:
    """Reads a qinglong 2.x data directory (read-only) for ``import qinglong``."""
    from .adapters.qinglong import QinglongPanel
    return QinglongPanel()


def network_check() -> tuple[bool, str]:
    """(ok, detail) of ``doctor``'s network line: netlink's default routes against the gate's."""
    from .adapters.netlink import network_check as check
    return check()


def store_checks(db_path: str) -> list[tuple[str, bool, str]]:
    """``qlagent doctor``'s checks of the store file: (name, ok, detail) each."""
    from .adapters.sqlite.store import diagnose
    return diagnose(db_path)


def require_cluster_driver() -> None:
    """The ``[cluster]`` role needs psycopg 3 and psycopg_pool, an optional extra a router never
    installs: without them, UnavailableError ``cluster_driver_missing`` (exit 5) naming
    ``cluster`` and the install command, instead of an internal ModuleNotFoundError."""
    import importlib.util
    missing = [m for m in ("psycopg", "psycopg_pool") if importlib.util.find_spec(m) is None]
    if missing:
        from .core.errors import UnavailableError
        raise UnavailableError(f"cluster: the [cluster] table needs {' and '.join(missing)} (not installed); "
                               "install them with `pip install 'qlagent[cluster]'`",
                               code="cluster_driver_missing", field="cluster")


def cluster_store_checks(settings: Settings) -> list[tuple[str, bool, str]]:
    """``qlagent doctor``'s checks of the ``[cluster]`` database: (name, ok, detail) each.
    Raises UnavailableError ``cluster_driver_missing`` (``require_cluster_driver``)."""
    require_cluster_driver()
    from .adapters.postgres.store import diagnose
    return diagnose(settings.config.cluster.database)


def key_file_problem(path: str) -> str | None:
    """What is wrong with the secret key file (missing, mode, size), or None."""
    from .adapters.secretbox import check_key_file
    return check_key_file(path)


def worker_ca(w: WorkerConfig):
    """The TLS client context a ``core.settings.WorkerConfig`` trusts (its ``ca_file``), or None
    when no ``control_url`` is https. ValidationError naming ``worker.ca_file`` when the file is
    not a readable PEM CA."""
    from .adapters.control_client import tls_context
    urls = w.urls
    return tls_context(w.ca_file) if w.ca_file and any(u.startswith("https://") for u in urls) else None


def tls_names_warning(cert_file: str, host: str) -> dict | None:
    """A replica's start-up check (issue 20): when the certificate in ``cert_file`` names none of
    the names a Worker may use for ``host`` (its listen address; every local address for an
    unspecified one), what to journal ({address, names, hint}); None when one is named."""
    from .adapters.tls_names import certificate_names, covers, listen_names
    names = certificate_names(cert_file)
    candidates = listen_names(host)
    if any(covers(names, c) for c in candidates):
        return None
    if candidates == [host]:
        hint = "cluster.tls_cert names none of this replica's listen addresses; Workers will refuse it"
    else:       # Workers may dial a DNS name of this host that it does not know itself by
        hint = ("cluster.tls_cert names neither this host's name nor its addresses; Workers refuse it unless "
                "they dial a name it carries")
    return {"address": host or "*", "names": ",".join(names) or "none", "hint": hint}


def make_tls_ca(directory: str, days: int, common_name: str, force: bool) -> tuple[str, str, int]:
    """``qlagent tls ca create``: (certificate file, key file, notAfter in Unix seconds) of a new
    CA in ``directory`` (``adapters.tls_ca.create_ca``: its refusals, nothing written)."""
    from .adapters import tls_ca
    cert, key = tls_ca.create_ca(directory, days, common_name, force)
    return cert, key, tls_ca.not_after(cert)


def make_server_certificate(directory: str, names: str, ca: str | None, ca_key: str | None, days: int,
                            force: bool, key_owner: tuple[int, int] | None = None) -> tuple[str, str, list[str], int]:
    """``qlagent tls cert create --server``: (certificate file, key file, subjectAltNames,
    notAfter in Unix seconds) of a replica certificate for ``names`` (``HOST[,HOST…]``) in
    ``directory``, signed by ``ca`` (default ``directory/qlagent-ca.pem``) with ``ca_key``
    (default ``qlagent-ca-key.pem`` beside it), the key owned by ``key_owner`` (uid, gid) when
    given; ``adapters.tls_ca``'s refusals, nothing written."""
    import os

    from .adapters import tls_ca
    sans = tls_ca.parse_names(names)
    ca = ca or os.path.join(directory, tls_ca.CA_CERT)
    ca_key = ca_key or os.path.join(os.path.dirname(ca), tls_ca.CA_KEY)
    cert, key = tls_ca.create_server_cert(directory, sans, ca, ca_key, days, force, key_owner)
    return cert, key, sans, tls_ca.not_after(cert)


def certificate_expiries(settings: Settings) -> list[tuple[str, str, int]]:
    """(field, file, notAfter in Unix seconds) of each certificate ``settings``' role relies on:
    a replica's ``cluster.tls_cert`` (read with ``cryptography``), a Worker's ``worker.ca_file``
    with an https control_url (its earliest CA, read by ``ssl``: a router never loads
    ``cryptography``). A file that cannot be read is left out: the preflight and ``doctor``'s
    own lines name it."""
    c, w = settings.config.cluster, settings.config.worker
    if c is not None and c.tls_cert is not None:
        from .adapters.tls_ca import not_after
        try:
            return [("cluster.tls_cert", c.tls_cert, not_after(c.tls_cert))]
        except (OSError, ValueError):
            return []
    if w is not None and w.ca_file and any(u.startswith("https://") for u in w.urls):
        import ssl
        from .adapters.control_client import tls_context
        from .core.errors import QlError
        try:
            ends = [ssl.cert_time_to_seconds(c["notAfter"]) for c in tls_context(w.ca_file).get_ca_certs()]
        except (QlError, ValueError, KeyError):
            return []
        return [("worker.ca_file", w.ca_file, min(ends))] if ends else []
    return []


def worker_credential(w: WorkerConfig, owner: bool = True) -> str:
    """The credential in ``w.credential_file`` (``core.settings.WorkerConfig``); ValidationError
    naming ``worker.credential_file`` when it is missing, not the agent's (``owner``), not 0600
    or not a Worker credential (the value is never quoted)."""
    from .adapters.control_client import read_credential
    return read_credential(w.credential_file, owner)


def build_worker(settings: Settings, log, notify):
    """The fleet Worker of ``settings.config.worker`` (issue 11): its control client (credential
    and CA checked now: ValidationError naming ``worker.credential_file``/``worker.ca_file``),
    its inbox (``<state dir>/inbox.sqlite3``) and its run directories
    (``<state dir>/worker-runs``), in an ``worker.runtime.WorkerRuntime``. Nothing of
    the local store or of the control plane (``qlagent.cluster``, psycopg) is loaded."""
    import os

    from .adapters.control_client import ControlClient
    from .adapters.sqlite.inbox import SqliteInbox
    from .adapters.worker_runs import WorkerRuns
    from .worker.runtime import WorkerRuntime
    from .core.cluster import Hello
    w = settings.config.worker
    client = ControlClient(w.control_url, w.worker_id, w.credential_file, w.ca_file)
    inbox = SqliteInbox.for_profile(settings.state_dir, settings.profile)
    runs = WorkerRuns(os.path.join(settings.state_dir, WORKER_RUNS_DIR))
    return WorkerRuntime(client, inbox, runs, worker_id=w.worker_id,
                         hello=Hello(labels=dict(w.labels), executor_types=tuple(w.executors), slots=w.slots),
                         slots=w.slots, heartbeat_s=w.heartbeat_interval_s, pull_wait_s=w.pull_wait_s,
                         drain_grace_s=settings.config.drain_grace_s,
                         log_store_bytes=w.log_store_bytes or settings.profile.artifact_total_bytes,
                         log_max_bytes=settings.profile.log_max_bytes, log=log, notify=notify)


DOCTOR_TIMEOUT_S = 5.0


def check_worker_cadence(settings: Settings, timeout_s: float) -> None:
    """Before a Worker opens its first Session: ask the control plane (read only, the first
    replica, waiting at most ``timeout_s`` s) its Session TTL and check ``heartbeat_interval_s``
    against it (``check_session_fit``: ValidationError naming ``worker.heartbeat_interval_s``,
    exit 2). No answer, a refusal or a replica that does not say: nothing raised (the first
    hello's Session TTL is checked then)."""
    from .adapters.control_client import ControlClient
    from .core.control import ControlError
    w = settings.config.worker
    client = ControlClient(w.control_url, w.worker_id, w.credential_file, w.ca_file, timeout_s=timeout_s)
    try:
        info = client.describe()
    except ControlError:
        return
    finally:
        client.close()
    if info.session_ttl_s is not None:
        check_session_fit(w.heartbeat_interval_s, info.session_ttl_s)


def worker_checks(settings: Settings) -> list[tuple[str, bool, str]]:
    """``qlagent doctor``'s checks of ``[worker]``: (name, ok, detail) each. The credential file
    and the CA file by the rules ``build_worker``'s control client applies; then for each
    ``control_url`` TCP + TLS with the pinned CA + ``GET /healthz`` (status, ms) and, with a good
    credential, ``GET /api/v3/cluster/workers/{workerId}`` (read only: no Session is opened and
    no Lease touched, so the running Worker is not fenced); then the inbox (read-only
    quick_check) and the log store against ``log_store_bytes``. Never raises for what it
    inspects; nothing is created."""
    import os
    import time

    from .adapters.control_client import ControlClient, healthz, read_credential, tls_context
    from .adapters.sqlite.inbox import FILENAME
    from .adapters.sqlite.inbox import diagnose as inbox_diagnose
    from .adapters.worker_runs import log_store_usage
    from .core.control import ControlAuthError, ControlError
    from .core.errors import QlError
    w, out = settings.config.worker, []
    urls = w.urls
    try:
        read_credential(w.credential_file)
        credential = True
        out.append(("credential", True, f"{w.credential_file} (regular file, 0600, a Worker credential)"))
    except QlError as e:
        credential = False
        out.append(("credential", False, str(e)))
    ctx, ca = None, True
    if any(u.startswith("https://") for u in urls):
        try:
            ctx = tls_context(w.ca_file)
            out.append(("ca file", True, f"{w.ca_file} (PEM CA loaded; the only CA trusted)"))
        except QlError as e:
            ca = False
            out.append(("ca file", False, str(e)))
    for url in urls:
        if url.startswith("https://") and not ca:
            out.append(("control", False, f"{url}: not checked (worker.ca_file cannot be loaded)"))
            continue
        t0 = time.monotonic()
        try:
            status = healthz(url, ctx, DOCTOR_TIMEOUT_S)
        except QlError as e:
            out.append(("control", False, f"{url}: {e}"))
            continue
        ms = (time.monotonic() - t0) * 1000
        out.append(("control", status == 200, f"{url}: TLS ok, GET /healthz {status} in {ms:.0f} ms"
                    if url.startswith("https://") else f"{url}: GET /healthz {status} in {ms:.0f} ms"))
        if not credential:
            out.append(("worker", False, f"{url}: credential not checked (worker.credential_file is not usable)"))
            continue
        client = ControlClient(url, w.worker_id, w.credential_file, w.ca_file, timeout_s=DOCTOR_TIMEOUT_S)
        try:
            info = client.describe()
        except ControlAuthError as e:
            out.append(("worker", False, f"{url}: the control plane refuses this credential for worker_id "
                                         f"{w.worker_id} ({e}); re-enroll it (`qlagent workers enroll`)"))
            continue
        except ControlError as e:
            if e.status == 404:
                out.append(("worker", True, f"{url}: credential check unavailable there (a control plane "
                                            "older than GET /api/v3/cluster/workers/{workerId})"))
            else:
                out.append(("worker", False, f"{url}: {e}"))
            continue
        finally:
            client.close()
        labels = ",".join(f"{k}={v}" for k, v in sorted(info.labels.items())) or "none"
        out.append(("worker", True, f"{url}: known as {info.name}, state {info.state}, generation "
                                    f"{info.generation}; enrolled labels {labels}, executors "
                                    f"{','.join(info.executor_types)}, slots {info.slots}"))
        if info.session_ttl_s is not None:
            try:
                check_session_fit(w.heartbeat_interval_s, info.session_ttl_s)
                out.append(("heartbeat", True, f"{url}: worker.heartbeat_interval_s {w.heartbeat_interval_s:g} s "
                                               f"renews its {info.session_ttl_s} s Session/Lease in time"))
            except QlError as e:
                out.append(("heartbeat", False, f"{url}: {e}"))
    p = settings.profile
    out.append(("inbox", *inbox_diagnose(os.path.join(settings.state_dir, FILENAME), p.inbox_rows, p.inbox_bytes)))
    cap = w.log_store_bytes or p.artifact_total_bytes
    runs, used = log_store_usage(os.path.join(settings.state_dir, WORKER_RUNS_DIR))
    out.append(("log store", used <= cap, f"{used} of {cap} bytes (worker.log_store_bytes) in {runs} run "
                                          "director" + ("y" if runs == 1 else "ies")))
    return out


# ---- the cluster control plane ([cluster]) -------------------------------------------------

def check_cluster(cluster: ClusterConfig) -> None:
    """Start-up checks of a ``core.settings.ClusterConfig`` beyond its msgspec bounds: the libpq
    URLs (``database``, ``listen_database``) and ADR-0014's dispatcher ceilings. Raises ValidationError naming the ``cluster.*`` field."""
    from .adapters.postgres.connection import check_url
    from .cluster.dispatcher import check_budgets
    check_url(cluster.database)
    if cluster.listen_database is not None:
        check_url(cluster.listen_database, "cluster.listen_database")
    check_budgets(_budgets(cluster))


def _budgets(cluster: ClusterConfig):
    from .cluster.dispatcher import DispatcherBudgets
    d = cluster.dispatcher
    return DispatcherBudgets(candidate_page_size=d.candidate_page_size, candidate_pages=d.candidate_pages,
                             claim_tries=d.claim_tries, lease_ttl_s=cluster.lease_ttl_s)


def join_tokens(store: PgStore):
    """``cluster.joins.JoinTokens`` on the PostgreSQL ``store``'s pool (issue 26)."""
    from .adapters.postgres.join_tokens import PgJoinTokens
    from .cluster.joins import JoinTokens
    return JoinTokens(PgJoinTokens(store.pool))


def rotate_worker_credential(store: PgStore, name: str) -> tuple[str, str]:
    """``workers rotate-credential``: (Worker ID, new credential) of the Worker ``name`` on the
    PostgreSQL ``store``'s pool (``cluster.credentials.rotate_credential``)."""
    from .adapters.postgres.credentials import PgCredentials
    from .cluster.credentials import rotate_credential
    return rotate_credential(PgCredentials(store.pool), name)


def fleet_overview(store: PgStore) -> dict:
    """``qlagent status``: ``adapters.postgres.overview.fleet_overview`` on the cluster store's pool."""
    from .adapters.postgres.overview import fleet_overview as overview
    return overview(store.pool)


def join_ca_pem(ca_der_b64: str) -> str:
    """The PEM of a join token's CA (``adapters.join_client.ca_pem``; ValidationError ``TOKEN``)."""
    from .adapters.join_client import ca_pem
    return ca_pem(ca_der_b64)


def is_worker_credential(text: str) -> bool:
    """Has ``text`` the shape of a Worker credential (``adapters.control_client.CREDENTIAL``)?"""
    from .adapters.control_client import CREDENTIAL
    return CREDENTIAL.fullmatch(text) is not None


def describe_joining_worker(token, ca_pem: str | None, timeout_s: float):
    """The ``core.cluster.WorkerInfo`` (enrolment, the replica's Session TTL) of a
    ``core.jointoken.JoinToken``'s Worker from the first of its URLs that answers, the token
    left unused; None from a control plane older than the route. The refusals of
    ``adapters.join_client.redeem``; the last URL's ``ControlUnreachable`` when none answers."""
    from .adapters.join_client import describe
    from .core.control import ControlUnreachable
    err = None
    for url in token.urls:
        try:
            return describe(url, ca_pem, token.worker_id, token.credential, timeout_s)
        except ControlUnreachable as e:
            err = e
    raise err


def check_within_enrolment(info, labels: dict[str, str], executors: list[str], slots: int) -> None:
    """The check a replica makes of a Worker's hello (``cluster.registry.narrow``) made on the
    ``[worker]`` values before they are written: ValidationError naming the ``worker.*`` key
    (``worker.labels.KEY``, ``worker.executors``, ``worker.slots``) wider than the enrolment
    ``info`` (a ``core.cluster.WorkerInfo``)."""
    from .cluster.registry import narrow
    from .core.cluster import Enrolment, Hello, hello_config_field
    from .core.errors import ValidationError
    enrolment = Enrolment(info.worker_id, info.name, info.labels, tuple(info.executor_types), info.slots, info.state)
    try:
        narrow(enrolment, Hello(labels=dict(labels), executor_types=tuple(executors), slots=slots))
    except ValidationError as e:
        why = e.args[0].split(": ", 1)[-1]
        raise ValidationError(hello_config_field(e.field) or e.field, why, limit=e.limit) from None


def check_session_fit(heartbeat_interval_s: float, session_ttl_s: float) -> None:
    """``worker.session.check_session_fit``: ValidationError naming
    ``worker.heartbeat_interval_s`` when it cannot renew a ``session_ttl_s`` Session in time."""
    from .worker.session import check_session_fit as fit
    fit(heartbeat_interval_s, session_ttl_s)


def redeem_join_token(token, ca_pem: str | None, timeout_s: float) -> str:
    """Redeem a ``core.jointoken.JoinToken`` at the first of its URLs that answers (TLS trusting
    only ``ca_pem``); the Worker's name. The refusals of ``adapters.join_client.redeem``; the
    last URL's ``ControlUnreachable`` when none answers."""
    from .adapters.join_client import redeem
    from .core.control import ControlUnreachable
    err = None
    for url in token.urls:
        try:
            return redeem(url, ca_pem, token.worker_id, token.credential, token.token_id, timeout_s)
        except ControlUnreachable as e:
            err = e
    raise err


def worker_registry(settings: Settings, store: PgStore):
    """``cluster.registry.WorkerRegistry`` on the PostgreSQL ``store``'s pool, with the Session and
    Lease lifetimes of ``[cluster]``."""
    from .adapters.postgres.registry import PgWorkerRegistry
    from .cluster.registry import Timings, WorkerRegistry
    c = settings.config.cluster
    return WorkerRegistry(PgWorkerRegistry(store.pool), Timings(session_ttl_s=c.session_ttl_s,
                                                                lease_ttl_s=c.lease_ttl_s))


def log_chunks(store: PgStore):
    """Reader of the Worker-uploaded log chunks: ``read(attempt_id, offset, limit) -> bytes``."""
    from .adapters.postgres.logs import PgLogStore
    return PgLogStore(store.pool)


class ClusterServices:
    """What one control-plane replica serves besides the store's routes, built over ONE pool:
    ``registry`` (WorkerRegistry), ``pull`` (WorkerPull, long-poll woken by LISTEN/NOTIFY),
    ``acks`` (AckService), ``logs`` (LogUpload), ``sweeper`` (LeaseSweeper), ``joins`` (JoinTokens), ``placement_report``
    (``report(limit)``: queued Runs no enrolled Worker can match get ``run.unplaceable``), ``log_reader``
    (PgLogStore: ``read_range`` serves ``GET …/runs/{id}/log``), ``budgets`` (DispatcherBudgets),
    ``now_us()`` (the database clock, µs: one query each), ``clock`` (``core.dbclock.
    DatabaseClock`` over it, synced by the replica's duty thread: the duties plan in it and the Worker
    routes stamp ``X-Qlagent-Server-Now-Us`` from it), the
    ``[cluster]`` table as ``config``, ``stop_waiting()`` (SIGTERM: long-polling Pulls answer at
    once) and ``close()`` for the LISTEN connection (supervised: ``log`` hears when it is lost and
    restored). ``qlagent.http.service`` mounts the Worker routes over it."""

    def __init__(self, settings: Settings, store: PgStore, log=None) -> None:
        from .adapters.postgres.dispatch import PgDispatchStore, PgPlanSource
        from .adapters.postgres.leases import PgLeaseStore
        from .adapters.postgres.notify import PgCandidateSignal
        from .adapters.postgres.placement import PgPlacementReport
        from .adapters.postgres.registry import PgWorkerRegistry
        from .adapters.postgres.secrets import PgSecretResolver
        from .adapters.secretbox import SecretBox
        from .cluster.acks import AckService
        from .cluster.leases import LeaseSweeper
        from .cluster.logs import LogUpload
        from .cluster.placement import LeaseFitPlans
        from .cluster.pull import WorkerPull
        from .core.dbclock import DatabaseClock
        c = settings.config.cluster
        self.config = c
        self.store = store
        self.budgets = _budgets(c)
        self.registry = worker_registry(settings, store)
        plans = LeaseFitPlans(PgPlanSource(store.pool, settings.profile), c.lease_ttl_s)
        dispatch = PgDispatchStore(store.pool, plans)
        self.signal = PgCandidateSignal(c.listen_database or c.database, log, notify_url=c.database)
        self.pull = WorkerPull(dispatch, PgSecretResolver(store.pool, _LazyBox(settings.key_file, SecretBox)),
                               self.budgets, self.signal)
        leases = PgLeaseStore(store.pool)
        self.acks = AckService(leases, c.lease_ttl_s)
        self.log_reader = log_chunks(store)
        self.logs = LogUpload(self.log_reader, settings.profile)
        self.sweeper = LeaseSweeper(leases, PgWorkerRegistry(store.pool), c.sweep_batch)
        self.placement_report = PgPlacementReport(store.pool, plans.max_grace_ms)
        self.joins = join_tokens(store)
        self.now_us = dispatch.now_us
        self.clock = DatabaseClock(self.now_us)

    def stop_waiting(self) -> None:
        """End every long-poll now (each answers what it has: idle) and every later one at
        once; the replica is stopping. Idempotent."""
        self.signal.close()

    def close(self) -> None:
        self.signal.close()


def check_replica_pool(cluster: ClusterConfig) -> int:
    """The Worker routes' database threads of a replica (``[cluster] threads``, default
    ``pool_size`` − 2 capped at 4). One connection serves the loop duties (scheduler,
    sweeper, Task-head reload) and ``/readyz`` (which wait at most 1 s and 2 s for it), one the long-polls re-reading after a wake-up (they hold none while
    waiting), so ``pool_size`` ≥ threads + 2; ValidationError naming ``cluster.pool_size``
    otherwise (issue 10 §6)."""
    from .core.errors import ValidationError
    threads = cluster.threads if cluster.threads is not None else max(1, min(4, cluster.pool_size - 2))
    if cluster.pool_size < threads + 2:
        raise ValidationError("cluster.pool_size", f"{cluster.pool_size} connections are too few for {threads} "
                              f"route threads: a replica needs threads + 2 = {threads + 2} (the loop, long-polls)",
                              limit=threads + 2)
    return threads


class _LazyBox:
    """Opens the secret key file at the first Secret a claimed offer needs (a replica without
    Secrets never needs the key)."""

    def __init__(self, path: str, box_class) -> None:
        self._path, self._cls, self._box = path, box_class, None

    def open(self, project_id: str, name: str, blob: bytes) -> bytes:
        if self._box is None:
            self._box = self._cls(self._path)
        return self._box.open(project_id, name, blob)
