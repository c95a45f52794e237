"""Worker Pull (ADR-0108, ADR-0014 §5 note): an authenticated Worker Session asks for work.

The Worker brings its Session, generation, a stable ``pullId`` (its offerId candidate: the
idempotency key of this request, kept until it has an answer) and a fresh high-entropy lease
token. One Pull is ONE transaction of the authority (``PullStore.pull_unit``), in the ADR-0014
§2 order: the Session authenticated and locked (its free slots counted under the lock, the
database clock read), then the Lease this pullId already created (the same request retried
after a lost response rebuilds the SAME answer from it; a different token with that pullId is
refused), then candidates read with the database clock, the Runs of each page locked and the
Runs other Pulls hold skipped (concurrent Pulls take different Runs instead of racing for the
first), Placement for THIS Session only, one plan at a time (``PullUnit.prepare``), the
ExecutionSpec sanitised, and the claim (same budgets as the dispatcher:
``dispatcher.CandidateClaimer``). Only the token's SHA-256 is stored on the Lease, with the
pullId; the answer's offerId is derived from the Lease (``offer.offer_id``). Secret values are
resolved only after the unit committed (ADR-0108); a Secret that is then missing or does not
decrypt fails closed: the Lease is released (``completed``), the Attempt ends ``start_failed``
with reason ``secret_missing:NAME`` / ``secret_unreadable:NAME`` (the name, never a value; event
``attempt.start_failed``), the Task's retry policy decides the Run, and the answer is
``lease_ended`` with that reason — never a 503 the Worker would retry against a Lease held until
it expires. The rebuild answers while the Lease is active and its Attempt ``claimed`` or
``starting`` (not yet ``running``), also to the Session that adopted the Lease (its sessionId
then replaces the first one in the request): a Worker restarted between its ``starting`` ACK and
the spawn gets the secret values again, the one thing it never kept (issue 11 §7).

A Pull of a Session whose earlier Pulls claimed through that walk first tries the usual case
in ONE call (``PullStore.quick_pull``): the Session checked as above and its first candidate
claimed when this replica has prepared that candidate's (Task, revision, Project, executor) for
this Session before (``PreparedClaims``: the sanitised spec and the Placement score of that
claim; a revision's rows are append-only and a Session's labels, executors and Projects fixed,
so the walk would decide the same again), the spec then copied with the new Run's identities.
Anything else (a candidate not prepared yet, a Session not current, a retried pullId, a claim
refused) runs the whole unit.

With ``wait_s`` > 0 (at most 30 s) a Pull that found nothing long-polls: it waits on the
CandidateSignal (LISTEN/NOTIFY, no polling loop) and tries again when woken, until the wait is
spent; the answer is then ``idle``/``unmatched`` as usual. Candidates another Pull held when this
one read (skipped, then released unclaimed: that Worker did not match) are not announced again,
so a waiting Pull that found nothing asks whether any were held (``PullUnit.held_elsewhere``)
and, while some are, looks again after a pause (~20 ms, doubling up to ``HELD_PAUSE_MAX_S``; a
NOTIFY ends it early) instead of only waiting for the next NOTIFY, until its wait is spent.
"""

from __future__ import annotations

import random
import threading
import time

import msgspec

from ..core.canonical import sha256_hex
from ..core.cluster import (CandidateSignal, ClaimedExecutionOffer, ExecutionSpec, PullAnswer, PullRequest, PullStore,
                            PullUnit, QuickPull, QuickStatus, SecretResolver)
from ..core.errors import ConflictError, UnavailableError, ValidationError
from ..core.states import AttemptState, LeaseState
from .registry import check_token
from .dispatcher import (BudgetExhausted, CandidateClaimer, CycleCounts, DispatcherBudgets, FailClosed, build_offer,
                         check_budgets)
from .execspec import sanitize
from .placement import score, with_executor
from .registry import check_generation, check_uuid, credential_digest


MAX_WAIT_S = 30
SECRET_FAILURES = ("secret_missing", "secret_unreadable")    # a claimed offer that fails closed
HELD_PAUSE_S = 0.02        # mean first pause (s) before looking again at held candidates: a Pull's
                           # transaction lasts milliseconds; each further pause doubles
HELD_PAUSE_MAX_S = 0.25    # longest such pause: at most ~125 looks in a 30 s long-poll
PREPARED_SESSIONS = 256    # Sessions whose prepared claims a replica keeps
PREPARED_KEYS = 16         # prepared (Task, revision, Project, executor) keys kept per Session


def claim_key(task_id: str, task_revision: int, project_id: str, executor_type: str) -> str:
    """``task:revision:project:executor``: what a prepared claim is kept under (``ql_pull``
    builds the same from the candidate)."""
    return f"{task_id}:{task_revision}:{project_id}:{executor_type}"


