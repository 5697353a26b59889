"""Configuration: one place for defaults, with a known source for every value.

Precedence, highest first: the call's own argument (CLI flag, library argument) > a
`CODECAGE_*` environment variable > the TOML config file > the built-in default.

The config file is the first of: the path given (`--config`, `Sandbox(config=...)`),
`$CODECAGE_CONFIG`, `./codecage.toml`, `$XDG_CONFIG_HOME/codecage/config.toml` (default
`~/.config/codecage/config.toml`), `/etc/codecage/config.toml`. None is needed.

```toml
[limits]                 # any field of Limits
timeout = 10
memory_mb = 256

[policy]
profile = "basic"                     # default profile(s), comma-separated
allowed_imports = ["os.path"]         # added to every run's profile
enabled_profiles = ["basic", "filesystem", "analyst"]   # the only ones a caller may pick

[profiles.analyst]                    # an operator-defined profile
extends = ["basic"]
modules = ["statistics", "decimal"]

[pool]                                # warm single-use sandboxes (see codecage.pool)
enabled = true
sizes = { min_idle = 2, max_idle = 8 }
profiles.data_science = { min_idle = 1, max_idle = 2 }

[scrub]                               # what results are scrubbed of (on by default)
ip = false                            # a switch per category: email, phone, ssn,
                                      # credit_card, iban, ip, secret
secrets_env = ["GITHUB_TOKEN"]        # values of these variables are redacted as [SECRET]

[mcpServers.memory]                   # upstream MCP servers, as in an MCP host's JSON
command = "npx"                       # (used when no --mcp-config is given)
args = ["-y", "@modelcontextprotocol/server-memory"]
env = { MEMORY_FILE_PATH = "/var/lib/agent/memory.jsonl" }

[tools]                               # defaults of the tool flags of run, serve and gen
servers_dir = "servers"               # relative to this file's directory
skills_dir = "skills"
allow = ["memory.read_*", "memory.search_nodes"]
max_calls = 200                       # tool calls per run (also max_in_flight, max_result_mb)
```

Environment variables: `CODECAGE_<LIMIT>` for each limit, `CODECAGE_PROFILE`,
`CODECAGE_ALLOWED_IMPORTS`, `CODECAGE_ENABLED_PROFILES`, `CODECAGE_POOL` (1/0),
`CODECAGE_POOL_MIN_IDLE`, `CODECAGE_POOL_MAX_IDLE`, `CODECAGE_SCRUB` (1/0),
`CODECAGE_SCRUB_CATEGORIES` (comma-separated: the categories to redact).
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from codecage.errors import ConfigError
from codecage.models import SCRUB_CATEGORIES, Limits, PoolConfig, ScrubSettings
from codecage.profiles import BUILTIN_PROFILES

ENV_CONFIG = "CODECAGE_CONFIG"


class _FileModel(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class PolicyFile(_FileModel):
    profile: str | None = Field(None, description="Default profile(s), comma-separated.")
    allowed_imports: list[str] = Field([], description="Modules added to every profile.")
    enabled_profiles: list[str] | None = Field(
        None, description="Profiles callers may choose; None = all."
    )


class ProfileFile(_FileModel):
    modules: list[str] = Field([], description="Dotted module prefixes the profile allows.")
    extends: list[str] = Field([], description="Built-in profiles whose modules it includes.")


class ToolsFile(_FileModel):
    servers_dir: str | None = Field(
        None, description="The tree `codecage gen` wrote (relative: to the file's directory)."
    )
    skills_dir: str | None = Field(None, description="Reusable functions, read-only at /skills.")
    allow: list[str] | None = Field(None, description='"server.tool" patterns code may call.')
    tokenize: bool | None = Field(None, description="Tokenize personal data in tool results.")
    max_calls: int = Field(200, ge=1, le=100_000, description="Tool calls and scrub()s per run.")
    max_in_flight: int = Field(16, ge=1, le=1000, description="Tool calls running at once.")
    max_result_mb: float = Field(4, gt=0, le=64, description="Size of one tool result (MiB).")


class ConfigFile(_FileModel):
    """The TOML file's shape; unknown keys are refused with their name."""

    limits: dict[str, Any] = Field({}, description="Overrides of the default Limits.")
    policy: PolicyFile = PolicyFile()
    profiles: dict[str, ProfileFile] = Field({}, description="Operator-defined profiles.")
    pool: PoolConfig = Field(PoolConfig(), description="The warm pool.")
    scrub: ScrubSettings = Field(ScrubSettings(), description="Scrubbing of results.")
    tools: ToolsFile = Field(ToolsFile(), description="Tool trees and allow-list.")
    mcp_servers: dict[str, Any] = Field(
        {}, alias="mcpServers", description="Upstream MCP servers, as in an MCP host's JSON."
    )


