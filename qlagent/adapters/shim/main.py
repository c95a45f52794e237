"""Per-run shim and FIFO drainer (ADR-0071 §5, ARCHITECTURE.md "shim contract").

Run as ``python3 -I -S shim/main.py`` in its own session, stdin a pipe carrying ONE JSON spec
(it holds secret plaintext, so it never travels through argv or disk), stdout/stderr /dev/null,
an empty environment. Stdlib only and no qlagent import: it must start fast, stay small
(one extra PID, a few MiB) and outlive the agent.

Spec fields: attempt_id (str), argv (non-empty list of str), env (dict str→str, the task's
ENTIRE environment), cwd (absolute path), run_dir (absolute, 0700, created by the agent),
artifact_path (absolute, created 0600 by the agent), quota_bytes (int ≥ 0, bytes kept in the
Artifact), linger_s (seconds ≥ 0 the drainer keeps reading after the main task exits).

Files in run_dir:
  output.fifo    0600 FIFO carrying the task's stdout+stderr; removed at the end.
  task.pid       the task PID (= its process group ID), written right after the spawn.
  truncated.json write-once truncation fact {"quota_bytes","bytes_kept"}, created when the first
                 byte beyond the quota arrives (hard link of a fsynced temp file, so it is
                 exclusive like O_EXCL and never seen half-written). Byte counts only.
  receipt.json   atomic completion receipt (temp, fsync, rename, dir fsync):
                 {"attempt_id","exit_code","signal","start_error","started_at_us","ended_at_us",
                  "bytes_total","bytes_kept","bytes_dropped","peak_rss_bytes","cpu_time_us"}.
  shim.err       the shim's own errors (never sent to the agent through a pipe).

Exit status: 0 once a receipt is written, 2 when the spec is unusable and no receipt can be written.

It imports the C modules behind json and signal (_json, _signal) directly: the pure-Python
json and signal modules pull in re and enum, which cost +1.2 MiB private memory and +6 ms per run
(bench/results/shim.md).
"""

import _json
import _signal
import os
import select
import stat
import sys
import time

SPEC_LIMIT_BYTES = 1 << 20
READ_CHUNK_BYTES = 65536
MAX_LINGER_S = 3600.0

_task_pid = 0
_term_requested = False


def _now_us():
    return time.time_ns() // 1000


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
    """Encode a flat dict of str → int | str | None (receipts and facts) as ASCII JSON bytes."""
    parts = []
    for key in sorted(doc):
        value = doc[key]
        if value is None:
            text = "null"
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
        chunk = os.read(0, 65536)
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
    return {
        "argv": argv, "env": env, "quota_bytes": quota, "linger_s": float(linger),
        "cwd": _str_field(spec, "cwd", absolute=True),
        "artifact_path": _str_field(spec, "artifact_path", absolute=True),
    }


class Shim:
    def __init__(self, attempt_id, run_dir):
        self.attempt_id = attempt_id
        self.run_dir = run_dir
        self.fifo_path = os.path.join(run_dir, "output.fifo")
        self.bytes_total = 0
        self.bytes_kept = 0
        self.quota = 0
        self.room = 0
        self.art_fd = -1
        self.truncated = False
        self.write_failed = False

    def log_error(self, message):
        # Own errors go to a file in run_dir; if even that fails there is nowhere left to write.
        try:
            fd = os.open(os.path.join(self.run_dir, "shim.err"),
                         os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o600)
            try:
                os.write(fd, ("%d %s\n" % (_now_us(), message)).encode("utf-8", "replace"))
            finally:
                os.close(fd)
        except OSError:
            pass

    def write_file_atomic(self, name, doc, exclusive):
        path = os.path.join(self.run_dir, name)
        tmp = "%s.tmp.%d" % (path, os.getpid())
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        try:
            os.write(fd, _dumps(doc) if isinstance(doc, dict) else str(doc).encode("ascii"))
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            if exclusive:
                os.link(tmp, path)  # fails with EEXIST: write-once
                os.unlink(tmp)
            else:
                os.rename(tmp, path)
        except OSError:
            os.unlink(tmp)
            raise
        dfd = os.open(self.run_dir, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)

    def consume(self, data):
        """Account for one chunk (a memoryview into the read buffer); keep at most the remaining
        quota in the Artifact, drop the rest."""
        self.bytes_total += len(data)
        if self.room > 0:
            view = data[:self.room]
            try:
                while view:
                    n = os.write(self.art_fd, view)
                    view = view[n:]
                    self.bytes_kept += n
                    self.room -= n
            except OSError as exc:
                # Flash full or similar: stop writing, keep draining so the task is unaffected.
                self.log_error("artifact write failed: %s" % exc)
                self.room = 0
                self.write_failed = True
        if not self.truncated and not self.write_failed and self.bytes_total > self.bytes_kept:
            self.truncated = True
            try:
                self.write_file_atomic("truncated.json",
                                       {"quota_bytes": self.quota, "bytes_kept": self.bytes_kept}, True)
            except OSError as exc:
                self.log_error("truncation fact not written: %s" % exc)


