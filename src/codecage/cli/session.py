"""`codecage session open | run | list | close | stop-server`: runs that share one Python
interpreter, held by a server (a CLI process lives for one command; the session must outlive
it): the one --server names, else the user's own local server (local.py), started on demand.
Each command is one MCP tool call (remote.py): open_session, execute_code with its
session_id, list_sessions, close_session."""

from __future__ import annotations

import base64
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.markup import escape

from codecage.cli.groups import FlagGroup, takes_groups
from codecage.cli.logs import configure_logging
from codecage.cli.options import AllowImportOpt, CodeFlags, ServerFlags, VerboseOpt
from codecage.cli.render import fail, print_json, stderr
from codecage.cli.setup import allowed_hosts, read_code, read_inputs
from codecage.errors import CodecageError
from codecage.output import neutralise_line, neutralise_text

if TYPE_CHECKING:  # remote.py loads the MCP SDK: only when a command runs
    from codecage.cli.remote import Reply

_MAX_UPLOAD_BYTES = 32 * 2**20
"""What --in may send in all (mcp/files.py MAX_UPLOAD_BYTES, the server's bound: it
refuses more with its own message)."""

app = typer.Typer(
    help="Sessions: runs that share one Python interpreter, so what one run defines "
    "(variables, imports, files in /workspace) is there for the next. A server holds "
    "them: your own local one, started on demand on a private Unix socket and ended after "
    "sessions.local_idle_exit seconds (config key, 600) with no session open; or a running "
    "`codecage serve --http` given with --server and --token. "
    "A session closes after --ttl seconds unused, with `codecage session close`, or when "
    "a run kills its interpreter.\n\n"
    "Example:\n\n"
    "    ID=$(codecage session open)\n\n"
    "    codecage session run $ID --code 'import pandas as pd; df = pd.read_csv(\"sales.csv\")' "
    "--in sales.csv\n\n"
    "    codecage session run $ID --code 'df.describe()'\n\n"
    "    codecage session close $ID",
    short_help="Runs that share state, kept between commands: open, run, list, close.",
    no_args_is_help=True,
)

SessionIdArg = Annotated[
    str,
    typer.Argument(
        help="The id `codecage session open` printed.", metavar="ID", show_default=False
    ),
]


@dataclass(frozen=True, slots=True)
class SessionFlags(FlagGroup):
    """What `session open` asks of the session: its imports, memory, life and network,
    within the server's bounds (None: the server's default)."""

    profile: Annotated[
        str | None,
        typer.Option(
            "--profile",
            help="Import profile(s) of every run in the session, comma-separated: standard, "
            "basic, data_science, filesystem, ... (default: the server's).",
            show_default=False,
        ),
    ] = None
    allow_import: AllowImportOpt = None
    memory_mb: Annotated[
        int | None,
        typer.Option(
            "--memory-mb",
            help="Memory of the whole session in MiB, 32 or more (default: the server's).",
            callback=lambda value: _within("--memory-mb", value, 32, None),
            show_default=False,
        ),
    ] = None
    ttl: Annotated[
        float | None,
        typer.Option(
            "--ttl",
            help="Close the session after this many seconds unused, 1 to 86400 (default: "
            "the server's).",
            callback=lambda value: _within("--ttl", value, 1, 86_400),
            show_default=False,
        ),
    ] = None
    allow_host: Annotated[
        list[str] | None,
        typer.Option(
            "--allow-host",
            metavar="HOST[:PORT]",
            help="A host every run of the session may reach through the server's egress "
            "proxy (repeat, or separate with commas), within what the server permits "
            "(its [network] ceiling). (default: the server's own hosts)",
            show_default=False,
        ),
    ] = None

    def arguments(self) -> dict[str, Any]:
        """open_session's arguments (None: left out)."""
        return {
            "profile": self.profile,
            "allowed_imports": _modules(self.allow_import),
            "memory_limit_mb": self.memory_mb,
            "idle_ttl_seconds": self.ttl,
            "allow_hosts": allowed_hosts(self.allow_host) or None,
        }


RunTimeoutOpt = Annotated[
    float | None,
    typer.Option(
        "--timeout",
        help="Wall-clock limit of this run in seconds (default: the server's; it sets "
        "the most a run may ask for).",
        callback=lambda value: _within("--timeout", value, 0, None, open_low=True),
        show_default=False,
    ),
]
SessionInOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--in",
        metavar="FILE[:NAME]",
        help="Put this host file in the session's /workspace as NAME (default: its "
        "basename) before the code runs; repeatable; 32 MiB in all. It stays there for "
        "later runs.",
        show_default=False,
    ),
]


