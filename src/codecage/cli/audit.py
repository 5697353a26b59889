"""`codecage audit list | show | export | stats | erase`: the operator's view of the audit
trail (docs/audit.md)."""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, TextIO

import typer
from rich.console import Console
from rich.markup import escape

from codecage.audit import AuditStore, Erasure, Query, journal, open_store, views
from codecage.audit.record import AuditRecord
from codecage.audit.store import default_location
from codecage.cli.logs import configure_logging
from codecage.cli.options import ConfigOpt, JsonOpt, VerboseOpt
from codecage.cli.render import fail, print_json, show, stderr
from codecage.cli.setup import load_config
from codecage.errors import CodecageError, ConfigError
from codecage.output import neutralise_line

log = logging.getLogger(__name__)

app = typer.Typer(
    help="The audit trail: one record per execution (who asked, the code's hash, the policy, "
    "status, usage, events, tool calls, files). `codecage serve` keeps one by default; "
    "`run --audit` and Sandbox(options=Options(audit=...)) on request. See docs/audit.md.",
    short_help="The audit trail (the operator's): list, show, export, stats, erase, web.",
    no_args_is_help=True,
)

StoreOpt = Annotated[
    str | None,
    typer.Option(
        "--store",
        metavar="PATH|URL",
        help="The audit store: a SQLite file or a postgresql:// URL (default: CODECAGE_AUDIT, "
        "else the config's \\[audit] store, else audit.db in codecage's state directory).",
        show_default=False,
    ),
]
StatusOpt = Annotated[
    str | None, typer.Option("--status", help="Only runs of this status (ok, error, timeout...).")
]
ClientOpt = Annotated[
    str | None, typer.Option("--client", help="Only runs of this caller (its name).")
]
SinceOpt = Annotated[
    str | None,
    typer.Option(
        "--since", metavar="WHEN", help="Only runs since: 2026-11-01, 2026-11-01T12:00, 12h, 7d."
    ),
]
EventOpt = Annotated[
    str | None,
    typer.Option("--event", metavar="KIND", help="Only runs with an event of this kind."),
]


@app.command("list")
def audit_list(
    status: StatusOpt = None,
    client: ClientOpt = None,
    since: SinceOpt = None,
    event: EventOpt = None,
    limit: Annotated[int, typer.Option("--limit", min=1, help="The newest this many.")] = 50,
    store: StoreOpt = None,
    config_file: ConfigOpt = None,
    as_json: JsonOpt = False,
    verbose: VerboseOpt = False,
) -> None:
    """The newest runs on record, newest first.

    Examples:

        codecage audit list --status error --since 1d

        codecage audit list --event network_denied --json
    """
    with _reading(store, config_file, as_json, verbose) as trail:
        query = _query(status, client, since, event, limit)
        records = trail.query(query)
        if as_json:
            print_json({"executions": [_summary(r) for r in records]})
            return
        _print_table(records)


@app.command("show")
def audit_show(
    execution: Annotated[
        str, typer.Argument(help="An execution id, or its first 8+ characters.", metavar="ID")
    ],
    store: StoreOpt = None,
    config_file: ConfigOpt = None,
    as_json: JsonOpt = False,
    verbose: VerboseOpt = False,
) -> None:
    """One run's whole record.

    Example:

        codecage audit show 3f2a9c1d
    """
    with _reading(store, config_file, as_json, verbose) as trail:
        record = trail.get(views.resolve_id(trail, execution))
        if record is None:  # erased between the two reads
            raise ConfigError(f"no execution {execution!r} in the audit store")
        show(record, _print_record, as_json=as_json)


@app.command("export")
def audit_export(
    format_: Annotated[
        str,
        typer.Option(
            "--format", metavar="jsonl|csv", help="jsonl: whole records; csv: one line each."
        ),
    ] = "jsonl",
    out: Annotated[
        Path | None,
        typer.Option("--out", help="Write to this file (default: stdout).", dir_okay=False),
    ] = None,
    status: StatusOpt = None,
    client: ClientOpt = None,
    since: SinceOpt = None,
    event: EventOpt = None,
    limit: Annotated[
        int | None, typer.Option("--limit", min=1, help="The newest this many (default: all).")
    ] = None,
    store: StoreOpt = None,
    config_file: ConfigOpt = None,
    verbose: VerboseOpt = False,
) -> None:
    """Records for a SIEM or a spreadsheet, oldest first, one at a time (a store of any size).

    Examples:

        codecage audit export --format jsonl --since 1d | vector --config siem.toml

        codecage audit export --format csv --out runs.csv
    """
    with _reading(store, config_file, False, verbose) as trail:
        if format_ not in ("jsonl", "csv"):
            raise ConfigError(f"--format {format_} is not known", hint="use --format jsonl or csv")
        query = _query(status, client, since, event, limit)
        with _output(out) as sink:
            count = _export(trail, query, format_, sink)
        stderr.print(f"exported {count} record{'s' if count != 1 else ''}", markup=False)


