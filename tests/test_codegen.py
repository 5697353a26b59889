"""The `servers/` tree generator: typed tool modules from upstream MCP tool lists.

The fixtures copy the schemas of the reference servers (server-memory, server-filesystem,
server-everything), a GitHub-like create_issue and a FastMCP/pydantic-style server with
`$defs`, `anyOf` and a recursive model. The generated tree is checked with the real tools
(`ruff check`, `ruff format --check`, `mypy --strict`, once per module as subprocesses) and
imported with a stand-in `codecage.runtime`: the real one runs inside the sandbox and talks
to the broker, and what this file checks is only which (server, tool, arguments) a generated
module hands to it.
"""

from __future__ import annotations

import ast
import asyncio
import importlib
import importlib.util
import json
import random
import re
import shutil
import string
import subprocess
import sys
import time
import types
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mcp_types import Tool
from tests._codegen import deterministic_tree, reference_functions

from codecage.bridge import codegen
from codecage.bridge.codegen import (
    MARKER,
    generate,
    module_name,
    py_str,
    unique_module_names,
    write_tree,
)
from codecage.errors import ConfigError

# --- fixtures: tools modelled on the reference servers -----------------------------------

_DRAFT7 = "http://json-schema.org/draft-07/schema#"

_ENTITY = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "description": "The name of the entity"},
        "entityType": {"type": "string", "description": "The type of the entity"},
        "observations": {
            "type": "array",
            "items": {"type": "string"},
            "description": "An array of observation contents associated with the entity",
        },
    },
    "required": ["name", "entityType", "observations"],
    "additionalProperties": False,
}
_RELATION = {
    "type": "object",
    "properties": {
        "from": {
            "type": "string",
            "description": "The name of the entity where the relation starts",
        },
        "to": {"type": "string", "description": "The name of the entity where the relation ends"},
        "relationType": {"type": "string", "description": "The type of the relation"},
    },
    "required": ["from", "to", "relationType"],
    "additionalProperties": False,
}
_GRAPH = {
    "type": "object",
    "properties": {
        "entities": {"type": "array", "items": _ENTITY},
        "relations": {"type": "array", "items": _RELATION},
    },
    "required": ["entities", "relations"],
}

MEMORY = [
    Tool(
        name="create_entities",
        description="Create multiple new entities in the knowledge graph",
        inputSchema={
            "type": "object",
            "properties": {"entities": {"type": "array", "items": _ENTITY}},
            "required": ["entities"],
        },
    ),
    Tool(
        name="create_relations",
        description=(
            "Create multiple new relations between entities in the knowledge graph. "
            "Relations should be in active voice"
        ),
        inputSchema={
            "type": "object",
            "properties": {"relations": {"type": "array", "items": _RELATION}},
            "required": ["relations"],
        },
    ),
    Tool(
        name="read_graph",
        description="Read the entire knowledge graph",
        inputSchema={"type": "object", "properties": {}},
        outputSchema=_GRAPH,
    ),
    Tool(
        name="search_nodes",
        description="Search for nodes in the knowledge graph based on a query",
        inputSchema={
            "type": "object",
            "properties": {
                "query": {
                    "type": "string",
                    "description": "The search query to match against entity names, types, "
                    "and observation content",
                }
            },
            "required": ["query"],
        },
        outputSchema=_GRAPH,
    ),
]

FILESYSTEM = [
    Tool(
        name="read_text_file",
        description=(
            "Read the complete contents of a file from the file system as text. Handles various "
            "text encodings and provides detailed error messages if the file cannot be read.\n"
            "Use the 'head' parameter to read only the first N lines of a file, or the 'tail' "
            "parameter to read only the last N lines of a file. Only works within allowed "
            "directories."
        ),
        inputSchema={
            "type": "object",
            "properties": {
                "path": {"type": "string"},
                "tail": {
                    "type": "number",
                    "description": "If provided, returns only the last N lines of the file",
                },
                "head": {
                    "type": "number",
                    "description": "If provided, returns only the first N lines of the file",
                },
            },
            "required": ["path"],
            "additionalProperties": False,
            "$schema": _DRAFT7,
        },
    ),
    Tool(
        name="edit_file",
        description=(
            "Make line-based edits to a text file. Each edit replaces exact line sequences "
            "with new content. Returns a git-style diff showing the changes made. "
            "Only works within allowed directories."
        ),
        inputSchema={
            "type": "object",
            "properties": {
                "path": {"type": "string"},
                "edits": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "properties": {
                            "oldText": {
                                "type": "string",
                                "description": "Text to search for - must match exactly",
                            },
                            "newText": {"type": "string", "description": "Text to replace with"},
                        },
                        "required": ["oldText", "newText"],
                        "additionalProperties": False,
                    },
                },
                "dryRun": {
                    "type": "boolean",
                    "default": False,
                    "description": "Preview changes using git-style diff format",
                },
            },
            "required": ["path", "edits"],
            "additionalProperties": False,
            "$schema": _DRAFT7,
        },
    ),
    Tool(
        name="directory_tree",
        description=(
            "Get a recursive tree view of files and directories as a JSON structure. "
            "Each entry includes 'name', 'type' (file/directory), and 'children' for "
            "directories."
        ),
        inputSchema={
            "type": "object",
            "properties": {
                "path": {"type": "string"},
                "excludePatterns": {"type": "array", "items": {"type": "string"}, "default": []},
            },
            "required": ["path"],
            "additionalProperties": False,
            "$schema": _DRAFT7,
        },
    ),
    Tool(
        name="list_allowed_directories",
        description="Returns the list of directories that this server is allowed to access.",
        inputSchema={"type": "object", "properties": {}, "required": []},
    ),
]

EVERYTHING = [
    Tool(
        name="echo",
        description="Echoes back the input",
        inputSchema={
            "type": "object",
            "properties": {"message": {"type": "string", "description": "Message to echo"}},
            "required": ["message"],
            "additionalProperties": False,
            "$schema": _DRAFT7,
        },
    ),
    Tool(
        name="add",
        description="Adds two numbers",
        inputSchema={
            "type": "object",
            "properties": {
                "a": {"type": "number", "description": "First number"},
                "b": {"type": "number", "description": "Second number"},
            },
            "required": ["a", "b"],
        },
    ),
    Tool(
        name="longRunningOperation",
        description="Demonstrates a long running operation with progress updates",
        inputSchema={
            "type": "object",
            "properties": {
                "duration": {
                    "type": "number",
                    "default": 10,
                    "description": "Duration of the operation in seconds",
                },
                "steps": {"type": "number", "default": 5, "description": "Number of steps"},
            },
        },
    ),
    Tool(
        name="annotatedMessage",
        description="Demonstrates how annotations can be used to provide metadata about content",
        inputSchema={
            "type": "object",
            "properties": {
                "messageType": {
                    "type": "string",
                    "enum": ["error", "success", "debug"],
                    "description": "Type of message to demonstrate different annotation patterns",
                },
                "includeImage": {
                    "type": "boolean",
                    "default": False,
                    "description": "Whether to include an example image",
                },
            },
            "required": ["messageType"],
        },
    ),
    Tool(
        name="getResourceReference",
        description="Returns a resource reference that can be used by MCP clients",
        inputSchema={
            "type": "object",
            "properties": {
                "resourceId": {
                    "type": "number",
                    "minimum": 1,
                    "maximum": 100,
                    "description": "ID of the resource to reference (1-100)",
                }
            },
            "required": ["resourceId"],
        },
    ),
    Tool(
        name="getTinyImage",
        description="Returns the MCP_TINY_IMAGE",
        inputSchema={"type": "object", "properties": {}},
    ),
    Tool(
        name="structuredContent",
        description=(
            "Returns structured content along with an output schema for client data validation"
        ),
        inputSchema={
            "type": "object",
            "properties": {
                "location": {
                    "type": "string",
                    "minLength": 1,
                    "description": "City name or zip code",
                }
            },
            "required": ["location"],
        },
        outputSchema={
            "type": "object",
            "properties": {
                "temperature": {"type": "number", "description": "Temperature in celsius"},
                "conditions": {"type": "string", "description": "Weather conditions description"},
                "humidity": {"type": "number", "description": "Humidity percentage"},
            },
            "required": ["temperature", "conditions", "humidity"],
        },
    ),
]

