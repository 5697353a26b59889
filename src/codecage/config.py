"""Configuration: one place for defaults, with a known source for every value.

Precedence, highest first: the call's own argument (CLI flag, library argument) > a
`CODECAGE_*` environment variable > the TOML config file > the built-in default.

The config file is the first of: the path given (`--config`, `Sandbox(config=...)`),
`$CODECAGE_CONFIG`, `$XDG_CONFIG_HOME/codecage/config.toml` (default
`~/.config/codecage/config.toml`), `/etc/codecage/config.toml`. None is needed. Only places
the operator controls are searched, never the current directory: the file can start host
commands (`[mcpServers]`), turn scrubbing off and mount host directories (`[tools]`), so a
`codecage.toml` that a project, or code run earlier with `--workspace .`, left in the
current directory must not configure the next run.

The file must be trusted (`_open_trusted`): a regular file owned by the effective user or
root and not writable by group or others, and every directory a name on its path is looked
up in (symbolic links included, followed by hand) owned by that user or root and not
writable by group or others unless sticky (`/tmp`), as OpenSSH's StrictModes asks of
`authorized_keys`. The checks are made on the descriptors the file is then read from, so
nothing can be swapped between check and use. A file that fails is refused (`ConfigError`),
never skipped. And no place the configuration is read from may lie inside a run's
`--workspace` (`check_workspace`): code there could write the next run's configuration.

```toml
[limits]                 # any field of Limits
timeout = 10
memory_mb = 256

[policy]
profile = "basic"                     # default profile(s), comma-separated (built-in
                                      # default: "standard", which refuses no import)
allowed_imports = ["os.path"]         # added to every run's profile
enabled_profiles = ["basic", "filesystem", "analyst"]   # the only ones a caller may pick

[profiles.analyst]                    # an operator-defined profile
extends = ["basic"]
modules = ["statistics", "decimal"]

[pool]                                # warm single-use sandboxes (see codecage.engine.pool)
enabled = true
sizes = { min_idle = 2, max_idle = 8 }
profiles.data_science = { min_idle = 1, max_idle = 2 }

[scrub]                               # what results are scrubbed of (on by default)
ip = false                            # a switch per category: email, phone, ssn,
                                      # credit_card, iban, ip, secret
secrets_env = ["GITHUB_TOKEN"]        # values of these variables are redacted as [SECRET]

[serve]                               # codecage serve (MCP)
reply_max_tokens = 20000              # estimated tokens a tool reply may take at most
data_dir = "/srv/codecage-data"       # read-only at /data in every sandbox (--data DIR)

[sessions]                            # state across runs, where a caller asks for it
idle_ttl = 600                        # seconds unused before a session is closed
max_idle_ttl = 1800                   # the longest idle TTL a client may ask for
lifetime = 3600                       # seconds a session lives at most
cpu_seconds = 600                     # CPU seconds of all of one session's runs
max_per_client = 4                    # open sessions per client (max_total per process)
local_idle_exit = 600                 # `codecage session`'s own server exits when idle this long

[mcpServers.memory]                   # upstream MCP servers, as in an MCP host's JSON
command = "npx"                       # (used when no --mcp-config is given)
args = ["-y", "@modelcontextprotocol/server-memory"]
env = { MEMORY_FILE_PATH = "/var/lib/agent/memory.jsonl" }

[tools]                               # defaults of the tool flags of run, serve and gen
servers_dir = "servers"               # relative to this file's directory
skills_dir = "skills"
allow = ["memory.read_*", "memory.search_nodes"]
max_calls = 200                       # tool calls per run (also max_in_flight, max_result_mb)

[packages]                            # packages the operator added (`codecage packages`)
dir = "/srv/codecage/packages"        # default: /var/lib/codecage/packages (root), else
                                      # $XDG_DATA_HOME/codecage/packages

[approval]                            # a person approves a run by what it is granted
require = "grants"                    # "grants" or "always"; unset: no approval
capabilities = ["network", "tools", "workspace"]  # what waits under "grants" (the default)
timeout = 300                         # seconds to answer; no answer is a denial
```

Environment variables: `CODECAGE_<LIMIT>` for each limit, `CODECAGE_PROFILE`,
`CODECAGE_ALLOWED_IMPORTS`, `CODECAGE_ENABLED_PROFILES`, `CODECAGE_POOL` (1/0),
`CODECAGE_POOL_MIN_IDLE`, `CODECAGE_POOL_MAX_IDLE`, `CODECAGE_FORK_SERVER` (1/0),
`CODECAGE_PREFORK` (1/0),
`CODECAGE_SCRUB` (1/0),
`CODECAGE_SCRUB_CATEGORIES` (comma-separated: the categories to redact),
`CODECAGE_PACKAGES_DIR` (read by `codecage.packages`), `CODECAGE_REPLY_MAX_TOKENS`,
`CODECAGE_AUDIT` (the audit store: a SQLite path or a postgresql:// URL; 1/0 on/off).
"""

