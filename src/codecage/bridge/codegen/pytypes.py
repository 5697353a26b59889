"""Python type expressions as the generated annotations spell them: names, generics, unions
and `Literal`s, built from JSON Schema and printed by `type_text()`."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Final

from codecage.bridge.codegen.text import py_str

_MAX_ENUM: Final = 256  # values in one Literal; more become the values' base type


@dataclass(frozen=True, slots=True)
class Name:
    """A name or `None`: `str`, `Any`, `Entity`."""

    text: str


@dataclass(frozen=True, slots=True)
class Sub:
    """A subscripted generic: `list[X]`, `dict[str, X]`."""

    head: str
    args: tuple[PyType, ...]


@dataclass(frozen=True, slots=True)
class Union:
    members: tuple[PyType, ...]


@dataclass(frozen=True, slots=True)
class Lit:
    """`Literal[...]`; each value is already rendered as Python source."""

    values: tuple[str, ...]


PyType = Name | Sub | Union | Lit

ANY: Final = Name("Any")
NONE: Final = Name("None")
STR: Final = Name("str")
DICT_ANY: Final = Sub("dict", (STR, ANY))
SCALARS: Final[Mapping[str, PyType]] = {
    "string": STR,
    "integer": Name("int"),
    "number": Name("float"),
    "boolean": Name("bool"),
    "null": NONE,
}


def type_text(t: PyType) -> str:
    if isinstance(t, Name):
        return t.text
    if isinstance(t, Sub):
        return f"{t.head}[{', '.join(type_text(a) for a in t.args)}]"
    if isinstance(t, Union):
        return " | ".join(type_text(m) for m in t.members)
    return f"Literal[{', '.join(t.values)}]"


def union(members: Iterable[PyType]) -> PyType:
    """A normalized union: flat, deduplicated, literals merged, `None` last, Any absorbing."""
    flat: list[PyType] = []
    for m in members:
        for x in m.members if isinstance(m, Union) else (m,):
            forward = isinstance(x, Name) and x.text.startswith('"')
            flat.append(DICT_ANY if forward else x)
    if not flat or ANY in flat:
        return ANY
    values: dict[str, None] = {}
    out: list[PyType] = []
    for m in flat:
        if isinstance(m, Lit):
            if not values:
                out.append(m)  # placeholder: the merged Literal goes where the first was
            values.update(dict.fromkeys(m.values))
        elif m not in out and m != NONE:
            out.append(m)
    merged: list[PyType] = [Lit(tuple(values))]
    if len(values) > _MAX_ENUM:
        merged = [_literal_base(v) for v in values]
    out = [x for m in out for x in (merged if isinstance(m, Lit) else [m])]
    out = list(dict.fromkeys(out))
    if NONE in flat:
        out.append(NONE)
    return out[0] if len(out) == 1 else Union(tuple(out))


def _literal_base(source: str) -> PyType:
    """The base type of a rendered Literal value."""
    if source[0] in "'\"":
        return STR
    return Name("bool") if source in ("True", "False") else Name("int")


def _literal_value(value: object) -> str | None:
    """`value` as Python source valid inside `Literal[...]`, or None if it cannot be one."""
    if isinstance(value, bool):
        return "True" if value else "False"
    if isinstance(value, int):
        return str(value) if abs(value) < 2**63 else None
    if isinstance(value, str):
        return py_str(value)
    return None


def _base_type(value: object) -> PyType:
    if value is None:
        return NONE
    if isinstance(value, bool):
        return Name("bool")
    if isinstance(value, int):
        return Name("int")
    if isinstance(value, float):
        return Name("float")
    if isinstance(value, str):
        return STR
    if isinstance(value, list):
        return Sub("list", (ANY,))
    if isinstance(value, dict):
        return DICT_ANY
    return ANY


def enum_type(values: Sequence[object]) -> PyType:
    if not values:
        return ANY
    literals = [_literal_value(v) for v in values if v is not None]
    if len(values) > _MAX_ENUM or any(lit is None for lit in literals):
        return union(_base_type(v) for v in values)
    parts: list[PyType] = [Lit(tuple(dict.fromkeys(v for v in literals if v is not None)))]
    if any(v is None for v in values):
        parts.append(NONE)
    return union(p for p in parts if p != Lit(()))
