"""From the command line's tool options to what a `Sandbox` needs: the broker, the tree.

`codecage run` and `codecage serve` take `--mcp-config FILE` (upstream servers),
`--servers-dir DIR` (the tree `codecage gen` wrote; generated into a temp dir when omitted),
`--skills-dir DIR` and `--allow-tool PATTERN`. The allow-list patterns and the generation
itself are the bridge's (`bridge.tooling`); this module sits above the engine because a
generated tree is kept, like a run's directory, in the engine's private parent under this
process's owner key (swept if the process is killed).
"""

from __future__ import annotations

import atexit
import shutil
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TypedDict

from codecage.bridge import upstreams
from codecage.bridge.channel import BridgeLimits
from codecage.bridge.tooling import allow_patterns, bridge_limits, configured_servers, generate
from codecage.config import Settings, ToolsFile
from codecage.engine import owner
from codecage.engine import workspace as workspaces
from codecage.engine.launch import SERVERS_DIR_PREFIX
from codecage.errors import ConfigError

if TYPE_CHECKING:  # the MCP SDK (~0.5 s to import) loads only when there are servers
    from codecage.bridge.broker import Broker


class SandboxToolArguments(TypedDict):
    """The keyword arguments of `Sandbox(...)` that a `ToolSetup` fills, typed (mypy checks
    `Sandbox(**setup.sandbox_arguments())` against the signature)."""

    tools: Broker | None
    servers_dir: Path | None
    skills_dir: Path | None
    allowed_tools: tuple[str, ...] | None
    tokenize: bool | None
    tool_limits: BridgeLimits | None


@dataclass(frozen=True, slots=True)
class ToolSetup:
    """Upstream servers and tool trees for the Sandboxes of one codecage process."""

    broker: Broker | None = None
    servers_dir: Path | None = None
    skills_dir: Path | None = None
    allowed_tools: tuple[str, ...] | None = None
    tokenize: bool | None = None
    tool_limits: BridgeLimits | None = None

    def sandbox_arguments(self) -> SandboxToolArguments:
        """What `Sandbox(...)` takes of this setup."""
        return SandboxToolArguments(
            tools=self.broker,
            servers_dir=self.servers_dir,
            skills_dir=self.skills_dir,
            allowed_tools=self.allowed_tools,
            tokenize=self.tokenize,
            tool_limits=self.tool_limits,
        )

    def close(self) -> None:
        if self.broker is not None:
            self.broker.close()


def prepare(
    mcp_config: Path | None,
    *,
    servers_dir: Path | None = None,
    skills_dir: Path | None = None,
    allowed_tools: Sequence[str] | None = None,
    tokenize: bool | None = None,
    settings: Settings | None = None,
    progress: Callable[[str], None] = lambda _message: None,
    host_servers: Mapping[str, upstreams.Upstream] | None = None,
) -> ToolSetup:
    """Load the upstream servers and find (or generate) their tool tree. What the flags
    leave out comes from `settings` (the config file's [mcpServers.*] and [tools]).

    Raises:
        ConfigError: a bad config file or directory.
        HostError: no private temp directory for the generated tree.
        SandboxError: an upstream server could not be listed for generating the tree.
    """
    asked = servers_dir is not None or bool(allowed_tools) or bool(tokenize)
    configured = mcp_config is not None or bool(host_servers)
    if asked and not configured and not (settings and settings.mcp_servers):
        raise ConfigError(
            "--servers-dir, --allow-tool and --tokenize need upstream servers",
            hint="pass --mcp-config FILE (the mcpServers JSON of your MCP host), or add "
            "[mcpServers.NAME] tables to the config file",
        )
    file = settings.tools if settings is not None else ToolsFile()
    where = settings.config_relative if settings is not None else _as_path
    skills_dir = skills_dir or where(file.skills_dir)
    allowed = allowed_tools or file.allow
    allow_patterns(allowed)  # a malformed pattern is the operator's error: said before any start
    servers = configured_servers(mcp_config, settings, host_servers)
    if servers is None:
        return ToolSetup(skills_dir=_existing_dir(skills_dir, "--skills-dir"))
    from codecage.bridge.broker import Broker  # the MCP SDK: only when there are servers

    config_file = settings.config_file if settings is not None else None
    broker = Broker(
        servers,
        network=settings.network if settings is not None else None,
        config_dir=config_file.parent if config_file is not None else None,
    )
    try:
        servers_dir = servers_dir or where(file.servers_dir)
        if servers_dir is None:
            servers_dir = _temporary_tree()
            progress(f"listing the tools of {len(broker.servers)} upstream server(s)")
            generate(broker, list(broker.servers), servers_dir)
        return ToolSetup(
            broker=broker,
            servers_dir=_existing_dir(servers_dir, "--servers-dir"),
            skills_dir=_existing_dir(skills_dir, "--skills-dir"),
            allowed_tools=tuple(allowed) if allowed is not None else None,
            tokenize=tokenize if tokenize is not None else file.tokenize,
            tool_limits=bridge_limits(file),
        )
    except BaseException:
        broker.close()
        raise


def _temporary_tree() -> Path:
    """A temp dir for the generated tree, in the private parent of the run dirs (not
    directly in /tmp), named with the owner key (engine.owner) so that it is swept if this
    process is killed.

    Raises:
        HostError: the private parent is not usable (see `workspace.private_parent`).
    """
    path = Path(
        tempfile.mkdtemp(
            prefix=f"{SERVERS_DIR_PREFIX}{owner.key()}-", dir=workspaces.private_parent()
        )
    )
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    # Like a run's directory: the sandbox's own host id (issue 20) passes through to bind it.
    path.chmod(workspaces.run_dir_mode())
    return path / "servers"


def _as_path(path: str | None) -> Path | None:
    return Path(path).expanduser() if path is not None else None


def _existing_dir(path: Path | None, option: str) -> Path | None:
    if path is None:
        return None
    if not path.is_dir():
        raise ConfigError(f"{option} {path}: not a directory", hint="")
    return path.resolve()
