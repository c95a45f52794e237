"""``qlagent import qinglong``: the crons and variables of a qinglong 2.x panel as Tasks and Secrets."""

from __future__ import annotations

from .common import Ctx, command, group, print_json


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
        print_json(report)
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


def register(subparsers, name: str, help_: str) -> None:
    """Add ``import qinglong``."""
    q = command(group(subparsers, name, help_), "qinglong", cmd_import_qinglong,
                "import the crons and variables of a qinglong 2.x panel")
    q.add_argument("path", help="the 2.x data directory (holding db/database.sqlite) or the database file")
    q.add_argument("--dry-run", action="store_true", help="print the report, write nothing")
    q.add_argument("--prefix", default="", help="prepend P to every task name (and to Secret names after 'qinglong.')")
    q.add_argument("--scripts-dir", default=None, help="where the 2.x scripts are (default: PATH/scripts)")
    q.add_argument("--env-scope", default="all", choices=["all", "none"],
                   help="all: every task references every imported variable (as in 2.x); none: Secrets only")
