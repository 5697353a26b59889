"""Upstream MCP tools as typed Python modules: the `servers/` tree that `codecage gen` writes.

`generate()` is pure and deterministic: the same tool lists give byte-identical files.
`write_tree()` writes them. Inside the sandbox the tree is mounted read-only at /servers:

```
servers/__init__.py              SERVERS: module name -> original server name
servers/<server>/__init__.py     TOOLS: module name -> one-line summary (and a docstring index)
servers/<server>/<tool>.py       SERVER, TOOL, Params, Result, call(), call_sync()
```

A tool module reads like a small hand-written client:

```python
from servers.memory import create_entities

await create_entities.call(create_entities.Params(entities=[...]))
await create_entities.call(entities=[...])          # the same, as keywords
create_entities.call_sync({"entities": [...]})      # a plain dict is a Params too
```

Public: `generate()`, `write_tree()`, `MARKER`, the bounds `MAX_TOOLS_PER_SERVER` and
`MAX_TOOL_NAME`, and the naming helpers `module_name()`,
`unique_module_names()` and `py_str()` (for the CLI and search, which must agree with
the file names and literals written here).

Choices, and why:
- `Params` and nested objects are `TypedDict`s, not dataclasses: a TypedDict *is* the dict
  that goes on the wire, so unset optional fields (`NotRequired`) are simply absent, nothing
  is imported but `typing`, and `Params(...)`, a dict literal and keywords all work. Keys that
  are not plain identifiers (`"from"`, `"x-y"`, `"Name"`) use the functional syntax; keys are
  never renamed, they are the tool's own argument names.
- Untrusted text (descriptions, titles, names, enum values, defaults) only ever reaches the
  generated code as a string literal built here (every non-ASCII or non-printable character
  escaped) or as docstring text (control characters dropped, backslashes doubled, runs of
  quotes broken, length bounded). Nothing an upstream server wrote can become code.
- Names: servers and tools become lowercase snake_case module names; keywords and builtins get
  a trailing `_`, a leading digit gets a `server_`/`tool_` prefix. When two names meet (`get-item`
  and `get_item`), the original that already is the identifier keeps it, then the others in
  code-point order take `_2`, `_3`... Type names are PascalCase from the `$defs` key, the
  `title`, or the property path, with `2`, `3`... on a collision.
- Order: servers and tools are sorted by module name (a server's listing order is not stable
  across restarts, and the file names are the sort key anyway); properties keep the schema's
  order, which is how a tool's author presents them.
- The text is already in `ruff format` style (line length 88): lines that would not fit get
  their type hoisted into a named `TypeAlias`, in the few shapes the formatter leaves alone.
- What JSON Schema cannot say in Python types becomes `Any`; a `$ref` cycle becomes
  `dict[str, Any]` at the back edge; depth, type counts, property counts, enum sizes and doc
  text are bounded. `generate()` does not raise on any schema.
"""

from __future__ import annotations

import builtins
import compileall
import importlib.util
import json
import keyword
import logging
import os
import re
import stat
import tempfile
import unicodedata
import urllib.parse
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, TypeGuard

from mcp_types import Tool

from codecage.errors import BridgeError, ConfigError

log = logging.getLogger(__name__)

MARKER: Final = ".codecage-generated.json"
"""The file in an output directory that lists what `write_tree()` wrote there."""

_LINE: Final = 88  # ruff format's default line length
_MAX_DEPTH: Final = 12  # schema nesting; deeper is Any
_MAX_TYPES: Final = 200  # named types per module; more objects become dict[str, Any]
_MAX_PROPERTIES: Final = 256  # per object; the rest are left out of the type
_MAX_ENUM: Final = 256  # values in one Literal; more become the values' base type
_MAX_MODULE_NAME: Final = 48
_MAX_TYPE_NAME: Final = 28  # before a collision suffix: names stay <= 32 characters
_MAX_PLAIN_KEY: Final = 32  # longer keys use the functional TypedDict syntax
_MAX_SUMMARY: Final = 120
_MAX_DESCRIPTION: Final = 4000
_MAX_FIELD_DOC: Final = 600
_MAX_DOC_TYPE: Final = 120
_MAX_DEFAULT: Final = 80
_MAX_NAME_INPUT: Final = 256

MAX_TOOLS_PER_SERVER: Final = 1000
"""Tools of one server that `generate()` writes modules for: past it, the first this many in
code-point order of their names (a listing's order is not stable), and a warning. A server
with thousands of tools is hostile or broken, and one module per tool would cost minutes of
host CPU and a tree no model reads; the tools left out can still be called by name with
`codecage.runtime.call_tool`."""

MAX_TOOL_NAME: Final = 1024
"""Characters of a tool name that `generate()` writes a module for (the MCP spec asks for at
most 128; module names are made from the first 256): a longer one is left out with a
warning, as it cannot be cut (the name is what the call sends). Descriptions and titles are
bounded where they are written (`_MAX_DESCRIPTION`, `_MAX_SUMMARY`)."""
_BUDGET: Final = 5000  # schema nodes read per module: bounds time and size on any schema
_MAX_MARKER_BYTES: Final = 1 << 20

