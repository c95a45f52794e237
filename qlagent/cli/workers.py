"""``qlagent workers …``: the cluster's Workers (enroll, ls, drain, resume, rm); ``[cluster]`` only."""

from __future__ import annotations

from ..core import errors as E
from ..core.states import WorkerState
from .common import Ctx, command, fmt_us, options, or_dash, print_json, table


def _registry(ctx: Ctx):
    """The cluster's Worker registry; ``workers`` needs ``[cluster]`` (exit 2 otherwise)."""
    if ctx.settings.config.cluster is None:
        raise E.ValidationError("cluster", "`qlagent workers` acts on the cluster authority; the configuration "
                                           "has no [cluster] table")
    from .. import bootstrap
    return bootstrap.worker_registry(ctx.settings, ctx.store)


def _labels(pairs: list[str]) -> dict[str, str]:
    out: dict[str, str] = {}
    for pair in pairs:
        key, eq, value = pair.partition("=")
        if not eq or not key:
            raise E.ValidationError("--label", f"{pair!r} is not KEY=VALUE")
        if key in out:
            raise E.ValidationError("--label", f"{key!r} is given twice")
        out[key] = value
    return out


def cmd_workers_enroll(ctx: Ctx) -> int:
    a = ctx.args
    labels = _labels(a.label or [])
    material = None
    if a.join_token:                    # checked before the Worker is enrolled
        from .join import join_material
        material = join_material(ctx)
    worker_id, credential = _registry(ctx).enroll(a.name, labels, tuple(a.executor or ["local_process"]), a.slots,
                                                  tuple(a.worker_projects or ()))
    from .join import show_credential
    return show_credential(ctx, worker_id, credential, material,
                           " enrolled; the join token above is shown once and carries its credential: on the "
                           "router run `qlagent worker join TOKEN`",
                           "the credential is shown once (only its SHA-256 is stored); give it to the Worker")


def cmd_workers_ls(ctx: Ctx) -> int:
    registry, rows, after = _registry(ctx), [], None
    while True:
        page = registry.list(64, after)
        rows += page
        if len(page) < 64:
            break
        after = page[-1]["name"]
    if ctx.args.json:
        from ..application import presenter
        print_json(presenter.page([presenter.worker(r) for r in rows]))
        return 0
    table([[r["name"], r["worker_id"], r["state"], str(r["generation"]), or_dash(r["session_id"]),
             fmt_us(r["last_heartbeat_us"]), str(max(0, r["free_slots"])), str(r["slots"]),
             ",".join(f"{k}={v}" for k, v in sorted(r["labels"].items())) or "-"] for r in rows],
           ["NAME", "WORKER", "STATE", "GEN", "SESSION", "HEARTBEAT", "FREE", "SLOTS", "LABELS"])
    return 0


_WORKER_VERBS = {"drain": WorkerState.DRAINING, "resume": WorkerState.ACTIVE, "rm": WorkerState.REMOVED}


def cmd_workers_state(ctx: Ctx, verb: str) -> int:
    """``workers drain|resume|rm NAME``: the Worker's new state (``--json``: name, workerId, state)."""
    registry = _registry(ctx)
    act = {"drain": registry.drain, "resume": registry.resume, "rm": registry.remove}[verb]
    worker_id, state = act(ctx.args.name), _WORKER_VERBS[verb]
    if ctx.args.json:
        print_json({"name": ctx.args.name, "workerId": worker_id, "state": state})
    else:
        print(f"{ctx.args.name} {worker_id} {state}")
    return 0


def register(subparsers, name: str, help_: str) -> None:
    """Add ``workers enroll|rotate-credential|ls|drain|resume|rm``."""
    wk = subparsers.add_parser(name, help=help_).add_subparsers(
        dest="sub", required=True, metavar="SUB")
    # Here --project scopes the Worker (repeatable), not the command: the common options but that one.
    we = wk.add_parser("enroll", parents=[options(project=False)], help="enroll a Worker; prints its credential once")
    we.set_defaults(handler=cmd_workers_enroll)
    we.add_argument("name")
    we.add_argument("--label", action="append", metavar="KEY=VALUE", help="a Placement label (repeatable)")
    we.add_argument("--executor", action="append", choices=["local_process"], help="executor type (repeatable)")
    we.add_argument("--slots", type=int, default=1, help="concurrent Attempts (1..256)")
    we.add_argument("--project", action="append", dest="worker_projects", metavar="PROJECT",
                    help="offer it only this Project's Runs (repeatable, ≤ 32; none: every Project)")
    from .join import add_token_options, register_rotate
    add_token_options(we)
    register_rotate(wk)
    command(wk, "ls", cmd_workers_ls, "list Workers: state, generation, Session, last heartbeat, free slots")
    command(wk, "drain", lambda c: cmd_workers_state(c, "drain"), "no new offers to the Worker").add_argument("name")
    command(wk, "resume", lambda c: cmd_workers_state(c, "resume"), "undo a drain: offers to the Worker again"
            ).add_argument("name")
    command(wk, "rm", lambda c: cmd_workers_state(c, "rm"), "remove the Worker (its Leases are fenced)"
            ).add_argument("name")
