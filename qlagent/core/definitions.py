"""Task definition input (TOML) → validated TaskDefinition, ContextRecipe and digests.

Pure: takes already-parsed TOML data, returns frozen records. Every refusal is a
ValidationError naming the field (``task[2].env.QL3_X``) and the limit; nothing is written.
Rules: ADR-0071 §2 (absolute bounded argv or allowlisted shell, POSIX env names, ``QL3_*``
reserved, recipe separate from SecretRefs), kernel MAX_ARG_STRLEN for each argv/env string.
"""

from __future__ import annotations

import re
import unicodedata

import msgspec

from . import limits as L
from .canonical import content_digest, recipe_ref
from .errors import ValidationError, from_msgspec
from .executors import EXECUTOR_LABEL, WORKER_EXECUTORS
from .models import (ContextRecipe, ExecutionSpec, NetworkRequirement, PlacementSpec, RetryPolicy,
                     TaskDefinition)
from .profiles import AGENT_MEMORY_SHARE, PROFILES, MiB, Profile, run_memory_share
from .names import TASK_NAME
from .text import QUOTE_CHARS, check_text

POSIX_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*\Z")
UMASK = re.compile(r"^[0-7]{3,4}\Z")
MEMORY_MAX = re.compile(r"^([0-9]{1,12})([KMG]?)\Z")
SECRET_NAME = re.compile(r"^[A-Za-z0-9_.-]+\Z")
IFACE_NAME = re.compile(r"^[A-Za-z0-9_.:@-]{1,15}\Z")   # Linux IFNAMSIZ - 1
PROJECT_NAME = re.compile(r"^[a-z0-9][a-z0-9._-]{0,63}\Z")
CATCH_UP = ("latest", "none")     # core.schedule.apply_catch_up; README "Catch-up after downtime"
# What a fleet Worker does with a run whose Run Lease it cannot renew (issue 11 §6): stop it
# (default; no second copy runs after the Attempt is re-offered) or keep it (at-least-once).
ON_LEASE_LOSS = ("kill", "keep")


class RetryInput(msgspec.Struct, forbid_unknown_fields=True):
    max_attempts: int = 1
    backoff_s: int | float = 10      # int | float: an integer's value as written, for a refusal


DEFAULT_GRACE_S = 5         # a task file's grace_s when it names none (s)


class TaskInput(msgspec.Struct, forbid_unknown_fields=True):
    """One ``[[task]]`` table of a task file (see README "Defining tasks")."""

    name: str
    schedule: str | list[str] = "@once"
    timezone: str | None = None
    command: list[str] | None = None
    shell: str | None = None
    script: str | None = None
    cwd: str | None = None
    umask: str | None = None
    keep_orphans: bool = False
    on_lease_loss: str | None = None
    memory_max: int | str | None = None
    timeout_s: int | float = 3600    # (int | float: see RetryInput.backoff_s)
    grace_s: int | float = DEFAULT_GRACE_S
    concurrency: str = "single"
    retry: RetryInput = msgspec.field(default_factory=RetryInput)
    labels: dict[str, str] = msgspec.field(default_factory=dict)
    network: str = "none"
    env: dict[str, str] = msgspec.field(default_factory=dict)
    secrets: dict[str, str] = msgspec.field(default_factory=dict)
    enabled: bool = True
    priority: int = 0
    description: str = ""
    catch_up: str = "latest"
    catch_up_within_s: int | float | None = None
    placement: PlacementInput | None = None
    executor: str | None = None


class PlacementInput(msgspec.Struct, forbid_unknown_fields=True):
    """``placement = { required = { k = "v" }, preferred = { k = "v" } }``."""

    required: dict[str, str] = msgspec.field(default_factory=dict)
    preferred: dict[str, str] = msgspec.field(default_factory=dict)


class TaskFile(msgspec.Struct, forbid_unknown_fields=True):
    task: list[TaskInput]


class PreparedTask(msgspec.Struct, frozen=True):
    """A validated definition ready for the definition writer."""

    definition: TaskDefinition
    content_digest: str
    recipe: ContextRecipe
    recipe_ref: str
    execution_digest: str
    enabled: bool


def _utf8_len(s: str) -> int:
    return len(s.encode("utf-8", "surrogatepass"))


def _no_nul(field: str, value: str) -> None:
    if "\x00" in value:
        raise ValidationError(field, "contains a NUL byte", limit="no NUL")


