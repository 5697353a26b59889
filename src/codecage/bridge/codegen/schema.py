"""JSON Schema -> the named types of one tool module (TypedDicts and aliases).

What JSON Schema cannot say in Python types becomes `Any`; a `$ref` cycle becomes
`dict[str, Any]` at the back edge; depth, type counts, property counts and the schema nodes
read are bounded, so no schema makes this raise or run long.
"""

from __future__ import annotations

import json
import re
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final, TypeGuard

from codecage.bridge.codegen.naming import MAX_TYPE_NAME, RESERVED_TYPE_NAMES, type_name
from codecage.bridge.codegen.pytypes import (
    ANY,
    DICT_ANY,
    NONE,
    SCALARS,
    STR,
    Name,
    PyType,
    Sub,
    enum_type,
    union,
)
from codecage.bridge.codegen.text import MAX_DESCRIPTION, doc_line, doc_text

_MAX_DEPTH: Final = 12  # schema nesting; deeper is Any
_MAX_TYPES: Final = 200  # named types per module; more objects become dict[str, Any]
_MAX_PROPERTIES: Final = 256  # per object; the rest are left out of the type
_MAX_FIELD_DOC: Final = 600
_MAX_DEFAULT: Final = 80
_BUDGET: Final = 5000  # schema nodes read per module: bounds time and size on any schema
# An array index in a `$ref` pointer: ASCII digits only (`"²".isdigit()` is true but `int`
# refuses it) and short (`int` refuses more than 4300 digits).
_INDEX: Final = re.compile(r"[0-9]{1,9}")


@dataclass(slots=True)
class Field:
    key: str
    type: PyType
    required: bool
    description: str
    default: str | None


@dataclass(slots=True)
class ClassDef:
    name: str
    description: str
    fields: list[Field]
    field_docs: bool = True  # False for Params: the module docstring documents those


@dataclass(slots=True)
class AliasDef:
    name: str
    type: PyType


@dataclass(slots=True)
class Types:
    """The named types of one tool module, in definition order (dependencies first)."""

    taken: set[str] = field(default_factory=lambda: set(RESERVED_TYPE_NAMES))
    defs: list[ClassDef | AliasDef] = field(default_factory=list)
    budget: int = _BUDGET  # schema nodes still to read; then everything is Any
    classes: int = 0

    def allocate(self, base: str) -> str:
        base = base[:MAX_TYPE_NAME]
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
    return doc_line(text, _MAX_DEFAULT)


