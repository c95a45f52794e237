"""Artifact allocator on real directories and a real small filesystem (issue 3 item 3;
ADR-0071 §5; field report F1 retention)."""

import os
import stat
import subprocess
import uuid

import pytest

from qlagent.adapters import artifacts
import msgspec

from qlagent.adapters.artifacts import ArtifactAllocator, ArtifactExistsError, UnsafeDirectoryError
from qlagent.core.errors import ValidationError
from qlagent.core.profiles import EDGE, MiB


def mode(path):
    return stat.S_IMODE(os.lstat(path).st_mode)


def new_id():
    return str(uuid.uuid4())


def roomy(tmp_path, total=64 * MiB):
    # Reserve 0 so the test machine's own free space never decides the outcome.
    profile = msgspec.structs.replace(EDGE, fs_reserve_bytes=0, artifact_total_bytes=total)
    return ArtifactAllocator(str(tmp_path / "artifacts"), profile)


def test_allocate_creates_private_deterministic_file(tmp_path):
    alloc = roomy(tmp_path)
    attempt = new_id()
    path = alloc.allocate(attempt, alloc.admit(4 * MiB))
    assert path == str(tmp_path / "artifacts" / attempt[:2] / f"{attempt}.log")
    assert path == alloc.artifact_path(attempt)
    assert mode(tmp_path / "artifacts") == 0o700 and mode(os.path.dirname(path)) == 0o700
    st = os.lstat(path)
    assert stat.S_ISREG(st.st_mode) and mode(path) == 0o600 and st.st_size == 0


def test_existing_file_is_refused_not_reused(tmp_path):
    alloc = roomy(tmp_path)
    attempt = new_id()
    path = alloc.allocate(attempt, alloc.admit(MiB))
    with open(path, "wb") as f:
        f.write(b"old")
    with pytest.raises(ArtifactExistsError) as err:
        alloc.allocate(attempt, alloc.admit(MiB))
    assert err.value.code == "artifact_exists" and err.value.field == "attempt_id"
    assert err.value.exit_code == 3
    with open(path, "rb") as f:
        assert f.read() == b"old"


def test_symlinked_log_file_is_refused_and_target_untouched(tmp_path):
    alloc = roomy(tmp_path)
    attempt = new_id()
    alloc.allocate(new_id(), alloc.admit(MiB))
    shard = tmp_path / "artifacts" / attempt[:2]
    shard.mkdir(mode=0o700, exist_ok=True)
    target = tmp_path / "victim"
    os.symlink(target, shard / f"{attempt}.log")
    with pytest.raises(ArtifactExistsError):
        alloc.allocate(attempt, alloc.admit(MiB))
    assert not target.exists()


def test_symlinked_root_is_refused(tmp_path):
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    os.symlink(real, tmp_path / "artifacts")
    alloc = roomy(tmp_path)
    with pytest.raises(UnsafeDirectoryError) as err:
        alloc.allocate(new_id(), alloc.admit(MiB))
    assert err.value.code == "unsafe_directory" and err.value.field == "artifact root"
    assert os.listdir(real) == []


def test_symlinked_shard_is_refused(tmp_path):
    alloc = roomy(tmp_path)
    attempt = new_id()
    os.mkdir(tmp_path / "artifacts", 0o700)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    os.symlink(elsewhere, tmp_path / "artifacts" / attempt[:2])
    with pytest.raises(UnsafeDirectoryError) as err:
        alloc.allocate(attempt, alloc.admit(MiB))
    assert err.value.field == "artifact shard"
    assert os.listdir(elsewhere) == []


def test_wrong_mode_on_own_directory_is_fixed_foreign_owner_refused(tmp_path):
    root = tmp_path / "artifacts"
    root.mkdir(mode=0o755)
    os.chmod(root, 0o755)
    alloc = roomy(tmp_path)
    alloc.allocate(new_id(), alloc.admit(MiB))
    assert mode(root) == 0o700
    os.chown(root, 65534, 65534)
    with pytest.raises(UnsafeDirectoryError, match="owned by uid 65534"):
        alloc.allocate(new_id(), alloc.admit(MiB))