from __future__ import annotations

import logging
import os
import stat
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from pydantic_core import ErrorDetails

from codecage.configsearch import ENV_CONFIG
from codecage.configsearch import SYSTEM_CONFIG as SYSTEM_CONFIG  # host.py reads it here
from codecage.configsearch import candidate_paths as candidate_paths  # tests, host.py
from codecage.errors import ConfigError
from codecage.models import (
    SCRUB_CATEGORIES,
    AlertSettings,
    ApprovalSettings,
    AuditSettings,
    Limits,
    NetworkSettings,
    PoolConfig,
    ScrubSettings,
    ServeSettings,
    SessionSettings,
)
from codecage.policy.profiles import BUILTIN_PROFILES, DEFAULT_PROFILE

# Where the file in force came from (`Settings.config_origin`, `codecage info`).
ORIGINS = {
    "argument": "--config / Sandbox(config=...)",
    "env": f"${ENV_CONFIG}",
    "user": "the user's config directory",
    "system": "the system's config directory",
    "none": "no config file",
}
_MAX_BYTES = 4 * 1024 * 1024  # a config file is a few KiB; this only bounds a mistake
_MAX_LINKS = 40  # symbolic links followed on one path, as the kernel's MAXSYMLINKS

log = logging.getLogger(__name__)


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


class PackagesFile(_FileModel):
    dir: str | None = Field(
        None,
        description="Where `codecage packages` installs (relative: to the file's directory).",
    )


def _host_id(kind: str) -> Any:
    """[sandbox] uid or gid: one host id for every sandbox; not 0 (root), nor 2**32 - 1
    (-1 to the kernel: "leave it unchanged")."""
    return Field(
        None,
        ge=1,
        le=2**32 - 2,
        description=f"Host {kind} every sandbox runs as when codecage runs as root (never 0); "
        "unset: each sandbox gets its own from id_base/id_count.",
    )


class SandboxFile(_FileModel):
    uid: int | None = _host_id("uid")
    gid: int | None = _host_id("gid")
    id_base: int = Field(
        2_000_000_000,
        ge=1,
        le=2**32 - 3,
        description="As root, the first of the host ids sandboxes get one each of (uid = "
        "gid; the first is the fork server's templates'); the range must be nobody's.",
    )
    id_count: int = Field(
        65_536,
        ge=2,
        le=2**31,
        description="How many ids the range of id_base holds: one per sandbox alive at "
        "once on this host, plus one.",
    )
    backends: list[str] | None = Field(
        None,
        description="The order `auto` tries backends in, strongest first (default: bwrap, "
        "gvisor); it takes the first whose self-test passes.",
    )


