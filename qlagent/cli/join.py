"""The one-line join (issue 26): ``qlagent workers enroll NAME --join-token --url URL`` (and
``workers rotate-credential NAME --join-token``) print a join token (``core.jointoken``) on the
control plane; ``qlagent worker join TOKEN`` on the router redeems it and writes the
``[worker]`` configuration, the credential file (0600, owned by the service's user) and the CA
file, then runs ``qlagent doctor`` as that user and says how to restart the service.

``worker join`` writes nothing unless every check before the write passes: the token decodes
and has not expired by this host's clock, no file is there already (``--force`` replaces them:
of a present ``[worker]`` only what the token carries — Worker ID, URLs, credential and CA
files — and the labels of ``--label``; every other key is kept), what the Worker would claim
is within its enrolment and its heartbeat fits the replica's Session TTL (asked read only with
the token's credential; the enrolled ``slots`` are written when none are set), the
configuration it would write validates, and the control plane — over TLS trusting only the
token's CA — accepts the token (``adapters.join_client.redeem``). On OpenWrt (``uci`` and
``/etc/openwrt_release``, or ``--uci``) the options go to UCI ``qlagent.main`` instead of a TOML
file, checked when the init script converts them at the restart.
Refusals: exit 2 ``TOKEN`` (truncated, damaged, wrong CA), ``--user``, ``--config``, ``--label``
(not granted), ``worker.slots`` / ``worker.executors`` (wider than the enrolment),
``worker.heartbeat_interval_s`` (too slow for the Session TTL); exit 3
``file_exists``, ``join_token_used``, ``join_token_expired``; exit 4 ``worker_not_found`` (a
removed Worker) or ``join_token_not_found``; exit 5 no control plane answered."""

from __future__ import annotations

import os
import re
import sys
import time

from ..core import errors as E

DEFAULT_TOKEN_TTL_S = 3600
CREDENTIAL_FILE = "worker.cred"
CA_FILE = "cp-ca.pem"
SERVICE_USER = "qlagent"
JOIN_TIMEOUT_S = 10.0


# ---- on the control plane ---------------------------------------------------------------------

def join_material(ctx) -> tuple[list[str], str | None]:
    """What a join token carries besides the credential, checked before anything is enrolled:
    (``--url`` list, 1..8; the CA's DER in base64 from ``--ca``, default ``qlagent-ca.pem`` beside
    ``cluster.tls_cert``, None without an https URL). ValidationError naming ``--url``, ``--ca``
    or ``--token-ttl`` (60..604800 s)."""
    import base64
    import ssl

    from ..core.control_url import parse_control_url
    from ..core.jointoken import MAX_TTL_S, MIN_TTL_S
    from ..service.config import MAX_CONTROL_URLS
    a = ctx.args
    if not MIN_TTL_S <= a.token_ttl <= MAX_TTL_S:
        raise E.ValidationError("--token-ttl", f"{a.token_ttl} s is outside {MIN_TTL_S}..{MAX_TTL_S} s",
                                limit=f"{MIN_TTL_S}..{MAX_TTL_S}")
    urls = a.url or []
    if not 1 <= len(urls) <= MAX_CONTROL_URLS or len(set(urls)) != len(urls):
        raise E.ValidationError("--url", f"give the control plane's URLs a Worker dials (1..{MAX_CONTROL_URLS}, "
                                         "no repeats), e.g. --url https://cp.example.net:7380", limit=MAX_CONTROL_URLS)
    for u in urls:
        try:
            parse_control_url(u)
        except E.ValidationError as e:
            raise E.ValidationError("--url", e.message.partition(": ")[2] or e.message, limit=e.limit) from None
    if not any(u.startswith("https://") for u in urls):
        return list(urls), None
    tls_cert = ctx.settings.config.cluster.tls_cert if ctx.settings.config.cluster else None
    ca = a.ca or (os.path.join(os.path.dirname(tls_cert), "qlagent-ca.pem") if tls_cert else None)
    if ca is None:
        raise E.ValidationError("--ca", "required with an https:// --url: the CA that signed the replicas' "
                                        "certificate (`qlagent tls ca create` made qlagent-ca.pem)")
    try:
        with open(ca) as f:
            der = ssl.PEM_cert_to_DER_cert(f.read())
    except (OSError, ValueError) as e:
        raise E.ValidationError("--ca", f"{ca}: not a readable PEM certificate ({type(e).__name__})") from None
    return list(urls), base64.b64encode(der).decode("ascii")


