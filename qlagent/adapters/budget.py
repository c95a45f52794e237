"""Self-policed Profile budgets: the service tree's memory and PIDs (edge 128 MiB / 64).

systemd enforces MemoryMax/TasksMax; procd on OpenWrt enforces neither, so the agent refuses
new activations itself when the tree is near its budget (a reason code in STATUS and an event).

Source rule: the kernel's figures of the service's own cgroup whenever it has one, else a walk of
the process tree (PSS, so pages the agent and the shims share are not counted once per process):
each process's children from /proc/<pid>/task/<tid>/children and its PSS from
/proc/<pid>/smaps_rollup, about 0.1 ms per process of the tree; where the kernel has no children
files (CONFIG_PROC_CHILDREN off, as on OpenWrt) psutil finds them by reading every process's
parent, which costs 2–4 ms per 100 processes on the host and runs once per dispatcher pass. The service's cgroup is found from /proc/self/cgroup: on cgroup v2 (Debian 13,
OpenWrt ≥ 22.03; the cgroup2 mount from /proc/self/mountinfo, /sys/fs/cgroup/unified on a hybrid
host) the ``0::`` line — the agent's own directory, or its parent when the agent sits in a leaf
of it (``agent`` of a delegated subtree, procd's instance group) — whose memory.current,
memory.peak, memory.events, memory.stat, memory.max, pids.current and pids.max are read; on v1
the ``memory`` and ``pids`` lines (memory.usage_in_bytes, memory.max_usage_in_bytes,
memory.oom_control, memory.stat, memory.limit_in_bytes, pids.current, pids.max). Only a
cgroup named for the agent (systemd's qlagent.service, procd's services/qlagent) is its own: a
container's or a CI job's cgroup would charge every stranger in it to the edge budget.
"""

from __future__ import annotations

import os
import time

from ..core.profiles import PIDS_PER_RUN, MiB, Profile

MEMORY_HIGH_WATER = 0.85   # refuse activations above this share of the memory budget
CGROUP_ROOT = "/sys/fs/cgroup"
_FIND = object()           # BudgetMeter's default: find the service cgroup from /proc/self/cgroup


class Usage:
    """One reading. ``rss_bytes``: the tree's anonymous memory (v2 memory.stat ``anon``, v1
    ``total_rss``, else the PSS sum) — what admission compares, page cache left out because the
    kernel reclaims it; ``pids``: tasks in the tree. Kernel-only figures (None without a cgroup):
    ``current_bytes`` (memory.current: page cache included), ``peak_bytes``, ``oom_kills`` (the
    cgroup's OOM kills since it was made), ``memory_max`` / ``pids_max`` (None: no limit).
    ``source``: ``cgroup v2``, ``cgroup v1`` or ``psutil``."""

    __slots__ = ("rss_bytes", "pids", "current_bytes", "peak_bytes", "oom_kills", "memory_max", "pids_max",
                 "source")

    def __init__(self, rss_bytes: int, pids: int, current_bytes: int | None = None, peak_bytes: int | None = None,
                 oom_kills: int | None = None, memory_max: int | None = None, pids_max: int | None = None,
                 source: str = "psutil") -> None:
        self.rss_bytes, self.pids = rss_bytes, pids
        self.current_bytes, self.peak_bytes, self.oom_kills = current_bytes, peak_bytes, oom_kills
        self.memory_max, self.pids_max, self.source = memory_max, pids_max, source