class ConfigFile(_FileModel):
    """The TOML file's shape; unknown keys are refused with their name."""

    limits: dict[str, Any] = Field({}, description="Overrides of the default Limits.")
    policy: PolicyFile = PolicyFile()
    profiles: dict[str, ProfileFile] = Field({}, description="Operator-defined profiles.")
    pool: PoolConfig = Field(PoolConfig(), description="The warm pool.")
    scrub: ScrubSettings = Field(ScrubSettings(), description="Scrubbing of results.")
    serve: ServeSettings = Field(ServeSettings(), description="Settings of `codecage serve`.")
    sessions: SessionSettings = Field(SessionSettings(), description="Sessions' limits.")
    network: NetworkSettings = Field(NetworkSettings(), description="Egress through the proxy.")
    audit: AuditSettings = Field(AuditSettings(), description="The audit trail.")
    approval: ApprovalSettings = Field(
        ApprovalSettings(), description="Human approval of a run by what it is granted."
    )
    alerts: AlertSettings = Field(AlertSettings(), description="Alerts to a webhook or command.")
    tools: ToolsFile = Field(ToolsFile(), description="Tool trees and allow-list.")
    packages: PackagesFile = Field(PackagesFile(), description="Packages the operator added.")
    sandbox: SandboxFile = Field(SandboxFile(), description="Who sandboxes are on the host.")
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
    config_origin: str = "none"  # a key of ORIGINS
    # Every real path the file's lookup went through (directories and the file), and the
    # places a config file was searched: none may lie inside a run's workspace.
    config_lookups: tuple[Path, ...] = ()
    config_searched: tuple[Path, ...] = ()
    pool: PoolConfig = field(default_factory=PoolConfig)
    scrub: ScrubSettings = field(default_factory=ScrubSettings)
    serve: ServeSettings = field(default_factory=ServeSettings)
    sessions: SessionSettings = field(default_factory=SessionSettings)
    network: NetworkSettings = field(default_factory=NetworkSettings)
    audit: AuditSettings = field(default_factory=AuditSettings)
    approval: ApprovalSettings = field(default_factory=ApprovalSettings)
    alerts: AlertSettings = field(default_factory=AlertSettings)
    tools: ToolsFile = field(default_factory=ToolsFile)
    packages: PackagesFile = field(default_factory=PackagesFile)
    sandbox: SandboxFile = field(default_factory=SandboxFile)
    mcp_servers: dict[str, Any] = field(default_factory=dict)  # the file's [mcpServers.*]

    def config_relative(self, path: str | None) -> Path | None:
        """A path from the config file, relative to the file's directory."""
        if path is None:
            return None
        base = self.config_file.parent if self.config_file is not None else Path.cwd()
        return base / Path(path).expanduser()


def load(path: Path | None = None, environ: Mapping[str, str] | None = None) -> Settings:
    """Built-in defaults, then the config file, then the environment.

    Raises:
        ConfigError: the file cannot be read, is not trusted (owner, mode, a directory on
            its way: see the module docstring), or has a bad key or value (the message
            names the file, the key and the reason), or an environment variable is invalid.
    """
    env = os.environ if environ is None else environ
    searched = [*([("argument", path)] if path is not None else []), *candidate_paths(env)]
    origin, chosen = "none", None
    for where_from, candidate in searched:
        # lexists: a dangling link or an unreadable file is refused below, not skipped.
        if where_from == "argument" or os.path.lexists(candidate):
            origin, chosen = where_from, candidate
            break
    lookups: tuple[Path, ...] = ()
    if chosen is not None:
        parsed, lookups = _read(chosen, explicit=origin == "argument")
    else:
        parsed = ConfigFile()
    log.debug("config.file", extra={"path": str(chosen), "origin": origin})
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
    profile, sources["profile"] = _pick(
        parsed.policy.profile, DEFAULT_PROFILE, where, env, "PROFILE"
    )
    imports, sources["allowed_imports"] = _pick_list(
        parsed.policy.allowed_imports, where, env, "ALLOWED_IMPORTS"
    )
    enabled, sources["enabled_profiles"] = _pick_enabled(parsed.policy.enabled_profiles, where, env)
    custom = _custom_profiles(parsed.profiles, chosen)
    pool, sources["pool"] = _pool_settings(parsed.pool, where, env)
    scrub, sources["scrub"] = _scrub_settings(parsed.scrub, where, env)
    serve, sources["reply_max_tokens"] = _serve_settings(parsed.serve, where, env)
    return Settings(
        limits=limits,
        profile=profile,
        allowed_imports=tuple(imports),
        enabled_profiles=tuple(enabled) if enabled is not None else None,
        custom_profiles=custom,
        config_file=chosen,
        sources=sources,
        config_origin=origin,
        config_lookups=lookups,
        config_searched=tuple(p for _, p in searched),
        pool=pool,
        scrub=scrub,
        serve=serve,
        sessions=parsed.sessions,
        network=parsed.network,
        audit=_audit_settings(parsed.audit, where, env, sources),
        approval=parsed.approval,
        alerts=parsed.alerts,
        tools=parsed.tools,
        packages=parsed.packages,
        sandbox=parsed.sandbox,
        mcp_servers=parsed.mcp_servers,
    )


