"""The MCP server's stdio transport, without worker threads.

The SDK's `stdio_server()` reads and writes stdin/stdout through `anyio.wrap_file`, which
runs every readline, write and flush in a worker thread: each message in costs one hand-off
from a thread to the event loop, each message out four. On this kind of host (a VM, two
cores) a hand-off costs 50-100 us, which is a tenth of what the whole sandbox run adds to a
tool call. Here the event loop itself waits for stdin to be readable and stdout writable.

The streams are handed to the SDK's own `stdio_server(stdin, stdout)` (its public way to
bring your own streams), so message framing and parsing stay the SDK's. Like the SDK, the
process's fds 0 and 1 are diverted while serving (0 to /dev/null, 1 to stderr), so that
stray output of anything in this process cannot corrupt the protocol; the wire is served
from private duplicates.

Only pipes and sockets are served this way (what MCP hosts give a server); a terminal or a
file on stdin or stdout takes the SDK's own transport.

What mcp/early.py read of stdin before the server was built (the first line, answered
early when it was an `initialize` whose answer was known) is served first; the SDK's own
answer to that `initialize` is then dropped, or kept for the next start (early.py says why).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
from collections.abc import AsyncIterator, Iterator
from typing import Any, Protocol

import anyio

from codecage import fdio
from codecage.mcp import early

log = logging.getLogger(__name__)

_READ_CHUNK = 1 << 16
# A message longer than this is dropped (with a warning in the log) instead of being held in
# memory; the SDK drops a line that is not JSON the same way. Generous: 20 MB of code, every
# character escaped, fits.
MAX_LINE_BYTES = 256 * 1024 * 1024


class _LowLevelServer(Protocol):
    async def run(self, read_stream: Any, write_stream: Any, options: Any) -> None: ...

    def create_initialization_options(self) -> Any: ...


def serve(server: Any) -> None:
    """Serve `server` (an `MCPServer`) over stdin and stdout until stdin closes."""
    lowlevel: _LowLevelServer | None = getattr(server, "_lowlevel_server", None)
    front = early.take()
    if front is not None and lowlevel is None:
        # What the front read can be handed on only through this transport.
        raise RuntimeError("the MCP SDK no longer exposes its low-level server: update codecage")
    if lowlevel is None or not (fdio.is_stream(0) and fdio.is_stream(1)):
        # The SDK no longer exposes its low-level server (or a terminal is attached):
        # its own transport is correct, only slower.
        server.run("stdio")
        return
    anyio.run(_serve, lowlevel, front)


async def _serve(lowlevel: _LowLevelServer, front: early.Front | None = None) -> None:
    from mcp.server.stdio import stdio_server

    with _claimed_stdio() as (stdin_fd, stdout_fd):
        try:
            async with stdio_server(
                _LineReader(stdin_fd, read=bytes(front.read) if front else b""),  # type: ignore[arg-type]
                _Writer(stdout_fd, front),  # type: ignore[arg-type]
            ) as (read_stream, write_stream):
                options = lowlevel.create_initialization_options()
                await lowlevel.run(read_stream, write_stream, options)
        except* BrokenPipeError:
            # The client stopped reading (closed its end of stdout): the session is over.
            log.info("server.client_gone")


@contextlib.contextmanager
def _claimed_stdio() -> Iterator[tuple[int, int]]:
    """Private non-blocking duplicates of fds 0 and 1, with 0 and 1 diverted meanwhile;
    everything put back on the way out (the blocking flag too: the open file descriptions
    may be shared with the process that started this one)."""
    with contextlib.ExitStack() as undo:
        stdin_fd = undo.enter_context(_diverted(0, os.open(os.devnull, os.O_RDONLY)))
        stdout_fd = undo.enter_context(_diverted(1, _stderr_or_null()))
        for fd in (stdin_fd, stdout_fd):
            if os.get_blocking(fd):
                os.set_blocking(fd, False)
                undo.callback(_set_blocking_quietly, fd)
        yield stdin_fd, stdout_fd


def _stderr_or_null() -> int:
    try:
        return os.dup(2)
    except OSError:  # started with fd 2 closed
        return os.open(os.devnull, os.O_WRONLY)


@contextlib.contextmanager
def _diverted(fd: int, diversion: int) -> Iterator[int]:
    private = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 3)
    try:
        os.dup2(diversion, fd)
    finally:
        os.close(diversion)
    try:
        yield private
    finally:
        os.dup2(private, fd)
        os.close(private)


def _set_blocking_quietly(fd: int) -> None:
    with contextlib.suppress(OSError):
        os.set_blocking(fd, True)


class _LineReader:
    """Lines of a non-blocking fd as text, read when the event loop says there is data
    (what `stdio_server` iterates: `async for line in stdin`)."""

    def __init__(self, fd: int, max_line_bytes: int = MAX_LINE_BYTES, read: bytes = b"") -> None:
        self._fd = fd
        self._max_line_bytes = max_line_bytes
        self._read_before = read  # what early.py read of this stream: served first

    def __aiter__(self) -> AsyncIterator[str]:
        return self._lines()

    async def _lines(self) -> AsyncIterator[str]:
        # A long line comes in many chunks: only each new chunk is searched for its end.
        parts: list[bytes] = []
        size = 0  # of `parts`; past the limit the line is skipped up to its end
        while chunk := await self._read():
            start = 0
            while (end := chunk.find(b"\n", start)) != -1:
                if size <= self._max_line_bytes:
                    parts.append(chunk[start : end + 1])
                    yield b"".join(parts).decode("utf-8", "replace")
                parts.clear()
                size = 0
                start = end + 1
            if start < len(chunk) and size <= self._max_line_bytes:
                parts.append(chunk[start:])
                size += len(chunk) - start
                if size > self._max_line_bytes:
                    parts.clear()  # the memory goes now; the rest of the line is skipped
                    log.warning("server.line_too_long", extra={"limit": self._max_line_bytes})
        if parts:
            yield b"".join(parts).decode("utf-8", "replace")

    async def _read(self) -> bytes:
        if self._read_before:
            chunk, self._read_before = self._read_before, b""
            return chunk
        while True:
            try:
                return os.read(self._fd, _READ_CHUNK)
            except BlockingIOError:
                await anyio.wait_readable(self._fd)


class _Writer:
    """What `stdio_server` writes with: `await write(text)`, then `await flush()`."""

    def __init__(self, fd: int, front: early.Front | None = None) -> None:
        self._fd = fd
        self._pending = bytearray()
        # The `initialize` early.py saw: the SDK's answer to it is kept, or dropped when
        # the front sent it already.
        self._front = front if front is not None and front.cache is not None else None

    async def write(self, text: str) -> int:
        if self._front is not None and self._answers_front(text, self._front):
            return len(text)
        self._pending += text.encode("utf-8")
        return len(text)

    def _answers_front(self, text: str, front: early.Front) -> bool:
        """Whether `text` is the SDK's answer to the `initialize` the front answered
        already (then it is not sent again); the SDK's answer is kept for next time."""
        try:
            message = json.loads(text)
        except ValueError:
            return False
        if not isinstance(message, dict) or "method" in message:
            return False  # a notification or request of the server's: not the answer
        if message.get("id") != front.request_id:
            return False
        self._front = None  # one answer only
        result = message.get("result")
        if not isinstance(result, dict):
            if front.answered is not None:  # sent already: it stands; the log says so
                log.warning("server.initialize_refused_after_answer", extra={"reply": text})
            return front.answered is not None
        if result != front.answered and front.cache is not None:
            if front.answered is not None:
                log.warning("server.initialize_changed", extra={"cache": str(front.cache)})
            early.keep(front.cache, result)
        return front.answered is not None

    async def flush(self) -> None:
        while self._pending:
            try:
                written = os.write(self._fd, self._pending)
            except BlockingIOError:
                await anyio.wait_writable(self._fd)
                continue
            del self._pending[:written]  # cheap: a bytearray drops its head in place
