"""Upstream MCP servers as configured: the `mcpServers` JSON that MCP hosts use.

```json
{"mcpServers": {
  "memory": {"command": "npx", "args": ["-y", "@modelcontextprotocol/server-memory"],
             "env": {"MEMORY_FILE_PATH": "/srv/memory.jsonl"}},
  "search": {"url": "https://search.internal/mcp",
             "headers": {"Authorization": "Bearer ${SEARCH_TOKEN}"}}
}}
```

`${NAME}` in `args`, `env`, `url` and `headers` is taken from the host's environment when the
file is loaded, so credentials need not be written into it. Keys codecage adds (hosts ignore
them): `allow_tools` (the only tools code may call; default all), `timeout` (seconds per call),
`roots` (directories declared to the server as the client's roots), `tokenize` (replace
personal data in this server's results with tokens, see the privacy docs), `sandbox` (run a
stdio server in a sandbox of its own, `bridge/sandboxed.py`), with `state_dir` (its
persistent directory, /state inside), `allow_hosts` (the hosts it may reach, through the
egress proxy, as a run's: HOST[:PORT], *.domain; `[network] deny` still wins), and
`memory_mb` and `max_processes` (its cgroup's bounds).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from codecage.errors import ConfigError
from codecage.models.hosts import parse_rules

_VARIABLE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")
# Keys other hosts write into the same table; accepted and not used.
_HOST_KEYS = ("type", "disabled", "autoApprove", "alwaysAllow", "description", "transport")


class Upstream(BaseModel):
    """One upstream MCP server: `command` (stdio) or `url` (streamable HTTP)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    command: str | None = None
    args: tuple[str, ...] = ()
    env: dict[str, str] = Field(default_factory=dict)
    cwd: str | None = None
    url: str | None = None
    headers: dict[str, str] = Field(default_factory=dict)
    allow_tools: tuple[str, ...] | None = None
    timeout: float = Field(default=60.0, gt=0, le=3600)
    roots: tuple[str, ...] = ()
    tokenize: bool = False
    disabled: bool = False
    sandbox: bool = Field(
        default=False,
        description="Run this stdio server in a sandbox of its own (no network, no host "
        "files but its program, /state and its roots); false: on the host, as you.",
    )
    state_dir: str | None = Field(
        default=None,
        description="A sandboxed server's persistent directory (/state inside); None: "
        "/var/lib/codecage/servers/NAME as root, else $XDG_DATA_HOME/codecage/servers/NAME.",
    )
    memory_mb: int = Field(
        default=1024,
        ge=32,
        le=1_048_576,
        description="A sandboxed server's memory in MiB, all its processes together (its "
        "cgroup, where the host has cgroups).",
    )
    max_processes: int = Field(
        default=512,
        ge=1,
        le=32_768,
        description="A sandboxed server's processes and threads at once (its pids cgroup; "
        "node starts a dozen threads).",
    )
    allow_hosts: tuple[str, ...] = Field(
        default=(),
        description='Hosts a sandboxed server may reach ("api.example.com", '
        '"*.example.com:8443"); empty: none. Not wired yet: a non-empty list is refused.',
    )

    @model_validator(mode="after")
    def _one_transport(self) -> Upstream:
        if (self.command is None) == (self.url is None):
            raise ValueError("give either `command` (a stdio server) or `url` (HTTP), not both")
        if self.url is not None and not self.url.startswith(("http://", "https://")):
            raise ValueError(f"url must be http:// or https://, got {self.url!r}")
        if self.sandbox and self.command is None:
            raise ValueError("`sandbox` applies to stdio servers (`command`), not to a `url`")
        if not self.sandbox and (self.state_dir is not None or self.allow_hosts):
            raise ValueError("`state_dir` and `allow_hosts` apply only with `sandbox`: true")
        if not self.sandbox and {"memory_mb", "max_processes"} & self.model_fields_set:
            raise ValueError("`memory_mb` and `max_processes` apply only with `sandbox`: true")
        if self.state_dir is not None and not self.state_dir.startswith("/"):
            raise ValueError(f"state_dir must be an absolute path, got {self.state_dir!r}")
        parse_rules(self.allow_hosts, what="allow_hosts")  # a RuleError says what is wrong
        return self

    def secrets(self) -> list[str]:
        """Values the sandbox must never see: env values and header values (credentials)."""
        return [v for v in (*self.env.values(), *self.headers.values()) if v]