class PreparedClaims:
    """Per Session, the claims the ADR-0014 walk made: key (``claim_key``) → (sanitised spec of
    that claim, its Placement score). Bounded: at most ``PREPARED_SESSIONS`` Sessions (the one
    least recently stored dropped first) of ``PREPARED_KEYS`` keys each (the oldest dropped
    first). Route threads share it."""

    def __init__(self) -> None:
        self._by_session: dict[str, dict[str, tuple[ExecutionSpec, int | None]]] = {}
        self._lock = threading.Lock()

    def of(self, session_id: str) -> dict[str, tuple[ExecutionSpec, int | None]]:
        """A copy of the Session's prepared claims (empty when none)."""
        with self._lock:
            return dict(self._by_session.get(session_id, ()))

    def put(self, session_id: str, offer: ClaimedExecutionOffer) -> None:
        """Keep the spec and score of a claim the walk made for ``session_id``."""
        key = claim_key(offer.task_id, offer.task_revision, offer.project_id, offer.spec.executor_type)
        with self._lock:
            keys = self._by_session.pop(session_id, None)
            if keys is None:
                keys = {}
                while len(self._by_session) >= PREPARED_SESSIONS:
                    del self._by_session[next(iter(self._by_session))]
            keys.pop(key, None)
            while len(keys) >= PREPARED_KEYS:
                del keys[next(iter(keys))]
            keys[key] = (offer.spec, offer.placement_score)
            self._by_session[session_id] = keys


