"""Many programs on one Sandbox (`Sandbox.run_many`, `codecage run-batch`): a bounded pool
of worker threads runs them, each once, and the results come back in input order.

The decisions, in one place:
- The whole batch is checked before anything runs: more than `max_queued` programs, a
  malformed item or an item's limits out of bounds refuse the batch with a `ConfigError`
  naming the item (its index and id). A refusal the run itself makes (e.g. two uploaded
  files named "a" and "a/b") is that item's error only.
- Nothing is run again. The program that crashed its own sandbox is a result like any
  other (status "killed", "error", ...: the host judged it); when codecage itself failed
  for an item (`SandboxError`, `HostError`, a run-time `ConfigError`), that item's
  `BatchResult` holds the error instead of a result, and the batch goes on.
- Every item gets exactly one `BatchResult`, at its index.
"""

from __future__ import annotations

import contextvars
import itertools
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Final, Literal, Protocol

from pydantic import Field, ValidationError

from codecage.errors import CodecageError, ConfigError
from codecage.models import ExecutionResult, Limits
from codecage.models.base import Model

log = logging.getLogger(__name__)

DEFAULT_MAX_QUEUED: Final = 100_000
"""Programs one batch may hold: a larger one is refused before anything runs."""
MAX_CONCURRENCY: Final = 256
"""Worker threads one batch may use (each runs one sandbox at a time)."""


class Program(Model):
    """One program of a batch: `Sandbox.run`'s arguments for one item."""

    code: str = Field(description="The Python code to run.")
    id: str | int | None = Field(
        None, description="The caller's name for the item, copied to its result."
    )
    limits: dict[str, Any] | None = Field(
        None,
        description="Limits of this item over the Sandbox's, by `Limits` field name "
        '(e.g. {"timeout": 2}); None: the defaults.',
    )
    files: dict[str, str | bytes] | None = Field(
        None,
        description="Files put in /workspace before it runs, by relative path (a str is "
        "written as UTF-8).",
    )
    filename: str = Field("main.py", description="The name the code runs under.")


ErrorCode = Literal["refused", "sandbox_error", "cancelled", "timed_out", "node_lost"]
"""What a pipeline can act on when codecage could not run an item (`BatchError.code`)."""


class BatchError(Model):
    """Why codecage could not run one item (not the code's own failure: that is a result)."""

    type: str = Field(description="The error's class, e.g. 'SandboxError'.")
    message: str = Field(description="What happened.")
    hint: str | None = Field(None, description="What to do about it.")
    code: ErrorCode | None = Field(
        None,
        description="What kind of failure, for a pipeline to act on: 'refused' (the item "
        "was refused before it ran: fix it), 'sandbox_error' (the sandbox failed: the "
        "program is not to blame), 'cancelled' (the batch stopped first), 'timed_out' "
        "(its node did not answer in time; codecage.ray) or 'node_lost' (its node went "
        "away while it may have been running, and running it again was not safe; "
        "codecage.ray). Run the item again for all but 'refused'.",
    )


class BatchResult(Model):
    """What became of one item: its `ExecutionResult`, or the error that kept it from
    running (exactly one of the two)."""

    index: int = Field(ge=0, description="The item's place in the input, from 0.")
    id: str | int | None = Field(description="The item's `id`, as given.")
    result: ExecutionResult | None = Field(description="The run's result; null on an error.")
    error: BatchError | None = Field(
        description="Why codecage could not run the item (the sandbox failed, the run was "
        "refused, the batch was cancelled first); null when it ran. Never retried."
    )

    @property
    def status(self) -> str:
        """The result's status, or "failed" when codecage could not run the item."""
        return self.result.status if self.result is not None else "failed"


ProgramLike = str | Program | Mapping[str, Any]
"""An item as callers give it: the code alone, a `Program`, or a dict of its fields."""
ProgressHandler = Callable[[int, int, BatchResult], None]
"""`on_progress(done, total, last)`: called once per finished item, never two at once."""


class Runner(Protocol):
    """What the batch needs of a Sandbox: its default limits and `run`."""

    @property
    def limits(self) -> Limits: ...

    def run(
        self,
        code: str,
        *,
        limits: Limits,
        filename: str,
        files: Mapping[str, bytes | str] | None,
        cancel: threading.Event | None,
    ) -> ExecutionResult: ...


@dataclass(frozen=True, slots=True)
class Item:
    """One checked item: its program and the limits it runs under."""

    index: int
    program: Program
    limits: Limits


