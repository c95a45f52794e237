"""The shim's out-of-memory side (ARCHITECTURE.md "Shim contract", issue 22 §3): the
oom_score_adj of the shim and its task, the Run's cgroup the task joins, and the kernel's
oom_kill counts and memory figures read back for the receipt.

Part of the shim (``shim/main.py``): standard library only, no qlagent import, imported by its
plain name (``import oom``) because the shim runs as a script under ``python3 -I -S``; it
never imports main.py.
"""

import os

TASK_OOM_SCORE_ADJ = b"1000"   # the kernel's first choice in an OOM (the maximum)
SHIM_OOM_SCORE_ADJ = b"500"    # after the task, before the agent: killing a shim loses its run


def set_score_adj(value):
    """Raise this process's oom_score_adj to ``value`` (ASCII bytes; raising needs no
    privilege); ignored without /proc."""
    try:
        fd = os.open("/proc/self/oom_score_adj", os.O_WRONLY)
        try:
            os.write(fd, value)
        finally:
            os.close(fd)
    except OSError:
        pass


def join_cgroup(path):
    """In the forked child: move into the Run's cgroup (absolute directory ``path``); a refusal
    leaves the task where the shim is (under oom_score_adj only)."""
    try:
        fd = os.open(path + "/cgroup.procs", os.O_WRONLY)
        try:
            os.write(fd, b"%d" % os.getpid())
        finally:
            os.close(fd)
    except OSError:
        pass


def cgroup_value(path, key):
    """``key``'s number (int) in a flat-keyed cgroup file, or the file's one number (key None);
    None when the file or the number is not there."""
    try:
        with open(path) as f:
            for line in f:
                parts = line.split()
                if key is None and len(parts) == 1:
                    return int(parts[0])
                if len(parts) == 2 and parts[0] == key:
                    return int(parts[1])
    except (OSError, ValueError):
        return None
    return None


def kills(cgroup=None):
    """The oom_kill count (int) of the Run's cgroup, else of this process's memory cgroup (v1
    ``memory`` line, else v2 ``0::``), or None where there is none to read."""
    if cgroup is not None:
        n = cgroup_value(cgroup + "/memory.events", "oom_kill")
        if n is not None:
            return n
    try:
        with open("/proc/self/cgroup") as f:
            lines = [ln.rstrip("\n").split(":", 2) for ln in f]
    except OSError:
        return None
    paths = [("/sys/fs/cgroup/memory%s/memory.oom_control" % p) for _, c, p in lines if "memory" in c.split(",")]
    paths += [("/sys/fs/cgroup%s/memory.events" % p) for h, c, p in lines if h == "0" and c == ""]
    for path in paths:
        try:
            with open(path) as f:
                for line in f:
                    if line.startswith("oom_kill "):
                        return int(line.split()[1])
        except (OSError, ValueError):
            continue
    return None
