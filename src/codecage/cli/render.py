"""What the CLI shows a person: results, validation reports, host info, the doctor's
verdict, package changes and errors, on stdout/stderr; or exactly one JSON object."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn, TextIO, TypeVar

import typer
from pydantic import BaseModel
from rich.console import Console
from rich.markup import escape

from codecage import config, displays
from codecage import packages as added
from codecage.errors import CodecageError, ConfigError
from codecage.models import (
    AuditState,
    DisplayOutput,
    DoctorReport,
    ExecutionResult,
    ForkServerState,
    HostInfo,
    NetworkState,
    PoolConfig,
    PoolState,
    ScrubState,
    ToolsState,
    ValidationReport,
)
from codecage.output import neutralise_line, neutralise_text

stderr = Console(stderr=True, highlight=False, soft_wrap=True)

Report = TypeVar("Report", bound=BaseModel)


@dataclass(frozen=True, slots=True)
class Screen:
    """Where a run's output and result are printed: this process's stdout and stderr (the
    default), or, for a `codecage run` handed to the local server, streams that record
    what to write into the client's (cli/handoff_endpoint.py). The same functions print to
    both, so the two outputs cannot drift apart. `console` writes on `err`."""

    out: TextIO
    err: TextIO
    console: Console


def this_process() -> Screen:
    """This process's own screen (its streams as they are now: tests replace them)."""
    return Screen(sys.stdout, sys.stderr, stderr)


def print_json(data: dict[str, Any], screen: Screen | None = None) -> None:
    out = (screen or this_process()).out
    out.write(json.dumps(data, ensure_ascii=False) + "\n")
    out.flush()


def show(report: Report, render: Callable[[Report], None], *, as_json: bool) -> None:
    """A report as --json asks: its JSON alone on stdout, or `render`ed for a person."""
    if as_json:
        print_json(report.model_dump(mode="json"))
    else:
        render(report)


class LiveOutput:
    """The program's output printed as it comes (`Sandbox.run`'s `on_output`, called on the
    run's output thread): stdout to stdout, stderr to stderr, neutralised for a terminal as
    `render_result` shows it (or, `raw`, as the program wrote it). `before_first` runs once,
    before the first text: it stops the spinner, which would garble the lines."""

    def __init__(
        self, *, raw: bool, before_first: Callable[[], None], screen: Screen | None = None
    ) -> None:
        self._raw = raw
        self._before_first: Callable[[], None] | None = before_first
        self._screen = screen

    def __call__(self, stream: str, text: str) -> None:
        if self._before_first is not None:
            self._before_first()
            self._before_first = None
        screen = self._screen or this_process()
        target = screen.out if stream == "stdout" else screen.err
        if self._raw:
            # An invalid byte arrives as its \x escape: the text holds no surrogate.
            target.buffer.write(text.encode("utf-8"))
            target.buffer.flush()
        else:
            target.write(neutralise_text(text))
            target.flush()


def render_result(
    result: ExecutionResult,
    *,
    raw: bool,
    streamed: bool = False,
    saved: bool = False,
    screen: Screen | None = None,
) -> None:
    """The person's view of a result; `streamed`: its output was printed live already
    (`LiveOutput`), so it is not printed again; `saved`: its display outputs were written
    to files (--out), so no hint says how to save them."""
    screen = screen or this_process()
    stderr = screen.console
    if not streamed:
        _print_output(result, raw=raw, screen=screen)
    else:
        _print_tails(result, raw=raw, screen=screen)
    for display in result.displays:
        _print_display(display, screen)
    if result.displays and not saved and any(displays.image_bytes(d) for d in result.displays):
        stderr.print(
            "[dim]· figures are not shown in a terminal: `--out DIR` saves them "
            "(figure-1.png, ...)[/dim]",
            markup=True,
        )
    if result.error is not None and result.error.traceback:
        screen.err.write(result.error.traceback.rstrip("\n") + "\n")
    elif result.error is not None:
        screen.err.write(f"{result.error.type}: {result.error.message}\n")
    if result.return_value is not None and not _value_shown(result):
        shown = json.dumps(result.return_value, ensure_ascii=False)
        stderr.print(f"[bold]→[/bold] {neutralise_text(shown)[:2000]}", markup=True)
    for event in result.events:
        # The detail holds text the code chose (module and tool names): never markup, and
        # one line (Event neutralises it when made; again here, as a result can be built
        # without validation and this costs nothing).
        detail = escape(neutralise_line(event.detail))
        if event.kind == "tool_call" and (event.data or {}).get("status") == "ok":
            stderr.print(f"[dim]· tool {detail}[/dim]", markup=True)
        elif event.kind in ("network_allowed", "network_usage") and not (event.data or {}).get(
            "reason"
        ):
            stderr.print(f"[dim]· net {detail}[/dim]", markup=True)
        else:
            stderr.print(f"[yellow]! {event.kind}[/yellow]: {detail}", markup=True)
    stderr.print(_summary(result), markup=True)