class CgroupFiles:
    """The files of one service cgroup. ``version`` 2: ``memory_dir`` and ``pids_dir`` are the
    same directory; 1: one per controller. Either is None when that controller is not ours.
    v2 only: ``service_dir`` the service's cgroup, ``leaf_dir`` the one this process is in."""

    __slots__ = ("version", "memory_dir", "pids_dir", "service_dir", "leaf_dir")

    def __init__(self, version: int, memory_dir: str | None, pids_dir: str | None, service_dir: str | None = None,
                 leaf_dir: str | None = None) -> None:
        self.version, self.memory_dir, self.pids_dir = version, memory_dir, pids_dir
        self.service_dir, self.leaf_dir = service_dir, leaf_dir

    def _names(self) -> dict[str, str]:
        if self.version == 2:
            return {"current": "memory.current", "peak": "memory.peak", "max": "memory.max"}
        return {"current": "memory.usage_in_bytes", "peak": "memory.max_usage_in_bytes",
                "max": "memory.limit_in_bytes"}

    def read(self) -> dict:
        """Every figure the files give (bytes, counts); a missing or unreadable one is None."""
        out: dict = {"pids": None, "pids_max": None, "rss": None, "current": None, "peak": None,
                     "oom_kills": None, "memory_max": None}
        if self.pids_dir is not None:
            out["pids"] = _read_int(os.path.join(self.pids_dir, "pids.current"))
            out["pids_max"] = _read_limit(os.path.join(self.pids_dir, "pids.max"))
        if self.memory_dir is not None:
            names = self._names()
            stat = _read_keyed(os.path.join(self.memory_dir, "memory.stat"))
            out["rss"] = stat.get("anon" if self.version == 2 else "total_rss")
            out["current"] = _read_int(os.path.join(self.memory_dir, names["current"]))
            out["peak"] = _read_int(os.path.join(self.memory_dir, names["peak"]))
            events = "memory.events" if self.version == 2 else "memory.oom_control"
            out["oom_kills"] = _read_keyed(os.path.join(self.memory_dir, events)).get("oom_kill")
            limit = _read_limit(os.path.join(self.memory_dir, names["max"]))
            # v1 writes "no limit" as a page-rounded LONG_MAX.
            out["memory_max"] = None if limit is not None and limit >= 1 << 62 else limit
        return out


def _own(path: str) -> bool:
    return "qlagent" in os.path.basename(path.rstrip("/"))


def cgroup2_mount(mountinfo: str = "/proc/self/mountinfo") -> str | None:
    """Where the cgroup v2 hierarchy is mounted (/sys/fs/cgroup, or /sys/fs/cgroup/unified on a
    hybrid host), or None."""
    try:
        with open(mountinfo) as f:
            for line in f:
                fields = line.split()
                sep = fields.index("-")
                if fields[sep + 1] == "cgroup2":
                    return fields[4]
    except (OSError, ValueError, IndexError):
        return None
    return None


def find_service_cgroup(v2_root: str | None = None, proc_cgroup: str = "/proc/self/cgroup",
                        v1_root: str = CGROUP_ROOT, require_controllers: bool = True) -> CgroupFiles | None:
    """The calling process's service cgroup (module docstring), or None when it has none of its
    own. v2 (``v2_root``, default the cgroup2 mount) where the service's directory has the memory
    or pids files (any, with ``require_controllers`` False), else v1 under ``v1_root``."""
    try:
        with open(proc_cgroup) as f:
            lines = [ln.rstrip("\n").split(":", 2) for ln in f if ln.count(":") >= 2]
    except OSError:
        return None
    v2_root = v2_root or cgroup2_mount()
    for hid, ctrls, path in lines:
        if v2_root and hid == "0" and ctrls == "" and os.path.exists(os.path.join(v2_root, "cgroup.controllers")):
            leaf = v2_root + path.rstrip("/")
            svc = leaf if _own(leaf) else os.path.dirname(leaf) if _own(os.path.dirname(leaf)) else None
            if svc is None:
                break
            mem = svc if os.path.exists(os.path.join(svc, "memory.current")) else None
            pids = svc if os.path.exists(os.path.join(svc, "pids.current")) else None
            if mem or pids or not require_controllers:
                return CgroupFiles(2, mem, pids, svc, leaf)
    dirs: dict[str, str | None] = {"memory": None, "pids": None}
    for _, ctrls, path in lines:
        for c in dirs:
            if c in ctrls.split(","):
                d = f"{v1_root}/{c}{path.rstrip('/')}"
                probe = "memory.stat" if c == "memory" else "pids.current"
                if _own(d) and os.path.exists(os.path.join(d, probe)):
                    dirs[c] = d
    return CgroupFiles(1, dirs["memory"], dirs["pids"]) if any(dirs.values()) else None


