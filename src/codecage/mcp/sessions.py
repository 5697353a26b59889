"""The session tools: `open_session`, `close_session`, `list_sessions` (and execute_code's
`session_id`, in tools.py), and who a call's client is.

A session belongs to the credential that opened it (`Clients`): a client with another
never sees or uses it, even with its id (ids are random and unguessable as well). Sessions
are closed by their TTLs or close_session, not when a connection goes away.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Annotated, Any

import anyio.to_thread
from mcp.server.mcpserver import Context
from mcp.server.mcpserver.exceptions import ToolError
from mcp_types import CallToolResult, ToolAnnotations
from pydantic import BaseModel, ConfigDict, Field

from codecage import host
from codecage.engine.session import Session
from codecage.errors import CodecageError
from codecage.mcp import reply
from codecage.mcp.arguments import refusal
from codecage.mcp.callers import SCOPE_CLIENT_KEY, caller_of
from codecage.mcp.runner import Runner

_Tool = Callable[..., Any]


class Clients:
    """Who owns a session: the verified identity a call came with. Over HTTP, the client
    whose token the gate accepted (`callers.SCOPE_CLIENT_KEY`: a `[serve.clients.NAME]`
    name, or "default" for the server's one token; every holder of a token is one
    principal: that is what sharing a token means); never the raw Authorization header,
    whose spelling (`Bearer`/`bearer`, spaces) is the client's to vary. Over stdio, or HTTP
    served without a token, the one principal there is (""). Not the transport's
    connection: the protocol keeps none (a request stands alone), and the CLI's `codecage
    session` commands open one per invocation. A session's id, random and unguessable, is a
    capability on top."""

    def key(self, ctx: Context[Any, Any]) -> str:
        request = ctx.request_context.request
        scope = getattr(request, "scope", None)
        name = scope.get(SCOPE_CLIENT_KEY) if isinstance(scope, dict) else None
        return f"client:{name}" if isinstance(name, str) and name else ""


class SessionReply(BaseModel):
    """The structured content of open_session and of each entry of list_sessions."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    session_id: str = Field(description="Pass it as execute_code's session_id.")
    runs: int = Field(description="Runs so far.")
    idle_ttl_seconds: float = Field(description="Closed after this long unused.")
    expires_in_seconds: float = Field(description="Seconds until it closes unless used.")
    memory_limit_mb: int = Field(description="Memory of the whole session.")
    profile: str = Field(description="The import profile of every run in it.")


class ClosedReply(BaseModel):
    """The structured content of close_session."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    closed: str = Field(description="The id of the session closed.")


class SessionsReply(BaseModel):
    """The structured content of list_sessions."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    sessions: list[SessionReply]
    max_per_client: int


def register(
    tool: Callable[..., Callable[[_Tool], _Tool]], runner: Runner, clients: Clients, budget: int
) -> None:
    """Add the session tools with `tool` (the registrar of tools.py)."""
    settings = runner.host.settings.sessions
    most_idle = settings.most_idle_ttl

    @tool(
        description=(
            "Open a session: a sandbox whose Python state (variables, functions, imports, "
            "files in /workspace) lasts between execute_code calls given its session_id. "
            "Use one for multi-step work: load once, then explore. Memory, profile, imports "
            "and hosts are set here; each call sets its own timeout, and a timeout interrupts "
            "the run (KeyboardInterrupt) and keeps the state. The session ends after "
            f"{settings.idle_ttl:g} s unused or {settings.lifetime:g} s in all, with "
            "close_session, or when a run ends its interpreter (memory limit, os._exit, code "
            f"that ignores its timeout). Its idle_ttl_seconds may be at most {most_idle:g}. "
            f"At most {settings.max_per_client} open per client."
        ),
        annotations=reply_annotations("Open a Python session", read_only=False),
    )
    async def open_session(
        ctx: Context[Any, Any],
        profile: Annotated[
            str | None, Field(description="Import profile(s) of every run in the session.")
        ] = None,
        allowed_imports: Annotated[
            list[str] | None, Field(description="Modules to allow on top of the profile.")
        ] = None,
        memory_limit_mb: Annotated[
            int | None, Field(description="Memory of the whole session in MiB.", ge=32)
        ] = None,
        # A default, not an annotation: annotations are evaluated later, without this scope.
        idle_ttl_seconds: float | None = Field(
            None,
            description=f"Close it after this many seconds unused (at most {most_idle:g}).",
            gt=0,
            le=86_400,
        ),
        allow_hosts: Annotated[
            list[str] | None,
            Field(
                description="Hosts every run of the session may reach (HOST[:PORT], "
                "*.domain), within what this server permits (as execute_code's).",
                max_length=64,
            ),
        ] = None,
    ) -> Annotated[CallToolResult, SessionReply]:
        _check_idle_ttl(idle_ttl_seconds, most_idle)
        # The client's bounds, as for execute_code: above them refused, unasked lowered.
        named = runner.named_client(caller_of(ctx))
        timeout, memory_mb = runner.within_client(named, None, memory_limit_mb)
        egress, policy = runner.network_for(
            runner.policy_for(profile, allowed_imports), allow_hosts
        )
        request = host.SessionRequest(
            limits=runner.call_limits(timeout, memory_mb),
            policy=policy,
            idle_ttl=idle_ttl_seconds,
            client=clients.key(ctx),
            face="mcp",
            egress=egress,
        )
        try:
            opened = await anyio.to_thread.run_sync(runner.host.open_session, request)
        except CodecageError as exc:
            raise ToolError(refusal(exc)) from exc
        data = _described(opened).model_dump(mode="json")
        text = (
            f"Session {opened.id} is open. Pass session_id={opened.id!r} to execute_code: "
            "what a run defines stays for the next. It closes after "
            f"{opened.terms.idle_ttl_s:g} s unused; close it with close_session when done."
        )
        return reply.for_data(text, data, budget)

    @tool(
        description="Close a session opened with open_session, freeing its sandbox; "
        "its state is gone.",
        annotations=reply_annotations("Close a Python session", read_only=False),
    )
    async def close_session(
        ctx: Context[Any, Any],
        session_id: Annotated[
            str, Field(description="The id open_session returned.", max_length=64)
        ],
    ) -> Annotated[CallToolResult, ClosedReply]:
        owner = clients.key(ctx)
        try:
            await anyio.to_thread.run_sync(runner.host.sessions.close, session_id, owner)
        except CodecageError as exc:
            raise ToolError(refusal(exc)) from exc
        closed = ClosedReply(closed=session_id).model_dump(mode="json")
        return reply.for_data(f"Session {session_id} is closed.", closed, budget)

    @tool(
        description="List this client's open sessions: id, runs, seconds until each "
        "closes unless used, memory and profile.",
        annotations=reply_annotations("List Python sessions", read_only=True),
    )
    def list_sessions(ctx: Context[Any, Any]) -> Annotated[CallToolResult, SessionsReply]:
        mine = runner.host.sessions.owned_by(clients.key(ctx))
        listed = SessionsReply(
            sessions=[_described(s) for s in mine], max_per_client=settings.max_per_client
        )
        lines = [
            f"{s.session_id}: {s.runs} runs, closes in {s.expires_in_seconds:.0f} s unless used"
            for s in listed.sessions
        ]
        text = "\n".join(lines) or "No open sessions; open one with open_session."
        return reply.for_data(text, listed.model_dump(mode="json"), budget)


def _check_idle_ttl(asked: float | None, most: float) -> None:
    """Refuse an idle TTL above the server's maximum (as limits above it are refused).

    Raises:
        ToolError: `asked` is above `most`.
    """
    if asked is not None and asked > most:
        raise ToolError(
            f"idle_ttl_seconds={asked:g} is above this server's maximum of {most:g} s "
            "([sessions] max_idle_ttl); ask for less, or leave it out for the default"
        )


def _described(session: Session) -> SessionReply:
    now = time.monotonic()
    terms = session.terms
    expires = min(
        terms.idle_ttl_s - (now - session.last_used), terms.lifetime_s - (now - session.created_at)
    )
    return SessionReply(
        session_id=session.id,
        runs=session.runs,
        idle_ttl_seconds=terms.idle_ttl_s,
        expires_in_seconds=round(max(0.0, expires), 1),
        memory_limit_mb=terms.limits.memory_mb,
        profile=terms.policy.profile if terms.policy is not None else "standard",
    )


def reply_annotations(title: str, *, read_only: bool) -> ToolAnnotations:
    return ToolAnnotations(
        title=title,
        read_only_hint=read_only,
        destructive_hint=False,
        idempotent_hint=read_only,
        open_world_hint=False,
    )