_TYPING_NAMES: Final = frozenset(
    {"Any", "Final", "Literal", "NotRequired", "TypeAlias", "TypedDict", "Unpack"}
)
_BUILTIN_NAMES: Final = frozenset(dir(builtins))
# Names a generated tool module defines or imports itself; no generated type may take them.
_MODULE_NAMES: Final = frozenset(
    {"SERVER", "TOOL", "Params", "Result", "call", "call_sync", "_arguments", "cast"}
    | {"overload", "call_tool", "call_tool_sync"}
)
_RESERVED_TYPE_NAMES: Final = (
    _TYPING_NAMES | _BUILTIN_NAMES | _MODULE_NAMES | frozenset(keyword.kwlist)
)
# Builtins that appear inside generated annotations: a class-syntax field of that name
# would shadow them in the class body, so such keys use the functional syntax.
_ANNOTATION_BUILTINS: Final = frozenset({"str", "int", "float", "bool", "list", "dict"})
# What generate() can produce, and so all that write_tree() may ever write or remove.
_GENERATED_PATH: Final = re.compile(
    r"(?:[a-z][a-z0-9_]*/(?:__init__|[a-z][a-z0-9_]*)|__init__)\.py"
)
_CAMEL_UPPER: Final = re.compile(r"([A-Z]+)([A-Z][a-z])")
_CAMEL_LOWER: Final = re.compile(r"([a-z0-9])([A-Z])")
_NOT_ALNUM: Final = re.compile(r"[^0-9A-Za-z]+")
_LINE_BREAKS: Final = re.compile("\r\n|[\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029]")


# --- type expressions ------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Name:
    """A name or `None`: `str`, `Any`, `Entity`."""

    text: str


@dataclass(frozen=True, slots=True)
class _Sub:
    """A subscripted generic: `list[X]`, `dict[str, X]`."""

    head: str
    args: tuple[_Type, ...]


@dataclass(frozen=True, slots=True)
class _Union:
    members: tuple[_Type, ...]


@dataclass(frozen=True, slots=True)
class _Lit:
    """`Literal[...]`; each value is already rendered as Python source."""

    values: tuple[str, ...]


_Type = _Name | _Sub | _Union | _Lit

_ANY: Final = _Name("Any")
_NONE: Final = _Name("None")
_STR: Final = _Name("str")
_DICT_ANY: Final = _Sub("dict", (_STR, _ANY))
_SCALARS: Final[Mapping[str, _Type]] = {
    "string": _STR,
    "integer": _Name("int"),
    "number": _Name("float"),
    "boolean": _Name("bool"),
    "null": _NONE,
}


def _flat(t: _Type) -> str:
    if isinstance(t, _Name):
        return t.text
    if isinstance(t, _Sub):
        return f"{t.head}[{', '.join(_flat(a) for a in t.args)}]"
    if isinstance(t, _Union):
        return " | ".join(_flat(m) for m in t.members)
    return f"Literal[{', '.join(t.values)}]"


def _union(members: Iterable[_Type]) -> _Type:
    """A normalized union: flat, deduplicated, literals merged, `None` last, Any absorbing."""
    flat: list[_Type] = []
    for m in members:
        for x in m.members if isinstance(m, _Union) else (m,):
            forward = isinstance(x, _Name) and x.text.startswith('"')
            flat.append(_DICT_ANY if forward else x)
    if not flat or _ANY in flat:
        return _ANY
    values: dict[str, None] = {}
    out: list[_Type] = []
    for m in flat:
        if isinstance(m, _Lit):
            if not values:
                out.append(m)  # placeholder: the merged Literal goes where the first was
            values.update(dict.fromkeys(m.values))
        elif m not in out and m != _NONE:
            out.append(m)
    merged: list[_Type] = [_Lit(tuple(values))]
    if len(values) > _MAX_ENUM:
        merged = [_literal_base(v) for v in values]
    out = [x for m in out for x in (merged if isinstance(m, _Lit) else [m])]
    out = list(dict.fromkeys(out))
    if _NONE in flat:
        out.append(_NONE)
    return out[0] if len(out) == 1 else _Union(tuple(out))


def _literal_base(source: str) -> _Type:
    """The base type of a rendered Literal value."""
    if source[0] in "'\"":
        return _STR
    return _Name("bool") if source in ("True", "False") else _Name("int")


def _literal_value(value: object) -> str | None:
    """`value` as Python source valid inside `Literal[...]`, or None if it cannot be one."""
    if isinstance(value, bool):
        return "True" if value else "False"
    if isinstance(value, int):
        return str(value) if abs(value) < 2**63 else None
    if isinstance(value, str):
        return py_str(value)
    return None


def _base_type(value: object) -> _Type:
    if value is None:
        return _NONE
    if isinstance(value, bool):
        return _Name("bool")
    if isinstance(value, int):
        return _Name("int")
    if isinstance(value, float):
        return _Name("float")
    if isinstance(value, str):
        return _STR
    if isinstance(value, list):
        return _Sub("list", (_ANY,))
    if isinstance(value, dict):
        return _DICT_ANY
    return _ANY


def _enum_type(values: Sequence[object]) -> _Type:
    if not values:
        return _ANY
    literals = [_literal_value(v) for v in values if v is not None]
    if len(values) > _MAX_ENUM or any(lit is None for lit in literals):
        return _union(_base_type(v) for v in values)
    parts: list[_Type] = [_Lit(tuple(dict.fromkeys(v for v in literals if v is not None)))]
    if any(v is None for v in values):
        parts.append(_NONE)
    return _union(p for p in parts if p != _Lit(()))


# --- text: literals, identifiers, docs -------------------------------------------------


def py_str(text: str) -> str:
    """A Python string literal for `text`, safe for any input, in `ruff format` style.

    Every character that is not printable ASCII is escaped (so the source is ASCII, shows no
    bidi or homoglyph tricks, and its width is its length); the quote is ruff's choice:
    double, unless the text holds more double quotes than single ones.
    """
    quote = "'" if text.count('"') > text.count("'") else '"'
    out: list[str] = []
    for ch in text:
        code = ord(ch)
        if ch in ("\\", quote):
            out.append("\\" + ch)
        elif 0x20 <= code < 0x7F:
            out.append(ch)
        elif ch == "\n":
            out.append("\\n")
        elif ch == "\r":
            out.append("\\r")
        elif ch == "\t":
            out.append("\\t")
        elif code < 0x100:
            out.append(f"\\x{code:02x}")
        elif code < 0x10000:
            out.append(f"\\u{code:04x}")
        else:
            out.append(f"\\U{code:08x}")
    return quote + "".join(out) + quote


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


