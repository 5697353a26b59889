"""The shapes that cross codecage's boundaries: limits, results, host reports, and the
host<->guest wire format (written by the guest with the stdlib, validated here).

Defaults live here and only here; the CLI, `info` and the docs read them from these models.
"""

from __future__ import annotations

from typing import Annotated, Any, Final, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ModelWrapValidatorHandler,
    PrivateAttr,
    field_validator,
    model_validator,
)

from codecage.errors import Face
from codecage.output import neutralise_line

Status = Literal["ok", "error", "timeout", "cpu_limit", "memory_limit", "killed", "blocked"]
"""How a run ended, judged by the host from what it observed (never from the guest's word)."""

EventKind = Literal[
    "import_blocked",
    "syscall_blocked",
    "network_denied",
    "output_truncated",
    "files_truncated",
    "workspace_full",
    "return_value_truncated",
    "guest_report_invalid",
    "degraded_isolation",
    "validation_finding",
    "cancelled",
    "tool_call",
    "bridge_closed",
    "reply_trimmed",
]
"""Things worth knowing that happened during a run (see docs/security-model.md)."""

STATUSES: tuple[Status, ...] = Status.__args__  # type: ignore[attr-defined]
EVENT_KINDS: tuple[EventKind, ...] = EventKind.__args__  # type: ignore[attr-defined]

WIRE_VERSION: Final = 1
"""Version of the JSON-lines protocol between host and guest bootstrap."""

