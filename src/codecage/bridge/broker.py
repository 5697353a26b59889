"""The broker: the host's MCP client sessions to the upstream servers, shared by all runs.

The sandbox never talks to an upstream server: its tool calls reach a `RunTools` (one per
run, made by `Broker.for_run`) over the run's bridge channel (`codecage.bridge.channel`),
which checks the run's allow-list, puts real values back in place of tokens, and asks the
broker. The broker holds one session per upstream server, on one asyncio loop in a thread
of its own: started at the first call, reused across runs, started again when it died.
A hung call times out; a failing server's error reaches the agent's code as a
`ToolCallError`; neither stops the host.

What the guest sends is checked before any library sees it: a server or tool name must be
short, allowed, and one the upstream listed in this session (the SDK would otherwise send
it upstream and log it). What an upstream sends is bounded while it is read (HTTP bodies
and SSE events, stdio lines: `_MAX_MESSAGE_BYTES`), and every outcome of a call, answer or
failure, passes one point (`RunTools._deliver`) on its way to the code.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any, TextIO

import httpx2
import mcp_types
from mcp import Client
from mcp.client.stdio import StdioServerParameters
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError

from codecage import forks
from codecage.bridge.channel import CallFailed, ToolAnswer
from codecage.bridge.sandboxed import sandboxed_stdio_client
from codecage.bridge.stdio_client import bounded_stdio_client
from codecage.bridge.tooling import ToolPattern, allow_patterns, name_matches
from codecage.bridge.upstreams import Upstream
from codecage.egress.records import ConnectionRecord
from codecage.egress.servers import ServerEgress
from codecage.errors import ConfigError
from codecage.models import NetworkSettings
from codecage.output import neutralise_text
from codecage.policy import scrub as scrubbing
from codecage.policy.approval import JudgedTools, ToolReach

log = logging.getLogger(__name__)

_START_TIMEOUT_S = 30.0
_STDERR_TAIL_BYTES = 2000
_WIND_DOWN_S = 1.0
# The largest message read from an upstream (an HTTP body, an SSE event, a stdio line):
# a result may be up to 64 MiB ([tools] max_result_mb's ceiling), plus its envelope.
_MAX_MESSAGE_BYTES = 65 * 1024 * 1024
# The longest server or tool name passed on (MCP recommends at most 128 characters).
_MAX_NAME_CHARS = 256
_RELIST_S = 30.0  # a name the upstream did not list lists its tools again, at most this often
_LOG_CHARS = 300  # of a text from the guest or an upstream, in a log record


class Broker:
    """Sessions to the upstream servers in `servers`; `close()` ends them (also at exit)."""

    def __init__(
        self,
        servers: Mapping[str, Upstream],
        *,
        network: NetworkSettings | None = None,
        config_dir: Path | None = None,
    ) -> None:
        """`network`: the `[network]` settings a sandboxed server's `allow_hosts` go
        through (its deny, limits, credentials, resolver); default: none of those."""
        self.servers = dict(servers)
        # The proxy of the sandboxed servers allowed hosts (made at the first one started).
        self.egress = ServerEgress(network or NetworkSettings(), base_dir=config_dir)
        self._process = forks.ForkGuard()  # a forked child has the sessions' copies, not the loop
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="codecage-broker", daemon=True
        )
        self._thread.start()
        # The credentials are scrubbed from the failures the broker words itself (an
        # upstream's exception, its stderr's last words): the code was never given them.
        credentials = scrubbing.Scrubber(
            scrubbing.ScrubConfig(
                categories=frozenset(),
                secrets=tuple(
                    s for s in self.secrets() if len(s.strip()) >= scrubbing.MIN_SECRET_CHARS
                ),
            )
        )
        self._upstreams = {
            name: _Upstream(name, cfg, credentials, self.egress)
            for name, cfg in self.servers.items()
        }
        self._closed = False
        forks.close_at_exit(self)  # stdio upstream servers exit with the host

    def secrets(self) -> list[str]:
        """The upstreams' credentials (env and header values): scrubbed from all output."""
        return [secret for server in self.servers.values() for secret in server.secrets()]

    def list_tools(self, server: str, timeout: float = 60.0) -> list[mcp_types.Tool]:
        """All tools of `server` (every page).

        Raises:
            ConfigError: no such server.
            CallFailed: the server could not be reached, failed, or did not answer in time.
        """
        upstream = self._upstream(server)
        try:
            tools: list[mcp_types.Tool] = self._submit(upstream.list_tools()).result(
                timeout=timeout + _START_TIMEOUT_S
            )
        except TimeoutError as exc:  # a page's own timeout, or this wait
            # The SDK drops an answer it cannot parse (JSON nested too deep, say) and waits on.
            raise CallFailed(
                "timeout",
                f"the upstream server {server!r} did not list its tools in time (an answer "
                "it sent may have been unreadable: see the log)",
            ) from exc
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
        judged: JudgedTools | None = None,
    ) -> RunTools:
        """The tools one run may use. `allowed_tools` ("server.tool" patterns, see
        `codecage.bridge.tooling.ToolPattern`) narrows the servers' own allow-lists;
        `tokenize` (default: per server's config) swaps personal data in results for
        tokens that only this run's vault resolves; `judged` (when [approval] is on): the
        tools the run was judged by, the only ones it may call.

        Raises:
            ConfigError: an allow-list pattern that does not name a server and a tool.
        """
        return RunTools(
            self, allow_patterns(allowed_tools), scrubber or scrubbing.Scrubber(), tokenize, judged
        )

    def reachable_tools(
        self, allowed_tools: Sequence[str] | None = None, timeout: float = 60.0
    ) -> list[ToolReach]:
        """The tools a run with `allowed_tools` may call (the servers' allow-lists and the
        run's, as `RunTools` checks them), each with what its MCP annotations say: what
        [approval] judges a run by. A server whose tools cannot be listed counts as one
        tool with every effect (an unknown tool is not taken to be harmless).

        Raises:
            ConfigError: an allow-list pattern that does not name a server and a tool.
        """
        patterns = allow_patterns(allowed_tools)
        found: list[ToolReach] = []
        for server, config in sorted(self.servers.items()):
            if patterns is not None and not any(name_matches(server, p.server) for p in patterns):
                continue
            try:
                tools = self.list_tools(server, timeout)
            except (CallFailed, ConfigError) as exc:
                log.warning(
                    "broker.unlisted_for_approval",
                    extra={"server": server, "error": str(exc)[:_LOG_CHARS]},
                )
                found.append(ToolReach(name=f"{server}.*", listed=False, server=server))
                continue
            for tool in tools:
                if config.allow_tools is not None and not any(
                    name_matches(tool.name, pattern) for pattern in config.allow_tools
                ):
                    continue
                if patterns is not None and not any(p.matches(server, tool.name) for p in patterns):
                    continue
                found.append(_reach(server, tool))
        return found

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
        self.egress.close()

    def network_records(self, server: str) -> list[ConnectionRecord]:
        """The connections sandboxed server `server` made through the proxy (its stopped
        sandboxes'; each also logged as `egress.upstream_connection`)."""
        return self.egress.records(server)

    def __enter__(self) -> Broker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _upstream(self, server: str) -> _Upstream:
        upstream = self._upstreams.get(server)
        if upstream is None:
            known = ", ".join(sorted(self.servers)) or "none"
            raise ConfigError(
                f"no upstream server {server!r} is configured (known: {known})", hint=""
            )
        return upstream

    def _forked(self) -> bool:
        return not self._process.owned_here()

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