def _type_name(name: str, fallback: str) -> str:
    parts = [p for p in _NOT_ALNUM.split(_ascii_words(name)) if p]
    text = "".join(p[0].upper() + p[1:] for p in parts)
    if not text:
        text = fallback
    elif text[0].isdigit():
        text = fallback + text
    return text[:_MAX_TYPE_NAME]


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


def _doc_text(value: object, limit: int) -> str:
    """Untrusted text made fit for a docstring: printable, dedented, bounded. Not escaped."""
    if not isinstance(value, str):
        return ""
    text = _LINE_BREAKS.sub("\n", value[: limit * 2])
    text = "".join(ch if ch == "\n" or ch.isprintable() else " " for ch in text.expandtabs(4))
    lines = [line.rstrip() for line in text.split("\n")]
    indents = [len(line) - len(line.lstrip(" ")) for line in lines if line]
    cut = min(indents, default=0)
    out: list[str] = []
    for line in lines:
        if line or (out and out[-1]):
            out.append(line[cut:])
    text = "\n".join(out).strip("\n")
    if len(text) > limit:
        text = text[: limit - 4].rstrip() + " ..."
    return text


def _doc_line(value: object, limit: int) -> str:
    """Untrusted text as one docstring line."""
    return " ".join(_doc_text(value, limit * 2).split())[:limit]


def _summary(description: object, fallback: str) -> str:
    for line in _doc_text(description, _MAX_DESCRIPTION).split("\n"):
        text = " ".join(line.split())
        if text:
            if len(text) > _MAX_SUMMARY:
                text = text[: _MAX_SUMMARY - 4].rsplit(" ", 1)[0] + " ..."
            return text
    return fallback


def _escape_doc(text: str) -> str:
    """Docstring body text (from `_doc_text`) as the inside of a triple-quoted string.

    Backslashes are doubled; a quote is escaped where it would make a run of three, and at
    the start and the end, so no run can close the string.
    """
    out: list[str] = []
    run = 0
    for i, ch in enumerate(text):
        if ch == "\\":
            out.append("\\\\")
            run = 0
        elif ch == '"':
            if run == 2 or i == 0 or i == len(text) - 1:
                out.append('\\"')
                run = 0
            else:
                out.append(ch)
                run += 1
        else:
            out.append(ch)
            run = 0
    return "".join(out)


def _docstring(lines: Sequence[str], indent: str) -> str:
    """A docstring from already-sanitized lines (the first is the summary)."""
    body = [_escape_doc(line) for line in lines]
    while len(body) > 1 and not body[-1]:
        body.pop()
    if len(body) == 1:
        return f'{indent}"""{body[0]}"""'
    rest = [f"{indent}{line}" if line else "" for line in body[1:]]
    return "\n".join([f'{indent}"""{body[0]}', *rest, f'{indent}"""'])


# --- schema -> named types -------------------------------------------------------------


@dataclass(slots=True)
class _Field:
    key: str
    type: _Type
    required: bool
    description: str
    default: str | None


@dataclass(slots=True)
class _Class:
    name: str
    description: str
    fields: list[_Field]
    field_docs: bool = True  # False for Params: the module docstring documents those


@dataclass(slots=True)
class _Alias:
    name: str
    type: _Type


@dataclass(slots=True)
class _Types:
    """The named types of one tool module, in definition order (dependencies first)."""

    taken: set[str] = field(default_factory=lambda: set(_RESERVED_TYPE_NAMES))
    defs: list[_Class | _Alias] = field(default_factory=list)
    budget: int = _BUDGET  # schema nodes still to read; then everything is Any
    classes: int = 0

    def allocate(self, base: str) -> str:
        base = base[:_MAX_TYPE_NAME]
        name, n = base, 2
        while name in self.taken:
            name, n = f"{base}{n}", n + 1
        self.taken.add(name)
        return name


def _typed(schema: object) -> bool:
    """Whether a schema says anything about the type (not just constraints)."""
    keys = ("type", "properties", "$ref", "enum", "const", "anyOf", "oneOf", "allOf", "items")
    return isinstance(schema, dict) and any(k in schema for k in keys)


def _default_text(schema: Mapping[str, Any]) -> str | None:
    if "default" not in schema:
        return None
    try:
        text = json.dumps(schema["default"], ensure_ascii=False, sort_keys=True)
    except (TypeError, ValueError, RecursionError):
        text = "(not JSON)"
    return _doc_line(text, _MAX_DEFAULT)


