"""The CLI's options, declared once and shared by the commands that take them (`run`,
`validate`, `serve`, ...): one flag, one help text, one environment variable. Flags that
go together are a group (groups.py), taken whole: limits (`LimitFlags`: run, run-batch),
tools (`ToolFlags`: run, serve), network, audit and output (run, run-batch, serve), the
sandbox's policy (`SandboxFlags`: run, run-batch), the code (`CodeFlags`: run, session run)
and the server a session command talks to (`ServerFlags`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import typer

from codecage.cli.groups import FlagGroup
from codecage.models import Limits


def _default(name: str) -> str:
    field = Limits.model_fields[name]
    # Parentheses, not brackets: rich would read "[default: …]" as markup and drop it.
    return f"{field.description} (default: {field.default})"


def _limit_option(name: str) -> Any:
    """The option of the `Limits` field `name`: one name in four spellings (field
    memory_mb, flag --memory-mb, env CODECAGE_MEMORY_MB), its help and default the field's."""
    flag = "--" + name.replace("_", "-")
    return typer.Option(flag, help=_default(name), envvar=f"CODECAGE_{name.upper()}")


TimeoutOpt = Annotated[float | None, _limit_option("timeout")]
CpuOpt = Annotated[int | None, _limit_option("cpu_seconds")]
MemoryOpt = Annotated[int | None, _limit_option("memory_mb")]
ProcessesOpt = Annotated[int | None, _limit_option("max_processes")]
OpenFilesOpt = Annotated[int | None, _limit_option("max_open_files")]
FileSizeOpt = Annotated[int | None, _limit_option("max_file_size_mb")]
WorkspaceMbOpt = Annotated[int | None, _limit_option("workspace_mb")]
TmpMbOpt = Annotated[int | None, _limit_option("tmp_mb")]
OutputOpt = Annotated[int | None, _limit_option("max_output_bytes")]
JsonOpt = Annotated[
    bool, typer.Option("--json", help="Print exactly one JSON object on stdout, nothing else.")
]
RayOpt = Annotated[
    str | None,
    typer.Option(
        "--ray",
        metavar="ADDRESS",
        help="Run on a Ray cluster, one Sandbox per node ('auto': the cluster of this node; "
        "host:port of its head; needs pip install 'codecage[ray]'): run-batch's programs, "
        "serve's execute_code and POST /run_code runs (sessions stay on this host; a full "
        "cluster is a 503 with Retry-After). A run that was on a node that went away runs "
        "again elsewhere when that is safe, else it gets a node_lost error "
        "(docs/scale-out.md).",
        show_default=False,
    ),
]
DegradedOpt = Annotated[
    bool,
    typer.Option(
        "--allow-degraded",
        help="Run even if the self-test finds an isolation layer missing (the result says which).",
        envvar="CODECAGE_ALLOW_DEGRADED",
    ),
]
BackendOpt = Annotated[
    str,
    typer.Option(
        "--backend",
        help="Isolation backend: auto (bwrap, else gvisor: the config sets the order), bwrap, "
        "gvisor, or landlock (no namespaces: a labelled fallback).",
        envvar="CODECAGE_BACKEND",
    ),
]
ProfileOpt = Annotated[
    str | None,
    typer.Option(
        "--profile",
        help="Capability profile(s) for imports, comma-separated: standard (the whole "
        "standard library and the installed data packages), or the curated basic, "
        "data_science, filesystem, network, or one from the config file. (default: "
        "standard, or CODECAGE_PROFILE, or the config file's policy.profile)",
        show_default=False,
    ),
]
ConfigOpt = Annotated[
    Path | None,
    typer.Option(
        "--config",
        help="TOML config file (default: $CODECAGE_CONFIG, else config.toml in "
        "~/.config/codecage or /etc/codecage; never the current directory), owned by you "
        "or root, not group/world-writable.",
        dir_okay=False,
        show_default=False,
    ),
]
AllowImportOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--allow-import",
        help="Also allow importing this module (repeat, or separate with commas).",
    ),
]
AllowHostOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--allow-host",
        metavar="HOST[:PORT]",
        help="Let the code reach this host through codecage's egress proxy (repeat, or "
        "separate with commas): api.example.com, *.example.com (its subdomains), "
        "api.example.com:8443, 203.0.113.7; port 443 and 80 when omitted. Added to the "
        "config's \\[network] allow; its deny still wins. (default: none: no network)",
        show_default=False,
    ),
]
AuditOpt = Annotated[
    str | None,
    typer.Option(
        "--audit",
        metavar="PATH|URL|off",
        help="Keep a record of the run in the audit trail: a SQLite file, a postgresql:// "
        "URL, 'on' for the config's \\[audit] store (default: audit.db in codecage's state "
        "directory), 'off' for none. (default: the config's \\[audit] enabled, else "
        "CODECAGE_AUDIT; `serve` keeps one unless told off, `run` does not)",
        show_default=False,
    ),
]
VerboseOpt = Annotated[
    bool, typer.Option("--verbose", "-v", help="Log what codecage does, with tracebacks.")
]


