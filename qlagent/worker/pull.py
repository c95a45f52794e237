"""The Worker's long-polling Pull and the offers it brings into the inbox (issue 11 §3, §6)."""

from __future__ import annotations

import secrets as _secrets
import selectors
import uuid

import msgspec

from ..core.cluster import PullAnswer
from ..core.control import ControlError, PullTokenMismatch, RequestRefused, SessionGone
from ..core.errors import QlError
from ..core.inbox_states import InboxState, InboxOffer
from .policy import fencing, pacing
from .job import Job


DEFAULT_PULL_WAIT_S = 20


class PullDuty:
    """One duty of ``worker.runtime.WorkerRuntime`` (a mixin over the runtime's state: ``jobs``,
    ``inbox``, ``runs``, ``client``, ``session``): the Pull."""

    def _can_pull(self) -> bool:
        if self.session is None or self.stopping:
            return False
        live = sum(1 for j in self.jobs.values() if j.entry.state in InboxState.LIVE)
        # Room in the inbox = rows not yet acknowledged (``jobs``): acknowledged rows are pruned
        # when the next offer is received, so counting them would stop the Pulls for good once
        # the cap's worth of offers had been acknowledged.
        return live < self.slots and len(self.jobs) < self.inbox.max_rows

    def _maybe_pull(self) -> None:
        if self.pull is not None or not self._can_pull() or self.now() < self.next_pull_us:
            return
        sid, gen = self.session
        pending = self.inbox.begin_pull(sid, gen, str(uuid.uuid4()), _secrets.token_urlsafe(32))
        try:
            self.pull_sent_us = self.now()
            fd = self.client.start_pull(pending.body, self.pull_wait_s, self._limit_s(self.pull_sent_us))
        except ControlError as e:
            self._pull_error(e, pending.pull_id)
            return
        self.pull = (pending.pull_id, fd)
        self.counts["pulls"] += 1
        self.sel.register(fd, selectors.EVENT_READ, ("pull", None))

    def _drop_pull(self, moved: bool = False) -> None:
        """Forget the Pull in flight (its request stays kept and is sent again, byte for byte);
        ``moved``: its replica gave no answer, the next one is asked."""
        pull_id, fd = self.pull
        self.pull = None
        try:
            self.sel.unregister(fd)
        except (KeyError, ValueError):
            pass
        self.client.abort_poll(unanswered=moved)

    def _pull_deadline_us(self) -> int:
        """When the Pull in flight is given up (µs): its long poll plus a call's bound."""
        return self.pull_sent_us + int((self.pull_wait_s + self._call_bound_s(self.pull_sent_us)) * 1e6)

    def _finish_pull(self) -> None:
        if self.pull is None:
            return
        pull_id, fd = self.pull
        self.pull = None
        self.sel.unregister(fd)
        try:
            answer, server_now_us = self.client.finish_pull()
        except ControlError as e:
            self._pull_error(e, pull_id)
            return
        except msgspec.DecodeError:
            self.inbox.end_pull(pull_id)
            self.log("err", "worker.pull_refused", reason="unreadable_answer")
            return
        self.failures["pull"] = 0
        if answer.status != "offered" or answer.offer is None:
            self.inbox.end_pull(pull_id)
            if answer.status not in ("idle", "unmatched"):
                self.log("warning", "worker.pull_answer", status=answer.status, reason=answer.reason)
                self.next_pull_us = self.now() + 1_000_000
            else:
                self.next_pull_us = pacing.next_pull_after_idle_us(self.pull_sent_us, self.pull_wait_s, answer.reason)
            return
        self._receive(answer, server_now_us, pull_id)

    def _pull_error(self, e: ControlError, pull_id: str) -> None:
        if isinstance(e, PullTokenMismatch):
            self.inbox.end_pull(pull_id)
            return
        if isinstance(e, RequestRefused):
            self.inbox.end_pull(pull_id)
            self.log("err", "worker.pull_refused", code=e.code, field=e.field)
            self.next_pull_us = self.now() + 5_000_000
            return
        if isinstance(e, SessionGone):
            self._lose_session(e.code)
            self.log("warning", "worker.session_gone", code=e.code)
            return
        # The answer was lost: the kept request is sent again, byte for byte, after a pause.
        self.client.abort_poll()
        self._fail(e, "pull")

    def _receive(self, answer: PullAnswer, server_now_us: int | None, pull_id: str) -> None:
        o = answer.offer
        sid, gen = self.session
        if o.worker_id != self.worker_id or (o.session_id, o.generation) != (sid, gen) \
                or o.spec.attempt_id != o.attempt_id:
            self.inbox.end_pull(pull_id)
            self.log("err", "worker.offer_refused", offer=o.offer_id, reason="identity")
            return
        spec_doc = msgspec.to_builtins(o.spec)
        offer = InboxOffer(offer_id=o.offer_id, attempt_id=o.attempt_id, session_id=o.session_id,
                           generation=o.generation, lease_generation=o.lease_generation,
                           lease_expires_at_us=o.lease_expires_at_us, lease_token=o.lease_token,
                           spec_digest=o.spec_digest, spec=spec_doc)
        try:
            entry, new = self.inbox.receive(offer, pull_id)
        except QlError as e:              # offer_conflict, inbox_full, a bad field: reported, not kept
            self.inbox.end_pull(pull_id)
            self.log("err", "worker.offer_refused", offer=o.offer_id, code=e.code, field=e.field)
            return
        if not new and o.offer_id in self.jobs:
            return
        job = Job(entry, self._within_profile(o.spec), dict(o.secrets))
        if server_now_us is not None:
            job.ttl_us = max(0, o.lease_expires_at_us - server_now_us)
            self.ttl_us = max(self.ttl_us, job.ttl_us)
            job.renewal = fencing.Renewal(sent_local_us=self.pull_sent_us, server_now_us=server_now_us,
                                          expires_at_us=o.lease_expires_at_us)
        self.jobs[o.offer_id] = job
        self.log("info", "worker.offer", offer=o.offer_id, attempt=o.attempt_id, source=o.source)
        self._send_owed()