def run_many(
    sandbox: Runner,
    programs: Iterable[ProgramLike],
    *,
    concurrency: int | None = None,
    max_queued: int = DEFAULT_MAX_QUEUED,
    on_progress: ProgressHandler | None = None,
    cancel: threading.Event | None = None,
) -> list[BatchResult]:
    """Run every program once on `sandbox`, `concurrency` at a time, and return their
    results in input order.

    Args:
        sandbox: the Sandbox whose settings every run has.
        programs: code strings, `Program`s or dicts with Program's keys.
        concurrency: runs at once, 1 to 256; None: `default_concurrency(sandbox)`.
        max_queued: the most programs the batch may hold (default 100,000).
        on_progress: called with (done, total, the item just finished), one call at a time;
            one that raises is not called again (logged once).
        cancel: set it to stop: runs in flight are killed (status "killed", a `cancelled`
            event) and items not started get a "Cancelled" error.

    Raises:
        ConfigError: refused before anything ran: too many programs, a bad concurrency,
            a malformed item or an item's limits out of bounds (the message names its
            index and id).
    """
    items = prepare(programs, sandbox.limits, max_queued=max_queued)
    return run_items(
        sandbox, items, concurrency=concurrency, on_progress=on_progress, cancel=cancel
    )


def run_items(
    sandbox: Runner,
    items: list[Item],
    *,
    concurrency: int | None = None,
    on_progress: ProgressHandler | None = None,
    cancel: threading.Event | None = None,
) -> list[BatchResult]:
    """`run_many` of items `prepare` checked already (the CLI names them by line).

    Raises:
        ConfigError: a bad concurrency (nothing ran).
    """
    workers = check_concurrency(
        default_concurrency(sandbox) if concurrency is None else concurrency
    )
    return _Batch(sandbox, items, on_progress, cancel or threading.Event()).run(workers)


def default_concurrency(sandbox: object) -> int:
    """The sandboxes a pool keeps warm at most, else the number of CPUs."""
    pool = getattr(sandbox, "pool", None)
    config = getattr(pool, "config", None)
    sizes = getattr(config, "sizes", None)
    if sizes is not None and sizes.max_idle > 0:
        return int(sizes.max_idle)
    return os.cpu_count() or 1


def prepare(
    programs: Iterable[ProgramLike],
    defaults: Limits,
    *,
    max_queued: int = DEFAULT_MAX_QUEUED,
    label: Callable[[int], str] = "programs[{}]".format,
) -> list[Item]:
    """Every item as a `Program` with its limits resolved, checked before anything runs;
    a refusal names the item by `label(index)`.

    Raises:
        ConfigError: more than `max_queued` items, or a bad item (named by index and id).
    """
    if isinstance(programs, str | bytes | Mapping):
        raise ConfigError(
            f"programs is one {type(programs).__name__}, not a list of programs",
            hint='pass programs=["print(1)", ...] (a list, even of one program)',
        )
    if not 1 <= max_queued <= 10_000_000:
        raise ConfigError(
            f"max_queued={max_queued!r} is not from 1 to 10000000",
            hint=f"pass max_queued={DEFAULT_MAX_QUEUED}",
        )
    items = []
    # One past the bound is enough to know: an endless generator is never drained.
    for index, given in enumerate(itertools.islice(programs, max_queued + 1)):
        if index == max_queued:
            raise ConfigError(
                f"the batch holds more than max_queued={max_queued} programs; none was run",
                hint="split it into batches of at most max_queued programs, or pass a "
                "larger max_queued",
            )
        program = _program(label(index), given)
        items.append(Item(index, program, _limits(label(index), program, defaults)))
    return items


def _program(name: str, given: ProgramLike) -> Program:
    """Raises: ConfigError: `given` is not a program."""
    if isinstance(given, Program):
        return given
    if isinstance(given, str):
        return Program(code=given)
    if not isinstance(given, Mapping):
        raise ConfigError(
            f"{name} is a {type(given).__name__}, not a program; none was run",
            hint='pass each program as code (a str), a Program or a dict {"code": ...}',
        )
    try:
        return Program.model_validate(dict(given))
    except ValidationError as exc:
        raise ConfigError(
            f"{name}{_named(given.get('id'))} is not a valid program: "
            f"{describe(exc)}; none was run",
            hint="give each program code (a str) and only the keys id, limits, files, filename",
        ) from exc


def _limits(name: str, program: Program, defaults: Limits) -> Limits:
    """Raises: ConfigError: the item's limits are unknown or out of bounds."""
    if not program.limits:
        return defaults
    try:
        return defaults.merged(program.limits)
    except ValidationError as exc:
        raise ConfigError(
            f"{name}{_named(program.id)} has invalid limits: {describe(exc)}; none was run",
            hint="fix that item's limits ({info} lists the limits and their bounds)",
        ) from exc


