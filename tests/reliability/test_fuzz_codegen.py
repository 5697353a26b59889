"""Fuzzing `codecage gen`: hostile upstream tool lists fed to the real generator.

Upstream MCP servers are untrusted: their tool names, descriptions, titles, defaults, enums
and whole schemas end up in Python modules that agent code imports. The requirements
(issue 25), each stated here on its own, not by the generator's code:

- `generate()` accepts any tool list and is deterministic: the same input gives
  byte-identical files, in this process and in a fresh one with another PYTHONHASHSEED,
  whatever the order of servers and tools;
- it is bounded in time, memory and output size (thousands of tools, schemas 1,000 deep,
  megabytes of text): the big cases print what they measured, and assert only generous
  bounds;
- it writes only inside its output directory (a tool name is never a path);
- no schema text becomes code: every token of a generated module outside its string
  literals is the generator's own vocabulary, a sanitised PascalCase type name, or an
  integer inside `Literal[...]`; the modules compile, pass `ruff check`, and importing
  them does nothing but define things (an audit hook in a child process sees no file
  opened, no process, no socket; a sentinel file the payloads try to create never is).

The strategies put hostile text everywhere a server can put text, and give every keyword the
generator reads both well-typed and wrongly typed values. A few cases go through the real
`codecage gen` command, against a real (hand-written, raw JSON-RPC) stdio MCP server that
lists exactly the tools given to it.
"""

from __future__ import annotations

import ast
import hashlib
import io
import json
import keyword
import os
import re
import subprocess
import sys
import tempfile
import time
import tokenize
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mcp_types import Tool
from tests._cli import CODECAGE
from tests._codegen import deterministic_tree, reference_functions

from codecage.bridge.codegen import MAX_TOOLS_PER_SERVER, generate, write_tree

# --- hostile text ------------------------------------------------------------------------

SENTINEL = "codecage_fuzz_sentinel"
# Each tries to leave a string literal or a docstring and run code that creates SENTINEL.
PAYLOADS = [
    f'"""\nopen("{SENTINEL}", "w")\n"""',
    f"'''\nopen('{SENTINEL}', 'w')\n'''",
    f'"; open("{SENTINEL}", "w"); "',
    f"'; open('{SENTINEL}', 'w'); '",
    f'\\"""; open("{SENTINEL}", "w")  #',
    f'""""""; __import__("os").system("touch {SENTINEL}")',
    f'x"""\r__import__("os").system("touch {SENTINEL}")\r"""',
    f'x"""\u2028open("{SENTINEL}", "w")\u2028"""',
    f'\x00"""\x1b[2J\x1b]0;{SENTINEL}\x07 open("{SENTINEL}", "w")',
    f"\\N{{QUOTATION MARK}}\\N{{QUOTATION MARK}}\\N{{QUOTATION MARK}}; open('{SENTINEL}')",
    f'{{__import__("os").system("touch {SENTINEL}")}}',
    f'" + open("{SENTINEL}", "w").name + "',
    f"\\\n\\\\\n\\'\\\"{SENTINEL}\\",
    '"""',
    '"',
    "\\",
    '\\"',
    '"\n',
    "\n\n\n",
    "\t\x0b\x0c\x85\u2029 ",
    "\ud800\udfff",
    "\u202eevil\u202c",
    "Ω≈ç√∫ 工具 \U0001f600",
    "__import__",
    "__class__",
    "__init__",
    "..",
    "../../../etc/passwd",
    "/etc/passwd",
    "a/b\\c",
    "",
    " ",
    "x" * 3000,
]
KEYWORDS = ["class", "import", "def", "None", "True", "lambda", "await", "match", "_", "type"]
BUILTINS = ["list", "dict", "str", "print", "exec", "eval", "open", "__builtins__", "id"]
GENERATED_NAMES = ["Params", "Result", "SERVER", "TOOL", "call", "call_sync", "_arguments"]
TYPING_NAMES = ["Any", "Final", "Literal", "NotRequired", "TypeAlias", "TypedDict", "cast"]
COLLIDING = ["get-item", "get_item", "getItem", "GET ITEM", "get__item", "get_item_2", "Get.Item"]
NAMES = [
    *KEYWORDS,
    *BUILTINS,
    *GENERATED_NAMES,
    *TYPING_NAMES,
    *COLLIDING,
    "3d-render",
    "0",
    "\uff11\uff12\uff13",  # fullwidth digits
    "\uff46\uff4f\uff4f",  # fullwidth letters
    "工具",
    "émoji😀",
    "\u0131",  # dotless i
    "ǅ",
    "a" * 1100,
    "b" * 300,
]

hostile_text = st.one_of(
    st.sampled_from(PAYLOADS + NAMES),
    st.text(max_size=30),
    st.text(alphabet="\"'\\\n\r\x00\x1b\u2028{}#$%-_./ ", max_size=30),
)
tool_names = st.one_of(
    st.sampled_from(NAMES + PAYLOADS),
    st.text(max_size=20),
    st.from_regex(r"[0-9][a-z0-9_-]{0,10}", fullmatch=True),
    st.from_regex(r"__[a-z]{1,8}__", fullmatch=True),
)

