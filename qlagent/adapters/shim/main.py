"""The shim: the per-run process (ADR-0071 §5, ARCHITECTURE.md "Shim contract"); its FIFO drainer
is ``drainer.py`` (``Drainer``), the stopping of what the task left behind ``leftovers.py``,
its oom_score_adj and cgroup reads ``oom.py``, the fork server ``forkserver.py`` (``serve_forks``).

Run as ``python3 -I -S shim/main.py`` in its own session, stdin a pipe carrying ONE JSON spec
(it holds secret plaintext, so it never travels through argv or disk), stdout/stderr /dev/null,
an empty environment. Stdlib only and no qlagent import: it must start fast, stay small
(one extra PID, a few MiB) and outlive the agent.

Fork server: started with stdin a Unix stream socket, this program is the fork server instead
(``forkserver.serve_forks``, processes.ForkServer): it forks one shim per request, which then
runs exactly as above (the fork server writes its ``pid <n>`` on the status pipe first); see ARCHITECTURE.md "Fork server".

Siblings: ``drainer``, ``leftovers``, ``oom`` and ``forkserver`` are imported by their plain names. The agent runs one
file, the shim compiled for its interpreter (``processes._compiled_path``, written by
``--compile``: ``_compile_self``), whose code puts the
compiled siblings into ``sys.modules`` before it runs this file's code: nothing is compiled and
nothing is searched on sys.path. Run from source (``python3 -I -S shim/main.py``, tests and
benches), -I keeps this file's directory off sys.path, so it is put first there; that directory
is as trusted as this file itself (same package, same owner, same installation).

Spec fields: attempt_id (str), argv (non-empty list of str), env (dict str→str, the task's
ENTIRE environment), cwd (absolute path), run_dir (absolute, 0700, created by the agent),
artifact_path (absolute, created 0600 by the agent), quota_bytes (int ≥ 0, bytes kept in the
Artifact), linger_s (seconds ≥ 0 the drainer keeps reading after the main task exits),
umask (int 0..0o777 or null: null gives the task the umask this process inherited, i.e. the
service's), grace_s (seconds ≥ 0 between SIGTERM and SIGKILL when stopping what the main task
left behind), keep_orphans (bool: leave them running), lease_file (absolute path or null, fleet
Worker runs under on_lease_loss = "kill" only: see "Lease self-fencing"), timeout_s (seconds in
(0, MAX_TIMEOUT_S] or null: the Run's timeout, see "Deadline"), cgroup (absolute path or null:
the Run's own cgroup, adapters/runcgroup.py, which the task joins before its exec).

Start status (stdout, a pipe to the agent): ONE line once the outcome of the exec is known,
``ok`` or ``err <start_error>``; then stdout is pointed at /dev/null. The agent records the
Run running only after ``ok``. The task is forked and exec'd here (not posix_spawn, whose glibc
child leaves the libc-internal signals ignored): in the child every signal disposition is the
default, the signal mask empty, the umask the task's, stdin /dev/null, stdout+stderr the FIFO,
cwd entered, PR_SET_PDEATHSIG SIGKILL (the task's leader dies with this process, so a shim
killed by SIGKILL or the OOM killer leaves no task running; what the leader forked is found by
its QL3_ATTEMPT_ID: the agent's start-up scan, ``processes.stop_strays``); an exec or chdir failure travels back through a CLOEXEC pipe as its errno, so the
reason is exact (``cwd /x: ENOENT (No such file or directory)``), like subprocess does.

After the main task exits, what it left behind (its process group, processes whose
environment carries QL3_ATTEMPT_ID=<attempt_id>, and the task's orphans: this process is their
subreaper, so a double-forked daemon is re-parented here, not to init) gets SIGTERM, then SIGKILL after grace_s,
unless keep_orphans; the receipt's orphans_stopped counts them.

Lease self-fencing (issue 11 §6, a fleet Worker that died): lease_file holds one decimal
integer, the CLOCK_MONOTONIC instant (µs) at which stopping the run must begin so that it is dead
before its Run Lease can expire (qlagent.worker.policy.fencing.stop_at_local_us); the Worker writes it
before the spawn and rewrites it (rename) at every renewal. This process sleeps until that
instant and reads the file again: a later instant means the Worker renewed, so it sleeps on.
Otherwise (the Worker is gone or cannot renew; an unreadable file counts the same) the task's
process group and everything of the run (as for leftovers, keep_orphans or not) gets SIGTERM,
SIGKILL after grace_s, and the receipt says "lease_lost": true. One wake-up per renewal period
and no thread: the shim stays as small as before.

Deadline (the Run's timeout, F3, held while no agent watches): with timeout_s, the instant
timeout_s after the exec (CLOCK_MONOTONIC, like the lease's) is kept in this process and written,
just before the exec, to run_dir/deadline (one decimal integer, µs: it tells an agent that
re-attaches that this shim holds the timeout, processes.ShimProcesses.holds_deadline). At that
instant, agent or not, the task's process group and everything of the run (keep_orphans or not)
gets SIGTERM, SIGKILL after grace_s, and the receipt says "deadline_passed": true. The agent
signals nothing itself for such a run and ends it ``timed_out`` from the receipt. A Lease lost
while the run is being stopped for its timeout (or the reverse) sends nothing more: one SIGTERM.

Out of memory (issue 22 §3): with a ``cgroup`` the task tree runs there, under the Run's own
memory.max (whole tree killed together: memory.oom.group), and this process stays beside the
agent. Either way the task is exec'd with oom_score_adj oom.TASK_OOM_SCORE_ADJ and this process runs
at oom.SHIM_OOM_SCORE_ADJ, so when a memory cgroup they share with the agent is full the kernel kills
the task first and the agent (whose own value is lower: the unit's OOMScoreAdjust=) last. A task
ended by SIGKILL while the oom_kill count rose — of the Run's cgroup, else of this process's
memory cgroup (v2 memory.events, v1 memory.oom_control) — ends with "oom_killed": true; with a
``cgroup`` peak_rss_bytes is its memory.peak (the whole tree) instead of the task's max RSS.

Files in run_dir (the agent creates it empty; the first thing in it is the shim's FIFO):
  output.fifo    0600 FIFO (FIFO_BYTES) carrying the task's stdout+stderr; created before the exec
                 and removed only once the receipt is written, so from before the exec until the
                 agent removes the directory it is never empty: the agent's restart recovery
                 tells by that a start that never reached the exec (ShimProcesses.fence_unstarted).
  deadline       with timeout_s: the Run's deadline (see "Deadline"), written before the exec.
  task.pid       the task PID (= its process group ID), written right after the spawn.
  truncated.json write-once truncation fact {"quota_bytes","bytes_kept","reason"}, created when the
                 first byte beyond the quota arrives or is dropped after a failed write of the
                 Artifact (hard link of a fsynced temp file, so it is exclusive like O_EXCL and
                 never seen half-written). reason: "quota" or "write_error: ENOSPC (No space left
                 on device)". Byte counts and an errno only.
  receipt.json   atomic completion receipt (temp, fsync, rename, dir fsync):
                 {"attempt_id","exit_code","signal","start_error","started_at_us","ended_at_us",
                  "bytes_total","bytes_kept","bytes_dropped","peak_rss_bytes","cpu_time_us",
                  "orphans_stopped","lease_lost","deadline_passed","oom_killed","quota_bytes","write_error"}.
                 start_error: at most START_ERROR_LIMIT characters, paths and errno names only (never
                 the environment); write_error: the first failed write of the Artifact, "ENOSPC (No
                 space left on device)", or null (the agent records the truncation fact from it when
                 truncated.json could not be written).
  shim.err       the shim's own errors (never sent to the agent through a pipe).

Exit status: 0 once a receipt is written, 2 when the spec is unusable and no receipt can be written,
1 when the receipt cannot be written. A full file system (ENOSPC, EDQUOT) after the task ran is
waited out: the receipt is tried again every RECEIPT_RETRY_S seconds until it fits, so the run's
end is never lost.

It imports the C modules behind json, signal, os and stat (_json, _signal, posix, _stat) directly:
the pure-Python json and signal modules pull in re and enum, which cost +1.2 MiB private memory
and +6 ms per run (bench/results/shim.md); os pulls in posixpath and _collections_abc, 0.16 MiB
of every fork server (bench/results/forkserver.md). The shim's own modules do the same.
"""

