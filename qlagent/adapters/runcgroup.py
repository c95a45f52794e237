"""Each Run's task tree in a cgroup of its own (issue 22 §3), where the service has a delegated
cgroup v2 subtree: systemd ``Delegate=yes``, or procd's ``services/qlagent`` that the OpenWrt
init script hands to the qlagent user.

Layout under the service cgroup S (``budget.find_service_cgroup``): the agent and every shim in a
leaf of S (``S/agent``, which the agent moves itself into when it finds itself in S itself —
v2's no-internal-processes rule lets S give controllers to its children only while no process
sits in S; or procd's instance leaf), each Run's task tree in ``S/run-<attempt>`` with
``memory.max`` = the Run's limit (core.profiles.run_memory_limit) and ``memory.oom.group`` = 1,
so an OOM kill takes the whole tree at once and never the agent or the shim that records it.
The shim's forked child joins the Run's cgroup before it execs the task; the shim reads
``memory.events`` and ``memory.peak`` there for the receipt. The cgroup outlives an agent
restart with its tasks (re-attach needs nothing of it) and is removed once its Run's facts are
in the store. Where no subtree can be had (cgroup v1, no delegation, read-only
/sys/fs/cgroup) ``enabled`` is False and ``reason`` says why: Runs then rely on oom_score_adj.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from .budget import cgroup2_mount, find_service_cgroup

if TYPE_CHECKING:   # annotations only: psutil is imported where a process is walked
    import psutil

AGENT_LEAF = "agent"
RUN_PREFIX = "run-"
CONTROLLERS = ("memory", "pids")


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


class RunCgroups:
    """``service_dir``: S, or None. ``enabled``/``reason`` after ``setup``."""

    def __init__(self, service_dir: str | None) -> None:
        self.service_dir = service_dir
        self.enabled = False
        self.reason = "no cgroup v2 service cgroup of its own"
        self.memory = False          # the memory controller reaches the run cgroups

    @classmethod
    def setup(cls, proc_cgroup: str = "/proc/self/cgroup", root: str | None = None) -> RunCgroups:
        """Find S for this process (``root``: the cgroup2 mount, found when None), move it into
        its leaf when it sits in S, and enable the controllers S offers its children. Never
        raises: a refusal leaves ``enabled`` False."""
        root = root or cgroup2_mount()
        cg = find_service_cgroup(root, proc_cgroup, require_controllers=False) if root else None
        if cg is None or cg.version != 2:
            return cls(None)
        rc = cls(cg.service_dir)
        rc._enable(cg.leaf_dir)
        return rc

    def _enable(self, leaf: str) -> None:
        s = self.service_dir
        try:
            if leaf == s:
                os.makedirs(os.path.join(s, AGENT_LEAF), exist_ok=True)
                _write(os.path.join(s, AGENT_LEAF, "cgroup.procs"), str(os.getpid()))
            with open(os.path.join(s, "cgroup.controllers")) as f:
                offered = f.read().split()
            wanted = [c for c in CONTROLLERS if c in offered]
            if wanted:
                _write(os.path.join(s, "cgroup.subtree_control"), " ".join("+" + c for c in wanted))
            if not os.access(os.path.join(s, "cgroup.procs"), os.W_OK):
                raise PermissionError(13, "cgroup.procs not writable (no delegation)")
        except OSError as e:
            self.reason = f"{s}: {e.strerror or e}"
            return
        self.enabled, self.reason = True, f"run cgroups under {s}"
        self.memory = "memory" in wanted

    def path(self, attempt_id: str) -> str:
        return os.path.join(self.service_dir, RUN_PREFIX + attempt_id)

    def create(self, attempt_id: str, memory_max: int | None) -> str | None:
        """The Run's cgroup with its limit, or None (not enabled, or the kernel refused: the Run
        goes on without one, under oom_score_adj)."""
        if not self.enabled:
            return None
        d = self.path(attempt_id)
        try:
            os.makedirs(d, exist_ok=True)
            if self.memory:
                if memory_max is not None:
                    _write(os.path.join(d, "memory.max"), str(memory_max))
                _write(os.path.join(d, "memory.oom.group"), "1")
                if os.path.exists(os.path.join(d, "memory.swap.max")):
                    _write(os.path.join(d, "memory.swap.max"), "0")   # a hog is killed, not swapped
        except OSError:
            self.remove(attempt_id)
            return None
        return d

    def members(self, attempt_id: str) -> dict[int, psutil.Process]:
        """The processes in the Run's cgroup (none when it has no cgroup)."""
        if self.service_dir is None:
            return {}
        try:
            with open(os.path.join(self.path(attempt_id), "cgroup.procs")) as f:
                pids = [int(p) for p in f.read().split()]
        except OSError:
            return {}
        import psutil           # only for a Run's members: a service start does not load it here
        found = {}
        for pid in pids:
            try:
                found[pid] = psutil.Process(pid)
            except psutil.NoSuchProcess:
                continue
        return found

    def remove(self, attempt_id: str) -> None:
        """Remove the Run's cgroup once no process is left in it (EBUSY: a ``keep_orphans``
        daemon still runs there under the Run's limit; the cgroup stays)."""
        if self.service_dir is None:
            return
        try:
            os.rmdir(self.path(attempt_id))
        except OSError:
            pass
