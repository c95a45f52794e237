"""The drainer (ADR-0071 §5, ARCHITECTURE.md "Shim contract"): the shim's reader of the task's
output FIFO into the log Artifact, with the exact quota and the truncation fact.

Part of the shim (``shim/main.py``): standard library only, no qlagent import, imported by its
plain name (``import drainer``) because the shim runs as a script under ``python3 -I -S``.
"""

import errno
import posix
import select

READ_CHUNK_BYTES = 65536
# Asked of one splice(2), more than the FIFO holds: one call moves all it holds.
SPLICE_BYTES = 1 << 20
_SPLICE_FLAGS = getattr(posix, "SPLICE_F_NONBLOCK", 0) | getattr(posix, "SPLICE_F_MOVE", 0)


class Drainer:
    """The drainer (ADR-0071 §5, the "C-free FIFO drainer"): moves the task's FIFO into the log
    Artifact ``art_fd`` (its offset at the file's end), keeps at most ``quota`` bytes there
    (``room`` of them left: what the file already holds counts) and only counts the rest; at
    the first byte past the quota it writes the truncation fact. No line assembly (F8: never
    buffer a line). ``drain(timeout_ms)`` is its one step; the shim's loop calls it while it
    waits for the task, its leftovers and the linger. ``shim`` is the run's ``Shim`` (main.py):
    its ``log_error`` and ``write_file_atomic`` take the drainer's own errors and the
    truncation fact.

    The bytes go by splice(2), FIFO to file and past the quota FIFO to /dev/null, so they never
    pass through this process: the kernel copies them once, from the pipe into the page cache
    (``cat`` copies twice, into its buffer and out of it); where splice is refused (no
    os.splice, or a file system without it: EINVAL) they are read into one READ_CHUNK_BYTES
    buffer, made then, and written."""

    def __init__(self, shim, art_fd, quota, room):
        self.shim = shim
        self.art_fd = art_fd
        self.quota = quota
        self.room = room
        self.bytes_total = 0
        self.bytes_kept = 0
        self.truncated = False
        self.write_error = None      # "ENOSPC (No space left on device)": the first failed write
        self.eof = False
        self.rfd = -1
        self.wake_r = -1
        self.null_fd = -1
        self.splicing = hasattr(posix, "splice")
        self.poller = select.poll()
        self.buf = None

    def watch(self, rfd, wake_r):
        """Read the FIFO's non-blocking read end ``rfd``; ``wake_r`` (the signal wakeup pipe)
        only ends a wait early."""
        self.rfd, self.wake_r = rfd, wake_r
        self.poller.register(rfd, select.POLLIN)
        self.poller.register(wake_r, select.POLLIN)

    def drain(self, timeout_ms):
        """Wait at most ``timeout_ms`` (None: until something happens) and take what came;
        sets ``eof`` once every writer has closed the FIFO."""
        for fd, _ in self.poller.poll(timeout_ms):
            if fd == self.wake_r:
                try:
                    while posix.read(self.wake_r, 512):
                        pass
                except BlockingIOError:
                    pass
            elif not self.eof:
                # Again until the FIFO is empty: the task writes on meanwhile (on another CPU),
                # and a second call costs less than a poll's sleep and wake-up. Bounded: the
                # wakeup pipe and the clock are looked at again.
                for _ in range(16):
                    n = self._splice() if self.splicing else self._copy()
                    if n is None:
                        break
                    if not n:
                        self.eof = True
                        self.poller.unregister(self.rfd)
                        break

    def _splice(self):
        """One splice of what the FIFO holds: into the Artifact while room is left, else to
        /dev/null. Returns the bytes moved (0: EOF), None when the FIFO is empty (or splice was
        refused: the copying path takes over)."""
        keep = self.room > 0
        if not keep and self.null_fd < 0:
            self.null_fd = posix.open("/dev/null", posix.O_WRONLY | posix.O_CLOEXEC)
        try:
            n = posix.splice(self.rfd, self.art_fd if keep else self.null_fd,
                             min(self.room, SPLICE_BYTES) if keep else SPLICE_BYTES, flags=_SPLICE_FLAGS)
        except BlockingIOError:
            return None
        except OSError as exc:
            if exc.errno in (errno.EINVAL, errno.ENOSYS):
                self.splicing = False        # the bytes are still in the FIFO: _copy takes them
                return self._copy()
            if not keep:
                raise
            self._write_failed(exc)          # nothing moved: the next splice drops it
            return self._splice()
        self._account(n, n if keep else 0)
        return n

    def _copy(self):
        """The same through a buffer: read once, keep at most the room left, drop the rest."""
        if self.buf is None:
            self.buf = bytearray(READ_CHUNK_BYTES)
        try:
            n = posix.readv(self.rfd, [self.buf])
        except BlockingIOError:
            return None
        if n:
            self.consume(memoryview(self.buf)[:n])
        return n

    def consume(self, data):
        """Account for one chunk (a memoryview into the read buffer); keep at most the remaining
        quota in the Artifact, drop the rest."""
        kept = 0
        if self.room > 0:
            view = data[:self.room]
            try:
                while view:
                    n = posix.write(self.art_fd, view)
                    view = view[n:]
                    kept += n
            except OSError as exc:
                self._write_failed(exc)
        self._account(len(data), kept)

    def _account(self, total, kept):
        self.bytes_total += total
        self.bytes_kept += kept
        self.room = max(0, self.room - kept)
        if not self.truncated and self.bytes_total > self.bytes_kept:
            self.truncated = True
            reason = "quota" if self.write_error is None else "write_error: " + self.write_error
            try:
                self.shim.write_file_atomic("truncated.json", {"quota_bytes": self.quota, "bytes_kept": self.bytes_kept,
                                                               "reason": reason}, True)
            except OSError as exc:
                # Likely the same full file system: the receipt's write_error and byte counts
                # still tell the agent, which records the fact from them.
                self.shim.log_error("truncation fact not written: %s" % exc)

    def _write_failed(self, exc):
        # Flash full or similar: stop writing, keep draining so the task is unaffected.
        self.shim.log_error("artifact write failed: %s" % exc)
        self.room = 0
        if self.write_error is None:
            self.write_error = "%s (%s)" % (errno.errorcode.get(exc.errno, "errno %s" % exc.errno),
                                            posix.strerror(exc.errno) if exc.errno else exc)