class _SchemaReader:
    """Turns one JSON Schema (an inputSchema or an outputSchema) into types in `types`."""

    def __init__(self, root: object, types: _Types) -> None:
        self.root = root
        self.types = types
        # pointer -> (class name, finished?); a reference to an unfinished class is a cycle
        self.ref_classes: dict[str, tuple[str, bool]] = {}
        self.inlining: set[str] = set()

    def resolve(self, ref: str) -> tuple[str, object] | None:
        if not ref.startswith("#"):
            return None  # remote references are not fetched
        pointer = urllib.parse.unquote(ref[1:])
        node: object = self.root
        if pointer:
            if not pointer.startswith("/"):
                return None
            for raw in pointer[1:].split("/"):
                part = raw.replace("~1", "/").replace("~0", "~")
                if isinstance(node, dict) and part in node:
                    node = node[part]
                elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                    node = node[int(part)]
                else:
                    return None
        return pointer, node

    def deref(self, schema: object) -> object:
        """`schema` with `$ref`s at its top followed (a few), for roots and descriptions."""
        for _ in range(8):
            if not (isinstance(schema, dict) and isinstance(schema.get("$ref"), str)):
                break
            found = self.resolve(schema["$ref"])
            if found is None:
                return {}
            schema = found[1]
        return schema

    def merge_all_of(self, schema: Mapping[str, Any]) -> dict[str, Any]:
        """`allOf` folded into one schema: properties and required lists united."""
        merged = {k: v for k, v in schema.items() if k != "allOf"}
        properties = dict(merged.get("properties") or {})
        required = list(merged.get("required") or [])
        for branch in schema["allOf"]:
            branch = self.deref(branch)
            if not isinstance(branch, dict):
                continue
            for key, value in branch.items():
                if key == "properties" and isinstance(value, dict):
                    for name, sub in value.items():
                        properties.setdefault(name, sub)
                elif key == "required" and isinstance(value, list):
                    required.extend(value)
                elif key not in merged and key not in ("$ref", "allOf"):
                    merged[key] = value
        if properties:
            merged["properties"] = properties
        if required:
            merged["required"] = required
        return merged

    def type_of(self, schema: object, hint: str, depth: int) -> _Type:
        self.types.budget -= 1
        if depth > _MAX_DEPTH or self.types.budget < 0 or not isinstance(schema, dict):
            return _ANY
        ref = schema.get("$ref")
        if isinstance(ref, str):
            return self.ref_type(ref, hint, depth)
        if "const" in schema:
            return _enum_type([schema["const"]])
        enum = schema.get("enum")
        if isinstance(enum, list):
            return _enum_type(enum)
        for key in ("anyOf", "oneOf"):
            options = schema.get(key)
            if isinstance(options, list) and any(_typed(o) for o in options):
                option_hint = hint + "Option"
                members = [self.type_of(o, option_hint, depth + 1) for o in options]
                return self.nullable(schema, _union(members))
        if isinstance(schema.get("allOf"), list):
            return self.type_of(self.merge_all_of(schema), hint, depth + 1)
        kind = schema.get("type")
        if isinstance(kind, list):
            names = list(dict.fromkeys(k for k in kind if isinstance(k, str)))
            result = _union(self.type_for(k, schema, hint, depth) for k in names)
        elif isinstance(kind, str):
            result = self.type_for(kind, schema, hint, depth)
        elif "properties" in schema or isinstance(schema.get("additionalProperties"), dict):
            result = self.type_for("object", schema, hint, depth)
        elif "items" in schema:
            result = self.type_for("array", schema, hint, depth)
        else:
            result = _ANY
        return self.nullable(schema, result)

    def nullable(self, schema: Mapping[str, Any], t: _Type) -> _Type:
        return _union((t, _NONE)) if schema.get("nullable") is True else t

    def type_for(self, kind: str, schema: Mapping[str, Any], hint: str, depth: int) -> _Type:
        if kind in _SCALARS:
            return _SCALARS[kind]
        if kind == "array":
            items = schema.get("items")
            if isinstance(items, dict):
                return _Sub("list", (self.type_of(items, hint + "Item", depth + 1),))
            return _Sub("list", (_ANY,))
        if kind == "object":
            return self.object_type(schema, hint, depth, None)
        return _ANY

    def ref_type(self, ref: str, hint: str, depth: int) -> _Type:
        found = self.resolve(ref)
        if found is None:
            return _ANY
        pointer, target = found
        if pointer in self.ref_classes:
            name, finished = self.ref_classes[pointer]
            # The back edge of a cycle: a forward reference, defined below (a recursive
            # TypedDict). `_union` turns it into a dict, as `"A" | None` fails at runtime.
            return _Name(name if finished else f'"{name}"')
        if _is_class_schema(target):
            if self.types.classes >= _MAX_TYPES or self.types.budget < 0:
                return _DICT_ANY
            segment = pointer.rsplit("/", 1)[-1].replace("~1", "/").replace("~0", "~")
            return self.class_type(
                target, self.types.allocate(_type_name(segment, hint)), depth, pointer
            )
        if pointer in self.inlining:
            return _ANY
        self.inlining.add(pointer)
        try:
            return self.type_of(target, hint, depth + 1)
        finally:
            self.inlining.discard(pointer)

    def object_type(
        self, schema: Mapping[str, Any], hint: str, depth: int, name: str | None
    ) -> _Type:
        """A TypedDict for an object with properties (named `name` if given), else a dict."""
        properties = schema.get("properties")
        if name is None and not (isinstance(properties, dict) and properties):
            extra = schema.get("additionalProperties")
            if isinstance(extra, dict) and extra:
                return _Sub("dict", (_STR, self.type_of(extra, hint + "Value", depth + 1)))
            return _DICT_ANY
        if name is None:
            if self.types.classes >= _MAX_TYPES or self.types.budget < 0:
                return _DICT_ANY
            title = schema.get("title")
            base = _type_name(title, hint) if isinstance(title, str) else hint
            if base in _RESERVED_TYPE_NAMES:  # a title "None" or "Params": the path reads better
                base = hint
            name = self.types.allocate(base)
        return self.class_type(schema, name, depth, None)

    def class_type(
        self, schema: Mapping[str, Any], name: str, depth: int, pointer: str | None
    ) -> _Name:
        """The TypedDict `name` for an object schema; defined after the types it uses."""
        if pointer is not None:
            self.ref_classes[pointer] = (name, False)
        self.types.classes += 1
        properties = schema.get("properties")
        fields = self.fields(properties if isinstance(properties, dict) else {}, schema, depth)
        description = _doc_text(schema.get("description"), _MAX_DESCRIPTION)
        self.types.defs.append(_Class(name, description, fields))
        if pointer is not None:
            self.ref_classes[pointer] = (name, True)
        return _Name(name)

    def fields(
        self, properties: Mapping[Any, Any], schema: Mapping[str, Any], depth: int
    ) -> list[_Field]:
        required = schema.get("required")
        required_keys = set()
        if isinstance(required, list):
            required_keys = {r for r in required if isinstance(r, str)}
        out: list[_Field] = []
        for key, sub in list(properties.items())[:_MAX_PROPERTIES]:
            if not isinstance(key, str):
                continue
            t = self.type_of(sub, _type_name(key, "Field"), depth + 1)
            doc_source = sub if isinstance(sub, dict) else {}
            description = doc_source.get("description")
            if description is None:
                target = self.deref(doc_source)
                description = target.get("description") if isinstance(target, dict) else None
            out.append(
                _Field(
                    key,
                    t,
                    key in required_keys,
                    _doc_text(description, _MAX_FIELD_DOC),
                    _default_text(doc_source),
                )
            )
        return out