def _num(v) -> str:
    """A number as the user wrote it: ``-5``, not ``-5.0``; an integer's own digits (never its
    float's, ``99999999999999991611392``), ``1e+308`` not its 309 digits; at most
    ``QUOTE_CHARS`` characters then ``… (N digits)``, so a refusal stays one short line."""
    if isinstance(v, float) and v.is_integer() and abs(v) < 1e16:
        text = str(int(v))
    else:
        text = str(v) if isinstance(v, int) else repr(v)
    return text if len(text) <= QUOTE_CHARS else f"{text[:QUOTE_CHARS]}… ({len(text)} digits)"


def _ms(field: str, seconds: float, lo: float, hi: float) -> int:
    if isinstance(seconds, bool) or not (lo <= seconds <= hi):
        raise ValidationError(field, f"{_num(seconds)} is outside {_num(lo)}..{_num(hi)} seconds",
                              limit=f"{_num(lo)}..{_num(hi)}")
    return round(seconds * 1000)


def _toml_type(v) -> str:
    for t, name in ((bool, "a boolean"), (int, "an integer"), (float, "a float"), (list, "an array"),
                    (dict, "a table")):
        if isinstance(v, t):
            return name
    return "a date/time"


def parse_task_file(data: dict) -> list[TaskInput]:
    """Convert parsed TOML (``{"task": [...]}``) into TaskInput records.

    Raises ValidationError naming the offending path for unknown fields or wrong types, or
    when the file holds more than ``MAX_TASKS_PER_FILE`` tasks or a name twice.
    """
    if not isinstance(data, dict) or not isinstance(data.get("task"), list):
        found = ", ".join(sorted(data)) if isinstance(data, dict) else ""
        raise ValidationError("task", "the file defines no [[task]] table"
                              + (f" (it has: {found}); every task is a [[task]] table" if found else ""))
    for key in data:
        if key != "task":
            raise ValidationError(key, "unknown top-level key; a task file holds only [[task]] tables")
    for i, t in enumerate(data["task"]):
        for table in ("env", "secrets", "labels"):
            mapping = t.get(table) if isinstance(t, dict) else None
            for k, v in (mapping.items() if isinstance(mapping, dict) else ()):
                if not isinstance(v, str):      # msgspec would say only `env[...]`: name the key
                    raise ValidationError(f"task[{i}].{table}.{k}", f"must be a string, got {_toml_type(v)} {v!r}; "
                                          f"quote it: {k} = \"{v}\"")
    try:
        tf = msgspec.convert(data, TaskFile, strict=True)
    except msgspec.ValidationError as e:
        raise from_msgspec(e, root="task file") from None
    if not tf.task:
        raise ValidationError("task", "the file defines no [[task]]")
    if len(tf.task) > L.MAX_TASKS_PER_FILE:
        raise ValidationError("task", f"{len(tf.task)} tasks in one file", limit=L.MAX_TASKS_PER_FILE)
    seen: set[str] = set()
    for i, t in enumerate(tf.task):
        if t.name in seen:
            raise ValidationError(f"task[{i}].name", f"duplicate task name {t.name!r} in this file")
        seen.add(t.name)
    return tf.task