def _named(item_id: object) -> str:
    return f" (id {item_id!r})" if item_id is not None else ""


def describe(exc: ValidationError) -> str:
    """A pydantic error as one line: each bad field, its value and what is wrong."""
    parts = []
    for err in exc.errors():
        field = ".".join(str(p) for p in err["loc"]) or "the item"
        shown = repr(err.get("input"))
        parts.append(f"{field}={shown[:80]}: {err['msg']}")
    return "; ".join(parts)


def check_concurrency(value: int) -> int:
    """Raises: ConfigError: not a whole number from 1 to MAX_CONCURRENCY."""
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_CONCURRENCY:
        raise ConfigError(
            f"concurrency={value!r} is not a whole number from 1 to {MAX_CONCURRENCY}",
            hint="pass concurrency=4 (runs at once; about the number of CPUs is enough)",
        )
    return value


class _Batch:
    """The items, the workers that take them in order and the results, by index."""

    def __init__(
        self,
        sandbox: Runner,
        items: list[Item],
        on_progress: ProgressHandler | None,
        cancel: threading.Event,
    ) -> None:
        self._sandbox = sandbox
        self._items = items
        self._next = iter(items)
        self._results: list[BatchResult | None] = [None] * len(items)
        self._lock = threading.Lock()  # guards _next, _done, _failure and on_progress
        self._on_progress = on_progress
        self._done = 0
        self._cancel = cancel
        self._failure: BaseException | None = None

    def run(self, workers: int) -> list[BatchResult]:
        started = time.monotonic()
        threads = [
            # Each worker runs in a copy of the caller's context (an `arun_many` caller's
            # loop is found there by a coroutine approval callback).
            threading.Thread(
                target=contextvars.copy_context().run,
                args=(self._work,),
                name=f"codecage-batch-{n}",
                daemon=True,
            )
            for n in range(min(workers, len(self._items)))
        ]
        for thread in threads:
            thread.start()
        try:
            for thread in threads:
                thread.join()
        except BaseException:  # Ctrl-C: kill the runs in flight, start no more
            self._cancel.set()
            for thread in threads:
                thread.join()
            raise
        if self._failure is not None:  # a bug, not a sandbox's failure: say it loudly
            raise self._failure
        log.info(
            "batch.done",
            extra={"programs": len(self._items), "wall_ms": _ms_since(started)},
        )
        return [r if r is not None else self._cancelled(i) for i, r in enumerate(self._results)]

    def _work(self) -> None:
        while True:
            with self._lock:
                item = None if self._cancel.is_set() else next(self._next, None)
            if item is None:
                return
            try:
                outcome = self._run(item)
            except BaseException as exc:
                with self._lock:
                    self._failure = self._failure or exc
                self._cancel.set()
                return
            self._finish(outcome)

    def _run(self, item: Item) -> BatchResult:
        """The item run once; codecage's own failure for it is its error, not a retry."""
        program = item.program
        try:
            result = self._sandbox.run(
                program.code,
                limits=item.limits,
                filename=program.filename,
                files=program.files,
                cancel=self._cancel,
            )
        except CodecageError as exc:
            # A refusal is the caller's to read in the result; a failure is codecage's own.
            level = logging.INFO if isinstance(exc, ConfigError) else logging.WARNING
            log.log(
                level, "batch.item_failed", extra={"index": item.index, "error": type(exc).__name__}
            )
            error = BatchError(
                type=type(exc).__name__,
                message=str(exc),
                hint=exc.hint or None,
                code="refused" if isinstance(exc, ConfigError) else "sandbox_error",
            )
            return BatchResult(index=item.index, id=program.id, result=None, error=error)
        return BatchResult(index=item.index, id=program.id, result=result, error=None)

    def _finish(self, outcome: BatchResult) -> None:
        with self._lock:
            self._results[outcome.index] = outcome
            self._done += 1
            if self._on_progress is None:
                return
            try:
                self._on_progress(self._done, len(self._items), outcome)
            except Exception as exc:  # the caller's code: it stops hearing, the batch goes on
                log.warning("batch.on_progress_failed", extra={"error": type(exc).__name__})
                self._on_progress = None

    def _cancelled(self, index: int) -> BatchResult:
        error = BatchError(
            type="Cancelled",
            message="the batch was cancelled before this program ran",
            hint="run it again in a new batch",
            code="cancelled",
        )
        item = self._items[index]
        return BatchResult(index=index, id=item.program.id, result=None, error=error)


def _ms_since(started: float) -> int:
    return int((time.monotonic() - started) * 1000)
