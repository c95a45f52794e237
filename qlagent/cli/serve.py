"""``qlagent serve``: the agent (a local agent, a control-plane replica or a fleet Worker, by
the configuration). ``cli.main`` parses its command line without argparse (``serve_args``)."""

from __future__ import annotations

from ..core import errors as E
from .common import Ctx, MAX_WAIT_S, ascii_seconds, command


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


def register(subparsers, name: str, help_: str) -> None:
    """Add ``serve`` (the reference grammar of ``cli.main``'s fast path)."""
    sv = command(subparsers, name, cmd_serve, help_)
    sv.add_argument("--listen", default=None, help="HTTP HOST:PORT (overrides http.listen)")
    sv.add_argument("--exit-after", type=ascii_seconds, default=None, help="drain and exit after this many seconds")
