"""The `codecage` command line: parse, build the model, call the library, render.

Exit codes: 0 the code ran and succeeded; 1 it ran and did not succeed, or a check failed,
or the host could not run it; 2 a usage error or a refused request (ConfigError).
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import inspect
import json
import logging
import os
import signal
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, NoReturn

import typer
from rich.console import Console
from rich.markup import escape

from codecage import __version__, config
from codecage import packages as added
from codecage.errors import CodecageError, ConfigError
from codecage.models import (
    DoctorReport,
    ExecutionResult,
    HostInfo,
    Limits,
    PoolState,
    ScrubSettings,
    ScrubState,
    ToolsState,
    ValidationReport,
)
from codecage.output import neutralise_line, neutralise_text
from codecage.policy import profiles
from codecage.policy import validate as validation
from codecage.sandbox import Sandbox

try:  # typer 0.2x carries its own copy of click; older ones use click itself
    from typer._click.exceptions import ClickException
except ImportError:  # pragma: no cover
    from click.exceptions import ClickException  # type: ignore[assignment]

if TYPE_CHECKING:
    from codecage.bridge.hosts import HostServers
    from codecage.bridge.tooling import ToolSetup
    from codecage.bridge.upstreams import Upstream

_HELP_NAMES = ["-h", "--help"]
app = typer.Typer(
    help="Run code written by AI agents with real OS isolation, and get a structured result.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",
    # Inherited by every command's context: `codecage run -h` as well as --help.
    context_settings={"help_option_names": _HELP_NAMES},
)
stderr = Console(stderr=True, highlight=False, soft_wrap=True)
log = logging.getLogger("codecage.cli")  # the same name under `python -m codecage.cli`


def reflow(doc: str) -> str:
    """`doc` with the lines of each prose paragraph joined, for the terminal to wrap.
    Indented lines (examples) stay one to a line, as written."""
    paragraphs = []
    for paragraph in inspect.cleandoc(doc).split("\n\n"):
        lines: list[str] = []
        for line in paragraph.splitlines():
            if lines and not line.startswith(" ") and not lines[-1].startswith(" "):
                lines[-1] += " " + line.strip()
            else:
                lines.append(line.rstrip())
        paragraphs.append("\n".join(lines))
    return "\n\n".join(paragraphs)


def _show_version(value: bool) -> None:
    if value:
        sys.stdout.write(f"codecage {__version__}\n")
        raise typer.Exit(0)


@app.callback()
def _options(
    version: Annotated[
        bool,
        typer.Option(
            "--version",
            "-V",
            help="Print codecage's version and exit.",
            is_eager=True,
            callback=_show_version,
        ),
    ] = False,
) -> None:
    pass


def _default(name: str) -> str:
    field = Limits.model_fields[name]
    # Parentheses, not brackets: rich would read "[default: …]" as markup and drop it.
    return f"{field.description} (default: {field.default})"


# One name in four spellings: field memory_mb, flag --memory-mb, env CODECAGE_MEMORY_MB.
TimeoutOpt = Annotated[
    float | None,
    typer.Option("--timeout", help=_default("timeout"), envvar="CODECAGE_TIMEOUT"),
]
CpuOpt = Annotated[
    int | None,
    typer.Option("--cpu-seconds", help=_default("cpu_seconds"), envvar="CODECAGE_CPU_SECONDS"),
]
MemoryOpt = Annotated[
    int | None,
    typer.Option("--memory-mb", help=_default("memory_mb"), envvar="CODECAGE_MEMORY_MB"),
]
ProcessesOpt = Annotated[
    int | None,
    typer.Option(
        "--max-processes", help=_default("max_processes"), envvar="CODECAGE_MAX_PROCESSES"
    ),
]
OpenFilesOpt = Annotated[
    int | None,
    typer.Option(
        "--max-open-files", help=_default("max_open_files"), envvar="CODECAGE_MAX_OPEN_FILES"
    ),
]
FileSizeOpt = Annotated[
    int | None,
    typer.Option(
        "--max-file-size-mb",
        help=_default("max_file_size_mb"),
        envvar="CODECAGE_MAX_FILE_SIZE_MB",
    ),
]
WorkspaceMbOpt = Annotated[
    int | None,
    typer.Option("--workspace-mb", help=_default("workspace_mb"), envvar="CODECAGE_WORKSPACE_MB"),
]
TmpMbOpt = Annotated[
    int | None,
    typer.Option("--tmp-mb", help=_default("tmp_mb"), envvar="CODECAGE_TMP_MB"),
]
OutputOpt = Annotated[
    int | None,
    typer.Option(
        "--max-output-bytes",
        help=_default("max_output_bytes"),
        envvar="CODECAGE_MAX_OUTPUT_BYTES",
    ),
]
JsonOpt = Annotated[
    bool, typer.Option("--json", help="Print exactly one JSON object on stdout, nothing else.")
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
    typer.Option("--backend", help="Isolation backend: auto or bwrap.", envvar="CODECAGE_BACKEND"),
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
VerboseOpt = Annotated[
    bool, typer.Option("--verbose", "-v", help="Log what codecage does, with tracebacks.")
]
McpConfigOpt = Annotated[
    Path | None,
    typer.Option(
        "--mcp-config",
        help="Upstream MCP servers whose tools the code may call, through codecage, without "
        "network or credentials: a JSON file with mcpServers, as MCP hosts write them.",
        dir_okay=False,
        exists=True,
        show_default=False,
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


@app.command()
def run(
    source: Annotated[
        str | None, typer.Argument(help="'-' to read the code from stdin.", show_default=False)
    ] = None,
    code: Annotated[str | None, typer.Option("--code", "-c", help="The code to run.")] = None,
    file: Annotated[
        Path | None, typer.Option("--file", "-f", help="A Python file to run.", dir_okay=False)
    ] = None,
    timeout: TimeoutOpt = None,
    cpu_seconds: CpuOpt = None,
    memory_mb: MemoryOpt = None,
    max_processes: ProcessesOpt = None,
    max_open_files: OpenFilesOpt = None,
    max_file_size_mb: FileSizeOpt = None,
    workspace_mb: WorkspaceMbOpt = None,
    tmp_mb: TmpMbOpt = None,
    max_output_bytes: OutputOpt = None,
    workspace: Annotated[
        Path | None,
        typer.Option(
            "--workspace",
            help="Mount this host directory at /workspace instead of a fresh empty one; "
            "its files stay after the run.",
            file_okay=False,
        ),
    ] = None,
    as_json: JsonOpt = False,
    raw: Annotated[
        bool, typer.Option("--raw", help="Print the program's output bytes unescaped.")
    ] = False,
    profile: ProfileOpt = None,
    allow_import: AllowImportOpt = None,
    config_file: ConfigOpt = None,
    replace_imports: Annotated[
        bool,
        typer.Option(
            "--replace-imports", help="--allow-import replaces the profile's modules instead."
        ),
    ] = False,
    no_import_policy: Annotated[
        bool,
        typer.Option(
            "--no-import-policy",
            help="Turn the import policy off; the OS sandbox still holds (it is the boundary).",
        ),
    ] = False,
    strict: Annotated[
        bool,
        typer.Option(
            "--strict",
            help="Validate first; refuse (status blocked) on a syntax error, a disallowed "
            "import or a high-severity finding.",
        ),
    ] = False,
    allow_degraded: DegradedOpt = False,
    backend: BackendOpt = "auto",
    mcp_config: McpConfigOpt = None,
    mcp_host: McpHostOpt = None,
    servers_dir: ServersDirOpt = None,
    skills_dir: SkillsDirOpt = None,
    allow_tool: AllowToolOpt = None,
    max_tool_calls: MaxToolCallsOpt = None,
    tokenize: TokenizeOpt = False,
    no_scrub: NoScrubOpt = False,
    scrub_categories: ScrubCategoriesOpt = None,
    verbose: VerboseOpt = False,
) -> None:
    """Run Python code in a fresh sandbox and report how it went.

    What the run returns is scrubbed by the host: personal data and secrets in stdout,
    stderr, the traceback, the return value and events become [EMAIL], [SECRET], ...
    (counted in `redactions`); --no-scrub turns that off.

    Examples:

        codecage run --code 'import math; math.factorial(20)'

        codecage run --file analysis.py --timeout 5 --memory-mb 256 --json

        echo 'print("hi")' | codecage run -

        codecage run --mcp-host claude-code --file agent.py  # calls MCP tools
    """
    _configure_logging(verbose)
    overrides: dict[str, Any] = {
        "timeout": timeout,
        "cpu_seconds": cpu_seconds,
        "memory_mb": memory_mb,
        "max_processes": max_processes,
        "max_open_files": max_open_files,
        "max_file_size_mb": max_file_size_mb,
        "workspace_mb": workspace_mb,
        "tmp_mb": tmp_mb,
        "max_output_bytes": max_output_bytes,
    }
    try:
        text, filename = _read_code(source, code, file)
        settings = _load_config(config_file)
        # Before any upstream server starts: code in the workspace may have written there.
        config.check_workspace(settings, workspace)
        _refuse_mcp_config_in(workspace, mcp_config)
        host_servers, host_reports = _host_servers(mcp_host, mcp_config)
        for report in host_reports:
            for host_file in report.files:
                _refuse_mcp_config_in(workspace, host_file)
        with _progress("connecting to the upstream MCP servers", enabled=not as_json):
            tools = _tool_setup(
                mcp_config,
                servers_dir,
                skills_dir,
                allow_tool,
                tokenize,
                settings,
                max_tool_calls=max_tool_calls,
                host_servers=host_servers,
            )
        sandbox = Sandbox(
            backend=backend,
            allow_degraded=allow_degraded,
            profile=profile,
            allowed_imports=[m for item in allow_import or [] for m in item.split(",") if m],
            replace_imports=replace_imports,
            import_policy=not no_import_policy,
            config=settings,
            scrub=_scrub_option(no_scrub, scrub_categories, settings),
            face="cli",
            **tools.sandbox_options(),
        )
        with (
            contextlib.closing(tools),
            sandbox,
            _progress("starting the sandbox", enabled=not as_json),
        ):
            result = sandbox.run(
                text, limits=overrides, filename=filename, workspace=workspace, strict=strict
            )
    except CodecageError as exc:
        _fail(exc, as_json=as_json, verbose=verbose)
    if as_json:
        data = result.model_dump(mode="json")
        if host_reports:  # which servers --mcp-host found, beside the result
            data["mcp_hosts"] = [report.as_json() for report in host_reports]
        _print_json(data)
    else:
        _render_human(result, raw=raw)
    raise typer.Exit(0 if result.ok else 1)


@app.command()
def validate(
    source: Annotated[
        str | None, typer.Argument(help="'-' to read the code from stdin.", show_default=False)
    ] = None,
    code: Annotated[str | None, typer.Option("--code", "-c", help="The code to check.")] = None,
    file: Annotated[
        Path | None, typer.Option("--file", "-f", help="A Python file to check.", dir_okay=False)
    ] = None,
    profile: ProfileOpt = None,
    allow_import: AllowImportOpt = None,
    config_file: ConfigOpt = None,
    strict: Annotated[
        bool, typer.Option("--strict", help="A high-severity security finding makes it invalid.")
    ] = False,
    as_json: JsonOpt = False,
    verbose: VerboseOpt = False,
) -> None:
    """Check code without running it: syntax, imports outside the profile, security findings.

    Exit 0 when the code would run under the profile, 1 when it would be refused.

    Examples:

        codecage validate --code 'import os; os.system("ls")'

        codecage validate --file job.py --profile filesystem --json
    """
    _configure_logging(verbose)
    try:
        text, _ = _read_code(source, code, file)
        extra = [m for item in allow_import or [] for m in item.split(",") if m]
        settings = _load_config(config_file)
        policy = profiles.resolve(
            (profile or settings.profile).split(","),
            allowed_imports=[*settings.allowed_imports, *extra],
            custom=settings.custom_profiles,
        )
    except CodecageError as exc:
        _fail(exc, as_json=as_json, verbose=verbose)
    report = validation.validate(
        text, allowed_modules=policy.modules, profile_name=policy.profile, strict=strict
    )
    if as_json:
        _print_json(report.model_dump(mode="json"))
    else:
        _render_validation(report)
    raise typer.Exit(0 if report.valid else 1)


@app.command()
def info(
    as_json: JsonOpt = False,
    backend: BackendOpt = "auto",
    config_file: ConfigOpt = None,
    pool: Annotated[
        bool,
        typer.Option(
            "--pool",
            help="Start the warm pool (sized as the config says), wait until it is ready, "
            "and report its state: idle sandboxes and the memory each costs.",
        ),
    ] = False,
    verbose: VerboseOpt = False,
) -> None:
    """Show the backend, the isolation layers really in force here, the default limits,
    the profiles and the warm pool's settings.

    Examples:

        codecage info --json

        codecage info --pool        # measure what an idle warm sandbox costs here
    """
    _configure_logging(verbose)
    try:
        settings = _load_config(config_file)
        with Sandbox(backend=backend, config=settings, pool=pool) as sb:
            if pool:
                with _progress("warming the pool", enabled=not as_json):
                    sb.warm(timeout=sb.settings.pool.ready_timeout)
            report = sb.info()
    except CodecageError as exc:
        _fail(exc, as_json=as_json, verbose=verbose)
    if as_json:
        _print_json(report.model_dump(mode="json"))
    else:
        _render_info(report)


@app.command()
def doctor(
    as_json: JsonOpt = False, backend: BackendOpt = "auto", verbose: VerboseOpt = False
) -> None:
    """Prove each isolation layer by running probes in a real sandbox.

    A file is planted on the host, a TCP listener opened on 127.0.0.1, and a probe program
    inside the sandbox tries to read the one and reach the other, calls denied syscalls and
    sets off the memory and process limits. One line per layer; exit 1 if any fails.

    Example:

        codecage doctor
    """
    _configure_logging(verbose)
    try:
        with _progress("probing every layer in a real sandbox", enabled=not as_json):
            report = Sandbox(backend=backend, selftest=False).doctor()
    except CodecageError as exc:
        _fail(exc, as_json=as_json, verbose=verbose)
    if as_json:
        _print_json(report.model_dump(mode="json"))
    else:
        _render_doctor(report)
    raise typer.Exit(0 if report.passed else 1)


# --- input ---------------------------------------------------------------------------------


def _read_code(source: str | None, code: str | None, file: Path | None) -> tuple[str, str]:
    given = [x for x in (source, code, file) if x is not None]
    if len(given) != 1:
        raise ConfigError(
            "give the code exactly one way",
            hint="use --code SRC, --file PATH, or - to read stdin",
        )
    if code is not None:
        return code, "main.py"
    if file is not None:
        try:
            data = file.read_bytes()
        except OSError as exc:
            # The reason is the message; no hint says more than "No such file or directory".
            raise ConfigError(f"cannot read {file}: {exc.strerror or exc}", hint="") from exc
        return _read_text(data, str(file)), file.name
    if source != "-":
        raise ConfigError(
            f"unexpected argument {source!r}",
            hint="to run a file use --file PATH; to read stdin use -",
        )
    return _read_text(sys.stdin.buffer.read(), "stdin"), "main.py"


def _read_text(data: bytes, where: str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"{where} is not UTF-8 text (byte {exc.start})",
            hint="pass Python source code, not a binary file",
        ) from exc


# --- output --------------------------------------------------------------------------------


def _print_json(data: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(data, ensure_ascii=False) + "\n")
    sys.stdout.flush()


def _render_human(result: ExecutionResult, *, raw: bool) -> None:
    if raw:
        sys.stdout.buffer.write(result.raw_stdout())
        sys.stdout.buffer.flush()
        sys.stderr.buffer.write(result.raw_stderr())
        sys.stderr.buffer.flush()
    else:
        sys.stdout.write(result.stdout)
        sys.stdout.flush()
        sys.stderr.write(result.stderr)
    if result.error is not None and result.error.traceback:
        sys.stderr.write(result.error.traceback.rstrip("\n") + "\n")
    elif result.error is not None:
        sys.stderr.write(f"{result.error.type}: {result.error.message}\n")
    if result.return_value is not None:
        shown = json.dumps(result.return_value, ensure_ascii=False)
        stderr.print(f"[bold]→[/bold] {neutralise_text(shown)[:2000]}", markup=True)
    for event in result.events:
        # The detail holds text the code chose (module and tool names): never markup, and
        # one line (Event neutralises it when made; again here, as a result can be built
        # without validation and this costs nothing).
        detail = escape(neutralise_line(event.detail))
        if event.kind == "tool_call" and (event.data or {}).get("status") == "ok":
            stderr.print(f"[dim]· tool {detail}[/dim]", markup=True)
        else:
            stderr.print(f"[yellow]! {event.kind}[/yellow]: {detail}", markup=True)
    stderr.print(_summary(result), markup=True)


def _summary(result: ExecutionResult) -> str:
    colour = "green" if result.ok else "red"
    parts = [f"[{colour}]{result.status}[/{colour}]", f"{result.usage.wall_ms} ms wall"]
    if result.usage.cpu_ms is not None:
        parts.append(f"{result.usage.cpu_ms} ms CPU")
    if result.usage.peak_memory_mb is not None:
        parts.append(f"{result.usage.peak_memory_mb:g} MiB peak")
    if result.exit_code not in (None, 0):
        parts.append(f"exit {result.exit_code}")
    if result.signal:
        parts.append(result.signal)
    if result.files:
        parts.append(f"{len(result.files)} file(s)")
    if result.redactions:
        counts = ", ".join(f"{n} {category}" for category, n in result.redactions.items())
        parts.append(f"redacted {counts}")
    return "codecage: " + " · ".join(parts)


def _render_validation(report: ValidationReport) -> None:
    out = Console(highlight=False, soft_wrap=True)
    for finding in report.findings:
        where = f"{finding.line}:{finding.col}" if finding.line else "-"
        out.print(
            f"{where:>7} {finding.severity:<6} {finding.rule_id:<6} {finding.message}",
            markup=False,
        )
    if report.omitted_findings:
        out.print(f"        … and {report.omitted_findings} more findings", markup=False)
    a = report.analysis
    out.print(
        f"{a.lines} lines · {a.functions} functions · {a.loops} loops · "
        f"nesting {a.max_nesting_depth} · complexity {a.complexity}",
        markup=False,
    )
    for tip in a.recommendations:
        out.print(f"tip: {tip}", markup=False)
    verdict = "[green]valid[/green]" if report.valid else "[red]invalid[/red]"
    out.print(f"{verdict}: {report.message}")


@app.command()
def gen(
    mcp_config: Annotated[
        Path | None,
        typer.Option(
            "--mcp-config",
            help="Upstream MCP servers: a JSON file with mcpServers, as MCP hosts write them "
            "(default: the config file's \\[mcpServers.*] tables).",
            dir_okay=False,
            exists=True,
            show_default=False,
        ),
    ] = None,
    server: Annotated[
        list[str] | None,
        typer.Option("--server", help="Generate this server's tools (repeat).", show_default=False),
    ] = None,
    all_servers: Annotated[
        bool, typer.Option("--all", help="Generate the tools of every configured server.")
    ] = False,
    out: Annotated[
        Path | None,
        typer.Option(
            "--out",
            help="Where to write the tree (default: the config's \\[tools] servers_dir, "
            "else ./servers).",
            file_okay=False,
            show_default=False,
        ),
    ] = None,
    mcp_host: McpHostOpt = None,
    config_file: ConfigOpt = None,
    as_json: JsonOpt = False,
    verbose: VerboseOpt = False,
) -> None:
    """Write typed Python modules for the tools of upstream MCP servers.

    Connects to each server, lists its tools, and writes servers/<server>/<tool>.py with a
    typed Params, the result type, and call()/call_sync(). Mount the tree into the sandbox
    with `codecage run --servers-dir` (or let run/serve generate it). Regenerating gives
    byte-identical files; files of servers no longer asked for are removed. Each module's
    bytecode is written beside it (the tree is read-only in the sandbox).

    Examples:

        codecage gen --mcp-config mcp.json --all

        codecage gen --mcp-config mcp.json --server memory --out ./servers

        codecage gen --mcp-host claude-code --all   # the servers Claude Code has
    """
    from codecage.bridge import tooling
    from codecage.bridge.broker import Broker

    _configure_logging(verbose)
    try:
        if bool(server) == all_servers:
            raise ConfigError(
                "name the servers with --server NAME, or pass --all",
                hint="--all generates the tools of every server configured",
            )
        settings = _load_config(config_file)
        host_servers, host_reports = _host_servers(mcp_host, mcp_config)
        servers = tooling.configured_servers(mcp_config, settings, host_servers)
        if servers is None:
            raise ConfigError(
                "no upstream MCP servers to generate",
                hint="pass --mcp-config FILE or --mcp-host HOST, or add [mcpServers.NAME] "
                "tables to the config file",
            )
        out = out or settings.config_relative(settings.tools.servers_dir) or Path("servers")
        with Broker(servers) as broker:
            names = list(broker.servers) if all_servers else list(server or [])
            with _progress(f"listing the tools of {', '.join(names)}", enabled=not as_json):
                written = tooling.generate(broker, names, out)
    except CodecageError as exc:
        _fail(exc, as_json=as_json, verbose=verbose)
    modules = sorted(p for p in out.rglob("*.py") if p.name != "__init__.py")
    packages = sorted(p.name for p in out.iterdir() if (p / "__init__.py").is_file())
    if as_json:
        _print_json(
            {
                "out": str(out),
                "servers": names,
                "modules": [str(m.relative_to(out)) for m in modules],
                "written": len(written),
                "mcp_hosts": [report.as_json() for report in host_reports],
            }
        )
        return
    stderr.print(
        f"{len(modules)} tool modules of {len(names)} server(s) in {out}/"
        f" ({len(written)} file(s) written or changed)",
        markup=False,
    )
    for package in packages:
        stderr.print(f"  from servers.{package} import ...", markup=False)


@app.command()
def serve(
    http: Annotated[
        bool, typer.Option("--http", help="Serve streamable HTTP at /mcp instead of stdio.")
    ] = False,
    host: Annotated[
        str, typer.Option("--host", help="HTTP: address to bind (a token is always required).")
    ] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", help="HTTP: port to listen on.")] = 8000,
    token: Annotated[
        str | None,
        typer.Option(
            "--token",
            help="HTTP: require 'Authorization: Bearer TOKEN' on every request (required).",
            envvar="CODECAGE_TOKEN",
            show_default=False,
        ),
    ] = None,
    insecure_no_token: Annotated[
        bool,
        typer.Option(
            "--insecure-no-token",
            help="HTTP on loopback without a token. INSECURE: every local user of this "
            "machine can then run code, and call the upstream tools with your credentials.",
        ),
    ] = False,
    max_timeout: Annotated[
        float, typer.Option("--max-timeout", help="Largest timeout a call may ask for (s).")
    ] = 120.0,
    max_memory_mb: Annotated[
        int, typer.Option("--max-memory-mb", help="Largest memory_limit_mb a call may ask for.")
    ] = 2048,
    max_concurrent: Annotated[
        int, typer.Option("--max-concurrent", help="Executions running at once.", min=1)
    ] = 4,
    max_queued: Annotated[
        int,
        typer.Option("--max-queued", help="Executions that may wait; past that, 'busy'.", min=0),
    ] = 32,
    no_pool: Annotated[
        bool, typer.Option("--no-pool", help="Cold-start every sandbox (no warm pool).")
    ] = False,
    reply_max_tokens: Annotated[
        int | None,
        typer.Option(
            "--reply-max-tokens",
            help="Estimated tokens one tool reply may take (env CODECAGE_REPLY_MAX_TOKENS, "
            "config key serve.reply_max_tokens; 2000 to 240000, default 20000). Longer output "
            "keeps its head and tail.",
            show_default=False,
        ),
    ] = None,
    mcp_config: McpConfigOpt = None,
    mcp_host: McpHostOpt = None,
    servers_dir: ServersDirOpt = None,
    skills_dir: SkillsDirOpt = None,
    allow_tool: AllowToolOpt = None,
    max_tool_calls: MaxToolCallsOpt = None,
    tokenize: TokenizeOpt = False,
    no_scrub: NoScrubOpt = False,
    scrub_categories: ScrubCategoriesOpt = None,
    config_file: ConfigOpt = None,
    verbose: VerboseOpt = False,
) -> None:
    """Serve codecage as an MCP server: tools execute_code, validate_code, get_sandbox_info.

    Logs go to stderr: the settings at start, then one line per tool call (tool, status,
    wall_ms, queue_ms); in stdio mode stdout carries only the protocol.

    Examples:

        codecage serve        # stdio: for Claude Code, Cursor, VS Code

        codecage serve --http --port 8765 --token "$TOKEN"   # at :8765/mcp

        codecage serve --http --host 0.0.0.0 --token "$(openssl rand -hex 16)"

        codecage serve --mcp-host cursor   # code may call Cursor's MCP servers
    """
    from codecage.mcp import http as http_serving
    from codecage.mcp import server as mcp_server  # the MCP SDK loads only for this command
    from codecage.mcp import stdio

    _configure_logging(verbose)
    if not verbose:  # the settings at start and one line per call, even when quiet
        for module in (mcp_server, stdio, http_serving):
            logging.getLogger(module.__name__).setLevel(logging.INFO)
    _exit_on_sigterm()
    limits = mcp_server.ServerLimits(
        max_timeout=max_timeout,
        max_memory_mb=max_memory_mb,
        max_concurrent=max_concurrent,
        max_queued=max_queued,
        reply_max_tokens=reply_max_tokens,  # None: env, then the config file, then 20000
    )
    try:
        settings = _load_config(config_file)
        host_servers, _ = _host_servers(mcp_host, mcp_config)
        tools = _tool_setup(
            mcp_config,
            servers_dir,
            skills_dir,
            allow_tool,
            tokenize,
            settings,
            max_tool_calls=max_tool_calls,
            host_servers=host_servers,
        )
        atexit.register(tools.close)
        options = {
            **tools.sandbox_options(),
            # Every Sandbox of the server (one per profile, per call with extra imports)
            # uses the settings loaded and logged now, not a file read again later.
            "config": settings,
            "scrub": _scrub_option(no_scrub, scrub_categories, settings),
        }
        app_server = mcp_server.build_server(
            limits=limits, pool=not no_pool, sandbox_options=options
        )
        if not http:
            stdio.serve(app_server)
            _ignore_sigterm()  # the client hung up: what is left is cleanup
            return
        asgi = mcp_server.http_app(
            app_server, host=host, token=token, insecure_no_token=insecure_no_token
        )
    except CodecageError as exc:
        _fail(exc, as_json=False, verbose=verbose)
    stderr.print(f"codecage MCP server on http://{host}:{port}/mcp", markup=False)
    http_serving.serve(asgi, host=host, port=port, verbose=verbose)


_MAX_TOOL_CALLS = 100_000  # as [tools] max_calls allows


# --- packages ------------------------------------------------------------------------------

packages_app = typer.Typer(
    help="Packages the operator adds for the sandboxes (scikit-learn, seaborn, openpyxl...): "
    "installed with this environment's pip into codecage's packages directory, pinned and "
    "recorded, and bound read-only at /opt/packages for the profiles that allow them.",
    short_help="Add packages for the sandboxes (the operator's): add, list, remove.",
    no_args_is_help=True,
)
app.add_typer(packages_app, name="packages")

PackagesDirOpt = Annotated[
    Path | None,
    typer.Option(
        "--packages-dir",
        help="The packages directory (default: CODECAGE_PACKAGES_DIR, else the config's "
        "\\[packages] dir, else /var/lib/codecage/packages for root and "
        "$XDG_DATA_HOME/codecage/packages for others). Owned by you or root, not "
        "group/world-writable.",
        envvar=added.ENV_DIR,
        file_okay=False,
        show_default=False,
    ),
]
AllowSourceOpt = Annotated[
    bool,
    typer.Option(
        "--allow-source",
        help="Build a package from source when it has no wheel (its build runs on this host).",
    ),
]
IgnoreHostVersionsOpt = Annotated[
    bool,
    typer.Option(
        "--ignore-host-versions",
        help="Resolve without pinning the dependencies the host already has to its versions "
        "(the added versions then shadow the host's in the sandbox).",
    ),
]


@packages_app.command("add")
def packages_add(
    names: Annotated[
        list[str],
        typer.Argument(
            help="NAME or NAME==VERSION (extras allowed), one or more.",
            metavar="NAME[==VERSION]",
            show_default=False,
        ),
    ],
    packages_dir: PackagesDirOpt = None,
    allow_source: AllowSourceOpt = False,
    ignore_host_versions: IgnoreHostVersionsOpt = False,
    config_file: ConfigOpt = None,
    as_json: JsonOpt = False,
    verbose: VerboseOpt = False,
) -> None:
    """Install packages (and what they need) for the sandboxes; a package already added is
    replaced by the version given.

    Examples:

        codecage packages add scikit-learn seaborn openpyxl

        codecage packages add tabulate==0.9.0
    """
    _change_packages(
        added.add,
        "installing with pip",
        names,
        packages_dir,
        config_file,
        allow_source=allow_source,
        host_versions=not ignore_host_versions,
        as_json=as_json,
        verbose=verbose,
    )


@packages_app.command("remove")
def packages_remove(
    names: Annotated[
        list[str],
        typer.Argument(help="Names of added packages.", metavar="NAME", show_default=False),
    ],
    packages_dir: PackagesDirOpt = None,
    allow_source: AllowSourceOpt = False,
    ignore_host_versions: IgnoreHostVersionsOpt = False,
    config_file: ConfigOpt = None,
    as_json: JsonOpt = False,
    verbose: VerboseOpt = False,
) -> None:
    """Remove added packages and what only they needed (the rest is installed again at the
    recorded versions).

    Example:

        codecage packages remove seaborn
    """
    _change_packages(
        added.remove,
        "reinstalling the rest with pip",
        names,
        packages_dir,
        config_file,
        allow_source=allow_source,
        host_versions=not ignore_host_versions,
        as_json=as_json,
        verbose=verbose,
    )


def _change_packages(
    change_with: Callable[..., added.Change],
    doing: str,
    names: list[str],
    packages_dir: Path | None,
    config_file: Path | None,
    *,
    allow_source: bool,
    host_versions: bool,
    as_json: bool,
    verbose: bool,
) -> None:
    """`packages add` and `remove`: one change of the operator's packages, shown as done."""
    _configure_logging(verbose)
    try:
        directory = _packages_dir(packages_dir, config_file, for_writing=True)
        with _progress(doing, enabled=not as_json):
            change = change_with(
                directory, names, allow_source=allow_source, host_versions=host_versions
            )
    except CodecageError as exc:
        _fail(exc, as_json=as_json, verbose=verbose)
    _render_package_change(change, as_json=as_json)


