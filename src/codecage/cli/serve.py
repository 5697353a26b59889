"""`codecage serve`: codecage as an MCP server, over stdio or streamable HTTP."""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import logging
import os
import signal
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from codecage import host as hosts
from codecage.cli.groups import FlagGroup, takes_groups
from codecage.cli.logs import configure_logging
from codecage.cli.options import (
    AuditFlags,
    ConfigOpt,
    NetworkFlags,
    OutputFlags,
    RayOpt,
    ToolFlags,
    VerboseOpt,
)
from codecage.cli.render import fail, stderr
from codecage.cli.setup import (
    host_options,
    load_config,
    scrub_option,
    servers_of_hosts,
    tool_setup_of,
)
from codecage.config import Settings
from codecage.errors import CodecageError
from codecage.host import Host
from codecage.options import Resolved

if TYPE_CHECKING:
    from codecage.audit.metrics import ServerMetrics
    from codecage.mcp.server import ServerLimits
    from codecage.ray import ClusterRuns
    from codecage.toolsetup import ToolSetup


@dataclass(frozen=True, slots=True)
class ListenFlags(FlagGroup):
    """Where and how the server listens: stdio, or HTTP on an address or a Unix socket."""

    http: Annotated[
        bool, typer.Option("--http", help="Serve streamable HTTP at /mcp instead of stdio.")
    ] = False
    host: Annotated[
        str, typer.Option("--host", help="HTTP: address to bind (a token is always required).")
    ] = "127.0.0.1"
    port: Annotated[int, typer.Option("--port", help="HTTP: port to listen on.")] = 8000
    uds: Annotated[
        Path | None,
        typer.Option(
            "--uds",
            metavar="PATH",
            help="HTTP: listen on this Unix socket instead of --host/--port (its "
            "directory's permissions say who may connect; a token is still required).",
            dir_okay=False,
            show_default=False,
        ),
    ] = None
    idle_exit: Annotated[
        float | None,
        typer.Option(
            "--idle-exit",
            metavar="SECONDS",
            help="HTTP: exit after this many seconds with no request and no open session "
            "(`codecage session`'s own server uses config key sessions.local_idle_exit).",
            min=0.1,
            show_default=False,
        ),
    ] = None
    token: Annotated[
        str | None,
        typer.Option(
            "--token",
            help="HTTP: require 'Authorization: Bearer TOKEN' on every request (required).",
            envvar="CODECAGE_TOKEN",
            show_default=False,
        ),
    ] = None
    insecure_no_token: Annotated[
        bool,
        typer.Option(
            "--insecure-no-token",
            help="HTTP on loopback without a token. INSECURE: every local user of this "
            "machine can then run code, and call the upstream tools with your credentials.",
        ),
    ] = False


DEFAULT_MAX_CONCURRENT = 4
"""Executions a server runs at once on its own host when --max-concurrent is not given."""


@dataclass(frozen=True, slots=True)
class CallLimitFlags(FlagGroup):
    """What one call may ask for at most, and how many run at once (`ServerLimits`)."""

    max_timeout: Annotated[
        float, typer.Option("--max-timeout", help="Largest timeout a call may ask for (s).")
    ] = 120.0
    max_memory_mb: Annotated[
        int, typer.Option("--max-memory-mb", help="Largest memory_limit_mb a call may ask for.")
    ] = 2048
    max_concurrent: Annotated[
        int | None,
        typer.Option(
            "--max-concurrent",
            help="Executions running at once (default 4; with --ray, what the cluster's "
            "nodes may run at once when the server starts: each node's CPUs, summed).",
            min=1,
            show_default=False,
        ),
    ] = None
    max_queued: Annotated[
        int,
        typer.Option("--max-queued", help="Executions that may wait; past that, 'busy'.", min=0),
    ] = 32

    def server_limits(self, reply_max_tokens: int | None, cluster: int | None) -> ServerLimits:
        """The limits of every call (`cluster`: the runs a Ray cluster takes at once, the
        default of --max-concurrent with --ray)."""
        from codecage.mcp.server import ServerLimits  # the MCP SDK: only when serving

        default = cluster if cluster is not None else DEFAULT_MAX_CONCURRENT
        return ServerLimits(
            max_timeout=self.max_timeout,
            max_memory_mb=self.max_memory_mb,
            max_concurrent=self.max_concurrent or default,
            max_queued=self.max_queued,
            reply_max_tokens=reply_max_tokens,  # None: env, then the config file, then 20000
        )


