"""From the command line's tool options to what a `Sandbox` needs: the broker, the tree.

`codecage run` and `codecage serve` take `--mcp-config FILE` (upstream servers),
`--servers-dir DIR` (the tree `codecage gen` wrote; generated into a temp dir when omitted),
`--skills-dir DIR` and `--allow-tool PATTERN`. `codecage gen` writes the tree.
"""

from __future__ import annotations

import atexit
import shutil
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mcp_types

from codecage.bridge import codegen, upstreams
from codecage.bridge.broker import Broker
from codecage.bridge.channel import CallFailed
from codecage.errors import ConfigError, SandboxError


@dataclass(frozen=True, slots=True)
class ToolSetup:
    """Upstream servers and tool trees for the Sandboxes of one codecage process."""

    broker: Broker | None = None
    servers_dir: Path | None = None
    skills_dir: Path | None = None
    allowed_tools: tuple[str, ...] | None = None
    tokenize: bool | None = None

    def sandbox_options(self) -> dict[str, Any]:
        """Keyword arguments for `Sandbox(...)`."""
        return {
            "tools": self.broker,
            "servers_dir": self.servers_dir,
            "skills_dir": self.skills_dir,
            "allowed_tools": self.allowed_tools,
            "tokenize": self.tokenize,
        }

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
    progress: Callable[[str], None] = lambda _message: None,
) -> ToolSetup:
    """Load the upstream servers and find (or generate) their tool tree.

    Raises:
        ConfigError: a bad config file or directory.
        SandboxError: an upstream server could not be listed for generating the tree.
    """
    if mcp_config is None:
        if servers_dir is not None or allowed_tools or tokenize:
            raise ConfigError(
                "--servers-dir, --allow-tool and --tokenize need upstream servers",
                hint="pass --mcp-config FILE (the mcpServers JSON of your MCP host)",
            )
        return ToolSetup(skills_dir=_existing_dir(skills_dir, "--skills-dir"))
    broker = Broker(upstreams.load(mcp_config))
    try:
        if servers_dir is None:
            servers_dir = _temporary_tree()
            progress(f"listing the tools of {len(broker.servers)} upstream server(s)")
            generate(broker, list(broker.servers), servers_dir)
        return ToolSetup(
            broker=broker,
            servers_dir=_existing_dir(servers_dir, "--servers-dir"),
            skills_dir=_existing_dir(skills_dir, "--skills-dir"),
            allowed_tools=tuple(allowed_tools) if allowed_tools else None,
            tokenize=tokenize,
        )
    except BaseException:
        broker.close()
        raise


def generate(broker: Broker, servers: Sequence[str], out_dir: Path) -> list[Path]:
    """List the tools of `servers` and write their modules into `out_dir` (which is then
    exactly the tree of these servers: other generated files in it are removed).

    Raises:
        ConfigError: an unknown server name, or `out_dir` is not codecage's to write.
        SandboxError: an upstream server could not be listed.
    """
    listed: dict[str, list[mcp_types.Tool]] = {}
    for name in servers:
        if name not in broker.servers:
            known = ", ".join(sorted(broker.servers)) or "none"
            raise ConfigError(f"no upstream server {name!r} in the MCP config (known: {known})")
        try:
            listed[name] = broker.list_tools(name)
        except CallFailed as exc:
            raise SandboxError(
                f"cannot list the tools of {name!r}: {exc.message}",
                hint="check the server's command/url in the MCP config; run it by hand to see",
            ) from exc
    return codegen.write_tree(codegen.generate(listed), out_dir)


def _temporary_tree() -> Path:
    path = Path(tempfile.mkdtemp(prefix="codecage-servers-"))
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path / "servers"


def _existing_dir(path: Path | None, option: str) -> Path | None:
    if path is None:
        return None
    if not path.is_dir():
        raise ConfigError(f"{option} {path}: not a directory")
    return path.resolve()
