"""codecage as an MCP server: `execute_code`, `validate_code`, `get_sandbox_info`.

Built on the official SDK's `MCPServer`, over one host runtime (`codecage.host`) that every
call shares. The parts: `tools` (the tools' bodies and replies), `arguments` (argument
checks, refusals, the per-call log line), `runner` (the queue and one run), `files`
(uploads and what is read back), `reply` (fitting a reply into its budget), `http`
(HTTP auth and limits), `stdio` (the stdio transport).
"""

from __future__ import annotations

import dataclasses
import logging
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import anyio
from mcp.server.mcpserver import MCPServer
from pydantic import ValidationError

from codecage import host as hosts
from codecage._version import __version__
from codecage.audit.metrics import ServerMetrics
from codecage.errors import ConfigError
from codecage.host import Host
from codecage.mcp import health, run_code, tools
from codecage.mcp import http as http_serving
from codecage.mcp.clients import ClientLimits, ClientTokens
from codecage.mcp.runner import Runner
from codecage.mcp.runner import ServerLimits as ServerLimits  # built by serve and by tests
from codecage.models import ClientSettings, ServeSettings
from codecage.options import Options

log = logging.getLogger(__name__)

# HTTP request bodies (the SDK's default is 4 MiB): room for the largest uploads as base64,
# and for oversized code to reach the tool and get its readable error, not an HTTP 413.
MAX_HTTP_BODY_BYTES = 32 * 1024 * 1024

INSTRUCTIONS = """\
codecage runs Python in a throwaway, isolated Linux sandbox: no host files, no network \
beyond the hosts the operator allows (execute_code's allow_hosts), bounded time, memory and \
processes. Use execute_code to compute, analyse data and transform \
files; print what you need to see, or end the code with an expression to get its value. \
The working directory /workspace starts empty: upload inputs with `files`, and files the code \
writes there are listed in the result (images and plt.show() charts come back as images). \
For several steps over the same data, open_session once and pass its session_id to \
execute_code: variables, imports and files then persist between calls. Use validate_code to \
check code without running it, and get_sandbox_info for the profiles and limits."""


_RUNNERS: weakref.WeakKeyDictionary[MCPServer, Runner] = weakref.WeakKeyDictionary()
"""The runner each server of `build_server` calls through: its HTTP faces (/run_code) share
it, so a client's limits, counts and queue are one whatever face it calls."""


def build_server(
    runtime: Host | None = None,
    *,
    limits: ServerLimits | None = None,
    metrics: ServerMetrics | None = None,
) -> MCPServer:
    """The MCP server, ready for `run()` (stdio) or `streamable_http_app()`.

    Args:
        runtime: the one host every call runs in, with its settings, backend, pool, tools
            and defaults (`codecage serve` builds it from its flags with `host.build`);
            None: one with a pool and the config found. The calls' hints name the tools'
            arguments whatever face the host was made for.
        limits: what one call may ask for at most.
        metrics: counts the queue into these; they count the runs as an observer of
            `runtime` (`health.server_metrics`, passed to `host.build`); None: nothing
            counted.

    Raises:
        ConfigError: the config file or environment is invalid, or reply_max_tokens is out
            of its bounds.
        HostError: this host cannot run sandboxes.
    """
    server_limits = limits or ServerLimits()
    base = runtime or hosts.build(Options(pool=True, face="mcp").resolve())
    budget = server_limits.reply_max_tokens
    if budget is None:
        budget = base.settings.serve.reply_max_tokens
    try:
        ServeSettings(reply_max_tokens=budget)
    except ValidationError as exc:
        raise ConfigError(
            f"reply_max_tokens={budget}: {exc.errors()[0]['msg']}",
            hint="set {reply_max_tokens} from 2000 to 240000 (the default is 20000)",
        ) from exc
    server_limits = dataclasses.replace(server_limits, reply_max_tokens=budget)
    alerter = base.alerter
    runner = Runner(
        host=base,
        limits=server_limits,
        slots=anyio.Semaphore(server_limits.max_concurrent),
        client_limits=ClientLimits(
            base.settings.serve.clients,
            on_refused=alerter.client_blocked if alerter is not None else None,
        ),
    )
    if metrics is not None:
        _count_into(metrics, runner)
    server = MCPServer(
        name="codecage",
        version=__version__,
        instructions=INSTRUCTIONS,
        log_level="WARNING",  # the SDK's rich INFO handler would cost ~1 ms per run's log line
        tools=tools.tools(runner),
    )
    _RUNNERS[server] = runner
    log.info(
        "server.start",
        extra={
            "backend": base.backend.name,
            "profile": base.settings.profile,
            "pool": base.pool is not None,
            "default_limits": base.limits.model_dump(mode="json"),
            "max_timeout": server_limits.max_timeout,
            "max_memory_mb": server_limits.max_memory_mb,
            "max_concurrent": server_limits.max_concurrent,
            "max_queued": server_limits.max_queued,
            "reply_max_tokens": server_limits.reply_max_tokens,
            "tool_servers": sorted(base.tools.servers) if base.tools is not None else [],
            "config_file": str(base.settings.config_file) if base.settings.config_file else None,
            "config_origin": base.settings.config_origin,
            "scrub": base.scrub_settings.enabled,
        },
    )
    return server


