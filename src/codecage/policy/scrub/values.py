"""Walking JSON-like values (a return value, events, tool results and arguments): every
string out in one list, so that they can be scanned together, and back into a copy of
the value in the same order.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Final

from codecage.policy.scrub.detectors import MIN_SECRET_CHARS

_MAX_DEPTH: Final = 200  # deeper JSON-like values are replaced, never walked unbounded
_TOO_DEEP: Final = "[TOO_DEEP]"


def _int_text(value: int) -> str | None:
    """An int's digits when it is long enough to be a card number or a secret."""
    digits = str(value)
    return digits if len(digits.lstrip("-")) >= MIN_SECRET_CHARS else None


def collect_strings(
    value: object,
    out: list[str],
    *,
    convert_other: bool,
    depth: int = 0,
    keys: list[int] | None = None,
) -> None:
    """Append every string of a JSON-like value (keys too, their indices in `out` to
    `keys`) to `out`, in the order in which `rebuild` will take them back. Exact type
    checks first: this runs per node."""
    kind = type(value)
    if kind is str:
        out.append(value)  # type: ignore[arg-type]
    elif depth > _MAX_DEPTH or value is None or kind is float or kind is bool:
        return
    elif kind is dict or isinstance(value, dict):
        for key, item in value.items():  # type: ignore[attr-defined]
            if type(key) is str:
                if keys is not None:
                    keys.append(len(out))
                out.append(key)
            collect_strings(item, out, convert_other=convert_other, depth=depth + 1, keys=keys)
    elif kind is list or isinstance(value, list | tuple):
        for item in value:  # type: ignore[attr-defined]
            collect_strings(item, out, convert_other=convert_other, depth=depth + 1, keys=keys)
    elif isinstance(value, str):
        out.append(value)
    elif isinstance(value, int) and not isinstance(value, bool):
        digits = _int_text(value)
        if digits is not None:
            out.append(digits)
    elif isinstance(value, float | bool):
        return
    elif convert_other:
        out.append(str(value))


def rebuild(value: object, mapped: Iterator[str], *, convert_other: bool, depth: int = 0) -> object:
    """A copy of `value` with its strings taken, in order, from `mapped` (the same walk
    as `collect_strings`)."""
    kind = type(value)
    if kind is str:
        return next(mapped)
    if depth > _MAX_DEPTH:
        return _TOO_DEEP
    if value is None or kind is float or kind is bool:
        return value
    if kind is dict or isinstance(value, dict):
        out: dict[object, object] = {}
        for key, item in value.items():  # type: ignore[attr-defined]
            new_key: object = next(mapped) if type(key) is str else key
            if new_key in out:
                new_key = _distinct_key(out, new_key)
            out[new_key] = rebuild(item, mapped, convert_other=convert_other, depth=depth + 1)
        return out
    if kind is list or isinstance(value, list | tuple):
        return [
            rebuild(item, mapped, convert_other=convert_other, depth=depth + 1)
            for item in value  # type: ignore[attr-defined]
        ]
    if isinstance(value, str):
        return next(mapped)
    if isinstance(value, int) and not isinstance(value, bool):
        digits = _int_text(value)
        if digits is None:
            return value
        new = next(mapped)
        return value if new == digits else new
    if isinstance(value, float | bool):
        return value
    return next(mapped) if convert_other else value


def _distinct_key(out: Mapping[object, object], key: object) -> str:
    """A scrubbed key that equals a key the value already had (``[EMAIL_1]`` written by
    the code itself) stays a key of its own: ``[EMAIL_1]#2``."""
    suffix = 2
    while f"{key}#{suffix}" in out:
        suffix += 1
    return f"{key}#{suffix}"
