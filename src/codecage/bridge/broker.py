"""The broker: the host's MCP client sessions to the upstream servers, shared by all runs.

The sandbox never talks to an upstream server: its tool calls reach a `RunTools` (one per
run, made by `Broker.for_run`) over the run's bridge channel (`codecage.bridge.channel`),
which checks the run's allow-list, puts real values back in place of tokens, and asks the
broker. The broker holds one session per upstream server, on one asyncio loop in a thread
of its own: started at the first call, reused across runs, started again when it died.
A hung call times out; a failing server's error reaches the agent's code as a
`ToolCallError`; neither stops the host.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import fnmatch
import logging
import os
import tempfile
import threading
import weakref
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any, TextIO

import httpx2
import mcp_types
from mcp import Client
from mcp.client.stdio import StdioServerParameters, stdio_client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError

from codecage import scrub as scrubbing
from codecage.bridge.channel import CallFailed, ToolAnswer
from codecage.bridge.upstreams import Upstream
from codecage.errors import ConfigError

log = logging.getLogger(__name__)

_START_TIMEOUT_S = 30.0
_STDERR_TAIL_BYTES = 2000
_WIND_DOWN_S = 1.0
_MAX_SSE_EVENT_BYTES = 16 * 1024 * 1024
_live_brokers: weakref.WeakSet[Broker] = weakref.WeakSet()


class Broker:
    """Sessions to the upstream servers in `servers`; `close()` ends them (also at exit)."""

    def __init__(self, servers: Mapping[str, Upstream]) -> None:
        self.servers = dict(servers)
        self._owner_pid = os.getpid()  # a forked child has the sessions' copies, not the loop
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="codecage-broker", daemon=True
        )
        self._thread.start()
        self._upstreams = {name: _Upstream(name, cfg) for name, cfg in self.servers.items()}
        self._closed = False
        _live_brokers.add(self)

    def secrets(self) -> list[str]:
        """The upstreams' credentials (env and header values): scrubbed from all output."""
        return [secret for server in self.servers.values() for secret in server.secrets()]

    def list_tools(self, server: str, timeout: float = 60.0) -> list[mcp_types.Tool]:
        """All tools of `server` (every page).

        Raises:
            ConfigError: no such server.
            CallFailed: the server could not be reached or failed.
        """
        upstream = self._upstream(server)
        tools: list[mcp_types.Tool] = self._submit(upstream.list_tools()).result(
            timeout=timeout + _START_TIMEOUT_S
        )
        return tools

    def call(self, server: str, tool: str, arguments: dict[str, Any]) -> Future[ToolAnswer]:
        """Call `tool` of `server`; the future fails with `CallFailed`."""
        try:
            upstream = self._upstream(server)
        except ConfigError:
            known = ", ".join(sorted(self.servers)) or "none"
            return _failed(
                CallFailed("unknown_server", f"no upstream server {server!r} (known: {known})")
            )
        return self._submit(upstream.call(tool, arguments))

    def for_run(
        self,
        *,
        allowed_tools: Sequence[str] | None = None,
        scrubber: scrubbing.Scrubber | None = None,
        tokenize: bool | None = None,
    ) -> RunTools:
        """The tools one run may use. `allowed_tools` ("server.tool" patterns, * allowed)
        narrows the servers' own allow-lists; `tokenize` (default: per server's config)
        swaps personal data in results for tokens that only this run's vault resolves."""
        return RunTools(self, allowed_tools, scrubber or scrubbing.Scrubber(), tokenize)

    def close(self) -> None:
        """End every session (stdio servers exit) and stop the loop; idempotent. (In a
        forked child: nothing; the sessions and the loop's thread are the parent's.)"""
        if self._closed or self._forked():
            return
        self._closed = True
        closing = [upstream.close() for upstream in self._upstreams.values()]
        with contextlib.suppress(Exception):
            self._submit(_gather(closing)).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
        if not self._thread.is_alive():
            self._loop.close()

    def __enter__(self) -> Broker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _upstream(self, server: str) -> _Upstream:
        upstream = self._upstreams.get(server)
        if upstream is None:
            known = ", ".join(sorted(self.servers)) or "none"
            raise ConfigError(f"no upstream server {server!r} is configured (known: {known})")
        return upstream

    def _forked(self) -> bool:
        return os.getpid() != self._owner_pid

    def _submit(self, coroutine: Any) -> Future[Any]:
        if self._forked():
            # The loop's thread did not survive the fork: a call would wait for nothing.
            coroutine.close()
            return _failed(
                CallFailed(
                    "upstream_error",
                    "this process was forked from the one that holds the upstream MCP "
                    "sessions; create the Broker (or the codecage process) after the fork",
                )
            )
        if self._closed and not self._loop.is_running():
            coroutine.close()
            return _failed(CallFailed("upstream_error", "the broker is closed"))
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop)