class SchemaReader:
    """Turns one JSON Schema (an inputSchema or an outputSchema) into types in `types`."""

    def __init__(self, root: object, types: Types) -> None:
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
                elif isinstance(node, list) and _INDEX.fullmatch(part) and int(part) < len(node):
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
        # Only a dict and a list are read: `dict("ab")`, `list(5)` would raise.
        own_properties, own_required = merged.get("properties"), merged.get("required")
        properties = dict(own_properties) if isinstance(own_properties, dict) else {}
        required = list(own_required) if isinstance(own_required, list) else []
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

    def type_of(self, schema: object, hint: str, depth: int) -> PyType:
        self.types.budget -= 1
        if depth > _MAX_DEPTH or self.types.budget < 0 or not isinstance(schema, dict):
            return ANY
        ref = schema.get("$ref")
        if isinstance(ref, str):
            return self.ref_type(ref, hint, depth)
        if "const" in schema:
            return enum_type([schema["const"]])
        enum = schema.get("enum")
        if isinstance(enum, list):
            return enum_type(enum)
        for key in ("anyOf", "oneOf"):
            options = schema.get(key)
            if isinstance(options, list) and any(_typed(o) for o in options):
                option_hint = hint + "Option"
                members = [self.type_of(o, option_hint, depth + 1) for o in options]
                return self.nullable(schema, union(members))
        if isinstance(schema.get("allOf"), list):
            return self.type_of(self.merge_all_of(schema), hint, depth + 1)
        kind = schema.get("type")
        if isinstance(kind, list):
            names = list(dict.fromkeys(k for k in kind if isinstance(k, str)))
            result = union(self.type_for(k, schema, hint, depth) for k in names)
        elif isinstance(kind, str):
            result = self.type_for(kind, schema, hint, depth)
        elif "properties" in schema or isinstance(schema.get("additionalProperties"), dict):
            result = self.type_for("object", schema, hint, depth)
        elif "items" in schema:
            result = self.type_for("array", schema, hint, depth)
        else:
            result = ANY
        return self.nullable(schema, result)

    def nullable(self, schema: Mapping[str, Any], t: PyType) -> PyType:
        return union((t, NONE)) if schema.get("nullable") is True else t

    def type_for(self, kind: str, schema: Mapping[str, Any], hint: str, depth: int) -> PyType:
        if kind in SCALARS:
            return SCALARS[kind]
        if kind == "array":
            items = schema.get("items")
            if isinstance(items, dict):
                return Sub("list", (self.type_of(items, hint + "Item", depth + 1),))
            return Sub("list", (ANY,))
        if kind == "object":
            return self.object_type(schema, hint, depth, None)
        return ANY

    def ref_type(self, ref: str, hint: str, depth: int) -> PyType:
        found = self.resolve(ref)
        if found is None:
            return ANY
        pointer, target = found
        if pointer in self.ref_classes:
            name, finished = self.ref_classes[pointer]
            # The back edge of a cycle: a forward reference, defined below (a recursive
            # TypedDict). `union` turns it into a dict, as `"A" | None` fails at runtime.
            return Name(name if finished else f'"{name}"')
        if is_class_schema(target):
            if self.types.classes >= _MAX_TYPES or self.types.budget < 0:
                return DICT_ANY
            segment = pointer.rsplit("/", 1)[-1].replace("~1", "/").replace("~0", "~")
            return self.class_type(
                target, self.types.allocate(type_name(segment, hint)), depth, pointer
            )
        if pointer in self.inlining:
            return ANY
        self.inlining.add(pointer)
        try:
            return self.type_of(target, hint, depth + 1)
        finally:
            self.inlining.discard(pointer)

    def object_type(
        self, schema: Mapping[str, Any], hint: str, depth: int, name: str | None
    ) -> PyType:
        """A TypedDict for an object with properties (named `name` if given), else a dict."""
        properties = schema.get("properties")
        if name is None and not (isinstance(properties, dict) and properties):
            extra = schema.get("additionalProperties")
            if isinstance(extra, dict) and extra:
                return Sub("dict", (STR, self.type_of(extra, hint + "Value", depth + 1)))
            return DICT_ANY
        if name is None:
            if self.types.classes >= _MAX_TYPES or self.types.budget < 0:
                return DICT_ANY
            title = schema.get("title")
            base = type_name(title, hint) if isinstance(title, str) else hint
            if base in RESERVED_TYPE_NAMES:  # a title "None" or "Params": the path reads better
                base = hint
            name = self.types.allocate(base)
        return self.class_type(schema, name, depth, None)

    def class_type(
        self, schema: Mapping[str, Any], name: str, depth: int, pointer: str | None
    ) -> Name:
        """The TypedDict `name` for an object schema; defined after the types it uses."""
        if pointer is not None:
            self.ref_classes[pointer] = (name, False)
        self.types.classes += 1
        properties = schema.get("properties")
        fields = self.fields(properties if isinstance(properties, dict) else {}, schema, depth)
        description = doc_text(schema.get("description"), MAX_DESCRIPTION)
        self.types.defs.append(ClassDef(name, description, fields))
        if pointer is not None:
            self.ref_classes[pointer] = (name, True)
        return Name(name)

    def fields(
        self, properties: Mapping[Any, Any], schema: Mapping[str, Any], depth: int
    ) -> list[Field]:
        required = schema.get("required")
        required_keys = set()
        if isinstance(required, list):
            required_keys = {r for r in required if isinstance(r, str)}
        out: list[Field] = []
        for key, sub in list(properties.items())[:_MAX_PROPERTIES]:
            if not isinstance(key, str):
                continue
            t = self.type_of(sub, type_name(key, "Field"), depth + 1)
            doc_source = sub if isinstance(sub, dict) else {}
            description = doc_source.get("description")
            if description is None:
                target = self.deref(doc_source)
                description = target.get("description") if isinstance(target, dict) else None
            out.append(
                Field(
                    key,
                    t,
                    key in required_keys,
                    doc_text(description, _MAX_FIELD_DOC),
                    _default_text(doc_source),
                )
            )
        return out


def is_class_schema(schema: object) -> TypeGuard[dict[str, Any]]:
    if not isinstance(schema, dict):
        return False
    properties = schema.get("properties")
    kind = schema.get("type", "object")
    plain = not any(k in schema for k in ("anyOf", "oneOf", "allOf", "enum", "const", "$ref"))
    return plain and kind == "object" and isinstance(properties, dict) and bool(properties)


def object_root(schema: object) -> TypeGuard[dict[str, Any]]:
    """Whether a root schema becomes a TypedDict class (possibly empty)."""
    if not isinstance(schema, dict) or schema.get("type", "object") != "object":
        return False
    if any(k in schema for k in ("anyOf", "oneOf", "enum", "const")):
        return False
    properties = schema.get("properties")
    extra = schema.get("additionalProperties")
    no_properties = not (isinstance(properties, dict) and properties)
    return not (no_properties and isinstance(extra, dict) and extra)
