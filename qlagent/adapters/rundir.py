"""What the shim leaves in a run directory (ARCHITECTURE.md "Shim contract"): the completion
receipt, the truncation fact and the task's PID, read back by the agent; and the removal of a
finished Attempt's directory.
"""

from __future__ import annotations

import os

from qlagent.core.errors import FACT_LIMIT_BYTES, RunFileError
from qlagent.core.receipt import Receipt, TruncationFact, decode_receipt, decode_truncation


def _read_fact(path: str) -> bytes | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return None
    try:
        return os.read(fd, FACT_LIMIT_BYTES + 1)
    finally:
        os.close(fd)


def read_receipt(run_dir: str) -> Receipt | None:
    """The completion receipt (run_dir/receipt.json) decoded as core.receipt.Receipt, or None
    if it is not written yet. Raises RunFileError naming the missing or mistyped field."""
    raw = _read_fact(os.path.join(run_dir, "receipt.json"))
    return None if raw is None else decode_receipt(raw)


def read_truncation(run_dir: str) -> TruncationFact | None:
    """The truncation fact (run_dir/truncated.json), or None if the quota was never exceeded.
    Raises RunFileError on a malformed fact."""
    raw = _read_fact(os.path.join(run_dir, "truncated.json"))
    return None if raw is None else decode_truncation(raw)


def read_task_pid(run_dir: str) -> int | None:
    """The task PID (= its process group ID) from run_dir/task.pid, or None before the spawn."""
    try:
        with open(os.path.join(run_dir, "task.pid"), "rb") as f:
            raw = f.read(32)
    except FileNotFoundError:
        return None
    try:
        pid = int(raw)
    except ValueError:
        raise RunFileError("task.pid", "not an integer") from None
    if pid <= 1:
        raise RunFileError("task.pid", "must be a process ID > 1")
    return pid


def remove_run_dir(run_dir: str) -> None:
    """Delete a finished Attempt's run directory; errors are ignored (it may be gone already).

    The shim writes only files there (FIFO, receipt, facts, task.pid), so a flat removal
    does it; ``shutil`` (whose bz2/lzma imports cost the resident agent ~0.2 MiB) is loaded
    only if something made a subdirectory.
    """
    try:
        entries = list(os.scandir(run_dir))
    except OSError:
        return
    for entry in entries:
        try:
            if entry.is_dir(follow_symlinks=False):
                import shutil
                shutil.rmtree(entry.path, ignore_errors=True)
            else:
                os.unlink(entry.path)
        except OSError:
            pass
    try:
        os.rmdir(run_dir)
    except OSError:
        pass