def test_bad_attempt_id_and_missing_admission_are_refused_with_nothing_created(tmp_path):
    alloc = roomy(tmp_path)
    for bad in ("../../etc/passwd", "ABCDEF00-0000-4000-8000-000000000000", ""):
        with pytest.raises(ValidationError, match="attempt_id: must be a lowercase canonical UUID4"):
            alloc.allocate(bad, alloc.admit(MiB))
    with pytest.raises(ValidationError, match="admission: allocation needs a granted admission"):
        alloc.allocate(new_id(), artifacts.SpaceGrant(False, "low_space", 0, 0, MiB))
    with pytest.raises(ValidationError, match="attempt_quota_bytes"):
        alloc.admit(0)
    assert not (tmp_path / "artifacts").exists()


def test_quota_larger_than_profile_log_is_refused(tmp_path):
    adm = roomy(tmp_path).admit(4 * MiB + 1)
    assert not adm.ok and adm.reason == "quota_too_large"


def test_total_artifact_quota_refuses_when_no_room_for_one_full_log(tmp_path):
    alloc = roomy(tmp_path, total=10 * MiB)
    for _ in range(2):
        path = alloc.allocate(new_id(), alloc.admit(4 * MiB))
        with open(path, "wb") as f:
            f.write(b"x" * 4 * MiB)
    adm = alloc.admit(4 * MiB)
    assert not adm.ok and adm.reason == "artifact_quota_full" and adm.used_bytes == 8 * MiB
    assert alloc.admit(2 * MiB).ok


@pytest.fixture
def small_fs(tmp_path):
    mnt = tmp_path / "small"
    mnt.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=40m", "tmpfs", str(mnt)],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"mounting a 40 MiB tmpfs is not permitted here: {proc.stderr.strip()}")
    yield mnt
    subprocess.run(["umount", str(mnt)], check=True)


def test_edge_admission_on_a_real_small_filesystem(small_fs):
    """The reserve fits the file system (core.profiles.fs_reserve): a quarter of 40 MiB, 10 MiB,
    not the edge Profile's 32 MiB. A log is admitted with free bytes exactly reserve + quota,
    refused one byte below."""
    alloc = ArtifactAllocator(str(small_fs / "artifacts"), EDGE)
    first = alloc.admit(EDGE.log_max_bytes)
    assert first.ok and first.free_bytes == 40 * MiB and first.reserve_bytes == 10 * MiB
    with open(small_fs / "filler", "wb") as f:
        f.write(b"\0" * (26 * MiB + 4096))
    free = os.statvfs(small_fs).f_bavail * os.statvfs(small_fs).f_frsize
    room = free - 10 * MiB                                 # 4 MiB - 4 KiB: short of one full log
    assert alloc.admit(room).ok
    adm = alloc.admit(room + 1)
    assert not adm.ok and adm.reason == "low_space" and adm.free_bytes == free
    assert adm.refusal(EDGE.artifact_total_bytes).text() == \
        f"low_space (free {free} bytes, needs {free + 1}) on {small_fs}"
    assert not (small_fs / "artifacts").exists()  # admission creates nothing
    with pytest.raises(ValidationError):
        alloc.allocate(new_id(), adm)
    assert not (small_fs / "artifacts").exists()


def test_make_room_frees_the_oldest_logs_but_never_a_tasks_newest(small_fs):
    """Short of space because of its own old logs, retention gives the room back (oldest first,
    only as many as needed); the newest log of each Task and a live one stay, and when even all
    the others would not make room, nothing is deleted."""
    alloc = ArtifactAllocator(str(small_fs / "artifacts"), EDGE)
    entries = []
    for n, task_id in enumerate(["a", "a", "a", "b"]):
        aid = new_id()
        path = alloc.allocate(aid, alloc.admit(MiB))
        with open(path, "wb") as f:
            f.write(b"x" * (4 * MiB))
        entries.append((aid, task_id, path, 1000 + n))
    live = new_id()
    live_path = alloc.allocate(live, alloc.admit(MiB))
    entries.append((live, "a", live_path, None))
    # 40 MiB: 10 reserve + 4 log = 14 needed; 16 MiB of logs, then a filler leaves 12 MiB free.
    with open(small_fs / "filler", "wb") as f:
        f.write(b"\0" * (12 * MiB))
    assert alloc.admit(EDGE.log_max_bytes).reason == "low_space"
    removed = alloc.make_room(EDGE.log_max_bytes, entries)
    assert [(r.attempt_id, r.bytes, r.rule) for r in removed] == [(entries[0][0], 4 * MiB, "low_space")]
    assert alloc.admit(EDGE.log_max_bytes).ok
    assert all(os.path.exists(e[2]) for e in entries[1:])
    with open(small_fs / "filler", "ab") as f:     # now only a's newest, b's and the live one are left to spare
        f.write(b"\0" * (7 * MiB))
    assert alloc.admit(EDGE.log_max_bytes).reason == "low_space"
    assert alloc.make_room(EDGE.log_max_bytes, entries[1:]) == []    # a's second log alone is not enough
    assert all(os.path.exists(e[2]) for e in entries[1:])


