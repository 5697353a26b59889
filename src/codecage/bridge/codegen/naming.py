"""Names: servers and tools as module names, schema objects as type names.

Module names are lowercase snake_case; keywords and builtins get a trailing `_`, a leading
digit a `server_`/`tool_` prefix, and names that meet are told apart by `_2`, `_3`...
(`unique_module_names`). Type names are PascalCase and never one that a generated module
defines or imports itself (`RESERVED_TYPE_NAMES`).
"""

from __future__ import annotations

import builtins
import keyword
import re
import unicodedata
from collections.abc import Sequence
from typing import Final

MAX_TYPE_NAME: Final = 28  # before a collision suffix: names stay <= 32 characters
_MAX_MODULE_NAME: Final = 48
_MAX_NAME_INPUT: Final = 256

_TYPING_NAMES: Final = frozenset(
    {"Any", "Final", "Literal", "NotRequired", "TypeAlias", "TypedDict", "Unpack"}
)
_BUILTIN_NAMES: Final = frozenset(dir(builtins))
# Names a generated tool module defines or imports itself; no generated type may take them.
_MODULE_NAMES: Final = frozenset(
    {"SERVER", "TOOL", "Params", "Result", "call", "call_sync", "_arguments", "cast"}
    | {"overload", "call_tool", "call_tool_sync"}
)
RESERVED_TYPE_NAMES: Final = (
    _TYPING_NAMES | _BUILTIN_NAMES | _MODULE_NAMES | frozenset(keyword.kwlist)
)
_CAMEL_UPPER: Final = re.compile(r"([A-Z]+)([A-Z][a-z])")
_CAMEL_LOWER: Final = re.compile(r"([a-z0-9])([A-Z])")
_NOT_ALNUM: Final = re.compile(r"[^0-9A-Za-z]+")


def _ascii_words(name: str) -> str:
    text = unicodedata.normalize("NFKD", name[:_MAX_NAME_INPUT])
    text = text.encode("ascii", "ignore").decode("ascii")
    text = _CAMEL_UPPER.sub(r"\1_\2", text)
    return _CAMEL_LOWER.sub(r"\1_\2", text)


def module_name(name: str, prefix: str) -> str:
    """`name` as a lowercase snake_case module name (`getItem` -> `get_item`), not yet unique.

    `prefix` ("tool", "server") stands in for an empty name and goes before a leading digit.
    """
    text = _NOT_ALNUM.sub("_", _ascii_words(name)).strip("_").lower()
    text = text[:_MAX_MODULE_NAME].rstrip("_")
    if not text:
        return prefix
    if text[0].isdigit():
        text = f"{prefix}_{text}"[:_MAX_MODULE_NAME].rstrip("_")
    if keyword.iskeyword(text) or text in _BUILTIN_NAMES:
        text += "_"
    return text


def type_name(name: str, fallback: str) -> str:
    parts = [p for p in _NOT_ALNUM.split(_ascii_words(name)) if p]
    text = "".join(p[0].upper() + p[1:] for p in parts)
    if not text:
        text = fallback
    elif text[0].isdigit():
        text = fallback + text
    return text[:MAX_TYPE_NAME]


def unique_module_names(names: Sequence[str], prefix: str) -> list[str]:
    """One distinct module name per entry of `names`, in the same order.

    Deterministic: an original that already is its module name keeps it; the others that
    meet on a name take `_2`, `_3`... in code-point order of the originals (then position).

    Linear in `len(names)` after the sort: each base name keeps the next suffix to try, so
    30,000 tools of one name do not rescan `_2` ... `_29999` each (which took minutes).
    """
    bases = [module_name(n, prefix) for n in names]
    order = sorted(range(len(names)), key=lambda i: (names[i] != bases[i], names[i], i))
    result: dict[int, str] = {}
    taken: set[str] = set()
    for i in order:  # first pass: the first claimant of each base keeps it
        if bases[i] not in taken:
            result[i] = bases[i]
            taken.add(bases[i])
    # The smallest free suffix of a base only grows (names are only ever added to `taken`),
    # so each base resumes where it stopped: every suffix is tried at most once per base.
    next_suffix: dict[str, int] = {}
    for i in order:
        if i in result:
            continue
        base = bases[i]
        n = next_suffix.get(base, 2)
        while f"{base}_{n}" in taken:
            n += 1
        result[i] = f"{base}_{n}"
        taken.add(result[i])
        next_suffix[base] = n + 1
    return [result[i] for i in range(len(names))]