def _count_into(metrics: ServerMetrics, runner: Runner) -> None:
    """Feed `metrics` from `runner`: its queue's waits, and its limiter's depth and slots
    in use, read at each scrape (the runs it counts as an observer of the host)."""
    slots, most = runner.slots, runner.limits.max_concurrent
    runner.metrics = metrics
    metrics.watch_queue(lambda: runner.waiting, lambda: most - slots.value)


# --- HTTP -----------------------------------------------------------------------------------

LOOPBACK_HOSTS = frozenset({"127.0.0.1", "::1", "localhost"})


def http_app(
    server: MCPServer,
    *,
    host: str,
    token: str | None,
    insecure_no_token: bool = False,
    runtime: Host | None = None,
    metrics: ServerMetrics | None = None,
    metrics_public: bool = False,
    clients: Mapping[str, ClientSettings] | None = None,
    wrap: Callable[[Any, Runner], Any] | None = None,
) -> Any:
    """The streamable HTTP app at /mcp (DNS-rebinding protection from the SDK), behind
    `http_serving.RequestGate`: the bearer token checked before any body is read, and
    bounded bodies. Sessions are capped (the idle longest is closed for a new one).

    Given the server's `runtime`: /healthz and /readyz, without a token; given `metrics`
    too: /metrics, behind the token unless `metrics_public` (mcp/health.py); and
    SandboxFusion's POST /run_code behind the token, through the server's own runner (its
    queue, each named client's limits and counts, the audit caller: mcp/run_code.py).
    `wrap(app, runner)` puts another endpoint behind the token (the local server's
    `codecage run` hand-off).

    A token is required: on loopback too, any local user could otherwise run code, and call
    the upstream tools with the operator's credentials. `insecure_no_token` (the CLI's
    `--insecure-no-token`) waives it on loopback only.

    Raises:
        ConfigError: no token, and not waived (or not on loopback); a named client's
            token variable is unset or empty, or two clients share a token.
    """
    tokens = http_tokens(host, token, insecure_no_token, clients)
    if tokens is None:
        log.warning("server.http_without_token", extra={"host": host})
    app = server.streamable_http_app(
        host=host,
        max_request_body_size=MAX_HTTP_BODY_BYTES,
        max_sessions=http_serving.MAX_SESSIONS,
        session_idle_timeout=http_serving.SESSION_IDLE_TIMEOUT,
    )
    http_serving.evict_idle_sessions_at_cap(server.session_manager)
    routes = health.routes(runtime, metrics) if runtime is not None else {}
    public = {p: r for p, r in routes.items() if p != "/metrics" or metrics_public}
    private = {p: r for p, r in routes.items() if p not in public}
    inner: Any = health.Endpoints(app, private) if private else app
    if runtime is not None:
        inner = run_code.RunCode(inner, _runner_of(server))
    if wrap is not None:  # another face's endpoint behind the gate (cli/handoff_endpoint.py)
        inner = wrap(inner, _runner_of(server))
    gated = http_serving.RequestGate(
        inner,
        tokens=tokens,
        max_body_bytes=MAX_HTTP_BODY_BYTES,
    )
    return health.Endpoints(gated, public) if public else gated


def http_tokens(
    host: str,
    token: str | None,
    insecure_no_token: bool,
    clients: Mapping[str, ClientSettings] | None,
) -> ClientTokens | None:
    """The tokens `http_app` will require (None: none, waived on loopback). The CLI asks
    first, before it builds the host whose warm pool starts sandboxes at once: a refusal
    then leaves nothing running (and nothing for the exit to stop).

    Raises:
        ConfigError: no token, and not waived (or not on loopback); a named client's
            token variable is unset or empty, or two clients share a token.
    """
    tokens = ClientTokens.load(clients or {}, token)
    if tokens is None:
        if host not in LOOPBACK_HOSTS:
            raise ConfigError(
                f"refusing to serve on {host} without a token: anyone who reaches it could "
                "run code here",
                hint="pass --token (or set CODECAGE_TOKEN), or bind 127.0.0.1",
            )
        if not insecure_no_token:
            raise ConfigError(
                "refusing to serve HTTP without a token: every local user of this machine "
                "could run code and call the upstream tools with your credentials",
                hint='pass --token "$(openssl rand -hex 16)" (or set CODECAGE_TOKEN) and send '
                "'Authorization: Bearer <token>'; or --insecure-no-token to accept the risk",
            )
    return tokens


def _runner_of(server: MCPServer) -> Runner:
    """The runner `build_server` made `server` with.

    Raises:
        ConfigError: `server` was not made by `build_server`.
    """
    runner = _RUNNERS.get(server)
    if runner is None:
        raise ConfigError(
            "this MCP server was not made by codecage's build_server: /run_code has no runner",
            hint="make the server with codecage.mcp.server.build_server",
        )
    return runner