def test_an_8_mib_file_system_still_takes_a_log(tmp_path):
    """A router's overlay may be 8 MiB: the reserve is 2 MiB there, and one 4 MiB log fits."""
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mnt)]).returncode != 0:
        pytest.skip("mounting a tmpfs is not permitted here")
    try:
        adm = ArtifactAllocator(str(mnt / "artifacts"), EDGE).admit(EDGE.log_max_bytes)
        assert adm.ok and adm.reserve_bytes == 2 * MiB
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


def test_run_dir_is_private_idempotent_and_refuses_symlinks(tmp_path):
    alloc = roomy(tmp_path)
    attempt = new_id()
    path = alloc.run_dir(attempt)
    assert path == str(tmp_path / "runs" / attempt)
    assert mode(tmp_path / "runs") == 0o700 and mode(path) == 0o700
    assert alloc.run_dir(attempt) == path
    other = new_id()
    os.symlink(tmp_path, tmp_path / "runs" / other)
    with pytest.raises(UnsafeDirectoryError, match="run directory"):
        alloc.run_dir(other)


def _entries(alloc, task, count, size, start=0):
    out = []
    for i in range(count):
        attempt = new_id()
        path = alloc.allocate(attempt, alloc.admit(MiB))
        with open(path, "wb") as f:
            f.write(b"x" * size)
        out.append((attempt, task, path, start + i))
    return out


def test_prune_keeps_newest_per_task_and_bounds_total_bytes(tmp_path):
    alloc = roomy(tmp_path, total=1 << 40)
    hi = _entries(alloc, "hi", 12, 3)           # per-minute `echo hi` (F1), ended_at 0..11
    big = _entries(alloc, "big", 3, 1000, -100)  # older: ended_at -100..-98
    live = (new_id(), "hi", None, None)
    live_path = alloc.allocate(live[0], alloc.admit(MiB))
    live = (live[0], "hi", live_path, None)
    removed = alloc.prune(keep_per_task=5, max_total_bytes=2100, entries=hi + big + [live])
    per_task = [r.attempt_id for r in removed if r.rule == "per_task"]
    assert per_task == [e[0] for e in hi[:7]]  # oldest 7 of 12
    assert [r.attempt_id for r in removed if r.rule == "total_bytes"] == [big[0][0]]
    assert all(not os.path.exists(r.path) for r in removed)
    kept = hi[7:] + big[1:]
    assert all(os.path.exists(e[2]) for e in kept) and os.path.exists(live_path)
    assert sum(os.path.getsize(e[2]) for e in kept) <= 2100
    # Second pass over the same list deletes nothing more: the rule is a fixed point.
    again = [e for e in hi + big if os.path.exists(e[2])]
    assert alloc.prune(5, 2100, again) == []


def test_prune_never_deletes_outside_its_root(tmp_path):
    alloc = roomy(tmp_path)
    victim = tmp_path / "victim.log"
    victim.write_bytes(b"keep")
    with pytest.raises(ValidationError, match="entries.path"):
        alloc.prune(0, 0, [(new_id(), "t", str(victim), 1)])
    assert victim.read_bytes() == b"keep"


def test_f1_thousand_echo_hi_runs_keep_the_log_folder_bounded(tmp_path):
    alloc = roomy(tmp_path, total=1 * MiB)
    live = []
    most_files = 0
    for minute in range(1000):
        attempt = new_id()
        path = alloc.allocate(attempt, alloc.admit(4096))
        with open(path, "wb") as f:
            f.write(b"hi\n")
        live.append((attempt, "echo-hi", path, minute))
        gone = {r.attempt_id for r in alloc.prune(keep_per_task=20, max_total_bytes=1 * MiB, entries=live)}
        live = [e for e in live if e[0] not in gone]
        files = sum(len(os.listdir(d.path)) for d in os.scandir(tmp_path / "artifacts"))
        most_files = max(most_files, files)
    assert most_files == 20
    assert [e[3] for e in live] == list(range(980, 1000))
    assert alloc.used_bytes() == 20 * 3