@packages_app.command("list")
def packages_list(
    packages_dir: PackagesDirOpt = None,
    config_file: ConfigOpt = None,
    as_json: JsonOpt = False,
    verbose: VerboseOpt = False,
) -> None:
    """List the added packages with their versions (the record, packages.lock.json).

    Example:

        codecage packages list --json
    """
    _configure_logging(verbose)
    try:
        directory = _packages_dir(packages_dir, config_file, for_writing=False)
        record = added.installed(directory)
    except CodecageError as exc:
        _fail(exc, as_json=as_json, verbose=verbose)
    if as_json:
        _print_json({"directory": str(directory), **record.model_dump(mode="json")})
        return
    out = Console(highlight=False, soft_wrap=True)
    out.print(f"packages directory: {directory}", markup=False)
    if not record.packages:
        out.print("no packages added (codecage packages add NAME)", markup=False)
        return
    for entry in record.packages:
        why = "" if entry.requested else "  (dependency)"
        out.print(f"  {entry.name}=={entry.version}{why}", markup=False)


def _packages_dir(argument: Path | None, config_file: Path | None, *, for_writing: bool) -> Path:
    settings = None if argument is not None else _load_config(config_file)
    return added.location(argument, settings, for_writing=for_writing)[0]


def _render_package_change(change: added.Change, *, as_json: bool) -> None:
    before = {added.canonical(e.name): e for e in change.before.packages}
    after = {added.canonical(e.name): e for e in change.after.packages}
    installed = [after[k] for k in sorted(after) if k not in before]
    removed = [before[k] for k in sorted(before) if k not in after]
    changed = [
        (before[k], after[k])
        for k in sorted(after)
        if k in before and before[k].version != after[k].version
    ]
    if as_json:
        _print_json(
            {
                "directory": str(change.directory),
                "notes": list(change.notes),
                "installed": [f"{e.name}=={e.version}" for e in installed],
                "removed": [f"{e.name}=={e.version}" for e in removed],
                "changed": [f"{a.name}=={a.version} -> {b.version}" for a, b in changed],
                **change.after.model_dump(mode="json"),
            }
        )
        return
    for note in change.notes:
        stderr.print(note, markup=False)
    for entry in installed:
        stderr.print(f"+ {entry.name}=={entry.version}", markup=False)
    for old, new in changed:
        stderr.print(f"~ {old.name}=={old.version} -> {new.version}", markup=False)
    for entry in removed:
        stderr.print(f"- {entry.name}=={entry.version}", markup=False)
    count = len(change.after.requested())
    stderr.print(
        f"{count} package(s) added in {change.directory}; sandboxes started from now on see "
        "them (a running `codecage serve` keeps its warm sandboxes until they are used)",
        markup=False,
    )


