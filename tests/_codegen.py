"""What the `servers/` generator writes for plain tools: the reference that the codegen checks
compare every generated module against (a function in it that is not one of these is code the
tool list wrote)."""

from __future__ import annotations

import ast
from collections.abc import Callable, Mapping, Sequence

from mcp_types import Tool

from codecage.bridge.codegen import generate

# Every input kind (an object, not an object, properties without a type) with and without an
# output schema, of either kind.
PLAIN_TOOLS = [
    Tool(name="a", inputSchema={"type": "object"}),
    Tool(name="b", inputSchema={"type": "object"}, outputSchema={"type": "object"}),
    Tool(name="c", inputSchema={"type": "string"}),
    Tool(name="d", inputSchema={"type": "string"}, outputSchema={"type": "object"}),
    Tool(name="d2", inputSchema={"type": "string"}, outputSchema={"type": "string"}),
    Tool(name="e", inputSchema={"properties": {"x": {}}}),
    Tool(name="f", inputSchema={"properties": {"x": {}}}, outputSchema={"type": "string"}),
]


def reference_functions() -> list[ast.FunctionDef | ast.AsyncFunctionDef]:
    """The functions of the tool modules generated for `PLAIN_TOOLS` (the packages'
    `__init__.py` left out)."""
    found: list[ast.FunctionDef | ast.AsyncFunctionDef] = []
    for path, text in generate({"s": PLAIN_TOOLS}).items():
        if path.endswith("__init__.py"):
            continue
        body = ast.parse(text).body
        found += [n for n in body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]
    return found


def deterministic_tree(
    servers: Mapping[str, Sequence[Tool]],
    check: Callable[[Mapping[str, str], Mapping[str, Sequence[Tool]]], None],
) -> None:
    """The tree generated for `servers` passes `check`, comes out the same when generated
    again, and does not depend on the order of the servers or of their tools (except between
    two tools of one server that have the same name: the listing order tells them apart)."""
    files = generate(servers)
    check(files, servers)
    assert generate(servers) == files
    if all(len({t.name for t in ts}) == len(ts) for ts in servers.values()):
        reordered = {s: list(reversed(ts)) for s, ts in reversed(list(servers.items()))}
        assert generate(reordered) == files