ENV_AUDIT = "CODECAGE_AUDIT"


def _audit_settings(
    parsed: AuditSettings, where: str, env: Mapping[str, str], sources: dict[str, str]
) -> AuditSettings:
    """The file's [audit] table; CODECAGE_AUDIT names the store (a path or a URL) and turns
    the trail on, or turns it off with 0."""
    sources["audit"] = where if parsed.enabled is not None or parsed.store else "default"
    value = env.get(ENV_AUDIT, "").strip()
    if not value:
        return parsed
    sources["audit"] = f"env {ENV_AUDIT}"
    if value in ("0", "off", "false"):
        return parsed.model_copy(update={"enabled": False})
    if value in ("1", "on", "true"):
        return parsed.model_copy(update={"enabled": True})
    return parsed.model_copy(update={"enabled": True, "store": value})


def check_workspace(settings: Settings, workspace: str | Path | None) -> None:
    """Refuse a workspace that holds a place this process's configuration is read from.

    Code in the run can write its workspace, and what it writes stays: a config file there
    (or a directory or link on the file's path, or a place a config file is searched) would
    configure a later run, whose `[mcpServers]` commands run on the host.

    Raises:
        ConfigError: the workspace contains the config file in use or a place searched.
    """
    if workspace is None:
        return
    root = Path(workspace).resolve()
    places = [*settings.config_lookups]
    for searched in settings.config_searched:
        places += [searched.resolve(), searched.absolute()]
    for place in places:
        if place.is_relative_to(root):
            in_use = settings.config_file is not None and place in settings.config_lookups
            what = f"the config file in use ({settings.config_file})" if in_use else place
            raise ConfigError(
                f"the workspace {workspace} contains {what}: code run there could write the "
                "configuration of later runs, whose [mcpServers] commands run on this host",
                hint="choose a workspace directory that holds no codecage config (not your "
                "home, ~/.config or /etc), or keep the config file outside it",
            )


def _read(path: Path, *, explicit: bool) -> tuple[ConfigFile, tuple[Path, ...]]:
    """The parsed file, and the real paths its lookup went through."""
    raw, lookups = _read_limited(
        path,
        explicit=explicit,
        max_bytes=_MAX_BYTES,
        label="config file ",
        size_hint="a codecage config file is a few kilobytes of TOML: check which file this is",
    )
    try:
        data = tomllib.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc}", hint="") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}", hint="") from exc
    except ValueError as exc:  # an integer past Python's 4300 digits: valid TOML, no number
        raise ConfigError(f"{path}: a value cannot be read: {exc}", hint="") from exc
    except RecursionError as exc:  # tomllib recurses into nested arrays and tables
        raise ConfigError(
            f"{path}: arrays or tables nested too deeply to read",
            hint="a codecage config file nests a few levels at most",
        ) from exc
    return _validated(
        ConfigFile,
        data,
        lambda err: (
            f"{path}: bad key {_dotted(err)}: {err['msg']}",
            "see docs/configuration.md for the file's keys",
        ),
    ), lookups


def read_trusted(path: Path, *, max_bytes: int = _MAX_BYTES) -> bytes:
    """The bytes of `path`, opened and checked as the config file is (`_open_trusted`):
    for other files whose content starts host commands, such as an MCP host's list of
    servers (`codecage.bridge.hosts`).

    Raises:
        ConfigError: the file is missing, not a regular file, not trusted, unreadable, or
            larger than `max_bytes`.
    """
    data, _ = _read_limited(path, explicit=True, max_bytes=max_bytes, label="", size_hint="")
    return data


def _read_limited(
    path: Path, *, explicit: bool, max_bytes: int, label: str, size_hint: str
) -> tuple[bytes, tuple[Path, ...]]:
    """The bytes of a trusted `path` (`_open_trusted`), at most `max_bytes`, and the real
    paths its lookup went through; `label` ("config file ") goes before the path in errors."""
    fd, lookups = _open_trusted(path, explicit=explicit)
    try:
        with os.fdopen(fd, "rb") as handle:
            data = handle.read(max_bytes + 1)
    except OSError as exc:
        raise ConfigError(f"cannot read {label}{path}: {exc.strerror or exc}", hint="") from exc
    if len(data) > max_bytes:
        raise ConfigError(f"{label}{path} is larger than {max_bytes} bytes", hint=size_hint)
    return data, lookups


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC


def _open_trusted(path: Path, *, explicit: bool) -> tuple[int, tuple[Path, ...]]:
    """A descriptor of `path` for reading, and the real paths its lookup went through.

    The path is resolved by hand, one name at a time from `/`, each directory opened with
    O_NOFOLLOW and checked (`_untrusted`) through its descriptor before a name is looked up
    in it, and symbolic links followed by reading them where they are: so every directory
    and link that decided which file is read is one only root or this user can change, and
    the file checked is the file read.

    Raises:
        ConfigError: the file does not exist, is not a regular file, or is not trusted.
    """
    pending = list(reversed(path.absolute().parts[1:]))
    opened: list[tuple[int, Path, os.stat_result]] = []  # the directories from / down
    lookups: list[Path] = []
    links = 0
    try:
        root_fd = os.open("/", _DIR_FLAGS)
        opened.append((root_fd, Path("/"), os.fstat(root_fd)))
        _refuse_untrusted(path, Path("/"), opened[-1][2], explicit)
        while pending:
            name = pending.pop()
            dir_fd, where, dir_stat = opened[-1]
            lookups.append(where)
            if name in ("", "."):
                continue
            if name == "..":
                if len(opened) > 1:
                    os.close(opened.pop()[0])
                continue
            here = where / name
            st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
            if stat.S_ISLNK(st.st_mode):
                links += 1
                if links > _MAX_LINKS:
                    raise ConfigError(
                        f"config file {path}: too many levels of symbolic links", hint=""
                    )
                if _sticky_shared(dir_stat) and not _trusted_owner(st.st_uid, dir_stat):
                    # What fs.protected_symlinks enforces, which following by hand bypasses.
                    raise _refusal(
                        path, f"{here} is a link owned by uid {st.st_uid} in {where}", explicit
                    )
                target = os.readlink(name, dir_fd=dir_fd)
                pending += reversed(Path(target).parts)
                if Path(target).is_absolute():
                    pending.pop()  # the "/" part: restart from the root
                    while len(opened) > 1:
                        os.close(opened.pop()[0])
                continue
            if pending:
                if not stat.S_ISDIR(st.st_mode):
                    raise ConfigError(f"config file {path}: {here} is not a directory", hint="")
                fd = os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
                opened.append((fd, here, os.fstat(fd)))
                _refuse_untrusted(path, here, opened[-1][2], explicit)
                continue
            if not stat.S_ISREG(st.st_mode):  # checked before opening: a device is not opened
                raise ConfigError(
                    f"config file {path}: {here} is not a regular file",
                    hint="give the path of a TOML file",
                )
            fd = os.open(name, _FILE_FLAGS, dir_fd=dir_fd)
            try:
                _refuse_untrusted(path, here, os.fstat(fd), explicit)
            except BaseException:
                os.close(fd)
                raise
            lookups.append(here)
            return fd, tuple(dict.fromkeys(lookups))
        raise ConfigError(f"config file {path} is a directory", hint="give a TOML file")
    except FileNotFoundError as exc:
        raise ConfigError(
            f"config file {path} does not exist",
            hint="check the path, and where any symbolic link on it points",
        ) from exc
    except OSError as exc:
        raise ConfigError(
            f"cannot read config file {path}: {exc.strerror or exc}",
            hint="check the path and its permissions",
        ) from exc
    finally:
        for fd, _, _ in opened:
            os.close(fd)


def _refuse_untrusted(path: Path, here: Path, st: os.stat_result, explicit: bool) -> None:
    """Raise if `here` (the file, or a directory on its way) can be changed by someone who
    is neither root nor this user: then that someone would choose the configuration."""
    reason = untrusted_reason(here, st)
    if reason is not None:
        raise _refusal(path, reason, explicit)


