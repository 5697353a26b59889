"""From the command line's tool options to what a `Sandbox` needs: the broker, the tree.

`codecage run` and `codecage serve` take `--mcp-config FILE` (upstream servers),
`--servers-dir DIR` (the tree `codecage gen` wrote; generated into a temp dir when omitted),
`--skills-dir DIR` and `--allow-tool PATTERN`. `codecage gen` writes the tree.

Allow-list patterns (`--allow-tool`, `[tools] allow`, `Sandbox(allowed_tools=...)`) name a
(server, tool) pair: `SERVER.TOOL`, split at the first dot (server names have none), each
half matched on its own with shell wildcards (`*`, `?`, `[...]`). A wildcard matches only
names made of the characters the MCP spec recommends for tool names (letters, digits,
`_`, `-`, `.`): a name with any other character (`/`, a space, a newline) is allowed only
by a pattern that spells it exactly. A server's own `allow_tools` are tool patterns of the
same kind.
"""

from __future__ import annotations

import atexit
import fnmatch
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TypedDict

from codecage.bridge import upstreams
from codecage.bridge.channel import BridgeLimits, CallFailed
from codecage.config import Settings, ToolsFile
from codecage.engine import owner
from codecage.engine import workspace as workspaces
from codecage.engine.launch import SERVERS_DIR_PREFIX
from codecage.errors import ConfigError, SandboxError

# The characters the MCP spec recommends for tool names; only such names match a wildcard.
_PLAIN_NAME = re.compile(r"[A-Za-z0-9_.\-]+")
_WILDCARD = re.compile(r"[*?\[]")

if TYPE_CHECKING:  # the MCP SDK (~0.5 s to import) loads only when there are servers
    import mcp_types

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
    from codecage.bridge.broker import Broker

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


@dataclass(frozen=True, slots=True)
class ToolPattern:
    """One allow-list entry: a server pattern and a tool pattern, matched separately."""

    server: str
    tool: str

    @classmethod
    def parse(cls, text: str) -> ToolPattern:
        """`SERVER.TOOL`, split at the first dot.

        Raises:
            ConfigError: no dot, or an empty half.
        """
        server, dot, tool = text.partition(".")
        if not dot or not server or not tool:
            raise ConfigError(
                f"the allow-list pattern {text!r} does not name a server and a tool",
                hint="write SERVER.TOOL, e.g. memory.read_graph, memory.read_* or memory.*",
            )
        return cls(server, tool)

    def matches(self, server: str, tool: str) -> bool:
        return name_matches(server, self.server) and name_matches(tool, self.tool)

    def __str__(self) -> str:
        return f"{self.server}.{self.tool}"


def allow_patterns(patterns: Sequence[str] | None) -> tuple[ToolPattern, ...] | None:
    """The parsed allow-list; None (no allow-list: every listed tool) stays None.

    Raises:
        ConfigError: a pattern that does not name a server and a tool.
    """
    if patterns is None:
        return None
    return tuple(ToolPattern.parse(pattern) for pattern in patterns)


def name_matches(name: str, pattern: str) -> bool:
    """Whether one name (a server's or a tool's) matches one half of a pattern. Without
    wildcards, only the same name. With them, only a name of plain characters: `read_*`
    must not grant `read_/../admin_delete` or a name with a newline in it."""
    if not _WILDCARD.search(pattern):
        return name == pattern
    return _PLAIN_NAME.fullmatch(name) is not None and fnmatch.fnmatchcase(name, pattern)


def bridge_limits(file: ToolsFile) -> BridgeLimits:
    """The bounds of a run's tool calls that the config's [tools] table sets."""
    return BridgeLimits(
        max_calls=file.max_calls,
        max_in_flight=file.max_in_flight,
        max_result_bytes=int(file.max_result_mb * 1024 * 1024),
    )


def configured_servers(
    mcp_config: Path | None,
    settings: Settings | None,
    host_servers: Mapping[str, upstreams.Upstream] | None = None,
) -> dict[str, upstreams.Upstream] | None:
    """The upstream servers of `--mcp-config` and of `--mcp-host` (`host_servers`; the
    file's win a name both have), else of the config file; None: none has any.

    Raises:
        ConfigError: the JSON file or the config's table is not a valid `mcpServers`.
    """
    if mcp_config is not None or host_servers:
        from_file = upstreams.load(mcp_config) if mcp_config is not None else {}
        return {**(host_servers or {}), **from_file}
    if settings is None or not settings.mcp_servers:
        return None
    source = f"{settings.config_file} [mcpServers]"
    return upstreams.parse(
        {"mcpServers": settings.mcp_servers}, source=source, environ=dict(os.environ)
    )


def generate(broker: Broker, servers: Sequence[str], out_dir: Path) -> list[Path]:
    """List the tools of `servers` and write their modules into `out_dir` (which is then
    exactly the tree of these servers: other generated files in it are removed).

    Raises:
        ConfigError: an unknown server name, or `out_dir` is not codecage's to write.
        SandboxError: an upstream server could not be listed.
    """
    from codecage.bridge import codegen

    listed: dict[str, list[mcp_types.Tool]] = {}
    for name in servers:
        if name not in broker.servers:
            known = ", ".join(sorted(broker.servers)) or "none"
            raise ConfigError(
                f"no upstream server {name!r} in the MCP config (known: {known})", hint=""
            )
        try:
            listed[name] = broker.list_tools(name)
        except CallFailed as exc:
            raise SandboxError(
                f"cannot list the tools of {name!r}: {exc.message}",
                hint="check the server's command/url in the MCP config; run it by hand to see",
            ) from exc
    return codegen.write_tree(codegen.generate(listed), out_dir)


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
