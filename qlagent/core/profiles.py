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


def get_profile(name: str) -> Profile:
    """Return the Profile called ``name``.

    Raises ValidationError(field="profile") for an unknown name.
    """
    try:
        return PROFILES[name]
    except KeyError:
        from .errors import ValidationError
        raise ValidationError("profile", f"unknown profile {name!r}; expected one of {sorted(PROFILES)}") from None