NoPoolOpt = Annotated[
    bool, typer.Option("--no-pool", help="Cold-start every sandbox (no warm pool).")
]
ReplyMaxTokensOpt = Annotated[
    int | None,
    typer.Option(
        "--reply-max-tokens",
        help="Estimated tokens one tool reply may take (env CODECAGE_REPLY_MAX_TOKENS, "
        "config key serve.reply_max_tokens; 2000 to 240000, default 20000). Longer output "
        "keeps its head and tail.",
        show_default=False,
    ),
]
MetricsPublicOpt = Annotated[
    bool,
    typer.Option(
        "--metrics-public",
        help="HTTP: serve /metrics without the token (for a scraper that cannot send "
        "one; the counts then show to anyone who reaches the port). /healthz and /readyz "
        "never need it.",
    ),
]
DataOpt = Annotated[
    Path | None,
    typer.Option(
        "--data",
        help="Mount this host directory read-only at /data in every sandbox (absolute; "
        "config key serve.data_dir). The code reads it; it cannot write it.",
        file_okay=False,
        show_default=False,
    ),
]


@takes_groups
def serve(
    *,
    listen: ListenFlags,
    calls: CallLimitFlags,
    no_pool: NoPoolOpt = False,
    reply_max_tokens: ReplyMaxTokensOpt = None,
    metrics_public: MetricsPublicOpt = False,
    data: DataOpt = None,
    ray: RayOpt = None,
    tools: ToolFlags,
    network: NetworkFlags,
    audit: AuditFlags,
    output: OutputFlags,
    config_file: ConfigOpt = None,
    verbose: VerboseOpt = False,
) -> None:
    """Serve codecage as an MCP server: tools execute_code, validate_code, get_sandbox_info,
    and open_session, close_session, list_sessions (state across calls).

    Logs go to stderr: the settings at start, then one line per tool call (tool, status,
    wall_ms, queue_ms); in stdio mode stdout carries only the protocol. Over HTTP, /healthz,
    /readyz and /metrics (Prometheus) serve operators; OpenTelemetry traces go where the
    OTEL_* variables say, when the SDK is installed.

    Examples:

        codecage serve        # stdio: for Claude Code, Cursor, VS Code

        codecage serve --http --port 8765 --token "$TOKEN"   # at :8765/mcp

        codecage serve --http --host 0.0.0.0 --token "$(openssl rand -hex 16)"

        codecage serve --mcp-host cursor   # code may call Cursor's MCP servers

        codecage serve --allow-host '*.example.com'   # every call may reach them

        codecage serve --http --token "$TOKEN" --ray auto   # on a Ray cluster
    """
    _log_calls(verbose)
    _exit_on_sigterm()
    fingerprint = _local_fingerprint(listen, tools, network, audit, output, data, config_file, ray)
    try:
        settings = load_config(config_file)
        # The HTTP tokens ([serve.clients.NAME]'s variables) checked before the pool starts:
        # a refusal then has nothing to stop.
        _check_tokens(listen, settings)
        toolset = _tools(settings, tools)
        pool = not no_pool and ray is None  # --ray: one-off runs go to the cluster, not here
        options = _options(settings, toolset, network, audit, output, pool=pool, data=data)
        runtime, metrics, cluster = _host(options, settings, toolset, http=listen.http, ray=ray)
        limits = calls.server_limits(reply_max_tokens, cluster)
        with _closed_on_error(runtime):
            asgi = _serve_stdio_or_app(
                runtime, listen, limits, settings, metrics, metrics_public, _unchanged(fingerprint)
            )
    except CodecageError as exc:
        fail(exc, as_json=False, verbose=verbose)
    if asgi is not None:
        _serve_http(asgi, listen, runtime, verbose=verbose)


def _log_calls(verbose: bool) -> None:
    """Logging as `serve` wants it: the settings at start and one line per call, even
    without -v; OpenTelemetry traces when configured."""
    from codecage.audit import tracing
    from codecage.mcp import http as http_serving
    from codecage.mcp import server as mcp_server  # the MCP SDK loads only for this command
    from codecage.mcp import stdio

    configure_logging(verbose)
    if not verbose:  # the settings at start and one line per call, even when quiet
        for module in (mcp_server, stdio, http_serving):
            logging.getLogger(module.__name__).setLevel(logging.INFO)
        # One line per run handed off by `codecage run` (imported only if one comes).
        logging.getLogger("codecage.cli.handoff_endpoint").setLevel(logging.INFO)
    tracing.configure()