_DISPLAY_LINES = 200  # of a display's text on a terminal (a DataFrame's repr is cut at 60 rows)


def _print_display(display: DisplayOutput, screen: Screen) -> None:
    """A display output as a person reads it: an image as one line (what it is, its size),
    text as its lines (a DataFrame as the table it is), neutralised: the code chose it."""
    stderr = screen.console
    text = displays.text_form(display)
    if text is None:
        stderr.print(f"[cyan]▣[/cyan] {escape(displays.describe(display))}", markup=True)
        return
    stderr.print(f"[cyan]▣[/cyan] {escape(displays.label(display))}:", markup=True)
    lines = neutralise_text(text).rstrip("\n").split("\n")
    shown = "\n".join(lines[:_DISPLAY_LINES])
    if len(lines) > _DISPLAY_LINES:
        shown += f"\n… ({len(lines) - _DISPLAY_LINES} more lines: `--out DIR` saves all of it)"
    screen.err.write(shown + "\n")
    screen.err.flush()


def _value_shown(result: ExecutionResult) -> bool:
    """Whether the return value is on screen already, as its last expression's display (a
    DataFrame's table): then its repr is not printed again."""
    return any(
        d.source == "last_expression" and displays.text_form(d) is not None for d in result.displays
    )


def _print_output(result: ExecutionResult, *, raw: bool, screen: Screen) -> None:
    if raw:
        screen.out.buffer.write(result.raw_stdout())
        screen.out.buffer.flush()
        screen.err.buffer.write(result.raw_stderr())
        screen.err.buffer.flush()
    else:
        screen.out.write(result.stdout)
        screen.out.flush()
        screen.err.write(result.stderr)


def _print_tails(result: ExecutionResult, *, raw: bool, screen: Screen) -> None:
    """After live output: what the result kept of a stream past its head (its cut marker
    and tail), which was not streamed."""
    for text, raw_bytes, target in (
        (result.stdout, result.raw_stdout(), screen.out),
        (result.stderr, result.raw_stderr(), screen.err),
    ):
        at = text.find("\n[... ")
        if at < 0 or " cut here" not in text[at:]:
            continue
        if raw:
            raw_at = raw_bytes.find(b"\n[... ")
            target.buffer.write(raw_bytes[raw_at + 1 :] if raw_at >= 0 else b"")
            target.buffer.flush()
        else:
            target.write(text[at + 1 :])
            target.flush()


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
    if result.displays:
        parts.append(f"{len(result.displays)} display output(s)")
    if result.redactions:
        counts = ", ".join(f"{n} {category}" for category, n in result.redactions.items())
        parts.append(f"redacted {counts}")
    return "codecage: " + " · ".join(parts)


def render_validation(report: ValidationReport) -> None:
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


