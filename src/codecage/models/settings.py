"""Settings a caller or the operator gives: limits, the pool, scrubbing, `serve`.

Defaults live here and only here; the CLI, `info` and the docs read them from these models.
"""

from __future__ import annotations

import ipaddress
import re
import urllib.parse
from typing import Any, Final

from pydantic import (
    Field,
    field_validator,
    model_validator,
)

from codecage.models.approval import (
    DEFAULT_CAPABILITIES,
    LEGACY_LEVELS,
    ApprovalLevel,
    Capability,
)
from codecage.models.base import Model
from codecage.models.hosts import Credential, HostRule, parse_rules
from codecage.models.status import STATUSES


def _seconds(default: float | None, most: float, description: str) -> Any:
    """A duration setting, in seconds: more than zero, at most `most`."""
    return Field(default, gt=0, le=most, description=description)


class Limits(Model):
    """Resource limits of one run. Every field has a default; any can be overridden per call."""

    timeout: float = _seconds(
        30.0, 3600, "Wall-clock limit in seconds; the whole sandbox is killed when it passes."
    )
    cpu_seconds: int = Field(
        30,
        ge=1,
        le=3600,
        description="CPU time in seconds: summed over every process of the run where a "
        "cgroup is available, else per process (RLIMIT_CPU).",
    )
    memory_mb: int = Field(
        512,
        ge=32,
        le=1_048_576,
        description="Memory in MiB for the whole sandbox, tmpfs and memfd included "
        "(cgroup where available, else RLIMIT_AS per process).",
    )
    max_processes: int = Field(
        64,
        ge=1,
        le=32_768,
        description="Processes and threads the code may have at once.",
    )
    max_open_files: int = Field(
        256,
        ge=16,
        le=65_536,
        description="Open file descriptors per process.",
    )
    max_file_size_mb: int = Field(
        64,
        ge=1,
        le=65_536,
        description="Largest single file the code may write, in MiB.",
    )
    workspace_mb: int = Field(
        256,
        ge=1,
        le=1_048_576,
        description="Total size of /workspace in MiB (a size-limited tmpfs when codecage runs "
        "as root; otherwise only the per-file limit applies).",
    )
    tmp_mb: int = Field(
        64,
        ge=1,
        le=1_048_576,
        description="Size of the private tmpfs at /tmp, in MiB.",
    )
    max_output_bytes: int = Field(
        1_048_576,
        ge=1024,
        le=256 * 1024 * 1024,
        description="Bytes kept of stdout and of stderr, each; the rest is discarded and flagged.",
    )

    def merged(self, overrides: dict[str, Any]) -> Limits:
        """Return a copy with the non-None `overrides` applied, validated again.

        Raises:
            pydantic.ValidationError: an override is out of bounds.
        """
        data = self.model_dump()
        data.update({k: v for k, v in overrides.items() if v is not None})
        return Limits.model_validate(data)


DEFAULT_REPLY_MAX_TOKENS = 20_000


CLIENT_NAME_PATTERN: Final = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"


class ClientSettings(Model):
    """One named HTTP client of `codecage serve --http` ([serve.clients.NAME])."""

    token_env: str = Field(
        pattern=r"^[A-Za-z_][A-Za-z0-9_]{0,127}$",
        description="The environment variable holding this client's bearer token (tokens are "
        "never written in the config file).",
    )
    runs_per_minute: int | None = Field(
        None, ge=1, le=100_000, description="Runs it may start in any 60 s; None: no bound."
    )
    max_concurrent: int | None = Field(
        None, ge=1, le=1024, description="Its runs at once (queued ones count); None: no bound."
    )
    max_memory_mb: int | None = Field(
        None, ge=32, description="The most memory one of its runs may ask for."
    )
    max_timeout: float | None = Field(
        None, gt=0, description="The longest timeout one of its runs may ask for, in seconds."
    )


