"""A minimal Worker start-up over the real inbox, run as a child process by test_worker_inbox.py
so that the test can SIGKILL it at each step between receipt and spawn and start it again.

    python inboxkit.py STATE_DIR OFFER_JSON PAUSE_AT

On start it recovers every open row with ``core.inbox_states.recovery_action`` (the evidence is
the Attempt's run directory, its task's liveness and its receipt), then receives OFFER_JSON if
the inbox does not know it yet, writes the barrier, creates the run directory (fsync'd) and
spawns the spec's argv. When the step named PAUSE_AT (``receipt``, ``barrier``, ``spawn``) is
durable it prints the step's name and sleeps, waiting for the test's SIGKILL. At the end it
prints the row's state and outcome as JSON.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import msgspec

from qlagent.adapters.sqlite.inbox import SqliteInbox
from qlagent.core.inbox_states import COLLECT, REATTACH, REPORT_LOST, SPAWN, InboxOffer, recovery_action

state_dir, offer_path, pause_at = sys.argv[1:4]
inbox = SqliteInbox(os.path.join(state_dir, "inbox.sqlite3"), max_rows=8, max_bytes=65_536)
runs = os.path.join(state_dir, "runs")


def pause(step: str) -> None:
    if step == pause_at:
        print(step, flush=True)
        time.sleep(3600)


def run_dir(entry) -> str:
    return os.path.join(runs, entry.offer.attempt_id)


def task_pid(entry) -> int | None:
    try:
        with open(os.path.join(run_dir(entry), "task.pid")) as f:
            return int(f.read())
    except (OSError, ValueError):
        return None


def alive(pid: int | None) -> bool:
    if pid is None:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def receipt(entry) -> int | None:
    try:
        with open(os.path.join(run_dir(entry), "receipt")) as f:
            return int(f.read())
    except (OSError, ValueError):
        return None


def spawn(entry):
    if entry.state == "received":
        entry = inbox.advance(entry.offer.offer_id, "barrier")
        pause("barrier")
    os.makedirs(runs, mode=0o700, exist_ok=True)
    os.mkdir(run_dir(entry), 0o700)                  # the evidence a spawn may have happened
    fd = os.open(runs, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    spec = entry.offer.spec
    p = subprocess.Popen(spec["argv"], env={**spec["env"], "RUN_DIR": run_dir(entry)}, cwd=run_dir(entry),
                         start_new_session=True)
    with open(os.path.join(run_dir(entry), "task.pid"), "w") as f:
        f.write(str(p.pid))
    pause("spawn")
    return inbox.advance(entry.offer.offer_id, "started"), p


def finish(entry, p=None):
    while receipt(entry) is None and (alive(task_pid(entry)) if p is None else p.poll() is None):
        time.sleep(0.02)
    if p is not None:
        p.wait()
    code = receipt(entry)
    outcome = {"exitCode": code} if code is not None else {"reason": "lost"}
    return inbox.advance(entry.offer.offer_id, "completed", outcome)


def handle(entry):
    action = recovery_action(entry.state, run_dir_exists=os.path.isdir(run_dir(entry)),
                             alive=alive(task_pid(entry)), receipt=receipt(entry) is not None)
    if action == SPAWN:
        entry, p = spawn(entry)
        return finish(entry, p)
    if action == REATTACH:
        if entry.state == "barrier":
            entry = inbox.advance(entry.offer.offer_id, "started")
        return finish(entry)
    if action in (COLLECT, REPORT_LOST):
        return finish(entry)
    return entry                                      # RESEND / acked: nothing to run


for e in inbox.open_entries():
    handle(e)
offer = msgspec.json.decode(open(offer_path, "rb").read(), type=InboxOffer)
if inbox.get(offer.offer_id) is None:
    new, _ = inbox.receive(offer)
    pause("receipt")
    handle(new)
final = inbox.get(offer.offer_id)
print(json.dumps({"state": final.state, "outcome": final.outcome}), flush=True)
