"""Cron scheduling against the store: turns due instants into queued Runs, exactly once.

For each enabled Task with clock schedules, ``core.schedule.plan_due`` decides (pure) which
instant gets a Run; this module writes that Run (queued Run + claimed Attempt + run.created +
run.queued) and the Task's schedule cursor in ONE transaction under the idempotency key
``ql3:schedule:v1:{task}:{instant}``, so a restart or a second loop never creates it twice.
Single-instance Tasks skip a fire while a Run of theirs is live and count it
(``tasks.skipped_fires``, shown by ``task show``). ``@boot`` Tasks get one Run per service start.
A Task's catch-up policy (``core.schedule.apply_catch_up``) may refuse a late instant: journal
``schedule.missed``. Coalesced instants are counted in the journal and in the ``run.created``
event as ``missed`` (``"≥100"`` once capped).
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable

from ..adapters.sqlite import definitions as defs
from ..adapters.sqlite import runs as runs_repo
from ..application.store import LocalStore
from ..core import schedule as sch
from ..core.errors import NotFoundError
from ..core.models import TaskHead

ACTOR = "scheduler"


class Scheduler:
    def __init__(self, store: LocalStore, system_tz: str, clock_us: Callable[[], int],
                 log: Callable[..., None] = lambda *a, **k: None) -> None:
        self._store = store
        self._tz = system_tz
        self._now = clock_us
        self._log = log
        self._tasks: list[tuple[TaskHead, tuple[sch.Schedule, ...]]] = []
        self.next_wake_us: int | None = None
        self.created = 0
        self.skipped = 0

    def reload(self) -> int:
        """Re-read enabled Task heads (after a poke or SIGHUP); returns how many are scheduled."""
        heads = self._store.read(lambda c: defs.list_heads(c, None))
        self._tasks = [(h, tuple(sch.parse_schedule(s) for s in h.definition.schedules))
                       for h in heads if h.enabled]
        self.next_wake_us = None
        return len(self._tasks)

    def fire_boot(self, service_started_us: int) -> int:
        """Create the ``@boot`` Runs of this service start (F6); returns how many were created."""
        n = 0
        for head, scheds in self._tasks:
            if sch.has_boot(scheds):
                key = sch.boot_idempotency_key(head.task_id, service_started_us)
                n += self._store.write(lambda c, h=head, k=key: self._create(c, h, k, "boot", None))
        return n

    def fire_due(self) -> int:
        """Create Runs for every instant that is due now; sets ``next_wake_us``. Returns count."""
        now = self._now()
        created = 0
        wake: list[int] = []
        # One read of every cursor; a write transaction only for a Task that has an instant due,
        # no cursor yet, or a clock that stepped back (recorded and logged once). Writing every cursor at every wake-up would be a write per Task per
        # wake on a router's flash, for nothing: between due instants the cursor decides nothing.
        cursors = self._store.read(lambda c: {r[0]: (r[1], r[2]) for r in c.execute(
            "SELECT task_id, last_instant_us, observed_wall_us FROM schedule_cursors")})
        for head, scheds in self._tasks:
            if not any(s.kind == "cron" for s in scheds):
                continue
            tz = head.definition.timezone or self._tz
            cur = cursors.get(head.task_id)
            if cur is not None:
                plan = sch.plan_due(scheds, tz, cur[0], cur[1], now)
                if plan.due_us is None and plan.clock_back_us <= 1_000_000:
                    if plan.wake_us is not None:
                        wake.append(plan.wake_us)
                    continue
            # Planned again inside the transaction: another loop may have moved the cursor.
            created += self._store.write(lambda c, h=head, s=scheds, z=tz: self._plan_task(c, h, s, z, now, wake))
        self.next_wake_us = min(wake) if wake else None
        return created

    def _plan_task(self, c: sqlite3.Connection, head: TaskHead, scheds, tz: str, now: int, wake: list) -> int:
        row = c.execute("SELECT last_instant_us, observed_wall_us FROM schedule_cursors WHERE task_id = ?",
                        (head.task_id,)).fetchone()
        d = head.definition
        plan = sch.plan_due(scheds, tz, row[0] if row else None, row[1] if row else None, now)
        within = d.catch_up_within_ms * 1000 if d.catch_up_within_ms is not None else None
        plan = sch.apply_catch_up(plan, now, d.catch_up, within)
        if plan.wake_us is not None:
            wake.append(plan.wake_us)
        if plan.clock_back_us > 1_000_000:
            self._log("warning", "clock.stepped_back", task=head.name, seconds=plan.clock_back_us // 1_000_000)
        n = 0
        if plan.dropped_us is not None:
            self._log("notice", "schedule.missed", task=head.name, catch_up=d.catch_up,
                      late_s=(now - plan.dropped_us) // 1_000_000, missed=plan.missed_text)
        if plan.due_us is not None:
            if plan.missed:
                self._log("notice", "schedule.coalesced", task=head.name, missed=plan.missed_text)
            n = self._create(c, head, sch.idempotency_key(head.task_id, plan.due_us), "cron", plan.due_us,
                             plan.missed_text if plan.missed else None)
        c.execute("INSERT INTO schedule_cursors VALUES (?, ?, ?) ON CONFLICT(task_id) DO UPDATE SET "
                  "last_instant_us = excluded.last_instant_us, observed_wall_us = excluded.observed_wall_us",
                  (head.task_id, plan.last_instant_us, plan.observed_wall_us))
        return n

    def _create(self, c: sqlite3.Connection, head: TaskHead, key: str, trigger: str, instant: int | None,
                missed: str | None = None) -> int:
        if c.execute("SELECT 1 FROM runs WHERE project_id = ? AND idempotency_key = ?",
                     (head.project_id, key)).fetchone():
            return 0
        # Re-read the head inside the transaction: a Task edited or disabled since reload() wins.
        try:
            cur = defs.get_head(c, head.project_id, head.task_id)
        except NotFoundError:      # removed since reload()
            return 0
        if not cur.enabled:
            return 0
        if cur.definition.concurrency == "single" and runs_repo.live_run_count(c, cur.task_id):
            c.execute("UPDATE tasks SET skipped_fires = skipped_fires + 1 WHERE task_id = ?", (cur.task_id,))
            self.skipped += 1
            self._log("notice", "schedule.skipped", task=cur.name, reason="single_instance")
            return 0
        runs_repo.create_run(c, head=cur, origin="schedule", trigger_type=trigger, idempotency_key=key,
                             requested_by=ACTOR, now_us=self._now(), scheduled_for_us=instant,
                             fences={"missed": missed} if missed else None)
        self.created += 1
        return 1
