"""The keyset cursor of a Run list page: ``{created_at_us}.{run_id}`` (what ``nextCursor`` holds).

Pure. Parsed and bounded before any store access: the µs part is a plain decimal in
0..2^63-1 (an SQLite INTEGER), the Run ID a lowercase canonical UUID; anything else — a
26-digit number, a sign, ``1_000``, spaces, another length — is bad input naming ``cursor``.
"""

from __future__ import annotations

import re

from .errors import ValidationError

MAX_CURSOR_CHARS = 256
_CURSOR = re.compile(r"^(0|[1-9][0-9]{0,18})\.([0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12})\Z")
_MAX_US = 2**63 - 1


def format_run_cursor(created_at_us: int, run_id: str) -> str:
    """The cursor after the Run created at ``created_at_us`` (µs) with ID ``run_id``."""
    return f"{created_at_us}.{run_id}"


def parse_run_cursor(text: str) -> tuple[int, str]:
    """(created_at_us, run_id) of a cursor; ValidationError(field="cursor") for anything else."""
    m = _CURSOR.match(text) if isinstance(text, str) and len(text) <= MAX_CURSOR_CHARS else None
    if m is None or int(m.group(1)) > _MAX_US:
        raise ValidationError("cursor", "is not a cursor this agent gave (nextCursor of the previous page: "
                                        "<µs 0..2^63-1>.<run id>)", limit="0..2^63-1")
    return int(m.group(1)), m.group(2)