def join_token(ctx, worker_id: str, credential: str, material: tuple[list[str], str | None]) -> str:
    """The join token for a just-issued ``credential`` of ``worker_id`` with ``material``
    (``join_material``), recorded by the control plane (``cluster.joins``) for
    ``--token-ttl`` seconds."""
    from .. import bootstrap
    from ..core.jointoken import JoinToken, encode_token
    urls, ca_der = material
    token_id, expires_us = bootstrap.join_tokens(ctx.store).issue(worker_id, ctx.args.token_ttl)
    return encode_token(JoinToken(token_id=token_id, worker_id=worker_id, urls=urls, ca_der=ca_der,
                                  credential=credential, expires_at_s=expires_us // 1_000_000))


def add_token_options(p) -> None:
    """``--join-token``, ``--url``, ``--ca``, ``--token-ttl`` on an enrolling parser."""
    from .common import ascii_int as _ascii_int
    p.add_argument("--join-token", action="store_true", help="print a one-line join token for `qlagent worker join`")
    p.add_argument("--url", action="append", metavar="URL", help="with --join-token: a control-plane URL the Worker "
                                                                 "dials (repeatable, ≤ 8)")
    p.add_argument("--ca", default=None, help="with --join-token: the CA certificate the Worker pins (default "
                                              "qlagent-ca.pem beside cluster.tls_cert)")
    p.add_argument("--token-ttl", type=_ascii_int, default=DEFAULT_TOKEN_TTL_S, metavar="S",
                   help="with --join-token: the token's lifetime in seconds (60..604800, default 3600)")


def cmd_rotate_credential(ctx) -> int:
    """``workers rotate-credential NAME``: a new credential for the same Worker ID, shown once
    (or inside a join token with ``--join-token``); the old one is refused from now on."""
    from .. import bootstrap
    from .workers import _registry
    a = ctx.args
    _registry(ctx)                          # [cluster] or exit 2
    material = join_material(ctx) if a.join_token else None
    worker_id, credential = bootstrap.rotate_worker_credential(ctx.store, a.name)
    return show_credential(ctx, worker_id, credential, material,
                           ": new credential in the join token above (shown once); the old credential is refused "
                           "from now on; on the router: `qlagent worker join --force TOKEN`",
                           "the credential is shown once; the old one is refused from now on: put this one in the "
                           "router's worker.credential_file (0600)")


def show_credential(ctx, worker_id: str, credential: str, material: tuple[list[str], str | None] | None,
                    token_note: str, note: str) -> int:
    """Print a Worker's new credential once — inside a join token when ``material``
    (``join_material``) is given — with ``token_note`` / ``note`` on stderr; ``--json``:
    {workerId, name, joinToken | credential}. Exit code 0."""
    from .common import print_json
    a = ctx.args
    if material is not None:
        token = join_token(ctx, worker_id, credential, material)
        if a.json:
            print_json({"workerId": worker_id, "name": a.name, "joinToken": token})
        else:
            print(token)
            print(f"qlagent: Worker {a.name} {worker_id}{token_note}", file=sys.stderr)
        return 0
    if a.json:
        print_json({"workerId": worker_id, "name": a.name, "credential": credential})
    else:
        print(f"worker      {a.name} {worker_id}")
        print(f"credential  {credential}")
        print(f"qlagent: {note}", file=sys.stderr)
    return 0


def register_rotate(wk) -> None:
    """Add ``rotate-credential`` to the ``workers`` subparsers ``wk``."""
    from .common import options
    common = options(project=False)
    r = wk.add_parser("rotate-credential", parents=[common],
                      help="a new credential for the same Worker ID; the old one is refused at once")
    r.set_defaults(handler=cmd_rotate_credential)
    r.add_argument("name")
    add_token_options(r)


# ---- on the router ----------------------------------------------------------------------------

def service_user(name: str | None) -> tuple[int, int, str]:
    """(uid, gid, name) of the service's user, who must own what it reads as a secret (a
    Worker's credential, a replica's TLS key): ``--user`` (``name``), else ``qlagent`` when
    running as root and that user exists, else this process's user. ValidationError naming
    ``--user`` for an unknown user, or another user's when not root."""
    import pwd
    if name is None and os.geteuid() == 0:
        try:
            pw = pwd.getpwnam(SERVICE_USER)
            return pw.pw_uid, pw.pw_gid, pw.pw_name
        except KeyError:
            pass
    if name is None:
        pw = pwd.getpwuid(os.geteuid())
        return pw.pw_uid, pw.pw_gid, pw.pw_name
    try:
        pw = pwd.getpwnam(name)
    except KeyError:
        raise E.ValidationError("--user", f"no user {name!r}") from None
    if pw.pw_uid != os.geteuid() and os.geteuid() != 0:
        raise E.ValidationError("--user", f"only root can give files to {name!r}")
    return pw.pw_uid, pw.pw_gid, pw.pw_name


def _toml_str(v: str) -> str:
    return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _toml_value(v) -> str:
    if isinstance(v, str):
        return _toml_str(v)
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{_toml_str(k)} = {_toml_value(x)}" for k, x in v.items()) + " }" if v else "{}"
    raise E.ValidationError("--config", f"a [worker] value of type {type(v).__name__} cannot be kept")


# What a join token decides; every other [worker] key of the present configuration is kept.
_TOKEN_KEYS = ("worker_id", "control_url", "credential_file", "ca_file")


def _worker_table(values: dict) -> str:
    """The ``[worker]`` table of ``values`` (key → a value tomllib reads), in their order."""
    return "\n".join(["[worker]", *(f"{k} = {_toml_value(v)}" for k, v in values.items())]) + "\n"


def _present_worker(path: str) -> dict:
    """The ``[worker]`` table of the config file at ``path`` ({} without one or without the
    file). ValidationError naming ``--config`` when the file is not TOML."""
    import tomllib
    try:
        with open(path, "rb") as f:
            doc = tomllib.load(f)
    except FileNotFoundError:
        return {}
    except tomllib.TOMLDecodeError as e:
        raise E.ValidationError("--config", f"{path}: not valid TOML ({e})") from None
    w = doc.get("worker")
    return dict(w) if isinstance(w, dict) else {}


def _uci_present() -> dict:
    """The Worker options of UCI ``qlagent.main`` that join checks and keeps (``slots``,
    ``heartbeat_interval_s``, ``label`` and ``executor`` lists), as ``[worker]`` keys; an
    option not set is absent. ValidationError naming the UCI option when its value is not one."""
    import shlex
    import subprocess
    out: dict = {}
    for opt in ("slots", "heartbeat_interval_s", "label", "executor"):
        p = subprocess.run(["uci", "-q", "show", f"qlagent.main.{opt}"], capture_output=True, timeout=30)
        if p.returncode != 0:
            continue
        raw = p.stdout.decode(errors="replace").strip().partition("=")[2]
        values = shlex.split(raw)
        try:
            if opt == "slots":
                out["slots"] = int(values[0])
            elif opt == "heartbeat_interval_s":
                out["heartbeat_interval_s"] = float(values[0])
            elif opt == "label":
                out["labels"] = dict(v.split("=", 1) for v in values)
            else:
                out["executors"] = values
        except (ValueError, IndexError):
            raise E.ValidationError(f"qlagent.main.{opt}", f"{raw!r} is not a value of this option") from None
    return out


_TABLE = re.compile(r"^\s*\[\s*(worker|cluster)(\.[^\]]*)?\s*\]", re.MULTILINE)


def _without_role(text: str) -> str:
    """``text`` (a TOML config) without its ``[worker]``/``[cluster]`` tables (each up to the
    next table header)."""
    out, skip = [], False
    for line in text.splitlines(keepends=True):
        if re.match(r"^\s*\[", line):
            skip = bool(_TABLE.match(line))
        if not skip:
            out.append(line)
    return "".join(out)


def _present_text(path: str, force: bool) -> str:
    """The config file's text ("" without one). ConflictError ``file_exists`` when it has a
    ``[worker]`` or ``[cluster]`` table and not ``force``."""
    try:
        with open(path) as f:
            old = f.read()
    except FileNotFoundError:
        return ""
    if _TABLE.search(old) and not force:
        raise E.ConflictError(f"{path} already has a [worker] or [cluster] table; --force replaces it",
                              field="--config", code="file_exists")
    return old


def _config_text(path: str, state_dir: str | None, table: str, force: bool) -> str:
    """The new config file's text: the present file's settings (profile, state_dir, [http] …)
    without a role, then ``table``. ConflictError ``file_exists`` when the present file has a
    ``[worker]`` or ``[cluster]`` table and not ``force``."""
    old = _present_text(path, force)
    head = _without_role(old).rstrip("\n")
    if state_dir is not None:
        head = re.sub(r"(?m)^\s*state_dir\s*=.*\n?", "", head).rstrip("\n")
        head = f"state_dir = {_toml_str(state_dir)}\n" + head
    # Top-level keys must precede every table: they stay first, the [worker] table goes last.
    return (head + "\n\n" if head.strip() else "") + table


def _on_openwrt() -> bool:
    import shutil
    return os.path.exists("/etc/openwrt_release") and shutil.which("uci") is not None


def _write_file(path: str, data: bytes, mode: int, owner: tuple[int, int] | None) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
    try:
        os.fchmod(fd, mode)
        if owner is not None and (owner[0] != os.geteuid()):
            os.fchown(fd, *owner)
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def _uci_set(options: list[tuple[str, str | list[str]]]) -> None:
    """Set ``qlagent.main``'s worker options with ``uci`` and commit them."""
    import subprocess
    cmds = []
    for name, value in options:
        cmds.append(["uci", "-q", "delete", f"qlagent.main.{name}"])
        for v in value if isinstance(value, list) else [value]:
            cmds.append(["uci", "add_list" if isinstance(value, list) else "set", f"qlagent.main.{name}={v}"])
    cmds.append(["uci", "commit", "qlagent"])
    for c in cmds:
        p = subprocess.run(c, capture_output=True, timeout=30)
        if p.returncode != 0 and c[2] != "delete":
            raise E.UnavailableError(f"`{' '.join(c[:3])}` failed: {p.stderr.decode(errors='replace').strip()}",
                                     code="uci_failed")


_UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


def _check_fields(token) -> None:
    """A token that decodes but whose Worker ID, URLs or credential could not have come from
    ``workers enroll`` (edited by hand, or another program's): ValidationError naming ``TOKEN``
    and the part, before the configuration it would make is judged by the agent's rules."""
    from ..bootstrap import is_worker_credential
    from ..core.control_url import parse_control_url
    from ..service.config import MAX_CONTROL_URLS
    if not _UUID.fullmatch(token.worker_id):
        raise E.ValidationError("TOKEN", "damaged: its Worker ID is not a UUID (copy the whole line)")
    if not 1 <= len(token.urls) <= MAX_CONTROL_URLS or len(set(token.urls)) != len(token.urls):
        raise E.ValidationError("TOKEN", f"damaged: it carries {len(token.urls)} control-plane URLs "
                                         f"(1..{MAX_CONTROL_URLS}, no repeats)")
    for u in token.urls:
        try:
            parse_control_url(u)
        except E.ValidationError as e:
            raise E.ValidationError("TOKEN", f"damaged: its control-plane URL {u!r} "
                                             f"{e.message.partition(': ')[2] or e.message}") from None
    if not is_worker_credential(token.credential):
        raise E.ValidationError("TOKEN", "damaged: its credential is not a Worker credential (qlw_ + 43 characters)")


def cmd_worker_join(ctx) -> int:
    from ..core.jointoken import decode_token
    from ..service.config import DEFAULT_CONFIG, load_config
    a = ctx.args
    token = decode_token(a.token)
    _check_fields(token)
    now = int(time.time())
    if token.expires_at_s <= now:
        raise E.ConflictError(f"TOKEN: expired {now - token.expires_at_s} s ago (by this host's clock); issue a new "
                              "one on the control plane (`qlagent workers rotate-credential NAME --join-token`)",
                              field="TOKEN", code="join_token_expired")
    from .. import bootstrap
    ca = bootstrap.join_ca_pem(token.ca_der) if token.ca_der is not None else None
    if any(u.startswith("https://") for u in token.urls) and ca is None:
        raise E.ValidationError("TOKEN", "it names an https:// control plane but carries no CA")
    uid, gid, user = service_user(a.user)
    uci = a.uci or (not a.toml and _on_openwrt())
    config = a.target_config or os.environ.get("QLAGENT_CONFIG") or DEFAULT_CONFIG
    directory = a.dir or ("/etc/qlagent" if uci else os.path.dirname(os.path.abspath(config)))
    cred_file, ca_file = os.path.join(directory, CREDENTIAL_FILE), os.path.join(directory, CA_FILE)
    if not os.path.isdir(directory):
        raise E.ValidationError("--dir", f"{directory}: no such directory")
    for p in (cred_file, ca_file):
        if os.path.lexists(p) and not a.force:
            raise E.ConflictError(f"{p} exists; --force replaces it", field="--dir", code="file_exists")
    from .workers import _labels
    if not uci:
        _present_text(config, a.force)
    present = _uci_present() if uci else _present_worker(config)
    values: dict = {"worker_id": token.worker_id,
                    "control_url": token.urls[0] if len(token.urls) == 1 else list(token.urls),
                    "credential_file": cred_file}
    if ca is not None:
        values["ca_file"] = ca_file
    values.update((k, v) for k, v in present.items() if k not in _TOKEN_KEYS)
    if a.label:
        values["labels"] = _labels(a.label)
    # Read only (the token stays unused): what the enrolment grants and how long a Session lives.
    info = bootstrap.describe_joining_worker(token, ca, JOIN_TIMEOUT_S)
    if info is not None:
        # Written when the configuration names no slots: the Worker would run 1 run at a time.
        values.setdefault("slots", info.slots)
        _check_against(a, info, values)
    table = _worker_table(values)
    text = None
    if not uci:
        text = _config_text(config, a.target_state_dir, table, a.force)
        # Judge it by the agent's own rules before anything is written or the token used.
        probe = f"{config}.join{os.getpid()}"
        with open(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
            f.write(text)
        try:
            load_config(probe, trust=False)
        except E.ValidationError as e:
            raise E.ValidationError("--config", f"{config}: the configuration would not load: {e}") from None
        finally:
            os.unlink(probe)
    name = bootstrap.redeem_join_token(token, ca, JOIN_TIMEOUT_S)
    if ca is not None:
        _write_file(ca_file, ca.encode(), 0o644, None)
    _write_file(cred_file, token.credential.encode() + b"\n", 0o600, (uid, gid))
    if uci:
        options: list[tuple[str, str | list[str]]] = [("control_url", list(token.urls)), ("worker_id", token.worker_id),
                                                      ("credential_file", cred_file)]
        if ca is not None:
            options.append(("ca_file", ca_file))
        if a.label:
            options.append(("label", [f"{k}={v}" for k, v in values["labels"].items()]))
        if "slots" in values and "slots" not in present:
            options.append(("slots", str(values["slots"])))
        _uci_set(options)
        where, restart = "UCI qlagent.main", "/etc/init.d/qlagent restart"
    else:
        _write_file(config, text.encode(), 0o644, None)
        where = config
        restart = ("systemctl restart qlagent" if os.path.isdir("/run/systemd/system")
                   else "/etc/init.d/qlagent restart" if os.path.exists("/etc/init.d/qlagent")
                   else f"qlagent serve --config {config}")
    state_dir = None
    if not uci:
        from ..service.config import resolve
        state_dir = resolve(config, trust=False).state_dir
        if not os.path.isdir(state_dir):       # as `qlagent init` makes it for a Worker, owned by the service
            os.makedirs(state_dir, mode=0o700)
            if uid != os.geteuid():
                os.chown(state_dir, uid, gid)
    checks = [] if uci else _doctor(config, uid, gid)
    bad = [c for c in checks if not c["ok"]]
    if a.json:
        from .common import print_json as _print_json
        _print_json({"workerId": token.worker_id, "name": name, "config": where, "credentialFile": cred_file,
                     "caFile": ca_file if ca is not None else None, "user": user, "checks": checks,
                     "next": restart})
    else:
        print(f"joined      {name} {token.worker_id} of {', '.join(token.urls)}")
        print(f"config      {where}")
        print(f"credential  {cred_file} (0600, user {user})")
        if ca is not None:
            print(f"ca file     {ca_file} (the only CA trusted)")
        for c in checks:
            print(f"{'ok  ' if c['ok'] else 'FAIL'}  {c['name']:<14} {c['detail']}")
        print(f"next        {restart}")
    return E.EXIT_UNAVAILABLE if bad else 0


def _check_against(a, info, values: dict) -> None:
    """The ``[worker]`` ``values`` about to be written, judged as the control plane will judge
    the Worker's hello (``bootstrap.check_within_enrolment``) and its heartbeat cadence against
    the replica's Session TTL (``bootstrap.check_session_fit``): a ValidationError naming the
    label (``--label`` when given here) or the key, so nothing is written that ``serve`` refuses."""
    from .. import bootstrap
    from ..core.settings import WorkerConfig
    defaults = WorkerConfig(worker_id="", control_url="", credential_file="")
    labels = values.get("labels", {})
    try:
        bootstrap.check_within_enrolment(info, labels if isinstance(labels, dict) else {},
                                         values.get("executors", defaults.executors),
                                         values.get("slots", defaults.slots))
    except E.ValidationError as e:
        granted = ", ".join(f"{k}={v}" for k, v in sorted(info.labels.items())) or "none"
        if e.field.startswith("worker.labels.") and a.label:
            key = e.field.removeprefix("worker.labels.")
            raise E.ValidationError("--label", f"{key}={labels[key]} is not granted by the enrolment of {info.name} "
                                               f"(its labels: {granted}); `qlagent workers enroll` decides what a "
                                               "Worker may claim") from None
        raise E.ValidationError(e.field, f"{e.message.partition(': ')[2]} (enrolment of {info.name}: labels "
                                         f"{granted}, executors {','.join(info.executor_types)}, slots {info.slots})",
                                limit=e.limit) from None
    interval = values.get("heartbeat_interval_s", defaults.heartbeat_interval_s)
    if info.session_ttl_s is not None and isinstance(interval, (int, float)):
        bootstrap.check_session_fit(interval, info.session_ttl_s)


def _doctor(config: str, uid: int, gid: int) -> list[dict]:
    """``qlagent doctor --json`` on the new configuration, as the service's user would run it."""
    import json
    import subprocess
    env = {k: v for k, v in os.environ.items() if k != "QLAGENT_CONFIG"}
    kw = {"user": uid, "group": gid} if uid != os.geteuid() else {}
    try:
        p = subprocess.run([sys.executable, "-m", "qlagent.cli.main", "doctor", "--config", config, "--json"],
                           capture_output=True, timeout=120, env=env, **kw)
    except (OSError, subprocess.TimeoutExpired) as e:
        # The files are written by now: say why the checks could not run (that user may not
        # execute this interpreter; doctor hung) rather than end as an internal error.
        return [{"name": "doctor", "ok": False, "detail": f"could not run `qlagent doctor` as uid {uid}: "
                                                          f"{type(e).__name__} ({getattr(e, 'strerror', None) or e})"}]
    try:
        return json.loads(p.stdout)["checks"]
    except (ValueError, KeyError):
        return [{"name": "doctor", "ok": False, "detail": p.stderr.decode(errors="replace").strip()[:400]}]


def register(sub, name: str, help_: str) -> None:
    """Add ``worker join`` to ``sub`` (the top-level subparsers). Its ``--config`` and
    ``--state-dir`` are what it writes, not what the command reads."""
    w = sub.add_parser(name, help=help_).add_subparsers(dest="sub", required=True, metavar="SUB")
    j = w.add_parser("join", help="join the fleet with a token from `qlagent workers enroll --join-token`")
    j.set_defaults(handler=cmd_worker_join, reads_config=False)
    j.add_argument("token", metavar="TOKEN")
    j.add_argument("--config", dest="target_config", default=None,
                   help="the config file to write (default $QLAGENT_CONFIG, else /etc/qlagent/qlagent.toml; "
                        "its other settings are kept)")
    j.add_argument("--state-dir", dest="target_state_dir", default=None, help="the state_dir to write into it")
    j.add_argument("--dir", default=None, help="where to write worker.cred and cp-ca.pem (default: the config's "
                                               "directory)")
    j.add_argument("--label", action="append", metavar="KEY=VALUE", help="a Placement label (repeatable)")
    j.add_argument("--user", default=None, help="the service's user, owner of the credential (default qlagent "
                                                "when run as root and it exists, else you)")
    j.add_argument("--toml", action="store_true", help="on OpenWrt too, write the TOML file instead of UCI")
    j.add_argument("--uci", action="store_true", help="write UCI qlagent.main (as on OpenWrt) wherever this runs")
    j.add_argument("--force", action="store_true", help="replace a present [worker], credential and CA file")
    j.add_argument("--json", action="store_true", help="machine-readable output")
