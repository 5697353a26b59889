"""Upstream tools as the command line and the settings name them: the configured servers
(`--mcp-config FILE`, `[mcpServers.*]`), the tool bounds of `[tools]`, the allow-list
patterns (`--allow-tool PATTERN`), and the tree of their modules (`generate`: what
`codecage gen` writes). What a face's Sandboxes get of them, the broker and the tree, is
put together by `codecage.toolsetup`.

Allow-list patterns (`--allow-tool`, `[tools] allow`, `Sandbox(allowed_tools=...)`) name a
(server, tool) pair: `SERVER.TOOL`, split at the first dot (server names have none), each
half matched on its own with shell wildcards (`*`, `?`, `[...]`). A wildcard matches only
names made of the characters the MCP spec recommends for tool names (letters, digits,
`_`, `-`, `.`): a name with any other character (`/`, a space, a newline) is allowed only
by a pattern that spells it exactly. A server's own `allow_tools` are tool patterns of the
same kind.
"""

from __future__ import annotations

import fnmatch
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from codecage.bridge import upstreams
from codecage.bridge.channel import BridgeLimits, CallFailed
from codecage.config import Settings, ToolsFile
from codecage.errors import ConfigError, SandboxError

# The characters the MCP spec recommends for tool names; only such names match a wildcard.
_PLAIN_NAME = re.compile(r"[A-Za-z0-9_.\-]+")
_WILDCARD = re.compile(r"[*?\[]")

if TYPE_CHECKING:  # the MCP SDK (~0.5 s to import) loads only when there are servers
    import mcp_types

    from codecage.bridge.broker import Broker


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