# Where systemd (qlagent.service) and procd (services/qlagent) put the service, for `doctor`,
# which runs outside it.
SERVICE_CGROUPS = ("system.slice/qlagent.service", "services/qlagent")


def installed_service_cgroup(root: str = CGROUP_ROOT) -> CgroupFiles | None:
    """The running service's cgroup at its packaged place (v2, else v1), or None."""
    for rel in SERVICE_CGROUPS:
        d = os.path.join(root, rel)
        if os.path.exists(os.path.join(root, "cgroup.controllers")) and os.path.isdir(d):
            mem = d if os.path.exists(os.path.join(d, "memory.current")) else None
            pids = d if os.path.exists(os.path.join(d, "pids.current")) else None
            if mem or pids:
                return CgroupFiles(2, mem, pids)
        mem, pids = os.path.join(root, "memory", rel), os.path.join(root, "pids", rel)
        if os.path.isdir(mem) or os.path.isdir(pids):
            return CgroupFiles(1, mem if os.path.isdir(mem) else None, pids if os.path.isdir(pids) else None)
    return None


def budget_check(profile: Profile, running: bool, root: str = CGROUP_ROOT) -> tuple[bool, str]:
    """``doctor``'s budget line: the kernel's figures of the running service's cgroup. Not ok
    when the kernel enforces no memory or PID limit at or under the Profile's (procd without the
    controllers, a drop-in that lifted MemoryMax=): then only the agent's admission holds it.
    ``running``: a service holds the state directory (its lock), with or without that cgroup."""
    cg = installed_service_cgroup(root)
    if cg is None:
        where = ("the service runs outside a packaged cgroup (started by hand)" if running
                 else "service not running")
        return True, f"no service cgroup found ({where}): admission measures the process tree"
    k = cg.read()
    where = cg.memory_dir or cg.pids_dir
    def mib(v: int | None, none: str = "-") -> str:
        return none if v is None else str(v // MiB)
    mem = (f"memory {mib(k['current'])} MiB (peak {mib(k['peak'])}, anon {mib(k['rss'])}) "
           f"of {mib(k['memory_max'], 'max')}")
    pids = f"pids {'-' if k['pids'] is None else k['pids']} of {'max' if k['pids_max'] is None else k['pids_max']}"
    unbounded = [n for n, v, most in (("memory", k["memory_max"], profile.memory_bytes),
                                      ("pids", k["pids_max"], profile.pids)) if v is None or v > most]
    detail = f"cgroup v{cg.version} {where}: {mem}, {pids}, {k['oom_kills'] or 0} OOM kills"
    if unbounded:
        detail += f"; the kernel enforces no {'/'.join(unbounded)} limit within the {profile.name} profile"
    return not unbounded, detail


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _read_limit(path: str) -> int | None:
    """A memory.max/pids.max value; "max" (no limit) and an unreadable file are None."""
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    return None if text == "max" or not text.isdigit() else int(text)


def _read_keyed(path: str) -> dict[str, int]:
    """A flat-keyed file (memory.stat, memory.events, memory.oom_control) → {key: int}."""
    out: dict[str, int] = {}
    try:
        with open(path) as f:
            for line in f:
                k, _, v = line.partition(" ")
                if v.strip().isdigit():
                    out[k] = int(v)
    except OSError:
        pass
    return out


def _pss(pid: int) -> int:
    """Proportional set size (bytes): the agent and every shim map the same interpreter, and RSS
    would count those shared pages once per process (4 runs looked like 80 MiB more than they
    are). PSS shares them out, so the tree's sum is what the box really spends. The ``Pss:`` line
    of /proc/<pid>/smaps_rollup; psutil (smaps, then RSS) where that file is missing (Linux <
    4.14) or unreadable; 0 for a process that has gone."""
    try:
        with open(f"/proc/{pid}/smaps_rollup", "rb") as f:
            data = f.read()
        at = data.index(b"\nPss:") + 5
        return int(data[at:data.index(b"kB", at)]) * 1024
    except (OSError, ValueError):
        pass
    import psutil
    try:
        p = psutil.Process(pid)
        try:
            return p.memory_full_info().pss
        except (psutil.AccessDenied, AttributeError):
            return p.memory_info().rss
    except psutil.Error:
        return 0


def _tree(root: int) -> list[int] | None:
    """``root`` and its descendants (PIDs), from each one's /proc/<pid>/task/<tid>/children
    (a thread's own children: every thread is read); a process that ends meanwhile is skipped.
    None where ``root`` has no children file (the kernel lacks CONFIG_PROC_CHILDREN)."""
    try:
        tids = os.listdir(f"/proc/{root}/task")
        if not os.path.exists(f"/proc/{root}/task/{tids[0]}/children"):
            return None
    except (OSError, IndexError):
        return []
    found = [root]
    for pid in found:                      # grows while it is walked: breadth first
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                with open(f"/proc/{pid}/task/{tid}/children", "rb") as f:
                    found += [int(c) for c in f.read().split()]
            except (OSError, ValueError):
                continue
    return found


def _psutil_tree(root: int) -> list[int]:
    import psutil       # only where the kernel has no children files
    try:
        return [root, *(p.pid for p in psutil.Process(root).children(recursive=True))]
    except psutil.Error:
        return []


class BudgetMeter:
    """Reads the service tree's use; ``extra_roots`` are re-attached shims (not our children).
    ``cgroup`` is the service cgroup (default: ``find_service_cgroup()``; None: psutil only)."""

    def __init__(self, profile: Profile, cgroup=_FIND) -> None:
        self.profile = profile
        self.cgroup: CgroupFiles | None = find_service_cgroup() if cgroup is _FIND else cgroup
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
        k = self.cgroup.read() if self.cgroup is not None else {}
        pids, rss = k.get("pids"), k.get("rss")
        if pids is None or rss is None:
            procs: dict[int, None] = {}        # ordered, each PID once (a re-attached shim may be ours too)
            for root in (os.getpid(), *extra_roots):
                tree = _tree(root)
                procs.update(dict.fromkeys(_psutil_tree(root) if tree is None else tree))
            pids = pids if pids is not None else len(procs)
            rss = rss if rss is not None else sum(_pss(p) for p in procs)
        source = f"cgroup v{self.cgroup.version}" if self.cgroup is not None else "psutil"
        return Usage(rss, pids, k.get("current"), k.get("peak"), k.get("oom_kills"), k.get("memory_max"),
                     k.get("pids_max"), source)

    def limits(self, u: Usage) -> tuple[int, int]:
        """(memory bytes, PIDs) the tree may use: the Profile's, or the kernel's limit where it is
        lower (a smaller MemoryMax= or TasksMax= in a drop-in is what the kernel enforces)."""
        mem = min(self.profile.memory_bytes, u.memory_max or self.profile.memory_bytes)
        pids = min(self.profile.pids, u.pids_max or self.profile.pids)
        return mem, pids

    def block_reason(self, extra_roots: list[int] = ()) -> str | None:
        """``pids`` or ``memory`` when one more Run would pass the budget (``limits``), else None."""
        u = self.usage(extra_roots)
        mem, pids = self.limits(u)
        if u.pids + PIDS_PER_RUN > pids:
            return "pids"
        if u.rss_bytes > mem * MEMORY_HIGH_WATER:
            return "memory"
        return None
