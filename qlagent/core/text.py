"""Text a terminal shows: control characters (C0, DEL, C1) refused in free-text input and
escaped in output, and long values quoted by a bounded prefix. A newline or ESC in a value
printed raw would forge a line (``state succeeded``) or move the cursor on the reader's terminal."""

from __future__ import annotations

import re

from .errors import ValidationError

_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f]")
QUOTE_CHARS = 64          # at most this many characters of a value an error message quotes


def check_text(field: str, value: str) -> str:
    """``value`` if it holds no control character; else ValidationError naming ``field`` and the
    first one (``U+000A``), limit ``no control characters``."""
    m = _CONTROL.search(value)
    if m is not None:
        raise ValidationError(field, f"contains the control character U+{ord(m.group()):04X}",
                              limit="no control characters")
    return value


def escape_controls(value: str) -> str:
    """``value`` with each control character written as its Python escape (``\\n``, ``\\x1b``,
    ``\\x9b``) for display; text without any comes back unchanged (the same object)."""
    if _CONTROL.search(value) is None:
        return value
    return _CONTROL.sub(lambda m: repr(m.group())[1:-1], value)


def quote_bounded(value: str, limit: int = QUOTE_CHARS) -> str:
    """``value`` quoted (``repr``: control characters escaped), or for a longer one its first
    ``limit`` characters quoted and ``… (N characters)``: what an error message may echo."""
    if len(value) <= limit:
        return repr(value)
    return f"{value[:limit]!r}… ({len(value)} characters)"