class ServeSettings(Model):
    """Settings of `codecage serve` (the config file's [serve] table)."""

    reply_max_tokens: int = Field(
        DEFAULT_REPLY_MAX_TOKENS,
        ge=2_000,
        le=240_000,
        description="Estimated tokens one MCP tool reply may take at most, text and "
        "structured content together (estimated high: 4 ASCII characters or 1 byte of "
        "other UTF-8 a token; an image 1,600). Claude Code refuses replies over 25,000 by "
        "default. Longer output is cut in the middle, head and tail kept.",
    )
    backends: list[str] | None = Field(
        None,
        description="Backends an execute_code call may ask for by name (its `backend` "
        'argument), e.g. ["bwrap", "gvisor"]; None: only the one the server runs with. '
        "A call on another backend than the server's runs cold (no warm pool).",
    )
    data_dir: str | None = Field(
        None,
        description="A host directory every sandbox of the server sees read-only at /data "
        "(absolute; not /, nor above or inside codecage's own state); None: no /data. "
        "`serve --data DIR` overrides it.",
    )
    clients: dict[str, ClientSettings] = Field(
        {},
        description="Named HTTP clients, each with its own token and limits "
        "([serve.clients.NAME]); its name goes into the audit trail.",
    )

    @field_validator("clients")
    @classmethod
    def _client_names(cls, value: dict[str, ClientSettings]) -> dict[str, ClientSettings]:
        for name in value:
            if not re.fullmatch(CLIENT_NAME_PATTERN, name):
                raise ValueError(
                    f"serve.clients.{name[:80]!r}: a client's name is 1-64 letters, digits, "
                    "'_', '.', '-'"
                )
        return value


DEFAULT_MAX_IDLE_TTL = 1800.0
"""The longest idle TTL a client may ask for when `[sessions] max_idle_ttl` is not set."""


class SessionSettings(Model):
    """Sessions: one long-lived sandbox whose runs share an interpreter (`[sessions]`)."""

    idle_ttl: float = _seconds(
        600.0,
        86_400,
        "Seconds a session may sit unused before it is closed (each run starts the count again).",
    )
    lifetime: float = _seconds(3600.0, 7 * 86_400, "Seconds a session lives at most, used or not.")
    max_idle_ttl: float | None = _seconds(
        None,
        86_400,
        "The longest idle TTL an MCP client may ask for (open_session's "
        "idle_ttl_seconds); more is refused. None: 1800, or idle_ttl when that is longer. "
        "At least idle_ttl.",
    )
    cpu_seconds: int = Field(
        600,
        ge=1,
        le=86_400,
        description="CPU seconds all the runs of one session may use together (each run "
        "also has its own cpu_seconds limit).",
    )
    max_per_client: int = Field(
        4, ge=0, le=256, description="Open sessions one client may have at once."
    )
    max_total: int = Field(
        16, ge=0, le=1024, description="Open sessions this process holds at once."
    )
    local_idle_exit: float = _seconds(
        600.0,
        86_400,
        "Seconds the per-user local server of `codecage session` (started on "
        "demand when no --server is given) waits with no open session and no request "
        "before it exits.",
    )

    @model_validator(mode="after")
    def _ttl_within_its_maximum(self) -> SessionSettings:
        if self.max_idle_ttl is not None and self.idle_ttl > self.max_idle_ttl:
            raise ValueError(
                f"idle_ttl ({self.idle_ttl:g}) is above max_idle_ttl ({self.max_idle_ttl:g}): "
                "the default a client gets must be one it may ask for"
            )
        return self

    @property
    def most_idle_ttl(self) -> float:
        """The longest idle TTL a client may ask for (`max_idle_ttl`, or its default)."""
        if self.max_idle_ttl is not None:
            return self.max_idle_ttl
        return max(DEFAULT_MAX_IDLE_TTL, self.idle_ttl)


