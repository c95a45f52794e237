"""``qlagent token …`` and ``qlagent role set``: API bearer tokens and the role bindings of a
Project's subjects."""

from __future__ import annotations

import sys

from .common import Ctx, command, fmt_us, group, print_json, say, table


def cmd_token_create(ctx: Ctx) -> int:
    from ..application.tokens import create_token
    token, token_id = create_token(ctx.store, ctx.args.project or ctx.settings.config.project, ctx.args.subject,
                                   ctx.args.role)
    print(token)                    # alone on stdout: `TOKEN=$(qlagent token create …)`
    say(f"token id {token_id} (for `qlagent token revoke`); the token is not shown again", file=sys.stderr)
    return 0


def cmd_token_ls(ctx: Ctx) -> int:
    from ..application.tokens import list_tokens
    rows = list_tokens(ctx.store)
    if ctx.args.json:
        from ..application import presenter
        print_json(presenter.page([presenter.token(r) for r in rows]))
    else:
        table([[r.token_id, r.subject, fmt_us(r.created_at_us), fmt_us(r.revoked_at_us)] for r in rows],
               ["TOKEN ID", "SUBJECT", "CREATED", "REVOKED"])
    return 0


def cmd_token_revoke(ctx: Ctx) -> int:
    from ..application.tokens import revoke_token
    say(f"token {revoke_token(ctx.store, ctx.args.token_id)} revoked")    # its ID, never the token
    return 0


def cmd_role_set(ctx: Ctx) -> int:
    from ..application.tokens import set_role
    v = set_role(ctx.store, ctx.args.subject, None if ctx.args.role == "none" else ctx.args.role)
    say(f"{ctx.args.subject}: {ctx.args.role} (bindingVersion {v})")
    return 0


ROLES = ["owner", "admin", "operator", "viewer"]


def register(subparsers, name: str, help_: str) -> None:
    """Add ``token create|revoke|ls`` or ``role set`` (``name``: token, role)."""
    if name == "role":
        rs = command(group(subparsers, name, help_), "set", cmd_role_set,
                     "bind a subject's role in the project ('none' revokes)")
        rs.add_argument("subject")
        rs.add_argument("role", choices=[*ROLES, "none"])
        return
    tok = group(subparsers, name, help_)
    tc = command(tok, "create", cmd_token_create, "create a token (printed once) and bind the subject's role")
    tc.add_argument("--subject", required=True)
    tc.add_argument("--role", required=True, choices=ROLES)
    command(tok, "revoke", cmd_token_revoke, "revoke a token (by its ID, or the token itself)").add_argument("token_id")
    command(tok, "ls", cmd_token_ls, "list tokens of the project (IDs and subjects, never the tokens)")