import _json
import _signal
import _stat
import errno
import fcntl
import posix
import sys
import time

if "drainer" not in sys.modules:   # run from source, not from the compiled file
    import posixpath
    sys.path.insert(0, posixpath.dirname(posixpath.abspath(__file__)))
import leftovers  # noqa: E402  (the three need the line above when run from source)
import oom  # noqa: E402
from drainer import Drainer  # noqa: E402

SPEC_LIMIT_BYTES = 1 << 20
MAX_LINGER_S = 3600.0
MAX_GRACE_S = 300.0
MAX_TIMEOUT_S = 7 * 24 * 3600    # core.limits.MAX_TIMEOUT_S (the shim imports nothing of qlagent)
START_ERROR_LIMIT = 512
_PATH_SHOWN = 200
PR_SET_PDEATHSIG = 1
_DEFPATH = "/bin:/usr/bin"   # posixpath.defpath: the search path of a task environment without PATH
RECEIPT_RETRY_S = 1.0    # a full file system: try the receipt again this often until it fits
# The FIFO's capacity (the kernel's default is 64 KiB): a task blocks less often on a full pipe
# and each wake-up of the drainer moves more (bench/results/forkserver.md). Its pages exist only
# while they hold output; where it is refused (pipe-max-size, the user's pipe pages) 64 KiB stays.
FIFO_BYTES = 262144

