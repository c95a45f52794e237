"""Cron scheduling against the store: turns due instants into queued Runs, exactly once.

For each enabled Task with clock schedules, ``core.schedule.plan_due`` decides (pure) which
instant gets a Run; this module writes that Run (queued Run + claimed Attempt + run.created +
run.queued) and the Task's schedule cursor in ONE transaction under the idempotency key
``ql3:schedule:v1:{task}:{instant}``, so a restart or a second loop never creates it twice.
Single-instance Tasks skip a fire while a Run of theirs is live and count it
(``tasks.skipped_fires``, shown by ``task show``). ``@boot`` Tasks get one Run per service start.
A Task's catch-up policy (``core.schedule.apply_catch_up``) may refuse a late instant: journal
``schedule.missed``. The store refuses an instant its own clock has not reached (``early``: a
Run is stamped with the authority's time, ADR-0376 §2, and ``clock_us`` is only this process's
reading of it): nothing is written, the Task is due again at that instant, ``clock_ahead`` tells
the caller to measure its clock again, and the journal gets ``schedule.early``. Coalesced instants are counted in the journal and in the ``run.created``
event as ``missed`` (``"≥100"`` once capped).

Bounded work per pass (issue 10 "Scheduler on PostgreSQL"): one ``fire_due`` pass makes at most
``max_writes`` store writes (fires and cursor moves). The Tasks it did not reach are carried to
the next pass, which starts with them (``next_wake_us`` is then the pass's own instant, so the
service loop runs it at once), counted in ``carried`` and journalled ``schedule.carried``: a
thousand Tasks due at one instant cannot hold one replica's loop for a thousand transactions,
and no Task is starved by the ones before it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from ..core import schedule as sch
from ..core.linelimit import LineLimit
from ..core.models import ScheduleCursor, TaskHead

if TYPE_CHECKING:   # ports are annotations only: no Protocol class at run time
    from ..core.ports import Store

ACTOR = "scheduler"
MAX_WRITES_PER_PASS = 64     # store writes (one transaction each) in one fire_due pass
# A per-second schedule behind a long Run skips a fire every second: one schedule.skipped line
# per Task in this long (µs), the next one carrying ``suppressed=N``, the lines left out.
SKIP_LOG_EVERY_US = 60_000_000


class Scheduler:
    """Over the store's DefinitionStore and ScheduleStore ports; ``next_wake_us`` is the next
    instant ``fire_due`` has work (µs), None when no clock schedule is pending; ``carried`` how
    many Tasks the last pass left to the next one; ``clock_ahead`` whether the last pass found
    ``clock_us`` ahead of the store's clock (an ``early`` fire). ``max_writes`` (1..MAX_WRITES_PER_PASS,
    ValueError otherwise) bounds the writes of one pass (see the module docstring)."""

    def __init__(self, store: Store, system_tz: str, clock_us: Callable[[], int],
                 log: Callable[..., None] = lambda *a, **k: None, max_writes: int = MAX_WRITES_PER_PASS) -> None:
        if not 1 <= max_writes <= MAX_WRITES_PER_PASS:
            raise ValueError(f"max_writes {max_writes} outside 1..{MAX_WRITES_PER_PASS}")
        self._store = store
        self._tz = system_tz
        self._now = clock_us
        self._log = log
        self._max_writes = max_writes
        self._tasks: list[tuple[TaskHead, tuple[sch.Schedule, ...]]] = []
        self._resume = 0             # index in _tasks where the next pass starts (the carried ones)
        self.next_wake_us: int | None = None
        self.carried = 0
        self.clock_ahead = False
        self._skip_log: dict[str, LineLimit] = {}    # task_id → its schedule.skipped line's limit

    def reload(self) -> int:
        """Re-read enabled Task heads (after a poke or SIGHUP); returns how many are scheduled."""
        heads = self._store.list_heads(None)
        self._tasks = [(h, tuple(sch.parse_schedule(s) for s in h.definition.schedules))
                       for h in heads if h.enabled]
        ids = {h.task_id for h, _ in self._tasks}
        self._skip_log = {k: v for k, v in self._skip_log.items() if k in ids}
        self._resume = 0
        self.next_wake_us = None
        return len(self._tasks)

    def fire_boot(self, service_started_us: int) -> int:
        """Create the ``@boot`` Runs of this service start (F6); returns how many were created."""
        n = 0
        for head, scheds in self._tasks:
            if sch.has_boot(scheds):
                key = sch.boot_idempotency_key(head.task_id, service_started_us)
                n += int(self._fire(head, key, "boot", None, None) == "created")
        return n

    def fire_due(self) -> int:
        """Create Runs for the instants due now, within the pass's write bound; sets
        ``next_wake_us`` and ``carried``. Returns how many Runs were created."""
        now = self._now()
        created = writes = 0
        wake: list[int] = []
        # One read of every cursor; a write transaction only for a Task that has an instant due,
        # no cursor yet, or a clock that stepped back (recorded and logged once). Writing every
        # cursor at every wake-up would be a write per Task per wake on a router's flash, for
        # nothing: between due instants the cursor decides nothing.
        cursors = self._store.schedule_cursors()
        start = self._resume % len(self._tasks) if self._tasks else 0
        order = self._tasks[start:] + self._tasks[:start]
        self._resume, self.carried, self.clock_ahead = start, 0, False
        for i, (head, scheds) in enumerate(order):
            if writes >= self._max_writes:
                self._carry(start, i, len(order), writes)
                wake.append(now)             # the carried Tasks are due now: the next pass at once
                break
            if not any(s.kind == "cron" for s in scheds):
                continue
            tz = head.definition.timezone or self._tz
            cur = cursors.get(head.task_id)
            outcome = ""                     # nothing to write unless an instant is due
            while True:
                plan = sch.plan_due(scheds, tz, cur.last_instant_us if cur else None,
                                    cur.observed_wall_us if cur else None, now)
                if cur is not None and plan.due_us is None and plan.clock_back_us <= 1_000_000:
                    break
                d = head.definition
                within = d.catch_up_within_ms * 1000 if d.catch_up_within_ms is not None else None
                plan = sch.apply_catch_up(plan, now, d.catch_up, within)
                new = ScheduleCursor(last_instant_us=plan.last_instant_us, observed_wall_us=plan.observed_wall_us)
                key = None if plan.due_us is None else sch.idempotency_key(head.task_id, plan.due_us)
                outcome = self._fire(head, key, "cron", plan.due_us, (cur, new), plan, now)
                writes += 1
                if outcome != "moved":
                    created += int(outcome == "created")
                    break
                if writes >= self._max_writes:
                    break
                # Another loop moved the cursor since it was read: plan again from the stored one.
                cur = self._store.schedule_cursors().get(head.task_id)
            if outcome == "moved" and writes >= self._max_writes:
                self._carry(start, i, len(order), writes)  # its cursor moved on the last write: plan it again
                wake.append(now)
                break
            if outcome == "early":
                wake.append(plan.due_us)     # the store's clock has not reached it: again at the instant
            elif plan.wake_us is not None:
                wake.append(plan.wake_us)
        self.next_wake_us = min(wake) if wake else None
        return created

    def _carry(self, start: int, i: int, total: int, writes: int) -> None:
        """Leave ``order[i:]`` to the next pass, which starts with it; count and journal them."""
        self._resume = (start + i) % len(self._tasks)
        self.carried = total - i
        self._log("notice", "schedule.carried", tasks=self.carried, writes=writes)

    def _fire(self, head: TaskHead, key: str | None, trigger: str, instant: int | None,
              cursor: tuple[ScheduleCursor | None, ScheduleCursor] | None, plan: sch.Plan | None = None,
              now: int | None = None) -> str:
        """Write one fire (and cursor move); returns the store's outcome (``ScheduleStore.fire_schedule``)."""
        missed = plan.missed_text if plan is not None and plan.missed and key is not None else None
        outcome = self._store.fire_schedule(project_id=head.project_id, task_id=head.task_id, idempotency_key=key,
                                            trigger=trigger, scheduled_for_us=instant, actor=ACTOR, cursor=cursor,
                                            missed=missed)
        if outcome == "moved":
            return outcome
        if outcome == "early":
            self.clock_ahead = True
            self._log("notice", "schedule.early", task=head.name, instant_us=instant)
            return outcome
        if plan is not None and plan.clock_back_us > 1_000_000:
            self._log("warning", "clock.stepped_back", task=head.name, seconds=plan.clock_back_us // 1_000_000)
        if plan is not None and plan.dropped_us is not None:
            self._log("notice", "schedule.missed", task=head.name, catch_up=head.definition.catch_up,
                      late_s=(now - plan.dropped_us) // 1_000_000, missed=plan.missed_text)
        if missed:
            self._log("notice", "schedule.coalesced", task=head.name, missed=missed)
        if outcome == "skipped":
            self._note_skipped(head)
        return outcome

    def _note_skipped(self, head: TaskHead) -> None:
        """Journal ``schedule.skipped`` at most once per ``SKIP_LOG_EVERY_US`` per Task (the
        count of every skip is the store's, ``tasks.skipped_fires``)."""
        now = self._now()
        limit = self._skip_log.get(head.task_id)
        if limit is None:
            limit = self._skip_log[head.task_id] = LineLimit(1, SKIP_LOG_EVERY_US, now)
        left_out = limit.admit(now)
        if left_out is not None:
            self._log("notice", "schedule.skipped", task=head.name, reason="single_instance",
                      suppressed=left_out or None)