def untrusted_reason(here: Path, st: os.stat_result, *, sticky_ok: bool = True) -> str | None:
    """Why `here` (status `st`) could be changed by someone who is neither root nor this
    user, or None: the trust rule of the config file, which the operator's package
    directory (`codecage.packages`) follows too. A sticky shared directory (`/tmp`) passes
    when `sticky_ok`: others may add names to it, not replace ours."""
    kind = "directory" if stat.S_ISDIR(st.st_mode) else "file"
    if st.st_uid not in (0, os.geteuid()):
        return f"the {kind} {here} is owned by uid {st.st_uid}"
    writable = st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
    if writable and not (sticky_ok and kind == "directory" and st.st_mode & stat.S_ISVTX):
        who = " and ".join(
            w for w, bit in (("group", stat.S_IWGRP), ("others", stat.S_IWOTH)) if writable & bit
        )
        mode = stat.S_IMODE(st.st_mode)
        return f"the {kind} {here} is writable by {who} (mode {mode:o})"
    return None


def trusted_directory(directory: Path, what: str, *, hint: str, missing_hint: str = "") -> Path:
    """The real path of `directory` (`what` names it in errors, e.g. "the packages
    directory"), once it and every directory above it are known to be changeable only by
    root or this user (`untrusted_reason`).

    Raises:
        ConfigError: it does not exist, is not a directory, or is not trusted (`hint`).
    """
    try:
        real = Path(os.path.realpath(directory, strict=True))
    except OSError as exc:
        raise ConfigError(
            f"{what} {directory} cannot be used: {exc.strerror or exc}", hint=missing_hint
        ) from exc
    for depth in range(1, len(real.parts) + 1):
        here = Path(*real.parts[:depth])
        # realpath left no links; one that appears now is refused (not a directory), and
        # only root or this user could have put it there (the directory above is checked).
        st = os.lstat(here)
        if not stat.S_ISDIR(st.st_mode):
            raise ConfigError(f"{what} {directory}: {here} is not a directory")
        reason = untrusted_reason(here, st, sticky_ok=here != real)
        if reason is not None:
            raise ConfigError(f"{what} {directory} is not trusted: {reason}", hint=hint)
    return real


def create_directory(directory: Path, what: str, *, mode: int, hint: str) -> None:
    """Create `directory` with `mode` and any missing parents 0755, whatever the umask (002
    would make them group-writable): readable by the sandbox's user, writable by the
    operator only. One that exists already is left as it is (`trusted_directory` checks it).

    Raises:
        ConfigError: one could not be created (`what` names it, `hint` says what to do).
    """
    missing: list[Path] = []
    here = directory
    while not os.path.lexists(here):
        missing.append(here)
        here = here.parent
    for path in reversed(missing):
        path_mode = mode if path == directory else 0o755
        try:
            path.mkdir(mode=path_mode)
            path.chmod(path_mode)
        except FileExistsError:
            pass
        except OSError as exc:
            raise ConfigError(
                f"cannot create {what} {path}: {exc.strerror or exc}", hint=hint
            ) from exc


def _sticky_shared(st: os.stat_result) -> bool:
    return bool(st.st_mode & stat.S_ISVTX and st.st_mode & (stat.S_IWGRP | stat.S_IWOTH))


def _trusted_owner(uid: int, dir_stat: os.stat_result) -> bool:
    return uid in (0, os.geteuid(), dir_stat.st_uid)


def _refusal(path: Path, reason: str, explicit: bool) -> ConfigError:
    hint = (
        "only root or you may be able to change a config file and the directories on its "
        "way: chown it to you or root and `chmod go-w` it (and them)"
    )
    if not explicit:
        hint += ", or pass --config (CODECAGE_CONFIG) to a file you own"
    return ConfigError(f"config file {path} is not trusted: {reason}", hint=hint)


_Model = TypeVar("_Model", bound=BaseModel)


def _validated(
    model: type[_Model], data: object, message: Callable[[ErrorDetails], tuple[str, str]]
) -> _Model:
    """`data` as a `model`, or a ConfigError about its first error: `message` turns that
    error into the error's text and hint, in the words of where the data came from."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        text, hint = message(exc.errors()[0])
        raise ConfigError(text, hint=hint) from exc


def _shown(value: object, limit: int = 80) -> str:
    """A bad value in an error message: its repr, cut (an environment variable can hold
    megabytes, and the message is printed whole)."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text):,} characters)"


def _dotted(err: ErrorDetails) -> str:
    """Where a validation error is, as a dotted key (`sandbox.timeout_s`)."""
    return ".".join(str(p) for p in err["loc"])


