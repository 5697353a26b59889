"""The MCP servers a user already configured for their MCP host, read from the host's
user-level config file (`--mcp-host claude-code|cursor|vscode|claude-desktop`).

- claude-code: the top-level `mcpServers` (user scope) of `~/.claude.json`, and of
  `$CLAUDE_CONFIG_DIR/.claude.json` and `~/.claude/.claude.json` where they exist;
- cursor: `mcpServers` in `~/.cursor/mcp.json`;
- vscode: `servers` in `~/.config/Code/User/mcp.json`, and `"mcp": {"servers": ...}` in
  that directory's `settings.json` (entries with `"type": "stdio"` or `"http"`);
- claude-desktop: `mcpServers` in `~/.config/Claude/claude_desktop_config.json`
  (`$XDG_CONFIG_HOME` stands for `~/.config` where it is set).

Only these user-level files are read, never a project's (`.mcp.json`, `.cursor/mcp.json`,
`.vscode/mcp.json` in the current directory): a project is not the operator's, and its
file would choose the commands this host starts. Each file is opened as codecage's own
config file is (`config.read_trusted`): owned by the user or root and not writable by
group or others, nor any directory on its way.

Entries are translated to codecage's `mcpServers` shape: the hosts' variables
`${env:NAME}` and `${NAME:-default}` become their values, `${userHome}` the home
directory. A server codecage cannot start as the host would (SSE, a variable only the
editor can fill, such as `${input:...}` or `${workspaceFolder}`, an `envFile`, a
disabled entry) is skipped, and the report says why.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from codecage import config
from codecage.bridge import upstreams
from codecage.errors import ConfigError

HOSTS = ("claude-code", "cursor", "vscode", "claude-desktop")
# ~/.claude.json also keeps Claude Code's history per project: larger than a config file.
_MAX_BYTES = 64 * 1024 * 1024
# Keys hosts write into an entry that say nothing about how to start the server.
_IGNORED_KEYS = ("type", "transport", "description", "dev", "gallery", "version", "name")
_DEFAULTED = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*):-([^}]*)\}")
_ENV = re.compile(r"\$\{env:([A-Za-z_][A-Za-z0-9_]*)\}")
_EDITOR_ONLY = re.compile(
    r"\$\{(?:input|workspaceFolder|workspaceFolderBasename|command|config)\b[^}]*\}"
)


@dataclass
class HostServers:
    """What one host's files gave: the servers found and those skipped, with why."""

    host: str
    files: list[Path] = field(default_factory=list)
    servers: dict[str, upstreams.Upstream] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)

    def as_json(self) -> dict[str, Any]:
        return {
            "host": self.host,
            "files": [str(f) for f in self.files],
            "servers": sorted(self.servers),
            "skipped": dict(self.skipped),
        }

    def describe(self) -> str:
        """One line for stderr: which servers, from which files."""
        where = ", ".join(str(f) for f in self.files) or "no config file found"
        found = ", ".join(sorted(self.servers)) or "no servers"
        line = f"MCP servers of {self.host} ({where}): {found}"
        if self.skipped:
            line += "; skipped " + "; ".join(f"{n} ({why})" for n, why in self.skipped.items())
        return line


def host_files(host: str, environ: Mapping[str, str] | None = None) -> list[Path]:
    """The user-level files of `host` that may hold its servers, in the order read.

    Raises:
        ConfigError: `host` is not one of HOSTS.
    """
    env = os.environ if environ is None else environ
    home = Path(env.get("HOME") or Path.home())
    xdg = Path(env.get("XDG_CONFIG_HOME") or home / ".config")
    if host == "claude-code":
        custom = env.get("CLAUDE_CONFIG_DIR")
        places = [Path(custom) / ".claude.json"] if custom else []
        return [*places, home / ".claude.json", home / ".claude" / ".claude.json"]
    if host == "cursor":
        return [home / ".cursor" / "mcp.json"]
    if host == "vscode":
        return [xdg / "Code" / "User" / "mcp.json", xdg / "Code" / "User" / "settings.json"]
    if host == "claude-desktop":
        return [xdg / "Claude" / "claude_desktop_config.json"]
    raise ConfigError(
        f"unknown MCP host {host!r}",
        hint=f"name one of: {', '.join(HOSTS)}; or pass the file with --mcp-config",
    )


def read(host: str, environ: Mapping[str, str] | None = None) -> HostServers:
    """The servers `host` has configured at user level.

    Raises:
        ConfigError: an unknown host, or a file that is not trusted or not JSON.
    """
    env = dict(os.environ if environ is None else environ)
    found = HostServers(host)
    for path in host_files(host, env):
        if not os.path.lexists(path):
            continue
        raw = _parse(config.read_trusted(path, max_bytes=_MAX_BYTES), path)
        found.files.append(path)
        for name, entry in _table(host, path, raw).items():
            if name in found.servers or name in found.skipped:
                continue  # the first file that names a server wins, as the order says
            try:
                found.servers[name] = _server(name, entry, path, env)
            except _Skip as skip:
                found.skipped[name] = str(skip)
            except ConfigError as exc:
                found.skipped[name] = str(exc).removeprefix(f"{path}: mcpServers.{name}: ")
    return found