# Any JSON value, huge and nested ones included (defaults, enums, consts, wrong keywords).
json_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.sampled_from([2**63, -(2**63) - 1, 10**100, 10**4000]),  # repr-able: < 4300 digits
    st.floats(allow_nan=False),
    hostile_text,
)
json_values = st.recursive(
    json_scalars,
    lambda c: st.lists(c, max_size=3) | st.dictionaries(hostile_text, c, max_size=3),
    max_leaves=6,
)

# `$ref`s: to the definitions below (whose refs to each other make cycles), to the root,
# through arrays, escaped, percent-encoded, remote, and malformed.
REFS = [
    "#",
    "#/$defs/A",
    "#/$defs/B",
    "#/$defs/a~1b",
    "#/$defs/%41",
    "#/definitions/A",
    "#/properties/p0",
    "#/properties/p0/items",
    "#/$defs/A/properties/p0",
    "#/$defs/L/anyOf/0",
    "#/$defs/L/anyOf/1",
    "#/$defs/L/anyOf/²",
    "#/$defs/L/anyOf/-1",
    "#/$defs/L/anyOf/" + "9" * 5000,
    "#/$defs/missing",
    "#/%ZZ",
    "#foo",
    "",
    "http://example.com/schema.json",
]
TYPES = ["string", "integer", "number", "boolean", "null", "object", "array", "martian"]

leaf_schemas = st.one_of(
    st.builds(lambda t: {"type": t}, st.sampled_from(TYPES)),
    st.builds(lambda r: {"$ref": r}, st.sampled_from(REFS)),
    st.builds(lambda v: {"enum": v}, st.lists(json_scalars, max_size=6)),
    st.builds(lambda v: {"const": v}, json_values),
    st.sampled_from([{}, True, False, None, [], "string"]),
)

# A keyword the generator reads, with a proper value (from `proper`) or any JSON value.
KEYWORD_NAMES = [
    "type",
    "properties",
    "required",
    "items",
    "enum",
    "const",
    "anyOf",
    "oneOf",
    "allOf",
    "$ref",
    "additionalProperties",
    "nullable",
    "title",
    "description",
    "default",
    "$defs",
]


def _proper_values(children: st.SearchStrategy[Any]) -> dict[str, st.SearchStrategy[Any]]:
    return {
        "type": st.sampled_from(TYPES) | st.lists(st.sampled_from(TYPES), max_size=4),
        "properties": st.dictionaries(st.sampled_from(NAMES) | hostile_text, children, max_size=5),
        "required": st.lists(st.sampled_from(NAMES) | hostile_text, max_size=4),
        "items": children,
        "enum": st.lists(json_values, max_size=8),
        "const": json_values,
        "anyOf": st.lists(children, max_size=4),
        "oneOf": st.lists(children, max_size=4),
        "allOf": st.lists(children, max_size=3),
        "$ref": st.sampled_from(REFS),
        "additionalProperties": children,
        "nullable": st.booleans(),
        "title": hostile_text,
        "description": hostile_text,
        "default": json_values,
        "$defs": st.dictionaries(st.sampled_from(["A", "B", "a/b"]), children, max_size=2),
    }