@app.command("stats")
def audit_stats(
    since: Annotated[
        str | None,
        typer.Option(
            "--since", metavar="WHEN", help="The window: 12h, 7d, 2026-11-01 (default 7d)."
        ),
    ] = "7d",
    store: StoreOpt = None,
    config_file: ConfigOpt = None,
    as_json: JsonOpt = False,
    verbose: VerboseOpt = False,
) -> None:
    """Runs by status, profile and backend, wall-time p50/p95, denials by kind, the busiest
    clients and tools.

    Example:

        codecage audit stats --since 1d
    """
    with _reading(store, config_file, as_json, verbose) as trail:
        report = views.stats(trail, views.parse_when(since) if since else None)
        show(report, _print_stats, as_json=as_json)


@app.command("erase")
def audit_erase(
    execution: Annotated[
        str | None, typer.Option("--execution", metavar="ID", help="This execution's record.")
    ] = None,
    client: Annotated[
        str | None, typer.Option("--client", help="Every record of this caller (and its alerts).")
    ] = None,
    before: Annotated[
        str | None, typer.Option("--before", metavar="WHEN", help="Every record before this time.")
    ] = None,
    yes: Annotated[bool, typer.Option("--yes", help="Do not ask for confirmation.")] = False,
    store: StoreOpt = None,
    config_file: ConfigOpt = None,
    as_json: JsonOpt = False,
    verbose: VerboseOpt = False,
) -> None:
    """Erase records (a right-to-erasure request, or housekeeping), then compact the store so
    that what was erased is gone from its files, not only unlinked. The options given must
    all match.

    Examples:

        codecage audit erase --client alice --yes

        codecage audit erase --before 2026-01-01
    """
    with _reading(store, config_file, as_json, verbose) as trail:
        if execution is None and client is None and before is None:
            raise ConfigError(
                "erase needs what to erase",
                hint="pass --execution ID, --client NAME or --before DATE",
            )
        erasure = Erasure(
            execution_id=views.resolve_id(trail, execution) if execution else None,
            caller=client,
            before=views.parse_when(before) if before else None,
        )
        _confirm(erasure, yes)
        erased = trail.erase(erasure)
        if as_json:
            print_json({"erased": erased, "store": trail.location})
            return
        print(f"erased {erased} record{'s' if erased != 1 else ''}; {trail.location} compacted")


WebHostOpt = Annotated[
    str, typer.Option("--host", help="Address to bind; not loopback: needs a given token.")
]
WebPortOpt = Annotated[int, typer.Option("--port", min=1, max=65535, help="Port to bind.")]
WebTokenOpt = Annotated[
    str | None,
    typer.Option(
        "--token",
        help="The token every request must carry (HTTP Basic's password, Bearer, or "
        "?token= once in a browser; docs/audit.md names its environment variable). "
        "Default: a fresh random one, printed at start.",
        envvar="CODECAGE_AUDIT_WEB_TOKEN",
        show_envvar=False,  # its name would not fit the 80-column help's cell
        show_default=False,
    ),
]
WebTokenEnvOpt = Annotated[
    str | None,
    typer.Option(
        "--token-env",
        metavar="VAR",
        help="The environment variable holding the token (instead of --token).",
    ),
]
WebNoTokenOpt = Annotated[
    bool,
    typer.Option(
        "--insecure-no-token",
        help="Loopback without a token. INSECURE: every local user of this machine can "
        "then read the whole audit trail.",
    ),
]


@app.command("web")
def audit_web(
    store: StoreOpt = None,
    host: WebHostOpt = "127.0.0.1",
    port: WebPortOpt = 8001,
    token: WebTokenOpt = None,
    token_env: WebTokenEnvOpt = None,
    insecure_no_token: WebNoTokenOpt = False,
    config_file: ConfigOpt = None,
    verbose: VerboseOpt = False,
) -> None:
    """A read-only web view of a SQLite audit store (Datasette): recent runs, failures,
    denials, tool calls, and a chart of runs and failures per hour. Works offline. Every
    request needs a token, on loopback too.

    Examples:

        codecage audit web              # prints its URL, with a fresh token

        WEB_TOKEN=... codecage audit web --host 0.0.0.0 --token-env WEB_TOKEN
    """
    configure_logging(verbose)
    try:
        from codecage.audit import web  # here, with uvicorn below: only this command serves

        given = _token(token_env) if token_env is not None else (token or "").strip() or None
        made = given is None and not insecure_no_token and web.is_loopback(host)
        secret = web.new_token() if made else given
        web.check_bind(host, secret, insecure_no_token=insecure_no_token)
        location = _location(store, config_file)
        if location.startswith(("postgresql://", "postgres://")):
            raise ConfigError(
                "the web view reads a SQLite store",
                hint="point Grafana or Metabase at the PostgreSQL tables (docs/audit.md)",
            )
        asgi = web.app(Path(location), secret, loopback=web.is_loopback(host))
    except CodecageError as exc:
        fail(exc, as_json=False, verbose=verbose)
    _announce(host, port, secret, made=made)
    import uvicorn  # here: its import (~40 ms) would otherwise delay every `codecage run`

    uvicorn.run(asgi, host=host, port=port, log_level="warning")