def load(
    hosts: Sequence[str], environ: Mapping[str, str] | None = None
) -> tuple[dict[str, upstreams.Upstream], list[HostServers]]:
    """The servers of every host named, merged (the first host that names a server wins),
    and one report per host.

    Raises:
        ConfigError: an unknown host, an untrusted or malformed file, or no server at all.
    """
    reports = [read(host, environ) for host in dict.fromkeys(hosts)]
    servers: dict[str, upstreams.Upstream] = {}
    for report in reports:
        for name, server in report.servers.items():
            if name in servers:
                report.skipped[name] = "a server of that name came from an earlier --mcp-host"
            else:
                servers[name] = server
        for name in report.skipped:
            report.servers.pop(name, None)
    if not servers:
        detail = "; ".join(r.describe() for r in reports)
        raise ConfigError(
            f"no MCP servers to use: {detail}",
            hint="add servers in the host (e.g. `claude mcp add --scope user ...`), or "
            "pass an mcpServers JSON file with --mcp-config",
        )
    return servers, reports


class _Skip(Exception):
    """This entry cannot be started as its host would start it."""


def _parse(data: bytes, path: Path) -> Any:
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path} is not UTF-8 text (byte {exc.start})", hint="") from exc
    if path.name in ("settings.json", "mcp.json"):  # the editors' files allow comments
        text = _strip_jsonc(text)
    try:
        return json.loads(text)
    except ValueError as exc:
        raise ConfigError(f"{path} is not JSON: {exc}", hint="") from exc


def _table(host: str, path: Path, raw: Any) -> dict[str, Any]:
    """The host's table of servers in `raw` (empty when it has none)."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a JSON object", hint="")
    if host == "vscode":
        # mcp.json: {"servers": {...}}; settings.json: {"mcp": {"servers": {...}}}
        holder = raw.get("mcp", {}) if path.name == "settings.json" else raw
        table = holder.get("servers", {}) if isinstance(holder, dict) else {}
    else:
        table = raw.get("mcpServers", {})
    if not isinstance(table, dict):
        raise ConfigError(f"{path}: the servers' table is not a JSON object", hint="")
    return table


def _server(name: str, entry: Any, path: Path, env: dict[str, str]) -> upstreams.Upstream:
    if not isinstance(entry, dict):
        raise _Skip("not a JSON object")
    if entry.get("disabled") is True:
        raise _Skip("disabled in the host")
    kind = entry.get("type") or entry.get("transport")
    if kind == "sse":
        raise _Skip("the SSE transport, which codecage does not speak")
    if kind not in (None, "stdio", "http", "streamable-http", "streamableHttp"):
        raise _Skip(f"type {kind!r}, which codecage does not know")
    if "envFile" in entry:
        raise _Skip("an envFile, which codecage does not read (put the variables in env)")
    fields = {k: v for k, v in entry.items() if k not in _IGNORED_KEYS}
    home = env.get("HOME") or str(Path.home())
    expanded = _expand(fields, env, home)
    # upstreams.parse expands ${NAME} (and says which one is unset) and validates.
    parsed = upstreams.parse({"mcpServers": {name: expanded}}, source=str(path), environ=env)
    if name not in parsed:
        raise _Skip("disabled in the host")
    return parsed[name]


def _expand(value: Any, env: dict[str, str], home: str) -> Any:
    if isinstance(value, str):
        editor = _EDITOR_ONLY.search(value)
        if editor:
            raise _Skip(f"{editor.group(0)}, which only the editor can fill in")
        value = value.replace("${userHome}", home)
        value = _ENV.sub(lambda m: "${" + m.group(1) + "}", value)
        return _DEFAULTED.sub(lambda m: env.get(m.group(1), m.group(2)), value)
    if isinstance(value, list):
        return [_expand(item, env, home) for item in value]
    if isinstance(value, dict):
        return {key: _expand(item, env, home) for key, item in value.items()}
    return value


def _strip_jsonc(text: str) -> str:
    """JSON with comments and trailing commas (VS Code's and Cursor's files) as JSON."""
    out: list[str] = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c == '"':
            j = i + 1
            while j < n and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            out.append(text[i : j + 1])
            i = j + 1
        elif text.startswith("//", i):
            end = text.find("\n", i)
            i = n if end < 0 else end
        elif text.startswith("/*", i):
            end = text.find("*/", i + 2)
            i = n if end < 0 else end + 2
        elif c in "}]":
            # A comma before the closing bracket (whitespace between) is dropped.
            k = len(out) - 1
            while k >= 0 and out[k].isspace():
                k -= 1
            if k >= 0 and out[k] == ",":
                del out[k]
            out.append(c)
            i += 1
        else:
            out.append(c)
            i += 1
    return "".join(out)
