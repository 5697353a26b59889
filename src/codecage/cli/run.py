"""`codecage run` and `codecage validate`: the commands that take code."""

from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, NoReturn

import typer
from rich.markup import escape

from codecage import config, displays
from codecage.cli.approval import TerminalPrompt
from codecage.cli.groups import FlagGroup, takes_groups
from codecage.cli.logs import configure_logging
from codecage.cli.options import (
    AllowImportOpt,
    AuditFlags,
    CodeFlags,
    ConfigOpt,
    JsonOpt,
    LimitFlags,
    McpConfigOpt,
    NetworkFlags,
    OutputFlags,
    ProfileOpt,
    SandboxFlags,
    ServersDirOpt,
    SkillsDirOpt,
    SourceArg,
    ToolFlags,
    VerboseOpt,
)
from codecage.cli.render import (
    LiveOutput,
    Screen,
    fail,
    print_json,
    progress,
    render_result,
    render_validation,
    show,
    stderr,
)
from codecage.cli.setup import (
    host_options,
    load_config,
    options_of,
    read_code,
    read_inputs,
    refuse_mcp_config_in,
    servers_of_hosts,
    tool_setup,
    tool_setup_of,
)
from codecage.config import Settings
from codecage.errors import CodecageError, ConfigError
from codecage.models import ExecutionResult
from codecage.output import neutralise_line
from codecage.sandbox import Sandbox

if TYPE_CHECKING:
    from codecage.bridge.hosts import HostServers
    from codecage.bridge.upstreams import Upstream
    from codecage.toolsetup import ToolSetup


@dataclass(frozen=True, slots=True)
class WorkspaceFlags(FlagGroup):
    """`run`'s /workspace: a host directory, or files put in a fresh one; where to save it."""

    workspace: Annotated[
        Path | None,
        typer.Option(
            "--workspace",
            help="Mount this host directory at /workspace instead of a fresh empty one; "
            "its files stay after the run. What the host would run from it (.git, .bashrc, "
            ".venv, *.pth, .vscode, ...) stays read-only (docs/security-model.md).",
            file_okay=False,
        ),
    ] = None
    inputs: Annotated[
        list[str] | None,
        typer.Option(
            "--in",
            metavar="FILE[:NAME]",
            help="Put this host file in the fresh /workspace as NAME (default: its "
            "basename) before the code runs; repeatable. Within --workspace-mb in all; "
            "not with --workspace.",
            show_default=False,
        ),
    ] = None
    out: Annotated[
        Path | None,
        typer.Option(
            "--out",
            help="After the run, write the files it left in /workspace into this directory "
            "(made when missing; links in it are never followed) and say where on stderr.",
            file_okay=False,
        ),
    ] = None
    overwrite: Annotated[
        bool,
        typer.Option("--overwrite", help="With --out: replace files that exist there."),
    ] = False


RawOpt = Annotated[
    bool,
    typer.Option(
        "--raw",
        help="Print the program's output unescaped (control characters as written; "
        "invalid UTF-8 shows as \\x escapes).",
    ),
]
ReplaceImportsOpt = Annotated[
    bool,
    typer.Option(
        "--replace-imports", help="--allow-import replaces the profile's modules instead."
    ),
]
StrictRunOpt = Annotated[
    bool,
    typer.Option(
        "--strict",
        help="Validate first; refuse (status blocked) on a syntax error, a disallowed "
        "import or a high-severity finding.",
    ),
]


@takes_groups
def run(
    *,
    program: CodeFlags,
    limits: LimitFlags,
    files: WorkspaceFlags,
    as_json: JsonOpt = False,
    raw: RawOpt = False,
    policy: SandboxFlags,
    config_file: ConfigOpt = None,
    replace_imports: ReplaceImportsOpt = False,
    strict: StrictRunOpt = False,
    tools: ToolFlags,
    network: NetworkFlags,
    audit: AuditFlags,
    output: OutputFlags,
    verbose: VerboseOpt = False,
) -> None:
    """Run Python code in a fresh sandbox and report how it went.

    The program's output is printed as it comes (stdout to stdout, stderr to stderr, escape
    sequences neutralised unless --raw), then a summary on stderr; --json prints one
    object at the end instead.

    What the run returns is scrubbed by the host: personal data and secrets in stdout,
    stderr, the traceback, the return value and events become [EMAIL], [SECRET], ...
    (counted in `redactions`); --no-scrub turns that off.

    Examples:

        codecage run --code 'import math; math.factorial(20)'

        codecage run --file analysis.py --timeout 5 --memory-mb 256 --json

        echo 'print("hi")' | codecage run -

        codecage run --mcp-host claude-code --file agent.py  # calls MCP tools

        codecage run --in sales.csv --out results/ --file chart.py

        codecage run --allow-host api.github.com --file fetch.py  # may reach it
    """
    configure_logging(verbose)
    try:
        text, filename = read_code(program.source, program.code, program.file)
        settings = load_config(config_file)
        workspace_mb = limits.workspace_mb or settings.limits.workspace_mb
        uploads = _uploads(files, workspace_mb)
        host_servers, host_reports = _host_servers(tools, files.workspace, settings)
        toolset = _connect(tools, settings, host_servers, quiet=as_json)
        groups = (policy, network, audit, output)
        sandbox = _single_run_sandbox(settings, toolset, *groups, replace_imports)
        job = _Job(text, filename, limits.overrides(), strict, uploads, workspace_mb)
        result, streamed = _execute(sandbox, toolset, job, files, as_json=as_json, raw=raw)
    except CodecageError as exc:
        fail(exc, as_json=as_json, verbose=verbose)
    _report(result, host_reports, files, as_json=as_json, raw=raw, streamed=streamed)


