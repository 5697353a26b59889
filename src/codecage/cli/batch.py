"""`codecage run-batch`: many programs from a JSON Lines file, one result line each, in input
order (`codecage.batch` runs them), a progress bar and a summary on stderr."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Annotated, Any, Final

import typer
from pydantic import ValidationError

from codecage import batch
from codecage.cli.groups import takes_groups
from codecage.cli.logs import configure_logging
from codecage.cli.options import (
    AuditFlags,
    ConfigOpt,
    LimitFlags,
    NetworkFlags,
    OutputFlags,
    RayOpt,
    SandboxFlags,
    VerboseOpt,
)
from codecage.cli.render import fail, stderr
from codecage.cli.setup import load_config, options_of
from codecage.errors import CodecageError, ConfigError
from codecage.options import Options
from codecage.sandbox import Sandbox

MAX_LINE_BYTES: Final = 16 * 2**20
"""Longest input line: a program (10 MiB at most) with its files and limits."""


JsonlOpt = Annotated[
    str,
    typer.Option(
        "--jsonl",
        metavar="IN",
        help='JSON Lines, one program per line: {"code": ..., "id": ..., "limits": '
        '{...}, "files": {...}, "filename": ...} (\'-\' for stdin; blank lines are '
        f"skipped; at most {batch.DEFAULT_MAX_QUEUED} programs, "
        f"{MAX_LINE_BYTES // 2**20} MiB a line).",
        show_default=False,
    ),
]
ResultsOpt = Annotated[
    Path | None,
    typer.Option(
        "--out",
        help="Write the result lines to this file (replaced) instead of stdout.",
        dir_okay=False,
        show_default=False,
    ),
]
ConcurrencyOpt = Annotated[
    int | None,
    typer.Option(
        "--concurrency",
        "-j",
        help=f"Programs run at once, 1 to {batch.MAX_CONCURRENCY} (default: the pool's "
        "size, 4 unless the config's \\[pool] says otherwise; with --ray: on each node, "
        "default its CPUs).",
        show_default=False,
    ),
]
SummaryJsonOpt = Annotated[
    bool, typer.Option("--json", help="Print the summary on stderr as one JSON object.")
]
QuietOpt = Annotated[bool, typer.Option("--quiet", "-q", help="No progress bar and no summary.")]


@takes_groups
def run_batch(
    *,
    jsonl: JsonlOpt,
    out: ResultsOpt = None,
    concurrency: ConcurrencyOpt = None,
    ray: RayOpt = None,
    limits: LimitFlags,
    policy: SandboxFlags,
    config_file: ConfigOpt = None,
    network: NetworkFlags,
    audit: AuditFlags,
    output: OutputFlags,
    as_json: SummaryJsonOpt = False,
    quiet: QuietOpt = False,
    verbose: VerboseOpt = False,
) -> None:
    """Run many programs, each once in its own sandbox, and write one JSON result per line.

    Each output line is {"index", "id", "result", "error"} in the order of the input: the
    program's result (as `codecage run --json` prints it), or, when codecage could not run
    it (its sandbox failed), the error; nothing is run twice. The limit flags are every
    program's defaults; a line's "limits" override them. A bad line refuses the whole
    batch before anything runs (exit 2), naming its line number. A progress bar and then
    a summary (statuses, wall time, runs/s) go to stderr.

    Exit 0 when every program ran, whatever its status; 1 when codecage could not run
    some (their lines hold the error); 2 on a usage error or a bad line.

    Examples:

        echo '{"id": "a", "code": "1 + 1"}' | codecage run-batch --jsonl -

        codecage run-batch --jsonl tasks.jsonl --out results.jsonl -j 4

        codecage run-batch --jsonl tasks.jsonl --timeout 5 --json > results.jsonl

        codecage run-batch --jsonl tasks.jsonl --out results.jsonl --ray auto

    where tasks.jsonl holds lines such as

        {"id": "t1", "code": "assert 1 + 1 == 2", "limits": {"timeout": 2}}
    """
    configure_logging(verbose)
    try:
        settings = load_config(config_file)
        programs, lines = read_programs(jsonl, limits.overrides())
        # A batch is what warm sandboxes are for (pool).
        options = options_of(settings, _no_tools(), policy, network, audit, output, pool=True)
        bar = not (quiet or as_json)
        run = _RunSpec(lambda index: f"--jsonl line {lines[index]}", out, concurrency, bar)
        if ray is None:
            results, wall_s = _on_host(options, programs, run)
        else:
            results, wall_s = _on_ray(ray, options, programs, run)
    except CodecageError as exc:
        fail(exc, as_json=False, verbose=verbose)  # stdout holds result lines, not errors
    if not quiet:
        _print_summary(results, wall_s, as_json=as_json)
    raise typer.Exit(1 if any(r.error is not None for r in results) else 0)


@dataclasses.dataclass(frozen=True, slots=True)
class _RunSpec:
    """How the batch runs, whichever engine runs it."""

    label: Callable[[int], str]  # an item's name in a refusal: its line
    out: Path | None
    concurrency: int | None
    bar: bool


def _on_host(
    options: Options, programs: list[batch.Program], run: _RunSpec
) -> tuple[Results, float]:
    """The batch on this host's Sandbox (warm pool, fork server)."""
    with Sandbox(options=options) as sandbox:
        items = batch.prepare(programs, sandbox.limits, label=run.label)

        def runner(items: list[batch.Item], progress: batch.ProgressHandler) -> Results:
            return batch.run_items(
                sandbox, items, concurrency=run.concurrency, on_progress=progress
            )

        return _timed(items, run.out, runner, bar=run.bar)


