"""Private log Artifacts: deterministic paths, statvfs admission, retention (ADR-0071 §5,
issue 3 item 3).

Layout: ``<root>/<first 2 hex of the Attempt ID>/<attempt_id>.log``; root and shard directories
0700, files 0600 regular files created with O_CREAT|O_EXCL|O_NOFOLLOW; run directories
``<runs_root>/<attempt_id>`` (0700) for the shim. A symlinked root, shard or runs
directory, or one owned by another user, is refused; a wrong mode on our own directory is fixed.
"""

from __future__ import annotations

import errno
import os
import re
import stat

import msgspec

from qlagent.core.dispatch import Refusal
from qlagent.core.errors import ConflictError, StartError, UnavailableError, ValidationError
from qlagent.core.profiles import Profile, fs_reserve

_ATTEMPT_ID = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$")


class UnsafeDirectoryError(UnavailableError):
    """An Artifact or run directory is a symlink, not a directory, or owned by another user;
    ``field`` names which one (artifact root, artifact shard, runs root, run directory)."""

    code = "unsafe_directory"


class ArtifactExistsError(ConflictError):
    """The Attempt's log file is already there (field attempt_id): it is never reused or followed."""

    code = "artifact_exists"


class SpaceGrant(msgspec.Struct, frozen=True):
    """Result of ArtifactAllocator.admit: ``ok``; ``reason`` (a short stable code, None when ok:
    quota_too_large | low_space | artifact_quota_full); ``free_bytes`` (statvfs
    f_bavail*f_frsize), ``used_bytes`` (sum of Artifact sizes under the root), ``quota_bytes``
    (the attempt's log quota), ``reserve_bytes`` (what must stay free on that file system:
    core.profiles.fs_reserve) and ``path`` (the directory measured)."""

    ok: bool
    reason: str | None
    free_bytes: int
    used_bytes: int
    quota_bytes: int
    reserve_bytes: int = 0
    path: str = ""

    def refusal(self, total_bytes: int) -> Refusal | None:
        """The figures of a refused grant (``total_bytes``: the Profile's total for logs)."""
        if self.ok:
            return None
        if self.reason == "low_space":
            return Refusal(self.reason, self.path, self.free_bytes, self.reserve_bytes + self.quota_bytes)
        if self.reason == "artifact_quota_full":
            return Refusal(self.reason, self.path, max(0, total_bytes - self.used_bytes), self.quota_bytes)
        return Refusal(self.reason, self.path, None, self.quota_bytes)


class Pruned(msgspec.Struct, frozen=True):
    """One log removed by ArtifactAllocator.prune or make_room: its Attempt ID, path, size in
    bytes (0 when it was already gone) and the rule that removed it: ``per_task``,
    ``total_bytes`` or (make_room) the refusal it lifted, ``low_space`` / ``artifact_quota_full``."""

    attempt_id: str
    path: str
    bytes: int
    rule: str


def _check_attempt_id(attempt_id: str) -> str:
    if not isinstance(attempt_id, str) or not _ATTEMPT_ID.match(attempt_id):
        raise ValidationError("attempt_id", "must be a lowercase canonical UUID4")
    return attempt_id


def _errno_name(exc: OSError) -> str:
    return f"{errno.errorcode.get(exc.errno, exc.errno)} ({exc.strerror})"


def _open_private_dir(name: str, dir_fd: int | None, shown: str, path: str) -> int:
    """mkdir 0700 if missing, then open it without following a symlink and make sure it is
    ours with mode 0700. Returns an O_DIRECTORY fd. ``shown``/``path`` name it in errors."""
    try:
        os.mkdir(name, 0o700, dir_fd=dir_fd)
    except FileExistsError:
        pass
    try:
        fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError as exc:
        # ELOOP: a symlink; ENOTDIR: a file or a symlink to one.
        raise UnsafeDirectoryError(f"{shown} {path}: not a real directory: {_errno_name(exc)}",
                                   field=shown) from None
    st = os.fstat(fd)
    if st.st_uid != os.geteuid():
        os.close(fd)
        raise UnsafeDirectoryError(f"{shown} {path}: owned by uid {st.st_uid}, not {os.geteuid()}", field=shown)
    if stat.S_IMODE(st.st_mode) != 0o700:
        os.fchmod(fd, 0o700)
    return fd


