"""Launch-plan materialisation in the fixed order of ADR-0071 §4.

1 re-read the exact candidate → 2 pinned execution revision → 3 context recipe →
4 de-duplicated secrets → 5 merged, frozen, bounded environment → 6 statvfs capacity and
profile quota/reserve → 7 private log Artifact → 8 (the caller) start command to the
coordinator. Nothing exists on disk or in the process table before step 7; any refusal
before it leaves no file behind.

No silent skip: a candidate is skipped only when it lost a race (``race_lost``) or must wait
for something that can change (``single_instance``, ``network``); one that can never start as
it stands (missing revision, recipe or Secret, environment too large, something already at its
Artifact path) is failed with its reason.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import msgspec

from ..core import limits as L
from ..core.dispatch import Candidate, LaunchCommand, Plan, Refusal
from ..core.errors import QlError, StartError, UnavailableError
from ..core.profiles import Profile, run_memory_limit, run_memory_reserve
from .admission import Admission
from .secrets import resolve_secrets

if TYPE_CHECKING:   # ports are annotations only: no Protocol class at run time
    from ..core.ports import ArtifactPort, CipherFactory, DispatchStore, SecretStore

# Refusals that the agent's own old logs may cause: retention gives room back before them.
ROOM_REASONS = ("low_space", "artifact_quota_full")
WAITING_REMEMBERED = 64      # Runs whose memory wait was journaled (oldest forgotten: at most a repeat)

class Prepared(msgspec.Struct, frozen=True):
    """Outcome of one materialisation.

    ``kind``: ``ready`` (``command`` set), ``skip`` (race lost or the Run must wait: try the
    next candidate) or ``unavailable`` (report to the caller; nothing was created).
    """

    kind: str
    reason: str | None = None
    command: LaunchCommand | None = None
    refusal: Refusal | None = None       # the log Artifact's admission refused, with its figures


def identity_env(c: Candidate, plan: Plan) -> dict[str, str]:
    """The ``QL3_*`` run identity every task sees (names reserved by ADR-0071 §2)."""
    return {"QL3_RUN_ID": c.run_id, "QL3_ATTEMPT_ID": c.attempt_id, "QL3_PROJECT_ID": c.project_id,
            "QL3_TASK_ID": c.task_id, "QL3_TASK_NAME": plan.task_name, "QL3_TASK_REVISION": str(c.task_revision)}


def freeze_env(public: dict[str, str], secrets: dict[str, str], identity: dict[str, str],
               baseline: dict[str, str] | None = None) -> dict[str, str]:
    """Step 5: merge the run user's baseline (HOME, USER, LOGNAME, SHELL), recipe values,
    secret values and identity, each overriding the one before; enforce the kernel's bounds.

    Raises UnavailableError(code="env_too_large") — without the offending value — when an
    entry passes MAX_ARG_STRLEN or the whole passes MAX_ENV_TOTAL.
    """
    env = {**(baseline or {}), **public, **secrets, **identity}
    total = 0
    for k, v in env.items():
        n = len(k.encode()) + len(v.encode("utf-8", "surrogateescape")) + 2
        if n > L.MAX_ARG_STRLEN:
            raise UnavailableError(f"environment entry {k} is {n} bytes (limit {L.MAX_ARG_STRLEN})",
                                   code="env_too_large", field=k)
        total += n
    if total > L.MAX_ENV_TOTAL:
        raise UnavailableError(f"environment is {total} bytes (limit {L.MAX_ENV_TOTAL})", code="env_too_large")
    return dict(sorted(env.items()))


class Materializer:
    """Turns one candidate into a LaunchCommand, or says why not (see module docstring).

    ``baseline``: the run user's HOME/USER/LOGNAME/SHELL (recipe values override them; an
    unset ``cwd`` is the resulting HOME); ``log(priority, event, **fields)``: the journal;
    ``secrets``/``cipher``: where SecretRefs are read and opened (step 4).
    """

    def __init__(self, store: DispatchStore, secrets: SecretStore, cipher: CipherFactory, artifacts: ArtifactPort,
                 admission: Admission, profile: Profile, baseline: dict[str, str] | None = None,
                 log: Callable[..., None] = lambda *a, **k: None,
                 make_room: Callable[[int, Refusal], None] = lambda quota, refusal: None) -> None:
        self._store = store
        self._make_room = make_room
        self._secrets = secrets
        self._cipher = cipher
        self._artifacts = artifacts
        self._admission = admission
        self._profile = profile
        self._baseline = dict(baseline or {})
        self._log = log
        self._waiting: dict[str, str] = {}     # run ID → the memory wait already journaled
        self.waits: dict[str, int] = {}        # reason → ``run.waiting`` lines journaled (GET /metrics)

    def discard(self, artifact_path: str) -> None:
        """Remove a log file allocated by a pass that then lost the claim race."""
        self._artifacts.discard(artifact_path)

    def prepare(self, c: Candidate) -> Prepared:
        if not self._store.reread(c):                                   # 1
            return Prepared("skip", "race_lost")
        plan, missing = self._store.load_plan(c)                        # 2, 3
        if plan is None:
            self._store.fail_unlaunched(c, missing, None)
            return Prepared("unavailable", missing)
        blocked = self._admission.run_block(c, plan)
        if blocked == "memory_reserved" and self._waiting.get(c.run_id) != blocked:
            # Nothing else says why the Run sits queued; once per Run, not at every pass.
            if len(self._waiting) >= WAITING_REMEMBERED:
                self._waiting.pop(next(iter(self._waiting)))
            self._waiting[c.run_id] = blocked
            self.waits[blocked] = self.waits.get(blocked, 0) + 1
            self._log("notice", "run.waiting", run=c.run_id, reason=blocked,
                      reserve_bytes=run_memory_reserve(self._profile, plan.execution.memory_max))
        if blocked:
            return Prepared("skip", blocked)
        self._waiting.pop(c.run_id, None)
        try:
            plain = resolve_secrets(self._secrets, self._cipher, c.project_id,                # 4
                                    list(plan.recipe.secret_refs.values()))
            secret_env = {env: plain[name].decode("utf-8", "surrogateescape")
                          for env, name in plan.recipe.secret_refs.items()}
            del plain
            env = freeze_env(plan.recipe.public, secret_env, identity_env(c, plan), self._baseline)    # 5
        except UnavailableError as e:
            # The reason names the Secret or environment name at fault (a name, never a value).
            reason = e.code if e.field is None else f"{e.code}:{e.field}"
            self._store.fail_unlaunched(c, reason, plan.retry)
            return Prepared("unavailable", reason)
        quota = self._profile.log_max_bytes
        refused = self._artifacts.admit(quota)                          # 6
        if refused is not None and refused.reason in ROOM_REASONS:
            self._make_room(quota, refused)
            refused = self._artifacts.admit(quota)
        if refused is not None:
            return Prepared("unavailable", refused.reason, refusal=refused)
        try:
            path = self._artifacts.allocate(c.attempt_id)               # 7
        except StartError as e:                                         # something already at the path
            self._store.fail_unlaunched(c, e.code, plan.retry, e.message)
            self._log("warning", "run.start_failed", run=c.run_id, attempt=c.attempt_id, reason=e.code,
                      error=e.message)
            return Prepared("unavailable", e.code)
        except QlError as e:   # unsafe directory; unwritable (read-only, out of inodes): the Run waits
            return Prepared("unavailable", e.code, refusal=Refusal(e.code, e.field or "", error=e.message))
        ex = plan.execution
        return Prepared("ready", command=LaunchCommand(
            candidate=c, argv=tuple(ex.launch_argv()), env=env, cwd=ex.cwd or env.get("HOME") or "/",
            artifact_path=path, quota_bytes=quota, timeout_ms=plan.timeout_ms, grace_ms=plan.grace_ms,
            retry=plan.retry, umask=None if ex.umask is None else int(ex.umask, 8),
            keep_orphans=ex.keep_orphans, memory_max=run_memory_limit(self._profile, ex.memory_max),
            memory_reserve=run_memory_reserve(self._profile, ex.memory_max)))
