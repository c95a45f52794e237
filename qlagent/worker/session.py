"""The Worker's Session (issue 11 §1–2): hello, adoption of held Leases, heartbeats, back-off."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import msgspec

from ..core.cluster import (MAX_ADOPT, MAX_HELD, AdoptClaim, HeartbeatRequest, HeldLease, SessionGrant,
                            hello_config_field)
from ..core.control import (ControlAuthError, ControlError, ControlTlsError, ControlUnreachable, RequestRefused,
                            SessionGone)
from ..core.errors import ValidationError
from ..core.leasefit import KILL_REAP_US          # after SIGKILL: reaping the tree (fencing's kill grace adds it)
from .policy import backoff, fencing, heartbeat
from ..core.inbox_states import InboxState
from ..core.states import KillReason
from .job import Job, LeaseHold, Owed


T = TypeVar("T")
REPLACED_RESET_US = 60_000_000          # a Session kept this long ends the back-off of session_replaced
NOT_READY_LOG_US = 60_000_000           # while stuck (no Session, refused credential), say why this often
MIN_CALL_S = 0.5                        # a call's bound never goes below this (a slow but live link)

def check_session_fit(interval_s: float, session_ttl_s: float) -> None:
    """``heartbeat.check_cadence`` of a Worker's ``heartbeat_interval_s`` (s) against the
    control plane's Session TTL (s; the Session and Lease TTLs are one table, and a run with no
    grace has the smallest fencing margin), so every run is renewed before its fencing starts.
    ValidationError naming ``worker.heartbeat_interval_s`` with both values and the largest
    interval that fits."""
    ttl_us = int(session_ttl_s * 1e6)
    try:
        heartbeat.check_cadence(interval_s, session_ttl_s, fencing.margin_us(ttl_us, KILL_REAP_US) / 1e6)
    except ValidationError as e:
        raise ValidationError("worker.heartbeat_interval_s",
                              f"{interval_s:g} s cannot renew the control plane's {session_ttl_s:g} s Session/Lease "
                              f"(session_ttl_s) in time (at most {max(e.limit, 0):.3f} s: "
                              f"{e.args[0].split(': ', 1)[-1]})", limit=e.limit) from None


class SessionDuty:
    """One duty of ``worker.runtime.WorkerRuntime`` (a mixin over the runtime's state: ``jobs``,
    ``inbox``, ``runs``, ``client``, ``session``): the Session."""

    def _fail(self, e: ControlError, what: str, delay: float | None = None) -> None:
        self.failures[what] += 1
        self.unreachable = isinstance(e, ControlUnreachable)
        if self.unreachable and what != "pull" and self.pull is not None:
            # The client moved on from a replica that gave no answer; the Pull likely waits on
            # it too: its kept request is sent again to the next one.
            self._drop_pull()
        if delay is None:
            delay = backoff.reconnect_delay_s(self.failures[what], self.rand())
            if e.retry_after_s:
                delay = max(delay, min(e.retry_after_s, backoff.DEFAULT_CAP_S))
            setattr(self, f"next_{what}_us", self.now() + int(delay * 1e6))
        level = "err" if isinstance(e, (ControlTlsError, ControlAuthError)) else "warning"
        suppressed = None
        if isinstance(e, ControlAuthError):
            # Every retry is refused the same way until the credential is replaced: one line a
            # minute, naming how many were left out.
            suppressed = self.auth_lines.admit(self.now())
            if suppressed is None:
                return
        self.log(level, f"worker.{what}_failed", code=e.code, error=str(e), retry_s=round(delay, 3),
                 suppressed=suppressed or None)

    def _rpc(self, call: Callable[[float], tuple[T, int | None]]) -> tuple[T, int | None, int]:
        """One request; its timeout never runs past the next fencing instant (a blocked call
        must not make a run outlive its Lease) nor a quarter of the systemd watchdog interval.
        ``call(timeout_s)`` is one typed call of the client (``ControlPort``). Returns (answer,
        database clock µs or None, local send time µs)."""
        sent = self.now()
        answer, server_now_us = call(self._limit_s(sent))
        if server_now_us is not None:
            # Database clock minus this one, from the answer's arrival: never later than the
            # truth (the database read its clock before the answer left).
            self.clock_offset_us = server_now_us - self.now()
        if self.unreachable:
            # The control plane answers again: what waited for the link goes now.
            self.unreachable = False
            self.failures = dict.fromkeys(self.failures, 0)
            self.next_send_us = self.next_pull_us = 0
        return answer, server_now_us, sent

    def _call_bound_s(self, sent: int) -> float:
        """How long one call sent at ``sent`` (µs) waits for an answer (s): the client's timeout,
        cut to an equal share per replica of the time left before the first of the Session's
        expiry (by its last renewal) and the fencing instants of the runs — a heartbeat one
        replica leaves unanswered gives up in time for each other one to renew there first —
        but at least ``MIN_CALL_S``."""
        ends = [self._stop_at(j) for j in self.jobs.values()
                if j.handle is not None and not j.fenced and j.kill_reason is None]
        ends = [t for t in (*ends, self.session_until_us) if t is not None]
        if not ends:
            return self.client.timeout_s
        share_s = (min(ends) - sent) / 1e6 / self.client.replicas
        return min(self.client.timeout_s, max(MIN_CALL_S, share_s))

    def _limit_s(self, sent: int) -> float:
        """How long a request sent at ``sent`` (µs) is waited for (s; ``_rpc``)."""
        limit = self._call_bound_s(sent)
        if self.stop_deadline_us is not None:
            limit = min(limit, (self.stop_deadline_us - sent) / 1e6)      # a stop fits the unit's timeout
        if self.notify is not None and self.notify.watchdog_us:
            # A call blocked on a dead link must not starve the watchdog: ping if due, and wait
            # at most a quarter of WATCHDOG_USEC (pings are due every half).
            self.notify.ping_if_due(sent)
            limit = min(limit, self.notify.watchdog_us / 4e6)
        for j in self.jobs.values():
            if j.handle is not None and not j.fenced and j.kill_reason is None and self._stop_at(j) is not None:
                limit = min(limit, (self._stop_at(j) - sent) / 1e6)
        return max(0.2, limit)

    def _connect(self) -> None:
        try:
            hello = msgspec.structs.replace(self.hello, adopt=tuple(self._adopt_claims()))
            grant, server_now_us, sent = self._rpc(lambda t: self.client.hello(hello, t))
            if not self.connected_once and server_now_us is not None:
                self._check_cadence(grant.expires_at_us - server_now_us)
            self._session_renewed(grant.expires_at_us, server_now_us, sent)
            self.session = (grant.session_id, grant.generation)
            self.counts["sessions"] += 1
            self.session_opened_us = self.now()
            self.connected_once = True
            self._unblocked()
            self.failures["connect"] = 0
            self.next_beat_us = self.now() + self._beat_delay_us()
            self.next_send_us = self.next_pull_us = 0
            self.log("info", "worker.session_opened", session=grant.session_id, generation=grant.generation,
                     slots=grant.slots, adopted=len(grant.adopted), refused=len(grant.refused))
            self._take_over(grant, server_now_us, sent)
            if grant.adopted:
                # An adopted Lease keeps the expiry it had: after a restart late in the Lease, less
                # than the fencing margin plus one interval may be left. Renew it in this pass.
                self.next_beat_us = 0
        except ControlError as e:
            self.session = None
            if isinstance(e, ControlTlsError) and not self.connected_once:
                # Every replica in a row refusing TLS at start-up is bad config (a wrong ca_file):
                # one line, exit 2. One of several (a certificate being rotated, a port without
                # TLS) is passed over like an unreachable one.
                self.tls_refusals += 1
                if self.tls_refusals >= self.client.replicas:
                    raise
            else:
                self.tls_refusals = 0
            field = hello_config_field(e.field) if isinstance(e, RequestRefused) else None
            if field is not None and not self.connected_once:
                # [worker] labels/executors/slots wider than the enrolment: the same hello would be
                # refused for ever, so it is bad config (one line naming the key, exit 2).
                why = e.message.rsplit(": ", 1)[-1]
                raise ValidationError(field, f"{why}; `qlagent workers enroll` decides what a Worker may claim") from None
            self._fail(e, "connect")
            self.clock_wait = e.code == "clock_not_set"
            self._block(e)
        except msgspec.DecodeError:
            self.session = None
            self._fail(ControlUnreachable("unreadable SessionGrant"), "connect")

    def _block(self, e: ControlError) -> None:
        """The Worker cannot work for ``e`` (no Session, or its credential refused): /readyz says
        so, and the journal once a minute while it lasts (``worker.not_ready``)."""
        self.blocked = (e.code, str(e))
        now = self.now()
        if now >= self.next_blocked_log_us:
            self.next_blocked_log_us = now + NOT_READY_LOG_US
            level = "err" if isinstance(e, (ControlTlsError, ControlAuthError)) else "warning"
            self.log(level, "worker.not_ready", code=e.code, error=str(e))

    def _unblocked(self) -> None:
        if self.blocked is not None:
            self.log("info", "worker.unblocked", was=self.blocked[0])
        self.blocked, self.next_blocked_log_us = None, 0

    def _adopt_claims(self) -> list[AdoptClaim]:
        """The Leases a new Session is asked to adopt (at most ``MAX_ADOPT``): rows whose run was
        started (barrier/started: re-attached, to be collected or spawned after an applied
        ``starting`` ACK) first, then completed rows still owing their completion or log chunks,
        then ``received`` rows: one whose ``starting`` ACK the control plane applied (its answer
        lost) is adopted and goes on (ACK replayed, barrier, spawn; never ``lost``); one still
        claimed is refused ``not_started`` and re-offered, as if it had not been named. A run
        being stopped for its Lease is not named; once it ended, its row is (its log still owed)."""
        held = [j for j in self.jobs.values() if not j.gone and (not j.fenced or j.entry.state == InboxState.COMPLETED)]
        rows = [j for j in held if j.entry.state in (InboxState.BARRIER, InboxState.STARTED)]
        rows += [j for j in held if j.entry.state == InboxState.COMPLETED]
        rows += [j for j in held if j.entry.state == InboxState.RECEIVED]
        return [AdoptClaim(attempt_id=j.attempt_id, lease_generation=j.entry.offer.lease_generation,
                           lease_token=j.entry.offer.lease_token) for j in rows[:MAX_ADOPT]]

    def _take_over(self, grant: SessionGrant, server_now_us: int | None, sent: int) -> None:
        """Rows of older Sessions after a hello: an adopted Lease goes on under the new Session
        (its fencing deadline from the Lease's expiry); a refused or unnamed one is gone."""
        adopted = {(a.attempt_id, a.lease_generation): a for a in grant.adopted}
        refused = {r.attempt_id: r.reason for r in grant.refused}
        for j in list(self.jobs.values()):
            if j.gone or j.session == self.session:
                continue
            a = adopted.get((j.attempt_id, j.entry.offer.lease_generation))
            if a is None:
                self._lease_gone(j, refused.get(j.attempt_id, "not_adopted"))
                continue
            j.session = self.session
            if j.lease == LeaseHold.LOST_KEPT:
                j.lease = LeaseHold.HELD        # a kept run is under a valid Lease again
            if server_now_us is not None:
                j.renewal = fencing.Renewal(sent_local_us=sent, server_now_us=server_now_us,
                                            expires_at_us=a.expires_at_us)
                self._tell_shim(j)
            self.log("info", "worker.lease_adopted", attempt=j.attempt_id, generation=grant.generation)

    def _check_cadence(self, ttl_us: int) -> None:
        """At start-up, the first Session's TTL (the Lease's is learnt only with an offer) must
        fit the heartbeat cadence (``check_session_fit``), or every run would be
        stopped before its first renewal: one line naming the key, exit 2. ``serve`` asks the
        same before it opens a Session; this catches a control plane that did not say. A Task's
        own grace is the control plane's to check (core.leasefit)."""
        check_session_fit(self.heartbeat_s, ttl_us / 1e6)

    def _beat_delay_us(self) -> int:
        return int(heartbeat.heartbeat_delay_s(self.heartbeat_s, self.rand()) * 1e6)

    def _held(self) -> list[HeldLease]:
        """The Leases of the current Session a heartbeat asks to renew (at most ``MAX_HELD``):
        rows whose run was started (barrier/started) and not self-fenced, a ``keep`` run
        included (it goes on, so its Lease should too), then completed rows whose completion or
        start failure the control plane has not acknowledged yet (their Lease must stay active for it to be
        accepted). Not named: fenced or gone rows (the run was stopped or dropped: its Lease
        must run out), ``received`` rows (the Attempt is still ``claimed``; the control plane
        renews only started Attempts), rows owing only log chunks (their Lease is completed)."""
        rows = [j for j in self.jobs.values() if not j.gone and not j.fenced and j.session == self.session]
        held = [j for j in rows if j.entry.state in (InboxState.BARRIER, InboxState.STARTED)]
        held += [j for j in rows if j.entry.state == InboxState.COMPLETED and Owed.COMPLETION_ACK in j.owed]
        return [HeldLease(attempt_id=j.attempt_id, lease_generation=j.entry.offer.lease_generation)
                for j in held[:MAX_HELD]]

    def _heartbeat(self) -> None:
        sid, gen = self.session
        until = None
        if self.clock_offset_us is not None:
            # The database-clock instant this Worker stops waiting for the answer (early, never
            # late): applied after it, the heartbeat would renew Leases of runs it may have
            # stopped meanwhile, so the control plane refuses it (heartbeat_late).
            now = self.now()
            until = now + int(self._limit_s(now) * 1e6) + self.clock_offset_us
        beat = HeartbeatRequest(session_id=sid, generation=gen, leases=tuple(self._held()), renew_until_us=until)
        try:
            hb, server_now_us, sent = self._rpc(lambda t: self.client.heartbeat(beat, t))
        except SessionGone as e:
            self.log("warning", "worker.session_gone", code=e.code)
            self._lose_session(e.code)
            return
        except ControlAuthError as e:
            # The credential is refused (rotated, Worker removed): nothing renews this Session
            # any more. It is given up, and hellos back off (capped) until one is accepted; they
            # journal the refusal.
            self._block(e)
            self._lose_session(e.code)
            return
        except ControlError as e:
            # No answer is not a lost Session: keep it (its Leases stay ours while they are
            # valid; fencing decides when they are not) and beat again at the usual cadence,
            # never later, or the Session would expire while the link is only slow. A replica
            # that gave no answer is followed at once by the next one (the client moved on):
            # one round over them, then the cadence.
            unanswered = isinstance(e, ControlUnreachable)
            delay_us = self._beat_delay_us()
            if unanswered and (self.failures["heartbeat"] + 1) % self.client.replicas:
                delay_us = 0
            self.next_beat_us = self.now() + delay_us
            self._fail(e, "heartbeat", delay_us / 1e6)
            if unanswered and self.failures["heartbeat"] >= self.client.replicas:
                # No replica answers: not ready, and the last round trip no longer says anything.
                self.heartbeat_rtt_us = None
                self._block(e)
            return
        except msgspec.DecodeError:
            return
        self.heartbeat_rtt_us = self.now() - sent
        self.next_beat_us = self.now() + self._beat_delay_us()
        self._session_renewed(hb.expires_at_us, server_now_us, sent)
        self.failures["heartbeat"] = 0
        self._unblocked()
        if self.replaced and self.now() - self.session_opened_us >= REPLACED_RESET_US:
            self.replaced = 0               # ours for a while: the other process is gone
        renewed = {x.attempt_id: x.expires_at_us for x in hb.leases}
        if server_now_us is not None and not self.ttl_us:
            # A restarted Worker has seen no offer yet: a renewed Lease's span (else the
            # Session's) stands in for the Lease TTL its ACKs renew.
            self.ttl_us = max(0, min(renewed.values(), default=hb.expires_at_us) - server_now_us)
        for j in self.jobs.values():
            # The heartbeat renewed these Leases of this Session to the expiry it answers.
            expires = renewed.get(j.attempt_id)
            if expires is not None and j.session == (sid, gen) and not j.gone and server_now_us is not None:
                j.renewal = fencing.Renewal(sent_local_us=sent, server_now_us=server_now_us,
                                            expires_at_us=expires)
                self._tell_shim(j)
        for aid in hb.cancel:
            for j in self.jobs.values():
                if j.attempt_id == aid and not j.cancel:
                    j.cancel = True
                    self.log("info", "worker.cancel", attempt=aid)
                    if j.handle is not None:
                        self._stop(j, KillReason.CANCEL)

    def _session_renewed(self, expires_at_us: int, server_now_us: int | None, sent: int) -> None:
        """A grant or heartbeat answer (sent at ``sent``, local µs) gave the Session this expiry
        (database µs): when it runs out unless renewed again (local µs, anchored at the send
        time: early, never late). No database clock: nothing is known."""
        if server_now_us is None:
            self.session_until_us = None
            return
        self.session_until_us = sent + max(0, expires_at_us - server_now_us)

    def _ttl(self, j: Job) -> int:
        # An offer rebuilt for a retried Pull shows only what is left of its Lease: the longest
        # span seen is the TTL (none is longer).
        return max(j.ttl_us, self.ttl_us)

    def _lose_session(self, code: str) -> None:
        self.session = None
        self.session_until_us = None
        if self.pull is not None:
            self._drop_pull()
        if code == "stale_generation":
            # Only a newer Session of this Worker makes ours stale, and this process opened none:
            # another process holds the same credential. Reconnecting at once would fence its
            # runs and it ours, in a loop of hellos; back off and say so.
            self.replaced += 1
            delay = backoff.reconnect_delay_s(self.replaced, self.rand())
            self.next_connect_us = self.now() + int(delay * 1e6)
            self.log("err", "worker.session_replaced", replaced=self.replaced, retry_s=round(delay, 3),
                     hint="another process uses this Worker's credential")