def _on_term(signum, frame):
    global _term_requested
    _term_requested = True
    if _task_pid:
        try:
            os.killpg(_task_pid, _signal.SIGTERM)
        except OSError:
            pass


def _resolve(argv0, env):
    if "/" in argv0:
        return argv0
    for d in env.get("PATH", os.defpath).split(os.pathsep):
        candidate = os.path.join(d or ".", argv0)
        if os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return candidate
    raise FileNotFoundError(2, "not found in the task's PATH", argv0)


def _spawn(cfg, wfd):
    """Start the task in its own process group; stdin /dev/null, stdout+stderr the FIFO."""
    path = _resolve(cfg["argv"][0], cfg["env"])
    try:
        os.chdir(cfg["cwd"])  # posix_spawn has no chdir action; the shim only uses absolute paths
    except OSError as exc:
        raise SpecError("cwd: cannot enter %s (%s)" % (cfg["cwd"], exc.strerror)) from None
    try:
        return os.posix_spawn(
            path, cfg["argv"], cfg["env"],
            file_actions=[(os.POSIX_SPAWN_OPEN, 0, "/dev/null", os.O_RDONLY, 0),
                          (os.POSIX_SPAWN_DUP2, wfd, 1),
                          (os.POSIX_SPAWN_DUP2, wfd, 2)],
            setpgroup=0,
            # Ignored dispositions survive exec: give the task the defaults back.
            setsigdef=(_signal.SIGINT, _signal.SIGHUP, _signal.SIGPIPE, _signal.SIGTERM,
                       _signal.SIGCHLD, _signal.SIGQUIT),
            setsigmask=(),
        )
    finally:
        os.chdir("/")


def new_receipt(attempt_id, start_error=None):
    """The receipt document (core.receipt.Receipt's fields); ``main`` fills in the byte counts.
    With ``start_error`` the task never ran and the receipt is final at once."""
    now = _now_us()
    return {"attempt_id": attempt_id, "exit_code": None, "signal": None, "start_error": start_error,
            "started_at_us": now, "ended_at_us": now if start_error is not None else None,
            "bytes_total": 0, "bytes_kept": 0, "bytes_dropped": 0, "peak_rss_bytes": None, "cpu_time_us": None}