_task_pid = 0
_term_requested = False
_inherited_umask = 0o022   # replaced in main() by the umask this process was started with
_status_sent = False


def _now_us():
    return time.time_ns() // 1000


def _join(directory, name):
    """posixpath.join of two parts (os and os.path are not loaded: see the module docstring)."""
    if name.startswith("/"):
        return name
    return directory + name if not directory or directory.endswith("/") else directory + "/" + name


def _is_file(path):
    """genericpath.isfile: a regular file there (symlinks followed)."""
    try:
        return _stat.S_ISREG(posix.stat(path).st_mode)
    except (OSError, ValueError):
        return False


class SpecError(Exception):
    """A spec field is missing or out of range; the message names the field."""


class _JsonContext:
    # The attributes _json.make_scanner reads; NaN/Infinity are refused.
    strict = True
    object_hook = None
    object_pairs_hook = None
    parse_float = float
    parse_int = int
    memo = None

    @staticmethod
    def parse_constant(name):
        raise ValueError("%s is not allowed" % name)


_scan = _json.make_scanner(_JsonContext())
_WHITESPACE = " \t\r\n"


def _loads(text):
    start = len(text) - len(text.lstrip(_WHITESPACE))
    try:
        value, end = _scan(text, start)
    except StopIteration:
        raise ValueError("no JSON value") from None
    if text[end:].strip(_WHITESPACE):
        raise ValueError("extra data after the JSON value")
    return value


def _dumps(doc):
    """Encode a flat dict of str → int | bool | str | None (receipts and facts) as ASCII JSON bytes."""
    parts = []
    for key in sorted(doc):
        value = doc[key]
        if value is None:
            text = "null"
        elif isinstance(value, bool):
            text = "true" if value else "false"
        elif isinstance(value, str):
            text = _json.encode_basestring_ascii(value)
        else:
            text = str(int(value))
        parts.append("%s: %s" % (_json.encode_basestring_ascii(key), text))
    return ("{" + ", ".join(parts) + "}").encode("ascii")


def _read_spec():
    chunks = []
    size = 0
    while True:
        chunk = posix.read(0, 65536)
        if not chunk:
            break
        size += len(chunk)
        if size > SPEC_LIMIT_BYTES:
            raise SpecError("spec: larger than %d bytes" % SPEC_LIMIT_BYTES)
        chunks.append(chunk)
    try:
        spec = _loads(b"".join(chunks).decode("utf-8"))
    except Exception as exc:  # _json raises ValueError subclasses, RecursionError, ...
        raise SpecError("spec: not valid JSON (%s)" % exc) from None
    if not isinstance(spec, dict):
        raise SpecError("spec: must be a JSON object")
    return spec


def _str_field(spec, name, absolute=False):
    value = spec.get(name)
    if not isinstance(value, str) or not value or "\0" in value:
        raise SpecError("%s: must be a non-empty string without NUL" % name)
    if absolute and not value.startswith("/"):
        raise SpecError("%s: must be an absolute path" % name)
    return value


def _validate(spec):
    argv = spec.get("argv")
    if not isinstance(argv, list) or not argv or not all(
            isinstance(a, str) and "\0" not in a for a in argv) or not argv[0]:
        raise SpecError("argv: must be a non-empty list of strings without NUL")
    env = spec.get("env")
    if not isinstance(env, dict) or not all(
            isinstance(k, str) and isinstance(v, str) and k and "=" not in k
            and "\0" not in k and "\0" not in v for k, v in env.items()):
        raise SpecError("env: must map names (no '=' or NUL) to strings without NUL")
    quota = spec.get("quota_bytes")
    if not isinstance(quota, int) or isinstance(quota, bool) or quota < 0:
        raise SpecError("quota_bytes: must be an integer >= 0")
    linger = spec.get("linger_s", 2.0)
    if (not isinstance(linger, (int, float)) or isinstance(linger, bool)
            or not 0 <= linger <= MAX_LINGER_S):
        raise SpecError("linger_s: must be a number of seconds in [0, %d]" % MAX_LINGER_S)
    grace = spec.get("grace_s", 5.0)
    if (not isinstance(grace, (int, float)) or isinstance(grace, bool)
            or not 0 <= grace <= MAX_GRACE_S):
        raise SpecError("grace_s: must be a number of seconds in [0, %d]" % MAX_GRACE_S)
    umask = spec.get("umask")
    if umask is not None and (not isinstance(umask, int) or isinstance(umask, bool)
                              or not 0 <= umask <= 0o777):
        raise SpecError("umask: must be null or an integer in [0, 0o777]")
    keep = spec.get("keep_orphans", False)
    if not isinstance(keep, bool):
        raise SpecError("keep_orphans: must be true or false")
    lease_file = spec.get("lease_file")
    if lease_file is not None:
        lease_file = _str_field(spec, "lease_file", absolute=True)
    timeout = spec.get("timeout_s")
    if timeout is not None and (not isinstance(timeout, (int, float)) or isinstance(timeout, bool)
                                or not 0 < timeout <= MAX_TIMEOUT_S):
        raise SpecError("timeout_s: must be null or a number of seconds in (0, %d]" % MAX_TIMEOUT_S)
    cgroup = spec.get("cgroup")
    if cgroup is not None:
        cgroup = _str_field(spec, "cgroup", absolute=True)
    return {
        "lease_file": lease_file, "timeout_s": timeout, "cgroup": cgroup,
        "argv": argv, "env": env, "quota_bytes": quota, "linger_s": float(linger),
        "grace_s": float(grace), "umask": _inherited_umask if umask is None else umask,
        "keep_orphans": keep,
        "cwd": _str_field(spec, "cwd", absolute=True),
        "artifact_path": _str_field(spec, "artifact_path", absolute=True),
    }