class ArtifactAllocator:
    """Allocates private log Artifacts under ``root`` within ``profile``'s log_max_bytes,
    fs_reserve_bytes (scaled to the file system: core.profiles.fs_reserve) and
    artifact_total_bytes (core.profiles, ADR-0071 §5).
    ``runs_root`` (default: ``<root>/../runs``) holds the shim's run directories."""

    def __init__(self, root: str, profile: Profile, runs_root: str | None = None):
        self.root = os.path.abspath(root)
        self.runs_root = os.path.abspath(runs_root or os.path.join(os.path.dirname(self.root), "runs"))
        self.profile = profile
        self.log_bytes = profile.log_max_bytes
        self.total_bytes = profile.artifact_total_bytes

    def artifact_path(self, attempt_id: str) -> str:
        """Deterministic path of an Attempt's log (pure; creates nothing)."""
        _check_attempt_id(attempt_id)
        return os.path.join(self.root, attempt_id[:2], attempt_id + ".log")

    def used_bytes(self) -> int:
        """Sum of the sizes of the regular files in the shard directories, in bytes."""
        total = 0
        try:
            shards = list(os.scandir(self.root))
        except FileNotFoundError:
            return 0
        for shard in shards:
            if not shard.is_dir(follow_symlinks=False):
                continue
            for entry in os.scandir(shard.path):
                if entry.is_file(follow_symlinks=False):
                    total += entry.stat(follow_symlinks=False).st_size
        return total

    def admit(self, attempt_quota_bytes: int) -> SpaceGrant:
        """Capacity admission before anything is created (ADR-0071 §4 step 6, §5): statvfs free
        bytes minus the reserve (core.profiles.fs_reserve of the file system's size) must cover
        one full log — free bytes equal to reserve + quota are enough — and the Artifacts already under
        the root plus this log must stay within the total quota. Creates nothing; the root's
        filesystem is measured (its nearest existing ancestor before the first allocation).
        Raises ValidationError (field attempt_quota_bytes) for a non-positive quota."""
        if (not isinstance(attempt_quota_bytes, int) or isinstance(attempt_quota_bytes, bool)
                or attempt_quota_bytes <= 0):
            raise ValidationError("attempt_quota_bytes", "must be an integer > 0", limit=self.log_bytes)
        probe = self.root
        while not os.path.exists(probe):
            probe = os.path.dirname(probe)
        vfs = os.statvfs(probe)
        free = vfs.f_bavail * vfs.f_frsize
        reserve = fs_reserve(self.profile, vfs.f_blocks * vfs.f_frsize)
        used = self.used_bytes()
        if attempt_quota_bytes > self.log_bytes:
            reason = "quota_too_large"
        elif free - reserve < attempt_quota_bytes:
            reason = "low_space"
        elif used + attempt_quota_bytes > self.total_bytes:
            reason = "artifact_quota_full"
        else:
            reason = None
        return SpaceGrant(reason is None, reason, free, used, attempt_quota_bytes, reserve, probe)

    def allocate(self, attempt_id: str, admission: SpaceGrant) -> str:
        """Create the Attempt's empty log file (0600, O_CREAT|O_EXCL|O_NOFOLLOW) after a granted
        admission and return its absolute path. Raises ValidationError (field admission: not
        granted; field attempt_id), UnsafeDirectoryError (root or shard is a symlink / not ours),
        ArtifactExistsError (the file is already there)."""
        if not isinstance(admission, SpaceGrant) or not admission.ok:
            raise ValidationError("admission", "allocation needs a granted admission")
        path = self.artifact_path(attempt_id)
        root_fd = _open_private_dir(self.root, None, "artifact root", self.root)
        try:
            shard_fd = _open_private_dir(attempt_id[:2], root_fd, "artifact shard", os.path.dirname(path))
        finally:
            os.close(root_fd)
        try:
            fd = os.open(attempt_id + ".log", os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                         | os.O_CLOEXEC, 0o600, dir_fd=shard_fd)
        except FileExistsError:
            raise ArtifactExistsError(f"artifact_path {path}: EEXIST ({_what_is_there(path)} is already there)",
                                      field="attempt_id") from None
        finally:
            os.close(shard_fd)
        try:
            os.fchmod(fd, 0o600)  # exact mode whatever the umask
        finally:
            os.close(fd)
        return path

    def run_dir(self, attempt_id: str) -> str:
        """Create (or re-check) ``<runs_root>/<attempt_id>`` with mode 0700 and return its path.
        Raises ValidationError (attempt_id) or UnsafeDirectoryError (symlinked / foreign)."""
        _check_attempt_id(attempt_id)
        runs_fd = _open_private_dir(self.runs_root, None, "runs root", self.runs_root)
        try:
            os.close(_open_private_dir(attempt_id, runs_fd, "run directory", os.path.join(self.runs_root, attempt_id)))
        finally:
            os.close(runs_fd)
        return os.path.join(self.runs_root, attempt_id)

    def prune(self, keep_per_task: int, max_total_bytes: int, entries) -> list[Pruned]:
        """Retention: delete the oldest ended logs so that each task keeps at most
        ``keep_per_task`` logs and all ended logs together take at most ``max_total_bytes``.

        ``entries`` is an iterable of (attempt_id, task_id, path, ended_at) from the caller's
        store; ended_at None means the Attempt is live and its log is never touched, and a path
        that is not this allocator's path for that Attempt is never deleted (ValidationError,
        field entries.path, raised before anything is removed). Work is bounded by
        len(entries). Returns what was deleted, oldest first; the caller drops its metadata.
        """
        if keep_per_task < 0 or max_total_bytes < 0:
            raise ValidationError("keep_per_task/max_total_bytes", "must be >= 0")
        ended = self._ended(entries)
        per_task: dict[str, int] = {}
        doomed: list[tuple[tuple, str]] = []
        kept = []
        for item in ended:
            count = per_task.get(item[2], 0)
            if count >= keep_per_task:
                doomed.append((item, "per_task"))
            else:
                per_task[item[2]] = count + 1
                kept.append((item, _size(item[3])))
        total = sum(size for _, size in kept)
        while kept and total > max_total_bytes:
            item, size = kept.pop()  # oldest of the survivors
            total -= size
            doomed.append((item, "total_bytes"))
        return _remove(doomed)

    def make_room(self, attempt_quota_bytes: int, entries) -> list[Pruned]:
        """Retention for room: when ``admit(attempt_quota_bytes)`` is refused ``low_space`` or
        ``artifact_quota_full``, delete the oldest ended logs — never a live one, never the
        newest log of a Task — until it would be granted: the blocks they hold (st_blocks)
        cover the file system's shortfall and their sizes the total quota's. Deletes nothing
        when even all of them would not (a log is not given up for nothing). ``entries`` as
        for ``prune``; returns what was deleted, oldest first, with the refusal as its rule."""
        grant = self.admit(attempt_quota_bytes)
        if grant.reason not in ("low_space", "artifact_quota_full"):
            return []
        short_fs = grant.reserve_bytes + attempt_quota_bytes - grant.free_bytes
        short_quota = grant.used_bytes + attempt_quota_bytes - self.total_bytes
        newest: set[str] = set()
        doomed: list[tuple[tuple, str]] = []
        for item in self._ended(entries):
            if item[2] not in newest:
                newest.add(item[2])
                continue
            doomed.append((item, grant.reason))
        doomed.reverse()                                 # oldest first
        chosen, blocks, sizes = [], 0, 0
        for entry in doomed:
            if blocks >= short_fs and sizes >= short_quota:
                break
            try:
                st = os.lstat(entry[0][3])
            except FileNotFoundError:
                continue
            chosen.append(entry)
            blocks += st.st_blocks * 512
            sizes += st.st_size
        if blocks < short_fs or sizes < short_quota:
            return []
        return _remove(chosen)

    def _ended(self, entries) -> list[tuple]:
        """(ended_at, attempt_id, task_id, path) of the ended entries, newest first; raises
        ValidationError (entries.path) for a path that is not this allocator's for its Attempt."""
        ended = []
        for attempt_id, task_id, path, ended_at in entries:
            if os.path.abspath(path) != self.artifact_path(attempt_id):
                raise ValidationError("entries.path", f"{path} is not the artifact of {attempt_id}")
            if ended_at is not None:
                ended.append((ended_at, attempt_id, task_id, path))
        ended.sort(reverse=True)
        return ended


