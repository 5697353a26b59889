"""codecage.runtime: what agent code imports inside the sandbox.

    from codecage.runtime import call_tool, search_tools, workspace, logger, scrub

- `await call_tool(server, tool, arguments)` / `call_tool_sync(...)`: call a tool of an
  upstream MCP server. The call leaves the sandbox over a private socket (fd 4) to the
  broker in the host, which holds the sessions and credentials (docs/tool-bridge.md). The
  generated modules (`servers.<server>.<tool>.call`) use these. A failed call raises
  `ToolCallError` (`.kind`, `.message`, `.server`, `.tool`).
- `search_tools(query)` / `list_servers()`: find tools in /servers without importing them.
- `workspace`: read and write files in /workspace, by paths relative to it.
- `run_async(coro)`: run a coroutine to the end, with or without a running event loop.
- `logger`: JSON lines on stderr; `scrub(text)`: the host's redaction of personal data.
- `display(obj)`: a rich output of the run (a figure, a table, an object's `_repr_html_`,
  ...), as in a notebook; also a builtin in the code. `plt.show()` shows figures the same
  way (`displays`, and `plots`, our matplotlib backend).

One module a concern: `bridge` (the tool-bridge client: calls and scrub), `search`
(finding tools), `files` (the workspace), `aio` (`run_async`), `logs` (the logger) and
`displays` (rich outputs);
this package is their public face (each loaded when one of its names is first used), and
the host's `codecage.runtime` forwards to it.

Standard library only: this runs in the sandbox's interpreter, which has nothing else.
It is imported by agent code on the hot path of a run, so it imports little at the top
(`logging`, `pathlib`, `asyncio`, `ast`, `socket`, `concurrent.futures` are imported when
first needed) and opens the bridge only on the first call. Nothing here is a security
boundary: the sandbox (namespaces, seccomp, mounts) and the host's checks are. The
workspace's path rules, for example, only turn a mistake into a clear error early.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

from ..contract import BRIDGE_FD, SERVERS_DIR

if TYPE_CHECKING:
    import logging

    from .aio import run_async
    from .bridge import ToolCallError, call_tool, call_tool_sync, scrub
    from .displays import display
    from .files import Workspace, WorkspacePathError, workspace
    from .search import ToolRef, list_servers, search_tools

    logger: logging.Logger

__all__ = [
    "BRIDGE_FD",
    "SERVERS_DIR",
    "ToolCallError",
    "ToolRef",
    "Workspace",
    "WorkspacePathError",
    "call_tool",
    "call_tool_sync",
    "display",
    "list_servers",
    "logger",
    "run_async",
    "scrub",
    "search_tools",
    "workspace",
]

# Where each name lives: its module is imported when the name is first used, so that a
# program (or a generated tool module) pays only for what it imports. `logger` is made
# then, too: `logging` costs a few ms at import, and most programs never log.
_HOMES = {
    "run_async": "aio",
    "ToolCallError": "bridge",
    "call_tool": "bridge",
    "call_tool_sync": "bridge",
    "display": "displays",
    "scrub": "bridge",
    "Workspace": "files",
    "WorkspacePathError": "files",
    "workspace": "files",
    "logger": "logs",
    "ToolRef": "search",
    "list_servers": "search",
    "search_tools": "search",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    __import__(f"{__name__}.{home}")
    module = sys.modules[f"{__name__}.{home}"]
    value = module.agent_logger() if name == "logger" else getattr(module, name)
    globals()[name] = value  # an ordinary attribute from now on
    return value