def render_info(report: HostInfo) -> None:
    out = Console(highlight=False, soft_wrap=True)
    out.print(f"codecage {report.version} · backend [bold]{escape(report.backend)}[/bold]")
    origin = config.ORIGINS.get(report.config_origin, report.config_origin)
    found = f"{report.config_file} (from {origin})" if report.config_file else "none found"
    out.print(f"config file: {found}", markup=False)
    out.print(f"python in the sandbox: {report.python}", markup=False)
    for state in report.backend_states:
        label = "in force" if state.in_force else "available" if state.available else "unavailable"
        if state.degraded:
            label += ", degraded fallback (only by name or with --allow-degraded)"
        why = f": {state.why_not}" if state.why_not else ""
        out.print(f"   backend {state.name:<9} {label}{why}", markup=False)
    for layer in report.layers:
        mark = "[green]✓[/green]" if layer.active else "[red]✗[/red]"
        out.print(f" {mark} {escape(f'{layer.name:<11} {layer.mechanism} — {layer.detail}')}")
    out.print(
        "default limits (override per run; see `codecage run --help`), and their source:",
        markup=False,
    )
    for name, value in report.default_limits.model_dump().items():
        source = report.limit_sources.get(name, "default")
        out.print(f"   {name:<18} {value!s:<10} ({source})", markup=False)
    out.print(
        f"ceilings: memory_mb ≤ {report.ceilings.memory_mb}, timeout ≤ {report.ceilings.timeout:g}",
        markup=False,
    )
    out.print(
        f"import policy: {report.import_policy or 'off'} (profiles, choose with --profile):",
        markup=False,
    )
    for profile in report.profiles:
        missing = [name for name, ok in profile.packages_importable.items() if not ok]
        note = f" (not importable yet: {', '.join(missing)})" if missing else ""
        mark = "*" if profile.default else " "
        # Plain text ("the config's [network]") that rich would read as markup and drop.
        text = f"{profile.name:<13} {profile.description}{note}"
        out.print(f" {mark} {escape(text)}")
    if report.pool is not None:
        _render_pool(out, report.pool)
    if report.scrub is not None:
        _render_scrub(out, report.scrub)
    if report.tools is not None:
        _render_tools(out, report.tools)
    if report.sessions is not None:
        s = report.sessions
        out.print(
            f"sessions: {report.open_sessions} open; idle TTL {s.idle_ttl:g} s, lifetime "
            f"{s.lifetime:g} s, {s.cpu_seconds} CPU s each, at most {s.max_per_client} per "
            f"client and {s.max_total} in all ([sessions] in the config)",
            markup=False,
        )
    if report.network is not None:
        _render_network(out, report.network)
    if report.audit is not None:
        _render_audit(out, report.audit)
    if report.packages:
        listed = ", ".join(f"{p.name}=={p.version}" for p in report.packages if p.requested)
        extra = sum(1 for p in report.packages if not p.requested)
        out.print(f"added packages: {listed} (+{extra} dependencies)", markup=False)
    else:
        out.print("added packages: none (`codecage packages add NAME`)", markup=False)


def _render_audit(out: Console, audit: AuditState) -> None:
    if not audit.enabled:
        out.print("audit: off (--audit PATH, [audit]; `codecage serve` keeps one)", markup=False)
        return
    required = ", required" if audit.required else ""
    failing = f"; FAILING: {audit.failure}" if audit.failure else ""
    out.print(f"audit: every run on record in {audit.store}{required}{failing}", markup=False)


def _render_network(out: Console, network: NetworkState) -> None:
    def listed(rules: list[str]) -> str:
        return ", ".join(rules) or "none"

    if not (network.ceiling or any(network.profiles.values())):
        out.print("network: none (allow hosts with --allow-host or [network] allow)", markup=False)
        return
    out.print(f"network: every run may reach {listed(network.allow)}", markup=False)
    out.print(f"   granted by --allow-host   {listed(network.granted)}", markup=False)
    out.print(f"   a call may ask for        {listed(network.ceiling)}", markup=False)
    out.print(f"   denied                    {listed(network.deny)}", markup=False)
    for name, rules in network.profiles.items():
        out.print(f"   profile {name:<17} + {listed(rules)}", markup=False)


def _render_tools(out: Console, tools: ToolsState) -> None:
    def named(names: list[str]) -> str:
        caged = set(tools.sandboxed_servers)
        return ", ".join(f"{n} (sandboxed)" if n in caged else n for n in names)

    if tools.servers:
        servers = named(tools.servers)
    elif tools.configured_servers:
        where = "in the config file; run and serve start them"
        servers = f"{named(tools.configured_servers)} ({where})"
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
    fork = pool.fork_server
    if fork is not None:
        _render_fork_server(out, fork, pool.config)