class PoolSizes(Model):
    """How many warm sandboxes one pool key keeps ready."""

    min_idle: int = Field(1, ge=0, le=64, description="Kept ready at all times.")
    max_idle: int = Field(
        4, ge=0, le=64, description="Grown to under load (a run that found none ready)."
    )

    @model_validator(mode="after")
    def _ordered(self) -> PoolSizes:
        if self.max_idle < self.min_idle:
            raise ValueError(f"max_idle={self.max_idle} is below min_idle={self.min_idle}")
        return self


class PoolConfig(Model):
    """The warm pool's settings (`[pool]` in the config file)."""

    enabled: bool = Field(False, description="Run requests in pre-started sandboxes.")
    sizes: PoolSizes = Field(PoolSizes(), description="Sizes of every key by default.")
    profiles: dict[str, PoolSizes] = Field(
        {}, description="Sizes by profile name, e.g. fewer of the heavy data_science."
    )
    max_starting: int = Field(4, ge=1, le=64, description="Sandboxes starting at once.")
    ready_timeout: float = _seconds(60.0, 600, "Seconds a sandbox may take to start and preload.")
    fork_server: bool = Field(
        True,
        description="Fork sandboxes from a warm template (bwrap, as root: namespaces, "
        "workspace, cgroup and filter per run, as a started one has) instead of starting "
        "each anew; off: every sandbox starts bwrap and an interpreter.",
    )
    prefork: bool = Field(
        True,
        description="With the pool off and the fork server on: after each run, fork the "
        "next sandbox of that run's kind from its template in the background (one per "
        "kind, single-use, destroyed on close), so that the next run only sends its "
        "request. Idle, each holds its processes (~7 MB PSS), a cgroup and a workspace "
        "tmpfs; off: every run forks its sandbox when it asks.",
    )
    template_max_runs: int = Field(
        1000,
        ge=1,
        le=1_000_000,
        description="Sandboxes one fork-server template makes before it is replaced (its "
        "forks share its memory layout and hash seed); the replacement starts in the "
        "background.",
    )
    template_max_age: float = _seconds(
        300.0,
        86_400,
        "Seconds a fork-server template serves before it is replaced, in the "
        "background, as after template_max_runs.",
    )
    wait: float = Field(
        2.0,
        ge=0,
        le=60,
        description="Seconds a run waits for a sandbox that is already starting before it "
        "starts a cold one itself.",
    )

    def sizes_for(self, profile: str) -> PoolSizes:
        return self.profiles.get(profile, self.sizes)


class ScrubSettings(Model):
    """What the host redacts from everything a run returns (`[scrub]` in the config file).

    One switch per category; `secrets` and `secrets_env` name exact values to redact (also
    base64- and URL-encoded), such as the credentials of upstream MCP servers.
    """

    enabled: bool = Field(True, description="Scrub results at all (off: nothing is redacted).")
    email: bool = Field(True, description="Email addresses -> [EMAIL].")
    phone: bool = Field(True, description="Phone numbers (international, US formats) -> [PHONE].")
    ssn: bool = Field(True, description="US social security numbers -> [SSN].")
    credit_card: bool = Field(
        True,
        description="Luhn-valid card numbers, grouped as cards are or next to a card word"
        " -> [CREDIT_CARD].",
    )
    iban: bool = Field(True, description="Checksum-valid IBANs -> [IBAN].")
    ip: bool = Field(
        True,
        description="Public IPv4/IPv6 addresses -> [IP_ADDRESS] (private, loopback, link-local"
        " and documentation ranges are kept).",
    )
    secret: bool = Field(
        True, description="Keys, tokens, private keys, password= assignments -> [SECRET]."
    )
    secrets: list[str] = Field(
        [], description="Exact values to redact as [SECRET] (6+ characters each)."
    )
    secrets_env: list[str] = Field(
        [], description="Names of host environment variables whose values are secrets."
    )
    phone_region: str = Field(
        "US", description="ISO 3166 region whose national phone format is recognised."
    )

    def categories(self) -> list[str]:
        """The categories switched on, in the order of the fields."""
        return [name for name in SCRUB_CATEGORIES if getattr(self, name)]