def _load_config(config_file: Path | None) -> config.Settings:
    """The settings, with the config file in force logged (INFO, shown by -v).

    Raises:
        ConfigError: the file is not trusted or not valid, or a variable is invalid.
    """
    settings = config.load(config_file)
    log.info(
        "config.file",
        extra={
            "path": str(settings.config_file) if settings.config_file else None,
            "origin": settings.config_origin,
            "searched": [str(p) for p in settings.config_searched],
        },
    )
    return settings


def _host_servers(
    names: list[str] | None, mcp_config: Path | None
) -> tuple[dict[str, Upstream] | None, list[HostServers]]:
    """The servers of the --mcp-host hosts, each host's finding said on stderr. A server
    the --mcp-config file names too is the file's (`tooling.configured_servers`): the
    report says so.

    Raises:
        ConfigError: an unknown host, an untrusted or malformed file, or no server found.
    """
    if not names:
        return None, []
    from codecage.bridge import hosts, upstreams

    servers, reports = hosts.load([n.strip() for item in names for n in item.split(",") if n])
    for name in upstreams.load(mcp_config) if mcp_config is not None else {}:
        for report in reports:
            if report.servers.pop(name, None) is not None:
                report.skipped[name] = "--mcp-config names a server of that name, used instead"
    for report in reports:
        stderr.print(f"codecage: {report.describe()}", markup=False)
    return servers, reports