def _render_fork_server(out: Console, fork: ForkServerState, config: PoolConfig) -> None:
    if not fork.enabled:
        out.print(f"fork server: off ({fork.why_not})", markup=False)
        return
    if config.enabled:
        warm = "the warm pool's sandboxes are forked"
    elif config.prefork:
        warm = (
            "prefork on: a library Sandbox() without a pool forks the next sandbox of a "
            "run's kind after the run, ahead of the next one (off: [pool] prefork = false, "
            "CODECAGE_PREFORK=0, or Sandbox(pool=False))"
        )
    else:
        warm = "each run forks its sandbox when it asks ([pool] prefork = false)"
    out.print(f"fork server: on; {warm}", markup=False)
    if fork.forked or fork.spares:
        out.print(
            f"   forked {fork.forked}, forked ahead and idle {fork.spares}, "
            f"runs that found theirs ready {fork.spares_taken}",
            markup=False,
        )


def render_doctor(report: DoctorReport) -> None:
    out = Console(highlight=False, soft_wrap=True)
    for probe in report.probes:
        if probe.passed:
            mark = "[green]PASS[/green]"
        elif probe.weak:
            mark = "[yellow]WEAK[/yellow]"
        else:
            mark = "[red]FAIL[/red]"
        out.print(f"{mark} {probe.layer:<12} {escape(probe.detail)}")
    weak = [p.layer for p in report.probes if p.weak]
    if report.passed:
        verdict = "all layers hold"
    elif all(p.passed or p.weak for p in report.probes):
        verdict = f"the layers it provides hold; not in force by design: {', '.join(weak)}"
    else:
        verdict = "some layers are missing"
    out.print(f"backend {report.backend}: {verdict}", markup=False)


def render_package_list(directory: Path, record: added.Record) -> None:
    out = Console(highlight=False, soft_wrap=True)
    out.print(f"packages directory: {directory}", markup=False)
    if not record.packages:
        out.print("no packages added (codecage packages add NAME)", markup=False)
        return
    for entry in record.packages:
        why = "" if entry.requested else "  (dependency)"
        out.print(f"  {entry.name}=={entry.version}{why}", markup=False)


def render_package_change(change: added.Change, *, as_json: bool) -> None:
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
        print_json(
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
    done = [
        f"{n} {what}"
        for n, what in (
            (len(installed), "added"),
            (len(removed), "removed"),
            (len(changed), "changed"),
        )
        if n
    ]
    count = len(change.after.requested())
    held = f"{count} package(s) you added" if count else "no package you added"
    stderr.print(
        f"{', '.join(done) or 'nothing changed'}; {change.directory} now holds {held}. "
        "Sandboxes started from now on see that (a running `codecage serve` keeps its warm "
        "sandboxes until they are used)",
        markup=False,
    )


def fail(exc: CodecageError, *, as_json: bool, verbose: bool) -> NoReturn:
    code = render_failure(exc, as_json=as_json)
    if verbose:
        stderr.print_exception()
    raise typer.Exit(code)


def render_failure(exc: CodecageError, *, as_json: bool, screen: Screen | None = None) -> int:
    """What `fail` prints for `exc` (its JSON with --json, then Error and Hint on stderr);
    the command's exit code: 2 for a refusal (ConfigError), else 1."""
    screen = screen or this_process()
    hint = exc.hint_for("cli")  # flags, not keyword arguments (errors.render_hint)
    if as_json:
        print_json(
            {"error": {"type": type(exc).__name__, "message": str(exc), "hint": hint or None}},
            screen,
        )
    screen.console.print(f"[red]Error:[/red] {escape(str(exc))}", markup=True)
    if hint:
        screen.console.print(f"Hint: {hint}", markup=False)  # a hint may name [tables]
    return 2 if isinstance(exc, ConfigError) else 1


class _NullContext:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *args: object) -> None:
        return None

    def stop(self) -> None:
        return None


def progress(message: str, *, enabled: bool) -> Any:
    """A spinner on stderr for slow steps, only for a person watching a terminal."""
    if not enabled or not sys.stderr.isatty() or os.environ.get("CI") == "true":
        return _NullContext()
    return stderr.status(message)