class RunTools:
    """One run's view of the broker: its allow-list, its token vault, its scrubber."""

    def __init__(
        self,
        broker: Broker,
        allowed_tools: Sequence[str] | None,
        scrubber: scrubbing.Scrubber,
        tokenize: bool | None,
    ) -> None:
        self._broker = broker
        self._allowed = tuple(allowed_tools) if allowed_tools is not None else None
        self._scrubber = scrubber
        self._tokenize = tokenize
        self._vault = scrubbing.Vault(scrubber)
        self._vault_lock = threading.Lock()

    def call_tool(self, server: str, tool: str, arguments: dict[str, Any]) -> Future[ToolAnswer]:
        refusal = self._refusal(server, tool)
        if refusal is not None:
            return _failed(refusal)
        tokenizing = self._tokenizing(server)
        if tokenizing:
            with self._vault_lock:
                arguments = dict(self._vault.detokenize(arguments))  # type: ignore[call-overload]
        future = self._broker.call(server, tool, arguments)
        if not tokenizing:
            return future
        result: Future[ToolAnswer] = Future()
        future.add_done_callback(lambda done: self._tokenized(done, result))
        return result

    def scrub(self, text: str) -> str:
        return self._scrubber.scrub(text).text

    def close(self) -> None:
        """Drop the run's token vault (its real values live nowhere else)."""
        with self._vault_lock:
            self._vault.clear()

    def _refusal(self, server: str, tool: str) -> CallFailed | None:
        config = self._broker.servers.get(server)
        if config is None:
            known = ", ".join(sorted(self._broker.servers)) or "none"
            return CallFailed("unknown_server", f"no upstream server {server!r} (known: {known})")
        name = f"{server}.{tool}"
        if config.allow_tools is not None and not _matches(tool, config.allow_tools):
            return CallFailed(
                "not_allowed",
                f"{name} is not on the server's allow-list ({', '.join(config.allow_tools)})",
            )
        if self._allowed is not None and not _matches(name, self._allowed):
            allowed = ", ".join(self._allowed) or "none"
            return CallFailed(
                "not_allowed", f"{name} is not among the tools this run may call ({allowed})"
            )
        return None

    def _tokenizing(self, server: str) -> bool:
        if self._tokenize is not None:
            return self._tokenize
        config = self._broker.servers.get(server)
        return config is not None and config.tokenize

    def _tokenized(self, done: Future[ToolAnswer], result: Future[ToolAnswer]) -> None:
        try:
            answer = done.result()
        except BaseException as exc:
            result.set_exception(exc)
            return
        with self._vault_lock:
            structured = self._vault.tokenize(answer.structured)
            text = self._vault.tokenize(answer.text)
        result.set_result(ToolAnswer(structured=structured, text=str(text)))


