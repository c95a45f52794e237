"""Import plan for a qinglong 2.x panel (issue 15): 2.x facts in, validated Task specs and
Secrets out. Pure: the adapter (``adapters.qinglong``) reads the panel and probes the
interpreters; the application writes the plan in one transaction.

Rules (each reported per cron or per variable, never fatal for the others):
- a Crontab ``task X.ext args`` (or ``X.ext args``: 2.x puts ``task`` in front of any other
  command) becomes ``command = [interpreter, /abs/scripts/X.ext, args…]`` with ``cwd`` = the
  scripts dir; ``node`` for .js, ``python3`` for .py, ``bash`` for .sh, ``ts-node`` for .ts,
  each only when the adapter found it; a script outside the scripts dir (``../``, an absolute
  path other than the container's ``/ql/data/scripts/…``) is skipped. ``now`` is dropped (we add no random delay);
  ``conc``/``desi`` and other panel options, ``ql …`` commands, ``isSystem`` crons and anything
  needing a shell (``$``, backticks, ``;``, ``|``, ``&&``, redirections) are skipped;
- with ``task_before``/``task_after`` the Task is ``/bin/bash`` running ``set -e``, the before
  snippet, the quoted command, the after snippet: the Run stops at the first failing step and
  its exit status is that step's (the after snippet runs only after a successful command);
- Envs: the enabled rows of one name joined with ``&`` in the panel's own order (``position``
  descending, then ``createdAt`` ascending, as 2.x ``EnvService.envs()`` sorts them), byte-exact:
  no trimming, no quoting, no evaluation (2.x wrote them into a sourced shell file);
  ``PATH`` is not imported (the agent's PATH; 2.x's ``$PATH:…`` would be literal);
- ``config/config.sh``: ``export NAME=value`` lines read as shell words WITHOUT a shell
  (``"…"``, ``'…'``, bare, backslash escapes); a value needing evaluation (``$…``, backticks,
  ``~``, globs) is reported and not imported; an Env of the same name wins (2.x sources
  config.sh, then the Envs file);
- each imported variable is one Secret ``qinglong.<prefix><NAME>``; with ``env_scope = "all"``
  every Task references every Secret under the variable's name (2.x gave every cron every
  variable); ``"none"`` imports the Secrets without references.
"""

from __future__ import annotations

import hashlib
import posixpath
import re
import shlex
import unicodedata

import msgspec

from . import limits as L
from .definitions import POSIX_ENV_NAME, SECRET_NAME, PreparedTask, TaskInput, prepare_task
from .errors import ValidationError

IMPORT_TIMEOUT_S = 86_400
"""Timeout of an imported Task (s): 2.x's default ``CommandTimeoutTime="24h"``."""

MAX_CRONS = L.MAX_TASKS_PER_FILE
"""Most Crontabs one import takes (one transaction, like one task file)."""

MAX_CONFIG_BYTES = 1_048_576
"""Largest ``config/config.sh`` read (bytes)."""

ID_LABEL = "qinglong.id"
"""Label holding the 2.x Crontab id; a re-import revises only Tasks carrying the same id."""

SECRET_PREFIX = "qinglong."

ENV_RESERVE = 4_096
"""Bytes of MAX_ENV_TOTAL kept for PATH and the QL3_* run identity when every Task gets every
variable (the launch bounds the real total: materializer ``freeze_env``)."""

INTERPRETERS = {".js": "node", ".py": "python3", ".sh": "bash", ".ts": "ts-node"}
BASH = "/bin/bash"
# Where a 2.x container keeps its scripts: absolute paths under these map to our scripts dir.
CONTAINER_SCRIPT_DIRS = ("/ql/data/scripts/", "/ql/scripts/")
PANEL_OPTIONS = frozenset({"conc", "desi"})
_SHELL_SYNTAX = re.compile(r"[;&|<>()$`\n]")
_SLUG_DROP = re.compile(r"[^a-z0-9._-]+")
_PREFIX = re.compile(r"^[a-z0-9][a-z0-9._-]{0,31}\Z")


