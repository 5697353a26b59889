"""The sandbox's `codecage.runtime`, seen from the host: for type checkers and editors.

Inside the sandbox, `codecage` is the guest package, so `codecage.runtime` is
`codecage/guest/runtime.py` itself; here it re-exports the same names, so that the modules
`codecage gen` writes (which import `codecage.runtime`) type-check on the host. `logger` is
forwarded on first use, like in the guest: importing this module adds no log handler.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from codecage.guest import runtime as _guest
from codecage.guest.runtime import (
    BRIDGE_FD,
    SERVERS_DIR,
    ToolCallError,
    ToolRef,
    Workspace,
    WorkspacePathError,
    call_tool,
    call_tool_sync,
    list_servers,
    run_async,
    scrub,
    search_tools,
    workspace,
)

if TYPE_CHECKING:
    from codecage.guest.runtime import logger

__all__ = [
    "BRIDGE_FD",
    "SERVERS_DIR",
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


def __getattr__(name: str) -> Any:
    if name == "logger":
        return _guest.logger
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