def _refuse_mcp_config_in(workspace: Path | None, mcp_config: Path | None) -> None:
    """Refuse an --mcp-config inside the workspace: like the config file, it names the
    commands the host starts, and code in the run could rewrite it for the next run.

    Raises:
        ConfigError: the workspace contains the file.
    """
    if workspace is None or mcp_config is None:
        return
    root = Path(workspace).resolve()
    for place in (mcp_config.resolve(), mcp_config.absolute()):
        if place.is_relative_to(root):
            raise ConfigError(
                f"the workspace {workspace} contains the --mcp-config file {mcp_config}: code "
                "run there could rewrite the commands this host starts for later runs",
                hint="keep the MCP config outside the workspace",
            )


def _tool_setup(
    mcp_config: Path | None,
    servers_dir: Path | None,
    skills_dir: Path | None,
    allow_tool: list[str] | None,
    tokenize: bool,
    settings: config.Settings,
    *,
    max_tool_calls: int | None = None,
    host_servers: Mapping[str, Upstream] | None = None,
) -> ToolSetup:
    """The tool flags, with the config file's [mcpServers.*] and [tools] for what they
    leave out."""
    from codecage.bridge import tooling

    setup = tooling.prepare(
        mcp_config,
        servers_dir=servers_dir,
        skills_dir=skills_dir,
        allowed_tools=[t for item in allow_tool or [] for t in item.split(",") if t],
        tokenize=True if tokenize else None,
        settings=settings,
        host_servers=host_servers,
    )
    if max_tool_calls is None:
        return setup
    if not 1 <= max_tool_calls <= _MAX_TOOL_CALLS:
        setup.close()
        raise ConfigError(
            f"--max-tool-calls {max_tool_calls} is out of range",
            hint=f"give 1 to {_MAX_TOOL_CALLS} tool calls per run",
        )
    limits = setup.tool_limits or tooling.bridge_limits(settings.tools)
    return dataclasses.replace(
        setup, tool_limits=dataclasses.replace(limits, max_calls=max_tool_calls)
    )


