"""A log cut short by a full file system is a truncation fact with its reason (ADR-0071 §5):
the state file system (logs and run directories on it) fills to 0 bytes while a task writes
41 lines of 100 kB, far below the 4 MiB quota. The shim cannot write ``truncated.json`` there
either; the agent records the fact from the receipt once space returns, and ``run show``,
``run logs`` and the HTTP API all say the log lost bytes to ``ENOSPC``, not to the quota.
A real ``qlagent serve`` over a real tmpfs. Root only (mount)."""

from __future__ import annotations

import http.client
import json
import os

import pytest
from execkit import Agent, task
from kit import fill, free_port, small_file_systems, wait_until

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="mounts a tmpfs: root only")

LINE = 100_001                       # 100 kB of x and a newline
REASON = "write_error: ENOSPC (No space left on device)"


@pytest.fixture
def root():
    with small_file_systems("qlagent-logfull-") as (d, mount):
        mount("state", "8m")
        yield d


def get(port: int, path: str, token: str) -> tuple[int, dict, bytes]:
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        c.request("GET", path, headers={"Authorization": f"Bearer {token}"})
        r = c.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
    finally:
        c.close()


def test_a_log_cut_by_a_full_file_system_says_so_in_run_show_run_logs_and_the_api(root):
    port = free_port()
    go = os.path.join(root, "go")
    os.mkfifo(go, 0o600)
    a = Agent(root, config=f'[http]\nlisten = "127.0.0.1:{port}"\n')
    line = "head -c 100000 /dev/zero | tr '\\0' x; echo\n"
    done = os.path.join(root, "done")          # off the full file system, like go
    a.add(task("lines", line + f"read _ < {go}\n" + "i=0\nwhile [ $i -lt 40 ]; do\n  " + line + "  i=$((i+1))\ndone\n"
               + f": > {done}\n", timeout_s=120))
    viewer = a.cli("token", "create", "--subject", "vera", "--role", "viewer").stdout.decode().strip()
    a.serve(exit_after=120)
    try:
        rid = a.start("lines")
        a.wait(rid, ("running",))
        (attempt,) = a.attempts(rid)
        log = attempt["artifact_path"]
        wait_until(lambda: os.path.getsize(log) == LINE, 20, "the first line in the log")
        with a.db() as c:               # the WAL back into the database first: the file fills the rest
            c.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        filler = os.path.join(a.state, "filler")
        fill(filler)
        with open(go, "w") as f:        # the task writes its other 40 lines onto the full file system
            f.write("go\n")
        # Its last line is past the FIFO's 256 KiB, so the drainer has met the full file system.
        wait_until(lambda: os.path.exists(done), 20, "the task's last line")
        fill(filler)                    # whatever the agent gave back meanwhile
        run_dir = os.path.join(a.state, "runs", attempt["attempt_id"])
        assert not os.path.exists(os.path.join(run_dir, "truncated.json"))   # no room for it: the receipt tells
        os.unlink(filler)               # space returns: the receipt is written, the Run ends
        run = a.wait(rid)
        assert (run["state"], run["exit_code"]) == ("succeeded", 0)      # the task never noticed

        (attempt,) = a.attempts(rid)
        kept, dropped = attempt["bytes_kept"], attempt["bytes_dropped"]
        assert kept + dropped == 41 * LINE and LINE <= kept < 2 * LINE and dropped > 0
        assert os.path.getsize(log) == kept
        (fact,) = a.truncations(rid)
        assert (fact["quota_bytes"], fact["bytes_kept"], fact["bytes_dropped"], fact["reason"]) == \
            (4 * 1048576, kept, dropped, REASON)

        shown = a.cli("run", "show", rid).stdout.decode()
        assert f"kept={kept} dropped={dropped} TRUNCATED" in shown, shown
        assert f"          log truncated: {REASON}\n" in shown, shown
        attempt_json = json.loads(a.cli("run", "show", rid, "--json").stdout)["attempts"][0]
        assert (attempt_json["truncated"], attempt_json["truncationReason"]) == (True, REASON)

        logs = a.cli("run", "logs", rid)
        assert logs.stdout == (b"x" * 100_000 + b"\n" + b"x" * (kept - LINE))   # ends mid-line, as written
        assert logs.stderr.decode() == \
            f"qlagent: note: log truncated at {kept} bytes, {REASON}; {dropped} bytes dropped\n"
        page = json.loads(a.cli("run", "logs", rid, "--json").stdout)
        assert page["truncated"] is True and page["truncation"] == {
            "quotaBytes": 4 * 1048576, "bytesKept": kept, "bytesDropped": dropped, "reason": REASON}

        status, headers, body = get(port, f"/api/v3/projects/default/runs/{rid}/log?limit=16", viewer)
        assert status == 200 and body == b"x" * 16
        assert headers["x-qlagent-log-truncated"] == "true"
        assert headers["x-qlagent-truncation"] == f"quota={4 * 1048576} kept={kept} dropped={dropped}"
        assert headers["x-qlagent-truncation-reason"] == REASON
        status, _, body = get(port, f"/api/v3/projects/default/runs/{rid}", viewer)
        latest = json.loads(body)["latestAttempt"]
        assert status == 200 and (latest["truncated"], latest["truncationReason"]) == (True, REASON)
        assert "Traceback" not in a.journal().decode()
    finally:
        a.stop()
