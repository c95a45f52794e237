"""What the Worker owes the control plane per row (issue 11 §3–4): ACKs in order, the row's
advance through the inbox, its closing."""

from __future__ import annotations

import msgspec

from ..core.cluster import AckKind, MAX_CHUNK_BYTES, Ack, AckResult
from ..core.control import (AttemptNotFound, ControlError, ControlUnreachable, LeaseGone, PullTokenMismatch,
                            RequestRefused, SessionGone)
from ..core.inbox_states import InboxState, OutcomeKind, pull_body
from .policy import fencing
from .job import Job, Owed


class SendDuty:
    """One duty of ``worker.runtime.WorkerRuntime`` (a mixin over the runtime's state: ``jobs``,
    ``inbox``, ``runs``, ``client``, ``session``): owed sends."""

    def _owes(self, j: Job) -> bool:
        if j.gone:
            return False
        return (j.entry.state == InboxState.RECEIVED or Owed.RUNNING_ACK in j.owed or Owed.COMPLETION_ACK in j.owed
                or (j.entry.state == InboxState.COMPLETED and not j.log_done)
                or (j.handle is not None and self.runs.log_size(j.attempt_id) - j.uploaded >= MAX_CHUNK_BYTES))

    def _ack(self, j: Job, kind: str, **fields) -> AckResult:
        o = j.entry.offer
        ack = Ack(session_id=j.session[0], generation=j.session[1], attempt_id=o.attempt_id,
                  lease_generation=o.lease_generation, lease_token=o.lease_token, kind=kind, **fields)
        result, server_now_us, sent = self._rpc(lambda t: self.client.ack(ack, t))
        if kind in (AckKind.STARTING, AckKind.RUNNING) and server_now_us is not None and self._ttl(j):
            # A starting/running ACK extends the Lease to at least now + TTL.
            j.renewal = fencing.Renewal(sent_local_us=sent, server_now_us=server_now_us,
                                        expires_at_us=server_now_us + self._ttl(j))
            self._tell_shim(j)
        return result

    def _send_owed(self) -> None:
        for j in list(self.jobs.values()):
            if self.session is None:
                return
            try:
                self._advance(j)
                self.failures["send"] = 0
            except (LeaseGone, AttemptNotFound) as e:
                self._lease_gone(j, e.code)
            except SessionGone as e:
                if j.session != self.session:
                    # An older Session's Lease: the control plane fenced it when this Session opened.
                    self._lease_gone(j, e.code)
                else:
                    self.log("warning", "worker.session_gone", code=e.code)
                    self._lose_session(e.code)
                    return
            except RequestRefused as e:
                self.log("err", "worker.ack_refused", attempt=j.attempt_id, code=e.code, field=e.field)
                self._lease_gone(j, e.code)
            except ControlError as e:
                self._fail(e, "send")
                if isinstance(e, ControlUnreachable):
                    return              # no link: the others would fail the same way
                # An answered refusal (503 for a chunk…) holds back this Attempt only.
            except msgspec.DecodeError:
                self._fail(ControlUnreachable("unreadable answer"), "send")
                return

    def _lease_gone(self, j: Job, code: str) -> None:
        """The control plane no longer knows this Lease: self-fence by on_lease_loss, drop what was owed."""
        if j.entry.state == InboxState.ACKED:
            return                      # already closed (by the recovery or another path): nothing left
        self.log("warning", "worker.lease_gone", attempt=j.attempt_id, code=code)
        j.drop()
        j.owed -= {Owed.RUNNING_ACK, Owed.COMPLETION_ACK}
        if j.live:
            if j.spec.on_lease_loss == "kill" and j.kill_reason is None and not j.fenced:
                j.fence()
                if j.handle is not None:
                    self._stop(j, None)     # else once its task runs (``_on_start``)
            return                      # its exit closes the row
        if j.entry.state in (InboxState.RECEIVED, InboxState.BARRIER):
            self._close_row(j, {"kind": OutcomeKind.FENCED})
        elif j.entry.state == InboxState.COMPLETED:
            self._acked(j)

    def _advance(self, j: Job) -> None:
        st = j.entry.state
        if st == InboxState.RECEIVED:
            if j.fenced or j.gone:
                return
            self._ack(j, AckKind.STARTING)
            j.entry = self.inbox.advance(j.offer_id, InboxState.BARRIER)      # the crash barrier, fsync'd
            st = InboxState.BARRIER
        if st == InboxState.BARRIER and j.handle is None and not self.runs.exists(j.attempt_id):
            if j.secrets is None and j.spec.secret_refs and j.entry.pull_id is not None and not j.refetched:
                self._refetch_secrets(j)
            self._spawn(j)
        if Owed.RUNNING_ACK in j.owed:
            self._ack(j, AckKind.RUNNING)
            j.owed.discard(Owed.RUNNING_ACK)
        if j.handle is not None and not j.gone:
            self._upload(j, final=False)
        if Owed.COMPLETION_ACK in j.owed:
            out = j.entry.outcome
            if out["kind"] == OutcomeKind.START_FAILURE:
                self._ack(j, AckKind.START_FAILURE, start_error=out["startError"])
            else:
                self._ack(j, AckKind.COMPLETION, **{k: out.get(c) for k, c in _ACK_FIELDS})
            j.owed.discard(Owed.COMPLETION_ACK)
        if j.entry.state == InboxState.COMPLETED and not j.gone:
            if not j.log_done:
                self._upload(j, final=True)
            if j.log_done:
                self._acked(j)

    def _refetch_secrets(self, j: Job) -> None:
        """ADR-0108 rebuild after a restart (secret values are never kept): the Pull that brought
        ``j``, its pullId and lease token from the row, sent under the Session that holds the
        Lease now (the offer's, or the one that adopted it). While the Lease is active and the
        Attempt not yet ``running``, the control plane answers the same offer, secret values
        included. Any other answer leaves them missing (the spawn then fails
        ``secrets_unavailable``). Transport errors and a lost Session propagate to
        ``_send_owed``, which retries later."""
        o = j.entry.offer
        body = pull_body(j.session[0], j.session[1], j.entry.pull_id, o.lease_token)
        try:
            answer, _, _ = self._rpc(lambda t: self.client.pull(body, t))
        except (PullTokenMismatch, RequestRefused) as e:
            j.refetched = True
            self.log("warning", "worker.secrets_refetch_refused", attempt=j.attempt_id, code=e.code)
            return
        j.refetched = True
        got = answer.offer
        if answer.status != "offered" or got is None or (got.attempt_id, got.lease_generation, got.lease_token,
                                                         got.spec_digest) != (o.attempt_id, o.lease_generation,
                                                                              o.lease_token, o.spec_digest):
            self.log("warning", "worker.secrets_refetch_failed", attempt=j.attempt_id, status=answer.status,
                     reason=answer.reason)
            return
        j.secrets = dict(got.secrets)
        self.log("info", "worker.secrets_refetched", attempt=j.attempt_id)

    def _acked(self, j: Job) -> None:
        """Close ``j``'s row (completed → acked), remove its run directory, forget the Job.
        Idempotent: two legitimate paths can both end one row (after a restart the recovery
        closes a run its shim fenced, then the hello that did not adopt its Lease declares it
        gone), so a row already acked is only forgotten again. Any other move the inbox does
        not allow still raises IllegalInboxTransition."""
        if j.entry.state != InboxState.ACKED:
            # A run that ended (not fenced or lost: those leave nothing on purpose) with
            # keep_orphans may leave processes that must outlive this row: recorded with the ack.
            keep = j.spec.keep_orphans and (j.entry.outcome or {}).get("kind") == OutcomeKind.COMPLETION
            j.entry = self.inbox.advance(j.offer_id, InboxState.ACKED, keep_orphans=keep)
            unsent = self.runs.log_size(j.attempt_id) - j.uploaded
            if not j.log_done and unsent > 0:
                # The control plane no longer takes this Lease's chunks: the log is cut where it
                # stands there, and the cut recorded (never deleted unsent without a word).
                self.log("warning", "worker.log_truncated", attempt=j.attempt_id, bytes_dropped=unsent,
                         bytes_kept=j.uploaded, reason="lease_gone")
            self.runs.prune(j.attempt_id)
        self.jobs.pop(j.offer_id, None)

    def _close_row(self, j: Job, outcome: dict) -> None:
        """End a row that owes nothing more (lost, fenced): completed → acked, run dir removed;
        a row already acked stays as it is (``_acked``)."""
        if j.entry.state not in (InboxState.COMPLETED, InboxState.ACKED):
            j.entry = self.inbox.advance(j.offer_id, InboxState.COMPLETED, outcome)
        self._acked(j)

_ACK_FIELDS = (("exit_code", "exitCode"), ("signal", "signal"), ("kill_reason", "killReason"),
               ("bytes_kept", "bytesKept"), ("bytes_dropped", "bytesDropped"), ("peak_rss_bytes", "peakRssBytes"),
               ("cpu_time_us", "cpuTimeUs"), ("truncation_reason", "truncationReason"))