class QlCron(msgspec.Struct, frozen=True):
    """One row of the 2.x ``Crontabs`` table; JSON columns kept as the text stored."""

    id: int
    name: str
    command: str
    schedule: str
    is_disabled: bool = False
    labels_json: str | None = None
    extra_schedules_json: str | None = None
    task_before: str | None = None
    task_after: str | None = None
    is_system: bool = False


class QlEnv(msgspec.Struct, frozen=True):
    """One row of the 2.x ``Envs`` table; ``value`` is the stored bytes, untouched."""

    id: int
    name: str
    value: bytes
    enabled: bool
    position: float | None = None
    created_at: str | None = None


class ConfigExport(msgspec.Struct, frozen=True):
    """``export NAME=value`` read from config.sh at ``line`` (1-based); ``value`` byte-exact."""

    line: int
    name: str
    value: bytes


class ConfigRefusal(msgspec.Struct, frozen=True):
    """An ``export`` line of config.sh that is not imported, and why (never its value)."""

    line: int
    name: str | None
    reason: str


class QlConfig(msgspec.Struct, frozen=True):
    exports: tuple[ConfigExport, ...] = ()
    refused: tuple[ConfigRefusal, ...] = ()
    other_lines: int = 0


class QlPanel(msgspec.Struct, frozen=True):
    """What the adapter read from a 2.x data directory (paths absolute)."""

    database: str
    scripts_dir: str
    crons: tuple[QlCron, ...]
    envs: tuple[QlEnv, ...]
    config: QlConfig


class Toolset(msgspec.Struct, frozen=True):
    """Interpreters found on the agent's task PATH: name → absolute path (absent = not found);
    ``bash_shell``: ``/bin/bash`` exists (needed for task_before/task_after)."""

    interpreters: dict[str, str]
    bash_shell: bool


class PlannedTask(msgspec.Struct, frozen=True):
    cron_id: int
    cron_name: str
    name: str
    prepared: PreparedTask
    notes: tuple[str, ...] = ()


class SkippedCron(msgspec.Struct, frozen=True):
    cron_id: int
    cron_name: str
    name: str
    reason: str


class PlannedSecret(msgspec.Struct, frozen=True):
    """A Secret to store. ``value`` is plaintext: never print it; reports carry its size."""

    env: str
    secret: str
    value: bytes
    parts: int
    source: str                      # "envs" or "config.sh"


class SkippedVariable(msgspec.Struct, frozen=True):
    name: str
    source: str
    reason: str
    line: int | None = None


class ImportPlan(msgspec.Struct, frozen=True):
    tasks: tuple[PlannedTask, ...]
    skipped: tuple[SkippedCron, ...]
    secrets: tuple[PlannedSecret, ...]
    skipped_variables: tuple[SkippedVariable, ...]
    config_other_lines: int


# ---- config/config.sh ------------------------------------------------------------------------

class _Refused(Exception):
    pass


_NAME_START = re.compile(r"[A-Za-z_]")
_DOUBLE_ESCAPES = frozenset('$`"\\')


def _expansion(text: str, i: int) -> str | None:
    """Which expansion a ``$`` at ``text[i]`` starts, or None if the shell keeps it literal."""
    nxt = text[i + 1:i + 2]
    if nxt == "(":
        return "$(…)"
    if nxt == "{":
        return "${…}"
    if nxt and (_NAME_START.match(nxt) or nxt.isdigit() or nxt in "@*#?$!-"):
        return "$NAME"
    return None