@dataclass(frozen=True, slots=True)
class _Job:
    """What `run` asks of its sandbox's one run."""

    code: str
    filename: str
    limits: dict[str, Any]
    strict: bool
    uploads: dict[str, bytes] | None
    workspace_mb: int  # in force: the flag's, else the config file's


def _uploads(files: WorkspaceFlags, workspace_mb: int) -> dict[str, bytes] | None:
    """The --in files, within the workspace's size.

    Raises:
        ConfigError: --in with --workspace, or a file unreadable or too large.
    """
    if files.inputs and files.workspace is not None:
        raise ConfigError(
            "--in and --workspace were both given",
            hint="copy the files into the --workspace directory, or drop --workspace",
        )
    return read_inputs(files.inputs, workspace_mb * 2**20)


def _host_servers(
    tools: ToolFlags, workspace: Path | None, settings: Settings
) -> tuple[dict[str, Upstream] | None, list[HostServers]]:
    """The --mcp-host servers, once the workspace and every MCP config file are checked.

    Raises:
        ConfigError: the workspace is refused, or holds a file naming commands to start.
    """
    # Before any upstream server starts: code in the workspace may have written there.
    config.check_workspace(settings, workspace)
    refuse_mcp_config_in(workspace, tools.mcp_config)
    host_servers, host_reports = servers_of_hosts(tools.mcp_host, tools.mcp_config)
    for report in host_reports:
        for host_file in report.files:
            refuse_mcp_config_in(workspace, host_file)
    return host_servers, host_reports


def _connect(
    tools: ToolFlags,
    settings: Settings,
    host_servers: dict[str, Upstream] | None,
    *,
    quiet: bool,
) -> ToolSetup:
    """The upstream tools, connected under a spinner when there are any (none with --json)."""
    upstream = bool(tools.mcp_config or host_servers or settings.mcp_servers)
    with progress("connecting to the upstream MCP servers", enabled=upstream and not quiet):
        return tool_setup_of(tools, settings, host_servers)


def _single_run_sandbox(
    settings: Settings,
    tools: ToolSetup,
    policy: SandboxFlags,
    network: NetworkFlags,
    audit: AuditFlags,
    output: OutputFlags,
    replace_imports: bool,
) -> Sandbox:
    """`run`'s Sandbox (not started): for one run, so without a warm pool (the config's
    [pool] would start several for nothing and make this process wait to tear them down)
    or a fork server (its template would cost a sandbox's start before the fork)."""
    options = options_of(
        settings,
        tools,
        policy,
        network,
        audit,
        output,
        pool=False,
        fork_server=False,
        replace_imports=replace_imports,
    )
    return Sandbox(options=options)


def _execute(
    sandbox: Sandbox,
    tools: ToolSetup,
    job: _Job,
    files: WorkspaceFlags,
    *,
    as_json: bool,
    raw: bool,
) -> tuple[ExecutionResult, bool]:
    """Start the sandbox, run the job in it, stop it; the result, and whether its output
    was printed as it came (human mode), not only at the end (--json)."""
    spinner = progress("starting the sandbox", enabled=not as_json)
    sandbox.approver = prompt = TerminalPrompt(sys.stdin, sys.stderr)  # [approval]
    prompt.before_prompt = spinner.stop
    live = None if as_json else LiveOutput(raw=raw, before_first=spinner.stop)
    with contextlib.closing(tools), sandbox, spinner:
        result = sandbox.run(
            job.code,
            limits=job.limits,
            filename=job.filename,
            workspace=files.workspace,
            strict=job.strict,
            files=job.uploads,
            # --out keeps all the workspace can hold; without it, nothing is kept.
            keep_files_mb=min(job.workspace_mb, 4096) if files.out is not None else 0,
            on_output=live,
        )
    return result, live is not None