@dataclass(frozen=True, slots=True)
class Settings:
    """The effective defaults, and where each came from."""

    limits: Limits
    profile: str
    allowed_imports: tuple[str, ...]
    enabled_profiles: tuple[str, ...] | None
    custom_profiles: dict[str, frozenset[str]]
    config_file: Path | None
    sources: dict[str, str] = field(default_factory=dict)
    pool: PoolConfig = field(default_factory=PoolConfig)
    scrub: ScrubSettings = field(default_factory=ScrubSettings)
    tools: ToolsFile = field(default_factory=ToolsFile)
    mcp_servers: dict[str, Any] = field(default_factory=dict)  # the file's [mcpServers.*]

    def config_relative(self, path: str | None) -> Path | None:
        """A path from the config file, relative to the file's directory."""
        if path is None:
            return None
        base = self.config_file.parent if self.config_file is not None else Path.cwd()
        return base / Path(path).expanduser()


def candidate_paths(environ: Mapping[str, str]) -> list[Path]:
    """Where a config file is looked for, in order (see the module docstring)."""
    paths: list[Path] = []
    if environ.get(ENV_CONFIG):
        paths.append(Path(environ[ENV_CONFIG]))
    paths.append(Path.cwd() / "codecage.toml")
    xdg = environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    paths += [Path(xdg) / "codecage" / "config.toml", Path("/etc/codecage/config.toml")]
    return paths


def load(path: Path | None = None, environ: Mapping[str, str] | None = None) -> Settings:
    """Built-in defaults, then the config file, then the environment.

    Raises:
        ConfigError: the file cannot be read or has a bad key or value (the message names
            the file, the key and the reason), or an environment variable is invalid.
    """
    env = os.environ if environ is None else environ
    chosen = path if path is not None else _first_existing(candidate_paths(env))
    if path is not None and not path.is_file():
        raise ConfigError(f"config file {path} does not exist", hint="check the --config path")
    parsed = _read(chosen) if chosen is not None else ConfigFile()
    where = f"file {chosen}"
    sources: dict[str, str] = {}
    limits_data: dict[str, Any] = {}
    for name in Limits.model_fields:
        sources[name] = "default"
        if name in parsed.limits:
            limits_data[name], sources[name] = parsed.limits[name], where
        key = f"CODECAGE_{name.upper()}"
        if key in env:
            limits_data[name], sources[name] = env[key], f"env {key}"
    unknown = set(parsed.limits) - set(Limits.model_fields)
    if unknown:
        raise ConfigError(
            f"{chosen}: unknown key limits.{sorted(unknown)[0]}",
            hint=f"limits keys are: {', '.join(Limits.model_fields)}",
        )
    limits = _validated_limits(limits_data, sources)
    profile, sources["profile"] = _pick(parsed.policy.profile, "basic", where, env, "PROFILE")
    imports, sources["allowed_imports"] = _pick_list(
        parsed.policy.allowed_imports, where, env, "ALLOWED_IMPORTS"
    )
    enabled, sources["enabled_profiles"] = _pick_enabled(parsed.policy.enabled_profiles, where, env)
    custom = _custom_profiles(parsed.profiles, chosen)
    pool, sources["pool"] = _pool_settings(parsed.pool, where, env)
    scrub, sources["scrub"] = _scrub_settings(parsed.scrub, where, env)
    return Settings(
        limits=limits,
        profile=profile,
        allowed_imports=tuple(imports),
        enabled_profiles=tuple(enabled) if enabled is not None else None,
        custom_profiles=custom,
        config_file=chosen,
        sources=sources,
        pool=pool,
        scrub=scrub,
        tools=parsed.tools,
        mcp_servers=parsed.mcp_servers,
    )


def _first_existing(paths: list[Path]) -> Path | None:
    return next((p for p in paths if p.is_file()), None)


def _read(path: Path) -> ConfigFile:
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read config file {path}: {exc}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from exc
    try:
        return ConfigFile.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        key = ".".join(str(p) for p in err["loc"])
        raise ConfigError(
            f"{path}: bad key {key}: {err['msg']}",
            hint="see docs/configuration.md for the file's keys",
        ) from exc


def _validated_limits(data: dict[str, Any], sources: dict[str, str]) -> Limits:
    try:
        return Limits.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        name = str(err["loc"][0])
        raise ConfigError(
            f"{name}={err.get('input')!r} from {sources.get(name, 'default')}: {err['msg']}",
            hint="fix that value; `codecage info` lists the defaults and bounds",
        ) from exc


def _pick(
    file_value: str | None, default: str, where: str, env: Mapping[str, str], suffix: str
) -> tuple[str, str]:
    key = f"CODECAGE_{suffix}"
    if env.get(key):
        return env[key], f"env {key}"
    if file_value is not None:
        return file_value, where
    return default, "default"