@app.command("open")
@takes_groups
def session_open(
    *,
    session: SessionFlags,
    server: ServerFlags,
) -> None:
    """Open a session and print its id (alone on stdout, for `ID=$(...)`).

    Examples:

        ID=$(codecage session open --profile data_science --memory-mb 1024)

        codecage session open --ttl 3600 --json

        codecage session open --allow-host api.github.com   # its runs may reach it
    """
    configure_logging(server.verbose)
    reply = _call(server, "open_session", session.arguments())
    data = reply.data
    if server.as_json:
        print_json(data)
        return
    sys.stdout.write(f"{data['session_id']}\n")
    stderr.print(
        f"session {data['session_id']} is open: profile {data['profile']}, "
        f"{data['memory_limit_mb']} MiB, closes after {data['idle_ttl_seconds']:g} s unused. "
        f"Run code in it: codecage session run {data['session_id']} --code '...'",
        markup=False,
    )


@app.command("run")
@takes_groups
def session_run(
    *,
    session_id: SessionIdArg,
    program: CodeFlags,
    timeout: RunTimeoutOpt = None,
    inputs: SessionInOpt = None,
    server: ServerFlags,
) -> None:
    """Run Python code in a session: what earlier runs in it defined is there.

    Prints the reply as a model reads it (the program's output, then stderr, display
    outputs, the value of the last expression after →, the traceback) on stdout and a
    summary on stderr; --json prints the structured result with that text as "text".
    Exit 0 when the code succeeded, 1 when it did not (or the session is unknown or has
    ended), 2 on a usage error.

    Examples:

        codecage session run $ID --code 'x = 42'

        codecage session run $ID --code 'x + 1'        # → 43

        codecage session run $ID --file step2.py --in data.csv --timeout 60

        echo 'print(x)' | codecage session run $ID -
    """
    configure_logging(server.verbose)
    try:
        text, _ = read_code(program.source, program.code, program.file)
        uploads = read_inputs(inputs, _MAX_UPLOAD_BYTES)
    except CodecageError as exc:
        fail(exc, as_json=server.as_json, verbose=server.verbose)
    arguments: dict[str, Any] = {
        "code": text,
        "session_id": session_id,
        "timeout": timeout,
        "files": _encoded(uploads) if uploads else None,
    }
    reply = _call(server, "execute_code", arguments, wait_s=timeout)
    if server.as_json:
        print_json({**reply.data, "text": reply.text})
    else:
        _render_run(reply)
    raise typer.Exit(0 if reply.data.get("status") == "ok" else 1)


@app.command("list")
@takes_groups
def session_list(
    *,
    server: ServerFlags,
) -> None:
    """List your open sessions (those opened with the same --token): id, runs, seconds
    until each closes unless used, memory and profile.

    Example:

        codecage session list --json
    """
    configure_logging(server.verbose)
    reply = _call(server, "list_sessions", {})
    if server.as_json:
        print_json(reply.data)
        return
    sessions = reply.data.get("sessions", [])
    for entry in sessions:
        sys.stdout.write(
            f"{entry['session_id']}  {entry['runs']} runs  "
            f"closes in {entry['expires_in_seconds']:.0f} s unless used  "
            f"{entry['memory_limit_mb']} MiB  {entry['profile']}\n"
        )
    limit = reply.data.get("max_per_client")
    if not sessions:
        stderr.print("no open sessions; open one with `codecage session open`", markup=False)
    else:
        stderr.print(f"{len(sessions)} open (at most {limit})", markup=False)


@app.command("close")
@takes_groups
def session_close(
    *,
    session_id: SessionIdArg,
    server: ServerFlags,
) -> None:
    """Close a session, freeing its sandbox; its state is gone.

    Example:

        codecage session close $ID
    """
    configure_logging(server.verbose)
    reply = _call(server, "close_session", {"session_id": session_id})
    if server.as_json:
        print_json(reply.data)
    else:
        stderr.print(f"session {neutralise_line(session_id)} is closed", markup=False)


@app.command("start-server")
def session_start_server(verbose: VerboseOpt = False) -> None:
    """Start your local server now, if none runs (the other session commands start it
    when they need it). While it runs, `codecage run` hands its runs to it and takes a
    fraction of the time (docs/performance.md). It ends by itself after
    sessions.local_idle_exit seconds (config key, 600) with no open session and no request.

    Example:

        codecage session start-server
    """
    from codecage.cli.local import ensure  # the session commands' own: not at every start

    configure_logging(verbose)
    try:
        found = ensure()
    except CodecageError as exc:
        fail(exc, as_json=False, verbose=verbose)
    stderr.print(f"the local codecage server runs on {found.socket}", markup=False)


@app.command("stop-server")
def session_stop_server(verbose: VerboseOpt = False) -> None:
    """End your local server now (its open sessions with it); the next command starts a
    new one. It also ends by itself after sessions.local_idle_exit seconds (config key, 600) with no
    open session and no request.

    Example:

        codecage session stop-server
    """
    from codecage.cli.local import stop  # the session commands' own: not at every start

    configure_logging(verbose)
    try:
        stopped = stop()
    except CodecageError as exc:
        fail(exc, as_json=False, verbose=verbose)
    stderr.print(
        "the local codecage server has ended" if stopped else "no local codecage server runs",
        markup=False,
    )


