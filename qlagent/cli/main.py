"""``qlagent`` command line. Wiring only: parse, call an application use case, print.

Exit codes (stable, documented in README): 0 ok, 1 internal error, 2 usage or bad input,
3 conflict, 4 not found, 5 unavailable, 6 ``run start --wait``: the Run did not succeed.
Every read command takes ``--json``. Secret values are never printed.
"""

from __future__ import annotations

import os
import sys
from types import SimpleNamespace
from typing import TYPE_CHECKING

import msgspec

from ..core import errors as E
from ..core.limits import MAX_TIMEOUT_S as MAX_WAIT_S     # --timeout/--exit-after: seconds
from ..core.states import RunState

if TYPE_CHECKING:
    import argparse


def _print_json(obj) -> None:
    sys.stdout.buffer.write(msgspec.json.format(msgspec.json.encode(obj), indent=2) + b"\n")
    sys.stdout.flush()


def _fmt_us(us: int | None) -> str:
    if us is None:
        return "-"
    import datetime as dt
    return dt.datetime.fromtimestamp(us / 1e6, dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _or_dash(v) -> str:
    return "-" if v is None else str(v)


def _table(rows: list[list[str]], header: list[str]) -> None:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    for r in [header, *rows]:
        print("  ".join(str(x).ljust(w) for x, w in zip(r, widths)).rstrip())


# Only the commands that define things in a Project may create it, and only with their own
# write (store ``create_project="on_write"``: a refused command leaves none). Every other
# command acts on what a Project holds: a mistyped --project is "not found", never a new tenant.
CREATING_COMMANDS = {("task", "add"), ("import", "qinglong"), ("secret", "set"), ("token", "create"),
                     ("role", "set")}


# The commands that act on the store of Tasks, Runs, Secrets, tokens and roles. A fleet Worker
# (``[worker]``) has none: its Tasks, Runs and Secrets live on the control plane, so these are
# refused on it (exit 2) before anything is opened or written (``refuse_on_worker``).
LOCAL_STORE_COMMANDS = frozenset({"task", "secret", "run", "token", "role", "import"})


def refuse_on_worker(settings, command: str, sub: str | None) -> None:
    """ValidationError ``worker_mode`` (exit 2, field ``worker``) for a local-store command
    (``LOCAL_STORE_COMMANDS``) under a ``[worker]`` configuration: without it ``task add`` or
    ``run start`` would write to a store the Worker never reads (a Run queued for ever)."""
    w = settings.config.worker
    if w is None or command not in LOCAL_STORE_COMMANDS:
        return
    urls = w.urls
    what = f"{command} {sub}" if sub else command
    err = E.ValidationError("worker", f"this agent is a fleet Worker ([worker] in {settings.config_path}): "
                            f"`qlagent {what}` acts on a local store it never uses; run it on the control plane "
                            f"({', '.join(urls)}), on a replica with [cluster]")
    err.code = "worker_mode"
    raise err


class Ctx:
    """Lazily opened settings and store for one CLI invocation."""

    def __init__(self, args) -> None:
        self.args = args
        self._store = None
        if getattr(args, "writes_config", False):   # `worker join` makes the config the others read
            self.settings = None
            return
        from ..service.config import resolve
        # Every command but doctor (which lists them) refuses paths another user could write.
        # `config check --as-user U`: as the agent running as U would (the OpenWrt converter
        # runs as root for an agent that runs as user qlagent and owns its state_dir).
        trust_uid = None
        if getattr(args, "as_user", None):
            import pwd
            try:
                trust_uid = pwd.getpwnam(args.as_user).pw_uid
            except KeyError:
                raise E.ValidationError("--as-user", f"no user {args.as_user!r}") from None
        self.settings = resolve(args.config, state_dir=args.state_dir, profile=args.profile,
                                trust=args.command != "doctor", trust_uid=trust_uid)
        refuse_on_worker(self.settings, args.command, getattr(args, "sub", None))

    @property
    def store(self):
        if self._store is None:
            if (self.settings.config.cluster is None and not os.path.exists(self.settings.db_path)
                    and self.args.command != "init"):
                raise E.UnavailableError(f"no store at {self.settings.db_path}; run `qlagent init` first",
                                         code="not_initialised")
            from .. import bootstrap
            a = self.args
            if a.command in ("workers", "status"):   # the cluster's, not a Project's: --project is not used
                self._store = bootstrap.open_cluster_store(self.settings)
                return self._store
            # (a dry run rolls its transaction back, and with it the Project it would create)
            creates = ((a.command, getattr(a, "sub", None)) in CREATING_COMMANDS
                       and getattr(a, "role", None) != "none")
            # init creates the configured Project at once: a fresh store is ready for every command
            create = True if a.command == "init" else "on_write" if creates else False
            self._store = bootstrap.open_store(self.settings, a.project, migrate=a.command == "init",
                                               create_project=create)
        return self._store

    def close(self) -> None:
        if self._store is not None:
            self._store.close()

    def poke_service(self) -> None:
        """Tell a running service that the queue changed, so a new Run starts at once."""
        from ..service.control import poke
        poke(self.settings.control_socket)


def _load_toml(path: str) -> dict:
    from ..service.tomlfile import read_toml
    from ..core.limits import MAX_TASK_FILE_BYTES
    return read_toml(path, "file", MAX_TASK_FILE_BYTES)


# ---- commands --------------------------------------------------------------------------------

def _redacted(url: str) -> str:
    """A libpq URL without its password (``user:***@``), for printing."""
    import re
    return re.sub(r"://([^:/@]*):[^@/]*@", r"://\1:***@", url)


def cmd_init(ctx: Ctx) -> int:
    from ..bootstrap import create_key_file, migrate_legacy_secrets
    s = ctx.settings
    if s.config.worker is not None:
        return _init_worker(ctx)
    os.makedirs(s.state_dir, mode=0o700, exist_ok=True)
    store = ctx.store
    created = create_key_file(s.key_file)
    database = s.db_path if s.config.cluster is None else _redacted(s.config.cluster.database)
    # Secrets an earlier version stored (AES-GCM) are re-encrypted here, in a short-lived
    # process, so the service never loads `cryptography` for them. A row that cannot be read
    # stays as it was; init itself has succeeded (the package's postinst must not fail on it).
    migrated, problems = migrate_legacy_secrets(s, store)
    for problem in problems:
        print(f"qlagent: warning: {problem}", file=sys.stderr)
    if ctx.args.json:
        _print_json({"stateDir": s.state_dir, "database": database, "keyFile": s.key_file,
                     "keyCreated": created, "migrationsApplied": store.applied, "profile": s.profile.name,
                     "secretsReencrypted": migrated})
    else:
        print(f"state directory  {s.state_dir}")
        print(f"database         {database} ({len(store.applied)} migrations applied)")
        print(f"secret key file  {s.key_file} ({'created' if created else 'kept'})")
        if migrated:
            print(f"secrets          {migrated} re-encrypted from the AES-GCM format")
        print(f"profile          {s.profile.name}")
    return 0


def _init_worker(ctx: Ctx) -> int:
    """``init`` of a fleet Worker: its state directory (0700, as ``serve`` makes it) and nothing
    else: no database, no key file (the Worker's Tasks, Runs and Secrets live on the control
    plane; ``serve`` creates its inbox). Exit 0, so the package's postinst passes."""
    s, w = ctx.settings, ctx.settings.config.worker
    urls = w.urls
    created = not os.path.isdir(s.state_dir)
    os.makedirs(s.state_dir, mode=0o700, exist_ok=True)
    if ctx.args.json:
        _print_json({"stateDir": s.state_dir, "stateDirCreated": created, "database": None, "keyFile": None,
                     "keyCreated": False, "migrationsApplied": [], "profile": s.profile.name,
                     "secretsReencrypted": 0, "role": "worker", "workerId": w.worker_id, "controlUrls": urls})
    else:
        print(f"state directory  {s.state_dir} ({'created' if created else 'kept'})")
        print(f"fleet Worker     {w.worker_id} of {', '.join(urls)}")
        print("local store      none: tasks, runs and secrets live on the control plane (no database, "
              "no key file)")
        print(f"profile          {s.profile.name}")
        print("next             `qlagent doctor` checks the credential, the CA and the control plane; "
              "`qlagent serve` runs the Worker")
    return 0


def cmd_doctor(ctx: Ctx) -> int:
    from ..service.doctor import run_checks
    checks = run_checks(ctx.settings)
    bad = [c for c in checks if not c["ok"]]
    if ctx.args.json:
        _print_json({"ok": not bad, "checks": checks})
    else:
        for c in checks:
            print(f"{'ok  ' if c['ok'] else 'FAIL'}  {c['name']:<14} {c['detail']}")
    return E.EXIT_UNAVAILABLE if bad else 0


def cmd_config_check(ctx: Ctx) -> int:
    """Loading the configuration validated its values; then the checks ``serve`` makes before it
    opens a database (``service.preflight``: pool size, TLS files, the Worker's CA file), so an
    ExecReload or OpenWrt conversion that passes is not refused by the next start for them."""
    from ..service.preflight import preflight
    s = ctx.settings
    preflight(s)
    certificates = _certificate_expiries(s)
    out = {"configFile": s.config_path, "profile": s.profile.name, "stateDir": s.state_dir,
           "artifactDir": s.artifact_dir, "config": msgspec.to_builtins(s.config), "certificates": certificates}
    for c in certificates:
        if not c["ok"]:
            print(f"qlagent: warning: {c['field']}: {c['file']} {c['detail']}; renew it "
                  "(`qlagent tls cert create`, `qlagent tls ca create`)", file=sys.stderr)
    if ctx.args.json:
        _print_json(out)
    else:
        print(f"config ok: {s.config_path or '(defaults, no file)'}; profile {s.profile.name}; state {s.state_dir}")
    return 0


def _certificate_expiries(s) -> list[dict]:
    """``config check``'s certificate lines: {field, file, notAfter, ok, detail} each
    (``bootstrap.certificate_expiries``; ok is False from 30 days before the end)."""
    import time

    from ..bootstrap import certificate_expiries
    from ..core.certexpiry import expiry_note
    out = []
    for field, path, end in certificate_expiries(s):
        good, detail = expiry_note(end, int(time.time()))
        out.append({"field": field, "file": path, "notAfter": _fmt_us(end * 1_000_000), "ok": good,
                    "detail": detail})
    return out


def _next_fires(head, count: int) -> list[int]:
    from ..application.schedules import upcoming
    return upcoming(head.definition, count) if head.enabled else []


def _head_json(ctx: Ctx, h) -> dict:
    """The shared Task head shape (application.presenter) plus the full ``definition``."""
    from ..application import presenter
    d = presenter.task_head(h, ctx.store.now_us())
    d["definition"] = presenter.definition(h.definition)
    return d


def cmd_task_add(ctx: Ctx) -> int:
    from ..application.definitions import DefinitionWriter
    prepared = DefinitionWriter.prepare_file(_load_toml(ctx.args.file))
    _check_lease_fit(ctx, prepared)
    _check_memory_max(ctx, prepared)
    heads = DefinitionWriter(ctx.store).add(prepared)
    ctx.poke_service()
    if ctx.args.json:
        from ..application import presenter
        _print_json(presenter.page([_head_json(ctx, h) for h in heads]))
    else:
        for h in heads:
            print(f"added {h.name} revision {h.revision} {h.content_digest}")
    _warn_missing_secrets(ctx, {h.name for h in heads})
    return 0


def _check_lease_fit(ctx: Ctx, prepared) -> None:
    """Against a ``[cluster]`` config, refuse (exit 2, nothing written) a Task whose ``grace_s``
    the config's ``lease_ttl_s`` cannot hold: its fleet Worker would stop it right after it
    starts (core.leasefit)."""
    from ..core.definitions import DEFAULT_GRACE_S
    from ..core.leasefit import check_grace
    c = ctx.settings.config.cluster
    if c is not None:
        for i, p in enumerate(prepared):
            check_grace(f"task[{i}].grace_s", p.definition.grace_ms, c.lease_ttl_s, DEFAULT_GRACE_S * 1000)


def _check_memory_max(ctx: Ctx, prepared) -> None:
    """Refuse (exit 2, nothing written) a Task whose ``memory_max`` is over the share for runs of
    the Profile in force (core.profiles.run_memory_share)."""
    from ..core.definitions import check_memory_max
    for i, p in enumerate(prepared):
        check_memory_max(f"task[{i}].memory_max", p.definition.execution.memory_max, ctx.settings.profile)


def _warn_missing_secrets(ctx: Ctx, names: set[str]) -> None:
    """A Task whose Secret is not stored yet is accepted (set it next), but said so on stderr."""
    from ..application.secrets import SecretService
    from ..bootstrap import cipher_factory
    for task, secret in SecretService(ctx.store, cipher_factory(ctx.settings.key_file)).missing():
        if task in names:
            print(f"qlagent: warning: task {task} uses secret {secret!r}, which is not set; its runs fail "
                  f"secret_missing:{secret} until `qlagent secret set {secret}`", file=sys.stderr)


def cmd_task_edit(ctx: Ctx) -> int:
    from ..application.definitions import DefinitionWriter, check_fence
    check_fence(ctx.args.expect_revision, ctx.args.expect_digest, revision_field="--expect-revision",
                digest_field="--expect-digest")
    prepared = DefinitionWriter.prepare_file(_load_toml(ctx.args.file))
    if len(prepared) != 1:
        raise E.ValidationError("task", f"`task edit` takes a file with exactly one [[task]], got {len(prepared)}")
    _check_lease_fit(ctx, prepared)
    _check_memory_max(ctx, prepared)
    h = DefinitionWriter(ctx.store).edit(ctx.args.name, ctx.args.expect_revision, ctx.args.expect_digest,
                                         prepared[0])
    ctx.poke_service()
    if ctx.args.json:
        _print_json(_head_json(ctx, h))
    else:
        print(f"{h.name} now at revision {h.revision} {h.content_digest}")
    _warn_missing_secrets(ctx, {h.name})
    return 0


def cmd_task_ls(ctx: Ctx) -> int:
    heads = ctx.store.list_heads(ctx.store.project.project_id)
    if ctx.args.json:
        from ..application import presenter
        _print_json(presenter.page([_head_json(ctx, h) for h in heads]))
        return 0
    rows = []
    for h in heads:
        nf = _next_fires(h, 1)
        rows.append([h.name, str(h.revision), h.content_digest[:12], "yes" if h.enabled else "no",
                     " | ".join(h.definition.schedules), _fmt_us(nf[0]) if nf else "-"])
    _table(rows, ["NAME", "REV", "DIGEST", "ENABLED", "SCHEDULE", "NEXT"])
    return 0


def cmd_task_show(ctx: Ctx) -> int:
    h = ctx.store.get_head(ctx.store.project.project_id, ctx.args.name)
    skipped = ctx.store.skipped_fires(h.task_id)
    d = _head_json(ctx, h)
    d["skippedFires"] = skipped
    recipe = ctx.store.get_recipe(h.definition.recipe_ref)
    d["env"], d["secrets"] = recipe.public, recipe.secret_refs     # Secret names only, never values
    if ctx.args.json:
        _print_json(d)
        return 0
    df = h.definition
    ex = df.execution
    print(f"name          {h.name}  ({h.task_id})")
    print(f"revision      {h.revision}")
    print(f"digest        {h.content_digest}")
    print(f"enabled       {'yes' if h.enabled else 'no'}")
    print(f"schedules     {' | '.join(df.schedules)}  (timezone {df.timezone or 'system'})")
    print(f"next fires    {', '.join(_fmt_us(u) for u in _next_fires(h, 3)) or '-'}")
    print(f"command       {' '.join(ex.argv) if ex.kind == 'local_process' else ex.shell + ' -c <script>'}")
    print(f"process       cwd {ex.cwd or '$HOME'}; umask {ex.umask or 'of the service'}; leftovers "
          f"{'kept (keep_orphans)' if ex.keep_orphans else 'stopped at exit'}")
    if ex.on_lease_loss is not None:
        print(f"lease loss    {ex.on_lease_loss} (on a fleet Worker that cannot renew the Run Lease)")
    print(f"timeout       {df.timeout_ms / 1000:g} s (grace {df.grace_ms / 1000:g} s); concurrency {df.concurrency}; "
          f"retry {df.retry.max_attempts}x")
    print(f"network       {df.network.require}{':' + df.network.interface if df.network.interface else ''}")
    print(f"recipe        {df.recipe_ref}")
    for k, v in recipe.public.items():
        print(f"env           {k}={v}")
    for k, v in recipe.secret_refs.items():
        print(f"secret        {k} <- secret {v}")
    if df.catch_up != "latest" or df.catch_up_within_ms is not None:
        print(f"catch up      {df.catch_up}" + (f" within {df.catch_up_within_ms / 1000:g} s"
                                                 if df.catch_up_within_ms is not None else ""))
    print(f"skipped fires {skipped}")
    return 0


def cmd_task_enable(ctx: Ctx, enabled: bool) -> int:
    from ..application.definitions import DefinitionWriter
    h, n = DefinitionWriter(ctx.store).set_enabled(ctx.args.name, enabled)
    ctx.poke_service()
    print(f"{h.name} {'enabled' if enabled else 'disabled'}" + (f"; {n} queued run(s) cancelled" if n else ""))
    return 0


def cmd_task_rm(ctx: Ctx) -> int:
    from ..application.definitions import DefinitionWriter
    h, n, live = DefinitionWriter(ctx.store).remove(ctx.args.name)
    ctx.poke_service()
    print(f"{h.name} removed" + (f"; {n} queued run(s) cancelled" if n else "")
          + (f"; {live} running run(s) asked to stop" if live else ""))
    return 0


def cmd_secret_set(ctx: Ctx) -> int:
    from ..application.secrets import SecretService
    from ..bootstrap import cipher_factory
    from ..core.definitions import check_secret_name
    from ..core.limits import MAX_SECRET_VALUE
    if ctx.args.stray:
        raise E.ValidationError("value", "give the secret on stdin (`qlagent secret set NAME < file`), never as an "
                                "argument: command lines are visible to every user")
    name = check_secret_name(ctx.args.name)
    if sys.stdin.isatty():
        import getpass       # termios: only for an interactive `secret set`
        value = getpass.getpass(f"value for {name}: ").encode()
    else:
        value = sys.stdin.buffer.read(MAX_SECRET_VALUE + 2)
        # `echo token |` adds one newline (a file from Windows, CRLF): not part of the secret.
        for end in (b"\r\n", b"\n"):
            if value.endswith(end):
                value = value[:-len(end)]
                break
    if len(value) > MAX_SECRET_VALUE:
        raise E.ValidationError("value", f"longer than {MAX_SECRET_VALUE} bytes", limit=MAX_SECRET_VALUE)
    if not value:
        raise E.ValidationError("value", "is empty")
    if b"\x00" in value:
        raise E.ValidationError("value", "contains a NUL byte", limit="no NUL")
    SecretService(ctx.store, cipher_factory(ctx.settings.key_file)).set(name, value)
    print(f"secret {name} stored ({len(value)} bytes, encrypted)")
    return 0


def cmd_secret_ls(ctx: Ctx) -> int:
    from ..application.secrets import SecretService
    from ..bootstrap import cipher_factory
    names = SecretService(ctx.store, cipher_factory(ctx.settings.key_file)).names()
    if ctx.args.json:
        from ..application import presenter
        _print_json(presenter.page([presenter.secret(n, u) for n, u in names]))
    else:
        _table([[n, _fmt_us(u)] for n, u in names], ["NAME", "UPDATED"])
    return 0


def cmd_secret_rm(ctx: Ctx) -> int:
    from ..application.secrets import SecretService
    from ..bootstrap import cipher_factory
    users = SecretService(ctx.store, cipher_factory(ctx.settings.key_file)).remove(ctx.args.name,
                                                                                   force=ctx.args.force)
    print(f"secret {ctx.args.name} removed")
    if users:
        print(f"qlagent: warning: task(s) {', '.join(users)} still use secret {ctx.args.name!r}; their runs fail "
              f"secret_missing:{ctx.args.name}", file=sys.stderr)
    return 0


def _run_json(run, attempts=None, events=None) -> dict:
    """The shared Run shape (application.presenter); ``run show`` adds every Attempt and RunEvent."""
    from ..application import presenter
    d = presenter.run(run, attempts[-1] if attempts else None)
    if attempts is not None:
        d["attempts"] = [presenter.attempt(a) for a in attempts]
    if events is not None:
        d["events"] = [presenter.event(e) for e in events]
    return d


def cmd_run_start(ctx: Ctx) -> int:
    from ..application.runs import RunService
    t = ctx.args.timeout
    if t is not None and not (0 < t <= MAX_WAIT_S):      # also refuses nan and inf
        raise E.ValidationError("--timeout", f"{t!r} is outside 0 < seconds ≤ {MAX_WAIT_S}", limit=f"0..{MAX_WAIT_S}")
    if t is not None and not ctx.args.wait:
        raise E.ValidationError("--timeout", "only with --wait")
    created = RunService(ctx.store).start(ctx.args.task)
    ctx.poke_service()
    if not ctx.args.wait:
        if ctx.args.json:
            from ..application import presenter
            _print_json(presenter.created_run(created))
        else:
            print(created.run_id)
        return 0
    from .wait import wait_for_run
    run = wait_for_run(ctx.settings, ctx.store, created.run_id, ctx.args.timeout)
    if ctx.args.json:
        _print_json(_run_json(run))
    else:
        print(f"{run.run_id} {run.state}" + (f" exit={run.exit_code}" if run.exit_code is not None else "")
              + (f" signal={run.exit_signal}" if run.exit_signal is not None else ""))
    return 0 if run.state == "succeeded" else E.EXIT_RUN_FAILED


def cmd_run_ls(ctx: Ctx) -> int:
    from ..application.runs import RunService
    runs, nxt = RunService(ctx.store).list(task=ctx.args.task, state=ctx.args.state, limit=ctx.args.limit,
                                           cursor=ctx.args.cursor)
    if ctx.args.json:
        from ..application import presenter
        _print_json(presenter.page([_run_json(r) for r in runs], nxt, pages=True))
        return 0
    _table([[r.run_id, r.task_name, r.state, r.trigger_type, _fmt_us(r.created_at_us),
             str(r.exit_code) if r.exit_code is not None else f"sig{r.exit_signal}" if r.exit_signal else "-"]
            for r in runs],
           ["RUN", "TASK", "STATE", "TRIGGER", "CREATED", "EXIT"])
    if nxt:
        print(f"(more: --cursor {nxt})")
    return 0


def cmd_run_show(ctx: Ctx) -> int:
    from ..application.runs import RunService
    svc = RunService(ctx.store)
    run = svc.get(ctx.args.run)
    attempts, events = svc.attempts(run.run_id), svc.events(run.run_id)
    if ctx.args.json:
        _print_json(_run_json(run, attempts, events))
        return 0
    print(f"run       {run.run_id}")
    print(f"task      {run.task_name} ({run.task_snapshot_ref})")
    print(f"state     {run.state}" + (f" exit={run.exit_code}" if run.exit_code is not None else "")
          + (f" signal={run.exit_signal}" if run.exit_signal is not None else ""))
    if run.held and run.state == "queued":
        print('waiting   for the live Run of this Task to end (concurrency = "single")')
    if run.state == RunState.QUEUED and ctx.settings.config.cluster is None:
        from ..service.config import state_space_problem
        problem = state_space_problem(ctx.settings.state_dir)
        if problem:
            print(f"waiting   no Run starts: {problem}")
    print(f"trigger   {run.trigger_type} by {run.requested_by}; created {_fmt_us(run.created_at_us)}")
    for a in attempts:
        figures = "" if a.ended_at_us is None else (
            f" kept={_or_dash(a.bytes_kept)} dropped={_or_dash(a.bytes_dropped)}{' TRUNCATED' if a.truncated else ''}"
            f" peak_rss={_or_dash(a.peak_rss_bytes)} cpu_us={_or_dash(a.cpu_time_us)}"
            + (f" orphans_stopped={a.orphans_stopped}" if a.orphans_stopped else ""))
        print(f"attempt   #{a.attempt_no} {a.state}{figures or ' (figures when it ends)'}"
              + (f" reason={a.failure_reason}" if a.failure_reason else ""))
        if a.start_error:
            print(f"          could not start: {a.start_error}")
    for e in events:
        print(f"event     {e.sequence:>3} {_fmt_us(e.created_at_us)} {e.type} {msgspec.json.encode(e.payload).decode()}")
    return 0


def cmd_run_logs(ctx: Ctx) -> int:
    from ..application.runs import MAX_LOG_OFFSET, MAX_LOG_READ, RunService, log_page_json, read_log_range
    offset, remaining = ctx.args.offset, ctx.args.limit
    if not 0 <= offset <= MAX_LOG_OFFSET:
        raise E.ValidationError("--offset", f"{offset} is outside 0..{MAX_LOG_OFFSET} bytes", limit=f"0..{MAX_LOG_OFFSET}")
    if remaining is not None and not 1 <= remaining <= MAX_LOG_OFFSET:
        raise E.ValidationError("--limit", f"{remaining} is outside 1..{MAX_LOG_OFFSET} bytes (omit it to read to "
                                "the end)", limit=f"1..{MAX_LOG_OFFSET}")
    svc = RunService(ctx.store)
    run = svc.get(ctx.args.run)
    if ctx.settings.config.cluster is not None:
        return _cluster_logs(ctx, run.run_id, offset, remaining)
    path, fact = svc.log_source(run.run_id)
    if ctx.args.json:
        _print_json(log_page_json(run.run_id, path, fact, offset, min(remaining or MAX_LOG_READ, MAX_LOG_READ)))
        return 0
    out = sys.stdout.buffer
    while remaining is None or remaining > 0:
        chunk, size = read_log_range(path, offset, min(MAX_LOG_READ, remaining or MAX_LOG_READ))
        if not chunk:
            break
        out.write(chunk)
        offset += len(chunk)
        if remaining is not None:
            remaining -= len(chunk)
    out.flush()
    if fact:      # stdout stays the log's bytes; the truncation fact goes to stderr, always
        print(f"qlagent: note: log truncated at {fact.quota_bytes} bytes; {fact.bytes_dropped} bytes dropped",
              file=sys.stderr)
    return 0


def _cluster_logs(ctx: Ctx, run_id: str, offset: int, remaining: int | None) -> int:
    """``run logs`` on the cluster authority: the chunks the Worker uploaded, from PostgreSQL."""
    from .. import bootstrap
    from ..application.runs import MAX_LOG_READ, log_page
    reader = bootstrap.log_chunks(ctx.store)
    if ctx.args.json:
        chunk, size, fact = reader.read_range(run_id, offset, min(remaining or MAX_LOG_READ, MAX_LOG_READ))
        _print_json(log_page(run_id, chunk, size, offset, fact))
        return 0
    out, fact = sys.stdout.buffer, None
    while remaining is None or remaining > 0:
        chunk, _, fact = reader.read_range(run_id, offset, min(MAX_LOG_READ, remaining or MAX_LOG_READ))
        if not chunk:
            break
        out.write(chunk)
        offset += len(chunk)
        if remaining is not None:
            remaining -= len(chunk)
    out.flush()
    if fact:
        print(f"qlagent: note: log truncated at {fact.quota_bytes} bytes; {_or_dash(fact.bytes_dropped)} bytes "
              "dropped", file=sys.stderr)
    return 0


def cmd_run_cancel(ctx: Ctx) -> int:
    from ..application.cancel import request_cancel
    from ..application.runs import RunService
    from ..core.states import RUN_TERMINAL
    before = RunService(ctx.store).get(ctx.args.run)
    if before.state in RUN_TERMINAL:
        raise E.ConflictError(f"run {before.run_id} had already ended ({before.state}); nothing to cancel",
                              code="run_ended")
    run = request_cancel(ctx.store, before.run_id, "local:cli")
    ctx.poke_service()
    print(f"{run.run_id} {run.state}" + (" (cancel requested)" if run.state not in RUN_TERMINAL else ""))
    return 0


def cmd_token_create(ctx: Ctx) -> int:
    from ..application.tokens import create_token
    token, token_id = create_token(ctx.store, ctx.args.project or ctx.settings.config.project, ctx.args.subject,
                                   ctx.args.role)
    print(token)                    # alone on stdout: `TOKEN=$(qlagent token create …)`
    print(f"token id {token_id} (for `qlagent token revoke`); the token is not shown again", file=sys.stderr)
    return 0


def cmd_token_ls(ctx: Ctx) -> int:
    from ..application.tokens import list_tokens
    rows = list_tokens(ctx.store)
    if ctx.args.json:
        from ..application import presenter
        _print_json(presenter.page([presenter.token(r) for r in rows]))
    else:
        _table([[r.token_id, r.subject, _fmt_us(r.created_at_us), _fmt_us(r.revoked_at_us)] for r in rows],
               ["TOKEN ID", "SUBJECT", "CREATED", "REVOKED"])
    return 0


def cmd_token_revoke(ctx: Ctx) -> int:
    from ..application.tokens import revoke_token
    revoke_token(ctx.store, ctx.args.token_id)
    print(f"token {ctx.args.token_id} revoked")
    return 0


def cmd_role_set(ctx: Ctx) -> int:
    from ..application.tokens import set_role
    v = set_role(ctx.store, ctx.args.subject, None if ctx.args.role == "none" else ctx.args.role)
    print(f"{ctx.args.subject}: {ctx.args.role} (bindingVersion {v})")
    return 0


def _registry(ctx: Ctx):
    """The cluster's Worker registry; ``workers`` needs ``[cluster]`` (exit 2 otherwise)."""
    if ctx.settings.config.cluster is None:
        raise E.ValidationError("cluster", "`qlagent workers` acts on the cluster authority; the configuration "
                                           "has no [cluster] table")
    from .. import bootstrap
    return bootstrap.worker_registry(ctx.settings, ctx.store)


def _labels(pairs: list[str]) -> dict[str, str]:
    out: dict[str, str] = {}
    for pair in pairs:
        key, eq, value = pair.partition("=")
        if not eq or not key:
            raise E.ValidationError("--label", f"{pair!r} is not KEY=VALUE")
        if key in out:
            raise E.ValidationError("--label", f"{key!r} is given twice")
        out[key] = value
    return out


def cmd_workers_enroll(ctx: Ctx) -> int:
    a = ctx.args
    labels = _labels(a.label or [])
    material = None
    if a.join_token:                    # checked before the Worker is enrolled
        from .join import join_material
        material = join_material(ctx)
    worker_id, credential = _registry(ctx).enroll(a.name, labels, tuple(a.executor or ["local_process"]), a.slots,
                                                  tuple(a.worker_projects or ()))
    if material is not None:
        from .join import join_token
        token = join_token(ctx, worker_id, credential, material)
        if a.json:
            _print_json({"workerId": worker_id, "name": a.name, "joinToken": token})
        else:
            print(token)
            print(f"qlagent: Worker {a.name} {worker_id} enrolled; the join token above is shown once and carries its "
                  f"credential: on the router run `qlagent worker join TOKEN`", file=sys.stderr)
        return 0
    if a.json:
        _print_json({"workerId": worker_id, "name": a.name, "credential": credential})
    else:
        print(f"worker      {a.name} {worker_id}")
        print(f"credential  {credential}")
        print("qlagent: the credential is shown once (only its SHA-256 is stored); give it to the Worker",
              file=sys.stderr)
    return 0


def cmd_workers_ls(ctx: Ctx) -> int:
    registry, rows, after = _registry(ctx), [], None
    while True:
        page = registry.list(64, after)
        rows += page
        if len(page) < 64:
            break
        after = page[-1]["name"]
    if ctx.args.json:
        from ..application import presenter
        _print_json(presenter.page([presenter.worker(r) for r in rows]))
        return 0
    _table([[r["name"], r["worker_id"], r["state"], str(r["generation"]), _or_dash(r["session_id"]),
             _fmt_us(r["last_heartbeat_us"]), str(max(0, r["free_slots"])), str(r["slots"]),
             ",".join(f"{k}={v}" for k, v in sorted(r["labels"].items())) or "-"] for r in rows],
           ["NAME", "WORKER", "STATE", "GEN", "SESSION", "HEARTBEAT", "FREE", "SLOTS", "LABELS"])
    return 0


_WORKER_VERBS = {"drain": "draining", "resume": "active", "rm": "removed"}


def cmd_workers_state(ctx: Ctx, verb: str) -> int:
    """``workers drain|resume|rm NAME``: the Worker's new state (``--json``: name, workerId, state)."""
    registry = _registry(ctx)
    act = {"drain": registry.drain, "resume": registry.resume, "rm": registry.remove}[verb]
    worker_id, state = act(ctx.args.name), _WORKER_VERBS[verb]
    if ctx.args.json:
        _print_json({"name": ctx.args.name, "workerId": worker_id, "state": state})
    else:
        print(f"{ctx.args.name} {worker_id} {state}")
    return 0


def cmd_import_qinglong(ctx: Ctx) -> int:
    from ..application.qinglong_import import apply_import, read_and_plan
    from ..bootstrap import cipher_factory, panel_source
    a = ctx.args
    # The 2.x side is read (and every refusal raised) before our store is even opened.
    panel, plan = read_and_plan(panel_source(), a.path, scripts_dir=a.scripts_dir, prefix=a.prefix,
                                env_scope=a.env_scope)
    report = apply_import(ctx.store, cipher_factory(ctx.settings.key_file), panel, plan, env_scope=a.env_scope,
                          dry_run=a.dry_run, prefix=a.prefix)
    if not a.dry_run:
        ctx.poke_service()
    if a.json:
        _print_json(report)
        return 0
    print(f"{'dry run, nothing written: ' if a.dry_run else ''}{len(report.tasks)} cron(s) imported from "
          f"{report.database} (scripts {report.scripts_dir})")
    for t in report.tasks:
        print(f"  {t.action:<9} {t.task} rev {t.revision}{'' if t.enabled else ' (disabled)'}  <- cron {t.cron_id} "
              f"{t.cron_name!r}" + "".join(f"; {n}" for n in t.notes))
    if report.skipped:
        print(f"{len(report.skipped)} cron(s) skipped:")
        for k in report.skipped:
            print(f"  cron {k.cron_id} {k.cron_name!r}: {k.reason}")
    if report.renamed:
        print(f"{len(report.renamed)} renamed:")
        for r in report.renamed:
            print(f"  cron {r.cron_id} {r.cron_name!r} -> {r.task}")
    scope = "referenced by every imported task" if a.env_scope == "all" else "not referenced (--env-scope none)"
    print(f"{len(report.secrets)} Secret(s), {scope}:")
    for s in report.secrets:
        print(f"  {s.action:<9} {s.secret} -> ${s.env} ({s.bytes} bytes, {s.parts} part(s) from {s.source})")
    for v in report.skipped_variables:
        where = f"config.sh line {v.line}" if v.line else v.source
        print(f"  not imported: {v.name} ({where}): {v.reason}")
    return 0


def cmd_serve(ctx: Ctx) -> int:
    from ..service.config import parse_listen
    if ctx.args.listen:
        parse_listen(ctx.args.listen, field="--listen")
    if ctx.args.exit_after is not None and not (0 <= ctx.args.exit_after <= MAX_WAIT_S):
        raise E.ValidationError("--exit-after", f"{ctx.args.exit_after!r} is outside 0..{MAX_WAIT_S} seconds",
                                limit=f"0..{MAX_WAIT_S}")
    if ctx.settings.config.worker is not None:        # a fleet Worker: nothing local is scheduled
        from ..service.worker_mode import serve_worker
        return serve_worker(ctx.settings, ctx.args.listen, ctx.args.exit_after)
    from ..service.main import serve
    return serve(ctx.settings, ctx.args)


# ---- parser ----------------------------------------------------------------------------------

class _UsageError(Exception):
    """argparse's refusal, answered by main() like every other one (exit 2)."""


def _ascii_decimal(text: str, fraction: bool = False) -> bool:
    """``text`` is ASCII decimal digits, optionally after a '-' (the range check then names the
    limit) and, with ``fraction``, with one '.': what the HTTP query parser takes. int() and
    float() alone would also take Arabic-Indic or fullwidth digits, ``1_0`` (= 10), blanks and,
    for float, ``1e3``, ``nan``, ``inf``."""
    body = text[1:] if text.startswith("-") else text
    whole, dot, frac = body.partition(".") if fraction else (body, "", "")
    return body.isascii() and (whole + frac).isdigit() and (whole.isdigit() or not whole) \
        and (frac.isdigit() or not dot)


def _ascii_int(text: str) -> int:
    """argparse type for integers (see _ascii_decimal); raises ArgumentTypeError (exit 2)."""
    if not _ascii_decimal(text):
        import argparse
        raise argparse.ArgumentTypeError(f"invalid integer {text!r}: ASCII decimal digits only")
    return int(text)


def _ascii_seconds(text: str) -> float:
    """argparse type for seconds (see _ascii_decimal); raises ArgumentTypeError (exit 2)."""
    if not _ascii_decimal(text, fraction=True):
        import argparse
        raise argparse.ArgumentTypeError(f"invalid seconds {text!r}: ASCII decimal digits only (e.g. 5 or 2.5)")
    return float(text)


def build_parser() -> argparse.ArgumentParser:
    import argparse     # not for `serve` (see _serve_args)

    class _Parser(argparse.ArgumentParser):
        """argparse with the CLI's one-line refusal (no usage block): exit 2 naming the argument."""

        def error(self, message: str):
            raise _UsageError(f"{message} (see `{self.prog} --help`)")

    def options(project: bool) -> _Parser:
        out = _Parser(add_help=False)
        out.add_argument("--state-dir", default=argparse.SUPPRESS, help="state directory (env QLAGENT_STATE_DIR)")
        out.add_argument("--config", default=argparse.SUPPRESS, help="config file (env QLAGENT_CONFIG)")
        out.add_argument("--profile", default=argparse.SUPPRESS, choices=["edge", "standalone"])
        if project:
            out.add_argument("--project", default=argparse.SUPPRESS, help="Project name (default: 'default')")
        out.add_argument("--json", action="store_true", default=argparse.SUPPRESS, help="machine-readable output")
        return out

    common = options(project=True)

    p = _Parser(prog="qlagent", parents=[common],
                description="Schedule and run tasks on routers and edge boxes.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(parent, name, fn, help_, **kw):
        sp = parent.add_parser(name, parents=[common], help=help_, **kw)
        sp.set_defaults(fn=fn)
        return sp

    add(sub, "init", cmd_init, "create the state directory, database and secret key file")
    add(sub, "doctor", cmd_doctor, "check schema, capability, integrity, key file and free space")
    cfg = sub.add_parser("config", help="configuration").add_subparsers(dest="sub", required=True, metavar="SUB")
    c = add(cfg, "check", cmd_config_check, "validate the config file and print the resolved settings")
    c.add_argument("--as-user", metavar="USER",
                   help="judge the paths the agent trusts as the agent running as USER would")

    task = sub.add_parser("task", help="task definitions").add_subparsers(dest="sub", required=True, metavar="SUB")
    a = add(task, "add", cmd_task_add, "add every [[task]] of a TOML file")
    a.add_argument("-f", "--file", required=True)
    add(task, "ls", cmd_task_ls, "list tasks")
    s = add(task, "show", cmd_task_show, "show a task's head, digest and next fire times")
    s.add_argument("name")
    e = add(task, "edit", cmd_task_edit, "fenced edit: appends revision+1")
    e.add_argument("name")
    e.add_argument("-f", "--file", required=True)
    e.add_argument("--expect-revision", type=_ascii_int, required=True, help="the head revision you read")
    e.add_argument("--expect-digest", required=True, help="the head contentDigest you read")
    for nm, fn in (("enable", lambda c: cmd_task_enable(c, True)), ("disable", lambda c: cmd_task_enable(c, False)),
                   ("rm", cmd_task_rm)):
        add(task, nm, fn, f"{nm} a task").add_argument("name")

    sec = sub.add_parser("secret", help="encrypted secrets").add_subparsers(dest="sub", required=True, metavar="SUB")
    ss = add(sec, "set", cmd_secret_set, "store a secret; the value is read from stdin, never argv")
    ss.add_argument("name")
    # Swallow stray words so argparse never echoes a value typed on the command line.
    ss.add_argument("stray", nargs=argparse.REMAINDER, metavar="value", help=argparse.SUPPRESS)
    add(sec, "ls", cmd_secret_ls, "list secret names (never values)")
    sr = add(sec, "rm", cmd_secret_rm, "remove a secret (refused while a task uses it, unless --force)")
    sr.add_argument("name")
    sr.add_argument("--force", action="store_true", help="remove it even if tasks use it")

    run = sub.add_parser("run", help="runs").add_subparsers(dest="sub", required=True, metavar="SUB")
    st = add(run, "start", cmd_run_start, "start a task now (Task Start semantics)")
    st.add_argument("task")
    st.add_argument("--wait", action="store_true", help="wait for the end; exit 6 unless it succeeded")
    st.add_argument("--timeout", type=_ascii_seconds, default=None, help="--wait at most this many seconds")
    ls = add(run, "ls", cmd_run_ls, "list runs, newest first")
    ls.add_argument("--task")
    ls.add_argument("--state")
    ls.add_argument("--limit", type=_ascii_int, default=50)
    ls.add_argument("--cursor")
    add(run, "show", cmd_run_show, "show a run, its attempts and events").add_argument("run")
    lg = add(run, "logs", cmd_run_logs, "print a run's log (bounded reads)")
    lg.add_argument("run")
    lg.add_argument("--offset", type=_ascii_int, default=0)
    lg.add_argument("--limit", type=_ascii_int, default=None)
    add(run, "cancel", cmd_run_cancel, "cancel a queued or running run").add_argument("run")

    tok = sub.add_parser("token", help="API bearer tokens").add_subparsers(dest="sub", required=True, metavar="SUB")
    tc = add(tok, "create", cmd_token_create, "create a token (printed once) and bind the subject's role")
    tc.add_argument("--subject", required=True)
    tc.add_argument("--role", required=True, choices=["owner", "admin", "operator", "viewer"])
    add(tok, "revoke", cmd_token_revoke, "revoke a token (by its ID, or the token itself)").add_argument("token_id")
    add(tok, "ls", cmd_token_ls, "list tokens of the project (IDs and subjects, never the tokens)")
    role = sub.add_parser("role", help="role bindings").add_subparsers(dest="sub", required=True, metavar="SUB")
    rs = add(role, "set", cmd_role_set, "bind a subject's role in the project ('none' revokes)")
    rs.add_argument("subject")
    rs.add_argument("role", choices=["owner", "admin", "operator", "viewer", "none"])

    wk = sub.add_parser("workers", help="cluster Workers ([cluster] only)").add_subparsers(dest="sub", required=True,
                                                                                        metavar="SUB")
    # Here --project scopes the Worker (repeatable), not the command: the common options but that one.
    we = wk.add_parser("enroll", parents=[options(project=False)], help="enroll a Worker; prints its credential once")
    we.set_defaults(fn=cmd_workers_enroll)
    we.add_argument("name")
    we.add_argument("--label", action="append", metavar="KEY=VALUE", help="a Placement label (repeatable)")
    we.add_argument("--executor", action="append", choices=["local_process"], help="executor type (repeatable)")
    we.add_argument("--slots", type=int, default=1, help="concurrent Attempts (1..256)")
    we.add_argument("--project", action="append", dest="worker_projects", metavar="PROJECT",
                    help="offer it only this Project's Runs (repeatable, ≤ 32; none: every Project)")
    from .join import add_token_options
    add_token_options(we)
    from .join import register_rotate
    register_rotate(wk, options(project=False))
    add(wk, "ls", cmd_workers_ls, "list Workers: state, generation, Session, last heartbeat, free slots")
    add(wk, "drain", lambda c: cmd_workers_state(c, "drain"), "no new offers to the Worker").add_argument("name")
    add(wk, "resume", lambda c: cmd_workers_state(c, "resume"), "undo a drain: offers to the Worker again"
        ).add_argument("name")
    add(wk, "rm", lambda c: cmd_workers_state(c, "rm"), "remove the Worker (its Leases are fenced)"
        ).add_argument("name")

    from . import join, status, tls
    tls.register(sub, common)
    join.register(sub, common)
    status.register(sub, common)

    imp = sub.add_parser("import", help="import from another scheduler").add_subparsers(dest="sub", required=True,
                                                                                        metavar="SUB")
    q = add(imp, "qinglong", cmd_import_qinglong, "import the crons and variables of a qinglong 2.x panel")
    q.add_argument("path", help="the 2.x data directory (holding db/database.sqlite) or the database file")
    q.add_argument("--dry-run", action="store_true", help="print the report, write nothing")
    q.add_argument("--prefix", default="", help="prepend P to every task name (and to Secret names after 'qinglong.')")
    q.add_argument("--scripts-dir", default=None, help="where the 2.x scripts are (default: PATH/scripts)")
    q.add_argument("--env-scope", default="all", choices=["all", "none"],
                   help="all: every task references every imported variable (as in 2.x); none: Secrets only")

    sv = add(sub, "serve", cmd_serve, "run the agent (systemd Type=notify service)")
    sv.add_argument("--listen", default=None, help="HTTP HOST:PORT (overrides http.listen)")
    sv.add_argument("--exit-after", type=_ascii_seconds, default=None, help="drain and exit after this many seconds")
    return p


# `qlagent serve` is parsed without argparse: the service keeps every module it imports for its
# lifetime, and argparse with gettext and the ~25 subcommand parsers cost it ~0.5 MiB RSS
# (bench/README.md). Only this exact grammar is taken here; anything else (help, an unknown or
# abbreviated option, a bad value) goes to build_parser(), which is the reference and reports
# it. tests/test_cli_serve_args.py checks that both agree.
_SERVE_VALUE_OPTIONS = {"--state-dir": "state_dir", "--config": "config", "--profile": "profile",
                        "--project": "project", "--listen": "listen", "--exit-after": "exit_after"}
_SERVE_ONLY = ("listen", "exit_after")         # options of the subcommand, not of `qlagent` itself


def _serve_args(argv: list[str]) -> SimpleNamespace | None:
    """The namespace build_parser() would give for a ``serve`` command line, or None."""
    args = dict.fromkeys(_SERVE_VALUE_OPTIONS.values())
    args["json"] = False
    command = False
    tokens = iter(argv)
    for tok in tokens:
        if tok == "serve" and not command:
            command = True
        elif tok == "--json":
            args["json"] = True
        else:
            name, eq, value = tok.partition("=")
            key = _SERVE_VALUE_OPTIONS.get(name)
            if key is None or (key in _SERVE_ONLY and not command):
                return None
            if not eq:
                value = next(tokens, None)
                if value is None or value.startswith("-"):
                    return None
            args[key] = value
    if not command or args["profile"] not in (None, "edge", "standalone"):
        return None
    if args["exit_after"] is not None:
        if not _ascii_decimal(args["exit_after"], fraction=True):
            return None
        args["exit_after"] = float(args["exit_after"])
    return SimpleNamespace(command="serve", fn=cmd_serve, **args)


# Arguments that are file-system paths: on POSIX a path is bytes, and one that is not UTF-8 is
# still a path the OS opens (Python keeps its bytes as lone surrogates), so it is not refused.
_PATH_ARGS = frozenset({"state_dir", "config", "file", "path", "scripts_dir", "dir", "ca", "ca_key",
                         "target_config", "target_state_dir"})


def _argument_names(parser: argparse.ArgumentParser | None, args) -> dict[str, str]:
    """dest → the name a refusal gives it (``--label``, ``name``) for the (sub)command parsed."""
    import argparse
    names: dict[str, str] = {}
    chosen = [getattr(args, "command", None), getattr(args, "sub", None)]
    while parser is not None:
        nested = None
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                nested = action.choices.get(chosen.pop(0)) if chosen else None
            elif action.option_strings:
                names[action.dest] = max(action.option_strings, key=len)
            else:
                names[action.dest] = action.metavar if isinstance(action.metavar, str) else action.dest
        parser = nested
    return names


def _refuse_undecodable(args, parser: argparse.ArgumentParser | None) -> None:
    """ValidationError (exit 2) naming the first str argument, or str in a list argument, that
    holds lone surrogates: bytes of argv that are not UTF-8 (PEP 383). Such a str reaches no
    store or output: every later encode would fail with a UnicodeEncodeError (exit 1)."""
    names = None
    for dest, value in vars(args).items():
        if dest in _PATH_ARGS:
            continue
        for item in value if isinstance(value, list) else [value]:
            if not isinstance(item, str):
                continue
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                names = _argument_names(parser, args) if names is None else names
                raise E.ValidationError(names.get(dest) or "--" + dest.replace("_", "-"),
                                        "is not valid UTF-8") from None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = None
    try:
        args = _serve_args(argv)
        if args is None:
            parser = build_parser()
            args = parser.parse_args(argv)
    except _UsageError as e:
        if "--json" in argv:
            sys.stdout.buffer.write(msgspec.json.encode({"error": {"code": "usage", "message": str(e)}}) + b"\n")
        print(f"qlagent: error: {e}", file=sys.stderr)
        return E.EXIT_USAGE
    for k in ("state_dir", "config", "profile", "project"):
        if not hasattr(args, k):
            setattr(args, k, None)
    if not hasattr(args, "json"):
        args.json = False
    ctx = None
    try:
        _refuse_undecodable(args, parser)      # before the config is read or a store opened
        ctx = Ctx(args)
        return args.fn(ctx)
    except E.QlError as e:
        if args.json:
            sys.stdout.buffer.write(msgspec.json.encode({"error": e.to_dict()}) + b"\n")
        msg = str(e)
        if e.limit is not None and str(e.limit) not in msg:     # every refusal names its limit
            msg += f" (limit {e.limit})"
        print(f"qlagent: error: {msg}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return 0
    except Exception as e:          # noqa: BLE001
        # A fault nobody anticipated still answers in one line (exit 1, internal), never a traceback.
        print(f"qlagent: internal error: {type(e).__name__}: {e}", file=sys.stderr)
        return E.EXIT_INTERNAL
    finally:
        if ctx is not None:
            ctx.close()


if __name__ == "__main__":
    sys.exit(main())