def prepare_recipe(prefix: str, env: dict[str, str], secrets: dict[str, str]) -> tuple[ContextRecipe, str]:
    """Validate and canonicalise a context recipe; return it and its ``localctx:sha256:`` ref.

    Limits: POSIX names, ``QL3_*`` reserved, no NUL, each ``KEY=VALUE`` entry ≤ MAX_ARG_STRLEN
    (131072) bytes with its NUL, at most MAX_ENV_ENTRIES entries and MAX_ENV_TOTAL bytes in all.
    A SecretRef counts only its name here: its value is unknown until launch and may change
    with ``secret set``, so the launch bounds the real total (ADR-0071 §4 step 5,
    ``materializer.freeze_env``: the Run fails ``env_too_large``). Counting every SecretRef at
    MAX_SECRET_VALUE would cap a Task at 15 Secrets (a 2.x panel's cron sees all its Envs).
    """
    if len(env) + len(secrets) > L.MAX_ENV_ENTRIES:
        # Named for the table that holds most of them: the one to shorten.
        field = f"{prefix}secrets" if len(secrets) > len(env) else f"{prefix}env"
        raise ValidationError(field, f"{len(env)} env + {len(secrets)} secrets entries; together at most "
                              f"{L.MAX_ENV_ENTRIES}", limit=L.MAX_ENV_ENTRIES)
    total = 0
    public: dict[str, str] = {}
    for key, value in env.items():
        _check_env_name(f"{prefix}env.{key}", key)
        if key in secrets:
            raise ValidationError(f"{prefix}env.{key}", "is also a secret; a name is either public or secret")
        _no_nul(f"{prefix}env.{key}", value)
        value = unicodedata.normalize("NFC", value)
        entry = _utf8_len(key) + 1 + _utf8_len(value) + 1
        if entry > L.MAX_ARG_STRLEN:
            raise ValidationError(f"{prefix}env.{key}",
                                  f"entry is {entry} bytes; the kernel's per-string limit is {L.MAX_ARG_STRLEN}",
                                  limit=L.MAX_ARG_STRLEN)
        total += entry
        public[key] = value
    refs: dict[str, str] = {}
    for key, name in secrets.items():
        _check_env_name(f"{prefix}secrets.{key}", key)
        _check_secret_name(f"{prefix}secrets.{key}", name)
        total += _utf8_len(key) + 2
        refs[key] = name
    if total > L.MAX_ENV_TOTAL:
        raise ValidationError(f"{prefix}env", f"environment needs up to {total} bytes", limit=L.MAX_ENV_TOTAL)
    # A task gets a conventional PATH unless its recipe sets one: it is part of the recipe (and
    # so of the digest), never inherited from the agent's own environment.
    public.setdefault("PATH", L.DEFAULT_PATH)
    recipe = ContextRecipe(public=dict(sorted(public.items())), secret_refs=dict(sorted(refs.items())))
    return recipe, recipe_ref(content_digest(recipe_document(recipe)))


def recipe_document(recipe: ContextRecipe) -> dict:
    """The canonical document a recipe digest covers."""
    return {"public": recipe.public, "secretRefs": recipe.secret_refs}


def _check_env_name(field: str, key: str) -> None:
    if not POSIX_ENV_NAME.match(key):
        raise ValidationError(field, "not a POSIX environment name ([A-Za-z_][A-Za-z0-9_]*)")
    if key.upper().startswith(L.RESERVED_ENV_PREFIX):
        raise ValidationError(field, f"names starting with {L.RESERVED_ENV_PREFIX} are reserved for the agent")


def _check_secret_name(field: str, name: str) -> None:
    if not (1 <= len(name) <= L.MAX_SECRET_NAME) or not SECRET_NAME.match(name):
        raise ValidationError(field, f"secret name must be 1..{L.MAX_SECRET_NAME} of [A-Za-z0-9_.-]",
                              limit=L.MAX_SECRET_NAME)


def check_project_name(name: str) -> str:
    """A Project name: 1..64 of [a-z0-9._-], starting alphanumeric; ValidationError(field=project)."""
    if not isinstance(name, str) or not PROJECT_NAME.match(name):
        raise ValidationError("project", f"{name!r} is not 1..64 of [a-z0-9._-] starting alphanumeric", limit=64)
    return name


def check_secret_name(name: str) -> str:
    """Validate a Secret name for ``secret set/rm``; raises ValidationError(field="name")."""
    _check_secret_name("name", name)
    return name


def parse_memory_max(field: str, value: int | str) -> int:
    """A Task's ``memory_max`` in bytes: a whole number of bytes or a string with K, M or G
    (binary: "48M" = 48 MiB). Refused (ValidationError naming ``field``): anything else, below
    limits.MIN_RUN_MEMORY, or above the largest Profile's runs' share (the Profile in force is
    checked where it is known: ``check_memory_max``)."""
    ceiling = max(run_memory_share(p) for p in PROFILES.values())
    n = value if isinstance(value, int) and not isinstance(value, bool) else None
    if isinstance(value, str):
        m = MEMORY_MAX.match(value)
        if m:
            n = int(m.group(1)) * L.MEMORY_UNITS.get(m.group(2), 1)
    if n is None:
        raise ValidationError(field, f"{value!r} is not a size: bytes, or a number with K, M or G (e.g. \"48M\")")
    if n < L.MIN_RUN_MEMORY:
        raise ValidationError(field, f"{n} bytes is below the floor of {L.MIN_RUN_MEMORY // MiB} MiB",
                              limit=L.MIN_RUN_MEMORY)
    if n > ceiling:
        raise ValidationError(field, f"{n} bytes is over every Profile's share for runs ({ceiling // MiB} MiB)",
                              limit=ceiling)
    return n