def _check_tokens(listen: ListenFlags, settings: Settings) -> None:
    """Raises: ConfigError: HTTP without a token where one is required, or a client's
    token variable unset."""
    from codecage.mcp import server as mcp_server

    if listen.http:
        mcp_server.http_tokens(
            listen.host, listen.token, listen.insecure_no_token, settings.serve.clients
        )


def _tools(settings: Settings, tools: ToolFlags) -> ToolSetup:
    """The upstream tools of every call (closed at exit)."""
    host_servers, _ = servers_of_hosts(tools.mcp_host, tools.mcp_config)
    toolset = tool_setup_of(tools, settings, host_servers)
    atexit.register(toolset.close)
    return toolset


def _options(
    settings: Settings,
    tools: ToolSetup,
    network: NetworkFlags,
    audit: AuditFlags,
    output: OutputFlags,
    *,
    pool: bool,
    data: Path | None,
) -> Resolved:
    """The options of the one host every call of the server runs in."""
    # Every call of the server runs in this one host, with the settings loaded and
    # logged now, not a file read again later; its alerts as the config's [alerts].
    return host_options(
        settings,
        tools,
        scrub=scrub_option(output.no_scrub, output.scrub_categories, settings),
        pool=pool,
        face="mcp",
        data_dir=_data_dir(data, settings),
        allow_host=network.allow_host,
        audit=audit.audit,
        alerts=settings.alerts.active,
    ).resolve(settings)


def _placement(address: str, options: Resolved) -> ClusterRuns:
    """The Ray cluster the server's runs go to: joined, an actor started on each node.

    Raises:
        ConfigError: Ray is not installed, no cluster at `address`, or the options give the
            code upstream tools (a node cannot reach them).
        SandboxError: no node of the cluster could start a sandbox.
    """
    from codecage.cli.batch import ray_extra

    hosts.check_placeable(options)  # before joining: a refusal then costs nothing
    cluster = ray_extra()
    # Each node's Sandbox: the server's settings and options, and a pool; no audit trail
    # or alerts there, since this server records and observes every run itself.
    node_options, _ = cluster.node_options_of(
        dataclasses.replace(options.options, config=options.settings, audit=False, alerts=False)
    )
    placement: ClusterRuns = cluster.ClusterRuns(node_options, address=address, concurrency=None)
    where = {"address": address, "nodes": placement.nodes, "capacity": placement.capacity}
    logging.getLogger(__name__).info("serve.ray", extra=where)
    stderr.print(
        f"codecage: runs go to the Ray cluster at {address}: {len(placement.nodes)} node(s), "
        f"{placement.capacity} at once",
        markup=False,
    )
    return placement


def _host(
    options: Resolved, settings: Settings, tools: ToolSetup, *, http: bool, ray: str | None
) -> tuple[Host, ServerMetrics | None, int | None]:
    """The server's host (its runs sent to the Ray cluster at `ray`, if given), over HTTP
    the metrics that observe it, and the runs the cluster takes at once (None: no cluster)."""
    from codecage.mcp import health

    placement = _placement(ray, options) if ray is not None else None
    metrics = health.server_metrics(settings, tools.broker) if http else None
    try:
        runtime = hosts.build(
            options, observers=(metrics.observe,) if metrics else (), placement=placement
        )
    except CodecageError:
        if placement is not None:  # its actors, stopped now rather than at exit
            placement.close()
        raise
    if runtime.alerter is not None:  # sends what is queued at exit
        atexit.register(runtime.alerter.close)
    return runtime, metrics, placement.capacity if placement is not None else None


@contextlib.contextmanager
def _closed_on_error(runtime: Host) -> Iterator[None]:
    """Close `runtime` when the block fails: stopped (its pool's threads joined) here, not
    left to the exit hooks."""
    try:
        yield
    except CodecageError:
        runtime.close()
        raise