def _is_class_schema(schema: object) -> TypeGuard[dict[str, Any]]:
    if not isinstance(schema, dict):
        return False
    properties = schema.get("properties")
    kind = schema.get("type", "object")
    plain = not any(k in schema for k in ("anyOf", "oneOf", "allOf", "enum", "const", "$ref"))
    return plain and kind == "object" and isinstance(properties, dict) and bool(properties)


def _object_root(schema: object) -> TypeGuard[dict[str, Any]]:
    """Whether a root schema becomes a TypedDict class (possibly empty)."""
    if not isinstance(schema, dict) or schema.get("type", "object") != "object":
        return False
    if any(k in schema for k in ("anyOf", "oneOf", "enum", "const")):
        return False
    properties = schema.get("properties")
    extra = schema.get("additionalProperties")
    no_properties = not (isinstance(properties, dict) and properties)
    return not (no_properties and isinstance(extra, dict) and extra)


# --- layout: text in ruff format style -------------------------------------------------


class _Layout:
    """Renders the definitions of one module; hoists types that would not fit a line."""

    def __init__(self, types: _Types) -> None:
        self.types = types
        self.blocks: list[str] = []
        self.imports: set[str] = set()

    def use(self, t: _Type) -> None:
        if isinstance(t, _Name) and t.text == "Any":
            self.imports.add("Any")
        elif isinstance(t, _Lit):
            self.imports.add("Literal")
        elif isinstance(t, _Sub):
            for a in t.args:
                self.use(a)
        elif isinstance(t, _Union):
            for m in t.members:
                self.use(m)

    def hoist(self, t: _Type, prefix: str, suffix: str) -> _Name:
        """`t` as a name: itself, or a new TypeAlias defined before the current block."""
        if isinstance(t, _Name):
            return t
        name = self.types.allocate(prefix[: _MAX_TYPE_NAME - len(suffix)] + suffix)
        self.alias(name, t)
        return _Name(name)

    def alias(self, name: str, t: _Type) -> None:
        self.imports.add("TypeAlias")
        head = f"{name}: TypeAlias = "
        if len(head + _flat(t)) > _LINE:
            if isinstance(t, _Sub):
                suffixes = ["Item"] if t.head == "list" else [f"Arg{i + 1}" for i in range(9)]
                if t.head == "dict":
                    suffixes = ["Key", "Value"]
                args = [self.hoist(a, name, s) for a, s in zip(t.args, suffixes, strict=False)]
                t = _Sub(t.head, tuple(args))
            elif isinstance(t, _Union):
                t = _Union(tuple(self.hoist(m, name, "Option") for m in t.members))
        self.use(t)
        text = head + _flat(t)
        if len(text) > _LINE and isinstance(t, _Lit):
            if len(t.values) == 1:
                text = f"{head}Literal[\n    {t.values[0]}\n]"
            else:
                text = "\n".join([f"{head}Literal[", *(f"    {v}," for v in t.values), "]"])
        elif len(text) > _LINE and isinstance(t, _Union):
            inner = _flat(t)
            if 4 + len(inner) <= _LINE:
                text = f"{head}(\n    {inner}\n)"
            else:
                first, *rest = (_flat(m) for m in t.members)
                text = "\n".join([f"{head}(", f"    {first}", *(f"    | {m}" for m in rest), ")"])
        self.blocks.append(text)

    def annotation(self, f: _Field, t: _Type) -> str:
        if f.required:
            return _flat(t)
        self.imports.add("NotRequired")
        return f"NotRequired[{_flat(t)}]"

    def typed_dict(self, cls: _Class, doc: list[str]) -> None:
        self.imports.add("TypedDict")
        if all(_plain_key(f.key) for f in cls.fields):
            lines = [f"class {cls.name}(TypedDict):", _docstring(doc, "    ")]
            if cls.fields:
                lines.append("")
            for f in cls.fields:
                t = f.type
                if len(f"    {f.key}: {self.annotation(f, t)}") > _LINE:
                    t = self.hoist(t, cls.name, _type_name(f.key, "Field")[:14])
                self.use(t)
                lines.append(f"    {f.key}: {self.annotation(f, t)}")
            self.blocks.append("\n".join(lines))
            return
        # Functional syntax: keys that are not identifiers (or would shadow something).
        lines = [f"{cls.name} = TypedDict(", f'    "{cls.name}",', "    {"]
        for f in cls.fields:
            key = py_str(f.key)
            t = f.type
            if len(f"        {key}: {self.annotation(f, t)},") > _LINE:
                t = self.hoist(t, cls.name, _type_name(f.key, "Field")[:14])
            self.use(t)
            item = f"        {key}: {self.annotation(f, t)},"
            if len(item) > _LINE and not f.required:
                item = f"        {key}: NotRequired[\n            {_flat(t)}\n        ],"
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