def check_memory_max(field: str, memory_max: int | None, profile: Profile) -> None:
    """Refuse a ``memory_max`` over what ``profile`` leaves to Runs (core.profiles)."""
    share = run_memory_share(profile)
    if memory_max is not None and memory_max > share:
        raise ValidationError(field, f"{memory_max} bytes is over the {profile.name} profile's share for runs: "
                                     f"{share // MiB} MiB of {profile.memory_bytes // MiB} MiB "
                                     f"({AGENT_MEMORY_SHARE // MiB} MiB stay the agent's)", limit=share)


def prepare_execution(prefix: str, t: TaskInput) -> ExecutionSpec:
    """Validate the launch spec (ADR-0071 §2): absolute bounded argv or allowlisted shell;
    ``cwd`` absolute (unset: HOME at launch); ``umask`` 3-4 octal digits ≤ 0777, kept as 4;
    ``on_lease_loss`` one of ``ON_LEASE_LOSS`` (issue 11 §6)."""
    if t.cwd is not None:
        _no_nul(f"{prefix}cwd", t.cwd)
        if not t.cwd.startswith("/") or _utf8_len(t.cwd) > L.MAX_PATH_BYTES:
            raise ValidationError(f"{prefix}cwd", "must be an absolute path", limit=L.MAX_PATH_BYTES)
    umask = None
    if t.umask is not None:
        if not UMASK.match(t.umask) or int(t.umask, 8) > 0o777:
            raise ValidationError(f"{prefix}umask", f"{t.umask!r} is not 3-4 octal digits up to 0777 (e.g. \"0027\")",
                                  limit="0000..0777")
        umask = "%04o" % int(t.umask, 8)
    if t.on_lease_loss is not None and t.on_lease_loss not in ON_LEASE_LOSS:
        raise ValidationError(f"{prefix}on_lease_loss",
                              f"{t.on_lease_loss!r} is not one of {', '.join(ON_LEASE_LOSS)}")
    common = {"cwd": t.cwd, "umask": umask, "keep_orphans": t.keep_orphans, "on_lease_loss": t.on_lease_loss,
              "memory_max": None if t.memory_max is None else parse_memory_max(f"{prefix}memory_max", t.memory_max)}
    if t.command is not None and (t.shell is not None or t.script is not None):
        raise ValidationError(f"{prefix}command", "give either command or shell+script, not both")
    if t.command is not None:
        argv = t.command
        if not argv:
            raise ValidationError(f"{prefix}command", "argv is empty")
        if len(argv) > L.MAX_ARGV_COUNT:
            raise ValidationError(f"{prefix}command", f"{len(argv)} arguments", limit=L.MAX_ARGV_COUNT)
        total = 0
        for i, a in enumerate(argv):
            _no_nul(f"{prefix}command[{i}]", a)
            n = _utf8_len(a) + 1
            if n > L.MAX_ARG_STRLEN:
                raise ValidationError(f"{prefix}command[{i}]", f"argument is {n} bytes", limit=L.MAX_ARG_STRLEN)
            total += n
        if total > L.MAX_ARGV_TOTAL:
            raise ValidationError(f"{prefix}command", f"argv is {total} bytes in all", limit=L.MAX_ARGV_TOTAL)
        if not argv[0].startswith("/"):
            raise ValidationError(f"{prefix}command[0]", f"{argv[0]!r} is not an absolute path")
        return ExecutionSpec(kind="local_process", argv=tuple(argv), **common)
    if t.shell is None and t.script is None:
        raise ValidationError(f"{prefix}command", "missing: give command = [absolute argv] or shell + script")
    if t.shell is None:
        raise ValidationError(f"{prefix}shell", f"missing: script needs shell = one of {list(L.SHELL_ALLOWLIST)}")
    if t.script is None:
        raise ValidationError(f"{prefix}script", f"missing: shell = {t.shell!r} needs a script")
    if t.shell not in L.SHELL_ALLOWLIST:
        raise ValidationError(f"{prefix}shell", f"{t.shell!r} is not in the allowlist {list(L.SHELL_ALLOWLIST)}")
    _no_nul(f"{prefix}script", t.script)
    if not t.script.strip():
        raise ValidationError(f"{prefix}script", "is empty")
    if _utf8_len(t.script) > L.MAX_SCRIPT_BYTES:
        raise ValidationError(f"{prefix}script", f"{_utf8_len(t.script)} bytes", limit=L.MAX_SCRIPT_BYTES)
    return ExecutionSpec(kind="shell", shell=t.shell, script=t.script, **common)


