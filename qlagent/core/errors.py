"""Error vocabulary shared by every layer.

Each error carries a stable ``code`` (what an API returns), the ``field`` it is about (for bad
input), an optional ``limit`` and a process ``exit_code`` for the CLI:
0 ok, 1 internal, 2 usage/bad input, 3 conflict, 4 not found, 5 unavailable, 6 run did not succeed.
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_INTERNAL = 1
EXIT_USAGE = 2
EXIT_CONFLICT = 3
EXIT_NOT_FOUND = 4
EXIT_UNAVAILABLE = 5
EXIT_RUN_FAILED = 6


class QlError(Exception):
    """Base of every expected error. ``str(err)`` is one line fit for an operator."""

    code = "internal"
    exit_code = EXIT_INTERNAL

    def __init__(self, message: str, *, field: str | None = None, limit: object = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.field = field
        self.limit = limit
        if code is not None:
            self.code = code

    def to_dict(self) -> dict:
        d = {"code": self.code, "message": self.message}
        if self.field is not None:
            d["field"] = self.field
        if self.limit is not None:
            d["limit"] = self.limit
        return d


class ValidationError(QlError):
    """Bad input: names the field and the limit; nothing has been written."""

    code = "invalid_input"
    exit_code = EXIT_USAGE

    def __init__(self, field: str, message: str, *, limit: object = None) -> None:
        super().__init__(f"{field}: {message}", field=field, limit=limit)


def from_msgspec(err: Exception, *, root: str = "", where: str | None = None, data: object = None,
                 type_: type | None = None) -> ValidationError:
    """The one translation of a ``msgspec.ValidationError`` (decode or convert) into a
    ValidationError: ``field`` is the path msgspec reports (``task[0].timeout``, ``http.listen``;
    ``root`` when the whole document is wrong); the message is msgspec's first clause prefixed
    with ``where`` (e.g. the file). A value outside a ``msgspec.Meta`` range of ``type_`` (the
    Struct ``data`` was converted to) reads ``9999.0 outside 0..600 seconds`` with ``limit``
    ``0..600`` (``seconds`` for a field named ``*_s``)."""
    import re       # only here: `qlagent --version` imports this module and no regular expression
    msg = str(err)
    head, _, at = msg.partition(" - at `$")
    path = at.rstrip("`").lstrip(".")
    named = re.search(r"field `([^`]+)`", head)       # missing or unknown field
    if named:
        path = f"{path}.{named.group(1)}" if path else named.group(1)
    path = path or root or "input"
    if type_ is not None and re.search(r" [<>]=? ", head):
        ranged = _range(type_, data, path)
        if ranged is not None:
            value, lo, hi = ranged
            unit = " seconds" if path.endswith("_s") else ""
            if lo is not None and hi is not None:
                span = f"{lo}..{hi}"
                return ValidationError(path, f"{value} outside {span}{unit}", limit=span)
            bound = f">= {lo}" if lo is not None else f"<= {hi}"
            return ValidationError(path, f"{value} must be {bound}{unit}", limit=bound)
    return ValidationError(path, f"{where}: {head}" if where else head)


def _range(type_: type, data: object, path: str):
    """(value as converted, ge, le) at dotted ``path`` of ``data`` against Struct ``type_``."""
    import msgspec      # only on this error path
    info = msgspec.inspect.type_info(type_)
    value = data
    for name in path.split("."):
        if not isinstance(info, msgspec.inspect.StructType) or not isinstance(value, dict):
            return None
        field = next((f for f in info.fields if f.encode_name == name), None)
        if field is None:
            return None
        info, value = field.type, value.get(name)
        if isinstance(info, msgspec.inspect.UnionType):
            info = next((t for t in info.types if not isinstance(t, msgspec.inspect.NoneType)), info)
    if not isinstance(info, (msgspec.inspect.IntType, msgspec.inspect.FloatType)):
        return None
    if isinstance(info, msgspec.inspect.FloatType) and isinstance(value, int):
        value = float(value)
    return value, info.ge, info.le


class ConflictError(QlError):
    """A fence or an append-only rule refused the write; nothing has been written."""

    code = "conflict"
    exit_code = EXIT_CONFLICT


class NotFoundError(QlError):
    code = "not_found"
    exit_code = EXIT_NOT_FOUND


class UnavailableError(QlError):
    """The store, a capability or a resource is not there (yet); retry later."""

    code = "unavailable"
    exit_code = EXIT_UNAVAILABLE


class StartError(QlError):
    """The task of a Run could not be started (ProcessPort.spawn). ``message`` is the reason:
    paths and errno names, at most limits.MAX_START_ERROR characters, never the environment;
    ``code`` is the Attempt's failure reason (exec_failed, cwd_unusable, artifact_unusable,
    run_dir_unsafe, shim_failed)."""

    code = "shim_failed"
    exit_code = EXIT_UNAVAILABLE


# A receipt or truncation fact is a few hundred bytes; refuse to parse anything much larger.
FACT_LIMIT_BYTES = 65_536


class RunFileError(QlError):
    """receipt.json, truncated.json or task.pid exists but is not valid; ``field`` names the fault
    (e.g. ``receipt.json.signal``)."""

    code = "run_file_invalid"

    def __init__(self, field_name: str, message: str):
        super().__init__(f"{field_name}: {message}", field=field_name)


class StoreIntegrityError(UnavailableError):
    """The database's migration history is unknown or altered; start-up refuses it."""

    code = "store_integrity"


class FenceRejected(ConflictError):
    """ADR-0376 §3 ``task_start_fence_rejected`` with a ``reason``: authorization_changed,
    definition_changed, task_disabled, task_not_executable or mutation_conflict."""

    code = "task_start_fence_rejected"

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason

    def to_dict(self) -> dict:
        d = super().to_dict()
        d["reason"] = self.reason
        return d