def _reach(server: str, tool: mcp_types.Tool) -> ToolReach:
    """A listed tool's effects by its annotations, MCP's defaults where it says nothing
    (a hint is the server's claim: only a read-only claim lowers what counts)."""
    hints = tool.annotations
    read_only = hints is not None and hints.read_only_hint is True
    destructive = hints is None or hints.destructive_hint is not False
    open_world = hints is None or hints.open_world_hint is not False
    return ToolReach(
        name=f"{server}.{_shown(tool.name)}",
        read_only=read_only,
        destructive=destructive and not read_only,
        open_world=open_world,
        server=server,
        tool=tool.name,
    )


class RunTools:
    """One run's view of the broker: its allow-list, its token vault, its scrubber, and its
    calls still running upstream (cancelled when the run ends)."""

    def __init__(
        self,
        broker: Broker,
        allowed_tools: Sequence[ToolPattern] | None,
        scrubber: scrubbing.Scrubber,
        tokenize: bool | None,
        judged: JudgedTools | None = None,
    ) -> None:
        self._broker = broker
        self._allowed = tuple(allowed_tools) if allowed_tools is not None else None
        self._judged = judged
        self._scrubber = scrubber
        self._tokenize = tokenize
        self._vault = scrubbing.Vault(scrubber)
        self._vault_lock = threading.Lock()
        self._pending: set[Future[ToolAnswer]] = set()
        self._pending_lock = threading.Lock()
        self._closed = False

    def call_tool(self, server: str, tool: str, arguments: dict[str, Any]) -> Future[ToolAnswer]:
        refusal = self._refusal(server, tool)
        if refusal is not None:
            return _failed(refusal)
        tokenizing = self._tokenizing(server)
        if tokenizing:
            with self._vault_lock:
                arguments = dict(self._vault.detokenize(arguments))  # type: ignore[call-overload]
        with self._pending_lock:
            if self._closed:
                return _failed(CallFailed("upstream_error", "the run is over"))
            upstream = self._broker.call(server, tool, arguments)
            self._pending.add(upstream)
        result: Future[ToolAnswer] = Future()
        upstream.add_done_callback(lambda done: self._deliver(done, result, tokenizing))
        return result

    def scrub(self, text: str) -> str:
        # The detectors only, never the configured secrets: `without_secrets` says why.
        return self._scrubber.without_secrets().scrub(text).text

    def close(self) -> None:
        """The run is over: cancel its calls still running upstream (the SDK tells the
        server with `notifications/cancelled`) and drop its token vault (its real values
        live nowhere else)."""
        with self._pending_lock:
            self._closed = True
            pending, self._pending = self._pending, set()
        for future in pending:
            future.cancel()
        with self._vault_lock:
            self._vault.clear()

    def _refusal(self, server: str, tool: str) -> CallFailed | None:
        """Checks made before anything reaches the broker (whose upstream then checks that
        the tool is one the server listed)."""
        if len(server) > _MAX_NAME_CHARS or len(tool) > _MAX_NAME_CHARS:
            return CallFailed(
                "bad_request", f"a server or tool name is over {_MAX_NAME_CHARS} characters"
            )
        config = self._broker.servers.get(server)
        if config is None:
            known = ", ".join(sorted(self._broker.servers)) or "none"
            return CallFailed(
                "unknown_server", f"no upstream server '{_shown(server)}' (known: {known})"
            )
        name = f"{server}.{_shown(tool)}"
        if config.allow_tools is not None and not any(
            name_matches(tool, pattern) for pattern in config.allow_tools
        ):
            return CallFailed(
                "not_allowed",
                f"{name} is not on the server's allow-list ({', '.join(config.allow_tools)})",
            )
        if self._allowed is not None and not any(p.matches(server, tool) for p in self._allowed):
            allowed = ", ".join(map(str, self._allowed)) or "none"
            return CallFailed(
                "not_allowed", f"{name} is not among the tools this run may call ({allowed})"
            )
        if self._judged is not None and not self._judged.allows(server, tool):
            return CallFailed(
                "not_allowed",
                f"{name} was not listed when this run was judged for approval (the server "
                "added it since): run again to have it judged",
            )
        return None

    def _tokenizing(self, server: str) -> bool:
        if self._tokenize is not None:
            return self._tokenize
        config = self._broker.servers.get(server)
        return config is not None and config.tokenize

    def _deliver(
        self, done: Future[ToolAnswer], result: Future[ToolAnswer], tokenizing: bool
    ) -> None:
        """The one point where an upstream's outcome becomes what the code receives:
        an answer and a failure alike. A failure's message can hold what the call's
        arguments held (a tool that says "no such user alice@example.com"), and the
        arguments carried the real values in place of the tokens; so, when tokenizing,
        the message passes the vault as an answer does, or the error path would hand the
        code the personal data the tokens stand for."""
        with self._pending_lock:
            self._pending.discard(done)
        outcome: ToolAnswer | CallFailed
        if done.cancelled():
            outcome = CallFailed("upstream_error", "the call was cancelled: the run is over")
        else:
            try:
                outcome = done.result()
            except CallFailed as exc:
                outcome = exc
            except Exception as exc:  # a broker bug: still an answer, never a raw message
                log.exception("broker.call_failed")
                outcome = CallFailed("upstream_error", f"the call failed ({type(exc).__name__})")
        if tokenizing:
            with self._vault_lock:
                if isinstance(outcome, ToolAnswer):
                    outcome = ToolAnswer(
                        structured=self._vault.tokenize(outcome.structured),
                        text=str(self._vault.tokenize(outcome.text)),
                    )
                else:
                    outcome = CallFailed(outcome.kind, str(self._vault.tokenize(outcome.message)))
        if isinstance(outcome, CallFailed):
            result.set_exception(outcome)
        else:
            result.set_result(outcome)


