"""Definitions and statements as text already in `ruff format` style (line length 88).

Lines that would not fit get their type hoisted into a named `TypeAlias`, in the few shapes
the formatter leaves alone.
"""

from __future__ import annotations

import keyword
from collections.abc import Iterable, Sequence
from typing import Final

from codecage.bridge.codegen.naming import MAX_TYPE_NAME, type_name
from codecage.bridge.codegen.pytypes import Lit, Name, PyType, Sub, Union, type_text
from codecage.bridge.codegen.schema import ClassDef, Field, Types
from codecage.bridge.codegen.text import doc_line, docstring, py_str, summary_line

LINE: Final = 88  # ruff format's default line length
_MAX_PLAIN_KEY: Final = 32  # longer keys use the functional TypedDict syntax
_MAX_DOC_TYPE: Final = 120
# Builtins that appear inside generated annotations: a class-syntax field of that name
# would shadow them in the class body, so such keys use the functional syntax.
_ANNOTATION_BUILTINS: Final = frozenset({"str", "int", "float", "bool", "list", "dict"})


class Layout:
    """Renders the definitions of one module; hoists types that would not fit a line."""

    def __init__(self, types: Types) -> None:
        self.types = types
        self.blocks: list[str] = []
        self.imports: set[str] = set()

    def use(self, t: PyType) -> None:
        if isinstance(t, Name) and t.text == "Any":
            self.imports.add("Any")
        elif isinstance(t, Lit):
            self.imports.add("Literal")
        elif isinstance(t, Sub):
            for a in t.args:
                self.use(a)
        elif isinstance(t, Union):
            for m in t.members:
                self.use(m)

    def hoist(self, t: PyType, prefix: str, suffix: str) -> Name:
        """`t` as a name: itself, or a new TypeAlias defined before the current block."""
        if isinstance(t, Name):
            return t
        name = self.types.allocate(prefix[: MAX_TYPE_NAME - len(suffix)] + suffix)
        self.alias(name, t)
        return Name(name)

    def alias(self, name: str, t: PyType) -> None:
        self.imports.add("TypeAlias")
        head = f"{name}: TypeAlias = "
        if len(head + type_text(t)) > LINE:
            if isinstance(t, Sub):
                suffixes = ["Item"] if t.head == "list" else [f"Arg{i + 1}" for i in range(9)]
                if t.head == "dict":
                    suffixes = ["Key", "Value"]
                args = [self.hoist(a, name, s) for a, s in zip(t.args, suffixes, strict=False)]
                t = Sub(t.head, tuple(args))
            elif isinstance(t, Union):
                t = Union(tuple(self.hoist(m, name, "Option") for m in t.members))
        self.use(t)
        text = head + type_text(t)
        if len(text) > LINE and isinstance(t, Lit):
            if len(t.values) == 1:
                text = f"{head}Literal[\n    {t.values[0]}\n]"
            else:
                text = "\n".join([f"{head}Literal[", *(f"    {v}," for v in t.values), "]"])
        elif len(text) > LINE and isinstance(t, Union):
            inner = type_text(t)
            if 4 + len(inner) <= LINE:
                text = f"{head}(\n    {inner}\n)"
            else:
                first, *rest = (type_text(m) for m in t.members)
                text = "\n".join([f"{head}(", f"    {first}", *(f"    | {m}" for m in rest), ")"])
        self.blocks.append(text)

    def annotation(self, f: Field, t: PyType) -> str:
        if f.required:
            return type_text(t)
        self.imports.add("NotRequired")
        return f"NotRequired[{type_text(t)}]"

    def typed_dict(self, cls: ClassDef, doc: list[str]) -> None:
        self.imports.add("TypedDict")
        if all(_plain_key(f.key) for f in cls.fields):
            lines = [f"class {cls.name}(TypedDict):", docstring(doc, "    ")]
            if cls.fields:
                lines.append("")
            for f in cls.fields:
                t = f.type
                if len(f"    {f.key}: {self.annotation(f, t)}") > LINE:
                    t = self.hoist(t, cls.name, type_name(f.key, "Field")[:14])
                self.use(t)
                lines.append(f"    {f.key}: {self.annotation(f, t)}")
            self.blocks.append("\n".join(lines))
            return
        # Functional syntax: keys that are not identifiers (or would shadow something).
        lines = [f"{cls.name} = TypedDict(", f'    "{cls.name}",', "    {"]
        for f in cls.fields:
            key = py_str(f.key)
            t = f.type
            if len(f"        {key}: {self.annotation(f, t)},") > LINE:
                t = self.hoist(t, cls.name, type_name(f.key, "Field")[:14])
            self.use(t)
            item = f"        {key}: {self.annotation(f, t)},"
            if len(item) > LINE and not f.required:
                item = f"        {key}: NotRequired[\n            {type_text(t)}\n        ],"
            lines.append(item)
        lines += ["    },", ")"]
        self.blocks.append("\n".join(lines))


def _plain_key(key: str) -> bool:
    """Whether a property can be a field in class syntax (else: functional TypedDict)."""
    return (
        key.isidentifier()
        and key.isascii()
        and not keyword.iskeyword(key)
        and not key.startswith("_")
        and not key[0].isupper()
        and key not in _ANNOTATION_BUILTINS
        and len(key) <= _MAX_PLAIN_KEY
    )


def field_doc(f: Field) -> list[str]:
    kind = type_text(f.type)
    if len(kind) > _MAX_DOC_TYPE:
        kind = kind[: _MAX_DOC_TYPE - 4] + " ..."
    state = "required" if f.required else "optional"
    if f.default is not None:
        state += f", default: {f.default}"
    head = f"    {doc_line(f.key, 80) or '(empty name)'}: {doc_line(kind, _MAX_DOC_TYPE)} ({state})"
    body = [
        f"        {line}" if line else "" for line in f.description.split("\n") if f.description
    ]
    return [head, *body]


def class_doc(cls: ClassDef, fallback: str) -> list[str]:
    doc = [summary_line(cls.description, fallback)]
    if cls.description and cls.description != doc[0]:
        doc += ["", *cls.description.split("\n")]
    if cls.field_docs and cls.fields:
        doc += ["", "Fields:"]
        for f in cls.fields:
            doc += field_doc(f)
    return doc


def assign_str(name: str, value: str) -> str:
    """`NAME: Final = "..."` as ruff formats it (long strings go in parentheses if that fits)."""
    literal = py_str(value)
    line = f"{name}: Final = {literal}"
    if len(line) > LINE and 4 + len(literal) <= LINE:
        return f"{name}: Final = (\n    {literal}\n)"
    return line


def import_line(module: str, names: Iterable[str]) -> str:
    # isort's order-by-type: CONSTANTS, then Classes, then functions.
    ordered = sorted(names, key=lambda n: (0 if n.isupper() else 1 if n[0].isupper() else 2, n))
    line = f"from {module} import {', '.join(ordered)}"
    if len(line) <= LINE:
        return line
    return "\n".join([f"from {module} import (", *(f"    {n}," for n in ordered), ")"])


def dict_literal(name: str, entries: Sequence[tuple[str, str]]) -> str:
    """`NAME: dict[str, str] = {...}`, one entry per line (ruff leaves long ones as they are)."""
    if not entries:
        return f"{name}: dict[str, str] = {{}}"
    lines = [f"{name}: dict[str, str] = {{"]
    lines += [f"    {py_str(key)}: {py_str(value)}," for key, value in entries]
    lines.append("}")
    return "\n".join(lines)
