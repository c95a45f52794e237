"""Room for the log Artifacts on small flash (ADR-0071 §4 step 6, §5): the reserve fits the file
system (core.profiles.fs_reserve), the agent's own old logs give the room back before a Run is
held, and a Run held for space says so with its figures in the journal, ``run show`` and
``/readyz``. A real ``qlagent serve`` over real tmpfs mounts. Root only (mount)."""

from __future__ import annotations

import os
import shutil

import pytest
from execkit import Agent, task
from kit import free_port, readyz, small_file_systems, wait_until

MiB = 1_048_576
pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="mounts a tmpfs: root only")

BIG = "head -c 5000000 /dev/zero | tr '\\0' x\n"       # 5 MB: the 4 MiB log quota keeps 4 MiB


@pytest.fixture
def root():
    with small_file_systems("qlagent-space-") as fs:
        yield fs


def free(path: str) -> int:
    v = os.statvfs(path)
    return v.f_bavail * v.f_frsize


def grow(path: str, nbytes: int) -> None:
    with open(path, "ab") as f:
        f.write(b"\0" * nbytes)


def journal_has(a: Agent, text: str) -> str:
    j = a.journal().decode()
    assert a.proc.poll() is None, j[-3000:]
    return j if text in j else ""


def test_old_logs_give_room_back_and_a_run_held_for_space_says_so(root):
    """The tester's router: a 48 MiB state file system, a task writing 5 MB. Its reserve is
    12 MiB (a quarter), so a log needs 16 MiB free. The Runs go on because the oldest logs of
    the task are pruned (journaled); when even that cannot make room the Run is held with its
    figures everywhere they are read, and starts by itself once space returns."""
    d, mount = root
    state = mount("state", "48m")
    port = free_port()
    a = Agent(d, config=f'[http]\nlisten = "127.0.0.1:{port}"\n')
    a.add(task("big", BIG, timeout_s=60))
    filler = os.path.join(state, "filler")
    grow(filler, free(state) - 22 * MiB)          # room for two logs, not for a third
    a.serve(exit_after=120)
    try:
        runs = []
        for _ in range(4):
            runs.append(a.start("big"))
            assert a.wait(runs[-1])["state"] == "succeeded", a.journal().decode()[-3000:]
        journal = a.journal().decode()
        pruned = [line for line in journal.splitlines() if "retention.pruned" in line]
        assert len(pruned) == 2 and all("reason=low_space" in p and "needed_bytes=16777216" in p for p in pruned), journal
        assert a.attempts(runs[0])[0]["attempt_id"] in pruned[0]
        p = a.cli("run", "logs", runs[0], check=False)
        assert p.returncode == 4 and b"pruned by retention" in p.stderr, p.stderr
        assert len(a.cli("run", "logs", runs[3]).stdout) == 4 * MiB

        grow(filler, free(state) - 9 * MiB)       # even the oldest log left would not make room
        held = a.start("big")
        line = wait_until(lambda: journal_has(a, "dispatch.refused"), 20, "the refusal",
                          detail=lambda: a.journal().decode()[-3000:])
        (line,) = [x for x in line.splitlines() if "dispatch.refused" in x]
        artifacts = os.path.join(state, "artifacts")
        assert "reason=low_space" in line and "needed_bytes=16777216" in line and f"path={artifacts}" in line, line
        shown_free = int(line.split("free_bytes=")[1].split()[0])
        assert shown_free < 16 * MiB
        assert a.run(held)["state"] == "queued"
        shown = a.cli("run", "show", held).stdout.decode()
        assert "waiting   no Run starts: low_space (free " in shown and \
            f"bytes, needs 16777216) on {artifacts}" in shown, shown
        status, body = readyz(port)
        assert status == 503 and body["checks"]["admission"].startswith("low_space (free "), body
        assert body["checks"]["store"] == "ok", body
        assert len(a.cli("run", "logs", runs[2]).stdout) == 4 * MiB      # nothing given up for nothing

        os.unlink(filler)                          # space returns: no restart
        assert a.wait(held)["state"] == "succeeded"
        status, body = readyz(port)
        assert status == 200 and body["checks"]["admission"] == "ok", body
        assert "dispatch.admitting" in a.journal().decode()
    finally:
        a.stop()