class _Upstream:
    """One upstream server's session, on the broker's loop."""

    def __init__(self, name: str, config: Upstream) -> None:
        self.name = name
        self.config = config
        self._client: Client | None = None
        self._task: asyncio.Task[None] | None = None
        self._stop: asyncio.Event | None = None
        self._starting: asyncio.Lock | None = None
        self._stderr: TextIO | None = None

    async def list_tools(self) -> list[mcp_types.Tool]:
        client = await self._session()
        tools: list[mcp_types.Tool] = []
        cursor: str | None = None
        for _ in range(1000):  # a server that pages forever is cut off
            page = await asyncio.wait_for(
                client.list_tools(cursor=cursor, cache_mode="bypass"), self.config.timeout
            )
            tools += page.tools
            cursor = page.next_cursor
            if not cursor:
                break
        return tools

    async def call(self, tool: str, arguments: dict[str, Any]) -> ToolAnswer:
        client = await self._session()
        try:
            result = await asyncio.wait_for(
                client.call_tool(tool, arguments, read_timeout_seconds=self.config.timeout),
                self.config.timeout,
            )
        except TimeoutError as exc:
            raise CallFailed(
                "timeout",
                f"{self.name}.{tool} did not answer within {self.config.timeout:g} s",
            ) from exc
        except CallFailed:
            raise
        except Exception as exc:
            died = _connection_closed(exc)
            if died:
                await self._end_session(client)
            message = self._failure(f"{self.name}.{tool}", exc, died=died)
            raise CallFailed("upstream_error", message) from exc
        return _answer(self.name, tool, result)

    async def _end_session(self, client: Client) -> None:
        """`client`'s connection closed (the server died): the SDK's session does not end
        by itself, so end it (the next call starts a new server) and give it a moment, so
        that its stderr holds the server's last words. Only once per session: the other
        calls that were in flight must not end the session started after it."""
        if self._client is not client:
            return
        self._client = None
        if self._stop is not None:
            self._stop.set()
        if self._task is not None and not self._task.done():
            await asyncio.wait({self._task}, timeout=_WIND_DOWN_S)

    async def close(self) -> None:
        if self._stop is not None:
            self._stop.set()
        if self._task is not None:
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await asyncio.wait_for(asyncio.shield(self._task), 5)
            if not self._task.done():
                self._task.cancel()
        if self._stderr is not None:
            self._stderr.close()

    async def _session(self) -> Client:
        if self._starting is None:
            self._starting = asyncio.Lock()
        async with self._starting:
            if self._client is not None and self._task is not None and not self._task.done():
                return self._client
            return await self._start()

    async def _start(self) -> Client:
        if self._task is not None:
            log.warning("broker.upstream_restart", extra={"server": self.name})
        self._client = None
        self._stop = asyncio.Event()
        started: asyncio.Future[Client] = asyncio.get_running_loop().create_future()
        self._task = asyncio.create_task(self._hold(started, self._stop))
        try:
            return await asyncio.wait_for(asyncio.shield(started), _START_TIMEOUT_S)
        except TimeoutError as exc:
            self._stop.set()
            self._task.cancel()
            raise CallFailed(
                "upstream_error",
                f"the upstream server {self.name!r} did not start within {_START_TIMEOUT_S:g} s",
            ) from exc
        except CallFailed:
            raise
        except Exception as exc:
            raise CallFailed(
                "upstream_error", self._failure(f"starting {self.name!r}", exc)
            ) from exc

    async def _hold(self, started: asyncio.Future[Client], stop: asyncio.Event) -> None:
        """Open the session, publish it, and keep it open until `stop` (or it breaks).
        Entering and leaving the SDK's context in this one task is what anyio requires."""
        mine: Client | None = None
        try:
            async with Client(
                self._transport(), list_roots_callback=self._roots_callback()
            ) as client:
                self._client = mine = client
                started.set_result(client)
                log.info("broker.upstream_started", extra={"server": self.name})
                await stop.wait()
        except BaseException as exc:
            if not started.done():
                started.set_exception(exc if isinstance(exc, Exception) else RuntimeError(exc))
            log.warning(
                "broker.upstream_ended", extra={"server": self.name, "error": repr(exc)[:300]}
            )
            if isinstance(exc, asyncio.CancelledError):
                raise
        finally:
            if self._client is mine:  # not a session started after this one ended
                self._client = None

    def _transport(self) -> Any:
        config = self.config
        if config.url is not None:
            http = httpx2.AsyncClient(headers=config.headers, timeout=config.timeout)
            return streamable_http_client(
                config.url, http_client=http, max_sse_event_size=_MAX_SSE_EVENT_BYTES
            )
        if self._stderr is None:
            # The server's stderr goes to a file: its tail explains a crash to the caller.
            self._stderr = tempfile.TemporaryFile("w+", encoding="utf-8", errors="replace")  # noqa: SIM115 - lives as long as the session
        params = StdioServerParameters(
            command=config.command or "",
            args=list(config.args),
            env=config.env or None,
            cwd=config.cwd,
        )
        return stdio_client(params, errlog=self._stderr)

    def _roots_callback(self) -> Any:
        if not self.config.roots:
            return None
        roots = [
            mcp_types.Root(uri=Path(root).resolve().as_uri(), name=Path(root).name)
            for root in self.config.roots
        ]

        async def list_roots(_context: Any) -> mcp_types.ListRootsResult:
            return mcp_types.ListRootsResult(roots=roots)

        return list_roots

    def _failure(self, what: str, exc: BaseException, *, died: bool = False) -> str:
        message = _describe(exc)
        if died or (self._task is not None and self._task.done()):
            tail = self._stderr_tail()
            message = f"the upstream server {self.name!r} died ({message})" + (
                f"; its last words: {tail}" if tail else ""
            )
        return f"{what} failed: {message}"[:4000]

    def _stderr_tail(self) -> str:
        if self._stderr is None:
            return ""
        with contextlib.suppress(OSError, ValueError):
            self._stderr.flush()
            size = self._stderr.seek(0, 2)
            self._stderr.seek(max(0, size - _STDERR_TAIL_BYTES))
            return " ".join(self._stderr.read().split())[-_STDERR_TAIL_BYTES:]
        return ""