class Shim:
    """One run's directory: its files (``write_file_atomic``), its own errors (``log_error``)
    and, once the Artifact is open, its ``drainer``."""

    def __init__(self, attempt_id, run_dir):
        self.attempt_id = attempt_id
        self.run_dir = run_dir
        self.fifo_path = _join(run_dir, "output.fifo")
        self.drainer = None

    def log_error(self, message):
        # Own errors go to a file in run_dir; if even that fails there is nowhere left to write.
        try:
            fd = posix.open(_join(self.run_dir, "shim.err"),
                         posix.O_WRONLY | posix.O_CREAT | posix.O_APPEND | posix.O_NOFOLLOW, 0o600)
            try:
                posix.write(fd, ("%d %s\n" % (_now_us(), message)).encode("utf-8", "replace"))
            finally:
                posix.close(fd)
        except OSError:
            pass

    def write_file_atomic(self, name, doc, exclusive):
        path = _join(self.run_dir, name)
        tmp = "%s.tmp.%d" % (path, posix.getpid())
        fd = posix.open(tmp, posix.O_WRONLY | posix.O_CREAT | posix.O_TRUNC | posix.O_NOFOLLOW, 0o600)
        try:
            posix.write(fd, _dumps(doc) if isinstance(doc, dict) else str(doc).encode("ascii"))
            posix.fsync(fd)
        finally:
            posix.close(fd)
        try:
            if exclusive:
                posix.link(tmp, path)  # fails with EEXIST: write-once
                posix.unlink(tmp)
            else:
                posix.rename(tmp, path)
        except OSError:
            posix.unlink(tmp)
            raise
        dfd = posix.open(self.run_dir, posix.O_RDONLY | posix.O_DIRECTORY)
        try:
            posix.fsync(dfd)
        finally:
            posix.close(dfd)


def _on_term(signum, frame):
    global _term_requested
    _term_requested = True
    if _task_pid:
        try:
            posix.killpg(_task_pid, _signal.SIGTERM)
        except OSError:
            pass


class StartFailure(Exception):
    """The task could not be started; the message is the receipt's start_error."""