def _call(
    server: ServerFlags,
    tool: str,
    arguments: dict[str, Any],
    *,
    wait_s: float | None = None,
) -> Reply:
    """One tool call, its arguments given (None: left out), to --server or (none given)
    the local server; a failure ends the command."""
    # Here: remote.py loads the MCP SDK, for the session commands only.
    from codecage.cli.local import ensure
    from codecage.cli.remote import LOCAL_URL, Server, Unreachable, call

    given = {name: value for name, value in arguments.items() if value is not None}
    try:
        if server.server is not None:
            target = Server(server.server, server.token or None)
            return call(target, tool, given, wait_s=wait_s)
        # The local server may be exiting as this command finds it (idle): it then refuses
        # before the tool runs, and the second attempt starts a new one.
        for attempt in range(2):
            found = ensure()
            target = Server(LOCAL_URL, found.token, found.socket)
            try:
                return call(target, tool, given, wait_s=wait_s)
            except Unreachable:
                if attempt:
                    raise
        raise AssertionError("unreachable")  # pragma: no cover
    except CodecageError as exc:
        fail(exc, as_json=server.as_json, verbose=server.verbose)


def _within(
    flag: str, value: float | None, low: float, high: float | None, *, open_low: bool = False
) -> float | None:
    """`value` when it lies within the bounds, checked here rather than by typer's min/max,
    whose "<float range> [1<=x<=86400]" would not fit the help's 80 columns."""
    if value is None:
        return None
    if value < low or (open_low and value == low) or (high is not None and value > high):
        bounds = f"more than {low:g}" if open_low else f"at least {low:g}"
        bounds += f" and at most {high:g}" if high is not None else ""
        raise typer.BadParameter(f"{flag} must be {bounds} (got {value:g})")
    return value


def _modules(allow_import: list[str] | None) -> list[str] | None:
    """--allow-import's modules: repeated, or separated with commas."""
    modules = [m.strip() for item in allow_import or [] for m in item.split(",") if m.strip()]
    return modules or None


def _encoded(uploads: dict[str, bytes]) -> dict[str, str]:
    """--in files as execute_code's `files`: UTF-8 text as it is, anything else (and text
    that would read as the "base64:" prefix) as base64."""
    encoded: dict[str, str] = {}
    for name, data in uploads.items():
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            text = None
        if text is None or text.startswith("base64:"):
            text = "base64:" + base64.b64encode(data).decode("ascii")
        encoded[name] = text
    return encoded


def _render_run(reply: Reply) -> None:
    """The reply's text up to its status line on stdout; a summary and the events on
    stderr, as `codecage run` ends."""
    body = _body(reply.text)
    if body:
        sys.stdout.write(neutralise_text(body if body.endswith("\n") else body + "\n"))
        sys.stdout.flush()
    data = reply.data
    for event in data.get("events", []):
        detail = escape(neutralise_line(str(event.get("detail", ""))))
        stderr.print(f"[yellow]! {escape(str(event.get('kind')))}[/yellow]: {detail}", markup=True)
    stderr.print(_summary(data), markup=True)


def _body(text: str) -> str:
    """The text before the status line the server writes after the program's output
    (`status: ok · 12 ms · session ...`): the last line that starts so, as what follows it
    (file names, notes) is indented or prefixed."""
    lines = text.split("\n")
    for index in range(len(lines) - 1, -1, -1):
        if lines[index].startswith("status: "):
            return "\n".join(lines[:index])
    return text


def _summary(data: dict[str, Any]) -> str:
    ok = data.get("status") == "ok"
    colour = "green" if ok else "red"
    usage = data.get("usage") or {}
    parts = [f"[{colour}]{escape(str(data.get('status')))}[/{colour}]"]
    parts.append(f"{usage.get('wall_ms')} ms wall")
    if usage.get("cpu_ms") is not None:
        parts.append(f"{usage['cpu_ms']} ms CPU")
    if usage.get("peak_memory_mb") is not None:
        parts.append(f"{usage['peak_memory_mb']:g} MiB peak")
    if data.get("exit_code") not in (None, 0):
        parts.append(f"exit {data['exit_code']}")
    if data.get("signal"):
        parts.append(escape(str(data["signal"])))
    if data.get("files_total"):
        parts.append(f"{data['files_total']} file(s) in /workspace")
    if data.get("displays"):
        parts.append(f"{len(data['displays'])} display output(s)")
    if data.get("redactions"):
        counts = ", ".join(f"{n} {category}" for category, n in data["redactions"].items())
        parts.append(f"redacted {escape(counts)}")
    parts.append(f"session {escape(str(data.get('session_id')))}")
    return "codecage: " + " · ".join(parts)