class _Upstream:
    """One upstream server's session, on the broker's loop."""

    def __init__(
        self,
        name: str,
        config: Upstream,
        credentials: scrubbing.Scrubber,
        egress: ServerEgress | None = None,
    ) -> None:
        self.name = name
        self.config = config
        self._egress = egress
        self._credentials = credentials
        # The names of the tools this session listed: a call to any other name is refused
        # before the SDK sees it (it would send it upstream, and log it when the server
        # answers). Per session: a restarted server is listed again.
        self._listed: frozenset[str] | None = None
        self._listed_by: Client | None = None
        self._listed_at = 0.0
        self._listing: asyncio.Lock | None = None
        self._overflow = False  # this session's server sent a line over the bound
        self._client: Client | None = None
        self._task: asyncio.Task[None] | None = None
        self._stop: asyncio.Event | None = None
        self._starting: asyncio.Lock | None = None
        self._stderr: TextIO | None = None

    async def list_tools(self) -> list[mcp_types.Tool]:
        client = await self._session()
        tools = await self._list_pages(client)
        self._remember(tools, client)
        return tools

    def _remember(self, tools: list[mcp_types.Tool], client: Client) -> frozenset[str]:
        self._listed = listed = frozenset(tool.name for tool in tools)
        self._listed_by, self._listed_at = client, time.monotonic()
        return listed

    async def _listed_names(self, client: Client, tool: str) -> frozenset[str]:
        """The tool names this session listed. A name not among them lists the tools again
        if the listing is older than `_RELIST_S` (a server may add tools): at most that
        often, whatever names the code tries."""
        if self._listing is None:
            self._listing = asyncio.Lock()
        async with self._listing:
            stale = time.monotonic() - self._listed_at > _RELIST_S
            if (
                self._listed is None
                or self._listed_by is not client
                or (tool not in self._listed and stale)
            ):
                return self._remember(await self._list_pages(client), client)
            return self._listed

    async def _list_pages(self, client: Client) -> list[mcp_types.Tool]:
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
        if len(tool) > _MAX_NAME_CHARS:
            raise CallFailed("bad_request", f"a tool name is over {_MAX_NAME_CHARS} characters")
        client = await self._session()
        try:
            listed = await self._listed_names(client, tool)
            if tool not in listed:
                raise CallFailed(
                    "not_allowed",
                    f"{self.name!r} lists no tool '{_shown(tool)}' (it lists "
                    f"{len(listed)}: {', '.join(sorted(listed)[:20])}"
                    f"{', ...' if len(listed) > 20 else ''})",
                )
            result = await asyncio.wait_for(
                client.call_tool(tool, arguments, read_timeout_seconds=self.config.timeout),
                self.config.timeout,
            )
        except TimeoutError as exc:
            raise CallFailed(
                "timeout",
                f"{self.name}.{_shown(tool)} did not answer within {self.config.timeout:g} s",
            ) from exc
        except CallFailed:
            raise
        except Exception as exc:
            died = _connection_closed(exc)
            if died:
                await self._end_session(client)
            message = self._failure(f"{self.name}.{_shown(tool)}", exc, died=died)
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
        self._overflow = False
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
                "broker.upstream_ended",
                extra={"server": self.name, "error": _for_log(self._credentials_out(repr(exc)))},
            )
            if isinstance(exc, asyncio.CancelledError):
                raise
        finally:
            if self._client is mine:  # not a session started after this one ended
                self._client = None

    def _transport(self) -> Any:
        config = self.config
        if config.url is not None:
            # Uncompressed answers only: a body's size must be counted as it will be held
            # (a few MiB of gzip inflate to gigabytes). `_BoundedClient` bounds them.
            http = _BoundedClient(
                limit=_MAX_MESSAGE_BYTES,
                headers={"Accept-Encoding": "identity", **config.headers},
                timeout=config.timeout,
            )
            return streamable_http_client(
                config.url, http_client=http, max_sse_event_size=_MAX_MESSAGE_BYTES
            )
        if self._stderr is None:
            # The server's stderr goes to a file: its tail explains a crash to the caller.
            self._stderr = tempfile.TemporaryFile("w+", encoding="utf-8", errors="replace")  # noqa: SIM115 - lives as long as the session
        if config.sandbox:
            return sandboxed_stdio_client(
                self.name,
                config,
                self._stderr,
                max_line_bytes=_MAX_MESSAGE_BYTES,
                on_overflow=self._overflowed,
                egress=self._egress,
            )
        params = StdioServerParameters(
            command=config.command or "",
            args=list(config.args),
            env=config.env or None,
            cwd=config.cwd,
        )
        return bounded_stdio_client(
            params,
            self._stderr,
            max_line_bytes=_MAX_MESSAGE_BYTES,
            on_overflow=self._overflowed,
        )

    def _overflowed(self) -> None:
        self._overflow = True
        log.warning(
            "broker.upstream_message_too_large",
            extra={"server": self.name, "limit_bytes": _MAX_MESSAGE_BYTES},
        )

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
        if self._overflow:
            message = (
                f"it sent a message over {_MAX_MESSAGE_BYTES // (1024 * 1024)} MiB, which the"
                f" broker does not read; the connection was ended ({message})"
            )
        if died or (self._task is not None and self._task.done()):
            tail = self._stderr_tail()
            message = f"the upstream server {self.name!r} died ({message})" + (
                f"; its last words: {tail}" if tail else ""
            )
        return self._credentials_out(f"{what} failed: {message}"[:4000])

    def _credentials_out(self, text: str) -> str:
        return self._credentials.scrub(text).text if self._credentials.active else text

    def _stderr_tail(self) -> str:
        if self._stderr is None:
            return ""
        with contextlib.suppress(OSError, ValueError):
            self._stderr.flush()
            size = self._stderr.seek(0, 2)
            self._stderr.seek(max(0, size - _STDERR_TAIL_BYTES))
            return " ".join(self._stderr.read().split())[-_STDERR_TAIL_BYTES:]
        return ""


