"""A run's processes by identity (ADR-0071 §5, issue 3 items 5-6, ARCHITECTURE.md "Shim
contract"): whether a PID is still the process started at a given time, the signalling of a
run's whole process tree (its group, the shim's descendants, processes seen before), and the
processes found by the tags every task carries in its environment (``QL3_ATTEMPT_ID``,
``QL3_AGENT_KEY``). Read from /proc through psutil; nothing here starts a process.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Container

import psutil

from qlagent.core.canonical import sha256_hex

_CREATE_TIME_TOLERANCE_S = 0.01


def process_matches(pid: int, create_time: float) -> bool:
    """True if ``pid`` is a live (not zombie) process started at ``create_time`` (psutil seconds).

    A PID reused by another process has another start time, so recovery never re-attaches to
    a stranger (issue 3 item 5: "PID and start time match").
    """
    try:
        proc = psutil.Process(pid)
        return (abs(proc.create_time() - create_time) < _CREATE_TIME_TOLERANCE_S
                and proc.status() != psutil.STATUS_ZOMBIE)
    except (psutil.NoSuchProcess, psutil.AccessDenied, ValueError):  # ValueError: pid < 0
        return False


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _descendants(shim_pid: int) -> dict[int, psutil.Process]:
    try:
        kids = psutil.Process(shim_pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return {}
    return {p.pid: p for p in kids}


def _group_members(pgid: int) -> dict[int, psutil.Process]:
    members = {}
    for proc in psutil.process_iter():
        try:
            if os.getpgid(proc.pid) == pgid:
                members[proc.pid] = proc
        except (ProcessLookupError, psutil.NoSuchProcess):
            continue
    return members


def _targets(task_pgid: int | None, shim_pid: int | None, started_after: float | None,
             known: dict[int, psutil.Process]) -> tuple[dict[int, psutil.Process], bool]:
    """Live processes of the run and whether the group is proven ours (a member is in the tree).
    A missing (None) shim or group contributes nothing; PIDs ≤ 1 are never looked at."""
    tree = _descendants(shim_pid) if shim_pid and shim_pid > 1 else {}
    group = _group_members(task_pgid) if task_pgid and task_pgid > 1 else {}
    owned = any(pid in tree for pid in group)
    if started_after is not None:
        group = {pid: p for pid, p in group.items() if _created(p) >= started_after}
    found = dict(known)
    found.update(tree)
    found.update(group)
    for pid in (shim_pid, os.getpid()):
        found.pop(pid, None)
    return {pid: p for pid, p in found.items() if _alive(p)}, owned


def _created(proc: psutil.Process) -> float:
    try:
        return proc.create_time()
    except psutil.NoSuchProcess:
        return 0.0


def _signal_all(task_pgid: int, owned: bool, procs: dict[int, psutil.Process], sig: int) -> list[int]:
    in_group = set()
    if owned:
        for pid in procs:  # before killpg: a member may die and be reaped at once
            try:
                if os.getpgid(pid) == task_pgid:
                    in_group.add(pid)
            except ProcessLookupError:
                continue
        try:
            os.killpg(task_pgid, sig)  # atomic for the group, including children forked meanwhile
        except (ProcessLookupError, PermissionError):
            in_group = set()
    sent = sorted(in_group)
    for pid, proc in procs.items():
        if pid in in_group:
            continue  # already reached by killpg; a second signal would be a new event
        try:
            proc.send_signal(sig)  # psutil checks the start time: a reused PID is not signalled
            sent.append(pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return sent


def signal_tree(task_pgid: int | None, shim_pid: int | None, sig: int, started_after: float | None,
                known: dict[int, psutil.Process]) -> list[int]:
    """One non-blocking step of stopping a run (the coordinator sends SIGTERM, then SIGKILL after
    the grace): send ``sig`` to the task's process group, every descendant of the shim and
    every process in ``known``
    (processes seen by an earlier step, which a dead parent may have re-parented out of the
    tree). ``known`` is updated with what this step found, so a later SIGKILL still reaches an
    escaped grandchild. ``shim_pid`` None (the shim is gone) signals the group's members
    started after ``started_after`` one by one. Never signals the shim or this process.
    Returns the PIDs signalled.
    """
    if task_pgid is None and shim_pid and shim_pid > 1:
        kids = _descendants(shim_pid)
        task_pgid = min(kids) if kids else None   # the shim's first child is the task
    live, owned = _targets(task_pgid, shim_pid, started_after, known)
    known.update(live)
    if not live:
        return []
    return _signal_all(task_pgid or 0, owned and bool(task_pgid), live, sig)


def find_by_attempt(attempt_id: str) -> dict[int, psutil.Process]:
    """Processes whose environment carries ``QL3_ATTEMPT_ID=<attempt_id>``: every process a run
    started and that kept the environment it was given, even one that escaped the process
    group with setsid and lost its parent (the shim died). Reads /proc/<pid>/environ of this
    user's processes; used only on the rare paths where the shim's tree is gone."""
    marker = f"\0QL3_ATTEMPT_ID={attempt_id}\0".encode()
    found = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/environ", "rb") as f:
                env = b"\0" + f.read()
        except OSError:
            continue
        if marker in env:
            try:
                found[int(entry.name)] = psutil.Process(int(entry.name))
            except psutil.NoSuchProcess:
                continue
    found.pop(os.getpid(), None)
    return found


AGENT_KEY_ENV = "QL3_AGENT_KEY"


def agent_key(runs_root: str) -> str:
    """The tag (16 lowercase hex) every task of the agent whose runs live under ``runs_root``
    carries as ``QL3_AGENT_KEY``: derived from the root's path, not from anything stored in
    it, so an agent started on a wiped state directory still recognises the tasks of the one
    before, and agents of other state directories (same uid) are told apart."""
    return sha256_hex(os.path.realpath(runs_root).encode("utf-8", "surrogateescape"))[:16]


def stop_strays(key: str, known: Container[str], seen: set[str] | None = None) -> dict[str, int]:
    """SIGKILL every process of this uid whose environment carries ``QL3_AGENT_KEY=<key>`` and a
    ``QL3_ATTEMPT_ID`` not in ``known`` (the Attempts the caller re-attaches or has ended
    itself): a task left by an agent whose state was lost or whose shim died unseen, which would
    otherwise run beside the Attempt's next copy. Returns {attempt ID: processes killed}; a
    ``seen`` set gets the attempt ID of every tagged process found, known or not (so a caller
    can forget the kept Attempts nothing carries any more).
    Reads /proc/<pid>/environ (this user's processes only); signals through psutil, which
    checks the start time, so a PID reused since the scan is never hit."""
    tag = f"\0{AGENT_KEY_ENV}={key}\0".encode()
    prefix = b"\0QL3_ATTEMPT_ID="
    uid = os.geteuid()
    stopped: dict[str, int] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            if entry.stat().st_uid != uid:
                continue
            with open(f"/proc/{entry.name}/environ", "rb") as f:
                env = b"\0" + f.read()
        except OSError:
            continue
        at = env.find(prefix)
        if tag not in env or at < 0:
            continue
        attempt_id = env[at + len(prefix):env.find(b"\0", at + 1)].decode("utf-8", "replace")
        if seen is not None:
            seen.add(attempt_id)
        if attempt_id in known or int(entry.name) == os.getpid():
            continue
        try:
            psutil.Process(int(entry.name)).send_signal(signal.SIGKILL)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        stopped[attempt_id] = stopped.get(attempt_id, 0) + 1
    return stopped