GITHUB = [
    Tool(
        name="create_issue",
        title="Create issue",
        description="Create a new issue in a GitHub repository",
        inputSchema={
            "type": "object",
            "properties": {
                "owner": {"type": "string", "description": "Repository owner"},
                "repo": {"type": "string", "description": "Repository name"},
                "title": {"type": "string", "description": "Issue title"},
                "body": {"type": "string", "description": "Issue body content"},
                "assignees": {
                    "type": "array",
                    "items": {"type": "string"},
                    "description": "Usernames to assign to this issue",
                },
                "labels": {"type": "array", "items": {"type": "string"}},
                "milestone": {"type": "number", "description": "Milestone number"},
                "state": {"type": "string", "enum": ["open", "closed"], "default": "open"},
                "type": {"anyOf": [{"type": "string"}, {"type": "null"}]},
                "metadata": {
                    "type": "object",
                    "description": "Planning metadata",
                    "properties": {
                        "priority": {"enum": ["low", "medium", "high", "critical"]},
                        "due": {"type": "string", "format": "date"},
                        "estimate": {"type": ["integer", "null"]},
                        "links": {
                            "type": "array",
                            "items": {
                                "type": "object",
                                "properties": {
                                    "url": {"type": "string"},
                                    "kind": {"const": "related"},
                                },
                                "required": ["url"],
                            },
                        },
                    },
                    "required": ["priority"],
                },
                "extra": {"type": "object", "additionalProperties": {"type": "integer"}},
            },
            "required": ["owner", "repo", "title"],
        },
        outputSchema={
            "type": "object",
            "properties": {
                "number": {"type": "integer"},
                "html_url": {"type": "string"},
                "state": {"type": "string", "enum": ["open", "closed"]},
            },
            "required": ["number", "html_url", "state"],
        },
    ),
]

# What FastMCP writes for pydantic models: titles everywhere, $defs, anyOf-null, a cycle.
PYDANTIC = [
    Tool(
        name="post_comment",
        description="Post a comment, with replies, on a thread.",
        inputSchema={
            "type": "object",
            "title": "post_commentArguments",
            "$defs": {
                "Comment": {
                    "type": "object",
                    "title": "Comment",
                    "description": "One comment and the replies to it.",
                    "properties": {
                        "author": {"type": "string", "title": "Author"},
                        "text": {"type": "string", "title": "Text"},
                        "replies": {
                            "type": "array",
                            "items": {"$ref": "#/$defs/Comment"},
                            "title": "Replies",
                            "default": [],
                        },
                        "parent": {
                            "anyOf": [{"$ref": "#/$defs/Comment"}, {"type": "null"}],
                            "default": None,
                        },
                    },
                    "required": ["author", "text"],
                },
                "Visibility": {"type": "string", "enum": ["public", "private"]},
            },
            "properties": {
                "thread_id": {"type": "integer", "title": "Thread Id"},
                "comment": {"$ref": "#/$defs/Comment"},
                "visibility": {"$ref": "#/$defs/Visibility", "default": "public"},
                "tags": {
                    "anyOf": [{"type": "array", "items": {"type": "string"}}, {"type": "null"}],
                    "default": None,
                    "title": "Tags",
                },
            },
            "required": ["thread_id", "comment"],
        },
        outputSchema={
            "type": "object",
            "properties": {"result": {"$ref": "#/$defs/Posted"}},
            "required": ["result"],
            "$defs": {
                "Posted": {
                    "type": "object",
                    "properties": {"id": {"type": "integer"}, "url": {"type": "string"}},
                    "required": ["id"],
                }
            },
        },
    ),
]

INJECTION = '\n"""\nimport os\nos.system("echo pwned")\n"""\n'
PAYLOADS = [
    INJECTION,
    '"""',
    "'''",
    '""""""',
    '"',
    "\\",
    '\\"""',
    "x\\",
    "\x00",
    "\r\n",
    "\u2028",
    "\x0c\x0b",
    "\ud800",
    "\u202eevil",
    "\N{ZERO WIDTH SPACE}",
    "\t\tindent",
    "# comment",
    "'); import os; ('",
    '"); import os; ("',
    "{}{{}}",
    "\\N{BULLET}",
    "\\x41\\u0041",
    "\U0001f600",
    "中文",
    "ü",
    "class",
    "None",
    "__init__",
    "",
    " ",
    "a" * 300,
]

# Tool and property names that meet, shadow, or are not identifiers at all.
HOSTILE = [
    Tool(name="get-item", description="Hyphenated.", inputSchema={"type": "object"}),
    Tool(name="get_item", description="Snake.", inputSchema={"type": "object"}),
    Tool(name="getItem", description="Camel.", inputSchema={"type": "object"}),
    Tool(name="class", description=INJECTION, inputSchema={"type": "object"}),
    Tool(name="list", description='Ends with a quote"', inputSchema={"type": "object"}),
    Tool(name="3d-render", description="\\", inputSchema={"type": "object"}),
    Tool(name="", description=None, inputSchema={"type": "object"}),
    Tool(name="工具", description="\x00\x01\x1b[31m", inputSchema={"type": "object"}),
    Tool(name="x" * 300, description="y" * 100_000, inputSchema={"type": "object"}),
    Tool(name="a-tool-name-just-too-long-for-one-line-" * 2, inputSchema={"type": "object"}),
    Tool(
        name='evil"""\nimport os',
        description='"""' * 50,
        inputSchema={
            "type": "object",
            "title": '"""; import os; """',
            "properties": {
                "from": {"type": "string", "description": INJECTION},
                "x-y": {"type": "integer", "default": INJECTION},
                "": {"type": "string"},
                "__init__": {"type": "string"},
                "Any": {"type": "boolean"},
                "str": {"type": "string"},
                "params": {"type": "integer"},
                "kwargs": {"type": "integer"},
                '"""': {"type": "string", "enum": ['"""', "'''", "\\", "\x00", "\ud800"]},
                "line\nbreak": {"type": "string"},
                "nested": {
                    "type": "object",
                    "title": "None",
                    "properties": {"class": {"type": "string"}, "ok": {"type": "string"}},
                },
                "k" * 120: {"type": "array", "items": {"enum": ["v" * 90, "w" * 90]}},
            },
            "required": ["from", ""],
        },
    ),
]

FIXTURES: dict[str, list[Tool]] = {
    "memory": MEMORY,
    "file-system": FILESYSTEM,
    "everything": EVERYTHING,
    "github": GITHUB,
    "pydantic": PYDANTIC,
    "hostile!": HOSTILE,
    "class": [Tool(name="noop", inputSchema={"type": "object"})],
}

