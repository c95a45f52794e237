"""What a run's task leaves behind (ARCHITECTURE.md "Shim contract"): finding it in /proc,
reaping it as the task's subreaper, signalling and stopping it.

Part of the shim (``shim/main.py``): standard library only, no qlagent import, imported by its
plain name (``import leftovers``) because the shim runs as a script under ``python3 -I -S``;
it never imports main.py.

A leftover of attempt ``<id>`` is a live process in the task's process group, or one whose
environment carries ``QL3_ATTEMPT_ID=<id>``, or one descending from the shim (an orphan
re-parented to it: the shim is the task's subreaper, so a double-forked, setsid, ``env -i``
daemon is still found).
"""

import _signal
import posix
import time

PR_SET_CHILD_SUBREAPER = 36
ORPHAN_POLL_S = 0.1   # a /proc scan costs ~5 ms at 135 processes: ≤ 5 % CPU while waiting

prctl = None   # libc prctl, set by load_prctl; None where unavailable


def read_all(path):
    """The whole content (bytes) of the file at ``path``, or None when it cannot be read."""
    try:
        fd = posix.open(path, posix.O_RDONLY)
    except OSError:
        return None
    try:
        chunks = []
        while True:
            chunk = posix.read(fd, 65536)
            if not chunk:
                return b"".join(chunks)
            chunks.append(chunk)
    except OSError:
        return None
    finally:
        posix.close(fd)


def _marker(attempt_id):
    return ("\0QL3_ATTEMPT_ID=%s\0" % attempt_id).encode("utf-8", "replace")


def find(pgid, marker):
    """PIDs (set of int) of the live leftovers: in process group ``pgid``, whose environment
    holds ``marker`` (b"\\0QL3_ATTEMPT_ID=<id>\\0"), or descending from this process; this
    process excluded; read from /proc."""
    found = set()
    me = posix.getpid()
    children = {}
    for name in posix.listdir("/proc"):
        if not name.isdigit() or int(name) == me:
            continue
        st = read_all("/proc/%s/stat" % name)
        if not st:
            continue
        fields = st[st.rfind(b")") + 2:].split()   # comm may hold spaces and parentheses
        if len(fields) < 3 or fields[0] in (b"Z", b"X"):
            continue
        children.setdefault(int(fields[1]), []).append(int(name))
        if int(fields[2]) == pgid:
            found.add(int(name))
            continue
        env = read_all("/proc/%s/environ" % name)
        if env and marker in b"\0" + env:
            found.add(int(name))
    todo = list(children.get(me, ()))
    while todo:
        pid = todo.pop()
        found.add(pid)
        todo.extend(children.get(pid, ()))
    return found


def reap_orphans():
    """Reap every exited child (orphans re-parented to this subreaper) so none keeps its PID;
    call only once the main task has been reaped."""
    while True:
        try:
            if posix.waitpid(-1, posix.WNOHANG)[0] == 0:
                return
        except ChildProcessError:
            return


def load_prctl():
    """libc's prctl into ``prctl`` (None where unavailable), loaded once per fork server or
    per directly started shim: a foreign function of the process's own symbols, called with
    int arguments and returning an int. Through ``_ctypes`` itself, not the ctypes package,
    whose Python-level types this needs none of (0.2 MiB less private memory in the fork
    server, bench/results/forkserver.md)."""
    global prctl
    if prctl is None:
        try:
            import _ctypes

            class _Self:   # what a foreign function's (name, library) reads: its dlopen handle
                _handle = _ctypes.dlopen(None, posix.RTLD_NOW)

            class _Function(_ctypes.CFuncPtr):
                _flags_ = _ctypes.FUNCFLAG_CDECL    # no restype: the result is a C int

            prctl = _Function(("prctl", _Self))
        except (OSError, AttributeError, ImportError):
            prctl = None


def become_subreaper():
    """prctl(PR_SET_CHILD_SUBREAPER): the task's orphans are re-parented to this process, not
    to init, so a daemonized leftover is still found. ``prctl`` also serves the task's
    PR_SET_PDEATHSIG (main.py ``_exec_child``). False where prctl is unavailable (the process
    group and QL3_ATTEMPT_ID still apply)."""
    load_prctl()
    return prctl is not None and prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0


def stop(pgid, attempt_id, grace_s, drain):
    """What the main task left behind: SIGTERM, ``grace_s`` seconds (draining the FIFO meanwhile
    with ``drain(timeout_ms)``), SIGKILL. Returns how many processes were stopped."""
    marker = _marker(attempt_id)
    seen = set()
    deadline = time.monotonic() + grace_s
    sig = _signal.SIGTERM
    while True:
        reap_orphans()
        left = find(pgid, marker)
        if not left:
            return len(seen)
        if sig is not None:
            # SIGTERM once to each process (one forked meanwhile is found by the next scan, 0.1 s
            # later); SIGKILL to every one still there.
            targets = left - seen if sig == _signal.SIGTERM else left
            for pid in targets:
                try:
                    posix.kill(pid, sig)
                except OSError:
                    pass
            seen |= left
            if sig == _signal.SIGKILL:
                sig = None
                deadline = time.monotonic() + 1.0
        if time.monotonic() >= deadline:
            if sig is None:
                return len(seen)   # unkillable (D state): counted, nothing more to do
            sig = _signal.SIGKILL
            continue
        drain(int(ORPHAN_POLL_S * 1000))


def signal_run(pgid, attempt_id, sig):
    """``sig`` to the task's process group, then to every other leftover of the run (``find``):
    each process gets it once."""
    # The group at once: signalled one by one, a shell could see its child die of the signal
    # and exit on its own (status 128+n) before its own signal came, under load.
    try:
        posix.killpg(pgid, sig)
    except OSError:
        pass
    for pid in find(pgid, _marker(attempt_id)):
        try:
            if posix.getpgid(pid) != pgid:
                posix.kill(pid, sig)
        except OSError:
            pass
