"""What the host reports about itself: layers in force, profiles, pool, tools, doctor."""

from __future__ import annotations

from pydantic import (
    Field,
)

from codecage.models.base import Model
from codecage.models.settings import Limits, NetworkLimits, PoolConfig, SessionSettings


class LayerStatus(Model):
    """One isolation layer and whether it is really in force on this host."""

    name: str = Field(description="Layer, e.g. 'namespaces', 'seccomp', 'memory'.")
    active: bool = Field(description="True when probed and in force.")
    mechanism: str = Field(description="How it is provided, e.g. 'cgroup v1', 'RLIMIT_AS'.")
    detail: str = Field("", description="What was probed, or why it is missing.")


class Ceilings(Model):
    """The largest limits this host accepts per call."""

    memory_mb: int
    max_processes: int
    timeout: float


class ProfileInfo(Model):
    """One capability profile as `info` reports it."""

    name: str
    description: str
    modules: list[str] = Field(
        description="Dotted module prefixes the code may import; `*`: every module."
    )
    packages_importable: dict[str, bool] = Field(
        description="Third-party packages of the profile and whether the sandbox can import them."
    )
    default: bool = Field(description="Whether runs use this profile when none is given.")


class ScrubState(Model):
    """What `info` says of scrubbing: what is redacted, never the configured values."""

    enabled: bool
    categories: list[str] = Field(description="Categories redacted; empty when disabled.")
    secrets: int = Field(description="How many exact secret values are redacted.")
    phone_region: str
    source: str = Field(description="Where the setting came from (default, file, env, argument).")


class AuditState(Model):
    """The audit trail of this process (`[audit]`, docs/audit.md)."""

    enabled: bool
    store: str | None = Field(None, description="Its store: a path, or a URL without password.")
    required: bool = False
    failure: str | None = Field(None, description="Why the store cannot be written, if so.")


class NetworkState(Model):
    """Which hosts runs may reach here (`[network]` and the operator's grants); all empty:
    no run has network."""

    allow: list[str] = Field(description="Hosts every run may reach ([network] allow).")
    deny: list[str] = Field(description="Hosts no run may reach, whatever allows them.")
    granted: list[str] = Field(
        description="Hosts the operator granted every run of this process (--allow-host, "
        "Sandbox(allow_hosts=))."
    )
    ceiling: list[str] = Field(
        description="The most a call may ask for (allow_hosts): [network] ceiling, allow and "
        "the grants; a call's profile adds its own hosts."
    )
    profiles: dict[str, list[str]] = Field(
        description="Hosts added to the runs of each profile ([network.profiles.NAME])."
    )
    limits: NetworkLimits = Field(description="Bounds of each run's egress.")


class ToolsState(Model):
    """What `info` says of the upstream MCP tools the code may call, and their bounds."""

    servers: list[str] = Field(
        description="Upstream servers this sandbox's code can call; empty: tool calls fail."
    )
    configured_servers: list[str] = Field(
        description="Servers in the config file's [mcpServers] (`run` and `serve` start them)."
    )
    sandboxed_servers: list[str] = Field(
        default_factory=list,
        description="Of those servers, the ones that run in a sandbox of their own.",
    )
    allowed_tools: list[str] | None = Field(
        description="'server.tool' patterns the code may call; None: all the servers allow."
    )
    tokenize: bool | None = Field(description="Personal data in tool results becomes tokens.")
    max_calls: int = Field(description="Tool calls per run.")
    max_in_flight: int = Field(description="Tool calls running at once in one run.")
    max_result_mb: float = Field(description="Size of one tool result.")
    servers_dir: str | None = Field(description="The typed tool tree, at /servers.")
    skills_dir: str | None = Field(description="Reusable functions, at /skills.")


class PoolKeyState(Model):
    """One pool key: the sandboxes kept warm for one profile (and sizes)."""

    profile: str = Field(description="Import profile(s) of these sandboxes; 'none' = no policy.")
    preload: list[str] = Field(description="Modules imported before the request comes.")
    workspace_mb: int
    tmp_mb: int
    idle: int = Field(description="Ready now, each waiting for its one request.")
    starting: int
    target: int = Field(description="How many it keeps ready now (min_idle..max_idle).")
    min_idle: int
    max_idle: int
    hits: int = Field(description="Runs that got a warm sandbox.")
    misses: int = Field(description="Runs that found none and started cold.")
    started: int
    crashed: int = Field(description="Idle sandboxes that died and were replaced.")
    failed_starts: int
    last_error: str | None
    idle_rss_mb: float | None = Field(
        description="Resident memory of one idle sandbox, all its processes together "
        "(shared pages counted in each); None when none is idle."
    )
    idle_pss_mb: float | None = Field(
        description="The same as proportional set size (shared pages divided among sharers)."
    )


