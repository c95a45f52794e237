"""When a certificate the agent relies on runs out (issue 26): a replica's ``cluster.tls_cert``,
a Worker's ``worker.ca_file``. ``config check`` warns and ``doctor`` fails its line from
``WARN_BEFORE_S`` before the end, so a certificate is renewed before Workers refuse it."""

from __future__ import annotations

WARN_BEFORE_S = 30 * 86_400         # 30 days


def expiry_note(not_after_s: int, now_s: int) -> tuple[bool, str]:
    """(ok, text) for a certificate ending at ``not_after_s`` (Unix seconds) seen at ``now_s``:
    ok when more than ``WARN_BEFORE_S`` remain; text says how long is left or since when it
    has expired (whole days, or hours in the last day)."""
    left = not_after_s - now_s
    if left <= 0:
        return False, f"expired {(-left) // 86_400} days ago"
    when = f"{left // 86_400} days" if left >= 86_400 else f"{left // 3600} hours"
    return left > WARN_BEFORE_S, f"expires in {when}"
