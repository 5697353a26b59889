"""What a client sees while a long `execute_code` call runs, when it asked for progress
(a progressToken in the request's _meta): every second, a progress notification
(progress = seconds since the call began, message = the program's last output line) and a
log message (notifications/message, level info) with the output lines that came since the
last one. A run over in less than a second sends neither; the final reply is the same.

The output comes from the host runtime's `on_output`, already scrubbed as the reply is.
It is bounded here so that a chatty program cannot flood the client: a message of at most
`MAX_MESSAGE_CHARS`, at most `MAX_LOG_LINES` lines of at most `MAX_LINE_CHARS` per log
message, and a count of the lines left out. A client that went away stops the reports,
never the run.
"""

from __future__ import annotations

import logging
import threading
import time
import warnings
from collections.abc import Awaitable, Callable
from typing import Any, Final, TypeVar

import anyio
from mcp.server.mcpserver import Context
from mcp.shared.exceptions import MCPDeprecationWarning

from codecage.output import neutralise_line

__all__ = ["MAX_LOG_LINES", "OutputDigest", "asked_for_progress", "reporting"]

log = logging.getLogger(__name__)

TICK_S: Final = 1.0
MAX_MESSAGE_CHARS: Final = 200
MAX_LINE_CHARS: Final = 500
MAX_LOG_LINES: Final = 20  # per log message, that is per second

_T = TypeVar("_T")
OutputHandler = Callable[[str, str], None]


class OutputDigest:
    """The program's output as the reports need it: its last line and, since the last
    report, at most `MAX_LOG_LINES` new lines. Fed on the run's output thread (`__call__`),
    read on the event loop (`take`)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._partial = {"stdout": "", "stderr": ""}  # an unfinished line, bounded
        self._lines: list[str] = []
        self._left_out = 0
        self._last = ""

    def __call__(self, stream: str, text: str) -> None:
        with self._lock:
            *complete, partial = (self._partial.get(stream, "") + text).split("\n")
            self._partial[stream] = partial[:MAX_LINE_CHARS]
            for line in complete:
                self._add(stream, line)
            if partial.strip():
                self._last = partial

    def _add(self, stream: str, line: str) -> None:
        if line.strip():
            self._last = line
        if len(self._lines) >= MAX_LOG_LINES:
            self._left_out += 1
            return
        shown = neutralise_line(line[:MAX_LINE_CHARS])
        self._lines.append(shown if stream == "stdout" else f"[stderr] {shown}")

    def take(self) -> tuple[str, str]:
        """The last line (for the progress message) and the log text since the last call
        ("" when nothing new came)."""
        with self._lock:
            lines, left_out = self._lines, self._left_out
            self._lines, self._left_out = [], 0
            last = neutralise_line(self._last[:MAX_MESSAGE_CHARS])
        if left_out:
            lines.append(f"[... {left_out} more line(s) this second, not sent]")
        return last, "\n".join(lines)


def asked_for_progress(ctx: Context[Any, Any]) -> bool:
    """Whether the call's _meta carries a progressToken."""
    try:
        meta = ctx.request_context.meta
    except ValueError:  # not within a request
        return False
    if not meta:
        return False
    return meta.get("progress_token", meta.get("progressToken")) is not None


async def reporting(
    ctx: Context[Any, Any], job: Callable[[OutputHandler | None], Awaitable[_T]]
) -> _T:
    """`job(on_output)`, reporting its progress to the client meanwhile when it asked for
    it (else `job(None)`: nothing to collect).

    Raises:
        Whatever `job` raises, as it raised it.
    """
    if not asked_for_progress(ctx):
        return await job(None)
    digest = OutputDigest()
    done = anyio.Event()
    failure: Exception | None = None
    async with anyio.create_task_group() as group:
        group.start_soon(_report, ctx, digest, done)
        try:
            value = await job(digest)
        except Exception as exc:  # raised outside the group: a task group would wrap it
            failure = exc
        finally:
            done.set()
    if failure is not None:
        raise failure
    return value


async def _report(ctx: Context[Any, Any], digest: OutputDigest, done: anyio.Event) -> None:
    started = time.monotonic()
    while True:
        with anyio.move_on_after(TICK_S):
            await done.wait()
        if done.is_set():
            return
        last, lines = digest.take()
        try:
            await ctx.report_progress(round(time.monotonic() - started, 1), message=last or None)
            if lines:
                await _log(ctx, lines)
        except Exception as exc:  # the client went away: stop reporting, the run goes on
            log.debug("server.progress_failed", extra={"error": type(exc).__name__})
            return


async def _log(ctx: Context[Any, Any], text: str) -> None:
    # notifications/message is deprecated from protocol 2026-07-28 (SEP-2577), where a
    # client opts in per request; clients of earlier versions still read it.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", MCPDeprecationWarning)
        await ctx.log("info", text, logger_name="execute_code")
