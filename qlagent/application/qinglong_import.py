"""``qlagent import qinglong``: read a 2.x panel, plan, and apply the plan in ONE transaction.

Re-running is idempotent: a cron whose Task content is unchanged adds no revision; a changed
one appends exactly one (fenced by the head read in the same transaction); a Task whose name
is taken by a Task not imported from the same 2.x cron id is left alone and reported; nothing
is ever deleted. Secrets are created, updated (value differs) or left (same value).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec

from ..core.definitions import definition_digest
from ..core.qinglong import ID_LABEL, ImportPlan, QlPanel, plan_import, script_paths

if TYPE_CHECKING:   # ports are annotations only: no Protocol class at run time
    from ..core.ports import CipherFactory, DefinitionBatch, PanelSource, Store


class TaskOutcome(msgspec.Struct, frozen=True, rename="camel"):
    cron_id: int
    cron_name: str
    task: str
    action: str                      # created | revised | unchanged
    revision: int
    enabled: bool
    notes: tuple[str, ...] = ()


class SkippedOutcome(msgspec.Struct, frozen=True, rename="camel"):
    cron_id: int
    cron_name: str
    task: str                        # the name it maps to
    reason: str


class Renamed(msgspec.Struct, frozen=True, rename="camel"):
    cron_id: int
    cron_name: str
    task: str


class VariableOutcome(msgspec.Struct, frozen=True, rename="camel"):
    name: str
    source: str                      # envs | config.sh
    line: int | None                 # in config.sh
    reason: str


class SecretOutcome(msgspec.Struct, frozen=True, rename="camel"):
    env: str
    secret: str
    source: str
    parts: int
    bytes: int
    action: str                      # created | updated | unchanged


class ImportReport(msgspec.Struct, frozen=True, rename="camel"):
    """What ``import qinglong`` did (or, with ``dry_run``, would do). No secret value in it."""

    database: str
    scripts_dir: str
    dry_run: bool
    env_scope: str
    tasks: tuple[TaskOutcome, ...]
    skipped: tuple[SkippedOutcome, ...]
    renamed: tuple[Renamed, ...]
    secrets: tuple[SecretOutcome, ...]
    skipped_variables: tuple[VariableOutcome, ...]
    config_other_lines: int


def read_and_plan(source: PanelSource, path: str, *, scripts_dir: str | None, prefix: str,
                  env_scope: str) -> tuple[QlPanel, ImportPlan]:
    """Read the 2.x panel (read-only) and compute the plan; touches nothing of ours.

    Raises ValidationError (bad path, not 2.x, corrupt, unreadable scripts dir, bad option)
    or UnavailableError (the 2.x database is locked or kept changing)."""
    panel = source.read_panel(path, scripts_dir)
    present = source.readable_files(script_paths(panel.crons, panel.scripts_dir))
    return panel, plan_import(panel, present, source.find_tools(), prefix=prefix, env_scope=env_scope)


def _imported_before(batch: DefinitionBatch, pid: str, prefix: str, cwd: str) -> dict[str, list]:
    """2.x cron id → live Task heads imported from the same panel (same scripts dir as cwd,
    same prefix), whatever their name: a cron renamed in 2.x maps to a new name."""
    out: dict[str, list] = {}
    for h in batch.list_heads(pid):
        cron_id = h.definition.labels.get(ID_LABEL)
        if cron_id is not None and h.name.startswith(prefix) and h.definition.execution.cwd == cwd:
            out.setdefault(cron_id, []).append(h)
    return out


def apply_import(store: Store, cipher: CipherFactory, panel: QlPanel, plan: ImportPlan, *, env_scope: str,
                 dry_run: bool, prefix: str = "") -> ImportReport:
    """Write the plan in one transaction (all or nothing); ``dry_run`` rolls it back.

    A cron imported before under another name (renamed in 2.x, or a same-name cron removed so
    that its name maps elsewhere) revises that Task, which keeps its name. Raises UnavailableError if Secrets are to
    be stored and the key file is missing.
    """
    pid = store.project.project_id
    box = cipher() if plan.secrets else None

    def work(batch: DefinitionBatch):
        tasks, taken = [], []
        earlier = None
        for t in plan.tasks:
            head = batch.get_head(pid, t.name)
            notes = t.notes
            if head is None or head.definition.labels.get(ID_LABEL) != str(t.cron_id):
                if earlier is None:
                    earlier = _imported_before(batch, pid, prefix, panel.scripts_dir)
                same = earlier.get(str(t.cron_id), [])
                if len(same) > 1:
                    taken.append(SkippedOutcome(t.cron_id, t.cron_name, t.name, "imported before as tasks "
                                                + ", ".join(repr(h.name) for h in same) + "; remove all but one"))
                    continue
                if len(same) == 1:
                    head = same[0]
                    d = msgspec.structs.replace(t.prepared.definition, name=head.name)
                    t = msgspec.structs.replace(t, name=head.name, prepared=msgspec.structs.replace(
                        t.prepared, definition=d, content_digest=definition_digest(d)))
                    notes = (*notes, "its name maps elsewhere now (renamed, or a same-name cron removed in 2.x); "
                                      "the Task keeps its name")
            if head is None:
                h, action = batch.add_task(pid, t.prepared), "created"
            elif head.definition.labels.get(ID_LABEL) != str(t.cron_id):
                taken.append(SkippedOutcome(t.cron_id, t.cron_name, t.name,
                                            f"task {t.name!r} exists and was not imported from this cron; "
                                            "use --prefix"))
                continue
            elif head.content_digest == t.prepared.content_digest:
                h, action = head, "unchanged"
            else:
                h = batch.edit_task(pid, head.task_id, head.revision, head.content_digest, t.prepared)
                action = "revised"
            tasks.append(TaskOutcome(t.cron_id, t.cron_name, t.name, action, h.revision, h.enabled, notes))
        secrets = []
        for s in plan.secrets:
            old = batch.ciphertexts(pid, [s.secret]).get(s.secret)
            if old is not None and box.open(pid, s.secret, old) == s.value:
                action = "unchanged"
            else:
                batch.put_secret(pid, s.secret, box.seal(pid, s.secret, s.value), box.key_id)
                action = "created" if old is None else "updated"
            secrets.append(SecretOutcome(s.env, s.secret, s.source, s.parts, len(s.value), action))
        return tasks, taken, secrets

    tasks, taken, secrets = store.definition_batch(work, dry_run=dry_run)
    actual = {t.cron_id: t.task for t in tasks}
    skipped = [SkippedOutcome(k.cron_id, k.cron_name, k.name, k.reason) for k in plan.skipped] + taken
    return ImportReport(
        database=panel.database, scripts_dir=panel.scripts_dir, dry_run=dry_run, env_scope=env_scope,
        tasks=tuple(tasks), skipped=tuple(sorted(skipped, key=lambda k: k.cron_id)),
        renamed=tuple(Renamed(t.cron_id, t.cron_name, name) for t in plan.tasks
                      if (name := actual.get(t.cron_id, t.name)) != t.cron_name),
        secrets=tuple(secrets),
        skipped_variables=tuple(VariableOutcome(v.name, v.source, v.line, v.reason) for v in plan.skipped_variables),
        config_other_lines=plan.config_other_lines)
