"""The drainer (ADR-0071 §5, ARCHITECTURE.md "Shim contract"): the shim's reader of the task's
output FIFO into the log Artifact, with the exact quota and the truncation fact.

Part of the shim (``shim/main.py``): standard library only, no qlagent import, imported by its
plain name (``import drainer``) because the shim runs as a script under ``python3 -I -S``.
"""

import posix
import select

READ_CHUNK_BYTES = 65536


class Drainer:
    """The drainer (ADR-0071 §5, the "C-free FIFO drainer"): reads the task's FIFO into the log
    Artifact ``art_fd`` (O_APPEND), keeps at most ``quota`` bytes there (``room`` of them left:
    what the file already holds counts) and only counts the rest; at the first byte past the
    quota it writes the truncation fact. One READ_CHUNK_BYTES buffer for the whole run (memory
    stays flat), no line assembly (F8: never buffer a line). ``drain(timeout_ms)`` is its one
    step; the shim's loop calls it while it waits for the task, its leftovers and the linger.
    ``shim`` is the run's ``Shim`` (main.py): its ``log_error`` and ``write_file_atomic`` take
    the drainer's own errors and the truncation fact."""

    def __init__(self, shim, art_fd, quota, room):
        self.shim = shim
        self.art_fd = art_fd
        self.quota = quota
        self.room = room
        self.bytes_total = 0
        self.bytes_kept = 0
        self.truncated = False
        self.write_failed = False
        self.eof = False
        self.rfd = -1
        self.wake_r = -1
        self.poller = select.poll()
        self.buf = bytearray(READ_CHUNK_BYTES)
        self.view = memoryview(self.buf)

    def watch(self, rfd, wake_r):
        """Read the FIFO's non-blocking read end ``rfd``; ``wake_r`` (the signal wakeup pipe)
        only ends a wait early."""
        self.rfd, self.wake_r = rfd, wake_r
        self.poller.register(rfd, select.POLLIN)
        self.poller.register(wake_r, select.POLLIN)

    def drain(self, timeout_ms):
        """Wait at most ``timeout_ms`` (None: until something happens) and read what came;
        sets ``eof`` once every writer has closed the FIFO."""
        for fd, _ in self.poller.poll(timeout_ms):
            if fd == self.wake_r:
                try:
                    while posix.read(self.wake_r, 512):
                        pass
                except BlockingIOError:
                    pass
            elif not self.eof:
                for _ in range(16):   # bounded: the wakeup pipe and the clock are looked at again
                    try:
                        n = posix.readv(self.rfd, [self.buf])
                    except BlockingIOError:
                        break
                    if not n:
                        self.eof = True
                        self.poller.unregister(self.rfd)
                        break
                    self.consume(self.view[:n])

    def consume(self, data):
        """Account for one chunk (a memoryview into the read buffer); keep at most the remaining
        quota in the Artifact, drop the rest."""
        self.bytes_total += len(data)
        if self.room > 0:
            view = data[:self.room]
            try:
                while view:
                    n = posix.write(self.art_fd, view)
                    view = view[n:]
                    self.bytes_kept += n
                    self.room -= n
            except OSError as exc:
                # Flash full or similar: stop writing, keep draining so the task is unaffected.
                self.shim.log_error("artifact write failed: %s" % exc)
                self.room = 0
                self.write_failed = True
        if not self.truncated and not self.write_failed and self.bytes_total > self.bytes_kept:
            self.truncated = True
            try:
                self.shim.write_file_atomic("truncated.json",
                                       {"quota_bytes": self.quota, "bytes_kept": self.bytes_kept}, True)
            except OSError as exc:
                self.shim.log_error("truncation fact not written: %s" % exc)