def _scrub_option(
    no_scrub: bool, categories: str | None, settings: config.Settings
) -> bool | ScrubSettings | None:
    """`Sandbox(scrub=...)` for the flags: None leaves it to the config.

    Raises:
        ConfigError: an unknown category, or --no-scrub with --scrub-categories.
    """
    if no_scrub and categories is not None:
        raise ConfigError(
            "--no-scrub and --scrub-categories contradict each other",
            hint="give one: --no-scrub turns scrubbing off, --scrub-categories narrows it",
        )
    if no_scrub:
        return False
    if categories is None:
        return None
    wanted = [c.strip() for c in categories.split(",") if c.strip()]
    base = settings.scrub.model_copy(update={"enabled": True})
    return config.with_categories(base, wanted, "--scrub-categories")


def _exit_on_sigterm() -> None:
    """Let SIGTERM (a service manager, `kill`) end the process through the interpreter's
    exit, as Ctrl-C does, so atexit closes the warm pool and leaves nothing behind. (uvicorn
    restores this handler when it stops and re-raises the signal to it.)"""

    def leave(signum: int, _frame: object) -> None:
        _ignore_sigterm()  # a second one must not cut the cleanup it starts short
        sys.exit(128 + signum)

    signal.signal(signal.SIGTERM, leave)