def run(w, cfg):
    global _task_pid
    receipt = new_receipt(w.attempt_id)
    try:
        w.art_fd = os.open(cfg["artifact_path"], os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC)
        st = os.fstat(w.art_fd)
    except OSError as exc:
        receipt["start_error"] = "artifact_path: cannot open (%s)" % exc.strerror
        receipt["ended_at_us"] = _now_us()
        return receipt
    if not stat.S_ISREG(st.st_mode):
        receipt["start_error"] = "artifact_path: not a regular file"
        receipt["ended_at_us"] = _now_us()
        return receipt
    w.quota = cfg["quota_bytes"]
    # The agent creates the file empty; anything already there counts against the quota.
    w.room = max(0, w.quota - st.st_size)
    try:
        os.mkfifo(w.fifo_path, 0o600)
        # Read end first and non-blocking, so opening the write end never blocks and EOF only
        # arrives once every writer (the task and its descendants) has closed it.
        rfd = os.open(w.fifo_path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        wfd = os.open(w.fifo_path, os.O_WRONLY | os.O_CLOEXEC)
    except OSError as exc:
        receipt["start_error"] = "output.fifo: cannot create (%s)" % exc.strerror
        receipt["ended_at_us"] = _now_us()
        return receipt

    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    _signal.set_wakeup_fd(wake_w, warn_on_full_buffer=False)
    _signal.signal(_signal.SIGCHLD, lambda s, f: None)  # only to wake poll through wakeup fd

    receipt["started_at_us"] = _now_us()
    try:
        if _term_requested:
            raise SpecError("terminated before the task was started")
        pid = _spawn(cfg, wfd)
    except (OSError, SpecError) as exc:
        os.close(wfd)
        os.close(rfd)
        if isinstance(exc, SpecError):
            receipt["start_error"] = str(exc)
        else:
            receipt["start_error"] = "exec %s: %s" % (cfg["argv"][0], exc.strerror or exc)
        receipt["ended_at_us"] = _now_us()
        return receipt
    os.close(wfd)
    _task_pid = pid
    if _term_requested:
        _on_term(_signal.SIGTERM, None)
    try:
        w.write_file_atomic("task.pid", pid, False)
    except OSError as exc:
        w.log_error("task.pid not written: %s" % exc)

    poller = select.poll()
    poller.register(rfd, select.POLLIN)
    poller.register(wake_r, select.POLLIN)
    buf = bytearray(READ_CHUNK_BYTES)  # one buffer for the whole run: memory stays flat
    view = memoryview(buf)
    eof = False
    status = None
    linger_deadline = None
    while not eof or status is None:
        if status is None:
            reaped, wstatus, rusage = os.wait4(pid, os.WNOHANG)
            if reaped:
                status = wstatus
                receipt["ended_at_us"] = _now_us()
                receipt["peak_rss_bytes"] = rusage.ru_maxrss * 1024
                receipt["cpu_time_us"] = int((rusage.ru_utime + rusage.ru_stime) * 1e6)
                linger_deadline = time.monotonic() + cfg["linger_s"]
                continue
        timeout_ms = None
        if linger_deadline is not None:
            left = linger_deadline - time.monotonic()
            if left <= 0:
                w.log_error("output still open %.1fs after the task exited; stopped draining"
                            % cfg["linger_s"])
                break
            timeout_ms = int(left * 1000) + 1
        for fd, _ in poller.poll(timeout_ms):
            if fd == wake_r:
                try:
                    while os.read(wake_r, 512):
                        pass
                except BlockingIOError:
                    pass
            elif not eof:
                # Bounded reads into the one buffer, no line assembly (F8: never buffer a line).
                for _ in range(16):
                    try:
                        n = os.readv(rfd, [buf])
                    except BlockingIOError:
                        break
                    if not n:
                        eof = True
                        poller.unregister(rfd)
                        break
                    w.consume(view[:n])

    os.close(rfd)
    if os.WIFSIGNALED(status):
        receipt["signal"] = os.WTERMSIG(status)
    else:
        receipt["exit_code"] = os.waitstatus_to_exitcode(status)
    return receipt


def main():
    for sig in (_signal.SIGINT, _signal.SIGHUP, _signal.SIGPIPE):
        _signal.signal(sig, _signal.SIG_IGN)
    _signal.signal(_signal.SIGTERM, _on_term)
    os.umask(0o077)
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
        receipt = new_receipt(attempt_id, "bad spec: %s" % exc)
    else:
        del spec
        try:
            receipt = run(w, cfg)
        except Exception as exc:  # the receipt must still appear; the cause goes to shim.err
            w.log_error("shim failure: %r" % (exc,))
            receipt = new_receipt(attempt_id, "shim failure: %s" % type(exc).__name__)
    if w.art_fd >= 0:
        try:
            os.fsync(w.art_fd)
        except OSError as exc:
            w.log_error("artifact fsync failed: %s" % exc)
        os.close(w.art_fd)
    receipt["bytes_total"] = w.bytes_total
    receipt["bytes_kept"] = w.bytes_kept
    receipt["bytes_dropped"] = w.bytes_total - w.bytes_kept
    # FIFO first: once the receipt exists the run directory is final.
    try:
        os.unlink(w.fifo_path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        w.log_error("output.fifo not removed: %s" % exc)
    try:
        w.write_file_atomic("receipt.json", receipt, False)
    except OSError as exc:
        w.log_error("receipt not written: %s" % exc)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