def _word(text: str, i: int) -> tuple[str, int]:
    """Read one shell word starting at ``i``; returns (value, index after it).

    Raises _Refused naming the construct that needs evaluation or an unterminated quote.
    """
    out: list[str] = []
    start = i
    n = len(text)
    while i < n:
        ch = text[i]
        if ch in " \t\n;":
            break
        if ch == "'":
            j = text.find("'", i + 1)
            if j < 0:
                raise _Refused("unterminated single quote")
            out.append(text[i + 1:j])
            i = j + 1
        elif ch == '"':
            i += 1
            while True:
                if i >= n:
                    raise _Refused("unterminated double quote")
                c = text[i]
                if c == '"':
                    i += 1
                    break
                if c == "\\" and i + 1 < n:
                    e = text[i + 1]
                    if e == "\n":                       # line continuation
                        pass
                    elif e in _DOUBLE_ESCAPES:
                        out.append(e)
                    else:
                        out.append("\\" + e)
                    i += 2
                    continue
                if c == "`":
                    raise _Refused("needs shell evaluation (`…`)")
                if c == "$" and _expansion(text, i):
                    raise _Refused(f"needs shell evaluation ({_expansion(text, i)})")
                out.append(c)
                i += 1
        elif ch == "\\":
            if i + 1 < n and text[i + 1] != "\n":
                out.append(text[i + 1])
            i += 2
        elif ch == "`":
            raise _Refused("needs shell evaluation (`…`)")
        elif ch == "$" and _expansion(text, i):
            raise _Refused(f"needs shell evaluation ({_expansion(text, i)})")
        elif ch == "~" and i == start:
            raise _Refused("needs shell evaluation (~)")
        elif ch in "*?[":
            raise _Refused("needs shell evaluation (a pattern)")
        elif ch in "|&<>(){}":
            raise _Refused(f"shell syntax {ch!r}")
        else:
            out.append(ch)
            i += 1
    return "".join(out), i


def _skip_statement(text: str, i: int) -> int:
    """Index after the end of the statement at ``i`` (quote-aware; a comment ends at the line)."""
    n = len(text)
    while i < n:
        ch = text[i]
        if ch == "\n":
            return i + 1
        if ch == "#" and (i == 0 or text[i - 1] in " \t;"):
            j = text.find("\n", i)
            return n if j < 0 else j + 1
        if ch == "'":
            j = text.find("'", i + 1)
            i = n if j < 0 else j + 1
        elif ch == '"':
            i += 1
            while i < n and text[i] != '"':
                i += 2 if text[i] == "\\" else 1
            i += 1
        elif ch == "\\":
            i += 2
        else:
            i += 1
    return n


_EXPORT = re.compile(r"export[ \t]+([^ \t\n=;#]+)=")
_QUOTED = re.compile(r"'[^']*'|\"(?:\\.|[^\"\\])*\"", re.S)
_OPENERS = re.compile(r"(?<![\w-])(?:if|case|for|while|until|select|\{)(?![\w-])|\(\)")
_CLOSERS = re.compile(r"(?<![\w-])(?:fi|esac|done|\})(?![\w-])")


def _depth_change(statement: str) -> int:
    """How many compound commands (if/case/loops, function bodies) a skipped statement opens
    minus closes; quoted text and comments do not count."""
    code = _QUOTED.sub("", statement).split("#", 1)[0]
    # A function header `name() {` opens one body: count the `()`, not also its `{`.
    return len(_OPENERS.findall(code)) - (1 if "()" in code and "{" in code else 0) - len(_CLOSERS.findall(code))


def parse_config_sh(data: bytes) -> QlConfig:
    """Read the ``export NAME=value`` lines of a 2.x ``config/config.sh`` without a shell.

    Values are shell words (``"…"`` with ``\\$ \\` \\" \\\\`` and line-continuation escapes,
    ``'…'`` literal, bare with backslash escapes) decoded byte-exact (non-UTF-8 bytes kept).
    A value needing evaluation, an invalid name, an unterminated quote, a second word after
    the value or an export inside an if/case/loop/function body makes a ConfigRefusal; the
    LAST export of a name decides (shell order).
    Other lines (comments, plain assignments, functions) are only counted.
    """
    text = data.decode("utf-8", "surrogateescape")
    exports: dict[str, ConfigExport] = {}
    refused: dict[str, ConfigRefusal] = {}
    unnamed: list[ConfigRefusal] = []
    other = 0
    i, n = 0, len(text)
    line, counted, depth = 1, 0, 0
    while i < n:
        while i < n and text[i] in " \t;":
            i += 1
        if i >= n:
            break
        line += text.count("\n", counted, i)
        counted = i
        if text[i] == "\n":
            i += 1
            continue
        m = _EXPORT.match(text, i)
        if not m:
            end = _skip_statement(text, i)
            if text[i] != "#":
                other += 1
                depth = max(0, depth + _depth_change(text[i:end]))
            i = end
            continue
        name = m.group(1)
        try:
            if not POSIX_ENV_NAME.match(name):
                raise _Refused("not a POSIX environment name")
            if depth:
                raise _Refused("inside an if, case, loop or function: it may not run")
            value, j = _word(text, m.end())
            k = j
            while k < n and text[k] in " \t":
                k += 1
            if k < n and text[k] not in "\n#;":
                raise _Refused("more than one word after '='")
            i = _skip_statement(text, j)
        except _Refused as e:
            refusal = ConfigRefusal(line=line, name=name if POSIX_ENV_NAME.match(name) else None, reason=str(e))
            if refusal.name is None:
                unnamed.append(refusal)
            else:
                refused[name] = refusal
                exports.pop(name, None)
            i = _skip_statement(text, m.end())
            continue
        refused.pop(name, None)
        exports[name] = ConfigExport(line=line, name=name, value=value.encode("utf-8", "surrogateescape"))
    return QlConfig(exports=tuple(exports.values()),
                    refused=tuple(sorted([*refused.values(), *unnamed], key=lambda r: r.line)),
                    other_lines=other)


