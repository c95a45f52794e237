"""``qlagent serve`` on examples/router-tasks.toml for real (issue 4 acceptance, ≈ 70 s):
heartbeat runs on its minute, chatty is truncated at the edge quota with a truncation fact,
hang is timed out, fail is recorded with exit 3, ddns-update gets its secret and prints only
its length — and the token is nowhere on disk (DB, WAL, logs, run files) nor in the agent's
stderr. wan-check and ddns-update are network-gated: this host has a default route.
"""

from __future__ import annotations

import os
import stat
from datetime import datetime

import pytest

from qlcli import js, ok
from servehelp import NotifyListener, db, runs_of, start_serve
from kit import clean_env, wait_until

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(REPO, "examples", "router-tasks.toml")
TOKEN = "ddns-T0KEN-9f27c1e4b8a6"
MiB = 1_048_576


def _instant(text: str) -> datetime:
    return datetime.fromisoformat(text.replace("Z", "+00:00"))


def _has_default_route() -> bool:
    with open("/proc/net/route") as f:
        return any(line.split()[1] == "00000000" for line in list(f)[1:])


def _files_containing(root: str, needle: bytes) -> list[str]:
    hits = []
    for d, _, files in os.walk(root):
        for name in files:
            path = os.path.join(d, name)
            try:
                if not stat.S_ISREG(os.lstat(path).st_mode):     # a live run's FIFO would block open()
                    continue
                with open(path, "rb") as f:
                    if needle in f.read():
                        hits.append(path)
            except OSError:
                continue
    return hits


def _final(state, task):
    """The Run started by hand (cron may have added its own for ddns-update/wan-check)."""
    with db(state) as c:
        (run_id,), = c.execute("SELECT r.run_id FROM runs r JOIN tasks t USING (task_id) "
                               "WHERE t.name = ? AND r.trigger_type = 'task_start'", (task,)).fetchall()
    return js(state, "run", "show", run_id)


@pytest.mark.slow
@pytest.mark.skipif(not _has_default_route(), reason="wan-check and ddns-update need a default route")
def test_router_task_set_under_serve(state, workdir):
    ok(state, "secret", "set", "ddns_token", stdin=TOKEN.encode() + b"\n")
    ok(state, "task", "add", "-f", EXAMPLE)
    cfg = os.path.join(workdir, "qlagent.toml")
    with open(cfg, "w") as f:
        f.write("drain_grace_s = 0\nkill_grace_s = 1\n")
    listener = NotifyListener(workdir)
    p = start_serve(state, env=clean_env(QLAGENT_CONFIG=cfg, NOTIFY_SOCKET=listener.path))
    try:
        listener.wait_for(lambda m: m == "READY=1")
        for task in ("chatty", "hang", "fail", "ddns-update", "wan-check"):
            ok(state, "run", "start", task)
        # the heartbeat's own minute: a cron Run scheduled on a whole minute, succeeded
        def heartbeat_done():
            with db(state) as c:
                return c.execute("SELECT r.run_id, r.scheduled_for_us FROM runs r JOIN tasks t USING (task_id) "
                                 "WHERE t.name = 'heartbeat' AND r.trigger_type = 'cron' AND r.state = 'succeeded'"
                                 ).fetchone()
        hb_run, hb_instant = wait_until(heartbeat_done, timeout=75, step=0.5)
        wait_until(lambda: all(runs_of(state, t)[0][1] not in ("queued", "starting", "running")
                               for t in ("chatty", "hang", "fail", "ddns-update", "wan-check")), timeout=30)
        assert os.path.exists(os.path.join(state, "qlagent.db-wal"))
        assert _files_containing(state, TOKEN.encode()) == []        # WAL and run dirs, while live
    finally:
        assert p.stop() == 0
        listener.close()
    err = p.journal()

    assert hb_instant % 60_000_000 == 0
    assert ok(state, "run", "logs", hb_run).stdout.startswith(b"heartbeat ")

    chatty = _final(state, "chatty")
    (a,) = chatty["attempts"]
    assert chatty["state"] == "succeeded" and a["truncated"] and a["bytesKept"] == 4 * MiB
    with db(state) as c:
        fact = c.execute("SELECT quota_bytes, bytes_kept, bytes_dropped FROM truncation_facts WHERE attempt_id = ?",
                         (a["attemptId"],)).fetchone()
    assert fact[0] == fact[1] == 4 * MiB and fact[2] > 0
    assert len(ok(state, "run", "logs", chatty["runId"]).stdout) == 4 * MiB

    hang = _final(state, "hang")
    assert hang["state"] == "timed_out"
    ran_s = (_instant(hang["endedAt"]) - _instant(hang["attempts"][0]["startedAt"])).total_seconds()
    assert ran_s < 2 + 5 + 3     # timeout + grace + slack

    fail = _final(state, "fail")
    assert fail["state"] == "failed" and fail["exitCode"] == 3

    ddns = _final(state, "ddns-update")
    assert ddns["state"] == "succeeded"
    out = ok(state, "run", "logs", ddns["runId"]).stdout.decode()
    assert f"token present ({len(TOKEN)} chars)" in out

    wan = _final(state, "wan-check")
    assert wan["state"] == "succeeded" and b'"interface"' in ok(state, "run", "logs", wan["runId"]).stdout

    # the token: nowhere under the state dir (DB, WAL, shm, logs, run files), nor in the agent's
    # stderr, nor in any event payload
    assert _files_containing(state, TOKEN.encode()) == []
    assert TOKEN not in err
    with db(state) as c:
        payloads = " ".join(r[0] for r in c.execute("SELECT payload_json FROM run_events"))
    assert TOKEN not in payloads and payloads
    assert "Traceback" not in err
