"""``qlagent run …``: Runs (start, ls, show, logs, cancel)."""

from __future__ import annotations

import sys


from ..core import errors as E
from ..core.states import RunState
from .common import (Ctx, MAX_WAIT_S, ascii_int, ascii_seconds, command, fmt_us, group, or_dash, print_json, say,
                     table, task_ref)


def _run_json(run, attempts=None, events=None) -> dict:
    """The shared Run shape (application.presenter); ``run show`` adds every Attempt and RunEvent."""
    from ..application import presenter
    d = presenter.run(run, attempts[-1] if attempts else None)
    if attempts is not None:
        d["attempts"] = [presenter.attempt(a) for a in attempts]
    if events is not None:
        d["events"] = [presenter.event(e) for e in events]
    return d


def cmd_run_start(ctx: Ctx) -> int:
    from ..application.runs import RunService
    t = ctx.args.timeout
    if t is not None and not (0 < t <= MAX_WAIT_S):      # also refuses nan and inf
        raise E.ValidationError("--timeout", f"{t!r} is outside 0 < seconds ≤ {MAX_WAIT_S}", limit=f"0..{MAX_WAIT_S}")
    if t is not None and not ctx.args.wait:
        raise E.ValidationError("--timeout", "only with --wait")
    created = RunService(ctx.store).start(ctx.args.task)
    ctx.poke_service()
    if not ctx.args.wait:
        if ctx.args.json:
            from ..application import presenter
            print_json(presenter.created_run(created))
        else:
            print(created.run_id)
        return 0
    from .wait import wait_for_run
    run = wait_for_run(ctx.settings, ctx.store, created.run_id, ctx.args.timeout)
    if ctx.args.json:
        print_json(_run_json(run))
    else:
        say(f"{run.run_id} {run.state}" + (f" exit={run.exit_code}" if run.exit_code is not None else "")
            + (f" signal={run.exit_signal}" if run.exit_signal is not None else ""))
    return 0 if run.state == RunState.SUCCEEDED else E.EXIT_RUN_FAILED


def cmd_run_ls(ctx: Ctx) -> int:
    from ..application.runs import RunService
    runs, nxt = RunService(ctx.store).list(task=ctx.args.task, state=ctx.args.state, limit=ctx.args.limit,
                                           cursor=ctx.args.cursor)
    if ctx.args.json:
        from ..application import presenter
        print_json(presenter.page([_run_json(r) for r in runs], nxt, pages=True))
        return 0
    table([[r.run_id, r.task_name, r.state, r.trigger_type, fmt_us(r.created_at_us),
             str(r.exit_code) if r.exit_code is not None else f"sig{r.exit_signal}" if r.exit_signal else "-"]
            for r in runs],
           ["RUN", "TASK", "STATE", "TRIGGER", "CREATED", "EXIT"])
    if nxt:
        say(f"(more: --cursor {nxt})")
    return 0


def cmd_run_show(ctx: Ctx) -> int:
    from ..application.runs import RunService
    svc = RunService(ctx.store)
    run = svc.get(ctx.args.run)
    attempts, events = svc.attempts(run.run_id), svc.events(run.run_id)
    if ctx.args.json:
        print_json(_run_json(run, attempts, events))
        return 0
    from msgspec.json import encode

    from ..core.receipt import QUOTA
    say(f"run       {run.run_id}")
    say(f"task      {run.task_name} ({run.task_snapshot_ref})")
    say(f"state     {run.state}" + (f" exit={run.exit_code}" if run.exit_code is not None else "")
        + (f" signal={run.exit_signal}" if run.exit_signal is not None else ""))
    if run.held and run.state == RunState.QUEUED:
        say('waiting   for the live Run of this Task to end (concurrency = "single")')
    if run.state == RunState.QUEUED and ctx.settings.config.cluster is None:
        from ..service.config import state_space_problem
        problem = state_space_problem(ctx.settings.state_dir)
        if problem:
            say(f"waiting   no Run starts: {problem}")
        else:
            from ..bootstrap import artifact_refusal
            refusal = artifact_refusal(ctx.settings)
            if refusal is not None:
                say(f"waiting   no Run starts: {refusal.text()}")
    say(f"trigger   {run.trigger_type} by {run.requested_by}; created {fmt_us(run.created_at_us)}")
    for a in attempts:
        figures = "" if a.ended_at_us is None else (
            f" kept={or_dash(a.bytes_kept)} dropped={or_dash(a.bytes_dropped)}{' TRUNCATED' if a.truncated else ''}"
            f" peak_rss={or_dash(a.peak_rss_bytes)} cpu_us={or_dash(a.cpu_time_us)}"
            + (f" orphans_stopped={a.orphans_stopped}" if a.orphans_stopped else ""))
        say(f"attempt   #{a.attempt_no} {a.state}{figures or ' (figures when it ends)'}"
            + (f" reason={a.failure_reason}" if a.failure_reason else "")
            + (f" worker={a.worker_name or a.worker_id}" if a.worker_id else ""))
        if a.start_error:
            say(f"          could not start: {a.start_error}")
        if a.truncation_reason not in (None, QUOTA):      # the quota's is TRUNCATED alone
            say(f"          log truncated: {a.truncation_reason}")
    from ..application.presenter import event
    for e in events:
        # The payload as JSON shows it: instants in RFC 3339 (deadlineAt), not µs.
        say(f"event     {e.sequence:>3} {fmt_us(e.created_at_us)} {e.type} {encode(event(e)['payload']).decode()}")
    return 0


