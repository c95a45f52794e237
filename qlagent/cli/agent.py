"""``qlagent init``, ``doctor`` and ``config check``: the agent's state directory, its checks and its
configuration."""

from __future__ import annotations

import os
import sys


from ..core import errors as E
from .common import Ctx, command, fmt_us, group, print_json


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
        print_json({"stateDir": s.state_dir, "database": database, "keyFile": s.key_file,
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
        print_json({"stateDir": s.state_dir, "stateDirCreated": created, "database": None, "keyFile": None,
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
        print_json({"ok": not bad, "checks": checks})
    else:
        for c in checks:
            print(f"{'ok  ' if c['ok'] else 'FAIL'}  {c['name']:<14} {c['detail']}")
    return E.EXIT_UNAVAILABLE if bad else 0


def cmd_config_check(ctx: Ctx) -> int:
    """Loading the configuration validated its values; then the checks ``serve`` makes before it
    opens a database (``service.preflight``: pool size, TLS files, the Worker's CA file), so an
    ExecReload or OpenWrt conversion that passes is not refused by the next start for them."""
    from msgspec import to_builtins

    from ..service.preflight import preflight
    s = ctx.settings
    preflight(s)
    certificates = _certificate_expiries(s)
    out = {"configFile": s.config_path, "profile": s.profile.name, "stateDir": s.state_dir,
           "artifactDir": s.artifact_dir, "config": to_builtins(s.config), "certificates": certificates}
    for c in certificates:
        if not c["ok"]:
            print(f"qlagent: warning: {c['field']}: {c['file']} {c['detail']}; renew it "
                  "(`qlagent tls cert create`, `qlagent tls ca create`)", file=sys.stderr)
    if ctx.args.json:
        print_json(out)
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
        out.append({"field": field, "file": path, "notAfter": fmt_us(end * 1_000_000), "ok": good,
                    "detail": detail})
    return out


def register(subparsers, name: str, help_: str) -> None:
    """Add ``init``, ``doctor`` or ``config check`` (``name``: init, doctor, config)."""
    if name != "config":
        command(subparsers, name, {"init": cmd_init, "doctor": cmd_doctor}[name], help_)
        return
    c = command(group(subparsers, name, help_), "check", cmd_config_check,
                "validate the config file and print the resolved settings")
    c.add_argument("--as-user", metavar="USER",
                   help="judge the paths the agent trusts as the agent running as USER would")
