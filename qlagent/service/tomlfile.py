"""Reading operator-supplied TOML (task files, the config file) within bounds.

A file larger than its limit, unreadable (missing, a directory, no permission), not UTF-8,
not TOML, or nested so deep that parsing would exhaust the interpreter's stack is refused with
a ValidationError naming ``field`` — never a traceback, never an unbounded read.
"""

from __future__ import annotations

import tomllib

from ..core.errors import ValidationError


def read_toml(path: str, field: str, limit: int) -> dict:
    """Parse the TOML file at ``path`` (at most ``limit`` bytes). Raises ValidationError(field)."""
    try:
        with open(path, "rb") as f:
            raw = f.read(limit + 1)
    except OSError as e:
        raise ValidationError(field, f"cannot read {path}: {e.strerror or e}") from None
    if len(raw) > limit:
        raise ValidationError(field, f"{path} is larger than {limit} bytes", limit=limit)
    try:
        return tomllib.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise ValidationError(field, f"{path} is not UTF-8: {e.reason} at byte {e.start}") from None
    except tomllib.TOMLDecodeError as e:
        raise ValidationError(field, f"{path}: {e}") from None
    except RecursionError:
        raise ValidationError(field, f"{path} nests tables or arrays too deeply") from None