def cmd_run_logs(ctx: Ctx) -> int:
    from ..application.runs import MAX_LOG_OFFSET, MAX_LOG_READ, RunService, log_page_json, read_log_range
    offset, remaining = ctx.args.offset, ctx.args.limit
    if not 0 <= offset <= MAX_LOG_OFFSET:
        raise E.ValidationError("--offset", f"{offset} is outside 0..{MAX_LOG_OFFSET} bytes", limit=f"0..{MAX_LOG_OFFSET}")
    if remaining is not None and not 1 <= remaining <= MAX_LOG_OFFSET:
        raise E.ValidationError("--limit", f"{remaining} is outside 1..{MAX_LOG_OFFSET} bytes (omit it to read to "
                                "the end)", limit=f"1..{MAX_LOG_OFFSET}")
    svc = RunService(ctx.store)
    run = svc.get(ctx.args.run)
    if ctx.settings.config.cluster is not None:
        return _cluster_logs(ctx, run.run_id, offset, remaining)
    path, fact = svc.log_source(run.run_id)
    if ctx.args.json:
        print_json(log_page_json(run.run_id, path, fact, offset, min(remaining or MAX_LOG_READ, MAX_LOG_READ)))
        return 0
    _copy_log(lambda at, n: read_log_range(path, at, n)[0], offset, remaining)
    if fact:      # stdout stays the log's bytes; the truncation fact goes to stderr, always
        say(_truncation_note(fact), file=sys.stderr)
    return 0


def _truncation_note(fact) -> str:
    """The ``run logs`` line of a truncation fact (core.receipt.TruncationFact): the quota it
    stopped at, or where a failed write cut the log and why."""
    from ..core.receipt import QUOTA
    if fact.reason == QUOTA:
        return f"qlagent: note: log truncated at {fact.quota_bytes} bytes; {or_dash(fact.bytes_dropped)} bytes dropped"
    return (f"qlagent: note: log truncated at {fact.bytes_kept} bytes, {fact.reason}; "
            f"{or_dash(fact.bytes_dropped)} bytes dropped")


def _copy_log(read, offset: int, remaining: int | None) -> None:
    """Write a Run's log to stdout from ``offset`` (bytes; ``remaining`` at most, None: to its
    end) through ``read(offset, n) -> bytes`` calls of at most ``MAX_LOG_READ`` bytes each."""
    from ..application.runs import MAX_LOG_READ
    out = sys.stdout.buffer
    while remaining is None or remaining > 0:
        chunk = read(offset, min(MAX_LOG_READ, remaining or MAX_LOG_READ))
        if not chunk:
            break
        out.write(chunk)
        offset += len(chunk)
        if remaining is not None:
            remaining -= len(chunk)
    out.flush()


def _cluster_logs(ctx: Ctx, run_id: str, offset: int, remaining: int | None) -> int:
    """``run logs`` on the cluster authority: the chunks the Worker uploaded, from PostgreSQL."""
    from .. import bootstrap
    from ..application.runs import MAX_LOG_READ, log_page
    reader = bootstrap.log_chunks(ctx.store)
    if ctx.args.json:
        chunk, size, fact = reader.read_range(run_id, offset, min(remaining or MAX_LOG_READ, MAX_LOG_READ))
        print_json(log_page(run_id, chunk, size, offset, fact))
        return 0
    facts = []

    def read(at: int, n: int) -> bytes:
        chunk, _, fact = reader.read_range(run_id, at, n)
        facts.append(fact)
        return chunk
    _copy_log(read, offset, remaining)
    fact = facts[-1] if facts else None
    if fact:
        say(_truncation_note(fact), file=sys.stderr)
    return 0


def cmd_run_cancel(ctx: Ctx) -> int:
    from ..application.cancel import request_cancel
    from ..application.runs import RunService
    from ..core.states import RunState
    before = RunService(ctx.store).get(ctx.args.run)
    if before.state in RunState.TERMINAL:
        raise E.ConflictError(f"run {before.run_id} had already ended ({before.state}); nothing to cancel",
                              code="run_ended")
    run = request_cancel(ctx.store, before.run_id, "local:cli")
    ctx.poke_service()
    say(f"{run.run_id} {run.state}" + (" (cancel requested)" if run.state not in RunState.TERMINAL else ""))
    return 0


def register(subparsers, name: str, help_: str) -> None:
    """Add ``run start|ls|show|logs|cancel``."""
    run = group(subparsers, name, help_)
    st = command(run, "start", cmd_run_start, "start a task now (Task Start semantics)")
    st.add_argument("task", type=task_ref)
    st.add_argument("--wait", action="store_true", help="wait for the end; exit 6 unless it succeeded")
    st.add_argument("--timeout", type=ascii_seconds, default=None, help="--wait at most this many seconds")
    ls = command(run, "ls", cmd_run_ls, "list runs, newest first")
    ls.add_argument("--task", type=task_ref)
    ls.add_argument("--state")
    ls.add_argument("--limit", type=ascii_int, default=50)
    ls.add_argument("--cursor")
    command(run, "show", cmd_run_show, "show a run, its attempts and events").add_argument("run")
    lg = command(run, "logs", cmd_run_logs, "print a run's log (bounded reads)")
    lg.add_argument("run")
    lg.add_argument("--offset", type=ascii_int, default=0)
    lg.add_argument("--limit", type=ascii_int, default=None)
    command(run, "cancel", cmd_run_cancel, "cancel a queued or running run").add_argument("run")
