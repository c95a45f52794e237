"""The fork server (ARCHITECTURE.md "Fork server", processes.ForkServer): one ``python3 -I -S``
that loaded the shim once and forks one shim per request, writing its ``pid <n>`` on the
request's status pipe; the shim then runs exactly as a shim the agent starts itself
(``shim/main.py``).

Part of the shim: standard library only, no qlagent import, imported by its plain name by
``shim/main.py`` when its stdin is a Unix stream socket; it never imports main.py (which runs
as ``__main__``), so the shim's entry and errno formatting are handed in.
"""

import _signal
import posix
import select
import sys

# A fork server this long without a request exits (processes.ForkServer): an hourly cron keeps
# it warm; an agent with nothing to run gets its ~3 MiB back.
FORK_SERVER_IDLE_S = 3600.0


def _received_fds(ancdata, scm_rights):
    fds = []
    for _, kind, data in ancdata:
        if kind == scm_rights:
            usable = len(data) - len(data) % 4
            fds += [int.from_bytes(data[i:i + 4], sys.byteorder, signed=True) for i in range(0, usable, 4)]
    return fds


def _fork_shim(spec_r, status_w, run_shim, errno_text):
    """In the fork server: one shim per request, in its own session like a shim the agent
    starts; no death signal ties it here, so it outlives this process (then init, or the
    nearest subreaper, is its parent). The child runs ``run_shim()`` (main.py ``main``) and
    exits with its status. Its ``pid <n>`` line is written here, right after the fork, so the
    agent's round trip for the spec overlaps the child's own set-up; a failed fork's reason
    (``errno_text(errno)``) goes there instead."""
    try:
        pid = posix.fork()
    except OSError as exc:
        posix.write(status_w, ("err fork: %s\n" % errno_text(exc.errno)).encode())
        return
    if pid == 0:
        code = 1
        try:
            _signal.signal(_signal.SIGCHLD, _signal.SIG_DFL)
            posix.setsid()
            posix.dup2(spec_r, 0)   # replaces the fork server's socket
            posix.dup2(status_w, 1)
            posix.close(spec_r)
            posix.close(status_w)
            code = run_shim()
        finally:
            posix._exit(code)
    try:
        posix.write(status_w, b"pid %d\n" % pid)
    except OSError:
        pass                 # the agent is gone: the shim reads no spec and exits


def serve_forks(run_shim, errno_text):
    """The fork server's loop: stdin is the agent's end of a Unix stream socket; each request
    is one byte carrying [spec_r, status_w] by SCM_RIGHTS, answered by a forked shim that runs
    ``run_shim()`` (``_fork_shim``). Returns the exit status: 0 on EOF (the agent closed it or
    died) or after FORK_SERVER_IDLE_S seconds without a request, 1 when the socket fails."""
    import _socket   # only here: a directly started shim never loads it
    import gc
    _signal.signal(_signal.SIGCHLD, _signal.SIG_IGN)   # the kernel reaps the shims forked here
    sock = _socket.socket(fileno=0)
    poller = select.poll()
    poller.register(0, select.POLLIN)
    gc.collect()
    gc.freeze()   # what is here now is never scanned again: a shim's collections dirty no shared page
    while poller.poll(int(FORK_SERVER_IDLE_S * 1000)):
        try:
            data, ancdata, _, _ = sock.recvmsg(1, _socket.CMSG_SPACE(8), _socket.MSG_CMSG_CLOEXEC)
        except InterruptedError:
            continue
        except OSError:
            return 1
        if not data:
            return 0
        fds = _received_fds(ancdata, _socket.SCM_RIGHTS)
        if len(fds) == 2:
            _fork_shim(fds[0], fds[1], run_shim, errno_text)
        for fd in fds:
            posix.close(fd)
    return 0