def _on_ray(
    address: str, options: Options, programs: list[batch.Program], run: _RunSpec
) -> tuple[Results, float]:
    """The batch on a Ray cluster, a Sandbox made from `options` on each node."""
    cluster = ray_extra()
    node_options, defaults = cluster.node_options_of(options)
    items = batch.prepare(programs, defaults, label=run.label)

    def runner(items: list[batch.Item], progress: batch.ProgressHandler) -> Results:
        result: Results = cluster.run_items(
            items, node_options, address=address, concurrency=run.concurrency, on_progress=progress
        )
        return result

    return _timed(items, run.out, runner, bar=run.bar)


Results = list[batch.BatchResult]
Runner = Callable[[list[batch.Item], batch.ProgressHandler], Results]
"""Runs the items, calling the handler once per finished one: on this host or on Ray."""


def _timed(
    items: list[batch.Item], out: Path | None, runner: Runner, *, bar: bool
) -> tuple[Results, float]:
    """The results, written to `out` as they come, and the wall time in seconds."""
    with _output(out) as target:  # made only once every line is accepted
        started = time.monotonic()
        results = _run(items, target, runner, bar=bar)
        return results, time.monotonic() - started


def _run(items: list[batch.Item], target: IO[str], runner: Runner, *, bar: bool) -> Results:
    """Run the items, writing each result line in input order as soon as it can be."""
    writer = _OrderedWriter(target)
    with _progress_bar(len(items), enabled=bar) as advance:

        def on_progress(done: int, total: int, last: batch.BatchResult) -> None:
            writer.add(last)
            advance(last)

        results = runner(items, on_progress)
    writer.finish(results)
    return results


def ray_extra() -> Any:
    """`codecage.ray`, imported only for --ray (Ray is slow to import and an extra).

    Raises:
        ConfigError: Ray is not installed.
    """
    try:
        from codecage import ray as cluster
    except ImportError as exc:
        raise ConfigError(
            f"--ray needs Ray, which is not installed here ({exc})",
            hint="pip install 'codecage[ray]' (in the environment codecage runs from), "
            "or leave out --ray to run on this host",
        ) from exc
    return cluster


def read_programs(
    source: str, flags: dict[str, Any], *, max_programs: int = batch.DEFAULT_MAX_QUEUED
) -> tuple[list[batch.Program], list[int]]:
    """The programs of the JSON Lines `source` ('-': stdin), each with the limit flags
    under its own limits, and the line number of each.

    Raises:
        ConfigError: the file cannot be read, or a line is too long, not UTF-8, not a JSON
            object or not a program (the message names the line), or there are too many.
    """
    programs: list[batch.Program] = []
    numbers: list[int] = []
    with _input(source) as stream:
        for number, raw in _lines(stream):
            if not raw.strip():
                continue
            if len(programs) == max_programs:
                raise ConfigError(
                    f"--jsonl {source} holds more than {max_programs} programs; none was run",
                    hint=f"split it into files of at most {max_programs} lines",
                )
            program = _parse_line(raw, number)
            if flags:
                program = program.model_copy(update={"limits": {**flags, **(program.limits or {})}})
            programs.append(program)
            numbers.append(number)
    if not programs:
        raise ConfigError(
            f"--jsonl {source} holds no programs",
            hint='give one JSON object per line, e.g. {"id": "a", "code": "1 + 1"}',
        )
    return programs, numbers


@contextlib.contextmanager
def _input(source: str) -> Iterator[IO[bytes]]:
    """Raises: ConfigError: the file cannot be opened."""
    if source == "-":
        yield sys.stdin.buffer
        return
    try:
        stream = Path(source).open("rb")  # noqa: SIM115 (closed below)
    except OSError as exc:
        raise ConfigError(
            f"cannot read --jsonl {source}: {exc.strerror}",
            hint="pass the path of a JSON Lines file, or - to read stdin",
        ) from exc
    with stream:
        yield stream