STUB_RUNTIME = '''"""Stand-in for the sandbox's codecage.runtime: the contract's signatures only."""

from collections.abc import Mapping
from typing import Any


class ToolCallError(Exception):
    """An upstream tool reported an error."""


async def call_tool(server: str, tool: str, arguments: Mapping[str, Any] | None = None) -> Any:
    raise NotImplementedError


def call_tool_sync(server: str, tool: str, arguments: Mapping[str, Any] | None = None) -> Any:
    raise NotImplementedError
'''


# --- a random schema generator, for hypothesis and for the ruff/mypy batch ---------------

_TRICKY_CHARS = "\"'\\\n\r\t\x00\x1b\x7f\x85\xa0\u2028\u202e\ud800\U0001f600中ü -_.{}#$%"


def random_text(rng: random.Random) -> str:
    choice = rng.random()
    if choice < 0.3:
        return rng.choice(PAYLOADS)
    if choice < 0.5:
        return "".join(rng.choice(string.ascii_letters) for _ in range(rng.randint(1, 12)))
    if choice < 0.6:
        return "".join(rng.choice(string.ascii_letters) for _ in range(rng.randint(60, 130)))
    pool = _TRICKY_CHARS + string.ascii_letters
    return "".join(rng.choice(pool) for _ in range(rng.randint(0, 20)))


def random_schema(rng: random.Random, depth: int = 0, defs: Sequence[str] = ()) -> Any:
    if depth > 4 or rng.random() < 0.2:
        return rng.choice(
            [
                {"type": "string"},
                {"type": "integer", "default": rng.randint(-5, 5)},
                {"type": "number"},
                {"type": "boolean"},
                {"type": "null"},
                {},
                True,
                {"type": "martian"},
                {"enum": [random_text(rng) for _ in range(rng.randint(0, 40))]},
                {"enum": [1, 2.5, None, True, "x", [1], {"a": 1}, 2**70]},
                {"const": random_text(rng)},
                {"$ref": f"#/$defs/{rng.choice(list(defs) or ['missing'])}"},
                {"$ref": "https://example.com/remote.json"},
                {"$ref": "#"},
            ]
        )
    kind = rng.choice(["object", "array", "union", "types", "allOf", "map", "nullable"])
    schema: dict[str, Any]
    if kind == "object":
        properties = {
            random_text(rng): random_schema(rng, depth + 1, defs) for _ in range(rng.randint(0, 6))
        }
        schema = {"type": "object", "properties": properties}
        keys = list(properties)
        schema["required"] = [*rng.sample(keys, rng.randint(0, len(keys))), "not-a-property"]
        if rng.random() < 0.3:
            schema["title"] = random_text(rng)
    elif kind == "array":
        schema = {"type": "array", "items": random_schema(rng, depth + 1, defs)}
    elif kind == "union":
        options = [random_schema(rng, depth + 1, defs) for _ in range(rng.randint(1, 4))]
        schema = {rng.choice(["anyOf", "oneOf"]): options}
    elif kind == "types":
        schema = {"type": rng.sample(["string", "integer", "null", "object", "array"], 3)}
    elif kind == "allOf":
        schema = {"allOf": [random_schema(rng, depth + 1, defs) for _ in range(2)]}
    elif kind == "map":
        schema = {"type": "object", "additionalProperties": random_schema(rng, depth + 1, defs)}
    else:
        schema = {"type": "string", "nullable": True, "format": "date-time"}
    if rng.random() < 0.5:
        schema["description"] = random_text(rng)
    if rng.random() < 0.2:
        schema["default"] = random_text(rng)
    return schema


def random_tool(rng: random.Random) -> Tool:
    def_names = [random_text(rng) for _ in range(rng.randint(0, 3))]
    defs: dict[str, Any] = {}
    for name in def_names:
        defs[name] = random_schema(rng, 2, def_names)
    root = random_schema(rng, 0, def_names)
    if rng.random() < 0.8:
        properties = {random_text(rng): random_schema(rng, 1, def_names) for _ in range(4)}
        root = {"type": "object", "properties": properties, "required": list(properties)[:2]}
    if isinstance(root, dict):
        root["$defs"] = defs
    output = None
    if rng.random() < 0.4:
        output = {
            "type": "object",
            "properties": {random_text(rng): random_schema(rng, 1, ()) for _ in range(3)},
        }
    return Tool(
        name=random_text(rng),
        description=rng.choice([None, random_text(rng), random_text(rng) * 50]),
        inputSchema=root if isinstance(root, dict) else {"type": "object"},
        outputSchema=output,
    )


def random_servers(rng: random.Random, n_servers: int, n_tools: int) -> dict[str, list[Tool]]:
    return {
        random_text(rng): [random_tool(rng) for _ in range(rng.randint(0, n_tools))]
        for _ in range(n_servers)
    }


# --- the structural check: hostile text never becomes code --------------------------------

_TYPE_HEADS = {"list", "dict", "Literal", "NotRequired"}
_TYPE_BUILTINS = {"str", "int", "float", "bool", "list", "dict", "Any"}


# The fixed call/call_sync/_arguments functions, unparsed, as the generator writes them.
REFERENCE_FUNCTIONS = {ast.unparse(node) for node in reference_functions()}


def _check_type(node: ast.expr, names: set[str]) -> None:
    if isinstance(node, ast.Name):
        assert node.id in names | _TYPE_BUILTINS, ast.dump(node)
    elif isinstance(node, ast.Constant):
        assert node.value is None or (
            isinstance(node.value, str) and node.value.isidentifier() and node.value in names
        ), ast.dump(node)
    elif isinstance(node, ast.BinOp):
        assert isinstance(node.op, ast.BitOr)
        _check_type(node.left, names)
        _check_type(node.right, names)
    elif isinstance(node, ast.Subscript):
        assert isinstance(node.value, ast.Name) and node.value.id in _TYPE_HEADS
        args = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
        if node.value.id == "Literal":
            for arg in args:
                value = arg.operand if isinstance(arg, ast.UnaryOp) else arg
                assert isinstance(value, ast.Constant)
                assert isinstance(value.value, str | int | bool), ast.dump(arg)
        else:
            for arg in args:
                _check_type(arg, names)
    else:
        raise AssertionError(f"not a type expression: {ast.dump(node)}")


def check_tool_module(text: str, server: str, tool: str) -> None:
    """The module has exactly the statements the generator means to write, and no others."""
    tree = ast.parse(text)
    compile(tree, "<generated>", "exec")
    first, *body = tree.body
    assert isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
    docstring = first.value.value
    assert isinstance(docstring, str)
    assert all(ch == "\n" or ch.isprintable() for ch in docstring)
    defined = {
        n.target.id if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name) else ""
        for n in body
    } | {n.name for n in body if isinstance(n, ast.ClassDef)}
    defined |= {
        t.id
        for n in body
        if isinstance(n, ast.Assign)
        for t in n.targets
        if isinstance(t, ast.Name)
    }
    constants: dict[str, object] = {}
    for node in body:
        if isinstance(node, ast.ImportFrom):
            assert node.level == 0 and node.module in ("typing", "codecage.runtime")
            assert all(a.asname is None for a in node.names)
        elif isinstance(node, ast.AnnAssign):
            assert isinstance(node.target, ast.Name) and node.value is not None
            assert isinstance(node.annotation, ast.Name)
            if node.annotation.id == "Final":
                assert node.target.id in ("SERVER", "TOOL")
                constants[node.target.id] = ast.literal_eval(node.value)
            else:
                assert node.annotation.id == "TypeAlias"
                _check_type(node.value, defined)
        elif isinstance(node, ast.ClassDef):
            assert [ast.unparse(b) for b in node.bases] == ["TypedDict"]
            assert not node.decorator_list and not node.keywords
            doc, *fields = node.body
            assert isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant)
            for f in fields:
                assert isinstance(f, ast.AnnAssign) and isinstance(f.target, ast.Name)
                assert f.value is None
                _check_type(f.annotation, defined)
        elif isinstance(node, ast.Assign):
            assert len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
            call = node.value
            assert isinstance(call, ast.Call) and ast.unparse(call.func) == "TypedDict"
            name, mapping = call.args
            assert ast.literal_eval(name) == node.targets[0].id and not call.keywords
            assert isinstance(mapping, ast.Dict)
            for key, value in zip(mapping.keys, mapping.values, strict=True):
                assert isinstance(key, ast.Constant) and isinstance(key.value, str)
                _check_type(value, defined)
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            assert ast.unparse(node) in REFERENCE_FUNCTIONS
        else:
            raise AssertionError(f"unexpected statement: {ast.unparse(node)[:200]}")
    assert constants == {"SERVER": server, "TOOL": tool}