def _announce(host: str, port: int, secret: str | None, *, made: bool) -> None:
    """Where the web view listens, on stderr, with its token when codecage made it."""
    url = f"http://{host}:{port}/"
    if secret is None:
        log.warning("audit.web_without_token", extra={"host": host})
        stderr.print(f"codecage audit web on {url} (read-only, NO TOKEN)", markup=False)
    elif made:  # only the operator's terminal sees it; a given token is never printed
        stderr.print(f"codecage audit web on {url}?token={secret} (read-only)", markup=False)
    else:
        stderr.print(f"codecage audit web on {url} (read-only; token required)", markup=False)


def _token(variable: str) -> str:
    value = os.environ.get(variable, "")
    if not value.strip():
        raise ConfigError(
            f"--token-env {variable}: the variable is unset or empty",
            hint=f"export {variable}=<a long random token> first",
        )
    return value.strip()


# --- helpers -----------------------------------------------------------------------------


@contextlib.contextmanager
def _reading(
    store: str | None, config_file: Path | None, as_json: bool, verbose: bool
) -> Iterator[AuditStore]:
    """The store the options name, with dead processes' journals put into it first; every
    CodecageError becomes the CLI's error exit."""
    configure_logging(verbose)
    try:
        opened = _open(store, config_file)
        try:
            journal.recover(opened, journal.directory_for(opened.location))
            yield opened
        finally:
            opened.close()
    except CodecageError as exc:
        fail(exc, as_json=as_json, verbose=verbose)


def _open(store: str | None, config_file: Path | None) -> AuditStore:
    return open_store(_location(store, config_file))


def _location(store: str | None, config_file: Path | None) -> str:
    """--store, else the config's (CODECAGE_AUDIT included), else the default; a SQLite
    path must exist (reading never makes an empty store)."""
    settings = load_config(config_file)
    location = store or settings.audit.store or str(default_location())
    if not location.startswith(("postgresql://", "postgres://")):
        path = Path(location).expanduser()
        if not path.exists():
            raise ConfigError(
                f"there is no audit store at {path}",
                hint="pass --store PATH|URL (`codecage serve` keeps one at "
                f"{default_location()} unless its config says otherwise)",
            )
        location = str(path.resolve())
    return location


def _query(
    status: str | None, client: str | None, since: str | None, event: str | None, limit: int | None
) -> Query:
    return Query(
        status=status,
        caller=client,
        since=views.parse_when(since) if since else None,
        event_kind=event,
        limit=limit,
    )


@contextlib.contextmanager
def _output(out: Path | None) -> Iterator[TextIO]:
    if out is None:
        yield sys.stdout
        return
    try:
        with out.open("w", encoding="utf-8", newline="") as sink:
            yield sink
    except OSError as exc:
        raise ConfigError(f"--out {out}: {exc.strerror or exc}") from exc


def _export(store: AuditStore, query: Query, format_: str, sink: TextIO) -> int:
    if format_ == "csv":
        sink.write(views.csv_header())
    count = 0
    for record in views.matching(store, query):
        sink.write(views.csv_row(record) if format_ == "csv" else views.jsonl_row(record))
        count += 1
    sink.flush()
    return count


def _confirm(erasure: Erasure, yes: bool) -> None:
    if yes:
        return
    what = ", ".join(
        f"{name} {value}"
        for name, value in (
            ("execution", erasure.execution_id),
            ("client", erasure.caller),
            ("before", erasure.before.isoformat() if erasure.before else None),
        )
        if value
    )
    if not (sys.stdin.isatty() and sys.stderr.isatty()):
        raise ConfigError(
            f"erasing ({what}) needs confirmation and there is no terminal to ask on",
            hint="pass --yes to erase without asking",
        )
    if not typer.confirm(f"Erase every record matching {what}?", err=True):
        raise typer.Exit(1)


def _summary(record: AuditRecord) -> dict[str, object]:
    return {
        "execution_id": record.execution_id,
        "started_at": record.started_at.isoformat(),
        "caller": _caller(record),
        "face": record.face,
        "backend": record.backend,
        "profile": record.profile,
        "status": record.status,
        "wall_ms": record.wall_ms,
        "events": _event_counts(record),
        "tool_calls": len(record.tool_calls),
        "files": len(record.files),
    }