def _node(children: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    proper = _proper_values(children)
    optional = {k: proper[k] | json_values if k in _WRONG_TYPED else proper[k] for k in proper}
    return st.fixed_dictionaries({}, optional=optional)


# Keywords that also get a wrongly typed value (any JSON) now and then.
_WRONG_TYPED = frozenset({"type", "properties", "required", "items", "enum", "anyOf", "allOf"})


schemas = st.recursive(leaf_schemas, _node, max_leaves=8)


def _input_schema(root: Any, defs: dict[str, Any], p0: Any) -> dict[str, Any]:
    base = root if isinstance(root, dict) else {}
    out: dict[str, Any] = {"type": "object", **base}
    if isinstance(out.get("properties"), dict):
        out["properties"] = {"p0": p0, **out["properties"]}
    out["$defs"] = defs
    return out


# `$defs` that refer to each other and to themselves: cycles of every length up to 3.
CYCLIC_DEFS = {
    "A": {"type": "object", "properties": {"p0": {"$ref": "#/$defs/B"}, "me": {"$ref": "#"}}},
    "B": {"anyOf": [{"$ref": "#/$defs/A"}, {"$ref": "#/$defs/B"}, {"type": "null"}]},
    "a/b": {"allOf": [{"$ref": "#/$defs/a~1b"}, {"$ref": "#/$defs/A"}]},
    "L": {"anyOf": [{"type": "string"}, {"$ref": "#/$defs/L"}]},
}

tools = st.builds(
    lambda name, description, title, root, defs, p0, output: Tool(
        name=name,
        description=description,
        title=title,
        inputSchema=_input_schema(root, CYCLIC_DEFS | defs, p0),
        outputSchema=output,
    ),
    tool_names,
    st.none() | hostile_text,
    st.none() | hostile_text,
    schemas,
    st.dictionaries(st.sampled_from(["A", "B", "a/b", "L", "x"]), schemas, max_size=2),
    schemas,
    st.none() | schemas.filter(lambda s: isinstance(s, dict)),
)
server_lists = st.dictionaries(tool_names, st.lists(tools, max_size=3), min_size=1, max_size=3)


# --- what a generated module may contain ----------------------------------------------------

# Every name the generator itself writes; anything else outside a string must be a type name
# made from schema text, which must be sanitised: ASCII PascalCase, short, defined right there.
VOCABULARY = frozenset(
    {"from", "import", "class", "def", "async", "await", "return", "if", "is", "not", "and"}
    | {"raise", "None", "True", "False", "else"}
    | {"typing", "codecage", "runtime", "call_tool", "call_tool_sync", "cast", "overload"}
    | {"Any", "Final", "Literal", "NotRequired", "TypeAlias", "TypedDict", "Unpack"}
    | {"SERVER", "TOOL", "SERVERS", "TOOLS", "Params", "Result", "call", "call_sync"}
    | {"_arguments", "params", "kwargs", "arguments", "TypeError"}
    | {"str", "int", "float", "bool", "list", "dict"}
)
OPERATORS = frozenset(["[", "]", "(", ")", "{", "}", ",", ":", "=", "|", ".", "...", "->"])
OPERATORS |= {"@", "**", "/", "-"}  # decorators, **kwargs, positional-only, negative ints
TYPE_NAME = r"[A-Z][A-Za-z0-9]{0,39}"
FIELD_NAME = r"[a-z][A-Za-z0-9_]{0,39}"
MODULE_PATH = r"(?:[a-z][a-z0-9_]{0,59}/)?(?:__init__|[a-z][a-z0-9_]{0,59})\.py"


def defined_names(tree: ast.Module) -> set[str]:
    """Names the module defines, and the field names of its class-syntax TypedDicts (a
    property key that is a plain identifier: only an annotation target, never evaluated)."""
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            names.add(node.name)
            fields = [f.target for f in node.body if isinstance(f, ast.AnnAssign)]
            names |= {f.id for f in fields if isinstance(f, ast.Name)}
        elif isinstance(node, ast.AnnAssign | ast.Assign):
            targets = [node.target] if isinstance(node, ast.AnnAssign) else node.targets
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
    return names


def check_tokens(text: str) -> None:
    """Outside string literals, only the generator's words and sanitised type names."""
    tree = ast.parse(text)
    defined = defined_names(tree)
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        kind, value = tok.type, tok.string
        where = f"line {tok.start[0]}: {value!r}"
        if kind == tokenize.NAME:
            if value not in VOCABULARY:
                plain = re.fullmatch(TYPE_NAME, value) or re.fullmatch(FIELD_NAME, value)
                assert plain and not keyword.iskeyword(value), f"unsanitised name at {where}"
                assert value in defined, f"a name that the module does not define at {where}"
        elif kind == tokenize.OP:
            assert value in OPERATORS, f"unexpected operator at {where}"
        elif kind == tokenize.NUMBER:
            assert re.fullmatch(r"[0-9]{1,19}", value), f"unexpected number at {where}"
        else:
            # A comment would be text the generator does not control: there are none.
            assert kind in _LAYOUT_TOKENS, f"unexpected {tokenize.tok_name[kind]} at {where}"


_LAYOUT_TOKENS = frozenset(
    {tokenize.STRING, tokenize.NEWLINE, tokenize.NL, tokenize.INDENT, tokenize.DEDENT}
    | {tokenize.ENDMARKER}
)


def check_ast(text: str, reference_functions: set[str]) -> None:
    """Only definitions: imports, constants, TypedDicts, aliases and the fixed functions;
    numbers only inside `Literal[...]`."""
    tree = ast.parse(text)
    compile(tree, "<generated>", "exec")
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            assert ast.dump(node) in reference_functions, ast.unparse(node)[:300]
        elif isinstance(node, ast.ImportFrom):
            assert node.module in ("typing", "codecage.runtime") and node.level == 0
        elif isinstance(node, ast.Assign):  # functional TypedDict
            assert isinstance(node.value, ast.Call)
            assert ast.unparse(node.value.func) == "TypedDict"
        else:
            assert isinstance(node, ast.Expr | ast.AnnAssign | ast.ClassDef), ast.dump(node)[:300]
    for annotation in _annotations(tree):
        _check_forward_refs(annotation, defined_names(tree))
    in_literal: set[int] = set()
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Subscript)
            and isinstance(node.value, ast.Name)
            and node.value.id == "Literal"
        ):
            in_literal |= {id(n) for n in ast.walk(node.slice)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and type(node.value) is int:
            assert id(node) in in_literal, f"an int outside Literal: {node.value}"
        assert not isinstance(node, ast.Call) or ast.unparse(node.func) in _CALLS, (
            f"a call the generator does not write: {ast.unparse(node)[:200]}"
        )


def _annotations(tree: ast.Module) -> Iterator[ast.expr]:
    """The type expressions of a module: alias values, class fields, functional fields."""
    for node in tree.body:
        if isinstance(node, ast.AnnAssign) and ast.unparse(node.annotation) == "TypeAlias":
            assert node.value is not None
            yield node.value
        elif isinstance(node, ast.ClassDef):
            yield from (f.annotation for f in node.body if isinstance(f, ast.AnnAssign))
        elif isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
            mapping = node.value.args[1]
            assert isinstance(mapping, ast.Dict)
            yield from mapping.values


def _check_forward_refs(node: ast.expr, defined: set[str]) -> None:
    """A string in a type outside `Literal[...]` is a forward reference, which typing
    compiles (and `get_type_hints` evaluates): it must be a type name the module defines."""
    if isinstance(node, ast.Subscript) and ast.unparse(node.value) == "Literal":
        return
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        assert re.fullmatch(TYPE_NAME, node.value) and node.value in defined, node.value
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.expr):
            _check_forward_refs(child, defined)