# ---- names -----------------------------------------------------------------------------------

def check_prefix(prefix: str) -> str:
    """``--prefix``: empty, or 1..32 of [a-z0-9._-] starting alphanumeric; ValidationError(prefix)."""
    if prefix and not _PREFIX.match(prefix):
        raise ValidationError("prefix", f"{prefix!r} is not 1..32 of [a-z0-9._-] starting alphanumeric", limit=32)
    return prefix


def _slug(text: str) -> str:
    return _SLUG_DROP.sub("-", text).strip("-._")


def base_name(cron_name: str, script: str | None) -> str:
    """A valid Task name for a 2.x cron name, deterministic.

    NFKC, lowercase, runs of other characters → ``-``. A name with non-ASCII letters (e.g.
    Chinese) keeps its ASCII part (or the script's stem, or ``cron``) plus ``-`` and the first
    8 hex digits of SHA-256 of the UTF-8 name, so distinct names stay distinct.
    """
    norm = unicodedata.normalize("NFKC", cron_name or "").lower()
    slug = _slug(norm)
    if any(not ch.isascii() and ch.isalnum() for ch in norm) or not slug:
        stem = _slug(posixpath.splitext(posixpath.basename(script))[0].lower()) if script else ""
        digest = hashlib.sha256((cron_name or "").encode("utf-8", "surrogatepass")).hexdigest()[:8]
        slug = f"{slug or stem or 'cron'}-{digest}"
    return slug


def _fit(prefix: str, base: str, suffix: str = "") -> str:
    # prefix ≤ 32 and suffix ≤ 13 characters leave base at least 19 of the 64.
    return prefix + base[:L.MAX_TASK_NAME - len(prefix) - len(suffix)].rstrip("-._") + suffix


def assign_names(crons: tuple[QlCron, ...], prefix: str, scripts: dict[int, str | None]) -> dict[int, str]:
    """Cron id → Task name, unique. In id order the first cron keeps the plain name; a later
    one with the same name gets ``-<id>`` (then ``-<id>-2``, … if that too is taken), so a
    name never moves to another cron when crons are added."""
    names: dict[int, str] = {}
    taken: set[str] = set()
    for cron in sorted(crons, key=lambda c: c.id):
        base = base_name(cron.name, scripts.get(cron.id))
        name = _fit(prefix, base)
        k = 1
        while name in taken:
            name = _fit(prefix, base, f"-{cron.id}" + (f"-{k}" if k > 1 else ""))
            k += 1
        taken.add(name)
        names[cron.id] = name
    return names


# ---- crons -----------------------------------------------------------------------------------

class _Command(msgspec.Struct, frozen=True):
    script: str                       # absolute
    ext: str
    args: tuple[str, ...]
    notes: tuple[str, ...]


def _script_path(raw: str, scripts_dir: str) -> str:
    for d in CONTAINER_SCRIPT_DIRS:
        if raw.startswith(d):
            raw = raw[len(d):]
            break
    return posixpath.normpath(posixpath.join(scripts_dir, raw))