def _serve_stdio_or_app(
    runtime: Host,
    listen: ListenFlags,
    limits: ServerLimits,
    settings: Settings,
    metrics: ServerMetrics | None,
    metrics_public: bool,
    fingerprint: str | None,
) -> Any:
    """Serve stdio until the client hangs up (None), or the HTTP app to serve; with a
    `fingerprint` (the user's local server), `codecage run`'s hand-off endpoint too."""
    from codecage.mcp import health, stdio
    from codecage.mcp import server as mcp_server

    if metrics is not None:
        health.watch(metrics, runtime)
    app_server = mcp_server.build_server(runtime, limits=limits, metrics=metrics)
    if not listen.http:
        stdio.serve(app_server)
        _ignore_sigterm()  # the client hung up: what is left is cleanup
        return None
    return mcp_server.http_app(
        app_server,
        host="localhost" if listen.uds is not None else listen.host,
        token=listen.token,
        insecure_no_token=listen.insecure_no_token,
        runtime=runtime,
        metrics=metrics,
        metrics_public=metrics_public,
        clients=settings.serve.clients,
        wrap=_handoff(fingerprint),
    )


def _local_fingerprint(
    listen: ListenFlags,
    tools: ToolFlags,
    network: NetworkFlags,
    audit: AuditFlags,
    output: OutputFlags,
    data: Path | None,
    config_file: Path | None,
    ray: str | None,
) -> str | None:
    """The hand-off fingerprint (cli/handoff.py), computed before the config is read, when
    this is the user's local server (cli/local.py) with nothing set that makes a run other
    than `codecage run`'s (the queue, the pool and the reply's size change no result);
    None: `codecage run` does not hand its runs here."""
    import codecage.cli.handoff as handoff

    where = handoff.home_path(os.environ) / handoff.SOCKET
    local = (
        listen.http
        and listen.uds is not None
        and listen.uds.absolute() == where
        and (tools, network, audit, output)
        == (ToolFlags(), NetworkFlags(), AuditFlags(), OutputFlags())
        and data is None
        and config_file is None
        and ray is None  # a run goes to a cluster, which `codecage run` in-process would not do
    )
    return handoff.fingerprint(os.environ) if local else None


def _unchanged(fingerprint: str | None) -> str | None:
    """`fingerprint` when it still holds once the host is built: else the config file (or
    the packages) changed while they were read, and which one is in force is unknown."""
    import codecage.cli.handoff as handoff

    return fingerprint if fingerprint == handoff.fingerprint(os.environ) else None


def _handoff(fingerprint: str | None) -> Any:
    """The `wrap` of `http_app` that adds the hand-off endpoint (None: not this server)."""
    if fingerprint is None:
        return None
    from codecage.cli.handoff_endpoint import Handoff

    return lambda app, runner: Handoff(app, runner, fingerprint)


def _serve_http(asgi: Any, listen: ListenFlags, runtime: Host, *, verbose: bool) -> None:
    """Serve the HTTP app until stopped, or until idle for --idle-exit seconds."""
    from codecage.mcp import http as http_serving

    idle = None
    if listen.idle_exit is not None:
        idle = http_serving.IdleExit(listen.idle_exit, runtime.sessions.open_count, listen.uds)
        asgi = idle.gate(asgi)
    host, port, uds = listen.host, listen.port, listen.uds
    where = f"unix socket {uds}" if uds is not None else f"http://{host}:{port}/mcp"
    stderr.print(f"codecage MCP server on {where}", markup=False)
    http_serving.serve(asgi, host=host, port=port, verbose=verbose, uds=uds, idle=idle)


def _exit_on_sigterm() -> None:
    """Let SIGTERM (a service manager, `kill`) end the process through the interpreter's
    exit, as Ctrl-C does, so atexit closes the warm pool and leaves nothing behind. (uvicorn
    restores this handler when it stops and re-raises the signal to it.)"""

    def leave(signum: int, _frame: object) -> None:
        _ignore_sigterm()  # a second one must not cut the cleanup it starts short
        sys.exit(128 + signum)

    signal.signal(signal.SIGTERM, leave)


def _ignore_sigterm() -> None:
    """From here on the process is only cleaning up (closing the warm pool, which waits
    for a sandbox still starting): a SIGTERM raising SystemExit inside that cleanup would
    leave the sandbox's run directory, mount and cgroup behind. MCP clients send one two
    seconds after they close the server's stdin (the SDKs' stdio transports do)."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def _data_dir(flag: Path | None, settings: Settings) -> Path | None:
    """--data, else the config file's [serve] data_dir (checked by the Sandbox)."""
    if flag is not None:
        return flag
    return Path(settings.serve.data_dir) if settings.serve.data_dir else None