_CALLS = frozenset(
    {"TypedDict", "call_tool", "call_tool_sync", "cast", "_arguments", "dict", "TypeError"}
)


# The functions a tool module has, as the generator writes them for plain tools.
REFERENCE_FUNCTIONS = {ast.dump(node) for node in reference_functions()}


def check_tree(files: Mapping[str, str], servers: Mapping[str, Sequence[Tool]]) -> None:
    """Every module is only definitions, names sanitised; SERVER/TOOL round-trip."""
    originals = {(s, t.name) for s, ts in servers.items() for t in ts}
    for path, text in files.items():
        assert re.fullmatch(MODULE_PATH, path), path
        check_tokens(text)
        check_ast(text, REFERENCE_FUNCTIONS)
        if path.endswith("__init__.py"):
            continue
        constants = {
            n.target.id: ast.literal_eval(n.value)
            for n in ast.parse(text).body
            if isinstance(n, ast.AnnAssign)
            and isinstance(n.target, ast.Name)
            and n.target.id in ("SERVER", "TOOL")
            and n.value is not None
        }
        assert (constants["SERVER"], constants["TOOL"]) in originals, path


# --- the properties, fuzzed --------------------------------------------------------------------


@settings(
    max_examples=30,  # 6-18 s on 2 shared cores: drawing these schemas is the slow part
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(server_lists)
def test_any_tool_list_gives_a_deterministic_tree_of_definitions_only(
    servers: dict[str, list[Tool]],
) -> None:
    deterministic_tree(servers, check_tree)


# --- findings: schemas that made generate() raise (fixed in codegen/schema.py) ----------------


@pytest.mark.parametrize(
    "schema",
    [
        pytest.param({"allOf": [{}], "properties": [1, 2]}, id="allOf-properties-list"),
        pytest.param({"allOf": [{}], "properties": "ab"}, id="allOf-properties-str"),
        pytest.param({"allOf": [{}], "required": 5}, id="allOf-required-int"),
        pytest.param({"allOf": [{}], "required": 2.5}, id="allOf-required-float"),
        pytest.param(
            {"properties": {"x": {"allOf": [{"type": "object"}], "properties": [[1, 2, 3]]}}},
            id="nested-allOf-properties-list",
        ),
        pytest.param(
            {"properties": {"x": {"$ref": "#/$defs/L/anyOf/²"}}, "$defs": {"L": {"anyOf": [{}]}}},
            id="ref-index-superscript-digit",
        ),
        pytest.param(
            {"properties": {"x": {"$ref": "#/$defs/L/anyOf/" + "9" * 5000}}, "$defs": CYCLIC_DEFS},
            id="ref-index-5000-digits",
        ),
    ],
)
def test_wrongly_typed_keywords_and_odd_ref_indexes_do_not_make_generate_raise(
    schema: dict[str, Any],
) -> None:
    """Found by the fuzzer: `allOf` beside a `properties` that is not an object or a
    `required` that is not an array raised TypeError/ValueError (dict("ab"), list(5)), and
    so did a `$ref` array index in non-ASCII digits or of more than 4300 digits. A hostile
    upstream could so stop `codecage gen`, and `run`/`serve` that generate at start."""
    servers = {"s": [Tool(name="t", inputSchema=schema, outputSchema=schema)]}
    files = generate(servers)
    check_tree(files, servers)


def test_a_required_that_is_not_an_array_means_nothing_required_with_or_without_allof() -> None:
    """A string `required` was split into characters under `allOf` (so "ab" required a
    property `a`), and ignored without it; JSON Schema wants an array: ignored both ways."""
    properties = {"a": {"type": "string"}, "b": {"type": "string"}}
    plain = {"type": "object", "properties": properties, "required": "ab"}
    merged = {"allOf": [{"type": "object", "properties": properties}], "required": "ab"}
    texts = [generate({"s": [Tool(name="t", inputSchema=s)]})["s/t.py"] for s in (plain, merged)]
    for text in texts:
        assert "a: NotRequired[str]" in text and "b: NotRequired[str]" in text


# --- a fixed hostile corpus: every payload in every place a server can put text -------------


def _payload_tool(name: str, text: str, i: int) -> dict[str, Any]:
    """A tool (as an MCP server lists it) with `text` in every text slot of its schemas."""
    nested = {
        "type": "object",
        "title": text,
        "description": text,
        "properties": {text: {"const": text}, "n": {"enum": [text, i, -i, True, None]}},
        "default": {text: [text, i]},
    }
    schema = {
        "type": "object",
        "title": text,
        "description": text,
        "properties": {
            text: {"type": "string", "description": text, "default": text, "enum": [text]},
            "p0": nested,
            "p1": {"$ref": "#/$defs/A"},
            "p2": {"anyOf": [{"const": text}, {"$ref": f"#/$defs/{_pointer(text)}"}]},
            "p3": {"type": "array", "items": {"title": text, "properties": {text: {}}}},
            "p4": {"additionalProperties": {"title": text, "properties": {"k": nested}}},
        },
        "required": [text, "p0"],
        "$defs": {text: nested, **CYCLIC_DEFS},
    }
    return {
        "name": name,
        "title": text,
        "description": text,
        "inputSchema": schema,
        "outputSchema": {"type": "object", "description": text, "properties": {text: nested}},
    }


def _pointer(key: str) -> str:
    return key.replace("~", "~0").replace("/", "~1")


def hostile_corpus() -> dict[str, list[dict[str, Any]]]:
    """Servers named by the payloads (one tool each, text everywhere), and one server whose
    tool names are all the hostile names (keywords, dunders, collisions, long ones...)."""
    servers = {text: [_payload_tool(text, text, i)] for i, text in enumerate(PAYLOADS)}
    servers["names"] = [
        _payload_tool(name, PAYLOADS[i % len(PAYLOADS)], i) for i, name in enumerate(NAMES)
    ]
    return servers


def as_tools(corpus: Mapping[str, Sequence[Mapping[str, Any]]]) -> dict[str, list[Tool]]:
    return {s: [Tool.model_validate(t) for t in ts] for s, ts in corpus.items()}


def snapshot(root: Path) -> dict[str, str]:
    """Every path under `root` (symlinks not followed) with a digest of what it is."""
    out: dict[str, str] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = Path(dirpath) / name
            st_ = path.lstat()
            kind = "dir" if path.is_dir() and not path.is_symlink() else "other"
            if path.is_file() and not path.is_symlink():
                kind = hashlib.sha256(path.read_bytes()).hexdigest()
            out[str(path.relative_to(root))] = f"{kind} {st_.st_mode:o}"
    return out


def check_confined(before: Mapping[str, str], after: Mapping[str, str], out: str) -> None:
    """Only paths under `out/` changed (and `out` itself appeared)."""
    changed = {p for p in before.keys() | after.keys() if before.get(p) != after.get(p)}
    outside = {p for p in changed if p != out and not p.startswith(f"{out}/")}
    assert not outside, sorted(outside)[:20]


def check_written(files: Mapping[str, str], out_dir: Path) -> None:
    """What is in `out_dir` is exactly the files, their bytecode, and the marker."""
    found = set()
    for path in out_dir.rglob("*"):
        assert not path.is_symlink(), path
        real = path.resolve()
        assert real.is_relative_to(out_dir.resolve()), path
        if path.is_file():
            found.add(str(path.relative_to(out_dir)))
    pyc = {p for p in found if "/__pycache__/" in f"/{p}" and p.endswith(".pyc")}
    assert found - pyc == set(files) | {".codecage-generated.json"}
    for rel, text in files.items():
        assert (out_dir / rel).read_text(encoding="utf-8") == text


@pytest.fixture(scope="module")
def corpus_tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The hostile corpus generated and written; a stand-in `codecage.runtime` beside it."""
    root = tmp_path_factory.mktemp("corpus")
    servers = as_tools(hostile_corpus())
    files = generate(servers)
    check_tree(files, servers)
    write_tree(files, root / "servers")
    stub = root / "stubs" / "codecage"
    stub.mkdir(parents=True)
    (stub / "__init__.py").write_text("", encoding="utf-8")
    (stub / "runtime.py").write_text(STUB_RUNTIME, encoding="utf-8")
    return root


STUB_RUNTIME = """\
async def call_tool(server, tool, arguments=None):
    raise NotImplementedError


def call_tool_sync(server, tool, arguments=None):
    raise NotImplementedError
"""

# Imports every module of the tree under an audit hook and prints what it saw. The modules
# the import machinery itself needs are loaded before the hook.
AUDITED_IMPORT = """\
import importlib, inspect, json, pkgutil, sys, typing
import codecage.runtime

events = []
sys.addaudithook(lambda event, args: events.append([event, [repr(a)[:300] for a in args]]))
import servers
for module in pkgutil.walk_packages(servers.__path__, "servers."):
    importlib.import_module(module.name)
modules = sorted(m for m in sys.modules if m.split(".")[0] == "servers")
print(json.dumps({"events": events, "modules": modules}))
"""
# Events of importing definitions: reading the tree, running its module bodies (class and
# function creation). Their paths are checked below.
_HARMLESS = frozenset(
    {"exec", "marshal.loads", "sys._getframe", "object.__setattr__", "object.__getattr__"}
    | {"builtins.id"}
)


def audited_import(tree: Path, stubs: Path) -> subprocess.CompletedProcess[str]:
    """AUDITED_IMPORT run in `tree` (a child of plain python3 with only `tree` and the
    stub runtime to import from), its output captured."""
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": f"{tree}:{stubs}"}
    return subprocess.run(
        [sys.executable, "-B", "-c", AUDITED_IMPORT],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_importing_the_hostile_tree_only_defines_things(corpus_tree: Path) -> None:
    """Every module imports (in a child, over a stub runtime) and does nothing else: no
    file opened outside the tree, no process, no socket, no module imported but the tree's
    own, and the sentinel file that every payload tries to create is never there."""
    proc = audited_import(corpus_tree, corpus_tree / "stubs")
    assert proc.returncode == 0, proc.stderr[-4000:]
    seen = json.loads(proc.stdout)
    tree = repr(str(corpus_tree / "servers"))[:-1]  # the quoted path, without its end quote
    for event, args in seen["events"]:
        if event == "import":
            assert re.fullmatch(r"'servers(\.[a-z0-9_]+)*'", args[0]), args
        elif event in ("open", "os.listdir"):
            assert args[0].startswith(tree), (event, args)
            assert event != "open" or args[1] in ("'r'", "None"), args
        elif event == "compile":  # typing compiles a forward reference: a type name only
            assert re.fullmatch(rf"b'{TYPE_NAME}'", args[0]) and args[1] == "'<string>'", args
        else:
            assert event in _HARMLESS, (event, args)
    modules = {
        p.with_suffix("").relative_to(corpus_tree) for p in corpus_tree.glob("servers/**/*.py")
    }
    expected = {".".join(m.parts[:-1] if m.name == "__init__" else m.parts) for m in modules}
    assert set(seen["modules"]) == expected
    assert not (corpus_tree / SENTINEL).exists()


def test_the_audit_sees_code_that_runs_at_import(corpus_tree: Path, tmp_path: Path) -> None:
    """The check above can fail: a module whose docstring escaping is broken, as if the
    generator forgot it, runs its payload, and the audit sees it."""
    tree = tmp_path / "servers"
    (tree / "evil").mkdir(parents=True)
    (tree / "__init__.py").write_text("", encoding="utf-8")
    (tree / "evil" / "__init__.py").write_text(
        '"""x"""\n' + f'open("{SENTINEL}", "w").close()\n', encoding="utf-8"
    )
    proc = audited_import(tmp_path, corpus_tree / "stubs")
    assert proc.returncode == 0, proc.stderr[-4000:]
    opened = [args for event, args in json.loads(proc.stdout)["events"] if event == "open"]
    assert any(
        SENTINEL in args[0] and not args[0].startswith(repr(str(tree))[:-1]) for args in opened
    )
    assert (tmp_path / SENTINEL).exists()


def test_the_hostile_tree_passes_ruff_check(corpus_tree: Path) -> None:
    for command in (["check"], ["format", "--check"]):
        proc = subprocess.run(
            [sys.executable, "-m", "ruff", *command, "--isolated", "--no-cache", "servers"],
            cwd=corpus_tree,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-2000:]


# --- confined to the output directory --------------------------------------------------------


# Paths come from names only: many names, plain schemas.
named_servers = st.dictionaries(
    tool_names,
    st.lists(st.builds(lambda n: Tool(name=n, inputSchema={"type": "object"}), tool_names)),
    min_size=1,
    max_size=4,
)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(named_servers, named_servers)
def test_writing_any_tree_touches_only_the_output_directory(
    first: dict[str, list[Tool]], second: dict[str, list[Tool]]
) -> None:
    """Writing a tree, then another over it (which removes what is gone), changes nothing
    outside the output directory, and leaves there exactly the files generated."""
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        (root / "neighbour").mkdir()
        (root / "neighbour" / "keep.py").write_text("x = 1\n", encoding="utf-8")
        (root / "etc").mkdir()
        before = snapshot(root)
        for servers in (first, second):
            files = generate(servers)
            write_tree(files, root / "out" / "servers")
            check_written(files, root / "out" / "servers")
            check_confined(before, snapshot(root), "out")


def test_the_hostile_corpus_is_written_only_inside_its_output_directory(tmp_path: Path) -> None:
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc" / "passwd").write_text("root:x:0:0\n", encoding="utf-8")
    before = snapshot(tmp_path)
    files = generate(as_tools(hostile_corpus()))
    write_tree(files, tmp_path / "a" / "servers")
    check_written(files, tmp_path / "a" / "servers")
    check_confined(before, snapshot(tmp_path), "a")
    assert {p.split("/")[0] for p in files} <= {
        p.name for p in (tmp_path / "a" / "servers").iterdir()
    }


# --- deterministic across processes --------------------------------------------------------

# Generates the corpus on stdin (JSON) and prints a digest of every file.
DIGEST_CHILD = """\
import hashlib, json, sys
from mcp_types import Tool
from codecage.bridge.codegen import generate
corpus = json.load(sys.stdin)
files = generate({s: [Tool.model_validate(t) for t in ts] for s, ts in corpus})
print(json.dumps({p: hashlib.sha256(t.encode()).hexdigest() for p, t in files.items()}))
"""


def digests(files: Mapping[str, str]) -> dict[str, str]:
    return {p: hashlib.sha256(t.encode()).hexdigest() for p, t in files.items()}


def test_a_fresh_process_with_another_hash_seed_generates_the_same_bytes() -> None:
    """This process's hash seed is random (or the runner's); the child's is fixed."""
    # As JSON carries it (which pairs the lone surrogates "\ud800\udfff" into one character).
    corpus = json.loads(json.dumps(hostile_corpus()))
    # Another order of servers and tools too: the output is sorted by module name.
    shuffled = [(s, list(reversed(corpus[s]))) for s in reversed(list(corpus))]
    expected = digests(generate(as_tools(corpus)))
    env = {"PATH": "/usr/bin:/bin", "PYTHONHASHSEED": "4242"}
    env["PYTHONPATH"] = os.environ.get("PYTHONPATH", "")
    proc = subprocess.run(
        [sys.executable, "-c", DIGEST_CHILD],
        input=json.dumps(shuffled),
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert json.loads(proc.stdout) == expected


# --- bounded in time, memory and size ---------------------------------------------------------


def _nested(depth: int, wrap: Any) -> Any:
    schema: Any = {"type": "string"}
    for _ in range(depth):
        schema = wrap(schema)
    return schema


def big_cases() -> dict[str, dict[str, list[dict[str, Any]]]]:
    """Named tool lists, each large in one way (JSON, as a server would send them)."""
    plain = {"type": "object", "properties": {"a": {"type": "string", "description": "d" * 80}}}
    many = [
        {"name": f"tool{i}", "description": "x" * 100, "inputSchema": plain} for i in range(5000)
    ]
    deep = {
        "properties": _nested(1000, lambda s: {"type": "object", "properties": {"a": s}}),
        "items": _nested(1000, lambda s: {"type": "array", "items": s}),
        "anyOf": _nested(1000, lambda s: {"anyOf": [s, {"type": "null"}]}),
        "allOf": _nested(1000, lambda s: {"allOf": [{"properties": {"a": s}}]}),
        "additionalProperties": _nested(1000, lambda s: {"additionalProperties": s}),
        "default": {"default": _nested(1000, lambda s: [s])},
        "enum": {"enum": [_nested(1000, lambda s: {"a": s})]},
    }
    chain = {
        f"D{i}": {"allOf": [{"$ref": f"#/$defs/D{i + 1}"}], "properties": {f"p{i}": {}}}
        for i in range(1000)
    }
    web = {
        f"W{i}": {
            "type": "object",
            "properties": {f"to{j}": {"$ref": f"#/$defs/W{j}"} for j in range(i, i + 20)},
        }
        for i in range(1000)
    }
    wide = {
        "properties": {
            f"p{i}": {"type": "string", "description": "d" * 1000} for i in range(10_000)
        },
        "enum": {"enum": [f"value {i}" for i in range(100_000)]},
        "text": {"type": "string", "description": "word " * 2_000_000},
        "defs-chain": {"$ref": "#/$defs/D0"},
        "defs-web": {"$ref": "#/$defs/W0"},
    }
    return {
        "5000 tools, one server": {"s": many},
        "5000 tools, 5 servers": {f"s{j}": many[j * 1000 : (j + 1) * 1000] for j in range(5)},
        "1000 deep, 7 ways": {
            "s": [
                {"name": k, "inputSchema": {"type": "object", "properties": {"x": v}}}
                for k, v in deep.items()
            ]
            + [{"name": "root", "inputSchema": deep["properties"], "outputSchema": deep["anyOf"]}]
        },
        "10,000 properties, 100,000 enum values, 10 MB text, 1000 defs": {
            "s": [
                {
                    "name": k,
                    "description": "word " * 2_000_000,
                    "inputSchema": {
                        "type": "object",
                        "properties": {"x": v} if k != "properties" else wide["properties"],
                        "$defs": {**chain, **web},
                    },
                }
                for k, v in wide.items()
            ]
        },
    }


# Generates each case in this fresh process; prints time, peak RSS growth, size. The cases
# are built there: nested 1,000 deep, they are too deep for `json.dumps`.
MEASURE_CHILD = """\
import json, sys, time
from mcp_types import Tool
from codecage.bridge.codegen import generate
from tests.reliability.test_fuzz_codegen import big_cases
def peak_kib():  # VmHWM: ru_maxrss would start at the (vfork) parent's peak, the test run's
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmHWM:"))
cases = big_cases()
out = {}
for name, servers in cases.items():
    tools = {s: [Tool.model_validate(t) for t in ts] for s, ts in servers.items()}
    rss = peak_kib()
    started = time.monotonic()
    files = generate(tools)
    seconds = time.monotonic() - started
    grown = peak_kib() - rss
    sizes = [len(t) for t in files.values()]
    out[name] = {"s": round(seconds, 2), "rss_growth_mb": round(grown / 1024, 1),
                 "files": len(files), "bytes": sum(sizes), "largest": max(sizes)}
print(json.dumps(out))
"""


def test_thousands_of_tools_and_huge_deep_schemas_are_generated_within_bounds() -> None:
    """Measured in a fresh process (printed, for docs/reliability.md); asserted only
    loosely: the cases finish, and their output and memory stay far from unbounded."""
    checkout = Path(__file__).parents[2]
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": f"{os.environ.get('PYTHONPATH', '')}:{checkout}"}
    proc = subprocess.run(
        [sys.executable, "-c", MEASURE_CHILD],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,  # a hang guard, not a speed claim: they took ~10 s on 2 busy cores
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    measured = json.loads(proc.stdout)
    print(json.dumps(measured, indent=1))
    for name, m in measured.items():
        assert m["largest"] < 2_000_000, name  # one module of a bounded size, whatever came in
        assert m["rss_growth_mb"] < 1024, name
    assert measured["5000 tools, one server"]["files"] == MAX_TOOLS_PER_SERVER + 2
    assert measured["5000 tools, 5 servers"]["files"] == 5000 + 5 + 1
    assert measured["5000 tools, 5 servers"]["bytes"] < 5000 * 20_000


# --- through the real `codecage gen` command --------------------------------------------------

# A stdio MCP server in raw JSON-RPC (stdlib only): it lists exactly the tools in the JSON
# file named by argv[1], in pages of 500, as a hostile server may list anything at all.
RAW_SERVER = """\
import json, sys
# One tool's JSON text a line, sent as it is (never parsed here: it may be nested too deep).
tools = open(sys.argv[1], encoding="utf-8").read().splitlines()
for line in sys.stdin:
    message = json.loads(line)
    if "id" not in message:
        continue
    method, params = message.get("method"), message.get("params") or {}
    head = '{"jsonrpc": "2.0", "id": %s, ' % json.dumps(message["id"])
    if method == "initialize":
        result = {"protocolVersion": params.get("protocolVersion"), "capabilities": {"tools": {}},
                  "serverInfo": {"name": "raw", "version": "1"}}
        print(head + '"result": %s}' % json.dumps(result), flush=True)
    elif method == "tools/list":
        start = int(params.get("cursor") or 0)
        page = ", ".join(tools[start:start + 500])
        after = ', "nextCursor": "%d"' % (start + 500) if start + 500 < len(tools) else ""
        print(head + '"result": {"tools": [%s]%s}}' % (page, after), flush=True)
    elif method == "ping":
        print(head + '"result": {}}', flush=True)
    else:
        print(head + '"error": {"code": -32601, "message": "no such method"}}', flush=True)
"""


def raw_servers(
    tmp_path: Path, servers: Mapping[str, Sequence[str]], timeout_s: float = 60
) -> Path:
    """An MCP config whose servers are RAW_SERVER processes listing `servers`' tools, each
    given as its JSON text."""
    script = tmp_path / "raw_server.py"
    script.write_text(RAW_SERVER, encoding="utf-8")
    config: dict[str, Any] = {"mcpServers": {}}
    for name, listed in servers.items():
        tools_file = tmp_path / f"{name}.jsonl"
        tools_file.write_text("".join(f"{line}\n" for line in listed), encoding="utf-8")
        config["mcpServers"][name] = {
            "command": sys.executable,
            "args": [str(script), str(tools_file)],
            "timeout": timeout_s,
        }
    path = tmp_path / "mcp.json"
    path.write_text(json.dumps(config), encoding="utf-8")
    return path


def gen_command(work: Path, config: Path, hash_seed: str) -> subprocess.CompletedProcess[str]:
    env = {"PATH": "/usr/bin:/bin", "HOME": str(work / "home"), "PYTHONHASHSEED": hash_seed}
    env["PYTHONPATH"] = os.environ.get("PYTHONPATH", "")
    argv = [CODECAGE, "gen", "--mcp-config", str(config), "--all", "--out", "servers", "--json"]
    return subprocess.run(
        argv, cwd=work, env=env, capture_output=True, text=True, timeout=300, check=False
    )


def test_the_gen_command_writes_the_hostile_listing_as_generated_and_only_in_out(
    tmp_path: Path,
) -> None:
    """`codecage gen` over real stdio MCP servers that list the hostile corpus and 2,000 more
    tools: the tree is what `generate()` makes of the listed tools, every module checks
    out, nothing outside --out changes, and a second run in a process with another hash
    seed finds every byte the same (and writes nothing)."""
    corpus = json.loads(json.dumps(hostile_corpus()))
    hostile = [tool for tools in corpus.values() for tool in tools]
    # Nested as deep as the MCP SDK reads (its JSON parser stops near 200 levels).
    nested = _nested(45, lambda s: {"type": "object", "properties": {"a": s}})
    hostile.append({"name": "nested", "inputSchema": nested})
    work = tmp_path / "work"
    (work / "home").mkdir(parents=True)
    config = raw_servers(tmp_path, {"hostile": list(map(json.dumps, hostile))})
    before = snapshot(tmp_path)
    started = time.monotonic()
    first = gen_command(work, config, "1")
    elapsed = time.monotonic() - started
    assert first.returncode == 0, first.stderr[-4000:]
    print(f"codecage gen, {len(hostile)} tools: {elapsed:.1f} s")
    check_confined(before, snapshot(tmp_path), "work/servers")
    servers = as_tools({"hostile": hostile})
    files = generate(servers)
    check_tree(files, servers)
    check_written(files, work / "servers")


def test_a_listing_too_deep_for_the_sdk_fails_gen_clearly_in_the_servers_timeout(
    tmp_path: Path,
) -> None:
    """Found here: a tool schema nested 1,000 deep is JSON the MCP SDK cannot parse; it
    logs that and drops the answer, so the listing timed out, and `codecage gen` died with
    a bare TimeoutError traceback. Now it is a clear error, after the server's `timeout`
    (the SDK gives the broker nothing sooner to act on), and nothing is written."""
    depth = 1000
    schema = '{"type": "object", "properties": {"a": ' * depth + "{}" + "}}" * depth
    config = raw_servers(tmp_path, {"deep": [f'{{"name": "deep", "inputSchema": {schema}}}']}, 1)
    work = tmp_path / "work"
    (work / "home").mkdir(parents=True)
    before = snapshot(tmp_path)
    proc = gen_command(work, config, "0")
    assert proc.returncode != 0
    # The SDK logs its parse error (with its traceback); codecage's own ending is an error
    # that says what happened, not an exception's traceback.
    assert "\nTimeoutError" not in proc.stderr, proc.stderr[-3000:]
    assert "Error: cannot list the tools of 'deep'" in proc.stderr, proc.stderr[-3000:]
    assert "did not list its tools in time" in proc.stderr, proc.stderr[-3000:]
    assert not (work / "servers").exists()
    check_confined(before, snapshot(tmp_path), "work/servers")
