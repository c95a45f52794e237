"""``qlagent`` command line: the top-level parser, dispatch to a command's handler and the
mapping of errors to exit codes. Each top-level command is added by a module of this package
(``COMMANDS``: ``agent``, ``task``, ``secret``, ``run``, ``access``, ``workers``, ``tls``,
``join``, ``status``, ``imports``, ``serve``) through ``register(subparsers, name, help)``.
A command line pays for its own command only (issue 24 §3): ``--version`` is answered before
anything is imported, the parser holds the named command's grammar alone (``--help`` lists the
others by name and help line), and a handler imports its use cases when it runs, so
``--help``, ``run ls`` and ``task ls`` load no HTTP server, dispatcher, cluster or Worker module
(``tests/test_cli_imports.py``; times in bench/bench_cli.py).

Exit codes (stable, documented in README): 0 ok, 1 internal error, 2 usage or bad input,
3 conflict, 4 not found, 5 unavailable, 6 ``run start --wait``: the Run did not succeed.
Every read command takes ``--json``. Secret values are never printed.
"""

from __future__ import annotations

import sys

from .. import __version__

# The top-level commands in ``qlagent --help`` order: name → (the module of this package that
# adds it, its line in that list).
COMMANDS = {
    "init": ("agent", "create the state directory, database and secret key file"),
    "doctor": ("agent", "check schema, capability, integrity, key file and free space"),
    "config": ("agent", "configuration"),
    "task": ("task", "task definitions"),
    "secret": ("secret", "encrypted secrets"),
    "run": ("run", "runs"),
    "token": ("access", "API bearer tokens"),
    "role": ("access", "role bindings"),
    "workers": ("workers", "cluster Workers ([cluster] only)"),
    "tls": ("tls", "the control plane's CA and replica certificates"),
    "worker": ("join", "this host as a fleet Worker"),
    "status": ("status", "the fleet at a glance ([cluster] only)"),
    "import": ("imports", "import from another scheduler"),
    "serve": ("serve", "run the agent (systemd Type=notify service)"),
}


def build_parser(commands=None, *, listed: bool = True):
    """The ``qlagent`` grammar (an ``argparse.ArgumentParser``): the common options, ``--version``
    and the top-level commands, those named in ``commands`` (default: all, the reference) with
    their arguments and subcommands; with ``listed`` the others too, by name and help line
    alone (all that ``qlagent --help`` and a refused command word show of them)."""
    import importlib
    from .common import options, parser_class
    p = parser_class()(prog="qlagent", parents=[options()],
                       description="Schedule and run tasks on routers and edge boxes.")
    p.add_argument("--version", action="version", version=f"qlagent {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module, help_) in COMMANDS.items():
        if commands is None or name in commands:
            importlib.import_module(f"{__package__}.{module}").register(sub, name, help_)
        elif listed:
            sub.add_parser(name, help=help_, add_help=False)    # its --help is the full parser's
    return p


# The options of ``qlagent`` itself that take a value (cli.common.options).
_VALUE_OPTIONS = ("--state-dir", "--config", "--profile", "--project")


def _command_word(argv: list[str]) -> str | None:
    """The top-level command of ``argv`` when only the common options, spelt in full, come
    before it; else None (no command word, an unknown one, ``--help``, ``--version``, an
    abbreviated option: argparse reads those against every command's name)."""
    tokens = iter(argv)
    for tok in tokens:
        if tok in _VALUE_OPTIONS:
            next(tokens, None)
        elif tok != "--json" and tok.partition("=")[0] not in _VALUE_OPTIONS:
            return tok if tok in COMMANDS else None
    return None


def parse(argv: list[str]):
    """(parser, namespace) of ``argv``; the namespace's ``handler`` is the command's. The parser
    holds that command's grammar alone. Raises UsageError; SystemExit for ``--help``/``--version``."""
    command = _command_word(argv)
    if command is None:
        command = build_parser(()).parse_known_args(argv)[0].command
    parser = build_parser((command,), listed=False)
    return parser, parser.parse_args(argv)


# `qlagent serve` is parsed without argparse: the service keeps every module it imports for its
# lifetime, and argparse with gettext and the ~25 subcommand parsers cost it ~0.5 MiB RSS
# (bench/README.md). Only this exact grammar is taken here; anything else (help, an unknown or
# abbreviated option, a bad value) goes to build_parser(), which is the reference and reports
# it. tests/test_cli_serve_args.py checks that both agree.
_SERVE_VALUE_OPTIONS = {**{o: o[2:].replace("-", "_") for o in _VALUE_OPTIONS}, "--listen": "listen",
                        "--exit-after": "exit_after"}
_SERVE_ONLY = ("listen", "exit_after")         # options of the subcommand, not of `qlagent` itself


def _serve_args(argv: list[str]):
    """The namespace (a SimpleNamespace) build_parser() would give for a ``serve`` command
    line, or None."""
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
        from .common import ascii_decimal
        if not ascii_decimal(args["exit_after"], fraction=True):
            return None
        args["exit_after"] = float(args["exit_after"])
    from types import SimpleNamespace
    from .serve import cmd_serve
    return SimpleNamespace(command="serve", handler=cmd_serve, **args)


# Arguments that are file-system paths: on POSIX a path is bytes, and one that is not UTF-8 is
# still a path the OS opens (Python keeps its bytes as lone surrogates), so it is not refused.
_PATH_ARGS = frozenset({"state_dir", "config", "file", "path", "scripts_dir", "dir", "ca", "ca_key",
                         "target_config", "target_state_dir"})


def _argument_names(parser, args) -> dict[str, str]:
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


def _refuse_undecodable(args, parser) -> None:
    """ValidationError (exit 2) naming the first str argument, or str in a list argument, that
    holds lone surrogates: bytes of argv that are not UTF-8 (PEP 383). Such a str reaches no
    store or output: every later encode would fail with a UnicodeEncodeError (exit 1)."""
    from ..core import errors as E
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
    if argv == ["--version"]:       # argparse's --version too, but without importing anything
        print(f"qlagent {__version__}")
        return 0
    from ..core import errors as E
    from ..core.text import escape_controls
    from .common import Ctx, UsageError
    parser = None
    try:
        args = _serve_args(argv)
        if args is None:
            parser, args = parse(argv)
    except UsageError as e:
        if "--json" in argv:
            from msgspec.json import encode
            sys.stdout.buffer.write(encode({"error": {"code": "usage", "message": str(e)}}) + b"\n")
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
        for k in ("state_dir", "config", "project"):
            # An empty value would read as "not given" and act on the default instead.
            if getattr(args, k) == "":
                raise E.ValidationError("--" + k.replace("_", "-"), "is empty; give a value or leave the option out",
                                        limit="non-empty")
        ctx = Ctx(args)
        return args.handler(ctx)
    except E.QlError as e:
        if args.json:
            from msgspec.json import encode
            sys.stdout.buffer.write(encode({"error": e.to_dict()}) + b"\n")
        msg = str(e)
        if e.limit is not None and str(e.limit) not in msg:     # every refusal names its limit
            msg += f" (limit {e.limit})"
        print(f"qlagent: error: {escape_controls(msg)}", file=sys.stderr)
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