def parse_command(command: str, scripts_dir: str) -> _Command | str:
    """A 2.x cron command → the script it runs, or the reason it is not imported."""
    text = (command or "").strip()
    if not text:
        return "empty command"
    if _SHELL_SYNTAX.search(text):
        return "needs a shell ($, backticks, ;, |, &, redirection or a newline); add it by hand"
    try:
        words = shlex.split(text)
    except ValueError as e:
        return f"cannot split the command: {e}"
    if words[0] == "ql":
        what = " ".join(words[:2])
        return f"panel-internal command ({what}): the 2.x panel's own maintenance; not imported"
    if words[0] == "task":
        words = words[1:]
        if not words:
            return "`task` without a script"
    script, args = words[0], list(words[1:])
    ext = posixpath.splitext(script)[1].lower()
    if ext not in INTERPRETERS:
        return f"{script!r} is not a .js, .py, .sh or .ts script; add it by hand"
    notes: list[str] = []
    builtins: list[str] = []
    if "--" in args:                  # 2.x: panel options before `--`, script arguments after
        cut = args.index("--")
        builtins, args = args[:cut], args[cut + 1:]
    elif args and (args[0] in PANEL_OPTIONS or args[0] == "now"):
        builtins, args = args[:1], args[1:]
    for b in builtins:
        if b == "now":
            notes.append("`now` dropped: qlagent adds no random delay")
        elif b in PANEL_OPTIONS:
            return f"task option {b!r} is a 2.x panel feature (it splits variables per account); add it by hand"
        else:
            return f"task option {b!r} is a 2.x panel option; add it by hand"
    path = _script_path(script, scripts_dir)
    # `task ../x.sh` or `/usr/x.sh` would run a file outside the folder the import checked (and,
    # for a panel in a container, another file than the one 2.x ran).
    if not path.startswith(scripts_dir.rstrip("/") + "/"):
        return f"script {path} is outside the scripts dir {scripts_dir}; add it by hand"
    return _Command(script=path, ext=ext, args=tuple(args), notes=tuple(notes))


def script_paths(crons: tuple[QlCron, ...], scripts_dir: str) -> frozenset[str]:
    """Absolute paths of the scripts the crons run (the adapter checks which exist)."""
    out = set()
    for c in crons:
        cmd = parse_command(c.command, scripts_dir)
        if isinstance(cmd, _Command):
            out.add(cmd.script)
    return frozenset(out)


def _json_list(text: str | None, what: str) -> list:
    if text is None or not text.strip():
        return []
    try:
        value = msgspec.json.decode(text.encode("utf-8", "surrogatepass"))
    except (msgspec.DecodeError, RecursionError):       # RecursionError: nested past msgspec's depth
        raise _Refused(f"{what} is not JSON") from None
    if value is None:
        return []
    if not isinstance(value, list):
        raise _Refused(f"{what} is not a JSON array")
    return value


def _labels(cron: QlCron, notes: list[str]) -> dict[str, str]:
    labels = {ID_LABEL: str(cron.id)}
    try:
        tags = _json_list(cron.labels_json, "labels")
    except _Refused as e:
        notes.append(f"{e}; labels not imported")
        return labels
    for tag in tags:
        if not isinstance(tag, str) or not tag or tag == ID_LABEL:
            continue
        if len(labels) >= L.MAX_LABELS:
            notes.append(f"more than {L.MAX_LABELS} labels; the rest dropped")
            break
        if len(tag.encode("utf-8", "surrogatepass")) > L.MAX_LABEL_BYTES or "\x00" in tag:
            notes.append(f"a label longer than {L.MAX_LABEL_BYTES} bytes dropped")
            continue
        labels[tag] = ""
    return labels


def _schedules(cron: QlCron) -> list[str]:
    # A dict keeps the first-seen order and de-duplicates in one pass (the cell is unbounded).
    lines = {" ".join((cron.schedule or "").split()): None}
    for item in _json_list(cron.extra_schedules_json, "extra_schedules"):
        s = item.get("schedule") if isinstance(item, dict) else None
        if not isinstance(s, str):
            raise _Refused("extra_schedules holds an item without a schedule string")
        lines.setdefault(" ".join(s.split()), None)
    return list(lines)