def _answer(server: str, tool: str, result: mcp_types.CallToolResult) -> ToolAnswer:
    text = "\n".join(_content_text(item) for item in result.content)
    if result.is_error:
        raise CallFailed("tool_error", f"{server}.{tool} reported an error: {text}"[:4000])
    return ToolAnswer(structured=result.structured_content, text=text)


def _content_text(item: Any) -> str:
    if isinstance(item, mcp_types.TextContent):
        return item.text
    if isinstance(item, mcp_types.EmbeddedResource):
        resource = item.resource
        return getattr(resource, "text", None) or f"[resource {resource.uri}]"
    if isinstance(item, mcp_types.ImageContent | mcp_types.AudioContent):
        return f"[{item.type}: {item.mime_type}, {len(item.data) * 3 // 4} bytes]"
    return f"[{getattr(item, 'type', 'content')}]"


def _describe(exc: BaseException) -> str:
    if isinstance(exc, BaseExceptionGroup):
        return "; ".join(_describe(inner) for inner in exc.exceptions[:3])
    return f"{type(exc).__name__}: {exc}"[:1000] if str(exc) else type(exc).__name__


def _connection_closed(exc: BaseException) -> bool:
    return isinstance(exc, MCPError) and exc.error.code == mcp_types.CONNECTION_CLOSED


def _matches(name: str, patterns: Iterable[str]) -> bool:
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in patterns)


def _failed(error: BaseException) -> Future[Any]:
    future: Future[Any] = Future()
    future.set_exception(error)
    return future


async def _gather(coroutines: list[Any]) -> None:
    await asyncio.gather(*coroutines, return_exceptions=True)


@atexit.register
def _close_live_brokers() -> None:
    for broker in list(_live_brokers):
        broker.close()