SCRUB_CATEGORIES: Final = ("email", "phone", "ssn", "credit_card", "iban", "ip", "secret")


"""The categories of `ScrubSettings` (the same as `codecage.policy.scrub.CATEGORIES`)."""


class NetworkLimits(Model):
    """Bounds of one run's egress through the host proxy (`[network.limits]`)."""

    max_connections: int = Field(
        32,
        ge=1,
        le=1024,
        description="Connections one run may have open at once; more are refused at accept. "
        "At most a quarter of [network] max_connections, so one run cannot fill the proxy.",
    )
    max_bytes_out: int = Field(
        64 * 1024 * 1024, ge=0, description="Bytes one run may send out, all connections together."
    )
    max_bytes_in: int = Field(
        256 * 1024 * 1024, ge=0, description="Bytes one run may receive, all connections together."
    )
    requests_per_second: float = _seconds(
        100.0, 100_000, "New connections and HTTP requests a run may make per second."
    )
    connect_timeout: float = _seconds(10.0, 300, "Seconds to connect to a server.")
    header_timeout: float = _seconds(
        10.0, 300, "Seconds a client has to send a whole request head (a slow client is cut off)."
    )
    idle_timeout: float = _seconds(60.0, 3600, "Seconds a connection may pass no byte either way.")
    total_timeout: float = _seconds(600.0, 86_400, "Seconds one connection may last at most.")


class NetworkProfile(Model):
    """Hosts a profile's runs may reach (`[network.profiles.NAME]`)."""

    allow: list[str] = Field([], description="HOST[:PORT] rules added to that profile's runs.")


class NetworkSettings(Model):
    """Egress through the host proxy (`[network]`). Without any allowed host a run has no
    network at all; rules are HOST[:PORT], `*.domain` wildcards, or IP literals (port: 443
    and 80 when omitted)."""

    allow: list[str] = Field([], description="Hosts every run may reach.")
    deny: list[str] = Field(
        [], description="Hosts no run may reach, whatever else allows them (deny wins)."
    )
    ceiling: list[str] = Field(
        [],
        description="What a caller may ask for per call (execute_code's allow_hosts, "
        "Sandbox.run(allow_hosts=)); asking for more is an error. `allow`, the profiles' "
        "hosts and the operator's own grants (--allow-host) are within it anyway.",
    )
    profiles: dict[str, NetworkProfile] = Field(
        {}, description="Hosts added per profile, e.g. a data index for data_science."
    )
    resolve: dict[str, list[str]] = Field(
        {},
        description="A static name -> addresses table the proxy consults before DNS (tests, "
        "hosts without DNS). Addresses are still checked (private ones refused).",
    )
    upstream_ca_file: str | None = Field(
        None,
        description="A CA certificate file the proxy also trusts for servers it talks TLS "
        "to (an internal CA); the system's CAs are always trusted.",
    )
    ca_dir: str | None = Field(
        None,
        description="Where the proxy keeps its CA for credential hosts (default "
        "/var/lib/codecage/egress-ca for root, else $XDG_DATA_HOME/codecage/egress-ca).",
    )
    pip_index_url: str | None = Field(
        None,
        description="The package index `pip` uses inside the sandbox (its host must be "
        "allowed for the run).",
    )
    limits: NetworkLimits = Field(NetworkLimits(), description="Bounds of each run's egress.")
    max_connections: int = Field(
        1024,
        ge=4,
        le=65_536,
        description="Connections the proxy holds open at once, all runs together (also "
        "bounded by the process's file descriptors, two per connection); over it, new ones "
        "are refused at accept with 503. Each run may hold at most a quarter of it.",
    )
    credentials: dict[str, Credential] = Field(
        {},
        description="Credentials the proxy adds at the edge, by HOST[:PORT]: the code sees "
        "a placeholder, never the value (docs/configuration.md).",
    )

    @model_validator(mode="after")
    def _fair_share(self) -> NetworkSettings:
        share = self.max_connections // 4
        if self.limits.max_connections > share:
            raise ValueError(
                f"[network.limits] max_connections = {self.limits.max_connections} is over a "
                f"quarter of [network] max_connections ({self.max_connections}): one run could "
                f"fill the proxy for the others; set it to {share} or less"
            )
        return self

    @model_validator(mode="after")
    def _rules_parse(self) -> NetworkSettings:
        for what, texts in (("allow", self.allow), ("deny", self.deny), ("ceiling", self.ceiling)):
            parse_rules(texts, what=f"[network] {what}")
        for name, profile in self.profiles.items():
            parse_rules(profile.allow, what=f"[network.profiles.{name}] allow")
        for name, addresses in self.resolve.items():
            HostRule.parse(name)
            for address in addresses:
                _ip(address, name)
        return self