def _bash_script(before: str, argv: list[str], after: str) -> str:
    parts = ["set -e"]
    if before.strip():
        parts.append(before.rstrip("\n"))
    parts.append(" ".join(shlex.quote(a) for a in argv))
    if after.strip():
        parts.append(after.rstrip("\n"))
    return "\n".join(parts) + "\n"


def _cron_task(cron: QlCron, name: str, cmd: _Command, scripts_dir: str, tools: Toolset,
               secret_refs: dict[str, str]) -> PlannedTask | str:
    interp = INTERPRETERS[cmd.ext]
    path = tools.interpreters.get(interp)
    if not path:
        return f"{interp} (for {cmd.ext}) was not found on the task PATH; install it and import again"
    notes = list(cmd.notes)
    try:
        schedules = _schedules(cron)
        labels = _labels(cron, notes)
    except _Refused as e:
        return str(e)
    argv = [path, cmd.script, *cmd.args]
    before, after = cron.task_before or "", cron.task_after or ""
    spec = dict(name=name, schedule=schedules, cwd=scripts_dir, timeout_s=IMPORT_TIMEOUT_S, labels=labels,
                secrets=dict(secret_refs), enabled=not cron.is_disabled, description=(cron.name or "")[:1024])
    if before.strip() or after.strip():
        if not tools.bash_shell:
            return f"task_before/task_after need {BASH}, which is missing"
        spec.update(shell=BASH, script=_bash_script(before, argv, after))
    else:
        spec.update(command=argv)
    try:
        prepared = prepare_task(TaskInput(**spec))
    except ValidationError as e:
        return f"refused: {e.message}" + (f" (limit {e.limit})" if e.limit is not None else "")
    return PlannedTask(cron_id=cron.id, cron_name=cron.name or "", name=name, prepared=prepared, notes=tuple(notes))


# ---- variables -------------------------------------------------------------------------------

def _variables(panel: QlPanel, prefix: str) -> tuple[list[PlannedSecret], list[SkippedVariable]]:
    skipped: list[SkippedVariable] = []
    groups: dict[str, list[QlEnv]] = {}
    for env in panel.envs:
        if env.enabled:
            groups.setdefault(env.name, []).append(env)
    secrets: dict[str, PlannedSecret] = {}

    def admit(name: str, value: bytes, parts: int, source: str, line: int | None) -> None:
        secret = SECRET_PREFIX + prefix + name
        reason = None
        if not POSIX_ENV_NAME.match(name):
            reason = "not a POSIX environment name"
        elif name == "PATH":
            # 2.x evaluated `$PATH:…` in its sourced file; byte-exact in every Task it would
            # replace the agent's PATH and no command on it would be found.
            reason = "the agent sets PATH for every Task; set it per Task (`env.PATH`) if a script needs more"
        elif name.upper().startswith(L.RESERVED_ENV_PREFIX):
            reason = f"names starting with {L.RESERVED_ENV_PREFIX} are reserved for the agent"
        elif len(secret) > L.MAX_SECRET_NAME or not SECRET_NAME.match(secret):
            reason = f"Secret name {secret!r} would be longer than {L.MAX_SECRET_NAME}"
        elif len(value) > L.MAX_SECRET_VALUE:
            reason = f"value is {len(value)} bytes (limit {L.MAX_SECRET_VALUE})"
        elif b"\x00" in value:
            reason = "value contains a NUL byte"
        if reason:
            skipped.append(SkippedVariable(name=name, source=source, reason=reason, line=line))
        else:
            secrets[name] = PlannedSecret(env=name, secret=secret, value=value, parts=parts, source=source)

    for name, rows in groups.items():
        # 2.x EnvService.envs(): ORDER BY position DESC, createdAt ASC; id (insertion order)
        # settles exact ties. Stable sorts, least significant key first.
        rows = sorted(rows, key=lambda e: e.id)
        rows.sort(key=lambda e: e.created_at or "")
        rows.sort(key=lambda e: float("-inf") if e.position is None else e.position, reverse=True)
        admit(name, b"&".join(e.value for e in rows), len(rows), "envs", None)
    for exp in panel.config.exports:
        if exp.name in groups:
            skipped.append(SkippedVariable(name=exp.name, source="config.sh", line=exp.line,
                                           reason="an Env of the same name wins (2.x sources config.sh first)"))
        elif not exp.value:
            skipped.append(SkippedVariable(name=exp.name, source="config.sh", line=exp.line, reason="empty value"))
        else:
            admit(exp.name, exp.value, 1, "config.sh", exp.line)
    for r in panel.config.refused:
        skipped.append(SkippedVariable(name=r.name or "?", source="config.sh", line=r.line, reason=r.reason))
    return sorted(secrets.values(), key=lambda s: s.env), skipped


