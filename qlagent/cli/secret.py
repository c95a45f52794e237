"""``qlagent secret …``: encrypted Secrets (set from stdin, ls names, rm)."""

from __future__ import annotations

import sys

from ..core import errors as E
from .common import Ctx, command, fmt_us, group, print_json, say, table


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
    say(f"secret {name} stored ({len(value)} bytes, encrypted)")
    return 0


def cmd_secret_ls(ctx: Ctx) -> int:
    from ..application.secrets import SecretService
    from ..bootstrap import cipher_factory
    names = SecretService(ctx.store, cipher_factory(ctx.settings.key_file)).names()
    if ctx.args.json:
        from ..application import presenter
        print_json(presenter.page([presenter.secret(n, u) for n, u in names]))
    else:
        table([[n, fmt_us(u)] for n, u in names], ["NAME", "UPDATED"])
    return 0


def cmd_secret_rm(ctx: Ctx) -> int:
    from ..application.secrets import SecretService
    from ..bootstrap import cipher_factory
    users = SecretService(ctx.store, cipher_factory(ctx.settings.key_file)).remove(ctx.args.name,
                                                                                   force=ctx.args.force)
    say(f"secret {ctx.args.name} removed")
    if users:
        say(f"qlagent: warning: task(s) {', '.join(users)} still use secret {ctx.args.name!r}; their runs fail "
            f"secret_missing:{ctx.args.name}", file=sys.stderr)
    return 0


def register(subparsers, name: str, help_: str) -> None:
    """Add ``secret set|ls|rm``."""
    import argparse
    sec = group(subparsers, name, help_)
    ss = command(sec, "set", cmd_secret_set, "store a secret; the value is read from stdin, never argv")
    ss.add_argument("name")
    # Swallow stray words so argparse never echoes a value typed on the command line.
    ss.add_argument("stray", nargs=argparse.REMAINDER, metavar="value", help=argparse.SUPPRESS)
    command(sec, "ls", cmd_secret_ls, "list secret names (never values)")
    sr = command(sec, "rm", cmd_secret_rm, "remove a secret (refused while a task uses it, unless --force)")
    sr.add_argument("name")
    sr.add_argument("--force", action="store_true", help="remove it even if tasks use it")