def load(path: Path, environ: dict[str, str] | None = None) -> dict[str, Upstream]:
    """The enabled upstream servers of an `mcpServers` JSON file.

    Raises:
        ConfigError: the file cannot be read, is not JSON of that shape, or names a
            variable that is not set.
    """
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(f"cannot read the MCP config {path}: {exc.strerror}", hint="") from exc
    except ValueError as exc:
        raise ConfigError(f"the MCP config {path} is not JSON: {exc}", hint="") from exc
    return parse(raw, source=str(path), environ=dict(os.environ) if environ is None else environ)


def parse(raw: Any, *, source: str, environ: dict[str, str]) -> dict[str, Upstream]:
    """`load()` for an already-parsed value (e.g. the codecage config's table)."""
    table = raw.get("mcpServers") if isinstance(raw, dict) else None
    if not isinstance(table, dict):
        raise ConfigError(
            f"{source}: no `mcpServers` object",
            hint='write {"mcpServers": {"name": {"command": ..., "args": [...]}}}',
        )
    servers: dict[str, Upstream] = {}
    for name, entry in table.items():
        if not isinstance(entry, dict):
            raise ConfigError(
                f"{source}: mcpServers.{name} must be an object",
                hint='write {"command": ..., "args": [...]} or {"url": ...}',
            )
        server = _parse_one(name, _expand(entry, f"{source}: mcpServers.{name}", environ), source)
        if not server.disabled:
            servers[name] = server
    return servers


def _parse_one(name: str, entry: dict[str, Any], source: str) -> Upstream:
    if not name or len(name) > 100:
        raise ConfigError(
            f"{source}: a server name must have 1 to 100 characters: {name!r}", hint=""
        )
    if "." in name:
        # An allow-list pattern SERVER.TOOL splits at its first dot: a server named
        # `evil.echo` would make `evil.*` grant its tools as well as those of `evil`.
        raise ConfigError(
            f"{source}: the server name {name!r} has a dot, which codecage does not accept",
            hint="rename it (e.g. with - or _): allow-list patterns are SERVER.TOOL",
        )
    transport = entry.get("type") or entry.get("transport")
    if transport == "sse":
        raise ConfigError(
            f"{source}: mcpServers.{name} uses the SSE transport, which codecage does not speak",
            hint="use the server's streamable HTTP endpoint (type http)",
        )
    fields = {k: v for k, v in entry.items() if k not in _HOST_KEYS or k == "disabled"}
    try:
        return Upstream.model_validate(fields)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in error['loc']) or 'entry'}: {error['msg']}"
            for error in exc.errors()
        )
        raise ConfigError(
            f"{source}: mcpServers.{name}: {problems}",
            hint="docs/tool-bridge.md lists the keys of a server entry",
        ) from exc


def _expand(value: Any, where: str, environ: dict[str, str]) -> Any:
    if isinstance(value, str):
        return _VARIABLE.sub(lambda match: _variable(match.group(1), where, environ), value)
    if isinstance(value, list):
        return [_expand(item, where, environ) for item in value]
    if isinstance(value, dict):
        return {key: _expand(item, where, environ) for key, item in value.items()}
    return value


def _variable(name: str, where: str, environ: dict[str, str]) -> str:
    if name not in environ:
        raise ConfigError(
            f"{where} uses ${{{name}}}, which is not set in the environment",
            hint=f"export {name}=... before starting codecage",
        )
    return environ[name]