def _network(prefix: str, value: str) -> NetworkRequirement:
    if value in ("none", "default_route"):
        return NetworkRequirement(require=value)
    if value.startswith("interface:") and IFACE_NAME.match(value[10:]):
        return NetworkRequirement(require="interface", interface=value[10:])
    raise ValidationError(f"{prefix}network", "expected 'none', 'default_route' or 'interface:NAME' (1..15 chars)")


EXECUTORS = ("local_process", "remote_worker")     # a Task's ``executor`` (the Attempt's executor type)


def _placement(p: str, placement: PlacementInput | None) -> PlacementSpec | None:
    """The validated Placement (≤ 32 labels per table, names/values ≤ 128 bytes, no NUL;
    ``required.executor`` one a Worker offers); None when both tables are empty, so a Task
    without one keeps its contentDigest."""
    if placement is None or not (placement.required or placement.preferred):
        return None
    for table in ("required", "preferred"):
        labels = getattr(placement, table)
        if len(labels) > L.MAX_LABELS:
            raise ValidationError(f"{p}placement.{table}", f"{len(labels)} labels", limit=L.MAX_LABELS)
        for k, v in labels.items():
            if not k or _utf8_len(k) > L.MAX_LABEL_BYTES or _utf8_len(v) > L.MAX_LABEL_BYTES or "\x00" in k + v:
                raise ValidationError(f"{p}placement.{table}.{k}", "label name empty, too long or contains NUL",
                                      limit=L.MAX_LABEL_BYTES)
    wanted = placement.required.get(EXECUTOR_LABEL)
    if wanted is not None and wanted not in WORKER_EXECUTORS:
        raise ValidationError(f"{p}placement.required.{EXECUTOR_LABEL}",
                              f"{wanted!r} is not one of {', '.join(WORKER_EXECUTORS)}")
    return PlacementSpec(required=dict(sorted(placement.required.items())),
                         preferred=dict(sorted(placement.preferred.items())))


def check_executor(d: TaskDefinition, available: str) -> None:
    """Refuse a Task whose ``executor`` this authority cannot run (``available``: the local
    agent runs ``local_process``, the cluster ``remote_worker``): ValidationError(``executor``)."""
    if d.executor is not None and d.executor != available:
        where = "the cluster ([cluster])" if d.executor == "remote_worker" else "a local agent (no [cluster])"
        raise ValidationError("executor", f"{d.executor!r} runs only on {where}; this authority runs {available!r}")


