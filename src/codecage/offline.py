"""What a run without network says when its code tried to reach a host anyway.

In a sandbox without network a name does not resolve ("Temporary failure in name
resolution"), an address is unreachable, and an Internet socket is refused: read alone,
that looks like a flaky DNS or a server that is down. The host adds one note to such a
run's error (after the traceback, as Python prints an exception's notes), worded for the
face that asked: the flag, the keyword argument or the tool argument that allows a host.
"""

from __future__ import annotations

import re
from typing import Final

from codecage.errors import Face
from codecage.models import ExecutionResult

__all__ = ["NOTE_START", "noted"]

NOTE_START: Final = "note: the sandbox has no network"

# What Python's socket layer (and urllib, http.client, requests, httpx and aiohttp, which
# carry its message) says when a name does not resolve or a host cannot be reached.
_REFUSED = re.compile(
    r"Temporary failure in name resolution|Name or service not known|"
    r"No address associated with hostname|nodename nor servname|\[Errno -[235]\]|"
    r"Network is unreachable|\[Errno 101\]|getaddrinfo failed|NameResolutionError|"
    r"Could not resolve host|Failed to resolve"
)

_HOW: Final[dict[Face, str]] = {
    "cli": "run it with --allow-host HOST (e.g. --allow-host api.example.com)",
    "library": "pass allow_hosts=['api.example.com'] to Sandbox(...) or to run()",
    "mcp": "call execute_code with allow_hosts=['api.example.com'], within what "
    "get_sandbox_info says this server permits",
}
_MCP_NONE: Final = (
    "this server permits no host: its operator can allow some (serve --allow-host HOST)"
)


def noted(result: ExecutionResult, face: Face, *, may_allow: bool = True) -> ExecutionResult:
    """`result` with the no-network note after its traceback when its error is a refused
    name or connection (or its code was refused an Internet socket); else `result` as it
    is. Only for a run that had no network. `may_allow`: a call could ask for hosts (an
    MCP server with none in its ceiling cannot).

    Raises:
        Nothing.
    """
    error = result.error
    if error is None or NOTE_START in error.traceback:
        return result
    socket_refused = any(e.kind == "network_denied" for e in result.events)
    said = f"{error.type}: {error.message}\n{error.traceback[-2000:]}"
    if not (socket_refused or _REFUSED.search(said)):
        return result
    how = _HOW[face] if may_allow or face != "mcp" else _MCP_NONE
    note = f"{NOTE_START}: this run may reach no host; to let it reach one, {how}"
    traceback = (error.traceback.rstrip("\n") + "\n" if error.traceback else "") + note + "\n"
    return result.model_copy(update={"error": error.model_copy(update={"traceback": traceback})})