def _ignore_sigterm() -> None:
    """From here on the process is only cleaning up (closing the warm pool, which waits
    for a sandbox still starting): a SIGTERM raising SystemExit inside that cleanup would
    leave the sandbox's run directory, mount and cgroup behind. MCP clients send one two
    seconds after they close the server's stdin (the SDKs' stdio transports do)."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def _render_info(report: HostInfo) -> None:
    out = Console(highlight=False, soft_wrap=True)
    out.print(f"codecage {report.version} · backend [bold]{report.backend}[/bold]")
    origin = config.ORIGINS.get(report.config_origin, report.config_origin)
    found = f"{report.config_file} (from {origin})" if report.config_file else "none found"
    out.print(f"config file: {found}", markup=False)
    out.print(f"python in the sandbox: {report.python}")
    for layer in report.layers:
        mark = "[green]✓[/green]" if layer.active else "[red]✗[/red]"
        out.print(f" {mark} {layer.name:<11} {layer.mechanism} — {layer.detail}")
    out.print("default limits (override per run; see `codecage run --help`), and their source:")
    for name, value in report.default_limits.model_dump().items():
        source = report.limit_sources.get(name, "default")
        out.print(f"   {name:<18} {value!s:<10} ({source})")
    out.print(
        f"ceilings: memory_mb ≤ {report.ceilings.memory_mb}, timeout ≤ {report.ceilings.timeout:g}"
    )
    out.print(f"import policy: {report.import_policy or 'off'} (profiles, choose with --profile):")
    for profile in report.profiles:
        missing = [name for name, ok in profile.packages_importable.items() if not ok]
        note = f" (not importable yet: {', '.join(missing)})" if missing else ""
        mark = "*" if profile.default else " "
        out.print(f" {mark} {profile.name:<13} {profile.description}{note}")
    if report.pool is not None:
        _render_pool(out, report.pool)
    if report.scrub is not None:
        _render_scrub(out, report.scrub)
    if report.tools is not None:
        _render_tools(out, report.tools)
    if report.packages:
        listed = ", ".join(f"{p.name}=={p.version}" for p in report.packages if p.requested)
        extra = sum(1 for p in report.packages if not p.requested)
        out.print(f"added packages: {listed} (+{extra} dependencies)", markup=False)
    else:
        out.print("added packages: none (`codecage packages add NAME`)", markup=False)


def _render_tools(out: Console, tools: ToolsState) -> None:
    if tools.servers:
        servers = ", ".join(tools.servers)
    elif tools.configured_servers:
        servers = (
            f"{', '.join(tools.configured_servers)} (in the config file; run and serve start them)"
        )
    else:
        servers = "none (add --mcp-config FILE, or [mcpServers.NAME] to the config file)"
    out.print(f"upstream MCP tools: {servers}", markup=False)
    out.print(
        f"   per run: at most {tools.max_calls} tool calls, {tools.max_in_flight} at once, "
        f"{tools.max_result_mb:g} MiB per result ([tools] in the config file)",
        markup=False,
    )
    if tools.allowed_tools is not None:
        out.print(f"   allowed: {', '.join(tools.allowed_tools) or 'none'}", markup=False)
    for label, directory in (("typed tools", tools.servers_dir), ("skills", tools.skills_dir)):
        if directory is not None:
            out.print(f"   {label}: {directory}", markup=False)


def _render_scrub(out: Console, scrub: ScrubState) -> None:
    if not scrub.enabled:
        out.print(f"scrubbing of results: off ({scrub.source})", markup=False)
        return
    secrets = f"; {scrub.secrets} configured secret(s)" if scrub.secrets else ""
    out.print(
        f"scrubbing of results: {', '.join(scrub.categories) or 'configured secrets only'}"
        f"{secrets} ({scrub.source})",
        markup=False,
    )


def _render_pool(out: Console, pool: PoolState) -> None:
    config = pool.config
    state = "on" if config.enabled else "off (enable: [pool] enabled = true, or CODECAGE_POOL=1)"
    sizes = config.sizes
    out.print(
        f"warm pool: {state}; keeps {sizes.min_idle}..{sizes.max_idle} ready per profile, "
        f"{config.max_starting} starting at once",
        markup=False,
    )
    for key in pool.keys:
        memory = (
            f"{key.idle_rss_mb} MB RSS / {key.idle_pss_mb} MB PSS each"
            if key.idle_rss_mb is not None
            else "none idle to measure"
        )
        preload = f", preloads {', '.join(key.preload)}" if key.preload else ""
        out.print(
            f"   {key.profile:<13} idle {key.idle}, starting {key.starting}, "
            f"hits {key.hits}, misses {key.misses}, crashed {key.crashed}; {memory}{preload}",
            markup=False,
        )
        if key.last_error:
            out.print(f"   last start failure: {key.last_error}", markup=False)
    if pool.host_rss_mb is not None:
        out.print(f"   this process: {pool.host_rss_mb} MB RSS", markup=False)


def _render_doctor(report: DoctorReport) -> None:
    out = Console(highlight=False, soft_wrap=True)
    for probe in report.probes:
        mark = "[green]PASS[/green]" if probe.passed else "[red]FAIL[/red]"
        out.print(f"{mark} {probe.layer:<12} {probe.detail}")
    verdict = "all layers hold" if report.passed else "some layers are missing"
    out.print(f"backend {report.backend}: {verdict}")


def _fail(exc: CodecageError, *, as_json: bool, verbose: bool) -> NoReturn:
    code = 2 if isinstance(exc, ConfigError) else 1
    hint = exc.hint_for("cli")  # flags, not keyword arguments (errors.render_hint)
    if as_json:
        _print_json(
            {"error": {"type": type(exc).__name__, "message": str(exc), "hint": hint or None}}
        )
    stderr.print(f"[red]Error:[/red] {escape(str(exc))}", markup=True)
    if hint:
        stderr.print(f"Hint: {hint}", markup=False)  # a hint may name [tables]
    if verbose:
        stderr.print_exception()
    raise typer.Exit(code)


class _NullContext:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *args: object) -> None:
        return None


def _progress(message: str, *, enabled: bool) -> Any:
    """A spinner on stderr for slow steps, only for a person watching a terminal."""
    if not enabled or not sys.stderr.isatty() or os.environ.get("CI") == "true":
        return _NullContext()
    return stderr.status(message)


_RECORD_FIELDS = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message"}


class _FieldsFormatter(logging.Formatter):
    """`LEVEL logger event key=value ...`: the `extra=` fields are the log's content."""

    def format(self, record: logging.LogRecord) -> str:
        fields = {k: v for k, v in vars(record).items() if k not in _RECORD_FIELDS}
        line = f"{record.levelname} {record.name} {record.getMessage()}"
        if fields:
            line += " " + " ".join(f"{k}={json.dumps(v, default=str)}" for k, v in fields.items())
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


