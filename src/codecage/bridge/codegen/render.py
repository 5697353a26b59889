"""The tree's files as text: a module per tool, an index per server, one of the servers.

`generate()` is pure and deterministic: servers and tools are sorted by module name (a
server's listing order is not stable across restarts, and the file names are the sort key
anyway); properties keep the schema's order, which is how a tool's author presents them.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Final

from mcp_types import Tool

from codecage.bridge.codegen.layout import (
    Layout,
    assign_str,
    class_doc,
    dict_literal,
    field_doc,
    import_line,
)
from codecage.bridge.codegen.naming import unique_module_names
from codecage.bridge.codegen.pytypes import ANY, DICT_ANY
from codecage.bridge.codegen.schema import (
    AliasDef,
    ClassDef,
    Field,
    SchemaReader,
    Types,
    is_class_schema,
    object_root,
)
from codecage.bridge.codegen.text import (
    MAX_DESCRIPTION,
    doc_line,
    doc_text,
    docstring,
    summary_line,
)

log = logging.getLogger(__name__)

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
bounded where they are written (`text.MAX_DESCRIPTION`, `text._MAX_SUMMARY`)."""


@dataclass(frozen=True, slots=True)
class _ToolModule:
    module: str
    summary: str
    text: str


def _tool_module(server: str, tool: Tool, module: str) -> _ToolModule:
    fallback = f"Call the tool {doc_line(tool.name, 80)} of the MCP server {doc_line(server, 80)}."
    description = tool.description if tool.description is not None else tool.title
    summary = summary_line(description, fallback)
    types = Types()
    params_fields = _params_type(tool, types)
    result_any = _result_type(tool, types)
    layout = Layout(types)
    for d in types.defs:
        if isinstance(d, AliasDef):
            layout.alias(d.name, d.type)
        elif d.name == "Params":
            layout.typed_dict(d, ["Arguments of this tool: the module docstring describes each."])
        elif d.name == "Result":
            layout.typed_dict(d, class_doc(d, "The structured result of this tool."))
        else:
            layout.typed_dict(d, class_doc(d, f"The {d.name} object."))

    params_is_class = params_fields is not None
    layout.imports |= {"Any", "Final"}
    if params_is_class:
        layout.imports.add("Unpack")
    if not result_any:
        layout.imports.add("cast")
    layout.imports.add("overload")
    doc = _module_doc(tool, summary, doc_text(description, MAX_DESCRIPTION), params_fields)
    blocks = [
        docstring(doc, ""),
        "\n".join(
            [
                import_line("typing", layout.imports),
                "",
                import_line("codecage.runtime", ["call_tool", "call_tool_sync"]),
                "",
                assign_str("SERVER", server),
                assign_str("TOOL", tool.name),
            ]
        ),
        *layout.blocks,
        *_call_functions(params_is_class, result_any),
    ]
    return _ToolModule(module, summary, _join_blocks(blocks))


def _params_type(tool: Tool, types: Types) -> list[Field] | None:
    """`Params` in `types`, from the tool's inputSchema: its fields, or None when it is not
    a TypedDict but any JSON object (`dict[str, Any]`)."""
    reader = SchemaReader(tool.input_schema, types)
    root = reader.deref(tool.input_schema)
    if isinstance(root, dict) and isinstance(root.get("allOf"), list):
        root = reader.merge_all_of(root)
    types.taken.discard("Params")
    types.allocate("Params")
    if not object_root(root):
        types.defs.append(AliasDef("Params", DICT_ANY))
        return None
    reader.class_type(root, "Params", 0, "")  # `$ref: "#"` inside is a cycle
    params = next(d for d in types.defs if isinstance(d, ClassDef) and d.name == "Params")
    params.field_docs = False  # the module docstring documents them
    params.description = ""
    return params.fields


def _result_type(tool: Tool, types: Types) -> bool:
    """`Result` in `types`, from the tool's outputSchema if it declares one; whether it is
    `Any` (then `call` returns what the runtime gives, without a cast)."""
    types.taken.discard("Result")
    types.allocate("Result")
    if tool.output_schema is None:
        types.defs.append(AliasDef("Result", ANY))
        return True
    reader = SchemaReader(tool.output_schema, types)
    root = reader.deref(tool.output_schema)
    if is_class_schema(root):
        reader.class_type(root, "Result", 0, "")
        return False
    t = reader.type_of(root, "Result", 0)
    types.defs.append(AliasDef("Result", t))
    return t == ANY


def _module_doc(
    tool: Tool, summary: str, full: str, params_fields: list[Field] | None
) -> list[str]:
    """The tool module's docstring lines: what the tool does, its parameters, its result."""
    doc = [summary]
    if full and full != summary:
        doc += ["", *full.split("\n")]
    doc += ["", "Parameters:"]
    if params_fields:
        for f in params_fields:
            doc += field_doc(f)
    else:
        doc.append("    (none)" if params_fields is not None else "    any JSON object")
    doc += ["", "Returns:"]
    if tool.output_schema is None:
        doc.append("    The tool's structured content (a dict) if it sends one, else its text.")
    else:
        doc.append("    Result: the tool's structured content, as its outputSchema declares.")
    return [
        *doc,
        "",
        "Call it with `await call(Params(...))`, `await call(name=value, ...)` or a dict;",
        "`call_sync(...)` is the same without await. Unset optional fields are not sent.",
    ]


def _call_functions(params_is_class: bool, result_any: bool) -> list[str]:
    """`call` and `call_sync` with their overloads, and the `_arguments` they share."""
    kwargs = "Unpack[Params]" if params_is_class else "Any"
    blocks: list[str] = []
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
    return blocks


def _join_blocks(blocks: Sequence[str]) -> str:
    """The module docstring, one blank line, then the blocks two blank lines apart."""
    return blocks[0] + "\n\n" + "\n\n\n".join(blocks[1:]) + "\n"


def _server_index(server: str, module: str, tools: Sequence[_ToolModule]) -> str:
    name = doc_line(server, 80) or "(unnamed)"
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
            docstring(doc, ""),
            "from typing import Final\n\n" + assign_str("SERVER", server),
            dict_literal("TOOLS", [(t.module, t.summary) for t in tools]),
        ]
    )


def _servers_index(servers: Sequence[tuple[str, str, int]]) -> str:
    doc = ["MCP servers whose tools this code can call.", ""]
    for original, module, count in servers:
        doc.append(f"{module}: {count} tool{'' if count == 1 else 's'} ({doc_line(original, 80)})")
    if not servers:
        doc.append("(none)")
    doc += [
        "",
        "Each server is a package: `import servers.<server>` and read its docstring or its",
        "TOOLS (module name -> summary). SERVERS maps module names to server names.",
        "Generated by `codecage gen`: do not edit.",
    ]
    return _join_blocks(
        [docstring(doc, ""), dict_literal("SERVERS", [(m, o) for o, m, _ in servers])]
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
