"""Self-policed Profile budgets: the service tree's memory and PIDs (edge 128 MiB / 64).

systemd enforces MemoryMax/TasksMax; procd on OpenWrt enforces neither, so the agent refuses
new activations itself when the tree is near its budget (a reason code in STATUS and an event).
Figures come from the service's cgroup when it has one of its own (pids.current,
memory.stat total_rss), else from walking the process tree with psutil (PSS, so pages the
agent and the shims share are not counted once per process).
"""

from __future__ import annotations

import os
import time

import psutil

from ..core.profiles import Profile

PIDS_PER_RUN = 4           # shim + task + a little headroom for what the task forks
MEMORY_HIGH_WATER = 0.85   # refuse activations above this share of the memory budget


class Usage:
    __slots__ = ("rss_bytes", "pids")

    def __init__(self, rss_bytes: int, pids: int) -> None:
        self.rss_bytes, self.pids = rss_bytes, pids


def _cgroup_v1_file(controller: str, name: str) -> str | None:
    try:
        with open("/proc/self/cgroup") as f:
            for line in f:
                _, ctrls, path = line.rstrip("\n").split(":", 2)
                if controller in ctrls.split(","):
                    # Only a cgroup named for the agent (systemd's qlagent.service, procd's
                    # services/qlagent) is its own: a container's or a CI job's cgroup would
                    # charge every stranger in it to the edge budget and block all Runs.
                    p = f"/sys/fs/cgroup/{controller}{path}/{name}"
                    own = "qlagent" in os.path.basename(path)
                    return p if own and os.path.exists(p) else None
    except OSError:
        return None
    return None


def _read_rss(path: str | None) -> int | None:
    """``total_rss`` from a v1 memory.stat: page cache of written logs is reclaimable, so it
    must not count as the agent's memory."""
    if path is None:
        return None
    try:
        with open(path) as f:
            for line in f:
                if line.startswith("total_rss "):
                    return int(line.split()[1])
    except (OSError, ValueError):
        return None
    return None


def _read_int(path: str | None) -> int | None:
    if path is None:
        return None
    try:
        with open(path) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _pss(p: psutil.Process) -> int:
    """Proportional set size: the agent and every shim map the same interpreter, and RSS
    would count those shared pages once per process (4 runs looked like 80 MiB more than they
    are). PSS shares them out, so the tree's sum is what the box really spends."""
    try:
        return p.memory_full_info().pss
    except (psutil.AccessDenied, AttributeError):
        try:
            return p.memory_info().rss
        except psutil.Error:
            return 0
    except psutil.Error:
        return 0


class BudgetMeter:
    """Reads the service tree's use; ``extra_roots`` are re-attached shims (not our children)."""

    def __init__(self, profile: Profile) -> None:
        self.profile = profile
        self._me = psutil.Process()
        self._pids_file = _cgroup_v1_file("pids", "pids.current")
        self._mem_file = _cgroup_v1_file("memory", "memory.stat")
        self._last: tuple[float, Usage] | None = None

    def recent(self, max_age_s: float, extra_roots: list[int] = ()) -> Usage:
        """The figures measured within ``max_age_s`` (by an admission check in the same loop
        iteration), else fresh ones: STATUS need not walk the tree a second time."""
        if self._last is not None and time.monotonic() - self._last[0] <= max_age_s:
            return self._last[1]
        return self.usage(extra_roots)

    def usage(self, extra_roots: list[int] = ()) -> Usage:
        u = self._measure(extra_roots)
        self._last = (time.monotonic(), u)
        return u

    def _measure(self, extra_roots: list[int]) -> Usage:
        pids = _read_int(self._pids_file)
        rss = _read_rss(self._mem_file)
        if pids is None or rss is None:
            procs = [self._me]
            try:
                procs += self._me.children(recursive=True)
            except psutil.Error:
                pass
            for pid in extra_roots:
                try:
                    root = psutil.Process(pid)
                    procs += [root, *root.children(recursive=True)]
                except psutil.Error:
                    continue
            total = 0
            for p in procs:
                total += _pss(p)
            pids = pids if pids is not None else len(procs)
            rss = rss if rss is not None else total
        return Usage(rss, pids)

    def block_reason(self, extra_roots: list[int] = ()) -> str | None:
        """``pids`` or ``memory`` when one more Run would pass the Profile budget, else None."""
        u = self.usage(extra_roots)
        if u.pids + PIDS_PER_RUN > self.profile.pids:
            return "pids"
        if u.rss_bytes > self.profile.memory_bytes * MEMORY_HIGH_WATER:
            return "memory"
        return None