def mcp_config_option(help_text: str) -> Any:
    """--mcp-config, a JSON file that must exist; its help the command's (`gen` reads the
    config file's servers without it, `run` and `serve` have none then)."""
    return typer.Option(
        "--mcp-config", help=help_text, dir_okay=False, exists=True, show_default=False
    )


McpConfigOpt = Annotated[
    Path | None,
    mcp_config_option(
        "Upstream MCP servers whose tools the code may call, through codecage, without "
        "network or credentials: a JSON file with mcpServers, as MCP hosts write them."
    ),
]
McpHostOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--mcp-host",
        help="Use the MCP servers already configured for this host, from its user-level "
        "file: claude-code, cursor, vscode or claude-desktop (repeat). A project's own "
        "file (.mcp.json, .cursor/, .vscode/) is never read.",
        show_default=False,
    ),
]
ServersDirOpt = Annotated[
    Path | None,
    typer.Option(
        "--servers-dir",
        help="The tool modules `codecage gen` wrote, mounted read-only at /servers "
        "(default: generated afresh into a temp dir at start).",
        file_okay=False,
        show_default=False,
    ),
]
SkillsDirOpt = Annotated[
    Path | None,
    typer.Option(
        "--skills-dir",
        help="A directory of reusable Python functions, read-only at /skills "
        "(import skills.<module>).",
        file_okay=False,
        show_default=False,
    ),
]
TokenizeOpt = Annotated[
    bool,
    typer.Option(
        "--tokenize",
        help="Replace personal data in tool results with tokens ([EMAIL_1]) that only "
        "tool arguments turn back into the real values (default: per server's config).",
    ),
]
NoScrubOpt = Annotated[
    bool,
    typer.Option(
        "--no-scrub",
        help="Do not redact personal data and secrets from the result (on by default: "
        "emails, phones, SSNs, cards, IBANs, IPs and secrets become [EMAIL], [SECRET], ...).",
    ),
]
ScrubCategoriesOpt = Annotated[
    str | None,
    typer.Option(
        "--scrub-categories",
        help="Redact only these categories, comma-separated: email, phone, ssn, "
        "credit_card, iban, ip, secret (default: the config's \\[scrub] switches, all on).",
        show_default=False,
    ),
]
MaxToolCallsOpt = Annotated[
    int | None,
    typer.Option(
        "--max-tool-calls",
        help="Tool calls one run may make, 1 to 100000 (default: \\[tools] max_calls, 200).",
        show_default=False,
    ),
]
AllowToolOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--allow-tool",
        help="Only these tools may be called: SERVER.TOOL, split at the first dot; a wildcard"
        " (*, ?) matches only plain names (letters, digits, _ - .) (repeat).",
        show_default=False,
    ),
]
# `codecage session ...`: the server the commands talk to (`codecage serve --http`).
ServerOpt = Annotated[
    str | None,
    typer.Option(
        "--server",
        help="The /mcp URL of a running `codecage serve --http` (default: your own local "
        "server, started when needed).",
        envvar="CODECAGE_SERVER",
        show_default=False,
    ),
]
ServerTokenOpt = Annotated[
    str | None,
    typer.Option(
        "--token",
        help="The bearer token the --server was started with (its --token).",
        envvar="CODECAGE_TOKEN",
        show_default=False,
    ),
]
SourceArg = Annotated[
    str | None, typer.Argument(help="'-' to read the code from stdin.", show_default=False)
]
NoImportPolicyOpt = Annotated[
    bool,
    typer.Option(
        "--no-import-policy",
        help="Turn the import policy off; the OS sandbox still holds (it is the boundary).",
    ),
]


