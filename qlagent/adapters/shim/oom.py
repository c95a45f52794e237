"""The shim's out-of-memory side (ARCHITECTURE.md "Shim contract", issue 22 §3): the
oom_score_adj of the shim and its task, the Run's cgroup the task joins, and the kernel's
oom_kill counts and memory figures read back for the receipt.

Part of the shim (``shim/main.py``): standard library only, no qlagent import, imported by its
plain name (``import oom``) because the shim runs as a script under ``python3 -I -S``; it
never imports main.py.
"""

import posix

TASK_OOM_SCORE_ADJ = b"1000"   # the kernel's first choice in an OOM (the maximum)
SHIM_OOM_SCORE_ADJ = b"500"    # after the task, before the agent: killing a shim loses its run


def set_score_adj(value):
    """Raise this process's oom_score_adj to ``value`` (ASCII bytes; raising needs no
    privilege); ignored without /proc."""
    try:
        fd = posix.open("/proc/self/oom_score_adj", posix.O_WRONLY)
        try:
            posix.write(fd, value)
        finally:
            posix.close(fd)
    except OSError:
        pass


def join_cgroup(path):
    """In the forked child: move into the Run's cgroup (absolute directory ``path``); a refusal
    leaves the task where the shim is (under oom_score_adj only)."""
    try:
        fd = posix.open(path + "/cgroup.procs", posix.O_WRONLY)
        try:
            posix.write(fd, b"%d" % posix.getpid())
        finally:
            posix.close(fd)
    except OSError:
        pass


def _small_file(path):
    """The content (bytes) of a small kernel file (one read: the cgroup files read here are
    well under a page), or None when it cannot be read."""
    try:
        fd = posix.open(path, posix.O_RDONLY)
    except OSError:
        return None
    try:
        return posix.read(fd, 65536)
    except OSError:
        return None
    finally:
        posix.close(fd)


def cgroup_value(path, key):
    """``key``'s number (int) in a flat-keyed cgroup file (``key`` bytes), or the file's one
    number (key None); None when the file or the number is not there. Read with posix calls,
    not ``open()``: the io stack's first use in a forked shim costs it ~0.2 ms of copied pages."""
    data = _small_file(path)
    if data is None:
        return None
    for line in data.split(b"\n"):
        parts = line.split()
        try:
            if key is None and len(parts) == 1:
                return int(parts[0])
            if len(parts) == 2 and parts[0] == key:
                return int(parts[1])
        except ValueError:
            return None
    return None


def counter():
    """Where this process's memory cgroup counts its OOM kills: the v1 ``memory`` line's
    memory.oom_control, else the v2 ``0::`` line's memory.events (a list of paths, the first
    readable one counts), from /proc/self/cgroup; [] without it."""
    data = _small_file("/proc/self/cgroup")
    if data is None:
        return []
    lines = [ln.split(":", 2) for ln in data.decode("utf-8", "surrogateescape").splitlines() if ln.count(":") >= 2]
    paths = [("/sys/fs/cgroup/memory%s/memory.oom_control" % p) for _, c, p in lines if "memory" in c.split(",")]
    paths += [("/sys/fs/cgroup%s/memory.events" % p) for h, c, p in lines if h == "0" and c == ""]
    return paths


def kills(cgroup, own):
    """The oom_kill count (int) of the Run's cgroup, else of this process's memory cgroup (the
    paths of ``counter()``), or None where there is none to read."""
    if cgroup is not None:
        n = cgroup_value(cgroup + "/memory.events", b"oom_kill")
        if n is not None:
            return n
    for path in own:
        n = cgroup_value(path, b"oom_kill")
        if n is not None:
            return n
    return None