def prepare_task(t: TaskInput, index: int | None = None) -> PreparedTask:
    """Validate one TaskInput and compute its contentDigest (canonical JSON, see core.canonical).

    Raises ValidationError naming ``task[i].<field>`` and the limit.
    """
    p = f"task[{index}]." if index is not None else ""
    if not (1 <= len(t.name) <= L.MAX_TASK_NAME) or not TASK_NAME.match(t.name):
        raise ValidationError(f"{p}name", f"must be 1..{L.MAX_TASK_NAME} of [a-z0-9._-], starting alphanumeric",
                              limit=L.MAX_TASK_NAME)
    # Only a Task being defined needs the cron grammar and the zones (cronsim, zoneinfo): not
    # every reader of a definition (``run ls``, the HTTP API).
    from .schedule import ScheduleError, parse_schedules, validate_timezone
    lines = [t.schedule] if isinstance(t.schedule, str) else list(t.schedule)
    try:
        schedules = [" ".join(s.source.split()) for s in parse_schedules(lines)]
    except ScheduleError as e:
        raise ValidationError(f"{p}{e.field}", e.detail, limit=e.limit) from None
    tz = None
    if t.timezone is not None:
        try:
            tz = validate_timezone(t.timezone)
        except ScheduleError as e:
            raise ValidationError(f"{p}timezone", e.detail) from None
    timeout_ms = _ms(f"{p}timeout_s", t.timeout_s, 1, L.MAX_TIMEOUT_S)
    grace_ms = _ms(f"{p}grace_s", t.grace_s, 0, 300)
    if t.concurrency not in ("single", "parallel"):
        raise ValidationError(f"{p}concurrency", "expected 'single' or 'parallel'")
    if not (1 <= t.retry.max_attempts <= L.MAX_RETRY_ATTEMPTS):
        raise ValidationError(f"{p}retry.max_attempts", f"{t.retry.max_attempts} outside 1..{L.MAX_RETRY_ATTEMPTS}",
                              limit=L.MAX_RETRY_ATTEMPTS)
    backoff_ms = _ms(f"{p}retry.backoff_s", t.retry.backoff_s, 0, L.MAX_RETRY_BACKOFF_S)
    if len(t.labels) > L.MAX_LABELS:
        raise ValidationError(f"{p}labels", f"{len(t.labels)} labels", limit=L.MAX_LABELS)
    for k, v in t.labels.items():
        if _utf8_len(k) > L.MAX_LABEL_BYTES or _utf8_len(v) > L.MAX_LABEL_BYTES or "\x00" in k + v:
            raise ValidationError(f"{p}labels.{k}", "label too long or contains NUL", limit=L.MAX_LABEL_BYTES)
    if not (-1000 <= t.priority <= 1000):
        raise ValidationError(f"{p}priority", f"{t.priority} outside -1000..1000", limit="-1000..1000")
    if len(t.description) > 1024:
        raise ValidationError(f"{p}description", "longer than 1024 characters", limit=1024)
    check_text(f"{p}description", t.description)
    if t.catch_up not in CATCH_UP:
        raise ValidationError(f"{p}catch_up", f"{t.catch_up!r} is not one of {', '.join(CATCH_UP)}")
    within_ms = None
    if t.catch_up_within_s is not None:
        if t.catch_up != "latest":
            raise ValidationError(f"{p}catch_up_within_s", 'applies only to catch_up = "latest"')
        within_ms = _ms(f"{p}catch_up_within_s", t.catch_up_within_s, 1, L.MAX_CATCH_UP_WITHIN_S)
    if t.executor is not None and t.executor not in EXECUTORS:
        raise ValidationError(f"{p}executor", f"{t.executor!r} is not one of {', '.join(EXECUTORS)}")
    placement = _placement(p, t.placement)
    execution = prepare_execution(p, t)
    recipe, rref = prepare_recipe(p, t.env, t.secrets)
    definition = TaskDefinition(
        name=t.name, description=t.description, schedules=tuple(schedules), timezone=tz,
        timeout_ms=timeout_ms, grace_ms=grace_ms, concurrency=t.concurrency,
        retry=RetryPolicy(max_attempts=t.retry.max_attempts, backoff_ms=backoff_ms),
        labels=dict(sorted(t.labels.items())), network=_network(p, t.network),
        priority=t.priority, execution=execution, recipe_ref=rref,
        catch_up=t.catch_up, catch_up_within_ms=within_ms, placement=placement, executor=t.executor,
    )
    return PreparedTask(definition=definition, content_digest=definition_digest(definition),
                        recipe=recipe, recipe_ref=rref,
                        execution_digest=content_digest(execution_document(execution, rref)),
                        enabled=t.enabled)


# Optional launch fields added after the first release: omitted while unset, so every Task
# stored before them keeps its contentDigest and execution digest.
_OMITTED_UNSET = {"umask": None, "keepOrphans": False, "onLeaseLoss": None, "memoryMax": None}


def _execution_builtins(e: ExecutionSpec) -> dict:
    doc = msgspec.to_builtins(e)
    for key, unset in _OMITTED_UNSET.items():
        if doc.get(key, unset) == unset:
            doc.pop(key, None)
    return doc


def definition_document(d: TaskDefinition) -> dict:
    """The canonical document a Task's contentDigest covers (``enabled`` is head state, not content)."""
    doc = msgspec.to_builtins(d)
    doc["execution"] = _execution_builtins(d.execution)
    return doc


def execution_document(e: ExecutionSpec, rref: str) -> dict:
    """The canonical document of an execution revision (its digest is the execution digest)."""
    doc = _execution_builtins(e)
    doc["recipeRef"] = rref
    return doc


def definition_digest(d: TaskDefinition) -> str:
    """contentDigest: lowercase hex SHA-256 of the canonical definition document."""
    return content_digest(definition_document(d))