class UpstreamTooLarge(httpx2.StreamError):
    """An upstream's HTTP answer was over the size the broker reads, or compressed."""


class _BoundedClient(httpx2.AsyncClient):
    """httpx's client, with each response body bounded while it is read.

    The SDK reads a JSON answer whole (`response.aread()`) before anything checks its
    size: an upstream answering with 1.5 GB took the host to 4.75 GB. Here a body stops
    at `limit` bytes: the read fails with `UpstreamTooLarge` (an `httpx.StreamError`, which
    the SDK turns into an error answer to that one request). An SSE stream is exempt from
    the total (it lives as long as the session) but not from the bound on each of its
    events (`max_sse_event_size`). A compressed body is refused: what counts is what it
    inflates to. Bounding at `send` covers every transport the client picks (a proxy's
    from the environment too)."""

    def __init__(self, *, limit: int, **options: Any) -> None:
        super().__init__(**options)
        self._limit = limit

    async def send(
        self, request: httpx2.Request, *, stream: bool = False, **options: Any
    ) -> httpx2.Response:
        response = await super().send(request, stream=True, **options)
        encoding = response.headers.get("content-encoding", "identity").strip().lower()
        content_type = response.headers.get("content-type", "").lower()
        if encoding not in ("", "identity"):
            response.stream = _RefusedStream(
                response.stream, f"a compressed answer ({encoding[:40]!r}) was refused"
            )
        elif not content_type.startswith("text/event-stream"):
            response.stream = _BoundedStream(response.stream, self._limit)
        if not stream:
            try:
                await response.aread()
            except BaseException:
                await response.aclose()
                raise
        return response


