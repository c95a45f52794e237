"""What every ``qlagent`` command group shares: ``Ctx`` (the settings and store of one
invocation), the output helpers, the argparse value types and the parser helpers each group's
``register(subparsers)`` uses (``command``, ``group``).

Only the standard library and ``core`` are imported here: ``--help``, ``run ls`` and ``task ls``
load each group module, so a group's handlers import their use cases (and msgspec) inside.
"""

from __future__ import annotations

import os
import sys

from ..core import errors as E
from ..core.limits import MAX_TIMEOUT_S as MAX_WAIT_S     # --timeout/--exit-after: seconds
from ..core.text import escape_controls

# typing.TYPE_CHECKING without loading typing (`--help` loads none: tests/test_cli_imports.py);
# type checkers take any TYPE_CHECKING as true.
TYPE_CHECKING = False
if TYPE_CHECKING:   # annotations only: core.settings loads msgspec, core.ports its records
    from ..core.ports import Store
    from ..core.settings import Settings


def print_json(obj) -> None:
    """``obj`` as indented JSON on stdout (msgspec encodes it)."""
    from msgspec import json
    sys.stdout.buffer.write(json.format(json.encode(obj), indent=2) + b"\n")
    sys.stdout.flush()


def fmt_us(us: int | None) -> str:
    """µs since the epoch as ``YYYY-MM-DDTHH:MM:SSZ`` (UTC); None as ``-``."""
    if us is None:
        return "-"
    import datetime as dt
    return dt.datetime.fromtimestamp(us / 1e6, dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def or_dash(v) -> str:
    """``str(v)``, or ``-`` for None."""
    return "-" if v is None else str(v)


def say(text: str, file=None) -> None:
    """Print one line of text output (to ``file``, default stdout) with every control character
    in it escaped (core.text.escape_controls): a value holding a newline or ESC cannot forge a
    line or drive the reader's terminal. Every text renderer's line goes through here or ``table``."""
    print(escape_controls(text), file=file)


def table(rows: list[list[str]], header: list[str]) -> None:
    """Print ``rows`` under ``header`` in left-aligned columns two blanks apart, each cell's
    control characters escaped (``say``)."""
    rows = [[escape_controls(str(x)) for x in r] for r in rows]
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


def refuse_on_worker(settings: Settings, command: str, sub: str | None) -> None:
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
        self._store: Store | None = None
        self.settings: Settings | None     # None for a command that reads no configuration
        # `worker join` makes the config the others read; `tls` makes files and reads none (on a
        # packaged control plane root runs it, whose trust rules refuse the service's state dir).
        if not getattr(args, "reads_config", True):
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
    def store(self) -> Store:
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


def load_toml(path: str) -> dict:
    """A task file (TOML, at most ``MAX_TASK_FILE_BYTES``); ValidationError naming ``file``."""
    from ..service.tomlfile import read_toml
    from ..core.limits import MAX_TASK_FILE_BYTES
    return read_toml(path, "file", MAX_TASK_FILE_BYTES)



class UsageError(Exception):
    """argparse's refusal, answered by main() like every other one (exit 2)."""


def ascii_decimal(text: str, fraction: bool = False) -> bool:
    """``text`` is ASCII decimal digits, optionally after a '-' (the range check then names the
    limit) and, with ``fraction``, with one '.': what the HTTP query parser takes. int() and
    float() alone would also take Arabic-Indic or fullwidth digits, ``1_0`` (= 10), blanks and,
    for float, ``1e3``, ``nan``, ``inf``."""
    body = text[1:] if text.startswith("-") else text
    whole, dot, frac = body.partition(".") if fraction else (body, "", "")
    return body.isascii() and (whole + frac).isdigit() and (whole.isdigit() or not whole) \
        and (frac.isdigit() or not dot)


def ascii_int(text: str) -> int:
    """argparse type for integers (see ascii_decimal); raises ArgumentTypeError (exit 2)."""
    if not ascii_decimal(text):
        import argparse
        raise argparse.ArgumentTypeError(f"invalid integer {text!r}: ASCII decimal digits only")
    return int(text)


def task_ref(text: str) -> str:
    """argparse type for a Task's name or ID (core.names): ArgumentTypeError (exit 2) naming the
    rule for one that can name no Task, which is bad input, not "not found" (exit 4)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return text         # argv bytes that are not UTF-8: main._refuse_undecodable's refusal
    from ..core.names import task_ref_problem
    problem = task_ref_problem(text)
    if problem is not None:
        import argparse
        raise argparse.ArgumentTypeError(problem)
    return text


def ascii_seconds(text: str) -> float:
    """argparse type for seconds (see ascii_decimal); raises ArgumentTypeError (exit 2)."""
    if not ascii_decimal(text, fraction=True):
        import argparse
        raise argparse.ArgumentTypeError(f"invalid seconds {text!r}: ASCII decimal digits only (e.g. 5 or 2.5)")
    return float(text)



_OPTIONS: dict[bool, object] = {}


def options(project: bool = True):
    """The options every command takes (``--state-dir``, ``--config``, ``--profile``, ``--json``,
    with ``project`` also ``--project``), as an argparse parent parser; one per flag."""
    if project not in _OPTIONS:
        import argparse
        out = parser_class()(add_help=False)
        out.add_argument("--state-dir", default=argparse.SUPPRESS, help="state directory (env QLAGENT_STATE_DIR)")
        out.add_argument("--config", default=argparse.SUPPRESS, help="config file (env QLAGENT_CONFIG)")
        out.add_argument("--profile", default=argparse.SUPPRESS, choices=["edge", "standalone"])
        if project:
            out.add_argument("--project", default=argparse.SUPPRESS, help="Project name (default: 'default')")
        out.add_argument("--json", action="store_true", default=argparse.SUPPRESS, help="machine-readable output")
        _OPTIONS[project] = out
    return _OPTIONS[project]


_PARSER: list[type] = []


def help_width() -> int:
    """Columns of help text: ``$COLUMNS``, else the terminal's on stdout, else 80, less 2 — what
    argparse asks ``shutil.get_terminal_size`` for, without importing shutil (with its bz2, lzma
    and zlib for archives) at every parser a command line builds."""
    try:
        columns = int(os.environ.get("COLUMNS", ""))
    except ValueError:
        columns = 0
    if columns <= 0:
        try:
            columns = os.get_terminal_size(sys.__stdout__.fileno()).columns or 80
        except (AttributeError, ValueError, OSError):
            columns = 80
    return columns - 2


def parser_class() -> type:
    """argparse.ArgumentParser with the CLI's one-line refusal (no usage block): ``error`` raises
    UsageError (exit 2 naming the argument); help text ``help_width()`` wide."""
    if not _PARSER:
        import argparse

        class Formatter(argparse.HelpFormatter):
            def __init__(self, prog, indent_increment=2, max_help_position=24, width=None):
                super().__init__(prog, indent_increment, max_help_position, help_width() if width is None else width)

        class Parser(argparse.ArgumentParser):
            def __init__(self, *args, **kw):
                kw.setdefault("formatter_class", Formatter)
                super().__init__(*args, **kw)

            def error(self, message: str):
                raise UsageError(f"{message} (see `{self.prog} --help`)")
        _PARSER.append(Parser)
    return _PARSER[0]


def command(subparsers, name: str, handler, help_: str, **kw):
    """Add the command ``name`` (with the common options) whose ``handler(ctx) -> exit code``
    runs it; returns its parser for the command's own arguments."""
    sp = subparsers.add_parser(name, parents=[options()], help=help_, **kw)
    sp.set_defaults(handler=handler)
    return sp


def group(subparsers, name: str, help_: str):
    """Add the command group ``name`` (``qlagent NAME SUB``); returns its subparsers."""
    return subparsers.add_parser(name, help=help_).add_subparsers(dest="sub", required=True, metavar="SUB")