def _ip(text: str, name: str) -> None:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        raise ValueError(f"[network.resolve] {name}: {text!r} is not an IP address") from None


class ApprovalSettings(Model):
    """Human approval of a run before it starts (the config file's [approval] table),
    decided by what the run is granted, never by how its code reads."""

    require: ApprovalLevel | None = Field(
        None,
        description="Which runs wait for a person before they start: 'grants' (a run "
        "granted one of `capabilities`), 'always' (every run). None: no approval. The old "
        "'high' and 'medium' (judged by static findings on the code's text, which "
        "obfuscation or a written-then-imported file escape) are read as 'grants'.",
    )
    capabilities: tuple[Capability, ...] = Field(
        DEFAULT_CAPABILITIES,
        description="Under require = 'grants', the capabilities a run waits for a person "
        "for: 'network' (hosts it may reach), 'tools' (a tool it may call that is not "
        "annotated read-only), 'destructive_tools', 'open_world_tools' (by the tools' MCP "
        "annotations), 'workspace' (a host directory lent read-write), 'packages' (the "
        "operator's added packages its profile imports), 'profile' (a profile wider than "
        "the default one), 'limits' (a limit above the default). Empty: no run waits.",
    )
    timeout: float = _seconds(
        300.0, 86_400, "Seconds a person has to answer; no answer in time is a denial."
    )

    @field_validator("require", mode="before")
    @classmethod
    def _legacy(cls, value: object) -> object:
        # The text-based levels judged how code reads, which obfuscation escapes: what a
        # run is granted decides now, so an old config still asks a person (docs/security-model.md).
        return "grants" if value in LEGACY_LEVELS else value


class AuditSettings(Model):
    """The audit trail (the config file's [audit] table; docs/audit.md)."""

    enabled: bool | None = Field(
        None,
        description="Keep a record of every execution. None: on for `codecage serve`, off for "
        "the library and `codecage run` (which turn it on with audit=... / --audit PATH).",
    )
    store: str | None = Field(
        None,
        description="Where: a SQLite file path, or a postgresql://... URL (one store for a "
        "fleet). None: audit.db in codecage's state directory (/var/lib/codecage for root, "
        "else $XDG_STATE_HOME/codecage). CODECAGE_AUDIT overrides it.",
    )
    required: bool = Field(
        False,
        description="When the store cannot be written (a full disk, a locked or read-only "
        "database), refuse new runs instead of running them unrecorded.",
    )
    keep_code: bool = Field(
        True,
        description="Keep the code itself (scrubbed, cut to max_code_bytes) as well as its sha256.",
    )
    max_code_bytes: int = Field(
        64 * 1024, ge=0, le=10 * 1024 * 1024, description="Bytes of code kept per record."
    )
    retention_days: float | None = Field(
        90,
        gt=0,
        description="Records older than this many days are deleted (checked at start and "
        "hourly); None: kept for ever.",
    )
    max_mb: int | None = Field(
        1024,
        ge=1,
        description="The most the records may take (MiB), held at write time: a full store "
        "refuses new records and keeps the ones it has (an alert, /readyz, a log warning); "
        "with required, runs are refused too, else they go on and the refused records are "
        "dropped and counted. None: no bound.",
    )