def _pick_list(
    file_value: list[str], where: str, env: Mapping[str, str], suffix: str
) -> tuple[list[str], str]:
    key = f"CODECAGE_{suffix}"
    if key in env:
        return [m.strip() for m in env[key].split(",") if m.strip()], f"env {key}"
    if file_value:
        return list(file_value), where
    return [], "default"


def _pick_enabled(
    file_value: list[str] | None, where: str, env: Mapping[str, str]
) -> tuple[list[str] | None, str]:
    key = "CODECAGE_ENABLED_PROFILES"
    if key in env:
        return [p.strip() for p in env[key].split(",") if p.strip()], f"env {key}"
    if file_value is not None:
        return list(file_value), where
    return None, "default"


def _custom_profiles(
    profiles: dict[str, ProfileFile], path: Path | None
) -> dict[str, frozenset[str]]:
    custom: dict[str, frozenset[str]] = {}
    for name, spec in profiles.items():
        modules = frozenset(spec.modules)
        for base in spec.extends:
            if base not in BUILTIN_PROFILES:
                raise ConfigError(
                    f"{path}: profiles.{name}.extends names unknown profile {base!r}",
                    hint=f"extend one of: {', '.join(BUILTIN_PROFILES)}",
                )
            modules |= BUILTIN_PROFILES[base]
        custom[name] = modules
    return custom


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def _pool_settings(
    from_file: PoolConfig, where: str, env: Mapping[str, str]
) -> tuple[PoolConfig, str]:
    """The file's [pool] table, overridden by CODECAGE_POOL, _POOL_MIN_IDLE, _POOL_MAX_IDLE."""
    data = from_file.model_dump()
    source = where if from_file != PoolConfig() else "default"
    if "CODECAGE_POOL" in env:
        value = env["CODECAGE_POOL"].strip().lower()
        if value not in _TRUE | _FALSE:
            raise ConfigError(
                f"CODECAGE_POOL={env['CODECAGE_POOL']!r} is not a yes/no value",
                hint="set CODECAGE_POOL=1 to enable the warm pool, 0 to disable it",
            )
        data["enabled"], source = value in _TRUE, "env CODECAGE_POOL"
    for name in ("min_idle", "max_idle"):
        key = f"CODECAGE_POOL_{name.upper()}"
        if key in env:
            data["sizes"][name], source = env[key], f"env {key}"
    try:
        return PoolConfig.model_validate(data), source
    except ValidationError as exc:
        err = exc.errors()[0]
        field_name = ".".join(str(p) for p in err["loc"])
        raise ConfigError(
            f"pool.{field_name}={err.get('input')!r} from {source}: {err['msg']}",
            hint="fix that value; `codecage info` shows the pool settings",
        ) from exc


def _scrub_settings(
    from_file: ScrubSettings, where: str, env: Mapping[str, str]
) -> tuple[ScrubSettings, str]:
    """The file's [scrub] table, overridden by CODECAGE_SCRUB and CODECAGE_SCRUB_CATEGORIES."""
    settings = from_file
    source = where if from_file != ScrubSettings() else "default"
    if "CODECAGE_SCRUB" in env:
        value = env["CODECAGE_SCRUB"].strip().lower()
        if value not in _TRUE | _FALSE:
            raise ConfigError(
                f"CODECAGE_SCRUB={env['CODECAGE_SCRUB']!r} is not a yes/no value",
                hint="set CODECAGE_SCRUB=0 to turn scrubbing of results off, 1 to turn it on",
            )
        settings = settings.model_copy(update={"enabled": value in _TRUE})
        source = "env CODECAGE_SCRUB"
    if "CODECAGE_SCRUB_CATEGORIES" in env:
        wanted = [c.strip() for c in env["CODECAGE_SCRUB_CATEGORIES"].split(",") if c.strip()]
        settings = with_categories(settings, wanted, "CODECAGE_SCRUB_CATEGORIES")
        source = "env CODECAGE_SCRUB_CATEGORIES"
    return settings, source


def with_categories(settings: ScrubSettings, wanted: list[str], origin: str) -> ScrubSettings:
    """`settings` redacting exactly the categories in `wanted`.

    Raises:
        ConfigError: `wanted` names an unknown category.
    """
    unknown = sorted(set(wanted) - set(SCRUB_CATEGORIES))
    if unknown:
        raise ConfigError(
            f"{origin}: unknown scrub categories: {', '.join(unknown)}",
            hint=f"choose from: {', '.join(SCRUB_CATEGORIES)}",
        )
    return settings.model_copy(update={c: c in wanted for c in SCRUB_CATEGORIES})
