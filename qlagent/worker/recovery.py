"""A restarted Worker's open inbox rows (ADR-0021): re-attach, collect, resend, report lost;
never a second spawn."""

from __future__ import annotations

import time

import msgspec

from ..core.cluster import ExecutionSpec
from ..core.inbox_states import InboxState, OutcomeKind, COLLECT, REATTACH, REPORT_LOST, RESEND, SPAWN, recovery_action
from .job import Job, Owed


class RecoveryDuty:
    """One duty of ``worker.runtime.WorkerRuntime`` (a mixin over the runtime's state: ``jobs``,
    ``inbox``, ``runs``, ``client``, ``session``): restart recovery."""

    def recover(self) -> dict[str, int]:
        """ADR-0021 restart: every open inbox row by ``recovery_action``; never a second spawn."""
        counts = {"reattached": 0, "collected": 0, "lost": 0, "resend": 0, "pending": 0, "strays": 0}
        for entry in self.inbox.open_entries():
            spec = msgspec.convert(entry.offer.spec, ExecutionSpec)
            job = Job(entry, self._within_profile(spec))
            aid = job.attempt_id
            h = self.runs.reattach(aid) if self.runs.exists(aid) else None
            action = recovery_action(entry.state, run_dir_exists=self.runs.exists(aid), alive=h is not None,
                                     receipt=self.runs.has_receipt(aid))
            if action == SPAWN:
                counts["pending"] += 1
            elif action == REATTACH:
                if entry.state == InboxState.BARRIER:
                    job.entry = self.inbox.advance(job.offer_id, InboxState.STARTED)
                job.handle = h
                job.owed.add(Owed.RUNNING_ACK)
                job.deadline_us = self._deadline(job, h.create_time)
                if job.spec.on_lease_loss == "kill":
                    job.stop_at_us = self.runs.lease_deadline(aid)
                self._watch(job)
                counts["reattached"] += 1
            elif action == COLLECT:
                self._complete(job)
                counts["collected"] += 1
            elif action == REPORT_LOST:
                # No ACK says "lost": the control plane's sweeper ends the Lease and the Attempt.
                # A task may still run without a shim this Worker can re-attach (killed between
                # the spawn and writing the shim's identity): it is stopped, so the Attempt the
                # control plane offers again never runs beside it.
                self.runs.kill_orphans(aid)
                self.log("warning", "worker.run_lost", attempt=aid)
                self._close_row(job, {"kind": OutcomeKind.LOST})
                counts["lost"] += 1
                continue
            elif action == RESEND:
                kind = entry.outcome.get("kind")
                if kind in (OutcomeKind.COMPLETION, OutcomeKind.START_FAILURE):
                    job.owed.add(Owed.COMPLETION_ACK)
                if kind not in (OutcomeKind.COMPLETION, OutcomeKind.FENCED):
                    job.owed.discard(Owed.LOG)
                counts["resend"] += 1
            if job.entry.state != InboxState.ACKED:     # _complete closes a fenced or receipt-less run
                self.jobs[job.offer_id] = job
        # Tasks of Attempts the inbox does not list (its state directory was wiped, a shim died
        # unseen) would run beside the copy the control plane offers again: stopped first. What
        # a keep_orphans run left on purpose (a VPN, a watchdog) is known, not a stray; an entry
        # no process carries any more is forgotten, so the table holds only live leftovers.
        kept, seen = self.inbox.kept_orphans(), set()
        strays = self.runs.stop_strays({j.attempt_id for j in self.jobs.values()} | kept, seen)
        self.inbox.forget_orphans(kept - seen)
        for aid, n in sorted(strays.items()):
            self.log("warning", "worker.stray_stopped", attempt=aid, processes=n)
        counts["strays"] = sum(strays.values())
        self.counts["reattached"] = counts["reattached"]
        return counts

    def _deadline(self, job: Job, started_epoch_s: float) -> int:
        elapsed_us = max(0, int((time.time() - started_epoch_s) * 1e6))
        return self.now() - elapsed_us + job.spec.timeout_ms * 1000

