"""Options: what a face asks of its host, resolved once with the origin of every value.

Two steps, as uvicorn's `Config` keeps settings apart from the server:

- `Options` is what the caller wrote: every keyword a `Sandbox`, the CLI or the MCP server
  takes, none of it resolved (a `Sandbox` takes the everyday ones as its own keywords and
  the rest as `Sandbox(options=Options(...))`);
- `Options.resolve()` loads the settings (the config file, then CODECAGE_* variables:
  `codecage.config`) once, puts the arguments over them, checks what can be checked before
  anything starts, and returns `Resolved`: immutable, and knowing where each value came
  from (`Resolved.origin`: "argument", "env CODECAGE_...", "file PATH" or "default").

`codecage.host.build(resolved)` then makes the one complete `Host` of a face from it.
Precedence, highest first: argument > CODECAGE_* variable > config file > built-in default.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from codecage import config
from codecage import kept as kept_files
from codecage.config import Settings
from codecage.errors import ConfigError, Face
from codecage.models import AlertSettings, AuditSettings, Limits, ScrubSettings
from codecage.policy import approval as approvals
from codecage.policy import profiles
from codecage.policy.profiles import ImportPolicy

if TYPE_CHECKING:
    from codecage.bridge.broker import Broker
    from codecage.bridge.channel import BridgeLimits
    from codecage.engine.pool import Pool


@dataclass(frozen=True, slots=True, kw_only=True)
class Options:
    """Everything a face's host is made from, as the caller gave it (nothing resolved).

    >>> from codecage import Options, Sandbox
    >>> sandbox = Sandbox(profile="basic", options=Options(fork_server=False, audit=True))

    The everyday ones (limits, backend, profile, allowed_imports, config, pool, tools,
    allowed_tools, data_dir, allow_hosts, approve) as `codecage.Sandbox` documents them;
    `Sandbox`'s keywords take precedence over these fields.

    Args:
        limits: default limits of runs: a full `Limits`, or a dict of fields overriding
            the configuration's.
        backend: "auto" (the strongest available) or a backend name.
        allow_degraded: run even when the self-test finds a promised layer missing; each
            result then carries a `degraded_isolation` event naming the missing layer.
        selftest: run the self-test before the first run (cached per boot); turning it off
            is for codecage's own tests of the self-test, not for production.
        profile: capability profile(s) for imports (None: the config's, else "standard").
        allowed_imports: modules added to the profile's set.
        replace_imports: `allowed_imports` replaces the profile's set instead of extending it.
        import_policy: False turns the import policy off (the OS layers still hold); the
            installed data packages are importable as under "standard".
        config: a TOML config file (None: the first found), or `Settings` already loaded.
        pool: True: a warm pool of this host's own; a `Pool`: share that one; False: cold
            starts only; None: as the config says.
        fork_server: fork each sandbox from a warm template of its profile instead of
            starting bwrap and an interpreter anew (same isolation per run: namespaces,
            workspace, cgroup, filter; docs/security-model.md#the-fork-server). None
            (default): as the config says (`[pool] fork_server`, on; CODECAGE_FORK_SERVER).
            Where it cannot be used (not bwrap, not root) sandboxes start anew; `info()`
            says which. Its templates live until the Sandbox is closed.
        tools: a `Broker` of upstream MCP servers for the code's tool calls.
        allowed_tools: "server.tool" patterns the code may call (None: all).
        tool_limits: bounds of each run's tool calls (count, in flight, result size);
            by default 200 calls, 16 at once, 4 MiB per result.
        servers_dir: the tree `codecage gen` wrote, mounted read-only at /servers and
            importable as `servers.<server>.<tool>`.
        skills_dir: a directory of reusable functions, read-only at /skills, importable as
            `skills.<module>`.
        packages_dir: the packages the operator added (`codecage packages add`), bound
            read-only at /opt/packages for profiles that allow them; default: the
            CODECAGE_PACKAGES_DIR variable, the config's `[packages] dir`, else
            /var/lib/codecage/packages (root) or $XDG_DATA_HOME/codecage/packages.
        tokenize: replace personal data (emails, phones, ...) in tool results with tokens
            such as [EMAIL_1] before the code sees them, and put the real values back when
            the code passes the tokens to another tool; the values stay in the host, per
            run. None: as each server's `tokenize` setting says (default off).
        scrub: redact personal data and secrets from everything a run returns (stdout,
            stderr, error, return value, events, file names) in the host, counting them in
            `redactions`. None (default): as the config's [scrub] table says (on unless
            turned off); True/False: on (with the config's categories) or off; a
            `ScrubSettings`: exactly that. The upstream servers' credentials (`tools`) are
            always among the secrets redacted.
        face: who makes the calls, for the wording of hints in results (an import
            refusal says how to allow the module): "library" (default: keyword
            arguments), "cli" (flags) or "mcp" (the execute_code tool's arguments).
        keep_files_mb: MiB of the files a run leaves that its result keeps for
            `result.read_file` / `result.save_files` (all files together; default 64; 0
            keeps none). A file past it is listed in `files` but not kept.
        data_dir: a host directory read-only at /data in every sandbox.
        allow_hosts: HOST[:PORT] rules every run may reach.
        audit: keep a record of every run in the audit trail (docs/audit.md). None
            (default): as the config's `[audit] enabled` says, else on for face "mcp"
            (`codecage serve`) and off otherwise; True: on, in the config's `[audit] store`
            (default: audit.db in codecage's state directory); a path or a
            postgresql:// URL: on, there; False (or "off"): off. Raises AuditError when
            the store cannot be opened.
        approve: how a person approves a run when [approval] requires it.
        alerts: tell a webhook or a command when chosen things happen in runs
            (docs/configuration.md, `[alerts]`): False (default): no alerts; True: as the
            config's `[alerts]` says; an `AlertSettings`: those. Alerts are recorded in the
            audit trail when there is one. Raises ConfigError when there is no hook to send
            to, or the command is not an executable program.
    """

    limits: Limits | Mapping[str, Any] | None = None
    backend: str = "auto"
    allow_degraded: bool = False
    selftest: bool = True
    profile: str | None = None
    allowed_imports: Iterable[str] = ()
    replace_imports: bool = False
    import_policy: bool = True
    config: str | Path | Settings | None = None
    pool: bool | Pool | None = None
    fork_server: bool | None = None
    tools: Broker | None = None
    allowed_tools: Iterable[str] | None = None
    tool_limits: BridgeLimits | None = None
    servers_dir: str | Path | None = None
    skills_dir: str | Path | None = None
    packages_dir: str | Path | None = None
    tokenize: bool | None = None
    scrub: bool | ScrubSettings | None = None
    face: Face = "library"
    keep_files_mb: int = kept_files.DEFAULT_KEEP_FILES_MB
    data_dir: str | Path | None = None
    allow_hosts: Iterable[str] = ()
    audit: bool | str | Path | None = None
    approve: approvals.Callback | None = None
    alerts: bool | AlertSettings = False

    def given(self) -> frozenset[str]:
        """The fields the caller set (a value other than the default)."""
        return frozenset(
            f.name for f in dataclasses.fields(self) if not _same(getattr(self, f.name), f.default)
        )

    def resolve(self, settings: Settings | None = None) -> Resolved:
        """Load the settings once (unless given, or `config` is `Settings`) and put these
        options over them.

        Raises:
            ConfigError: the config file or a CODECAGE_* variable is invalid, or an option
                is out of its bounds (limits, keep_files_mb, a tool pattern, a profile).
        """
        if settings is None:
            settings = (
                self.config
                if isinstance(self.config, Settings)
                else config.load(Path(self.config) if self.config is not None else None)
            )
        return _resolve(self, settings)


@dataclass(frozen=True, slots=True)
class Resolved:
    """Options resolved once over the settings: what the host factory builds from, and
    what each face reads its defaults from. Immutable; `origin(name)` says where a value
    came from."""

    options: Options
    settings: Settings
    limits: Limits
    policy: ImportPolicy | None  # the face's default import policy; None: none
    allowed_tools: tuple[str, ...] | None
    keep_files_mb: int
    scrub: ScrubSettings
    audit: AuditSettings | None  # None: no audit trail
    alerts: AlertSettings | None  # None: no alerts
    approver: approvals.Approver | None
    origins: Mapping[str, str] = field(default_factory=dict)

    @property
    def face(self) -> Face:
        return self.options.face

    def origin(self, name: str) -> str:
        """Where `name` (an `Options` field, or a `Limits` field) came from: "argument",
        "env CODECAGE_...", "file PATH" or "default".

        Raises:
            KeyError: no option or limit has that name.
        """
        return self.origins[name]

    @property
    def limit_sources(self) -> dict[str, str]:
        """The origins `codecage info` shows: the limits', the profile's and the settings'."""
        shown = dict(self.settings.sources)
        shown.update({name: self.origins[name] for name in Limits.model_fields})
        if "profile" in self.options.given():
            shown["profile"] = "argument"
        return shown


def _resolve(options: Options, settings: Settings) -> Resolved:
    limits = (
        settings.limits if options.limits is None else limits_over(settings.limits, options.limits)
    )
    allowed_tools = tuple(options.allowed_tools) if options.allowed_tools is not None else None
    # A profile that is unknown or not enabled fails here, before a host starts a pool.
    policy = (
        resolve_policy(
            settings, options.profile, tuple(options.allowed_imports), options.replace_imports
        )
        if options.import_policy
        else None
    )
    return Resolved(
        options=options,
        settings=settings,
        limits=limits,
        policy=policy,
        allowed_tools=allowed_tools,
        keep_files_mb=check_keep_files_mb(options.keep_files_mb),
        scrub=_scrub(settings, options.scrub),
        audit=_audit(settings, options.audit, options.face),
        alerts=_alerts(options.alerts, settings),
        approver=_approver(settings, options.approve, options.face),
        origins=_origins(options, settings, options.given()),
    )


def _origins(options: Options, settings: Settings, given: frozenset[str]) -> dict[str, str]:
    """Where each option and each limit came from."""
    from_settings = {
        "profile": "profile",
        "allowed_imports": "allowed_imports",
        "pool": "pool",
        "fork_server": "pool",
        "scrub": "scrub",
        "audit": "audit",
    }
    origins: dict[str, str] = {}
    for f in dataclasses.fields(options):
        if f.name in given:
            origins[f.name] = "argument"
        else:
            origins[f.name] = settings.sources.get(from_settings.get(f.name, ""), "default")
    limits = options.limits
    for name in Limits.model_fields:
        if isinstance(limits, Limits) or (
            isinstance(limits, Mapping) and limits.get(name) is not None
        ):
            origins[name] = "argument"  # a whole `Limits` is the argument's, every field
        else:
            origins[name] = settings.sources.get(name, "default")
    return origins


def _same(value: object, default: object) -> bool:
    if default is dataclasses.MISSING:
        return False
    if isinstance(default, tuple) and isinstance(value, list | tuple):
        return tuple(value) == default
    return value is default or (type(value) is type(default) and value == default)


def limits_over(defaults: Limits, limits: Limits | Mapping[str, Any] | None) -> Limits:
    """`limits` whole, or `defaults` with the mapping's non-None fields applied.

    Raises:
        ConfigError: an override is unknown or out of its bounds, or `limits` is neither.
    """
    if isinstance(limits, Limits):
        return limits
    if limits is not None and not isinstance(limits, dict):
        raise ConfigError(
            f"limits must be a Limits or a dict of its fields, not {type(limits).__name__}",
            hint="e.g. limits={'timeout': 5, 'memory_mb': 512}",
        )
    overrides = {name: value for name, value in (limits or {}).items() if value is not None}
    if not overrides:
        return defaults
    try:
        return defaults.merged(overrides)
    except ValidationError as exc:
        raise ConfigError(describe_validation(exc), hint=limits_hint(exc)) from exc


def check_keep_files_mb(value: int) -> int:
    """Refuse a `keep_files_mb` that is not a whole number of MiB from 0 to 4096.

    Raises:
        ConfigError: it is not.
    """
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 4096:
        raise ConfigError(
            f"keep_files_mb={value!r} is not a whole number from 0 to 4096",
            hint="pass {keep_files_mb=64} (MiB of a run's files its result keeps; 0: none)",
        )
    return value


def limits_hint(exc: ValidationError) -> str:
    """Name the first bad limit the way the reader's face spells it (errors.render_hint)."""
    fields = [str(err["loc"][0]) for err in exc.errors() if err["loc"]]
    named = next((f for f in fields if f in Limits.model_fields), None)
    if named is None:
        return "{info} lists the limits, their defaults and bounds"
    return f"pass {{{named}}} within its bounds; {{info}} lists the defaults and bounds"


def describe_validation(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors():
        where = ".".join(str(p) for p in err["loc"])
        parts.append(f"{where}={err.get('input')!r}: {err['msg']}")
    return "invalid limits: " + "; ".join(parts)


def resolve_policy(
    settings: Settings,
    profile: str | None,
    allowed_imports: Iterable[str] = (),
    replace: bool = False,
) -> ImportPolicy:
    """The import policy of `profile` (None: the settings' default) with the settings' and
    the caller's `allowed_imports` added (or, with `replace`, instead).

    Raises:
        ConfigError: a profile is unknown, or not among the operator's enabled ones.
    """
    names = [p.strip() for p in (profile or settings.profile).split(",") if p.strip()]
    enabled = settings.enabled_profiles
    refused = [n for n in names if enabled is not None and n not in enabled]
    if refused:
        raise ConfigError(
            f"profile {', '.join(map(repr, refused))} is not enabled on this host",
            hint=f"pass one of the enabled profiles as {{profile}}: "
            f"{', '.join(enabled or ())} (the operator's config enables them)",
        )
    return profiles.resolve(
        names,
        allowed_imports=[*settings.allowed_imports, *allowed_imports],
        replace=replace,
        custom=settings.custom_profiles,
    )


def _scrub(settings: Settings, scrub: bool | ScrubSettings | None) -> ScrubSettings:
    """The scrub settings in force."""
    if isinstance(scrub, ScrubSettings):
        return scrub
    if scrub is None:
        return settings.scrub
    return settings.scrub.model_copy(update={"enabled": scrub})


def _audit(settings: Settings, audit: bool | str | Path | None, face: Face) -> AuditSettings | None:
    """The audit trail's settings that `audit` asks for (see `Sandbox`); None when off."""
    if isinstance(audit, str) and audit.lower() in ("on", "off"):  # as the CLI spells it
        audit = audit.lower() == "on"
    wanted = settings.audit.enabled if audit is None else audit is not False
    if wanted is None:
        wanted = face == "mcp"
    if not wanted:
        return None
    if isinstance(audit, str | Path):
        return settings.audit.model_copy(update={"store": str(audit)})
    return settings.audit


def _alerts(asked: bool | AlertSettings, settings: Settings) -> AlertSettings | None:
    """The alert settings asked for: False: none; True: the config's `[alerts]`;
    `AlertSettings`: those. (The host factory checks their command when it makes the
    alerter, before anything starts.)

    Raises:
        ConfigError: alerts are asked for with no webhook_url or command to send to.
    """
    if asked is False:
        return None
    chosen = settings.alerts if asked is True else asked
    if not chosen.active:
        raise ConfigError(
            "alerts were asked for, but no webhook_url or command is set",
            hint="set webhook_url or command in the config's [alerts] table, or pass "
            "alerts=AlertSettings(webhook_url=...)",
        )
    return chosen


def _approver(
    settings: Settings, approve: approvals.Callback | None, face: Face
) -> approvals.Approver | None:
    """The library's approver from `approve`; refused when the config requires approval and
    a library caller gave no callback (the CLI and the MCP server ask in their own way).

    Raises:
        ConfigError: approval is required and there is no callback.
    """
    if approve is not None:
        return approvals.from_callback(approve)
    if settings.approval.require is not None and face == "library":
        raise ConfigError(
            f"the config's [approval] require = '{settings.approval.require}': a run granted "
            "what it lists waits for a person, and no one can be asked",
            hint="pass Sandbox(approve=callback), a function that shows an ApprovalRequest "
            "to a person and returns True to run the code",
        )
    return None
