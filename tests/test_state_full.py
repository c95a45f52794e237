"""A full state file system is a condition, not a crash (issue #20 point 4, freifunk-berlin
firmware #191 kind): the state directory on a 1 MiB tmpfs mounted here (the log Artifacts
elsewhere), a seconds schedule filling the database, then the file system filled up by a file
of our own. A real ``qlagent serve`` must stay up, refuse to start Runs and say why, answer
the CLI in one line, and carry on by itself once the file is removed. Root only (mount)."""

from __future__ import annotations

import os
import time

import pytest
from execkit import Agent, task
from kit import fill, free_port, readyz, small_file_systems, wait_until

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="mounts a tmpfs: root only")

@pytest.fixture
def root():
    with small_file_systems("qlagent-full-") as (d, mount):
        mount("state", "1m")
        yield d


def count(a: Agent, state: str) -> int:
    with a.db() as c:
        return c.execute("SELECT count(*) FROM runs WHERE state = ?", (state,)).fetchone()[0]


def wait_running(a: Agent, predicate, what: str, timeout: float = 20.0) -> None:
    """Wait for ``predicate()`` while ``a``'s serve stays up; a failure carries its journal tail."""
    def check():
        assert a.proc.poll() is None, a.journal().decode()[-3000:]
        return predicate()
    wait_until(check, timeout, what, step=0.2, detail=lambda: a.journal().decode()[-3000:])


def test_a_full_state_file_system_pauses_the_agent_and_it_resumes_when_space_returns(root):
    port = free_port()
    a = Agent(root, config=f'artifact_dir = "{root}/artifacts"\n[http]\nlisten = "127.0.0.1:{port}"\n')
    a.add(task("tick", "echo tick\n", schedule=["* * * * * *"]), task("slow", "sleep 6; echo done\n", timeout_s=60))
    a.serve(exit_after=120)
    try:
        wait_running(a, lambda: count(a, "succeeded") >= 2, "scheduled Runs before the file system fills")
        slow = a.start("slow")
        a.wait(slow, ("running",))
        waiting = a.start("slow")                 # queued behind it (concurrency = "single")
        with a.db() as c:               # the WAL back into the database first: the file fills the rest
            c.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        filler = os.path.join(a.state, "filler")
        fill(filler)
        wait_running(a, lambda: "store.unavailable" in a.journal().decode(), "the store filling up")
        fill(filler)                    # and what the agent's own checkpoint gave back
        time.sleep(8)                   # eight more fires due, and the slow Run ends: none may kill it
        assert a.proc.poll() is None
        assert a.run(slow)["state"] == "running"        # its shim holds the receipt until it fits
        status, body = readyz(port)
        assert status == 503 and "full" in body["checks"]["store"], body
        p = a.cli("task", "disable", "tick", check=False)
        assert p.returncode == 5 and p.stderr.count(b"\n") == 1 and b"full" in p.stderr, (p.returncode, p.stderr)
        shown = a.cli("run", "show", waiting).stdout.decode()
        assert "waiting   no Run starts: the state file system is full" in shown, shown
        doctor = a.cli("doctor", check=False)
        assert doctor.returncode != 0 and b"FAIL  state free space" in doctor.stdout, doctor.stdout
        journal = a.journal().decode()
        assert journal.count("store.unavailable") == 1 and "Traceback" not in journal, journal[-3000:]
        done = count(a, "succeeded")
        os.unlink(filler)                                 # space returns: no restart
        wait_running(a, lambda: count(a, "succeeded") >= done + 3, "Runs after the space returned")
        run = a.run(slow)
        assert (run["state"], run["exit_code"]) == ("succeeded", 0)
        assert a.wait(waiting)["state"] == "succeeded"
        assert a.cli("run", "logs", slow).stdout == b"done\n"
        status, body = readyz(port)
        assert status == 200, body
        assert "store.available" in a.journal().decode()
        with a.db() as c:
            assert c.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    finally:
        a.stop()


def test_an_agent_started_on_a_full_state_file_system_waits_for_space_instead_of_exiting(root):
    """A router rebooting with its flash full: the database's -wal/-shm files went with the last
    close and cannot be made again, so every open fails. The CLI and doctor must say the file
    system is full (exit 5, one line), and ``serve`` must wait for space, not exit into a
    restart loop."""
    a = Agent(root, config=f'artifact_dir = "{root}/artifacts"\n')
    a.add(task("tick", "echo tick\n", schedule=["* * * * * *"]))
    filler = os.path.join(a.state, "filler")
    fill(filler)
    p = a.cli("run", "ls", check=False)
    assert p.returncode == 5 and p.stderr.count(b"\n") == 1 and b"file system is full" in p.stderr, p.stderr
    doctor = a.cli("doctor", check=False)
    assert doctor.returncode == 5 and b"FAIL  state free space" in doctor.stdout, (doctor.stdout, doctor.stderr)
    proc = a.serve(ready=None)                   # no service.ready until the store opens
    try:
        time.sleep(4)
        journal = a.journal().decode()
        assert proc.poll() is None, journal
        assert journal.count("store.unavailable") == 1 and "Traceback" not in journal, journal
        os.unlink(filler)                                 # space returns: the same process carries on
        wait_running(a, lambda: count(a, "succeeded") >= 2, "Runs after the space returned")
        assert "service.ready" in a.journal().decode()
    finally:
        a.stop()