def _lines(stream: IO[bytes]) -> Iterator[tuple[int, bytes]]:
    """Each line with its number from 1, read in bounded pieces.

    Raises:
        ConfigError: a line is longer than MAX_LINE_BYTES (or cannot be read).
    """
    number = 0
    while True:
        number += 1
        try:
            raw = stream.readline(MAX_LINE_BYTES + 1)
        except OSError as exc:
            raise ConfigError(
                f"reading --jsonl failed at line {number}: {exc.strerror}",
                hint="pass a readable JSON Lines file",
            ) from exc
        if not raw:
            return
        if len(raw) > MAX_LINE_BYTES:
            raise ConfigError(
                f"--jsonl line {number} is longer than {MAX_LINE_BYTES // 2**20} MiB; none was run",
                hint="keep each program, with its files, under that size",
            )
        yield number, raw


def _parse_line(raw: bytes, number: int) -> batch.Program:
    """Raises: ConfigError: the line is not UTF-8 JSON of one program."""
    try:
        data = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"--jsonl line {number} is not UTF-8 (byte {exc.start}); none was run",
            hint="write the file as UTF-8",
        ) from exc
    except json.JSONDecodeError as exc:
        raise ConfigError(
            f"--jsonl line {number} is not JSON: {exc.msg} (column {exc.colno}); none was run",
            hint='each line must be one JSON object, e.g. {"id": "a", "code": "1 + 1"}',
        ) from exc
    if not isinstance(data, dict):
        raise ConfigError(
            f"--jsonl line {number} is a JSON {type(data).__name__}, not an object; none was run",
            hint='each line must be one JSON object, e.g. {"id": "a", "code": "1 + 1"}',
        )
    try:
        return batch.Program.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(
            f"--jsonl line {number} is not a program: {batch.describe(exc)}; none was run",
            hint="each line has code (a string) and only the keys id, limits, files, filename",
        ) from exc


@contextlib.contextmanager
def _output(out: Path | None) -> Iterator[IO[str]]:
    """Raises: ConfigError: --out cannot be written."""
    if out is None:
        yield sys.stdout
        return
    try:
        stream = out.open("w", encoding="utf-8")
    except OSError as exc:
        raise ConfigError(
            f"cannot write --out {out}: {exc.strerror}",
            hint="pass a file path in a directory you can write",
        ) from exc
    with stream:
        yield stream


class _OrderedWriter:
    """Writes each result line as soon as every earlier one is written (input order), so
    a long batch's output grows as it goes; called one at a time (`on_progress`)."""

    def __init__(self, target: IO[str]) -> None:
        self._target = target
        self._waiting: dict[int, batch.BatchResult] = {}
        self._next = 0

    def add(self, result: batch.BatchResult) -> None:
        self._waiting[result.index] = result
        while self._next in self._waiting:
            line = json.dumps(self._waiting.pop(self._next).model_dump(mode="json"))
            self._target.write(line + "\n")
            self._next += 1
        self._target.flush()

    def finish(self, results: list[batch.BatchResult]) -> None:
        """The lines not written yet (items never started: the batch was cancelled)."""
        for result in results[self._next :]:
            self.add(result)


@contextlib.contextmanager
def _progress_bar(total: int, *, enabled: bool) -> Iterator[Any]:
    """`advance(result)` for a rich progress bar on stderr: only for a person watching a
    terminal (not with --quiet or --json, not when stderr is not a TTY, not with CI=true)."""
    if not enabled or not sys.stderr.isatty() or os.environ.get("CI") == "true":
        yield lambda result: None
        return
    # Here: rich.progress (and rich.table under it) is ~20 ms of every CLI start otherwise.
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    bar = Progress(
        "[progress.description]{task.description}",
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=stderr,
        transient=True,
    )
    with bar:
        task = bar.add_task("running", total=total)
        yield lambda result: bar.advance(task)


def summary(results: list[batch.BatchResult], wall_s: float) -> dict[str, Any]:
    """The batch in numbers: programs, count per status ("failed": codecage could not
    run it), wall time and runs per second."""
    statuses = Counter(result.status for result in results)
    return {
        "programs": len(results),
        "statuses": dict(sorted(statuses.items())),
        "failed": statuses.get("failed", 0),
        "wall_s": round(wall_s, 3),
        "runs_per_s": round(len(results) / wall_s, 1) if wall_s > 0 else None,
    }


def _print_summary(results: list[batch.BatchResult], wall_s: float, *, as_json: bool) -> None:
    data = summary(results, wall_s)
    if as_json:
        sys.stderr.write(json.dumps(data) + "\n")
        return
    counts = ", ".join(f"{status} {count}" for status, count in data["statuses"].items())
    stderr.print(
        f"{data['programs']} programs in {data['wall_s']:.2f} s "
        f"({data['runs_per_s']} runs/s): {counts}",
        markup=False,
    )


def _no_tools() -> Any:
    """No upstream MCP servers: a batch runs self-contained programs."""
    from codecage import toolsetup  # lazily, as setup.py does: it is slow to import

    return toolsetup.ToolSetup()
