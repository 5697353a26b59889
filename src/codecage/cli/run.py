"""`codecage run` and `codecage validate`: the commands that take code."""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.markup import escape

from codecage import config, displays
from codecage.cli.approval import TerminalPrompt
from codecage.cli.logs import configure_logging
from codecage.cli.options import (
    AllowHostOpt,
    AllowImportOpt,
    AllowToolOpt,
    AuditOpt,
    BackendOpt,
    ConfigOpt,
    CpuOpt,
    DegradedOpt,
    FileSizeOpt,
    JsonOpt,
    MaxToolCallsOpt,
    McpConfigOpt,
    McpHostOpt,
    MemoryOpt,
    NoScrubOpt,
    OpenFilesOpt,
    OutputOpt,
    ProcessesOpt,
    ProfileOpt,
    ScrubCategoriesOpt,
    ServersDirOpt,
    SkillsDirOpt,
    TimeoutOpt,
    TmpMbOpt,
    TokenizeOpt,
    VerboseOpt,
    WorkspaceMbOpt,
)
from codecage.cli.render import (
    LiveOutput,
    fail,
    print_json,
    progress,
    render_result,
    render_validation,
    show,
    stderr,
)
from codecage.cli.setup import (
    build_sandbox,
    load_config,
    read_code,
    read_inputs,
    refuse_mcp_config_in,
    scrub_option,
    servers_of_hosts,
    tool_setup,
)
from codecage.errors import CodecageError, ConfigError
from codecage.models import ExecutionResult
from codecage.output import neutralise_line


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
            "its files stay after the run. What the host would run from it (.git, .bashrc, "
            ".venv, *.pth, .vscode, ...) stays read-only (docs/security-model.md).",
            file_okay=False,
        ),
    ] = None,
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
    ] = None,
    out: Annotated[
        Path | None,
        typer.Option(
            "--out",
            help="After the run, write the files it left in /workspace into this directory "
            "(made when missing; links in it are never followed) and say where on stderr.",
            file_okay=False,
        ),
    ] = None,
    overwrite: Annotated[
        bool,
        typer.Option("--overwrite", help="With --out: replace files that exist there."),
    ] = False,
    as_json: JsonOpt = False,
    raw: Annotated[
        bool,
        typer.Option(
            "--raw",
            help="Print the program's output unescaped (control characters as written; "
            "invalid UTF-8 shows as \\x escapes).",
        ),
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
    allow_host: AllowHostOpt = None,
    audit: AuditOpt = None,
    max_tool_calls: MaxToolCallsOpt = None,
    tokenize: TokenizeOpt = False,
    no_scrub: NoScrubOpt = False,
    scrub_categories: ScrubCategoriesOpt = None,
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
        text, filename = read_code(source, code, file)
        settings = load_config(config_file)
        if inputs and workspace is not None:
            raise ConfigError(
                "--in and --workspace were both given",
                hint="copy the files into the --workspace directory, or drop --workspace",
            )
        workspace_mb_in_force = workspace_mb or settings.limits.workspace_mb
        uploads = read_inputs(inputs, workspace_mb_in_force * 2**20)
        # Before any upstream server starts: code in the workspace may have written there.
        config.check_workspace(settings, workspace)
        refuse_mcp_config_in(workspace, mcp_config)
        host_servers, host_reports = servers_of_hosts(mcp_host, mcp_config)
        for report in host_reports:
            for host_file in report.files:
                refuse_mcp_config_in(workspace, host_file)
        upstream = bool(mcp_config or host_servers or settings.mcp_servers)
        with progress("connecting to the upstream MCP servers", enabled=upstream and not as_json):
            tools = tool_setup(
                mcp_config,
                servers_dir,
                skills_dir,
                allow_tool,
                tokenize,
                settings,
                max_tool_calls=max_tool_calls,
                host_servers=host_servers,
            )
        sandbox = build_sandbox(
            settings,
            tools,
            profile=profile,
            allow_import=allow_import,
            backend=backend,
            allow_degraded=allow_degraded,
            replace_imports=replace_imports,
            import_policy=not no_import_policy,
            scrub=scrub_option(no_scrub, scrub_categories, settings),
            allow_host=allow_host,
            audit=audit,
            # One run, one sandbox: a warm pool (the config's [pool]) would start several
            # for nothing and make this process wait to tear them down; a fork server's
            # template would cost a sandbox's start before the fork.
            pool=False,
            fork_server=False,
        )
        spinner = progress("starting the sandbox", enabled=not as_json)
        sandbox.approver = prompt = TerminalPrompt(sys.stdin, sys.stderr)  # [approval]
        prompt.before_prompt = spinner.stop
        # Human mode prints the output as it comes; --json prints one object at the end.
        live = None if as_json else LiveOutput(raw=raw, before_first=spinner.stop)
        with contextlib.closing(tools), sandbox, spinner:
            result = sandbox.run(
                text,
                limits=overrides,
                filename=filename,
                workspace=workspace,
                strict=strict,
                files=uploads,
                # --out keeps all the workspace can hold; without it, nothing is kept.
                keep_files_mb=min(workspace_mb_in_force, 4096) if out is not None else 0,
                on_output=live,
            )
    except CodecageError as exc:
        fail(exc, as_json=as_json, verbose=verbose)
    saved_ok = out is None or _save_outputs(result, out, overwrite=overwrite, quiet=as_json)
    if as_json:
        data = result.model_dump(mode="json")
        if host_reports:  # which servers --mcp-host found, beside the result
            data["mcp_hosts"] = [report.as_json() for report in host_reports]
        print_json(data)
    else:
        render_result(result, raw=raw, streamed=live is not None, saved=out is not None)
    raise typer.Exit(0 if result.ok and saved_ok else 1)


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
            sandbox = build_sandbox(
                settings, tools, profile=profile, allow_import=allow_import, pool=False
            )
            with sandbox:
                report = sandbox.validate(text, strict=strict)
    except CodecageError as exc:
        fail(exc, as_json=as_json, verbose=verbose)
    show(report, render_validation, as_json=as_json)
    raise typer.Exit(0 if report.valid else 1)