def check_tree(files: Mapping[str, str], servers: Mapping[str, Sequence[Tool]]) -> None:
    """Every module checks out; one module per tool; indexes list what is there."""
    modules = unique_module_names(list(servers), "server")
    expected = {"__init__.py"}
    for server, module in zip(servers, modules, strict=True):
        tools = servers[server]
        names = unique_module_names([t.name for t in tools], "tool")
        expected |= {f"{module}/__init__.py"} | {f"{module}/{n}.py" for n in names}
        for tool, name in zip(tools, names, strict=True):
            check_tool_module(files[f"{module}/{name}.py"], server, tool.name)
        index = ast.parse(files[f"{module}/__init__.py"])
        kinds = [type(n).__name__ for n in index.body]
        assert kinds == ["Expr", "ImportFrom", "AnnAssign", "AnnAssign"]
        tools_dict = ast.literal_eval(index.body[3].value)  # type: ignore[attr-defined]
        assert sorted(tools_dict) == sorted(names)
        assert ast.literal_eval(index.body[2].value) == server  # type: ignore[attr-defined]
    assert set(files) == expected
    top = ast.parse(files["__init__.py"])
    assert [type(n).__name__ for n in top.body] == ["Expr", "AnnAssign"]
    assert ast.literal_eval(top.body[1].value) == dict(  # type: ignore[attr-defined]
        zip(modules, servers, strict=True)
    )


# --- generated layout and contents --------------------------------------------------------


def test_each_tool_becomes_one_module_under_its_server_with_indexes() -> None:
    files = generate({"memory": MEMORY, "file-system": FILESYSTEM})
    assert list(files) == sorted(files)
    assert set(files) == {
        "__init__.py",
        "file_system/__init__.py",
        "file_system/directory_tree.py",
        "file_system/edit_file.py",
        "file_system/list_allowed_directories.py",
        "file_system/read_text_file.py",
        "memory/__init__.py",
        "memory/create_entities.py",
        "memory/create_relations.py",
        "memory/read_graph.py",
        "memory/search_nodes.py",
    }


def test_every_fixture_module_has_only_the_expected_statements() -> None:
    check_tree(generate(FIXTURES), FIXTURES)


def test_create_entities_reads_like_a_small_typed_client() -> None:
    text = generate({"memory": MEMORY})["memory/create_entities.py"]
    assert text.startswith('"""Create multiple new entities in the knowledge graph\n')
    assert 'SERVER: Final = "memory"\nTOOL: Final = "create_entities"\n' in text
    assert "class EntitiesItem(TypedDict):" in text
    assert "    name: str\n    entityType: str\n    observations: list[str]\n" in text
    assert "class Params(TypedDict):" in text
    assert "    entities: list[EntitiesItem]\n" in text
    assert "Result: TypeAlias = Any\n" in text
    assert "async def call(params: Params | None = None, /, **kwargs: Any) -> Result:" in text
    assert "def call_sync(**kwargs: Unpack[Params]) -> Result: ..." in text
    assert "    entities: list[EntitiesItem] (required)\n" in text  # the Parameters section


def test_the_module_docstring_documents_types_requiredness_defaults_and_descriptions() -> None:
    doc = ast.get_docstring(ast.parse(generate({"fs": FILESYSTEM})["fs/edit_file.py"]))
    assert doc is not None
    summary, blank, *_ = doc.split("\n")
    assert summary.startswith("Make line-based edits to a text file.") and blank == ""
    assert "Parameters:\n    path: str (required)\n" in doc
    assert "    edits: list[EditsItem] (required)\n" in doc
    assert (
        "    dryRun: bool (optional, default: false)\n"
        "        Preview changes using git-style diff format\n" in doc
    )
    assert "Returns:\n    The tool's structured content (a dict) if it sends one" in doc
    item = ast.get_docstring(
        next(
            n
            for n in ast.parse(generate({"fs": FILESYSTEM})["fs/edit_file.py"]).body
            if isinstance(n, ast.ClassDef) and n.name == "EditsItem"
        )
    )
    assert item is not None and "oldText: str (required)\n        Text to search for" in item


def test_an_output_schema_gives_a_typed_result_and_a_cast() -> None:
    text = generate({"everything": EVERYTHING})["everything/structured_content.py"]
    assert "class Result(TypedDict):" in text
    assert "    temperature: float\n    conditions: str\n    humidity: float\n" in text
    assert "return cast(Result, await call_tool(SERVER, TOOL, arguments))" in text
    plain = generate({"everything": EVERYTHING})["everything/echo.py"]
    assert "return await call_tool(SERVER, TOOL, arguments)" in plain and "cast" not in plain


def _params_fields(text: str, class_name: str = "Params") -> dict[str, str]:
    """Field name -> annotation source of a TypedDict in a generated module (either syntax)."""
    for node in ast.parse(text).body:
        if isinstance(node, ast.ClassDef) and node.name == class_name:
            return {
                f.target.id: ast.unparse(f.annotation)
                for f in node.body
                if isinstance(f, ast.AnnAssign) and isinstance(f.target, ast.Name)
            }
        if (
            isinstance(node, ast.Assign)
            and ast.unparse(node.targets[0]) == class_name
            and isinstance(node.value, ast.Call)
            and isinstance(node.value.args[1], ast.Dict)
        ):
            mapping = node.value.args[1]
            return {
                ast.literal_eval(k): ast.unparse(v)  # type: ignore[arg-type]
                for k, v in zip(mapping.keys, mapping.values, strict=True)
            }
    raise AssertionError(f"no {class_name} in module")


def _aliases(text: str) -> dict[str, str]:
    return {
        n.target.id: ast.unparse(n.value)
        for n in ast.parse(text).body
        if isinstance(n, ast.AnnAssign)
        and isinstance(n.target, ast.Name)
        and ast.unparse(n.annotation) == "TypeAlias"
        and n.value is not None
    }


def test_github_create_issue_types_enums_unions_nested_objects_and_maps() -> None:
    text = generate({"github": GITHUB})["github/create_issue.py"]
    fields = _params_fields(text)
    assert fields == {
        "owner": "str",
        "repo": "str",
        "title": "str",
        "body": "NotRequired[str]",
        "assignees": "NotRequired[list[str]]",
        "labels": "NotRequired[list[str]]",
        "milestone": "NotRequired[float]",
        "state": "NotRequired[Literal['open', 'closed']]",
        "type": "NotRequired[str | None]",
        "metadata": "NotRequired[Metadata]",
        "extra": "NotRequired[dict[str, int]]",
    }
    assert _params_fields(text, "Metadata") == {
        "priority": "Literal['low', 'medium', 'high', 'critical']",
        "due": "NotRequired[str]",
        "estimate": "NotRequired[int | None]",
        "links": "NotRequired[list[LinksItem]]",
    }
    assert _params_fields(text, "LinksItem") == {
        "url": "str",
        "kind": "NotRequired[Literal['related']]",
    }
    assert _params_fields(text, "Result")["state"] == "Literal['open', 'closed']"