def test_a_run_is_admitted_at_exactly_the_free_space_it_needs_and_held_below(root):
    """A 16 MiB artifact file system: reserve 4 MiB + one 4 MiB log = 8 MiB needed. At exactly
    8 MiB free a Run starts; its 3-byte log takes a page, and the next Run (whose Task's only
    log is the newest, so nothing may be pruned) is held, 4096 bytes short, and says so."""
    d, mount = root
    arts = mount("artifacts", "16m")
    a = Agent(d, config=f'artifact_dir = "{arts}/logs"\n')
    a.add(task("hi", "echo hi\n"))
    os.mkdir(os.path.join(arts, "logs"), 0o700)
    grow(os.path.join(arts, "filler"), free(arts) - 8 * MiB)
    assert free(arts) == 8 * MiB
    a.serve(exit_after=60)
    try:
        first = a.start("hi")
        assert a.wait(first)["state"] == "succeeded"
        assert a.cli("run", "logs", first).stdout == b"hi\n"
        assert free(arts) == 8 * MiB - 4096
        second = a.start("hi")
        line = wait_until(lambda: journal_has(a, "dispatch.refused"), 20, "the refusal",
                          detail=lambda: a.journal().decode()[-3000:])
        (line,) = [x for x in line.splitlines() if "dispatch.refused" in x]
        assert f"free_bytes={8 * MiB - 4096} needed_bytes={8 * MiB}" in line, line
        assert "retention.pruned" not in a.journal().decode()
        assert a.run(second)["state"] == "queued"
        assert f"low_space (free {8 * MiB - 4096} bytes, needs {8 * MiB})" in a.cli("run", "show", second).stdout.decode()
    finally:
        a.stop()


def test_a_run_starts_on_an_8_mib_state_file_system(root):
    """A router's overlay may be 8 MiB: the reserve is 2 MiB there, not the Profile's 32."""
    d, mount = root
    mount("state", "8m")
    a = Agent(d)
    a.add(task("hi", "echo hi\n"))
    a.serve(exit_after=60)
    try:
        rid = a.start("hi")
        assert a.wait(rid)["state"] == "succeeded"
        assert a.cli("run", "logs", rid).stdout == b"hi\n"
    finally:
        a.stop()


def test_out_of_inodes_names_the_path_and_the_errno_and_doctor_fails(root):
    """An artifact file system with bytes to spare but no inode left: the Run is held with the
    log's path and the errno text in the journal and ``run show`` keeps it queued; ``doctor``'s
    free space line fails on the inodes; the Run starts once an inode returns."""
    d, mount = root
    arts = mount("artifacts", "16m,nr_inodes=64")
    a = Agent(d, config=f'artifact_dir = "{arts}/logs"\n')
    a.add(task("hi", "echo hi\n"))
    os.mkdir(os.path.join(arts, "logs"), 0o700)
    hog = os.path.join(arts, "hog")
    os.mkdir(hog)
    n = 0
    while True:
        try:
            open(os.path.join(hog, str(n)), "wb").close()
        except OSError:
            break
        n += 1
    doctor = a.cli("doctor", check=False)
    line = [x for x in doctor.stdout.decode().splitlines() if "free space" in x and "state" not in x][0]
    assert doctor.returncode != 0 and line.startswith("FAIL") and "0 inodes free, a Run needs 16" in line, doctor.stdout
    a.serve(exit_after=60)
    try:
        rid = a.start("hi")
        j = wait_until(lambda: journal_has(a, "dispatch.refused"), 20, "the refusal",
                       detail=lambda: a.journal().decode()[-3000:])
        (refused,) = [x for x in j.splitlines() if "dispatch.refused" in x]
        assert "reason=artifact_unwritable" in refused and f"path={arts}/logs/" in refused \
            and 'error="ENOSPC (No space left on device)"' in refused, refused
        assert a.run(rid)["state"] == "queued"
        shutil.rmtree(hog)
        a.poke()
        assert a.wait(rid)["state"] == "succeeded"
    finally:
        a.stop()