def _shown(path):
    # Bounded: a start_error never grows with a path (START_ERROR_LIMIT).
    if len(path) <= _PATH_SHOWN:
        return path
    return path[:_PATH_SHOWN // 2] + "..." + path[-(_PATH_SHOWN // 2 - 3):]


def _errno_text(number, detail=None):
    name = errno.errorcode.get(number, "errno %d" % number)
    return "%s (%s)" % (name, detail or posix.strerror(number))


def _report(start_error):
    """Tell the agent, once, whether the task was exec'd (see the module docstring)."""
    global _status_sent
    if _status_sent:
        return
    _status_sent = True
    line = "ok\n" if start_error is None else "err %s\n" % start_error
    try:
        posix.write(1, line.encode("utf-8", "replace"))
        null = posix.open("/dev/null", posix.O_WRONLY)
        posix.dup2(null, 1)   # closes the pipe: the agent reads EOF after the line
        posix.close(null)
    except OSError:
        pass  # stdout already /dev/null or closed: nobody waits for the status


def _resolve(argv0, env):
    if "/" in argv0:
        return argv0
    for d in env.get("PATH", _DEFPATH).split(":"):
        candidate = _join(d or ".", argv0)
        if _is_file(candidate) and posix.access(candidate, posix.X_OK):
            return candidate
    raise StartFailure("exec %s: %s" % (_shown(argv0), _errno_text(
        errno.ENOENT, "not found in the task's PATH")))


def _exec_child(cfg, path, wfd, err_w, reset, shim_pid):
    # In the forked child: only async-signal-safe work on our own state, then execve.
    stage = b"exec"
    try:
        for sig in reset:
            _signal.signal(sig, _signal.SIG_DFL)
        _signal.pthread_sigmask(_signal.SIG_SETMASK, ())
        posix.setpgid(0, 0)
        if leftovers.prctl is not None:
            # Tied to this shim: its death (SIGKILL, OOM kill) SIGKILLs the task (kept across
            # execve). The shim may have died before the prctl: then the parent is already another.
            leftovers.prctl(PR_SET_PDEATHSIG, _signal.SIGKILL, 0, 0, 0)
            if posix.getppid() != shim_pid:
                posix._exit(127)
        posix.umask(cfg["umask"])
        null = posix.open("/dev/null", posix.O_RDONLY)
        posix.dup2(null, 0)
        posix.dup2(wfd, 1)
        posix.dup2(wfd, 2)
        oom.set_score_adj(oom.TASK_OOM_SCORE_ADJ)
        if cfg["cgroup"] is not None:
            oom.join_cgroup(cfg["cgroup"])
        stage = b"cwd"
        posix.chdir(cfg["cwd"])
        stage = b"exec"
        posix.execve(path, cfg["argv"], cfg["env"])
    except OSError as exc:
        posix.write(err_w, b"%s %d" % (stage, exc.errno or 0))
    except BaseException:
        posix.write(err_w, b"shim 0")
    posix._exit(127)


def _spawn(cfg, wfd):
    """Fork and exec the task in its own process group (see the module docstring); returns its
    PID once the exec has succeeded, raises StartFailure with the exact reason otherwise."""
    path = _resolve(cfg["argv"][0], cfg["env"])
    # What this process changed (ignored, or a handler of its own) is set back in the child; a
    # signal at its default stays so without a call. _signal's table holds every signal's
    # disposition since the interpreter's start (ignored ones it inherited included; None: a
    # handler it did not install), and nothing in the shim changes one but through it.
    reset = [s for s in _signal.valid_signals() if s not in (_signal.SIGKILL, _signal.SIGSTOP)
             and _signal.getsignal(s) != _signal.SIG_DFL]
    err_r, err_w = posix.pipe()   # O_CLOEXEC: EOF as soon as the exec succeeds
    shim_pid = posix.getpid()
    try:
        pid = posix.fork()
    except OSError as exc:
        posix.close(err_r)
        posix.close(err_w)
        raise StartFailure("fork: %s" % _errno_text(exc.errno)) from None
    if pid == 0:
        _exec_child(cfg, path, wfd, err_w, reset, shim_pid)
    posix.close(err_w)
    try:
        posix.setpgid(pid, pid)   # also here: the agent may signal the group before the child runs
    except OSError:
        pass                   # EACCES once the child has exec'd: it already did it itself
    data = b""
    while True:
        chunk = posix.read(err_r, 64)
        if not chunk:
            break
        data += chunk
    posix.close(err_r)
    if not data:
        return pid
    posix.waitpid(pid, 0)
    stage, _, number = data.partition(b" ")
    number = int(number or 0)
    if stage == b"cwd":
        raise StartFailure("cwd %s: %s" % (_shown(cfg["cwd"]), _errno_text(number)))
    if stage == b"exec":
        detail = _missing_interpreter(_join(cfg["cwd"], path)) if number == errno.ENOENT else None
        raise StartFailure("exec %s: %s" % (_shown(cfg["argv"][0]), _errno_text(number, detail)))
    raise StartFailure("shim: the child failed before exec")


def _missing_interpreter(path):
    """When execve said ENOENT about a file that is there, the missing file is its #!
    interpreter (often ``/bin/sh\\r`` of a CRLF file): the detail naming it (repr, so a \\r
    shows, bounded like a path), else None. Reads the first line only."""
    try:
        fd = posix.open(path, posix.O_RDONLY | posix.O_NONBLOCK | posix.O_CLOEXEC)
    except OSError:
        return None
    try:
        head = posix.read(fd, 256)
    except OSError:
        return None
    finally:
        posix.close(fd)
    if not head.startswith(b"#!"):
        return None
    words = head[2:].split(b"\n", 1)[0].lstrip(b" \t").split(b" ", 1)[0].split(b"\t", 1)[0]
    return "interpreter %r of its #! line not found" % _shown(words.decode("utf-8", "replace"))


def _mono_us():
    return time.monotonic_ns() // 1000   # CLOCK_MONOTONIC: the Worker's clock too


def _lease_deadline(path):
    """The instant (µs, CLOCK_MONOTONIC) in ``path``, or None when it cannot be read."""
    data = leftovers.read_all(path)
    try:
        return int(data.strip()) if data and len(data) <= 32 else None
    except ValueError:
        return None


def new_receipt(attempt_id, start_error=None):
    """The receipt document (core.receipt.Receipt's fields); ``main`` fills in the byte counts.
    With ``start_error`` the task never ran and the receipt is final at once."""
    now = _now_us()
    return {"attempt_id": attempt_id, "exit_code": None, "signal": None, "start_error": start_error,
            "started_at_us": now, "ended_at_us": now if start_error is not None else None,
            "bytes_total": 0, "bytes_kept": 0, "bytes_dropped": 0, "peak_rss_bytes": None, "cpu_time_us": None,
            "orphans_stopped": None, "lease_lost": False, "deadline_passed": False, "oom_killed": False,
            "quota_bytes": None, "write_error": None}


def _prepare():
    """The run's set-up that needs no spec, done before reading it (a fork-served shim gets its
    spec only once the agent took in its PID, so this overlaps that round trip): the signal
    wakeup pipe and SIGCHLD (only to wake the drainer's poll), this process's oom_score_adj,
    where its own oom_kill count is read. Returns (wakeup pipe's read end, ``oom.counter()``)."""
    wake_r, wake_w = posix.pipe()
    posix.set_blocking(wake_r, False)
    posix.set_blocking(wake_w, False)
    _signal.set_wakeup_fd(wake_w, warn_on_full_buffer=False)
    _signal.signal(_signal.SIGCHLD, lambda s, f: None)  # only to wake poll through wakeup fd
    oom.set_score_adj(oom.SHIM_OOM_SCORE_ADJ)
    return wake_r, oom.counter()


def run(w, cfg, wake_r, own_oom):
    global _task_pid
    receipt = new_receipt(w.attempt_id)
    try:
        # Not O_APPEND, which splice(2) refuses: the shim is the file's only writer while it runs,
        # and it starts at the end.
        art_fd = posix.open(cfg["artifact_path"], posix.O_WRONLY | posix.O_NOFOLLOW | posix.O_CLOEXEC)
    except OSError as exc:
        receipt["start_error"] = "artifact_path %s: %s" % (_shown(cfg["artifact_path"]), _errno_text(exc.errno))
        receipt["ended_at_us"] = _now_us()
        return receipt
    w.drainer = d = Drainer(w, art_fd, cfg["quota_bytes"], 0)
    try:
        st = posix.fstat(art_fd)
    except OSError as exc:
        receipt["start_error"] = "artifact_path %s: %s" % (_shown(cfg["artifact_path"]), _errno_text(exc.errno))
        receipt["ended_at_us"] = _now_us()
        return receipt
    if not _stat.S_ISREG(st.st_mode):
        receipt["start_error"] = "artifact_path %s: not a regular file" % _shown(cfg["artifact_path"])
        receipt["ended_at_us"] = _now_us()
        return receipt
    # The agent creates the file empty; anything already there counts against the quota.
    d.room = max(0, d.quota - st.st_size)
    posix.lseek(art_fd, 0, 2)   # SEEK_END (os defines it, posix does not)
    try:
        posix.mkfifo(w.fifo_path, 0o600)
        # Read end first and non-blocking, so opening the write end never blocks and EOF only
        # arrives once every writer (the task and its descendants) has closed it.
        rfd = posix.open(w.fifo_path, posix.O_RDONLY | posix.O_NONBLOCK | posix.O_CLOEXEC)
        wfd = posix.open(w.fifo_path, posix.O_WRONLY | posix.O_CLOEXEC)
        try:
            fcntl.fcntl(rfd, fcntl.F_SETPIPE_SZ, FIFO_BYTES)
        except OSError:
            pass
    except OSError as exc:
        receipt["start_error"] = "output.fifo %s: %s" % (_shown(w.fifo_path), _errno_text(exc.errno))
        receipt["ended_at_us"] = _now_us()
        return receipt

    timeout_at = None
    if cfg["timeout_s"] is not None:
        timeout_at = _mono_us() + int(cfg["timeout_s"] * 1e6)
        try:
            # Not fsynced: the monotonic instant means nothing after a reboot, nor does this process.
            fd = posix.open(_join(w.run_dir, "deadline"),
                            posix.O_WRONLY | posix.O_CREAT | posix.O_EXCL | posix.O_NOFOLLOW | posix.O_CLOEXEC, 0o600)
            try:
                posix.write(fd, b"%d" % timeout_at)
            finally:
                posix.close(fd)
        except OSError as exc:
            w.log_error("deadline not written (the timeout holds all the same): %s" % exc)
    oom_before = oom.kills(cfg["cgroup"], own_oom)
    receipt["started_at_us"] = _now_us()
    try:
        if _term_requested:
            raise StartFailure("shim: terminated before the task was started")
        pid = _spawn(cfg, wfd)
    except StartFailure as exc:
        posix.close(wfd)
        posix.close(rfd)
        receipt["start_error"] = str(exc)
        receipt["ended_at_us"] = _now_us()
        return receipt
    posix.close(wfd)
    _task_pid = pid
    if _term_requested:
        _on_term(_signal.SIGTERM, None)
    _report(None)   # before task.pid and its fsyncs: the agent waits for this line
    try:
        w.write_file_atomic("task.pid", pid, False)
    except OSError as exc:
        w.log_error("task.pid not written: %s" % exc)

    d.watch(rfd, wake_r)
    status = None
    linger_deadline = None
    # Lease self-fencing: the instant to look at lease_file again, then (fenced) to SIGKILL.
    # An unreadable file reads as instant 0: fail closed, the run is stopped at the first look.
    lease_at = (_lease_deadline(cfg["lease_file"]) or 0) if cfg["lease_file"] else None
    kill_at = None
    stopping = False      # the lease or the timeout began stopping the run: SIGTERM sent once

    while not d.eof or status is None:
        if status is None:
            while True:
                # As subreaper this process also gets the task's orphans: reap them as they
                # exit (freeing their PIDs) until the main task or nothing is left to reap.
                try:
                    reaped, wstatus, rusage = posix.wait4(-1, posix.WNOHANG)
                except ChildProcessError:
                    reaped = 0
                if reaped in (0, pid):
                    break
            if reaped:
                status = wstatus
                receipt["ended_at_us"] = _now_us()
                receipt["peak_rss_bytes"] = rusage.ru_maxrss * 1024
                receipt["cpu_time_us"] = int((rusage.ru_utime + rusage.ru_stime) * 1e6)
                if stopping:
                    # Nothing of a run past its Lease or its timeout may go on: what is left gets
                    # the rest of the grace.
                    left_s = max(0.0, (kill_at - _mono_us()) / 1e6) if kill_at is not None else 0.0
                    receipt["orphans_stopped"] = leftovers.stop(pid, w.attempt_id, left_s, d.drain)
                elif not cfg["keep_orphans"]:
                    receipt["orphans_stopped"] = leftovers.stop(pid, w.attempt_id, cfg["grace_s"], d.drain)
                linger_deadline = time.monotonic() + cfg["linger_s"]
                continue
            now = _mono_us()
            if kill_at is not None and now >= kill_at:
                leftovers.signal_run(pid, w.attempt_id, _signal.SIGKILL)
                kill_at = None
            if lease_at is not None and now >= lease_at:
                renewed = _lease_deadline(cfg["lease_file"])
                if renewed is not None and renewed > now:
                    lease_at = renewed
                else:
                    w.log_error("lease not renewed by the Worker: the run is stopped")
                    receipt["lease_lost"] = True
                    lease_at = None
            if timeout_at is not None and now >= timeout_at:
                receipt["deadline_passed"] = True
                timeout_at = None
            if not stopping and (receipt["lease_lost"] or receipt["deadline_passed"]):
                stopping = True
                kill_at = now + int(cfg["grace_s"] * 1e6)
                leftovers.signal_run(pid, w.attempt_id, _signal.SIGTERM)
        timeout_ms = None
        if status is None:
            for at in (lease_at, kill_at, timeout_at):
                if at is not None:
                    wait_ms = max(0, (at - _mono_us()) // 1000 + 1)
                    timeout_ms = wait_ms if timeout_ms is None else min(timeout_ms, wait_ms)
        if linger_deadline is not None:
            left = linger_deadline - time.monotonic()
            if left <= 0:
                w.log_error("output still open %.1fs after the task exited; stopped draining"
                            % cfg["linger_s"])
                break
            timeout_ms = int(left * 1000) + 1
        d.drain(timeout_ms)

    posix.close(rfd)
    if posix.WIFSIGNALED(status):
        receipt["signal"] = posix.WTERMSIG(status)
        if receipt["signal"] == _signal.SIGKILL and oom_before is not None:
            receipt["oom_killed"] = (oom.kills(cfg["cgroup"], own_oom) or 0) > oom_before
    else:
        receipt["exit_code"] = posix.waitstatus_to_exitcode(status)
    if cfg["cgroup"] is not None:
        # The whole task tree's peak, as the kernel counted it (memory.peak: Linux 5.19+).
        peak = oom.cgroup_value(cfg["cgroup"] + "/memory.peak", None)
        if peak is not None:
            receipt["peak_rss_bytes"] = peak
    return receipt


# The shim's sibling modules, in the order the compiled file loads them (none imports main).
SIBLINGS = ("drainer", "leftovers", "oom", "forkserver")
# The code of the compiled file: the siblings into sys.modules, then main.py's code as
# __main__. "PARTS" stands for a tuple of (name, code object) with main last.
_LOADER = """
import sys
for _name, _code in "PARTS":
    if _name == "main":
        del _name
        exec(_code)
        break
    _mod = sys.modules[_name] = type(sys)(_name)
    exec(_code, _mod.__dict__)
"""


def _compile_self(dest):
    """``shim/main.py --compile DEST``: write the shim (this file and SIBLINGS) compiled for this
    interpreter to DEST (new, 0600) as one .pyc script (_LOADER) that runs with no compile and
    no import search, so that the agent pays neither per run. At optimize level 2: no docstring
    is kept (nothing here reads one, and the shim has no assert)."""
    import marshal
    import posixpath
    here = posixpath.dirname(posixpath.abspath(__file__))
    parts = []
    for name in SIBLINGS + ("main",):
        path = _join(here, name + ".py")
        source = leftovers.read_all(path)
        if source is None:
            return 1
        parts.append((name, compile(source, path, "exec", dont_inherit=True, optimize=2)))
    loader = compile(_LOADER, __file__, "exec", dont_inherit=True, optimize=2)
    # The code objects themselves as a constant: marshal keeps them as code, so the process
    # holds no second, serialised copy of them.
    code = loader.replace(co_consts=tuple(tuple(parts) if c == "PARTS" else c for c in loader.co_consts))
    # PEP 552 header: magic, flags 0, then mtime and size (never checked for a script).
    data = sys.modules["_frozen_importlib_external"].MAGIC_NUMBER + bytes(12) + marshal.dumps(code)
    fd = posix.open(dest, posix.O_WRONLY | posix.O_CREAT | posix.O_EXCL | posix.O_NOFOLLOW, 0o600)
    try:
        posix.write(fd, data)
    finally:
        posix.close(fd)
    return 0


def main():
    global _inherited_umask
    if len(sys.argv) == 3 and sys.argv[1] == "--compile":
        return _compile_self(sys.argv[2])
    for sig in (_signal.SIGINT, _signal.SIGHUP, _signal.SIGPIPE):
        _signal.signal(sig, _signal.SIG_IGN)
    _signal.signal(_signal.SIGTERM, _on_term)
    # Our own files private whatever the service's umask; the task gets the inherited one back.
    _inherited_umask = posix.umask(0o077)
    leftovers.become_subreaper()
    wake_r, own_oom = _prepare()
    try:
        spec = _read_spec()
        attempt_id = _str_field(spec, "attempt_id")
        run_dir = _str_field(spec, "run_dir", absolute=True)
    except SpecError as exc:
        sys.stderr.write("qlagent shim: %s\n" % exc)
        return 2
    w = Shim(attempt_id, run_dir)
    try:
        cfg = _validate(spec)
    except SpecError as exc:
        w.log_error(str(exc))
        receipt = new_receipt(attempt_id, "bad spec: %s" % str(exc)[:START_ERROR_LIMIT - 10])
    else:
        del spec
        try:
            receipt = run(w, cfg, wake_r, own_oom)
        except Exception as exc:  # the receipt must still appear; the cause goes to shim.err
            w.log_error("shim failure: %r" % (exc,))
            receipt = new_receipt(attempt_id, "shim failure: %s" % type(exc).__name__)
    _report(receipt["start_error"])
    d = w.drainer
    if d is not None:
        try:
            posix.fsync(d.art_fd)
        except OSError as exc:
            w.log_error("artifact fsync failed: %s" % exc)
        posix.close(d.art_fd)
        receipt["bytes_total"] = d.bytes_total
        receipt["bytes_kept"] = d.bytes_kept
        receipt["bytes_dropped"] = d.bytes_total - d.bytes_kept
        receipt["quota_bytes"] = d.quota
        receipt["write_error"] = d.write_error
    while True:
        try:
            w.write_file_atomic("receipt.json", receipt, False)
            break
        except OSError as exc:
            if exc.errno not in (errno.ENOSPC, errno.EDQUOT) or receipt["start_error"] is not None:
                w.log_error("receipt not written: %s" % exc)
                return 1
        # The run directory's file system is full: the receipt is the run's only record, so
        # this process waits (one sleeping PID) until there is room for it. Not after a start
        # failure: the agent, which waits for this exit, already has the reason.
        time.sleep(RECEIPT_RETRY_S)
    # The FIFO only now (module docstring, output.fifo): the run directory is never empty.
    try:
        posix.unlink(w.fifo_path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        w.log_error("output.fifo not removed: %s" % exc)
    return 0


def _serve_forks():
    from forkserver import serve_forks
    leftovers.load_prctl()   # once, before the fork server freezes its heap: every shim it forks has it
    return serve_forks(main, _errno_text)


if __name__ == "__main__":
    sys.exit(_serve_forks() if _stat.S_ISSOCK(posix.fstat(0).st_mode) else main())