def _utf8(text: str | None) -> bool:
    # The adapter keeps non-UTF-8 bytes as surrogate escapes; an argv or script must be text.
    try:
        (text or "").encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def plan_import(panel: QlPanel, present: frozenset[str], tools: Toolset, *, prefix: str = "",
                env_scope: str = "all") -> ImportPlan:
    """The whole import plan (see the module docstring for every rule).

    ``present``: which of ``script_paths(...)`` exist and are readable. Raises ValidationError
    for a bad ``prefix``/``env_scope``, more than MAX_CRONS crons, or variables that cannot fit
    in one Task environment (more than MAX_ENV_ENTRIES or MAX_ENV_TOTAL bytes) with
    ``env_scope = "all"``.
    """
    check_prefix(prefix)
    if env_scope not in ("all", "none"):
        raise ValidationError("env-scope", f"{env_scope!r}: expected 'all' or 'none'")
    if len(panel.crons) > MAX_CRONS:
        raise ValidationError("Crontabs", f"{len(panel.crons)} crons", limit=MAX_CRONS)
    secrets, skipped_vars = _variables(panel, prefix)
    refs: dict[str, str] = {}
    if env_scope == "all":
        size = sum(len(s.env) + len(s.value) + 2 for s in secrets)
        room = L.MAX_ENV_TOTAL - ENV_RESERVE
        if len(secrets) > L.MAX_ENV_ENTRIES or size > room:
            raise ValidationError("env-scope", f"{len(secrets)} variables of {size} bytes do not fit in every "
                                  f"Task's environment (limits {L.MAX_ENV_ENTRIES} entries, {room} bytes); use "
                                  "--env-scope none and reference them per Task", limit=room)
        refs = {s.env: s.secret for s in secrets}
    commands = {c.id: parse_command(c.command, panel.scripts_dir) for c in panel.crons}
    names = assign_names(panel.crons, prefix,
                         {i: (c.script if isinstance(c, _Command) else None) for i, c in commands.items()})
    tasks: list[PlannedTask] = []
    skipped: list[SkippedCron] = []
    for cron in sorted(panel.crons, key=lambda c: c.id):
        cmd = commands[cron.id]
        bad = next((f for f, v in (("command", cron.command), ("task_before", cron.task_before),
                                   ("task_after", cron.task_after)) if not _utf8(v)), None)
        if cron.is_system:
            outcome: PlannedTask | str = "a 2.x system cron (isSystem): the panel's own; not imported"
        elif bad:
            outcome = f"{bad} is not valid UTF-8; fix it in the panel or add it by hand"
        elif isinstance(cmd, str):
            outcome = cmd
        elif cmd.script not in present:
            outcome = f"script {cmd.script} does not exist or is not readable"
        else:
            outcome = _cron_task(cron, names[cron.id], cmd, panel.scripts_dir, tools, refs)
        if isinstance(outcome, str):
            skipped.append(SkippedCron(cron_id=cron.id, cron_name=cron.name or "", name=names[cron.id],
                                       reason=outcome))
        else:
            tasks.append(outcome)
    return ImportPlan(tasks=tuple(tasks), skipped=tuple(skipped), secrets=tuple(secrets),
                      skipped_variables=tuple(skipped_vars), config_other_lines=panel.config.other_lines)