def _field_doc(f: _Field) -> list[str]:
    kind = _flat(f.type)
    if len(kind) > _MAX_DOC_TYPE:
        kind = kind[: _MAX_DOC_TYPE - 4] + " ..."
    state = "required" if f.required else "optional"
    if f.default is not None:
        state += f", default: {f.default}"
    head = (
        f"    {_doc_line(f.key, 80) or '(empty name)'}: {_doc_line(kind, _MAX_DOC_TYPE)} ({state})"
    )
    body = [
        f"        {line}" if line else "" for line in f.description.split("\n") if f.description
    ]
    return [head, *body]


def _class_doc(cls: _Class, fallback: str) -> list[str]:
    doc = [_summary(cls.description, fallback)]
    if cls.description and cls.description != doc[0]:
        doc += ["", *cls.description.split("\n")]
    if cls.field_docs and cls.fields:
        doc += ["", "Fields:"]
        for f in cls.fields:
            doc += _field_doc(f)
    return doc


def _assign_str(name: str, value: str) -> str:
    """`NAME: Final = "..."` as ruff formats it (long strings go in parentheses if that fits)."""
    literal = py_str(value)
    line = f"{name}: Final = {literal}"
    if len(line) > _LINE and 4 + len(literal) <= _LINE:
        return f"{name}: Final = (\n    {literal}\n)"
    return line


def _import_line(module: str, names: Iterable[str]) -> str:
    # isort's order-by-type: CONSTANTS, then Classes, then functions.
    ordered = sorted(names, key=lambda n: (0 if n.isupper() else 1 if n[0].isupper() else 2, n))
    line = f"from {module} import {', '.join(ordered)}"
    if len(line) <= _LINE:
        return line
    return "\n".join([f"from {module} import (", *(f"    {n}," for n in ordered), ")"])


def _dict_literal(name: str, entries: Sequence[tuple[str, str]]) -> str:
    """`NAME: dict[str, str] = {...}`, one entry per line (ruff leaves long ones as they are)."""
    if not entries:
        return f"{name}: dict[str, str] = {{}}"
    lines = [f"{name}: dict[str, str] = {{"]
    lines += [f"    {py_str(key)}: {py_str(value)}," for key, value in entries]
    lines.append("}")
    return "\n".join(lines)


# --- modules ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _ToolModule:
    module: str
    summary: str
    text: str


def _tool_module(server: str, tool: Tool, module: str) -> _ToolModule:
    fallback = (
        f"Call the tool {_doc_line(tool.name, 80)} of the MCP server {_doc_line(server, 80)}."
    )
    description = tool.description if tool.description is not None else tool.title
    summary = _summary(description, fallback)
    types = _Types()
    layout = _Layout(types)

    # Params: the tool's inputSchema.
    params_reader = _SchemaReader(tool.input_schema, types)
    root = params_reader.deref(tool.input_schema)
    if isinstance(root, dict) and isinstance(root.get("allOf"), list):
        root = params_reader.merge_all_of(root)
    params_fields: list[_Field] = []
    params_is_class = False
    types.taken.discard("Params")
    types.allocate("Params")
    if _object_root(root):
        params_is_class = True
        params_reader.class_type(root, "Params", 0, "")  # `$ref: "#"` inside is a cycle
        params_class = next(d for d in types.defs if isinstance(d, _Class) and d.name == "Params")
        params_class.field_docs = False
        params_class.description = ""
        params_fields = params_class.fields
    else:
        types.defs.append(_Alias("Params", _DICT_ANY))

    # Result: the tool's outputSchema, if it declares one.
    types.taken.discard("Result")
    types.allocate("Result")
    result_any = tool.output_schema is None
    if tool.output_schema is not None:
        result_reader = _SchemaReader(tool.output_schema, types)
        out_root = result_reader.deref(tool.output_schema)
        if _is_class_schema(out_root):
            result_reader.class_type(out_root, "Result", 0, "")
        else:
            t = result_reader.type_of(out_root, "Result", 0)
            result_any = t == _ANY
            types.defs.append(_Alias("Result", t))
    else:
        types.defs.append(_Alias("Result", _ANY))

    for d in types.defs:
        if isinstance(d, _Alias):
            layout.alias(d.name, d.type)
        elif d.name == "Params":
            layout.typed_dict(d, ["Arguments of this tool: the module docstring describes each."])
        elif d.name == "Result":
            layout.typed_dict(d, _class_doc(d, "The structured result of this tool."))
        else:
            layout.typed_dict(d, _class_doc(d, f"The {d.name} object."))

    doc = [summary]
    full = _doc_text(description, _MAX_DESCRIPTION)
    if full and full != summary:
        doc += ["", *full.split("\n")]
    doc += ["", "Parameters:"]
    if params_fields:
        for f in params_fields:
            doc += _field_doc(f)
    else:
        doc.append("    (none)" if params_is_class else "    any JSON object")
    doc += ["", "Returns:"]
    if tool.output_schema is None:
        doc.append("    The tool's structured content (a dict) if it sends one, else its text.")
    else:
        doc.append("    Result: the tool's structured content, as its outputSchema declares.")
    doc += [
        "",
        "Call it with `await call(Params(...))`, `await call(name=value, ...)` or a dict;",
        "`call_sync(...)` is the same without await. Unset optional fields are not sent.",
    ]

    layout.imports |= {"Any", "Final"}
    if params_is_class:
        layout.imports.add("Unpack")
    if not result_any:
        layout.imports.add("cast")
    layout.imports.add("overload")
    kwargs = "Unpack[Params]" if params_is_class else "Any"
    blocks = [
        _docstring(doc, ""),
        "\n".join(
            [
                _import_line("typing", layout.imports),
                "",
                _import_line("codecage.runtime", ["call_tool", "call_tool_sync"]),
                "",
                _assign_str("SERVER", server),
                _assign_str("TOOL", tool.name),
            ]
        ),
        *layout.blocks,
    ]
    for prefix, fn, runner in (
        ("async ", "call", "await call_tool"),
        ("", "call_sync", "call_tool_sync"),
    ):
        value = f"{runner}(SERVER, TOOL, arguments)"
        blocks += [
            f"@overload\n{prefix}def {fn}(params: Params, /) -> Result: ...",
            f"@overload\n{prefix}def {fn}(**kwargs: {kwargs}) -> Result: ...",
            "\n".join(
                [
                    f"{prefix}def {fn}(params: Params | None = None, /, **kwargs: Any) -> Result:",
                    '    """Call the tool with a Params (or a dict), or with keyword arguments."""',
                    "    arguments = _arguments(params, kwargs)",
                    f"    return {value if result_any else f'cast(Result, {value})'}",
                ]
            ),
        ]
    blocks.append(
        "\n".join(
            [
                "def _arguments(params: Params | None, kwargs: dict[str, Any]) -> dict[str, Any]:",
                "    if params is not None and kwargs:",
                '        raise TypeError("pass a Params or keyword arguments, not both")',
                "    return dict(params if params is not None else kwargs)",
            ]
        )
    )
    return _ToolModule(module, summary, _join_blocks(blocks))