def _caller(record: AuditRecord) -> str:
    who = "/".join(p for p in (record.caller_name, record.caller_version) if p)
    return f"{record.caller_kind}:{who}" if who else record.caller_kind


def _event_counts(record: AuditRecord) -> dict[str, int]:
    counts: dict[str, int] = {}
    for event in record.events:
        counts[event.kind] = counts.get(event.kind, 0) + 1
    return counts


_STATUS_STYLE = {"ok": "green", "blocked": "yellow"}


def _print_table(records: list[AuditRecord]) -> None:
    console = Console(highlight=False)
    if not records:
        console.print("no runs on record match", markup=False)
        return
    from rich.table import Table  # here, as uvicorn above: only this command draws tables

    table = Table(box=None, pad_edge=False)
    for column in ("started (UTC)", "id", "caller", "status", "wall", "events"):
        table.add_column(column, no_wrap=column != "events")
    for record in records:
        style = _STATUS_STYLE.get(record.status, "red")
        events = ", ".join(f"{k} x{n}" if n > 1 else k for k, n in _event_counts(record).items())
        table.add_row(
            record.started_at.astimezone(datetime.UTC).strftime("%Y-%m-%d %H:%M:%S"),
            record.execution_id[:12],
            escape(neutralise_line(_caller(record))),
            f"[{style}]{record.status}[/{style}]",
            f"{record.wall_ms} ms",
            escape(events),
        )
    console.print(table)


def _print_record(record: AuditRecord) -> None:
    console = Console(highlight=False)
    line = neutralise_line
    rows = [
        ("execution", record.execution_id),
        ("started", record.started_at.isoformat()),
        ("finished", record.finished_at.isoformat()),
        ("caller", _caller(record)),
        ("face", record.face),
        ("session", record.session_id or "-"),
        ("backend", record.backend),
        ("profile", record.profile or "none"),
        ("status", record.status),
        (
            "exit",
            f"code {record.exit_code}" if record.signal is None else f"signal {record.signal}",
        ),
        ("error", record.error_type or "-"),
        (
            "usage",
            f"wall {record.wall_ms} ms, cpu {record.cpu_ms} ms, "
            f"peak {record.peak_memory_mb} MB, wrote {record.bytes_written} bytes",
        ),
        ("code", f"sha256 {record.code_sha256}, {record.code_bytes} bytes"),
        ("redactions", ", ".join(f"{k} {n}" for k, n in record.redactions.items()) or "-"),
        ("left out", ", ".join(f"{k} {n}" for k, n in record.omitted.items()) or "-"),
    ]
    for name, value in rows:
        console.print(f"[bold]{name:<11}[/bold]{escape(line(str(value)))}")
    for event in record.events:
        claim = "" if event.source == "host" else f" ({event.source or 'origin unknown'})"
        console.print(
            f"  event      {escape(line(event.kind))}{claim}: {escape(line(event.detail))}"
        )
    for call in record.tool_calls:
        console.print(
            f"  tool call  {escape(line(call.server))}.{escape(line(call.tool))} "
            f"{escape(call.status)} {call.duration_ms} ms"
        )
    for file in record.files:
        console.print(
            f"  file       {escape(line(file.path))} {file.size} bytes {file.sha256 or ''}"
        )
    if record.code is not None:
        console.print("[bold]code[/bold]" + (" (cut)" if record.code_truncated else ""))
        for text in record.code.splitlines():
            console.print("  " + escape(line(text)), markup=True)


def _print_stats(report: views.Stats) -> None:
    console = Console(highlight=False)
    window = f"since {report.since:%Y-%m-%d %H:%M} UTC" if report.since else "all time"
    console.print(f"[bold]{report.runs} runs[/bold] {window}")

    def counts(title: str, data: dict[str, int]) -> None:
        shown = ", ".join(f"{escape(line(k))} {n}" for k, n in data.items()) or "-"
        console.print(f"{title:<12}{shown}")

    line = neutralise_line
    counts("status", report.by_status)
    counts("profile", report.by_profile)
    counts("backend", report.by_backend)
    wall = report.wall
    console.print(f"{'wall':<12}p50 {wall.p50_ms} ms, p95 {wall.p95_ms} ms")
    counts("denials", report.denials)
    counts("claims", report.guest_claims)  # the guest's word: forgeable, never a denial
    clients = {f"{c.client or '-'} ({c.failures} failed)": c.runs for c in report.top_clients}
    counts("clients", clients)
    counts("tools", {f"{t.tool} ({t.errors} errors)": t.calls for t in report.tool_calls})