def _report(
    result: ExecutionResult,
    host_reports: list[HostServers],
    files: WorkspaceFlags,
    *,
    as_json: bool,
    raw: bool,
    streamed: bool,
) -> NoReturn:
    """Save the --out files, print the result and exit: 0 when it succeeded and was saved."""
    saved_ok = files.out is None or _save_outputs(
        result, files.out, overwrite=files.overwrite, quiet=as_json
    )
    extra = {"mcp_hosts": [report.as_json() for report in host_reports]} if host_reports else {}
    show_run(
        result,
        as_json=as_json,
        raw=raw,
        streamed=streamed,
        saved=files.out is not None,
        extra=extra,
    )
    raise typer.Exit(exit_code(result, saved_ok=saved_ok))


def show_run(
    result: ExecutionResult,
    *,
    as_json: bool,
    raw: bool,
    streamed: bool,
    saved: bool = False,
    extra: dict[str, Any] | None = None,
    screen: Screen | None = None,
) -> None:
    """What `run` prints for a result: with --json, its one JSON object (with `extra`
    beside the result's fields: which servers --mcp-host found); else the person's view.
    The run handed to the local server prints through this too (cli/handoff_endpoint.py)."""
    if as_json:
        print_json({**result.model_dump(mode="json"), **(extra or {})}, screen)
    else:
        render_result(result, raw=raw, streamed=streamed, saved=saved, screen=screen)


def exit_code(result: ExecutionResult, *, saved_ok: bool = True) -> int:
    """`run`'s exit code: 0 when the code succeeded (and --out's files were saved), else 1."""
    return 0 if result.ok and saved_ok else 1


def write_outputs(result: ExecutionResult, directory: Path, *, overwrite: bool) -> list[Path]:
    """Everything `--out DIR` writes for a result: the files it left in /workspace, then
    its display outputs (figure-1.png, display-2.html, ...). Returns the paths written.

    Raises:
        ConfigError: a file exists (without --overwrite) or something is in the way.
    """
    written = result.save_files(directory, overwrite=overwrite, partial=True)
    if result.displays:
        written += displays.save(result.displays, directory)
    return written


def _save_outputs(
    result: ExecutionResult, directory: Path, *, overwrite: bool, quiet: bool
) -> bool:
    """Write the outputs to `directory`, one line per file on stderr (none with --json);
    a failure is reported on stderr without hiding the run's result. False when it failed."""
    try:
        written = write_outputs(result, directory, overwrite=overwrite)
    except CodecageError as exc:
        stderr.print(f"[red]Error:[/red] {escape(str(exc))}", markup=True)
        stderr.print(f"Hint: {exc.hint_for('cli')}", markup=False)
        return False
    if not quiet:
        for path in written:
            stderr.print(f"saved {neutralise_line(str(path))}", markup=False)
    return True


def validate(
    source: SourceArg = None,
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
    mcp_config: McpConfigOpt = None,
    servers_dir: ServersDirOpt = None,
    skills_dir: SkillsDirOpt = None,
    as_json: JsonOpt = False,
    verbose: VerboseOpt = False,
) -> None:
    """Check code without running it: syntax, imports outside the profile, security findings.

    Exit 0 when the code would run under the profile, 1 when it would be refused. The
    rule for imports is the one the sandbox applies; `servers.*` and `skills.*` import
    when their directories are given, as for `run`.

    Examples:

        codecage validate --code 'import os; os.system("ls")'

        codecage validate --file job.py --profile filesystem --json
    """
    configure_logging(verbose)
    try:
        text, _ = read_code(source, code, file)
        settings = load_config(config_file)
        upstream = bool(mcp_config or settings.mcp_servers)
        with progress("connecting to the upstream MCP servers", enabled=upstream and not as_json):
            tools = tool_setup(mcp_config, servers_dir, skills_dir, None, False, settings)
        with contextlib.closing(tools):
            options = host_options(
                settings, tools, profile=profile, allow_import=allow_import, pool=False
            )
            sandbox = Sandbox(options=options)
            with sandbox:
                report = sandbox.validate(text, strict=strict)
    except CodecageError as exc:
        fail(exc, as_json=as_json, verbose=verbose)
    show(report, render_validation, as_json=as_json)
    raise typer.Exit(0 if report.valid else 1)
