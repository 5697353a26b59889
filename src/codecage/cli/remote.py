"""The CLI as a client of a running `codecage serve --http`: one MCP tool call over
streamable HTTP (the official SDK's client), its failures turned into codecage errors worded
for the command line.

A CLI process lives for one command, so what must outlive it (a session) lives in the
server; each command connects, makes its call and disconnects. The server knows the caller
by its bearer token (mcp/sessions.py `Clients`), so every command given the same token sees
the same sessions. Imported only by the `codecage session` commands: it loads the MCP SDK.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import httpx2
from mcp import Client, MCPError
from mcp.client.streamable_http import streamable_http_client
from mcp_types import CallToolResult, TextContent

from codecage.errors import CodecageError, ConfigError, SessionError

START_HINT = (
    "start one with `codecage serve --http --token TOKEN`, or point --server (env "
    "CODECAGE_SERVER) at the one that runs"
)
_CONNECT_S = 10.0
_SPARE_S = 60.0
"""Beyond a run's own timeout: the server's queue, the sandbox's start and the reply."""
_NO_TIMEOUT_WAIT_S = 600.0
"""How long a call that names no timeout waits for the reply (the server's maximum is
its operator's choice, unknown here)."""
_TOOL_PREFIX = re.compile(r"^Error executing tool \w+: ")
# The server words its refusals for a model (tool and argument names); the CLI's user
# knows commands and flags. Whole words only.
_CLI_WORDS = {
    "the open_session tool": "`codecage session open`",
    "open_session": "`codecage session open`",
    "close_session": "`codecage session close`",
    "list_sessions": "`codecage session list`",
    "memory_limit_mb": "--memory-mb",
    "idle_ttl_seconds": "--ttl",
    "allowed_imports": "--allow-import",
    "allow_hosts": "--allow-host",
}
_CLI_WORD = re.compile(r"\b(" + "|".join(re.escape(word) for word in _CLI_WORDS) + r")\b")


LOCAL_URL = "http://localhost:1/mcp"
"""The URL of a request over a Unix socket: never dialled, but its Host header (with a port)
must pass the server's DNS-rebinding check, which allows localhost:*."""


class Unreachable(CodecageError):
    """No server took the call: nothing answers at the address, or it is exiting (`503`).
    The tool did not run, so the call may be made again elsewhere."""


@dataclass(frozen=True, slots=True)
class Server:
    """Where the server is and the token it wants (None: send no Authorization); `uds`:
    the Unix socket of the user's local server (cli/local.py), `url` then `LOCAL_URL`."""

    url: str
    token: str | None
    uds: Path | None = None

    @property
    def where(self) -> str:
        """The server, as messages name it."""
        if self.uds is not None:
            return f"the local codecage server ({self.uds})"
        return f"the server at {self.url}"


@dataclass(frozen=True, slots=True)
class Reply:
    """A tool's successful reply: its text (what a model reads) and structured content."""

    text: str
    data: dict[str, Any]


def call(server: Server, tool: str, arguments: dict[str, Any], *, wait_s: float | None) -> Reply:
    """Call `tool` on `server` and return its reply; `wait_s`: how long the call itself may
    take (a run's timeout), None when the caller does not know.

    Raises:
        ConfigError: the server refused the token (HTTP 401), or --server is no URL.
        SessionError: the tool refused the call for its session (unknown, ended, too many):
            the server's message, in the CLI's words.
        CodecageError: the tool refused an argument, no server answers at the URL, or it
            failed.
    """
    statuses: list[int] = []
    try:
        result = anyio.run(_call, server, tool, arguments, wait_s, statuses)
    except Exception as exc:  # the SDK's task groups wrap what failed in groups
        raise _failure(exc, server, statuses) from exc
    if result.is_error:
        raise _refusal(_text(result))
    return Reply(_text(result), result.structured_content or {})