class WorkerPull:
    """ADR-0108 Pull over the Pull store (``PgDispatchStore``: its units also rebuild plans) and
    the secret resolver; ``signal`` enables long-polling. Budgets as the dispatcher's (refused
    over a ceiling)."""

    def __init__(self, store: PullStore, secrets: SecretResolver, budgets: DispatcherBudgets = DispatcherBudgets(),
                 signal: CandidateSignal | None = None) -> None:
        self._b = check_budgets(budgets)
        self._store, self._secrets = store, secrets
        self._signal = signal
        self._claimer = CandidateClaimer(self._b)
        self._prepared = PreparedClaims()
        self._count_lock = threading.Lock()
        self.offers = 0        # Pulls answered with an offer since start (GET /metrics); route threads add

    def _count(self, answer: PullAnswer) -> PullAnswer:
        if answer.status == "offered":
            with self._count_lock:
                self.offers += 1
        return answer

    def pull(self, worker_id: str, credential: str, req: PullRequest, wait_s: float = 0) -> PullAnswer:
        """Answer one Pull, long-polling up to ``wait_s`` seconds (0..30; needs a signal).
        Raises ValidationError (a field), WorkerAuthError, ConflictError (stale_generation,
        session_expired, pull_token_mismatch) or UnavailableError."""
        if not isinstance(wait_s, (int, float)) or not 0 <= wait_s <= MAX_WAIT_S or (wait_s and not self._signal):
            raise ValidationError("waitS", f"must be 0..{MAX_WAIT_S} (and needs a candidate signal)",
                                  limit=MAX_WAIT_S)
        deadline = time.monotonic() + wait_s
        pause = HELD_PAUSE_S
        while True:
            seq = self._signal.seq() if self._signal else 0
            answer, held = self._pull_once(worker_id, credential, req, wait_s > 0)
            left = deadline - time.monotonic()
            if answer.status not in ("idle", "unmatched") or answer.reason in ("draining", "no_free_slot") \
                    or left <= 0:
                return self._count(answer)
            if held:
                # Concurrent Pulls held candidates this one skipped; they release them unclaimed
                # (another Worker's Placement) without a NOTIFY, so look again shortly. Under a
                # load that keeps them held longer, every look is a transaction: back off.
                if not self._signal.wait(seq, min(left, pause * (0.5 + random.random()))) \
                        and self._signal.seq() != seq:
                    # Not woken, yet moved: the signal closed (shutdown), or in the instant
                    # after the timeout a wake-up came; either way this answer stands.
                    return answer
                pause = min(pause * 2, HELD_PAUSE_MAX_S)
            elif not self._signal.wait(seq, left):
                return answer

    def _pull_once(self, worker_id: str, credential: str, req: PullRequest,
                   waiting: bool) -> tuple[PullAnswer, bool]:
        """(the answer, whether candidates were held by concurrent Pulls: asked only of a
        ``waiting`` Pull that found nothing)."""
        digest = credential_digest(credential)
        check_uuid("pullId", req.pull_id)
        token_digest = sha256_hex(check_token("leaseToken", req.lease_token).encode())
        worker_id, session_id = check_uuid("workerId", worker_id), check_uuid("sessionId", req.session_id)
        generation = check_generation("generation", req.generation)
        try:
            prepared = self._prepared.of(session_id)
            if prepared:
                quick = self._store.quick_pull(worker_id, digest, session_id, generation, req.pull_id, token_digest,
                                               self._b.lease_ttl_s * 1_000_000, list(prepared), waiting)
                if quick.status == QuickStatus.NO_OFFER:
                    return PullAnswer(status="idle", reason=quick.reason), quick.held
                if quick.status == QuickStatus.LEASED:
                    return self._offered(self._quick_offer(quick, prepared, req.lease_token)), False
            answer, held = self._store.pull_unit(worker_id, digest, session_id, generation, req.pull_id,
                                                 lambda unit: self._decide(unit, req, token_digest, waiting))
        except ConflictError as e:
            if e.code != "lease_exists":
                raise
            return PullAnswer(status="refused", reason="lease_exists"), False
        if answer.offer is None:
            return answer, held
        return self._offered(answer.offer), False

    @staticmethod
    def _quick_offer(quick: QuickPull, prepared: dict, token: str) -> ClaimedExecutionOffer:
        """The offer of a quick claim: the prepared spec of its key with the claimed Run's and
        Attempt's identities (its environment tables copied: no offer shares one)."""
        c = quick.candidate
        spec, score = prepared[claim_key(c.task_id, c.task_revision, c.project_id, c.executor_type)]
        spec = msgspec.structs.replace(spec, run_id=c.run_id, attempt_id=c.attempt_id, env=dict(spec.env),
                                       secret_refs=dict(spec.secret_refs))
        return build_offer(c, quick.lease, spec, token, "new_claim", score)

    def _decide(self, unit: PullUnit, req: PullRequest, token_digest: str, waiting: bool) -> tuple[PullAnswer, bool]:
        """The answer of one Pull inside its unit (ADR-0014 §2 order; see the module docstring)."""
        answer = self._answer(unit, req, token_digest)
        if waiting and answer.status in ("idle", "unmatched") and answer.reason not in ("draining", "no_free_slot"):
            return answer, unit.held_elsewhere(unit.now_us)
        return answer, False

    def _answer(self, unit: PullUnit, req: PullRequest, token_digest: str) -> PullAnswer:
        w = unit.worker
        prior = unit.prior()
        if prior is not None:
            lease, c, attempt_state = prior
            if lease.token_digest != token_digest:
                raise ConflictError("this pullId was answered with another lease token", code="pull_token_mismatch")
            if lease.state != LeaseState.ACTIVE or attempt_state not in (AttemptState.CLAIMED, AttemptState.STARTING):
                return PullAnswer(status="lease_ended", reason=f"attempt_{attempt_state}"
                                  if lease.state == LeaseState.ACTIVE else f"lease_{lease.state}")
            plan = unit.prepare(c)
            if plan is None:
                return PullAnswer(status="refused", reason="recovery_plan_missing")
            try:
                spec = sanitize(plan.spec, c)
                placement = with_executor(plan.placement, c.executor_type)
            except ValidationError:
                return PullAnswer(status="refused", reason="recovery_plan_drift")
            offer = build_offer(c, lease, spec, req.lease_token, "new_claim", score(placement, w))
            return PullAnswer(status="offered", reason="new_claim", offer=offer)
        if w.draining:
            return PullAnswer(status="idle", reason="draining")
        if w.free_slots <= 0:
            return PullAnswer(status="idle", reason="no_free_slot")
        n = CycleCounts()
        try:
            offer = self._claimer.run(unit, unit, unit.now_us, n, lambda: [w], lambda c, _w: req.lease_token,
                                      req.pull_id)
        except FailClosed as e:
            return PullAnswer(status="refused", reason=e.reason)
        except BudgetExhausted as e:
            return PullAnswer(status="truncated", reason=e.reason)
        if offer is None:
            return PullAnswer(status="unmatched" if n.skipped else "idle", reason=n.skip_reason)
        # The walk prepared this key's plan and matched this Session: its next Pulls claim quick.
        self._prepared.put(w.session_id, offer)
        return PullAnswer(status="offered", reason="new_claim", offer=offer)

    def _offered(self, offer: ClaimedExecutionOffer) -> PullAnswer:
        """The claimed offer with its Secret values, or its fail-closed end (module docstring).
        Any other UnavailableError (the authority unreachable) propagates: the Worker retries
        the same pull and gets the same Lease."""
        refs = offer.spec.secret_refs
        if not refs:
            return PullAnswer(status="offered", reason="new_claim", offer=offer)
        try:
            values = self._secrets.resolve(offer.project_id, sorted(set(refs.values())))
        except UnavailableError as e:
            if e.code not in SECRET_FAILURES:
                raise
            reason = f"{e.code}:{e.field}"
            self._store.fail_claimed(offer.attempt_id, offer.lease_generation, reason)
            return PullAnswer(status="lease_ended", reason=reason)
        return PullAnswer(status="offered", reason="new_claim", offer=msgspec.structs.replace(
            offer, secrets={env: values[name] for env, name in sorted(refs.items())}))
