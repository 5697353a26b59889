"""The sandbox's `codecage.runtime`, seen from the host: for type checkers and editors.

Inside the sandbox, `codecage` is the guest package, so `codecage.runtime` is
`codecage/guest/runtime.py` itself; here it re-exports the same names, so that the modules
`codecage gen` writes (which import `codecage.runtime`) type-check on the host.
"""

from codecage.guest.runtime import (
    BRIDGE_FD,
    ToolCallError,
    ToolRef,
    Workspace,
    WorkspacePathError,
    call_tool,
    call_tool_sync,
    list_servers,
    logger,
    run_async,
    scrub,
    search_tools,
    workspace,
)

__all__ = [
    "BRIDGE_FD",
    "ToolCallError",
    "ToolRef",
    "Workspace",
    "WorkspacePathError",
    "call_tool",
    "call_tool_sync",
    "list_servers",
    "logger",
    "run_async",
    "scrub",
    "search_tools",
    "workspace",
]