async def _call(
    server: Server, tool: str, arguments: dict[str, Any], wait_s: float | None, statuses: list[int]
) -> CallToolResult:
    async def record(response: httpx2.Response) -> None:
        statuses.append(response.status_code)

    headers = {"Authorization": f"Bearer {server.token}"} if server.token else {}
    read_s = (wait_s if wait_s is not None else _NO_TIMEOUT_WAIT_S) + _SPARE_S
    timeout = httpx2.Timeout(_CONNECT_S, read=read_s)
    transport = httpx2.AsyncHTTPTransport(uds=str(server.uds)) if server.uds else None
    async with (
        httpx2.AsyncClient(
            headers=headers,
            timeout=timeout,
            event_hooks={"response": [record]},
            transport=transport,
        ) as http,
        Client(streamable_http_client(server.url, http_client=http)) as client,
    ):
        return await client.call_tool(tool, arguments)


def _failure(exc: Exception, server: Server, statuses: list[int]) -> CodecageError:
    """What went wrong, from the HTTP statuses seen and the exceptions the SDK raised."""
    leaves = list(_leaves(exc))
    if 401 in statuses and server.uds is not None:
        # The local server was replaced (its token with it) between reading the token and
        # the call: the call did not run; the next attempt reads the new token.
        return Unreachable(f"{server.where} refused the token", hint="try again")
    if 401 in statuses:
        given = "refused the token given" if server.token else "wants a token; none was given"
        return ConfigError(
            f"the server at {server.url} {given} (HTTP 401)",
            hint="pass the token its `codecage serve` was started with: --token TOKEN, or "
            "env CODECAGE_TOKEN",
        )
    if any(isinstance(leaf, httpx2.UnsupportedProtocol | httpx2.InvalidURL) for leaf in leaves):
        return ConfigError(
            f"--server {server.url!r} is not an http:// or https:// URL",
            hint="pass the URL `codecage serve --http` printed, e.g. http://127.0.0.1:8000/mcp",
        )
    if any(isinstance(leaf, httpx2.ConnectError | httpx2.ConnectTimeout) for leaf in leaves):
        address = server.uds or server.url
        return Unreachable(f"no codecage server answers at {address}", hint=START_HINT)
    if 503 in statuses and server.uds is not None:  # it is exiting, or at its connection cap
        return Unreachable(f"{server.where} is busy or exiting", hint="try again")
    if any(isinstance(leaf, httpx2.TimeoutException) for leaf in leaves):
        return CodecageError(
            f"{server.where} did not answer in time",
            hint="try again; a run that needs longer may ask for it with --timeout",
        )
    bad = [status for status in statuses if status >= 400]
    if bad:
        return CodecageError(
            f"{server.where} answered HTTP {bad[-1]}",
            hint="is --server the /mcp URL of a `codecage serve --http`? (e.g. "
            "http://127.0.0.1:8000/mcp)",
        )
    reason = next((str(leaf) for leaf in leaves if isinstance(leaf, MCPError)), None)
    reason = reason or "; ".join(f"{type(leaf).__name__}: {leaf}" for leaf in leaves)
    return CodecageError(
        f"the call to {server.uds or server.url} failed: {reason}", hint=START_HINT
    )


def _leaves(exc: BaseException) -> Iterator[BaseException]:
    """The exceptions inside (nested) exception groups, and their causes."""
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            yield from _leaves(inner)
        return
    yield exc
    if exc.__cause__ is not None:
        yield from _leaves(exc.__cause__)


def _refusal(message: str) -> CodecageError:
    """The tool's refusal: the server says what happened and what to do, in a model's terms;
    the same in the CLI's."""
    text = _CLI_WORD.sub(lambda match: _CLI_WORDS[match.group(1)], _TOOL_PREFIX.sub("", message))
    if "session" in text:
        return SessionError(text, hint="`codecage session list` shows your open sessions")
    return CodecageError(text, hint="")  # a bad argument: the message names it


def _text(result: CallToolResult) -> str:
    return "\n".join(block.text for block in result.content if isinstance(block, TextContent))
