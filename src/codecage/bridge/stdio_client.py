"""The MCP SDK's stdio client with one change: a line from the server is bounded while it
is read.

The SDK's `mcp.client.stdio.stdio_client` gathers a server's stdout into one string until
a newline comes (`buffer + chunk`, copied at each chunk): a server that writes gigabytes
without a newline takes the host's memory and, copying, its CPU. Here the line's parts
are kept in a list and counted; past `max_line_bytes` the connection ends (the session
sees it closed, the broker fails the calls in flight and starts the server again) and
`on_overflow` says why. Everything else (spawning, shutdown, the process tree's end) is
the SDK's own, from its module, so its fixes apply here too.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import TextIO

import anyio
import anyio.lowlevel
from anyio.abc import ByteReceiveStream, ByteSendStream
from anyio.streams.text import TextReceiveStream
from mcp.client import stdio as sdk
from mcp.client._transport import TransportStreams
from mcp.shared.message import SessionMessage


@asynccontextmanager
async def bounded_stdio_client(
    server: sdk.StdioServerParameters,
    errlog: TextIO,
    *,
    max_line_bytes: int,
    on_overflow: Callable[[], None],
    exact_env: dict[str, str] | None = None,
    pass_fds: tuple[int, ...] = (),
) -> AsyncGenerator[TransportStreams, None]:
    """`mcp.client.stdio.stdio_client`, with each line of the server's stdout at most
    `max_line_bytes` (counted in characters: UTF-8 has at least one byte per character).
    `exact_env`: the process's whole environment (not added to the SDK's default one);
    `pass_fds`: fds the process inherits under their numbers (a sandbox's seccomp filter).

    Raises:
        OSError: the server process cannot be spawned.
    """
    if exact_env is None and not pass_fds:
        command = await sdk._get_executable_command(server.command)
        process = await sdk._create_platform_compatible_process(
            command=command,
            args=server.args,
            env=sdk.get_default_environment() | (server.env or {}),
            errlog=errlog,
            cwd=server.cwd,
        )
    else:
        # As the SDK spawns on POSIX (its own session: the SDK ends it by process group).
        process = await anyio.open_process(
            [server.command, *server.args],
            env=exact_env if exact_env is not None else sdk.get_default_environment(),
            stderr=errlog,
            cwd=server.cwd,
            start_new_session=True,
            pass_fds=pass_fds,
        )
    server_stdin, server_stdout = process.stdin, process.stdout
    if server_stdin is None or server_stdout is None:  # the SDK spawns with pipes
        process.kill()
        raise OSError("the upstream server was started without pipes")

    async def stop() -> None:
        await sdk._stop_server_process(process)

    async with bounded_transport(
        server_stdin,
        server_stdout,
        stop,
        max_line_bytes=max_line_bytes,
        on_overflow=on_overflow,
        encoding=server.encoding,
        errors=server.encoding_error_handler,
    ) as streams:
        yield streams


@asynccontextmanager
async def bounded_transport(
    server_stdin: ByteSendStream,
    server_stdout: ByteReceiveStream,
    stop: Callable[[], Awaitable[None]],
    *,
    max_line_bytes: int,
    on_overflow: Callable[[], None],
    encoding: str = "utf-8",
    errors: str = "strict",
) -> AsyncGenerator[TransportStreams, None]:
    """The session's streams over a started server's stdin and stdout, each line of its
    stdout bounded as `bounded_stdio_client` says; `stop` ends the server (after its stdin
    is closed and what it still writes drained). Also used for a server the host holds as
    a sandbox (`bridge/sandboxed.py`)."""
    read_stream_writer, read_stream = anyio.create_memory_object_stream[SessionMessage | Exception](
        0
    )
    write_stream, write_stream_reader = anyio.create_memory_object_stream[SessionMessage](0)
    writer_done = anyio.Event()

    async def overflowed() -> None:
        # Close the session's stream before the drain below: the session must see the
        # connection end now (the calls in flight fail), not when the server stops writing.
        on_overflow()
        await read_stream_writer.aclose()

    async def stdout_reader() -> None:
        stdout = TextReceiveStream(server_stdout, encoding=encoding, errors=errors)
        try:
            async with read_stream_writer:
                try:
                    parts: list[str] = []
                    pending = 0
                    async for chunk in stdout:
                        *lines, rest = chunk.split("\n")
                        for line in lines:
                            whole = "".join((*parts, line))
                            parts, pending = [], 0
                            if len(whole) > max_line_bytes:
                                await overflowed()
                                return
                            try:
                                await read_stream_writer.send(sdk._parse_line(whole))
                            except (anyio.ClosedResourceError, anyio.BrokenResourceError):
                                return
                        if rest:
                            parts.append(rest)
                            pending += len(rest)
                            if pending > max_line_bytes:
                                await overflowed()
                                return
                finally:
                    await _drain(server_stdout)
        except (anyio.ClosedResourceError, anyio.BrokenResourceError, ConnectionError):
            pass  # shutdown, or the server went away: the session sees the stream close

    async def stdin_writer() -> None:
        try:
            async with write_stream_reader:
                async for session_message in write_stream_reader:
                    json = session_message.message.model_dump_json(
                        by_alias=True, exclude_unset=True
                    )
                    data = (json + "\n").encode(encoding=encoding, errors=errors)
                    await server_stdin.send(data)
        except (anyio.ClosedResourceError, anyio.BrokenResourceError, OSError):
            await read_stream_writer.aclose()
        finally:
            writer_done.set()

    async def shutdown() -> None:
        read_stream.close()
        write_stream.close()
        with anyio.move_on_after(sdk._WRITER_FLUSH_TIMEOUT):
            await writer_done.wait()
        await stop()
        await sdk._aclose_all(read_stream, write_stream, read_stream_writer, write_stream_reader)
        await anyio.lowlevel.checkpoint()

    async with anyio.create_task_group() as tg:
        tg.start_soon(stdout_reader)
        tg.start_soon(stdin_writer)
        try:
            yield read_stream, write_stream
        finally:
            with anyio.CancelScope(shield=True):
                await shutdown()
            tg.cancel_scope.cancel()
    await anyio.lowlevel.cancel_shielded_checkpoint()


async def _drain(stdout: ByteReceiveStream) -> None:
    """What the server still writes, read and dropped until shutdown closes the pipe (the
    SDK's `_drain_stdout`, for any byte stream): a server blocked on a full pipe would
    miss its chance to exit."""
    with anyio.CancelScope(shield=True):
        with contextlib.suppress(
            anyio.EndOfStream,
            anyio.ClosedResourceError,
            anyio.BrokenResourceError,
            ConnectionError,
            OSError,
        ):
            while True:
                await stdout.receive()
