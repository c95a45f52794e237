"""``qlagent task …``: Task definitions (add, edit, ls, show, enable, disable, rm)."""

from __future__ import annotations

import sys

from ..core import errors as E
from .common import Ctx, ascii_int, command, fmt_us, group, load_toml, print_json, say, table, task_ref


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
    prepared = DefinitionWriter.prepare_file(load_toml(ctx.args.file))
    _check_lease_fit(ctx, prepared)
    _check_memory_max(ctx, prepared)
    heads = DefinitionWriter(ctx.store).add(prepared)
    ctx.poke_service()
    if ctx.args.json:
        from ..application import presenter
        print_json(presenter.page([_head_json(ctx, h) for h in heads]))
    else:
        for h in heads:
            say(f"added {h.name} revision {h.revision} {h.content_digest}")
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
            say(f"qlagent: warning: task {task} uses secret {secret!r}, which is not set; its runs fail "
                f"secret_missing:{secret} until `qlagent secret set {secret}`", file=sys.stderr)


def cmd_task_edit(ctx: Ctx) -> int:
    from ..application.definitions import DefinitionWriter, check_fence
    check_fence(ctx.args.expect_revision, ctx.args.expect_digest, revision_field="--expect-revision",
                digest_field="--expect-digest")
    prepared = DefinitionWriter.prepare_file(load_toml(ctx.args.file))
    if len(prepared) != 1:
        raise E.ValidationError("task", f"`task edit` takes a file with exactly one [[task]], got {len(prepared)}")
    _check_lease_fit(ctx, prepared)
    _check_memory_max(ctx, prepared)
    h = DefinitionWriter(ctx.store).edit(ctx.args.name, ctx.args.expect_revision, ctx.args.expect_digest,
                                         prepared[0])
    ctx.poke_service()
    if ctx.args.json:
        print_json(_head_json(ctx, h))
    else:
        say(f"{h.name} now at revision {h.revision} {h.content_digest}")
    _warn_missing_secrets(ctx, {h.name})
    return 0


def cmd_task_ls(ctx: Ctx) -> int:
    heads = ctx.store.list_heads(ctx.store.project.project_id)
    if ctx.args.json:
        from ..application import presenter
        print_json(presenter.page([_head_json(ctx, h) for h in heads]))
        return 0
    rows = []
    for h in heads:
        nf = _next_fires(h, 1)
        rows.append([h.name, str(h.revision), h.content_digest[:12], "yes" if h.enabled else "no",
                     " | ".join(h.definition.schedules), fmt_us(nf[0]) if nf else "-"])
    table(rows, ["NAME", "REV", "DIGEST", "ENABLED", "SCHEDULE", "NEXT"])
    return 0


def cmd_task_show(ctx: Ctx) -> int:
    h = ctx.store.get_head(ctx.store.project.project_id, ctx.args.name)
    skipped = ctx.store.skipped_fires(h.task_id)
    d = _head_json(ctx, h)
    d["skippedFires"] = skipped
    recipe = ctx.store.get_recipe(h.definition.recipe_ref)
    d["env"], d["secrets"] = recipe.public, recipe.secret_refs     # Secret names only, never values
    if ctx.args.json:
        print_json(d)
        return 0
    df = h.definition
    ex = df.execution
    say(f"name          {h.name}  ({h.task_id})")
    say(f"revision      {h.revision}")
    say(f"digest        {h.content_digest}")
    say(f"enabled       {'yes' if h.enabled else 'no'}")
    say(f"schedules     {' | '.join(df.schedules)}  (timezone {df.timezone or 'system'})")
    say(f"next fires    {', '.join(fmt_us(u) for u in _next_fires(h, 3)) or '-'}")
    say(f"command       {' '.join(ex.argv) if ex.kind == 'local_process' else ex.shell + ' -c <script>'}")
    say(f"process       cwd {ex.cwd or '$HOME'}; umask {ex.umask or 'of the service'}; leftovers "
        f"{'kept (keep_orphans)' if ex.keep_orphans else 'stopped at exit'}")
    if ex.on_lease_loss is not None:
        say(f"lease loss    {ex.on_lease_loss} (on a fleet Worker that cannot renew the Run Lease)")
    say(f"timeout       {df.timeout_ms / 1000:g} s (grace {df.grace_ms / 1000:g} s); concurrency {df.concurrency}; "
        f"retry {df.retry.max_attempts}x")
    say(f"network       {df.network.require}{':' + df.network.interface if df.network.interface else ''}")
    say(f"recipe        {df.recipe_ref}")
    for k, v in recipe.public.items():
        say(f"env           {k}={v}")
    for k, v in recipe.secret_refs.items():
        say(f"secret        {k} <- secret {v}")
    if df.catch_up != "latest" or df.catch_up_within_ms is not None:
        say(f"catch up      {df.catch_up}" + (f" within {df.catch_up_within_ms / 1000:g} s"
                                               if df.catch_up_within_ms is not None else ""))
    say(f"skipped fires {skipped}")
    return 0


def cmd_task_enable(ctx: Ctx, enabled: bool) -> int:
    from ..application.definitions import DefinitionWriter
    h, n = DefinitionWriter(ctx.store).set_enabled(ctx.args.name, enabled)
    ctx.poke_service()
    say(f"{h.name} {'enabled' if enabled else 'disabled'}" + (f"; {n} queued {_runs(n)} cancelled" if n else ""))
    return 0


def cmd_task_rm(ctx: Ctx) -> int:
    from ..application.definitions import DefinitionWriter
    h, n, live = DefinitionWriter(ctx.store).remove(ctx.args.name)
    ctx.poke_service()
    say(f"{h.name} removed" + (f"; {n} queued {_runs(n)} cancelled" if n else "")
        + (f"; {live} running {_runs(live)} asked to stop" if live else ""))
    return 0


def _runs(n: int) -> str:
    return "Run" if n == 1 else "Runs"


def register(subparsers, name: str, help_: str) -> None:
    """Add ``task add|ls|show|edit|enable|disable|rm``."""
    task = group(subparsers, name, help_)
    command(task, "add", cmd_task_add, "add every [[task]] of a TOML file").add_argument("-f", "--file", required=True)
    command(task, "ls", cmd_task_ls, "list tasks")
    sh = command(task, "show", cmd_task_show, "show a task's head, digest and next fire times")
    sh.add_argument("name", type=task_ref)
    e = command(task, "edit", cmd_task_edit, "fenced edit: appends revision+1")
    e.add_argument("name", type=task_ref)
    e.add_argument("-f", "--file", required=True)
    e.add_argument("--expect-revision", type=ascii_int, required=True, help="the head revision you read")
    e.add_argument("--expect-digest", required=True, help="the head contentDigest you read")
    for nm, fn in (("enable", lambda c: cmd_task_enable(c, True)), ("disable", lambda c: cmd_task_enable(c, False)),
                   ("rm", cmd_task_rm)):
        command(task, nm, fn, f"{nm} a task").add_argument("name", type=task_ref)