ALERT_TRIGGERS: Final = (
    "network_denied",
    "import_blocked",
    "degraded_isolation",
    "validation_high",
    "client_blocked",
    "audit_full",
)
"""The triggers of `[alerts] on`, besides `status:<status>` (a run that ended so)."""
_LOOPBACK_NAMES: Final = frozenset({"localhost", "localhost.localdomain"})


class AlertSettings(Model):
    """Alerts to a webhook or a command when chosen things happen (`[alerts]`;
    docs/configuration.md). Neither `webhook_url` nor `command`: no alerts."""

    webhook_url: str | None = Field(
        None,
        description="POST each alert as JSON here: https://, or http:// to a loopback "
        "address only. Only its host is recorded (a path may hold a secret).",
    )
    command: list[str] | None = Field(
        None,
        description="Run this argv (no shell) per alert, the alert as JSON on stdin, e.g. "
        '["/usr/local/bin/page-oncall", "--team", "sec"]. A name without / is looked up '
        "on PATH when alerts start.",
    )
    on: list[str] = Field(
        ["network_denied", "degraded_isolation", "validation_high", "client_blocked", "audit_full"],
        description="What alerts: network_denied (observed by the host) and import_blocked "
        "(the guest's claim) (repeat_count of them from one caller within repeat_window), "
        "degraded_isolation, validation_high (a high-severity validation finding), "
        "client_blocked (a client's call refused), audit_full (the audit store reached its "
        "max_mb), and status:<status> (a run that ended so, e.g. status:memory_limit).",
    )
    max_per_hour: int = Field(
        10,
        ge=1,
        le=3600,
        description="Alerts one trigger may send per hour; past it they are suppressed "
        "(recorded, counted, and the next one sent says how many).",
    )
    timeout: float = _seconds(10.0, 300, "Seconds one webhook call or command may take.")
    repeat_count: int = Field(
        5,
        ge=1,
        le=100_000,
        description="network_denied and import_blocked: events from one caller that make an alert.",
    )
    repeat_window: float = _seconds(
        600.0, 86_400, "network_denied and import_blocked: the seconds repeat_count is counted in."
    )

    @property
    def active(self) -> bool:
        """Whether there is anywhere to send alerts to."""
        return bool(self.webhook_url or self.command)

    @model_validator(mode="after")
    def _checked(self) -> AlertSettings:
        if self.webhook_url is not None:
            webhook_host(self.webhook_url)
        if self.command is not None and (not self.command or not self.command[0]):
            raise ValueError("command must name a program: a non-empty argv list")
        for trigger in self.on:
            _check_trigger(trigger)
        return self


def webhook_host(url: str) -> str:
    """The host of an alert webhook URL (what is recorded of it).

    Raises:
        ValueError: not https://, or http:// to a host other than loopback.
    """
    parts = urllib.parse.urlsplit(url)
    host = parts.hostname or ""
    if parts.scheme not in ("https", "http") or not host:
        raise ValueError(f"webhook_url must be an https:// URL with a host, not {url[:60]!r}")
    if parts.scheme == "http" and not _is_loopback(host):
        raise ValueError(f"webhook_url: http:// is for loopback only ({host} is not); use https://")
    return host


def _is_loopback(host: str) -> bool:
    if host.lower() in _LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _check_trigger(trigger: str) -> None:
    kind, _, status = trigger.partition(":")
    if trigger in ALERT_TRIGGERS or (kind == "status" and status in STATUSES and status != "ok"):
        return
    statuses = ", ".join(f"status:{s}" for s in STATUSES if s != "ok")
    raise ValueError(
        f"on: unknown trigger {trigger!r}; the triggers are {', '.join(ALERT_TRIGGERS)}, {statuses}"
    )