def _remove(doomed: list[tuple[tuple, str]]) -> list[Pruned]:
    removed = []
    for (ended_at, attempt_id, _task, path), rule in sorted(doomed):
        size = _size(path)
        try:
            os.unlink(path)
        except FileNotFoundError:
            size = 0
        removed.append(Pruned(attempt_id, path, size, rule))
    return removed


def _what_is_there(path: str) -> str:
    try:
        mode = os.lstat(path).st_mode
    except OSError:
        return "a file"
    if stat.S_ISLNK(mode):
        return "a symlink"
    if stat.S_ISDIR(mode):
        return "a directory"
    return "a file" if stat.S_ISREG(mode) else "a special file"


def _size(path: str) -> int:
    try:
        return os.lstat(path).st_size
    except FileNotFoundError:
        return 0


class Artifacts:
    """``core.ports.ArtifactPort`` over an ArtifactAllocator: the grant of ``admit`` is kept for
    the ``allocate`` that follows it in the same pass."""

    def __init__(self, allocator: ArtifactAllocator) -> None:
        self._a = allocator
        self._grant: SpaceGrant | None = None

    def used_bytes(self) -> int:
        return self._a.used_bytes()

    def admit(self, quota_bytes: int) -> Refusal | None:
        grant = self._a.admit(quota_bytes)
        self._grant = grant if grant.ok else None
        return grant.refusal(self._a.total_bytes)

    def allocate(self, attempt_id: str) -> str:
        try:
            return self._a.allocate(attempt_id, self._grant)
        except ArtifactExistsError as e:
            raise StartError(e.message, code="artifact_unusable") from None
        except OSError as e:            # read-only, out of inodes, no permission
            raise UnavailableError(_errno_name(e), code="artifact_unwritable",
                                   field=self._a.artifact_path(attempt_id)) from None

    def discard(self, path: str) -> None:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass

    def discard_attempt(self, attempt_id: str) -> None:
        self.discard(self._a.artifact_path(attempt_id))

    def prune(self, keep_per_task: int, max_total_bytes: int, entries) -> list[str]:
        removed = self._a.prune(keep_per_task, max_total_bytes,
                                [(e.attempt_id, e.task_id, e.artifact_path, e.ended_at_us) for e in entries])
        return [r.attempt_id for r in removed]

    def make_room(self, quota_bytes: int, entries) -> tuple[list[str], int]:
        removed = self._a.make_room(quota_bytes,
                                    [(e.attempt_id, e.task_id, e.artifact_path, e.ended_at_us) for e in entries])
        return [r.attempt_id for r in removed], sum(r.bytes for r in removed)