def _join_blocks(blocks: Sequence[str]) -> str:
    """The module docstring, one blank line, then the blocks two blank lines apart."""
    return blocks[0] + "\n\n" + "\n\n\n".join(blocks[1:]) + "\n"


def _server_index(server: str, module: str, tools: Sequence[_ToolModule]) -> str:
    name = _doc_line(server, 80) or "(unnamed)"
    count = f"{len(tools)} tool" + ("" if len(tools) == 1 else "s")
    doc = [f"Tools of the MCP server {name} ({count}).", ""]
    doc += [f"{t.module}: {t.summary}" for t in tools] or ["(none)"]
    doc += [
        "",
        f"Each tool is a module: `from servers.{module} import <tool>`; its docstring",
        "describes the parameters, and `await <tool>.call(...)` calls it.",
        "Generated by `codecage gen`: do not edit.",
    ]
    return _join_blocks(
        [
            _docstring(doc, ""),
            "from typing import Final\n\n" + _assign_str("SERVER", server),
            _dict_literal("TOOLS", [(t.module, t.summary) for t in tools]),
        ]
    )


def _servers_index(servers: Sequence[tuple[str, str, int]]) -> str:
    doc = ["MCP servers whose tools this code can call.", ""]
    for original, module, count in servers:
        doc.append(f"{module}: {count} tool{'' if count == 1 else 's'} ({_doc_line(original, 80)})")
    if not servers:
        doc.append("(none)")
    doc += [
        "",
        "Each server is a package: `import servers.<server>` and read its docstring or its",
        "TOOLS (module name -> summary). SERVERS maps module names to server names.",
        "Generated by `codecage gen`: do not edit.",
    ]
    return _join_blocks(
        [_docstring(doc, ""), _dict_literal("SERVERS", [(m, o) for o, m, _ in servers])]
    )


def generate(servers: Mapping[str, Sequence[Tool]]) -> dict[str, str]:
    """The `servers/` tree for these upstream servers and their tools.

    Returns a dict from a path relative to the output directory (`"__init__.py"`,
    `"memory/__init__.py"`, `"memory/create_entities.py"`) to the file's text, sorted by path.
    Pure and deterministic: servers and tools come out sorted by module name, so neither
    the order of `servers` nor a server's listing order matters (except between two tools
    of the same name). Any schema and any text are accepted; what cannot be typed is `Any`.
    Raises nothing for a tool's content.
    """
    names = list(servers)
    modules = unique_module_names(names, "server")
    files: dict[str, str] = {}
    index: list[tuple[str, str, int]] = []
    for server, server_module in sorted(zip(names, modules, strict=True), key=lambda p: p[1]):
        tools = _bounded_tools(server, servers[server])
        tool_modules = unique_module_names([t.name for t in tools], "tool")
        generated = sorted(
            (_tool_module(server, tool, m) for tool, m in zip(tools, tool_modules, strict=True)),
            key=lambda g: g.module,
        )
        for g in generated:
            files[f"{server_module}/{g.module}.py"] = g.text
        files[f"{server_module}/__init__.py"] = _server_index(server, server_module, generated)
        index.append((server, server_module, len(generated)))
    files["__init__.py"] = _servers_index(index)
    return dict(sorted(files.items()))


def _bounded_tools(server: str, listed: Sequence[Tool]) -> list[Tool]:
    """The tools of `server` to write modules for: names of at most `MAX_TOOL_NAME`
    characters, at most `MAX_TOOLS_PER_SERVER` of them; a warning for any left out."""
    tools = [t for t in listed if len(t.name) <= MAX_TOOL_NAME]
    if len(tools) < len(listed):
        log.warning(
            "codegen_tools_left_out: tool names longer than the bound",
            extra={"server": server, "left_out": len(listed) - len(tools), "max": MAX_TOOL_NAME},
        )
    if len(tools) > MAX_TOOLS_PER_SERVER:
        log.warning(
            "codegen_tools_left_out: more tools than the bound; the first by name are kept, "
            "the others can be called by name with codecage.runtime.call_tool",
            extra={"server": server, "listed": len(tools), "kept": MAX_TOOLS_PER_SERVER},
        )
        # Stable: tools of one name keep their listing order, as unique_module_names wants.
        tools = sorted(tools, key=lambda t: t.name)[:MAX_TOOLS_PER_SERVER]
    return tools