def test_pydantic_defs_refs_nullable_and_a_recursive_model() -> None:
    text = generate({"p": PYDANTIC})["p/post_comment.py"]
    assert _params_fields(text) == {
        "thread_id": "int",
        "comment": "Comment",
        "visibility": "NotRequired[Literal['public', 'private']]",
        "tags": "NotRequired[list[str] | None]",
    }
    # The cycle: a forward reference where the runtime allows one, a dict inside a union.
    assert _params_fields(text, "Comment") == {
        "author": "str",
        "text": "str",
        "replies": "NotRequired[list['Comment']]",
        "parent": "NotRequired[dict[str, Any] | None]",
    }
    assert "One comment and the replies to it." in text
    assert _params_fields(text, "Result") == {"result": "Posted"}
    assert _params_fields(text, "Posted") == {"id": "int", "url": "NotRequired[str]"}
    assert '(optional, default: \\"public\\")' in text or '(optional, default: "public")' in text


@pytest.mark.parametrize(
    ("schema", "expected"),
    [
        ({"type": "string"}, "str"),
        ({"type": "integer"}, "int"),
        ({"type": "number"}, "float"),
        ({"type": "boolean"}, "bool"),
        ({"type": "null"}, "None"),
        ({"type": ["string", "null"]}, "str | None"),
        ({"type": ["null", "integer", "integer"]}, "int | None"),
        ({"type": "string", "nullable": True}, "str | None"),
        ({"enum": ["a", 1, True, None]}, "Literal['a', 1, True] | None"),
        ({"enum": [1.5, "x"]}, "float | str"),
        ({"enum": [2**80]}, "int"),
        ({"enum": []}, "Any"),
        ({"const": "fixed"}, "Literal['fixed']"),
        ({"const": -3}, "Literal[-3]"),
        (
            {"anyOf": [{"enum": ["a"]}, {"enum": ["b"]}, {"type": "null"}]},
            "Literal['a', 'b'] | None",
        ),
        (
            {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "integer"}}]},
            "str | list[int]",
        ),
        ({"anyOf": [{"type": "string"}, {}]}, "Any"),
        ({"anyOf": [{"required": ["a"]}], "type": "string"}, "str"),
        ({"type": "array"}, "list[Any]"),
        ({"type": "array", "items": [{"type": "string"}]}, "list[Any]"),
        (
            {"type": "array", "items": {"type": "array", "items": {"type": "number"}}},
            "list[list[float]]",
        ),
        ({"type": "object"}, "dict[str, Any]"),
        ({"type": "object", "additionalProperties": {"type": "boolean"}}, "dict[str, bool]"),
        ({"additionalProperties": {"type": "string"}}, "dict[str, str]"),
        ({"type": "object", "patternProperties": {"^x": {"type": "string"}}}, "dict[str, Any]"),
        ({"allOf": [{"type": "string"}]}, "str"),
        ({"$ref": "#/$defs/Missing"}, "Any"),
        ({"$ref": "http://example.com/schema.json"}, "Any"),
        ({"$ref": "#/properties/other"}, "int"),
        ({"$ref": "#/$defs/Loop"}, "Any"),
        ({"type": "martian"}, "Any"),
        ({"description": "no type at all"}, "Any"),
        (True, "Any"),
        ("not a schema", "Any"),
    ],
)
def test_schema_types_become_python_types(schema: Any, expected: str) -> None:
    tool = Tool(
        name="t",
        inputSchema={
            "type": "object",
            "properties": {"field": schema, "other": {"type": "integer"}},
            "required": ["field"],
            "$defs": {"Loop": {"$ref": "#/$defs/Loop2"}, "Loop2": {"$ref": "#/$defs/Loop"}},
        },
    )
    text = generate({"s": [tool]})["s/t.py"]
    fields = _params_fields(text)
    aliases = _aliases(text)
    # A hoisted alias stands for its definition: compare the definition.
    got = aliases.get(fields["field"], fields["field"])
    assert ast.dump(ast.parse(got, mode="eval")) == ast.dump(ast.parse(expected, mode="eval"))


def test_allof_objects_merge_and_nested_objects_get_distinct_names() -> None:
    tool = Tool(
        name="t",
        inputSchema={
            "type": "object",
            "properties": {
                "a": {
                    "type": "object",
                    "properties": {
                        "item": {"type": "object", "properties": {"x": {"type": "integer"}}}
                    },
                },
                "b": {
                    "type": "object",
                    "properties": {
                        "item": {"type": "object", "properties": {"y": {"type": "integer"}}}
                    },
                },
                "c": {
                    "allOf": [
                        {
                            "type": "object",
                            "properties": {"p": {"type": "string"}},
                            "required": ["p"],
                        },
                        {"type": "object", "properties": {"q": {"type": "integer"}}},
                    ]
                },
            },
        },
    )
    text = generate({"s": [tool]})["s/t.py"]
    assert _params_fields(text) == {
        "a": "NotRequired[A]",
        "b": "NotRequired[B]",
        "c": "NotRequired[C]",
    }
    assert _params_fields(text, "A") == {"item": "NotRequired[Item]"}
    assert _params_fields(text, "B") == {"item": "NotRequired[Item2]"}
    assert _params_fields(text, "Item2") == {"y": "NotRequired[int]"}
    assert _params_fields(text, "C") == {"p": "str", "q": "NotRequired[int]"}


def test_a_non_object_input_schema_gives_a_dict_params() -> None:
    text = generate({"s": [Tool(name="t", inputSchema={"type": "string"})]})["s/t.py"]
    assert "Params: TypeAlias = dict[str, Any]" in text
    assert "def call_sync(**kwargs: Any) -> Result: ..." in text


def test_keys_that_are_not_plain_identifiers_use_the_functional_syntax_unrenamed() -> None:
    files = generate({"h": HOSTILE})
    name = unique_module_names([t.name for t in HOSTILE], "tool")[-1]
    text = files[f"h/{name}.py"]
    fields = _params_fields(text)
    assert list(fields) == [
        "from", "x-y", "", "__init__", "Any", "str", "params", "kwargs", '"""', "line\nbreak",
        "nested", "k" * 120,
    ]  # fmt: skip
    assert "Params = TypedDict(" in text
    assert fields["from"] == "str" and fields[""] == "str"
    assert fields["x-y"] == "NotRequired[int]"
    # A title that is a keyword is not a class name; a keyword key keeps the functional form.
    assert fields["nested"] == "NotRequired[NoneType]" or fields["nested"].startswith(
        "NotRequired["
    )
    assert "class None" not in text


# --- names ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("create_entities", "create_entities"),
        ("get-item", "get_item"),
        ("getItem", "get_item"),
        ("HTTPServer", "http_server"),
        ("read.text file", "read_text_file"),
        ("class", "class_"),
        ("list", "list_"),
        ("type", "type_"),
        ("3d-render", "tool_3d_render"),
        ("", "tool"),
        ("___", "tool"),
        ("工具", "tool"),
        ("Ünïcödé", "unicode"),
        ("ﬁle", "file"),
        ("x" * 300, "x" * 48),
    ],
)
def test_tool_names_become_snake_case_module_names(name: str, expected: str) -> None:
    assert module_name(name, "tool") == expected