MAX_CODE_BYTES = 10 * 1024 * 1024
"""Largest submission accepted: agent code is small; this only stops absurd input early."""


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Limits(_Model):
    """Resource limits of one run. Every field has a default; any can be overridden per call."""

    timeout: float = Field(
        30.0,
        gt=0,
        le=3600,
        description="Wall-clock limit in seconds; the whole sandbox is killed when it passes.",
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


class ServeSettings(_Model):
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


class ErrorInfo(_Model):
    """An exception raised by the user's code."""

    type: str = Field(description="Exception class name, e.g. 'ZeroDivisionError'.")
    message: str = Field(description="str() of the exception.")
    traceback: str = Field(description="Traceback limited to frames of the user's code.")


class FileInfo(_Model):
    """A regular file the code left in the workspace.

    The code chooses the name, so `path` is neutralised to one line when the model is made
    (`output.neutralise_line`: ESC, C1, bidi controls, newline and tab become visible
    escapes; an undecodable byte shows as ``\\x80``). The name as it is on disk is kept
    aside, out of the JSON, for reading the file back (`raw_path`).
    """

    path: str = Field(
        description="Path relative to /workspace, '/'-separated; control, bidi and newline "
        "characters in it are shown as backslash escapes."
    )
    size: int = Field(ge=0, description="Size in bytes.")
    sha256: str | None = Field(
        description="SHA-256 of the content; None when the file was over the read bound."
    )
    mime: str = Field(description="MIME type guessed from the name and first bytes.")

    # The path as on disk when it differs from `path` (None: the same); not part of the JSON.
    _raw_path: str | None = PrivateAttr(default=None)

    @model_validator(mode="wrap")
    @classmethod
    def _neutralise_path(cls, data: Any, handler: ModelWrapValidatorHandler[FileInfo]) -> FileInfo:
        raw = data.get("path") if isinstance(data, dict) else None
        if not isinstance(raw, str):
            return handler(data)  # an instance already made, or a type error to report
        info = handler({**data, "path": neutralise_line(raw)})
        if info.path != raw:
            info._raw_path = raw
        return info

    def raw_path(self) -> str:
        """The path as it is on disk, for `workspace.read_file`: `path` itself unless
        neutralising changed it. A FileInfo read back from JSON only has `path`."""
        return self.path if self._raw_path is None else self._raw_path


class Usage(_Model):
    """What the run consumed, as measured by the host."""

    wall_ms: int = Field(ge=0, description="Wall-clock time in milliseconds.")
    cpu_ms: int | None = Field(description="CPU time in ms of every process; None if unknown.")
    peak_memory_mb: float | None = Field(
        description="Peak memory in MiB from the cgroup; None where no cgroup was used."
    )
    waited_ms: int = Field(
        0,
        ge=0,
        description="Milliseconds the call waited for a warm sandbox (one the pool was still "
        "starting) before the run began; not part of wall_ms. 0 when it did not wait.",
    )


MAX_EVENT_DETAIL: Final = 2000
"""Characters of an event's detail, and of each string in its data, after neutralising."""

_MAX_EVENT_DATA_DEPTH: Final = 8
_TOO_DEEP: Final = "(nested too deep)"


class Event(_Model):
    """Something worth knowing that happened during the run.

    Details and data hold text the code chose (module, server and tool names, file names),
    so they are neutralised where the event is made, whoever makes it: the detail and every
    string in `data` (keys and values, at any depth up to 8) go through
    `output.neutralise_line` and are cut to `MAX_EVENT_DETAIL` characters. What prints or
    returns an event (the CLI, the MCP summary, a JSON consumer) cannot meet a raw escape
    sequence or a line break in it. Idempotent: validating a dumped event again changes
    nothing. (`model_copy(update=...)` does not validate: pass only neutralised text to it.)
    """

    kind: EventKind
    detail: str = Field(
        max_length=MAX_EVENT_DETAIL,
        description="One line; control, bidi and newline characters shown as backslash escapes.",
    )
    data: dict[str, Any] | None = Field(
        default=None,
        description="Machine-readable facts of the event (a tool_call's server, tool, "
        "duration_ms, status, request_bytes, result_bytes), strings neutralised like the "
        "detail; None for most kinds.",
    )

    @field_validator("detail", mode="before")
    @classmethod
    def _one_line_detail(cls, value: Any) -> Any:
        if isinstance(value, str):
            return neutralise_line(value)[:MAX_EVENT_DETAIL]
        return value

    @field_validator("data", mode="before")
    @classmethod
    def _neutralised_data(cls, value: Any) -> Any:
        if isinstance(value, dict):
            return _neutralised_tree(value, 0)
        return value


def _neutralised_tree(value: Any, depth: int) -> Any:
    """`value` with every string in it, dict keys included, one-line neutralised and cut."""
    if isinstance(value, str):
        return neutralise_line(value)[:MAX_EVENT_DETAIL]
    if isinstance(value, dict | list | tuple) and depth >= _MAX_EVENT_DATA_DEPTH:
        return _TOO_DEEP
    if isinstance(value, dict):
        return {
            _neutralised_tree(k, depth + 1): _neutralised_tree(v, depth + 1)
            for k, v in value.items()
        }
    if isinstance(value, list | tuple):
        return [_neutralised_tree(v, depth + 1) for v in value]
    return value


def _any_json_value(schema: dict[str, Any]) -> None:
    """Any JSON value, spelled as one single-type branch per JSON type: a schema without a type
    validates anything but tells a client nothing (the MCP Inspector warns on it), and a type
    array is less portable than anyOf. Integers are numbers."""
    schema["anyOf"] = [
        {"type": "object", "additionalProperties": True},
        {"type": "array"},
        {"type": "string"},
        {"type": "number"},
        {"type": "boolean"},
        {"type": "null"},
    ]


class ExecutionResult(_Model):
    """The structured result of one run (the contract of `codecage run --json`)."""

    execution_id: str = Field(description="Unique id of this run; log lines about it carry it.")
    status: Status = Field(
        description="How the run ended, judged by the host: ok, error (an exception or a "
        "non-zero exit), timeout, cpu_limit, memory_limit, killed, blocked."
    )
    exit_code: int | None = Field(description="Exit code of the program, None if it was signalled.")
    signal: str | None = Field(description="Name of the signal that ended it, e.g. 'SIGKILL'.")
    stdout: str = Field(description="What the code printed (control characters neutralised).")
    stderr: str = Field(description="What the code wrote to stderr (the traceback is in error).")
    stdout_truncated: bool = Field(description="True when stdout passed max_output_bytes.")
    stderr_truncated: bool = Field(description="True when stderr passed max_output_bytes.")
    return_value: Any = Field(
        description="The value of the code's last expression, if it is one: as JSON when it is "
        "JSON-able (any JSON value, at most 1 MiB encoded), else its repr() as a string "
        "(bounded; a return_value_truncated event says so); null when there is none.",
        json_schema_extra=_any_json_value,
    )
    error: ErrorInfo | None = Field(
        description="The exception the code raised, with a traceback of its own frames; "
        "null when it raised none."
    )
    files: list[FileInfo] = Field(
        description="Regular files in /workspace after the run (uploads included)."
    )
    usage: Usage = Field(description="Time and memory the run used, measured by the host.")
    limits: Limits = Field(description="The limits the run had.")
    events: list[Event] = Field(
        description="What else happened: blocked imports or syscalls, truncation, tool calls."
    )
    backend: str = Field(description="The isolation backend that ran the code.")
    redactions: dict[str, int] = Field(
        default_factory=dict,
        description="How many values the host replaced by a placeholder ([EMAIL], [SECRET], "
        "...) in this result, by category (email, phone, ssn, credit_card, iban, ip, secret); "
        "empty when nothing was found or scrubbing is off.",
    )

    # The bytes as printed, before neutralising; not part of the JSON contract (`--raw`).
    _raw_stdout: bytes = PrivateAttr(default=b"")
    _raw_stderr: bytes = PrivateAttr(default=b"")

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def raw_stdout(self) -> bytes:
        """stdout exactly as the program wrote it (up to the cap): may hold escape codes."""
        return self._raw_stdout

    def raw_stderr(self) -> bytes:
        """stderr exactly as the program wrote it (up to the cap): may hold escape codes."""
        return self._raw_stderr

    def with_raw_output(self, stdout: bytes, stderr: bytes) -> ExecutionResult:
        self._raw_stdout, self._raw_stderr = stdout, stderr
        return self


# --- what the host reports about itself -------------------------------------------------


class LayerStatus(_Model):
    """One isolation layer and whether it is really in force on this host."""

    name: str = Field(description="Layer, e.g. 'namespaces', 'seccomp', 'memory'.")
    active: bool = Field(description="True when probed and in force.")
    mechanism: str = Field(description="How it is provided, e.g. 'cgroup v1', 'RLIMIT_AS'.")
    detail: str = Field("", description="What was probed, or why it is missing.")


class Ceilings(_Model):
    """The largest limits this host accepts per call."""

    memory_mb: int
    max_processes: int
    timeout: float


class ProfileInfo(_Model):
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


class PoolSizes(_Model):
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


class PoolConfig(_Model):
    """The warm pool's settings (`[pool]` in the config file)."""

    enabled: bool = Field(False, description="Run requests in pre-started sandboxes.")
    sizes: PoolSizes = Field(PoolSizes(), description="Sizes of every key by default.")
    profiles: dict[str, PoolSizes] = Field(
        {}, description="Sizes by profile name, e.g. fewer of the heavy data_science."
    )
    max_starting: int = Field(4, ge=1, le=64, description="Sandboxes starting at once.")
    ready_timeout: float = Field(
        60.0, gt=0, le=600, description="Seconds a sandbox may take to start and preload."
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


class ScrubSettings(_Model):
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
"""The categories of `ScrubSettings` (the same as `codecage.scrub.CATEGORIES`)."""


class ScrubState(_Model):
    """What `info` says of scrubbing: what is redacted, never the configured values."""

    enabled: bool
    categories: list[str] = Field(description="Categories redacted; empty when disabled.")
    secrets: int = Field(description="How many exact secret values are redacted.")
    phone_region: str
    source: str = Field(description="Where the setting came from (default, file, env, argument).")


class ToolsState(_Model):
    """What `info` says of the upstream MCP tools the code may call, and their bounds."""

    servers: list[str] = Field(
        description="Upstream servers this sandbox's code can call; empty: tool calls fail."
    )
    configured_servers: list[str] = Field(
        description="Servers in the config file's [mcpServers] (`run` and `serve` start them)."
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


class PoolKeyState(_Model):
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


class PoolState(_Model):
    """What `info` says of the warm pool."""

    enabled: bool
    config: PoolConfig
    keys: list[PoolKeyState] = Field(description="Live keys; empty when no pool runs here.")
    host_rss_mb: float | None = Field(description="Resident memory of this (host) process.")


class AddedPackage(_Model):
    """A distribution the operator added with `codecage packages add` (or pulled in by one)."""

    name: str
    version: str
    requested: bool = Field(True, description="Named by the operator, not only a dependency.")


class HostInfo(_Model):
    """What `codecage info` reports: backend, mechanisms in force, defaults and ceilings."""

    version: str
    backend: str
    backends: dict[str, bool] = Field(description="Every backend codecage knows: available here?")
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


class ProbeResult(_Model):
    """One check of `codecage doctor`, proven by running code in a real sandbox."""

    layer: str
    passed: bool
    detail: str


class DoctorReport(_Model):
    """All checks of `codecage doctor`."""

    backend: str
    passed: bool
    probes: list[ProbeResult]

    def failed_layers(self) -> list[str]:
        return [p.layer for p in self.probes if not p.passed]


# --- host <-> guest wire format (JSON lines over the control socket) --------------------


class GuestLimits(_Model):
    """Per-run rlimits the guest bootstrap applies before the user's code starts."""

    cpu_seconds: int
    max_open_files: int
    max_file_size_bytes: int
    max_processes: int | None = Field(
        description="RLIMIT_NPROC, only when no pids cgroup enforces the process limit."
    )
    address_space_bytes: int | None = Field(
        description="RLIMIT_AS, only when no memory cgroup enforces the memory limit."
    )


class GuestRequest(_Model):
    """host -> guest: the code to run."""

    v: Literal[1] = WIRE_VERSION
    kind: Literal["run"] = "run"
    code: str
    filename: str
    limits: GuestLimits
    return_value_max_bytes: int
    profile: str = Field("", description="Profile name(s), for messages.")
    allowed_modules: list[str] | None = Field(
        None, description="Modules the user's code may import; None = no import policy."
    )
    face: Face = Field("library", description="Who asked: an import refusal's hint says how "
                       "to allow the module in this face's terms.")  # fmt: skip
    installed_packages: list[str] = Field(
        default_factory=list,
        description="Third-party packages the host has: a refusal suggests allowing only "
        "these (or the standard library's), never a module that would then be missing.",
    )
    wider_profile: str | None = Field(
        None, description="A profile the caller may choose that allows every module."
    )


class GuestReady(_Model):
    """guest -> host: the interpreter is up and waits for its request."""

    v: Literal[1]
    kind: Literal["ready"]
    pid: int


GuestEventKind = Literal[
    "syscall_blocked", "network_denied", "return_value_truncated", "import_blocked"
]


class GuestEvent(_Model):
    kind: GuestEventKind
    detail: Annotated[str, Field(max_length=500)]


class GuestResult(_Model):
    """guest -> host: how the code ended, as the guest saw it. Untrusted: bounded, validated."""

    v: Literal[1]
    kind: Literal["result"]
    pid: int = Field(description="pid (inside the sandbox) of the process that reported.")
    exit_code: int = Field(0, ge=0, le=255, description="The code the guest then exits with.")
    return_value: Any = None
    error: ErrorInfo | None = None
    events: Annotated[list[GuestEvent], Field(max_length=50)] = []


class GuestEnd(_Model):
    """guest -> host: the main process's last message; the run is over. Untrusted."""

    v: Literal[1]
    kind: Literal["end"]
    pid: int
    exit_code: int = Field(ge=0, le=255)


# --- static validation (codecage validate) ---------------------------------------------

Severity = Literal["low", "medium", "high"]
"""How much a finding matters; only "high" refuses a run in strict mode."""

FindingKind = Literal["syntax", "policy", "security", "limit"]
"""syntax/policy/limit findings make the code invalid; security findings inform."""


class Finding(_Model):
    """One thing validation found, at one place in the code."""

    rule_id: str = Field(description="Rule id: 'CC###' for codecage's rules, 'B###' for bandit's.")
    kind: FindingKind = Field(
        description="syntax, policy and limit findings make the code invalid; security informs."
    )
    severity: Severity = Field(description="low, medium or high.")
    line: int = Field(ge=0, description="1-based line; 0 when it concerns the whole source.")
    col: int = Field(ge=0, description="1-based column; 0 when unknown or the whole source.")
    message: str = Field(description="What was found and, where it helps, what to do.")
    source: Literal["codecage", "bandit"] = Field(description="Which analyser reported it.")


class Analysis(_Model):
    """Measurements of the code. Counts are 0 when the code could not be parsed."""

    lines: int = Field(ge=0, description="Number of lines.")
    characters: int = Field(ge=0, description="Number of characters (not bytes).")
    functions: int = Field(ge=0, description="Functions, async functions and lambdas.")
    classes: int = Field(ge=0, description="Class definitions.")
    loops: int = Field(ge=0, description="for, async for, while and comprehension loops.")
    max_nesting_depth: int = Field(
        ge=0, description="Deepest nesting of block statements (if/for/while/with/try/def/...)."
    )
    complexity: int = Field(
        ge=0,
        description="Estimated cyclomatic complexity of the whole module: 1 + decision points "
        "(see the module docstring); 0 when not parsed.",
    )
    imports: list[str] = Field(
        description="Top-level names of the modules imported (relative imports left out), sorted."
    )
    recommendations: list[str] = Field(description="Short suggestions, most useful first.")
    nodes_analysed: int = Field(ge=0, description="AST nodes walked by codecage's rules.")
    bandit_ran: bool = Field(description="Whether bandit's checks ran on this code.")
    skipped: list[str] = Field(
        description="Checks that did not run and why; empty when every check ran."
    )


class ValidationReport(_Model):
    """The verdict of static validation (the contract of `codecage validate --json`)."""

    valid: bool = Field(
        description="True when the code parses and would run under the profile without a policy "
        "refusal (and, in strict mode, has no high-severity finding)."
    )
    message: str = Field(description="One line summing up the verdict.")
    profile: str = Field(description="Profile name the imports were checked against.")
    strict: bool = Field(description="Whether high-severity findings make the code invalid.")
    findings: list[Finding] = Field(
        description="What was found, in source order: the first 200 (the verdict counts all)."
    )
    omitted_findings: int = Field(
        0,
        ge=0,
        description="Findings past the first 200, not listed (10 MiB of code can hold "
        "hundreds of thousands, and a report must stay readable).",
    )
    analysis: Analysis = Field(description="Measurements of the code: size, functions, imports.")
