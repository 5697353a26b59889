"""`codecage gen`: typed Python modules for the tools of upstream MCP servers."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from codecage.cli.logs import configure_logging
from codecage.cli.options import ConfigOpt, JsonOpt, McpHostOpt, VerboseOpt, mcp_config_option
from codecage.cli.render import fail, print_json, progress, stderr
from codecage.cli.setup import load_config, servers_of_hosts
from codecage.config import Settings
from codecage.errors import CodecageError, ConfigError

if TYPE_CHECKING:
    from codecage.bridge.hosts import HostServers
    from codecage.bridge.upstreams import Upstream


GenMcpConfigOpt = Annotated[
    Path | None,
    mcp_config_option(
        "Upstream MCP servers: a JSON file with mcpServers, as MCP hosts write them "
        "(default: the config file's \\[mcpServers.*] tables)."
    ),
]
GenServerOpt = Annotated[
    list[str] | None,
    typer.Option("--server", help="Generate this server's tools (repeat).", show_default=False),
]
AllServersOpt = Annotated[
    bool, typer.Option("--all", help="Generate the tools of every configured server.")
]
TreeOpt = Annotated[
    Path | None,
    typer.Option(
        "--out",
        help="Where to write the tree (default: the config's \\[tools] servers_dir, "
        "else ./servers).",
        file_okay=False,
        show_default=False,
    ),
]


def gen(
    mcp_config: GenMcpConfigOpt = None,
    server: GenServerOpt = None,
    all_servers: AllServersOpt = False,
    out: TreeOpt = None,
    mcp_host: McpHostOpt = None,
    config_file: ConfigOpt = None,
    as_json: JsonOpt = False,
    verbose: VerboseOpt = False,
) -> None:
    """Write typed Python modules for the tools of upstream MCP servers.

    Connects to each server, lists its tools, and writes servers/<server>/<tool>.py with a
    typed Params, the result type, and call()/call_sync(). Mount the tree into the sandbox
    with `codecage run --servers-dir` (or let run/serve generate it). Regenerating gives
    byte-identical files; files of servers no longer asked for are removed. Each module's
    bytecode is written beside it (the tree is read-only in the sandbox).

    Examples:

        codecage gen --mcp-config mcp.json --all

        codecage gen --mcp-config mcp.json --server memory --out ./servers

        codecage gen --mcp-host claude-code --all   # the servers Claude Code has
    """
    configure_logging(verbose)
    try:
        if bool(server) == all_servers:
            raise ConfigError(
                "name the servers with --server NAME, or pass --all",
                hint="--all generates the tools of every server configured",
            )
        settings = load_config(config_file)
        host_servers, host_reports = servers_of_hosts(mcp_host, mcp_config)
        out = out or settings.config_relative(settings.tools.servers_dir) or Path("servers")
        names, written = _generate(mcp_config, settings, host_servers, server, out, as_json)
    except CodecageError as exc:
        fail(exc, as_json=as_json, verbose=verbose)
    _print_generated(out, names, len(written), host_reports, as_json=as_json)


def _generate(
    mcp_config: Path | None,
    settings: Settings,
    host_servers: dict[str, Upstream] | None,
    server: list[str] | None,
    out: Path,
    quiet: bool,
) -> tuple[list[str], list[Path]]:
    """Write the tree of the servers named (None: every one configured) into `out`: the
    servers' names, and the files written or changed.

    Raises:
        ConfigError: no server is configured, or one named is not.
        CodecageError: a server could not be reached or listed.
    """
    from codecage.bridge import tooling
    from codecage.bridge.broker import Broker

    servers = tooling.configured_servers(mcp_config, settings, host_servers)
    if servers is None:
        raise ConfigError(
            "no upstream MCP servers to generate",
            hint="pass --mcp-config FILE or --mcp-host HOST, or add [mcpServers.NAME] "
            "tables to the config file",
        )
    with Broker(servers) as broker:
        names = list(server) if server else list(broker.servers)
        with progress(f"listing the tools of {', '.join(names)}", enabled=not quiet):
            return names, tooling.generate(broker, names, out)


def _print_generated(
    out: Path, names: list[str], written: int, host_reports: list[HostServers], *, as_json: bool
) -> None:
    modules = sorted(p for p in out.rglob("*.py") if p.name != "__init__.py")
    packages = sorted(p.name for p in out.iterdir() if (p / "__init__.py").is_file())
    if as_json:
        print_json(
            {
                "out": str(out),
                "servers": names,
                "modules": [str(m.relative_to(out)) for m in modules],
                "written": written,
                "mcp_hosts": [report.as_json() for report in host_reports],
            }
        )
        return
    stderr.print(
        f"{len(modules)} tool modules of {len(names)} server(s) in {out}/"
        f" ({written} file(s) written or changed)",
        markup=False,
    )
    for package in packages:
        stderr.print(f"  from servers.{package} import ...", markup=False)