def test_names_that_meet_get_deterministic_suffixes_and_the_exact_one_keeps_its_name() -> None:
    names = ["getItem", "get-item", "get_item", "get_item_2", "GET ITEM"]
    # get_item and get_item_2 are exact; then by code point: "GET ITEM" < "get-item" < "getItem".
    assert unique_module_names(names, "tool") == [
        "get_item_5",
        "get_item_4",
        "get_item",
        "get_item_2",
        "get_item_3",
    ]
    shuffled = list(reversed(names))
    mapping = dict(zip(shuffled, unique_module_names(shuffled, "tool"), strict=True))
    assert mapping == dict(zip(names, unique_module_names(names, "tool"), strict=True))


@given(st.lists(st.text(max_size=20), max_size=12))
def test_module_names_are_unique_lowercase_identifiers_for_any_names(names: list[str]) -> None:
    modules = unique_module_names(names, "tool")
    assert len(set(modules)) == len(names)
    for m in modules:
        assert m.isidentifier() and m.isascii() and m == m.lower()
        assert not m.startswith("_") and m not in ("class", "list", "import")
        assert codegen.write._GENERATED_PATH.fullmatch(f"{m}/{m}.py")


@given(st.text())
def test_py_str_round_trips_any_text_as_ascii_source(text: str) -> None:
    literal = py_str(text)
    assert literal.isascii() and literal.isprintable()
    assert ast.literal_eval(literal) == text


@pytest.mark.parametrize("text", PAYLOADS)
def test_py_str_round_trips_each_payload(text: str) -> None:
    assert ast.literal_eval(py_str(text)) == text
    assert "\n" not in py_str(text)


# --- hostile text ----------------------------------------------------------------------------


def test_a_docstring_injection_stays_inside_the_docstring() -> None:
    tool = Tool(name="t", description=INJECTION, inputSchema={"type": "object"})
    text = generate({"s": [tool]})["s/t.py"]
    check_tool_module(text, "s", "t")
    doc = ast.get_docstring(ast.parse(text))
    assert doc is not None and 'os.system("echo pwned")' in doc


def test_the_structural_check_catches_a_broken_docstring_escape(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The check must be able to fail: without escaping, the payload becomes code."""
    monkeypatch.setattr(codegen.text, "_escape_doc", lambda text: text)
    tool = Tool(name="t", description=INJECTION, inputSchema={"type": "object"})
    text = generate({"s": [tool]})["s/t.py"]
    with pytest.raises((AssertionError, SyntaxError)):
        check_tool_module(text, "s", "t")


def test_the_structural_check_catches_a_broken_string_literal(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(codegen.layout, "py_str", lambda text: f'"{text}"')
    tool = Tool(name='x"; import os; "', inputSchema={"type": "object"})
    text = generate({"s": [tool]})["s/x_import_os.py"]
    with pytest.raises((AssertionError, SyntaxError)):
        check_tool_module(text, "s", tool.name)


def test_hostile_names_and_descriptions_give_checked_modules() -> None:
    servers = {p: HOSTILE[:3] for p in PAYLOADS[:6]} | {"h": HOSTILE}
    check_tree(generate(servers), servers)


def test_very_long_text_is_bounded() -> None:
    tool = Tool(
        name="t",
        description="word " * 200_000,
        inputSchema={
            "type": "object",
            "properties": {
                f"p{i}": {"type": "string", "description": "d" * 100_000} for i in range(300)
            },
        },
    )
    started = time.monotonic()
    text = generate({"s": [tool]})["s/t.py"]
    assert time.monotonic() - started < 5
    assert len(text) < 400_000
    assert len(_params_fields(text)) == codegen.schema._MAX_PROPERTIES


def test_deep_wide_and_self_referencing_schemas_finish_quickly() -> None:
    deep: dict[str, Any] = {"type": "string"}
    for _ in range(200):
        deep = {"type": "object", "properties": {"a": deep, "b": {"type": "array", "items": deep}}}
    fan = {
        f"D{i}": {"anyOf": [{"$ref": f"#/$defs/D{i + 1}"} for _ in range(20)]} for i in range(30)
    }
    tools = [
        Tool(name="deep", inputSchema=deep),
        Tool(
            name="fan",
            inputSchema={
                "type": "object",
                "properties": {"x": {"$ref": "#/$defs/D0"}},
                "$defs": fan,
            },
        ),
        Tool(name="self", inputSchema={"type": "object", "properties": {"me": {"$ref": "#"}}}),
    ]
    started = time.monotonic()
    files = generate({"s": tools})
    assert time.monotonic() - started < 10
    check_tree(files, {"s": tools})
    assert _params_fields(files["s/self.py"]) == {"me": "NotRequired['Params']"}


# Hypothesis strategies: JSON Schemas from all the keywords the generator reads, with
# hostile text wherever a server can put text (names, keys, titles, descriptions, values).
_DEF_NAMES = ["A", "b c", '"""', "Node"]
hostile_text = st.one_of(
    st.sampled_from(PAYLOADS),
    st.text(max_size=24),
    st.text(alphabet=_TRICKY_CHARS, max_size=24),
)
json_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), hostile_text
)
leaf_schemas = st.one_of(
    st.sampled_from(
        [{"type": t} for t in ("string", "integer", "number", "boolean", "null", "martian")]
        + [{}, True, False, {"$ref": "#"}, {"$ref": "#/$defs/missing"}, {"$ref": "http://x"}]
        + [{"$ref": f"#/$defs/{name}"} for name in _DEF_NAMES]
        + [{"type": "string", "nullable": True}, {"type": "array"}, {"items": {}}]
    ),
    st.builds(lambda v: {"enum": v}, st.lists(json_scalars, max_size=6)),
    st.builds(lambda v: {"const": v}, json_scalars),
)


def _with_text(schema: Any, description: str | None, title: str | None, default: Any) -> Any:
    if not isinstance(schema, dict):
        return schema
    extra = {"description": description, "title": title, "default": default}
    return schema | {k: v for k, v in extra.items() if v is not None}