def _configure_logging(verbose: bool) -> None:
    """Logs go to stderr only: stdout belongs to the program's output and to --json."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_FieldsFormatter())
    logging.basicConfig(level=logging.DEBUG if verbose else logging.WARNING, handlers=[handler])
    # bandit's plugin loader logs an ERROR for every optional formatter it cannot load.
    logging.getLogger("stevedore").setLevel(logging.CRITICAL)


def main(argv: Sequence[str] | None = None) -> NoReturn:
    """Run the CLI. Usage errors (a bad flag or value) exit 2 as click's do, and with
    --json they are one JSON object on stdout like every other error."""
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        code = _click_command().main(args=args, prog_name="codecage", standalone_mode=False)
    except ClickException as exc:
        _usage_error(exc, as_json=_wants_json(args))
    except typer.Abort:
        stderr.print("Aborted.", markup=False)
        sys.exit(1)
    sys.exit(code if isinstance(code, int) else 0)


def _click_command() -> Any:
    """The click command typer builds, with its help fitted to an 80-column terminal: each
    command's docstring reflowed (typer keeps the source's line breaks inside a paragraph,
    which leave one word on a line), a flag shown without `<bool>` and a repeatable option
    with its element type. Sub-apps added with `app.add_typer` get the same."""
    command = typer.main.get_command(app)
    pending = [command]
    while pending:
        current = pending.pop()
        pending += getattr(current, "commands", {}).values()
        if current.help:
            current.help = reflow(current.help)
        help_names = _HELP_NAMES
        help_option = current.get_help_option(typer.Context(current, help_option_names=help_names))
        for param in [*current.params, *([help_option] if help_option else [])]:
            if getattr(param, "is_flag", False):
                param.metavar = ""
            elif getattr(param, "multiple", False) and param.metavar is None:
                param.metavar = "<str>"
    return command


def _wants_json(args: list[str]) -> bool:
    return "--json" in args[: args.index("--")] if "--" in args else "--json" in args


def _usage_error(exc: ClickException, *, as_json: bool) -> NoReturn:
    context = getattr(exc, "ctx", None)
    command = context.command_path if context is not None else "codecage"
    hint = f"`{command} --help` lists its options and arguments"
    if as_json:
        message = exc.format_message()
        _print_json({"error": {"type": "UsageError", "message": message, "hint": hint}})
        stderr.print(f"Error: {message}", markup=False)
    else:
        from typer import rich_utils

        rich_utils.rich_format_error(exc)
    sys.exit(exc.exit_code)


if __name__ == "__main__":
    main()