@dataclass(frozen=True, slots=True)
class CodeFlags(FlagGroup):
    """The code to run: an argument ('-': stdin), --code or --file (setup.read_code)."""

    source: SourceArg = None
    code: Annotated[str | None, typer.Option("--code", "-c", help="The code to run.")] = None
    file: Annotated[
        Path | None, typer.Option("--file", "-f", help="A Python file to run.", dir_okay=False)
    ] = None


@dataclass(frozen=True, slots=True)
class LimitFlags(FlagGroup):
    """One flag per `Limits` field (a test holds them equal): each run's limits over the
    config file's. A new limit is one line here."""

    timeout: TimeoutOpt = None
    cpu_seconds: CpuOpt = None
    memory_mb: MemoryOpt = None
    max_processes: ProcessesOpt = None
    max_open_files: OpenFilesOpt = None
    max_file_size_mb: FileSizeOpt = None
    workspace_mb: WorkspaceMbOpt = None
    tmp_mb: TmpMbOpt = None
    max_output_bytes: OutputOpt = None

    def overrides(self) -> dict[str, Any]:
        """The limits given, by field name (unset: not there)."""
        given = {name: getattr(self, name) for name in self.__dataclass_fields__}
        return {name: value for name, value in given.items() if value is not None}


@dataclass(frozen=True, slots=True)
class SandboxFlags(FlagGroup):
    """What the sandbox allows and how it isolates: import profile and policy, backend."""

    profile: ProfileOpt = None
    allow_import: AllowImportOpt = None
    no_import_policy: NoImportPolicyOpt = False
    allow_degraded: DegradedOpt = False
    backend: BackendOpt = "auto"


@dataclass(frozen=True, slots=True)
class ToolFlags(FlagGroup):
    """The upstream MCP servers the code may call through codecage, and how."""

    mcp_config: McpConfigOpt = None
    mcp_host: McpHostOpt = None
    servers_dir: ServersDirOpt = None
    skills_dir: SkillsDirOpt = None
    allow_tool: AllowToolOpt = None
    max_tool_calls: MaxToolCallsOpt = None
    tokenize: TokenizeOpt = False


@dataclass(frozen=True, slots=True)
class NetworkFlags(FlagGroup):
    """The hosts the code may reach through codecage's egress proxy."""

    allow_host: AllowHostOpt = None


@dataclass(frozen=True, slots=True)
class AuditFlags(FlagGroup):
    """Where the record of each run is kept."""

    audit: AuditOpt = None


@dataclass(frozen=True, slots=True)
class OutputFlags(FlagGroup):
    """What a result may show: personal data and secrets in it are scrubbed unless told."""

    no_scrub: NoScrubOpt = False
    scrub_categories: ScrubCategoriesOpt = None


@dataclass(frozen=True, slots=True)
class ServerFlags(FlagGroup):
    """The server a `codecage session` command talks to (None: the user's local one), and
    how the command shows what it answers."""

    server: ServerOpt = None
    token: ServerTokenOpt = None
    as_json: JsonOpt = False
    verbose: VerboseOpt = False