def _compound(children: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    objects = st.builds(
        lambda props, required: {"type": "object", "properties": props, "required": required},
        st.dictionaries(hostile_text, children, max_size=5),
        st.lists(hostile_text, max_size=3),
    )
    structured = st.one_of(
        objects,
        st.builds(lambda items: {"type": "array", "items": items}, children),
        st.builds(
            lambda options, key: {key: options},
            st.lists(children, min_size=1, max_size=4),
            st.sampled_from(["anyOf", "oneOf", "allOf"]),
        ),
        st.builds(lambda v: {"type": "object", "additionalProperties": v}, children),
        st.builds(
            lambda kinds: {"type": kinds},
            st.lists(st.sampled_from(["string", "integer", "null", "object", "array"])),
        ),
    )
    return st.builds(
        _with_text,
        structured,
        st.none() | hostile_text,
        st.none() | hostile_text,
        st.none() | json_scalars,
    )


schemas = st.recursive(leaf_schemas, _compound, max_leaves=12)
tools = st.builds(
    lambda name, description, props, required, defs, output: Tool(
        name=name,
        description=description,
        inputSchema={"type": "object", "properties": props, "required": required, "$defs": defs},
        outputSchema=output,
    ),
    hostile_text,
    st.none() | hostile_text,
    st.dictionaries(hostile_text, schemas, max_size=5),
    st.lists(hostile_text, max_size=3),
    st.dictionaries(st.sampled_from(_DEF_NAMES), schemas, max_size=3),
    st.none() | schemas.filter(lambda s: isinstance(s, dict)),
)
servers_strategy = st.dictionaries(
    hostile_text, st.lists(tools, max_size=3), min_size=1, max_size=3
)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(servers_strategy)
def test_random_schemas_and_hostile_text_give_deterministic_checked_trees(
    servers: dict[str, list[Tool]],
) -> None:
    deterministic_tree(servers, check_tree)


# --- ruff and mypy on the generated tree (once per module: they are slow) -------------------


@dataclass
class GeneratedTree:
    root: Path  # holds `servers/` and `stubs/codecage/runtime.py`
    files: dict[str, str]


@pytest.fixture(scope="module")
def generated_tree(tmp_path_factory: pytest.TempPathFactory) -> GeneratedTree:
    root = tmp_path_factory.mktemp("codegen")
    servers: dict[str, list[Tool]] = dict(FIXTURES)
    rng = random.Random(20250601)
    for i, (name, tools) in enumerate(random_servers(rng, 20, 5).items()):
        servers[f"random{i}-{name}"] = tools
    files = generate(servers)
    write_tree(files, root / "servers")
    stub = root / "stubs" / "codecage"
    stub.mkdir(parents=True)
    (stub / "__init__.py").write_text("", encoding="utf-8")
    (stub / "py.typed").write_text("", encoding="utf-8")
    (stub / "runtime.py").write_text(STUB_RUNTIME, encoding="utf-8")
    return GeneratedTree(root, files)


def _run(
    argv: list[str], cwd: Path, env: Mapping[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        argv,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env=dict(env or {}) or None,
    )


def test_generated_tree_passes_ruff_check(generated_tree: GeneratedTree) -> None:
    proc = _run(
        [sys.executable, "-m", "ruff", "check", "--isolated", "--no-cache", "servers"],
        generated_tree.root,
    )
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-2000:]


def test_generated_tree_is_already_ruff_formatted(generated_tree: GeneratedTree) -> None:
    proc = _run(
        [sys.executable, "-m", "ruff", "format", "--isolated", "--no-cache", "--diff", "servers"],
        generated_tree.root,
    )
    assert proc.returncode == 0, proc.stdout[-8000:] + proc.stderr[-2000:]


# The shapes of text the layout writes where a line would be too long; the ruff test above
# proves something only if the tree holds each of them.
LAYOUT_FORMS = {
    "union in parentheses": r": TypeAlias = \(\n    \S[^\n]*\n\)",
    "union one member a line": r"^    \| ",
    "functional field split": r": NotRequired\[$",
    "long string in parentheses": r"Final = \($",
    "exploded Literal": r"TypeAlias = Literal\[$",
    "exploded import": r"^from typing import \($",
    "functional TypedDict": r"= TypedDict\($",
    "forward reference": r"\[\"[A-Z][A-Za-z0-9]*\"\]",
}


def test_the_checked_tree_holds_every_layout_form(generated_tree: GeneratedTree) -> None:
    text = "\n".join(generated_tree.files.values())
    missing = [k for k, pattern in LAYOUT_FORMS.items() if not re.search(pattern, text, re.M)]
    assert not missing


def test_every_module_of_the_checked_tree_imports(generated_tree: GeneratedTree) -> None:
    """In a child process, over the stub runtime: what mypy cannot see, like `"A" | None`."""
    code = (
        "import importlib, pkgutil, servers\n"
        "for m in pkgutil.walk_packages(servers.__path__, 'servers.'):\n"
        "    importlib.import_module(m.name)\n"
    )
    root = generated_tree.root
    env = {"PYTHONPATH": f"{root}:{root / 'stubs'}", "PATH": "/usr/bin:/bin"}
    proc = _run([sys.executable, "-c", code], root, env)
    assert proc.returncode == 0, proc.stderr[-4000:]


USAGE = """
import asyncio
from typing import assert_type

from servers.everything import structured_content
from servers.file_system import edit_file, read_text_file
from servers.github import create_issue
from servers.memory import create_entities, read_graph


async def main() -> None:
    await create_entities.call(
        create_entities.Params(
            entities=[create_entities.EntitiesItem(name="a", entityType="b", observations=[])]
        )
    )
    await create_entities.call(entities=[{"name": "a", "entityType": "b", "observations": []}])
    graph = await read_graph.call()
    assert_type(graph["entities"][0]["name"], str)
    weather = structured_content.call_sync(location="Paris")
    assert_type(weather["temperature"], float)
    edit_file.call_sync({"path": "/x", "edits": [{"oldText": "a", "newText": "b"}]})
    read_text_file.call_sync(read_text_file.Params(path="/x", head=3))
    issue = create_issue.call_sync(owner="o", repo="r", title="t", state="closed")
    assert_type(issue["number"], int)


asyncio.run(main())
"""

MISUSE = """
from servers.file_system import read_text_file
from servers.github import create_issue
from servers.memory import create_entities

create_issue.call_sync(owner="o", repo="r", title="t", state="reopened")
create_issue.call_sync(owner="o", repo="r")
read_text_file.call_sync(read_text_file.Params(path=3))
create_entities.call_sync(entities=[{"name": "a"}])
"""


def test_generated_tree_passes_mypy_strict_and_types_its_callers(
    generated_tree: GeneratedTree,
) -> None:
    root = generated_tree.root
    (root / "usage.py").write_text(USAGE, encoding="utf-8")
    (root / "misuse.py").write_text(MISUSE, encoding="utf-8")
    (root / "mypy.ini").write_text("[mypy]\n", encoding="utf-8")
    env = {"MYPYPATH": str(root / "stubs"), "PATH": "/usr/bin:/bin"}
    base = [sys.executable, "-m", "mypy", "--config-file", "mypy.ini", "--strict"]
    base += ["--no-site-packages", "--cache-dir", str(root / ".mypy_cache")]
    proc = _run([*base, "servers", "usage.py"], root, env)
    assert proc.returncode == 0, proc.stdout[-8000:] + proc.stderr[-2000:]
    bad = _run([*base, "misuse.py"], root, env)
    errors = [line for line in bad.stdout.splitlines() if ": error:" in line]
    assert sorted({int(line.split(":")[1]) for line in errors}) == [6, 7, 8, 9], bad.stdout


# --- importing and calling a generated module -----------------------------------------------


@dataclass
class Calls:
    sent: list[tuple[str, str, Any]]
    result: Any = None


@pytest.fixture
def servers_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Calls]:
    """The fixture tree, importable as `servers`, over a recording stand-in runtime."""
    write_tree(generate(FIXTURES), tmp_path / "servers")
    calls = Calls([])
    runtime = types.ModuleType("codecage.runtime")

    def call_tool_sync(server: str, tool: str, arguments: Mapping[str, Any] | None = None) -> Any:
        calls.sent.append((server, tool, json.loads(json.dumps(arguments))))
        return calls.result

    async def call_tool(server: str, tool: str, arguments: Mapping[str, Any] | None = None) -> Any:
        return call_tool_sync(server, tool, arguments)

    runtime.call_tool = call_tool  # type: ignore[attr-defined]
    runtime.call_tool_sync = call_tool_sync  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "codecage.runtime", runtime)
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    yield calls
    for name in [m for m in sys.modules if m == "servers" or m.startswith("servers.")]:
        del sys.modules[name]


def test_call_sync_sends_server_tool_and_only_the_fields_that_were_set(
    servers_package: Calls,
) -> None:
    edit_file = importlib.import_module("servers.file_system.edit_file")
    servers_package.result = "diff"
    out = edit_file.call_sync(
        edit_file.Params(path="/w/a.txt", edits=[edit_file.EditsItem(oldText="a", newText="b")])
    )
    assert out == "diff"
    assert servers_package.sent == [
        (
            "file-system",
            "edit_file",
            {"path": "/w/a.txt", "edits": [{"oldText": "a", "newText": "b"}]},
        )
    ]