class _BoundedStream(httpx2.AsyncByteStream):
    def __init__(self, inner: Any, limit: int) -> None:
        self._inner = inner
        self._limit = limit

    async def __aiter__(self) -> AsyncIterator[bytes]:
        read = 0
        async for chunk in self._inner:
            read += len(chunk)
            if read > self._limit:
                raise UpstreamTooLarge(
                    f"the upstream's answer is over {self._limit // (1024 * 1024)} MiB"
                )
            yield chunk

    async def aclose(self) -> None:
        await self._inner.aclose()


class _RefusedStream(httpx2.AsyncByteStream):
    def __init__(self, inner: Any, reason: str) -> None:
        self._inner = inner
        self._reason = reason

    async def __aiter__(self) -> AsyncIterator[bytes]:
        raise UpstreamTooLarge(self._reason)
        yield b""  # pragma: no cover - makes this an async generator

    async def aclose(self) -> None:
        await self._inner.aclose()


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


def _shown(name: str) -> str:
    """A guest-chosen name as a message shows it: bounded, on one line, neutralised."""
    return _for_log(name[:100]) + ("..." if len(name) > 100 else "")


def _for_log(text: str) -> str:
    """A text from the guest or an upstream as a log record holds it: bounded, and no
    character (a newline, an escape) that could forge a line or act on a terminal."""
    return neutralise_text(text[:_LOG_CHARS]).replace("\n", "\\n").replace("\t", "\\t")


def _failed(error: BaseException) -> Future[Any]:
    future: Future[Any] = Future()
    future.set_exception(error)
    return future


async def _gather(coroutines: list[Any]) -> None:
    await asyncio.gather(*coroutines, return_exceptions=True)
