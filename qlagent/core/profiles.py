"""Profiles and their fixed budgets (DESIGN.md "Profile budgets", ADR-0071 §3 and §5, ADR-0376 §4)."""

from __future__ import annotations

import msgspec

MiB = 1_048_576


class Profile(msgspec.Struct, frozen=True):
    """Budgets of one deployment profile. Sizes in bytes."""

    name: str
    memory_bytes: int            # the whole service tree
    pids: int                    # the whole service tree
    dispatch_page: int           # candidates read per dispatcher pass (ADR-0071 §3)
    log_max_bytes: int           # one log Artifact (ADR-0071 §5)
    fs_reserve_bytes: int        # free space that must remain (ADR-0071 §5)
    artifact_total_bytes: int    # all log Artifacts together
    max_concurrent_runs: int     # live Runs at once
    http_in_flight: int          # ADR-0376 §4
    http_body_bytes: int         # mutation body (ADR-0376 §4)
    # Worker inbox (ADR-0021): offers kept at once, and their stored spec + outcome bytes.
    # Acknowledged rows are pruned first; unacknowledged ones are never dropped (InboxFull).
    inbox_rows: int = 64
    inbox_bytes: int = 4 * 1_048_576


EDGE = Profile("edge", 128 * MiB, 64, 4, 4 * MiB, 32 * MiB, 64 * MiB, 4, 4, 512)
STANDALONE = Profile("standalone", 256 * MiB, 256, 16, 64 * MiB, 256 * MiB, 1024 * MiB, 16, 16, 4096,
                     inbox_rows=1024, inbox_bytes=64 * MiB)

PROFILES = {p.name: p for p in (EDGE, STANDALONE)}

# Per-run memory (ADR-0071 §4 admission, the Profile's budget). The agent keeps AGENT_MEMORY_SHARE
# of the service budget: its ~20 MiB RSS, the shims (which stay in its cgroup) and the page cache
# of the logs being written; the rest is the runs' share. A Run's limit (memory.max of its cgroup)
# is its Task's ``memory_max``, else the whole runs' share (one runaway can never reach the
# agent's); admission reserves ``memory_max``, else the runs' share split over
# ``max_concurrent_runs`` (edge: 80 MiB for runs, 20 MiB reserved per Run by default). With only
# 32 MiB kept, a hog at its limit took the arm64 guest's edge service to 126 of 128 MiB and
# reclaim stalled the agent past its watchdog.
AGENT_MEMORY_SHARE = 48 * MiB


def run_memory_share(p: Profile) -> int:
    """Bytes the Profile leaves to Runs: the largest ``memory_max`` a Task may state."""
    return p.memory_bytes - AGENT_MEMORY_SHARE


def run_memory_limit(p: Profile, memory_max: int | None) -> int:
    """A Run's memory limit in bytes: its Task's ``memory_max``, capped at the runs' share."""
    share = run_memory_share(p)
    return share if memory_max is None else min(memory_max, share)


def run_memory_reserve(p: Profile, memory_max: int | None) -> int:
    """What admission sets aside for a Run (bytes): ``memory_max``, else an equal slice."""
    return run_memory_limit(p, memory_max) if memory_max is not None else run_memory_share(p) // p.max_concurrent_runs


# ADR-0071 §5 names the free space each Profile keeps (edge 32 MiB, standalone 256 MiB) and is
# silent on a file system smaller than that figure: a router's overlay may be 8 MiB, where it
# would refuse every Run for good. The figure is kept as the cap; a file system keeps at most
# this fraction of its size free for the rest of the system.
FS_RESERVE_DIVISOR = 4


def fs_reserve(p: Profile, fs_bytes: int) -> int:
    """Free bytes that must remain on a file system of ``fs_bytes`` (statvfs ``f_blocks *
    f_frsize``) when a log Artifact is allocated: the Profile's ``fs_reserve_bytes``, at most
    ``fs_bytes // FS_RESERVE_DIVISOR`` (edge: 32 MiB from a 128 MiB file system up)."""
    return min(p.fs_reserve_bytes, fs_bytes // FS_RESERVE_DIVISOR)


# PIDs (tasks of the service's cgroup) admission counts for one more Run: shim + task + a little
# headroom for what the task forks; and what the agent itself holds (its process and threads,
# the fork server).
PIDS_PER_RUN = 4
AGENT_PIDS = 4


def max_runs_in_pids(p: Profile) -> int:
    """The most live Runs the Profile's PID budget holds beside the agent: the ceiling of
    ``max_concurrent_runs`` (edge 15, standalone 63)."""
    return (p.pids - AGENT_PIDS) // PIDS_PER_RUN


def get_profile(name: str) -> Profile:
    """Return the Profile called ``name``.

    Raises ValidationError(field="profile") for an unknown name.
    """
    try:
        return PROFILES[name]
    except KeyError:
        from .errors import ValidationError
        raise ValidationError("profile", f"unknown profile {name!r}; expected one of {sorted(PROFILES)}") from None