def test_keywords_a_dict_and_no_arguments_all_work_and_both_at_once_is_refused(
    servers_package: Calls,
) -> None:
    issue = importlib.import_module("servers.github.create_issue")
    graph = importlib.import_module("servers.memory.read_graph")
    issue.call_sync(owner="o", repo="r", title="t", metadata={"priority": "high"})
    issue.call_sync({"owner": "o", "repo": "r", "title": "t"})
    graph.call_sync()
    assert servers_package.sent == [
        (
            "github",
            "create_issue",
            {"owner": "o", "repo": "r", "title": "t", "metadata": {"priority": "high"}},
        ),
        ("github", "create_issue", {"owner": "o", "repo": "r", "title": "t"}),
        ("memory", "read_graph", {}),
    ]
    with pytest.raises(TypeError, match="not both"):
        issue.call_sync({"owner": "o"}, repo="r")


def test_async_call_awaits_the_runtime_and_returns_its_result(servers_package: Calls) -> None:
    weather = importlib.import_module("servers.everything.structured_content")
    servers_package.result = {"temperature": 21.5, "conditions": "sunny", "humidity": 40}
    result = asyncio.run(weather.call(weather.Params(location="Paris")))
    assert result == servers_package.result
    assert servers_package.sent == [("everything", "structuredContent", {"location": "Paris"})]


def test_keys_that_are_keywords_or_punctuation_go_on_the_wire_as_written(
    servers_package: Calls,
) -> None:
    relations = importlib.import_module("servers.memory.create_relations")
    item = relations.RelationsItem(**{"from": "a", "to": "b", "relationType": "knows"})
    relations.call_sync(relations.Params(relations=[item]))
    assert servers_package.sent[-1][2] == {
        "relations": [{"from": "a", "to": "b", "relationType": "knows"}]
    }


def test_every_fixture_module_imports_and_its_indexes_match(servers_package: Calls) -> None:
    top = importlib.import_module("servers")
    for module, server in top.SERVERS.items():
        package = importlib.import_module(f"servers.{module}")
        assert server == package.SERVER
        for tool_module in package.TOOLS:
            mod = importlib.import_module(f"servers.{module}.{tool_module}")
            assert server == mod.SERVER
            assert callable(mod.call) and callable(mod.call_sync)


# --- write_tree -----------------------------------------------------------------------------


def test_write_tree_is_idempotent(tmp_path: Path) -> None:
    out = tmp_path / "servers"
    files = generate({"memory": MEMORY})
    written = write_tree(files, out)
    assert sorted(p.relative_to(out).as_posix() for p in written) == sorted(files)
    mtimes = {p: p.stat().st_mtime_ns for p in written}
    assert write_tree(files, out) == []
    assert {p: p.stat().st_mtime_ns for p in written} == mtimes
    assert json.loads((out / MARKER).read_text())["files"] == sorted(files)
    assert {p.relative_to(out).as_posix() for p in out.rglob("*.py")} == set(files)


def test_write_tree_removes_stale_tools_and_servers_and_nothing_else(tmp_path: Path) -> None:
    out = tmp_path / "servers"
    write_tree(generate({"memory": MEMORY, "github": GITHUB}), out)
    (out / "memory" / "notes.txt").write_text("mine", encoding="utf-8")
    (out / "memory" / "mine.py").write_text("# mine", encoding="utf-8")
    write_tree(generate({"memory": MEMORY[:2]}), out)
    assert not (out / "memory" / "read_graph.py").exists()
    assert not (out / "memory" / "search_nodes.py").exists()
    assert (out / "memory" / "create_entities.py").exists()
    assert not (out / "github").exists()
    assert (out / "memory" / "notes.txt").read_text() == "mine"
    assert (out / "memory" / "mine.py").read_text() == "# mine"
    assert "github" not in (out / "__init__.py").read_text()


def test_write_tree_leaves_bytecode_for_the_read_only_mount_and_removes_the_stale(
    tmp_path: Path,
) -> None:
    out = tmp_path / "servers"
    files = generate({"memory": MEMORY})
    write_tree(files, out)
    for rel in files:
        cached = Path(importlib.util.cache_from_source(str(out / rel)))
        assert cached.is_file(), rel
    gone = Path(importlib.util.cache_from_source(str(out / "memory" / "read_graph.py")))
    write_tree(generate({"memory": [t for t in MEMORY if t.name != "read_graph"]}), out)
    assert not gone.exists()


def test_write_tree_refuses_a_directory_it_did_not_write(tmp_path: Path) -> None:
    out = tmp_path / "servers"
    out.mkdir()
    (out / "precious.py").write_text("x = 1", encoding="utf-8")
    with pytest.raises(ConfigError, match="not written by codecage"):
        write_tree(generate({"memory": MEMORY}), out)
    assert [p.name for p in out.iterdir()] == ["precious.py"]


def test_write_tree_refuses_paths_it_would_not_generate(tmp_path: Path) -> None:
    for bad in ["../escape.py", "/abs.py", "a/b/c.py", "x.sh", "Upper.py"]:
        with pytest.raises(ConfigError):
            write_tree({bad: "x = 1\n"}, tmp_path / "servers")
    assert not (tmp_path / "escape.py").exists()


def test_write_tree_never_follows_a_symlink_out_of_the_tree(tmp_path: Path) -> None:
    out = tmp_path / "servers"
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "create_entities.py").write_text("keep", encoding="utf-8")
    write_tree(generate({"memory": MEMORY}), out)
    # A server directory swapped for a symlink is refused, not written through.
    shutil.rmtree(out / "memory")
    (out / "memory").symlink_to(outside)
    with pytest.raises(ConfigError, match="symlink"):
        write_tree(generate({"memory": MEMORY}), out)
    assert (outside / "create_entities.py").read_text() == "keep"
    # A file swapped for a symlink is replaced by the file, the target is untouched.
    (out / "memory").unlink()
    write_tree(generate({"memory": MEMORY}), out)
    target = out / "memory" / "read_graph.py"
    target.unlink()
    target.symlink_to(outside / "create_entities.py")
    write_tree(generate({"memory": MEMORY}), out)
    assert not target.is_symlink()
    assert (outside / "create_entities.py").read_text() == "keep"
    # Nor is a __pycache__ swapped for a symlink written through.
    shutil.rmtree(out / "memory" / "__pycache__")
    (out / "memory" / "__pycache__").symlink_to(outside)
    (out / "memory" / "read_graph.py").unlink()  # so that its bytecode is due again
    write_tree(generate({"memory": MEMORY}), out)
    assert sorted(p.name for p in outside.iterdir()) == ["create_entities.py"]


def test_a_tampered_marker_cannot_make_write_tree_delete_outside_the_tree(tmp_path: Path) -> None:
    out = tmp_path / "servers"
    victim = tmp_path / "victim.py"
    victim.write_text("keep", encoding="utf-8")
    write_tree(generate({"memory": MEMORY}), out)
    listed = json.loads((out / MARKER).read_text())["files"]
    listed += ["../victim.py", str(victim), "memory/../../victim.py", "memory/../../victim"]
    (out / MARKER).write_text(json.dumps({"files": listed}), encoding="utf-8")
    write_tree(generate({"github": GITHUB}), out)
    assert victim.read_text() == "keep"
    assert not (out / "memory").exists()
    assert (out / "github" / "create_issue.py").exists()
