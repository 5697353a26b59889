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

The package, one concern a module, each using only those before it:

```
text      untrusted text as string literals and docstrings (py_str, doc_text, docstring)
naming    module names for servers and tools, type names for schema objects
pytypes   Python type expressions (names, generics, unions, Literal) and their text
schema    JSON Schema -> the named types of one module (SchemaReader, bounded)
layout    those types and statements as text in ruff format style
render    generate(): the tool modules and the two indexes, pure and deterministic
write     write_tree(): the files on disk, atomically, touching only what it wrote
```

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

from codecage.bridge.codegen.naming import module_name, unique_module_names
from codecage.bridge.codegen.render import MAX_TOOL_NAME, MAX_TOOLS_PER_SERVER, generate
from codecage.bridge.codegen.text import py_str
from codecage.bridge.codegen.write import MARKER, write_tree

__all__ = [
    "MARKER",
    "MAX_TOOLS_PER_SERVER",
    "MAX_TOOL_NAME",
    "generate",
    "module_name",
    "py_str",
    "unique_module_names",
    "write_tree",
]
