"""The thread-free stdio transport (codecage.mcp.stdio): framing over real pipes and sockets,
a slow reader that does not stall the event loop, fds put back as they were, and the SDK's
own transport when stdin or stdout is not a pipe.

The end-to-end calls over this transport are in test_server*.py (the SDK's stdio client
gives the server pipes, so every stdio test there goes through it).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import anyio
import pytest

from codecage.mcp import stdio
from test_server import CODECAGE, left_behind, session_input

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def read_lines(fd: int) -> list[str]:
    return [line async for line in stdio._LineReader(fd)]


async def test_lines_are_framed_across_chunks_and_split_characters() -> None:
    reader, writer = socket.socketpair()
    reader.setblocking(False)
    # "é" is two bytes in UTF-8: the first chunk ends between them.
    pieces = [b'{"a": "caf\xc3', b'\xa9"}\n{"b"', b": 1}\n\n", b'{"c": 2}\n{"tail": true}']
    lines: list[str] = []

    async def collect() -> None:
        lines.extend(await read_lines(reader.fileno()))

    async with anyio.create_task_group() as tg:
        tg.start_soon(collect)
        for piece in pieces:
            writer.sendall(piece)
            await anyio.sleep(0.02)  # each piece arrives in a read of its own
        writer.close()
    reader.close()
    assert lines == ['{"a": "café"}\n', '{"b": 1}\n', "\n", '{"c": 2}\n', '{"tail": true}']


async def test_a_20_mb_line_arrives_whole() -> None:
    read_fd, write_fd = os.pipe()
    os.set_blocking(read_fd, False)
    line = b'{"code": "' + b"x" * (20 * 1024 * 1024) + b'"}\n'
    lines: list[str] = []

    async def collect() -> None:
        lines.extend(await read_lines(read_fd))

    async with anyio.create_task_group() as tg:
        tg.start_soon(collect)
        await anyio.to_thread.run_sync(_write_and_close, write_fd, line)
    os.close(read_fd)
    assert len(lines) == 1
    assert lines[0].encode() == line


async def test_a_line_past_the_limit_is_dropped_and_the_next_one_read(
    caplog: pytest.LogCaptureFixture,
) -> None:
    reader, writer = socket.socketpair()
    reader.setblocking(False)
    lines: list[str] = []

    async def collect() -> None:
        lines.extend([line async for line in stdio._LineReader(reader.fileno(), 1000)])

    async with anyio.create_task_group() as tg:
        tg.start_soon(collect)
        for piece in [b'{"big": "' + b"z" * 3000, b"z" * 3000 + b'"}\n{"next"', b": 1}\n"]:
            writer.sendall(piece)
            await anyio.sleep(0.02)
        writer.close()
    reader.close()
    assert lines == ['{"next": 1}\n']
    assert "server.line_too_long" in caplog.text


def _write_and_close(fd: int, data: bytes) -> None:
    with open(fd, "wb") as out:
        out.write(data)


async def test_a_slow_reader_does_not_stall_the_event_loop() -> None:
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    message = "y" * (1024 * 1024) + "\n"  # sixteen times what the pipe holds
    out = stdio._Writer(write_fd)
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await anyio.sleep(0.001)

    async def send() -> None:
        await out.write(message)
        await out.flush()
        os.close(write_fd)

    async with anyio.create_task_group() as tg:
        tg.start_soon(ticker)
        tg.start_soon(send)
        await anyio.sleep(0.2)  # the pipe is full and nobody reads
        ticks_while_full = ticks
        received = await anyio.to_thread.run_sync(_read_to_end, read_fd)
        tg.cancel_scope.cancel()
    assert ticks_while_full > 20
    assert received == message.encode()


def _read_to_end(fd: int) -> bytes:
    with open(fd, "rb") as source:
        return source.read()


SERVE_ONE_SESSION = textwrap.dedent(
    """
    import json, os, sys
    from mcp.server.mcpserver import MCPServer
    from codecage.mcp import stdio

    before = [os.get_blocking(0), os.get_blocking(1)]
    server = MCPServer(name="probe")

    @server.tool()
    def echo(text: str) -> str:
        print("stray output from a handler")  # must not reach the wire
        return text

    stdio.serve(server)
    after = [os.get_blocking(0), os.get_blocking(1)]
    sys.stderr.write(json.dumps({"before": before, "after": after}) + "\\n")
    os.write(1, b"fd 1 is the wire again\\n")
    """
)


def answer_to_call(received: bytes) -> dict[str, Any] | None:
    """The reply to request 2, once it is in `received` (the server answers line by line)."""
    for line in received.decode("utf-8", "replace").splitlines():
        if line.startswith("{") and (message := json.loads(line)).get("id") == 2:
            return message["result"]  # type: ignore[no-any-return]
    return None


def converse(proc: subprocess.Popen[bytes], tool: str, arguments: dict[str, object]) -> bytes:
    """Send a session's requests and read until the call is answered; then hang up (a
    server cancels what is in flight when its stdin ends, so not before)."""
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(session_input(tool, arguments))
    proc.stdin.flush()
    received = b""
    while answer_to_call(received) is None:
        chunk = os.read(proc.stdout.fileno(), 1 << 16)
        assert chunk, "the server closed stdout without answering"
        received += chunk
    proc.stdin.close()
    received += proc.stdout.read()
    proc.stdout.close()
    proc.wait(timeout=30)
    return received


def test_a_session_over_pipes_leaves_the_fds_as_they_were() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", SERVE_ONE_SESSION],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    received = converse(proc, "echo", {"text": "hé"})
    assert proc.stderr is not None
    stderr = proc.stderr.read().decode()
    proc.stderr.close()
    assert answer_to_call(received) == {
        "content": [{"type": "text", "text": "hé"}],
        "structuredContent": {"result": "hé"},
        "isError": False,
    }
    assert received.decode().endswith("}\nfd 1 is the wire again\n")
    assert "stray output from a handler" in stderr
    flags = json.loads(stderr.strip().splitlines()[-1])
    assert flags["before"] == flags["after"] == [True, True]


def test_with_a_file_for_stdout_the_sdk_transport_serves(tmp_path: Path) -> None:
    replies = tmp_path / "out.jsonl"
    with replies.open("wb") as stdout:
        proc = subprocess.Popen(
            [sys.executable, "-c", SERVE_ONE_SESSION],
            stdin=subprocess.PIPE,
            stdout=stdout,
            stderr=subprocess.DEVNULL,
        )
    assert proc.stdin is not None
    proc.stdin.write(session_input("echo", {"text": "hé"}))
    proc.stdin.flush()
    deadline = time.monotonic() + 60
    while answer_to_call(replies.read_bytes()) is None and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.stdin.close()
    proc.wait(timeout=30)
    answer = answer_to_call(replies.read_bytes())
    assert answer is not None and answer["content"][0]["text"] == "hé"


def test_codecage_serve_answers_over_a_socket(tmp_path: Path) -> None:
    """Some hosts hand a server one socket for both directions, not pipes."""
    ours, theirs = socket.socketpair()
    with theirs:
        proc = subprocess.Popen(
            [CODECAGE, "serve", "--no-pool"],
            stdin=theirs,
            stdout=theirs,
            stderr=subprocess.DEVNULL,
            cwd=tmp_path,
        )
    with ours:
        ours.settimeout(60)
        ours.sendall(session_input("execute_code", {"code": "print(6 * 7)"}))
        received = b""
        while (answer := answer_to_call(received)) is None:
            chunk = ours.recv(1 << 16)
            assert chunk, "the server closed the socket without answering"
            received += chunk
    proc.wait(timeout=30)
    assert answer["structuredContent"]["status"] == "ok"
    assert answer["content"][0]["text"].startswith("42\n")  # the output is in the text


def test_a_client_that_stops_reading_ends_the_session_quietly(tmp_path: Path) -> None:
    """Closing its end of the server's stdout is a hang-up: the server exits 0 with a log
    line (not a traceback) and leaves no sandbox, mount, run dir or cgroup."""
    proc = subprocess.Popen(
        [CODECAGE, "serve"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=tmp_path,
    )
    assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()
    proc.stdin.write(session_input("execute_code", {"code": "print(1)"}))
    proc.stdin.flush()
    try:
        returncode = proc.wait(timeout=60)
    finally:
        proc.kill()
        proc.stdin.close()
    stderr = proc.stderr.read().decode()
    proc.stderr.close()
    assert returncode == 0, stderr
    assert "server.client_gone" in stderr
    assert "Traceback" not in stderr
    assert left_behind(proc.pid) == {}
