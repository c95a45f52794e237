"""The conventions of README "JSON output", as one check every ``--json`` output and every HTTP
answer must pass (tests/test_json_output.py walks them; the cluster's ``workers`` commands are
checked in tests/cluster/test_cluster_serve.py)."""

from __future__ import annotations

import re

# RFC 3339 UTC with microseconds, the one instant format.
INSTANT = re.compile(r"^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}\.\d{6}Z$")
INSTANT_KEYS = {"scheduledFor", "nextFires", "notBefore"}   # instants whose name does not end in "At"
MEASURED_US = {"cpuTimeUs"}                           # a measured duration, not an instant
# Maps whose keys the user chose (environment names, labels), not ours.
USER_KEYED = {"env", "secrets", "labels", "required", "preferred"}


def check_conventions(doc, where: str) -> None:
    """AssertionError naming the path in ``doc`` that breaks a convention: a bare list at the
    top, an instant that is not an RFC 3339 µs string, a µs or ms field (the store's units)."""
    assert isinstance(doc, dict), f"{where}: a list must be {{\"items\": [...]}}, got {type(doc).__name__}"
    _walk(doc, where)


def check_list(doc, where: str, *, pages: bool) -> list:
    """``{"items": [...]}``, plus ``nextCursor`` (a string or null) when the list ``pages``; returns the items."""
    check_conventions(doc, where)
    assert set(doc) == ({"items", "nextCursor"} if pages else {"items"}), f"{where}: keys {sorted(doc)}"
    assert isinstance(doc["items"], list), where
    if pages:
        assert doc["nextCursor"] is None or isinstance(doc["nextCursor"], str), f"{where}: nextCursor"
    return doc["items"]


def _walk(value, path: str) -> None:
    if isinstance(value, list):
        for i, v in enumerate(value):
            _walk(v, f"{path}[{i}]")
    elif isinstance(value, dict):
        for key, v in value.items():
            here = f"{path}.{key}"
            assert not key.endswith(("Us", "Ms", "_us", "_ms")) or key in MEASURED_US, \
                f"{here}: a time in the store's unit; instants are RFC 3339 (…At), durations the file's unit"
            if key.endswith("At") or key in INSTANT_KEYS:
                for t in v if isinstance(v, list) else [v]:
                    assert t is None or (isinstance(t, str) and INSTANT.match(t)), f"{here}: {t!r} is not RFC 3339 µs"
            if key not in USER_KEYED:
                _walk(v, here)