# --- writing ---------------------------------------------------------------------------


def _read_bounded(path: Path, limit: int) -> bytes | None:
    """A regular file's bytes (no symlink followed, at most `limit`), or None."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            return None
        return f.read(limit + 1)


def _previous_files(out_dir: Path) -> set[str]:
    data = _read_bounded(out_dir / MARKER, _MAX_MARKER_BYTES)
    if data is None or len(data) > _MAX_MARKER_BYTES:
        return set()
    try:
        listed = json.loads(data).get("files", [])
    except (ValueError, AttributeError, RecursionError):
        return set()
    if not isinstance(listed, list):
        return set()
    return {p for p in listed if isinstance(p, str) and _GENERATED_PATH.fullmatch(p)}


def _write_atomic(path: Path, data: bytes) -> bool:
    """Write `path` by rename (a symlink there is replaced, never followed); False if same."""
    if not path.is_symlink() and _read_bounded(path, len(data)) == data:
        return False
    if path.is_dir() and not path.is_symlink():
        raise ConfigError(f"{path} is a directory", hint="remove it, or pick another output")
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".codecage-", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        Path(tmp).chmod(0o644)
        Path(tmp).replace(path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return True


def _check_dir(path: Path) -> None:
    if path.is_symlink() or (path.exists() and not path.is_dir()):
        raise ConfigError(
            f"{path} is not a directory (or is a symlink)",
            hint="codecage gen writes only into real directories; remove it or pick another",
        )


def write_tree(files: Mapping[str, str], out_dir: Path) -> list[Path]:
    """Write a `generate()` tree into `out_dir` (the `servers` directory itself).

    Files whose text is unchanged are left alone; files this function wrote before (listed in
    `out_dir/.codecage-generated.json`) that are not in `files` any more are removed, and so
    are server directories they leave empty. Nothing else is touched: no path outside
    `out_dir`, no file it did not generate, no symlink followed. `files` is the whole tree.

    Returns the paths written (created or changed), sorted; empty when nothing changed.

    Raises:
        ConfigError: a path in `files` is not one `generate()` makes; `out_dir` or a directory
            in it is a symlink or not a directory; or `out_dir` is a non-empty directory that
            `write_tree()` did not write.
        BridgeError: a file could not be written or removed.
    """
    for rel in files:
        if not _GENERATED_PATH.fullmatch(rel):
            raise ConfigError(
                f"{rel!r} is not a generated module path",
                hint="pass the dict that codegen.generate() returned",
            )
    _check_dir(out_dir)
    try:
        if out_dir.exists() and not (out_dir / MARKER).exists() and any(out_dir.iterdir()):
            raise ConfigError(
                f"{out_dir} is not empty and was not written by codecage gen",
                hint="pick an empty or new directory, or remove this one",
            )
        previous = _previous_files(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        marker = out_dir / MARKER
        # First list old and new together: if we stop half-way, the next run still cleans up.
        _write_marker(marker, previous | set(files))
        written: list[Path] = []
        for rel, text in sorted(files.items()):
            path = out_dir / rel
            if path.parent != out_dir:
                _check_dir(path.parent)
                path.parent.mkdir(exist_ok=True)
            if _write_atomic(path, text.encode("utf-8")):
                written.append(path)
        for rel in sorted(previous - set(files)):
            path = out_dir / rel
            if path.parent != out_dir:
                _check_dir(path.parent)
            if path.is_symlink() or path.is_file():
                path.unlink()
                log.debug("codegen_removed", extra={"path": str(path)})
            _remove_bytecode(path)
            if path.parent != out_dir and path.parent.is_dir() and not any(path.parent.iterdir()):
                path.parent.rmdir()
        _write_marker(marker, set(files))
        _compile_tree(out_dir, files)
    except OSError as exc:
        raise BridgeError(
            f"could not write the generated tree in {out_dir}: {exc.strerror or exc}",
            hint="check that the output directory is writable and on a local filesystem",
        ) from exc
    log.debug("codegen_written", extra={"out_dir": str(out_dir), "written": len(written)})
    return written


def _compile_tree(out_dir: Path, files: Mapping[str, str]) -> None:
    """Bytecode beside each module, as an import on the host would write it: the tree is
    read-only in the sandbox, where importing a server and two of its tools otherwise
    compiles them on every run (2.7 ms instead of 1.7 ms). Up-to-date files are skipped."""
    for rel in files:
        source = out_dir / rel
        if Path(importlib.util.cache_from_source(str(source))).parent.is_symlink():
            continue  # never written through (the pyc itself is replaced, not followed)
        compileall.compile_file(str(source), quiet=2)


def _remove_bytecode(source: Path) -> None:
    """The bytecode of a module that is gone, and its __pycache__ once that is empty."""
    cached = Path(importlib.util.cache_from_source(str(source)))
    if cached.is_file() and not cached.is_symlink():
        cached.unlink()
    if (
        cached.parent.is_dir()
        and not cached.parent.is_symlink()
        and not any(cached.parent.iterdir())
    ):
        cached.parent.rmdir()


def _write_marker(marker: Path, files: set[str]) -> None:
    payload = {"generator": "codecage gen", "version": 1, "files": sorted(files)}
    _write_atomic(marker, (json.dumps(payload, indent=1) + "\n").encode("utf-8"))
