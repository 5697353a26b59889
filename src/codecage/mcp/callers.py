"""Who made an MCP call, for the audit trail: over HTTP, the named client whose token the
gate accepted (`mcp.http` puts its name in the request's scope); else the MCP client as it
named itself in `initialize` (name and version, bounded by `audit.Caller`)."""

from __future__ import annotations

from typing import Any

from mcp.server.mcpserver import Context

from codecage.audit import Caller

SCOPE_CLIENT_KEY = "codecage.client"
"""The request scope's key under which the HTTP gate leaves the accepted client's name."""


def caller_of(ctx: Context[Any, Any]) -> Caller:
    request = ctx.request_context.request
    scope = getattr(request, "scope", None)
    info = _client_info(ctx)
    if isinstance(scope, dict):
        name = scope.get(SCOPE_CLIENT_KEY)
        # The token's client is who; the MCP client it used goes beside it.
        used = "/".join(part for part in info if part)
        return Caller("http", name=name if isinstance(name, str) else "", version=used)
    return Caller("mcp", name=info[0], version=info[1])


def _client_info(ctx: Context[Any, Any]) -> tuple[str, str]:
    params = getattr(ctx.session, "client_params", None)
    info = getattr(params, "client_info", None) or getattr(params, "clientInfo", None)
    name = getattr(info, "name", "")
    version = getattr(info, "version", "")
    return (name if isinstance(name, str) else "", version if isinstance(version, str) else "")
