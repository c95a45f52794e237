"""Prometheus text exposition, format 0.0.4 (issue 26 §3): the body of ``GET /metrics``.

Pure: a route builds :class:`Family` values from figures it already has and :func:`render`
turns them into bytes. Names follow the Prometheus conventions: counters end in ``_total``,
units are in the name (``_seconds``, ``_bytes``). Written here rather than loaded from
``prometheus_client`` so a router pays for none of that package.
"""

from __future__ import annotations

import re

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
COUNTER, GAUGE = "counter", "gauge"
_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*\Z")
_LABEL = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*\Z")


class Family:
    """``Family(name, kind, help)``: one metric family; :meth:`add` a sample per label set.
    ``kind`` is :data:`COUNTER` (``name`` must end in ``_total``) or :data:`GAUGE`. Raises
    ValueError for a name, label name or kind outside the format (a programming error)."""

    __slots__ = ("name", "kind", "help", "samples")

    def __init__(self, name: str, kind: str, help: str) -> None:
        if not _NAME.match(name) or kind not in (COUNTER, GAUGE) or (kind == COUNTER) != name.endswith("_total"):
            raise ValueError(f"metric {name!r} of kind {kind!r}: counters end in _total, gauges do not")
        self.name, self.kind, self.help = name, kind, help
        self.samples: list[tuple[tuple[tuple[str, str], ...], float]] = []

    def add(self, value: float, **labels: str) -> Family:
        """One sample (``value``: a number; None is not a sample — leave it out) with ``labels``
        (names ``[a-zA-Z_][a-zA-Z0-9_]*``, values any text). Returns self."""
        for key in labels:
            if not _LABEL.match(key) or key.startswith("__"):
                raise ValueError(f"label name {key!r} of {self.name}")
        self.samples.append((tuple(sorted(labels.items())), value))
        return self


def _escape_help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def _escape_value(text: str) -> str:
    return str(text).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _number(value: float) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, int):
        return str(value)
    if value != value:
        return "NaN"
    if value in (float("inf"), float("-inf")):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value))


def render(families: list[Family]) -> bytes:
    """The exposition text (UTF-8) of ``families`` in order: ``# HELP`` and ``# TYPE`` lines,
    then one ``name{label="value",…} number`` line per sample, a newline after the last."""
    out: list[str] = []
    for f in families:
        out.append(f"# HELP {f.name} {_escape_help(f.help)}")
        out.append(f"# TYPE {f.name} {f.kind}")
        for labels, value in f.samples:
            if labels:
                inner = ",".join(f'{k}="{_escape_value(v)}"' for k, v in labels)
                out.append(f"{f.name}{{{inner}}} {_number(value)}")
            else:
                out.append(f"{f.name} {_number(value)}")
    return ("\n".join(out) + "\n").encode("utf-8")