def _validated_limits(data: dict[str, Any], sources: dict[str, str]) -> Limits:
    def message(err: ErrorDetails) -> tuple[str, str]:
        name = str(err["loc"][0])
        return (
            f"{name}={_shown(err.get('input'))} from {sources.get(name, 'default')}: {err['msg']}",
            f"fix {{{name}}}; {{info}} lists the defaults and bounds",
        )

    return _validated(Limits, data, message)


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


def _env_flag(env: Mapping[str, str], key: str, hint: str) -> bool:
    """The yes/no value of `env[key]` (`1`, `true`, `yes`, `on` or their opposites)."""
    value = env[key].strip().lower()
    if value not in _TRUE | _FALSE:
        raise ConfigError(f"{key}={_shown(env[key])} is not a yes/no value", hint=hint)
    return value in _TRUE


def _pool_settings(
    from_file: PoolConfig, where: str, env: Mapping[str, str]
) -> tuple[PoolConfig, str]:
    """The file's [pool] table, overridden by CODECAGE_POOL, _POOL_MIN_IDLE, _POOL_MAX_IDLE,
    CODECAGE_FORK_SERVER and CODECAGE_PREFORK."""
    data = from_file.model_dump()
    source = where if from_file != PoolConfig() else "default"
    if "CODECAGE_POOL" in env:
        hint = "set CODECAGE_POOL=1 to enable the warm pool, 0 to disable it"
        data["enabled"], source = _env_flag(env, "CODECAGE_POOL", hint), "env CODECAGE_POOL"
    if "CODECAGE_FORK_SERVER" in env:
        hint = "set CODECAGE_FORK_SERVER=1 to fork sandboxes from a template, 0 to start each anew"
        data["fork_server"] = _env_flag(env, "CODECAGE_FORK_SERVER", hint)
        source = "env CODECAGE_FORK_SERVER"
    if "CODECAGE_PREFORK" in env:
        hint = "set CODECAGE_PREFORK=1 to fork the next sandbox after each run, 0 not to"
        data["prefork"] = _env_flag(env, "CODECAGE_PREFORK", hint)
        source = "env CODECAGE_PREFORK"
    for name in ("min_idle", "max_idle"):
        key = f"CODECAGE_POOL_{name.upper()}"
        if key in env:
            data["sizes"][name], source = env[key], f"env {key}"
    return _validated(
        PoolConfig,
        data,
        lambda err: (
            f"pool.{_dotted(err)}={_shown(err.get('input'))} from {source}: {err['msg']}",
            "fix that value; `codecage info` shows the pool settings",
        ),
    ), source


def _serve_settings(
    from_file: ServeSettings, where: str, env: Mapping[str, str]
) -> tuple[ServeSettings, str]:
    """The file's [serve] table, overridden by CODECAGE_REPLY_MAX_TOKENS."""
    key = "CODECAGE_REPLY_MAX_TOKENS"
    if key not in env:
        source = where if "reply_max_tokens" in from_file.model_fields_set else "default"
        return from_file, source
    return _validated(
        ServeSettings,
        {**from_file.model_dump(exclude_unset=True), "reply_max_tokens": env[key]},
        lambda err: (
            f"{key}={_shown(env[key])}: {err['msg']}",
            "give a number of tokens from 2000 to 240000 (the default is 20000)",
        ),
    ), f"env {key}"


def _scrub_settings(
    from_file: ScrubSettings, where: str, env: Mapping[str, str]
) -> tuple[ScrubSettings, str]:
    """The file's [scrub] table, overridden by CODECAGE_SCRUB and CODECAGE_SCRUB_CATEGORIES."""
    settings = from_file
    source = where if from_file != ScrubSettings() else "default"
    if "CODECAGE_SCRUB" in env:
        hint = "set CODECAGE_SCRUB=0 to turn scrubbing of results off, 1 to turn it on"
        enabled = _env_flag(env, "CODECAGE_SCRUB", hint)
        settings = settings.model_copy(update={"enabled": enabled})
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
            f"{origin}: unknown scrub categories: {', '.join(u[:80] for u in unknown[:5])}",
            hint=f"choose from: {', '.join(SCRUB_CATEGORIES)}",
        )
    return settings.model_copy(update={c: c in wanted for c in SCRUB_CATEGORIES})