class PoolState(Model):
    """What `info` says of the warm pool."""

    enabled: bool
    config: PoolConfig
    keys: list[PoolKeyState] = Field(description="Live keys; empty when no pool runs here.")
    host_rss_mb: float | None = Field(description="Resident memory of this (host) process.")
    fork_server: ForkServerState | None = Field(
        None, description="The fork server: on or why not, its templates and their memory."
    )


class TemplateState(Model):
    """One fork-server template, as `info` lists it."""

    profile: str
    rss_mb: float | None
    pss_mb: float | None = Field(description="Its share of memory (forks share its pages).")


class ForkServerState(Model):
    """What `info` says of the fork server (engine/forkserver.py)."""

    enabled: bool = Field(description="Sandboxes of fresh-workspace, no-network runs are forked.")
    why_not: str | None = Field(None, description="Why it is off, when it is.")
    forked: int = Field(0, description="Sandboxes this process forked so far.")
    prefork: bool = Field(
        False,
        description="This host forks the next sandbox of a run's kind after the run, so that "
        "the next run only sends its request ([pool] prefork, for a host without a pool; "
        "`codecage info` itself has none: see pool.config.prefork for the setting).",
    )
    spares: int = Field(0, description="Sandboxes forked ahead and idle now (one per kind).")
    spares_taken: int = Field(0, description="Runs so far that found theirs forked ahead.")
    templates: list[TemplateState] = Field(default_factory=list)


class AddedPackage(Model):
    """A distribution the operator added with `codecage packages add` (or pulled in by one)."""

    name: str
    version: str
    requested: bool = Field(True, description="Named by the operator, not only a dependency.")


class BackendState(Model):
    """One backend as `info` lists it."""

    name: str
    available: bool = Field(description="It can run on this host.")
    in_force: bool = Field(description="The backend this process runs sandboxes with.")
    degraded: bool = Field(
        description="A fallback without namespaces: never picked unless allowed by name "
        "or with --allow-degraded, and every result says what it lacks."
    )
    why_not: str | None = Field(None, description="Why it is not available, and what to do.")


class HostInfo(Model):
    """What `codecage info` reports: backend, mechanisms in force, defaults and ceilings."""

    version: str
    backend: str
    backends: dict[str, bool] = Field(description="Every backend codecage knows: available here?")
    backend_states: list[BackendState] = Field(
        [], description="Every backend: available, in force, degraded, and why not."
    )
    bwrap_version: str | None
    python: str = Field(description="Interpreter that runs inside the sandbox.")
    layers: list[LayerStatus]
    default_limits: Limits
    limit_sources: dict[str, str] = Field(
        description="Where each setting came from: 'default', 'file PATH', 'env CODECAGE_…' "
        "or 'argument'."
    )
    profiles: list[ProfileInfo] = Field(description="Capability profiles (import policy).")
    config_file: str | None = Field(description="The config file in force; None = none found.")
    config_origin: str = Field(
        "none",
        description="Where the config file came from: 'argument' (--config, "
        "Sandbox(config=...)), 'env' (CODECAGE_CONFIG), 'user' ($XDG_CONFIG_HOME/codecage), "
        "'system' (/etc/codecage) or 'none'. Never the current directory.",
    )
    import_policy: str | None = Field(
        description="The profile(s) this Sandbox applies; None when the import policy is off."
    )
    ceilings: Ceilings
    pool: PoolState | None = Field(None, description="The warm pool's settings and state.")
    scrub: ScrubState | None = Field(None, description="What results are scrubbed of.")
    tools: ToolsState | None = Field(
        None, description="Upstream MCP tools the code may call, and the bounds of its calls."
    )
    packages: list[AddedPackage] = Field(
        [],
        description="Packages the operator added (`codecage packages add`), importable where "
        "the profile allows them.",
    )
    data_dir: str | None = Field(
        None,
        description="The host directory every sandbox sees read-only at /data (`serve "
        "--data DIR`, `Sandbox(data_dir=...)`); None: there is no /data.",
    )
    sessions: SessionSettings | None = Field(
        None, description="The bounds of sessions (the config's [sessions])."
    )
    open_sessions: int = Field(0, ge=0, description="Sessions this process holds open now.")
    network: NetworkState | None = Field(
        None, description="Which hosts runs may reach (the config's [network], the grants)."
    )
    audit: AuditState | None = Field(None, description="Whether runs are put on record, where.")


class ProbeResult(Model):
    """One check of `codecage doctor`, proven by running code in a real sandbox."""

    layer: str
    passed: bool
    detail: str
    weak: bool = Field(
        default=False,
        description="The layer is not in force because the backend does not provide it by "
        "design (the Landlock fallback's namespaces and private root; each result names "
        "them as degraded_isolation events): `passed` is False, doctor prints WEAK.",
    )


class DoctorReport(Model):
    """All checks of `codecage doctor`."""

    backend: str
    passed: bool
    probes: list[ProbeResult]

    def failed_layers(self) -> list[str]:
        return [p.layer for p in self.probes if not p.passed]
