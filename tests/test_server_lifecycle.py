"""`codecage serve` under pressure, over real transports: a call the client cancels or
abandons by disconnecting has its sandbox killed, and concurrent calls are served (a bounded
number at once, the rest queued) while the server keeps answering.

Both protocol eras are driven: "legacy" (the 2025-11-25 initialize handshake, where a
`notifications/cancelled` message cancels) and 2026-07-28 (where, over HTTP, closing the
request's stream cancels).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import anyio
import httpx2
import pytest
from mcp import Client
from mcp.client.stdio import StdioServerParameters, stdio_client
from mcp.client.streamable_http import streamable_http_client
from mcp_types import CallToolResult, TextContent

from test_server import (
    CODECAGE,
    INITIALIZE,
    gone_soon,
    left_behind,
    send_lines,
    server_env,
    serving_http,
    spawn_serve,
)

pytestmark = pytest.mark.anyio

MODES = ["legacy", "2026-07-28"]

# Five threads and the main one asleep: a sandbox running this has 6+ threads, while an
# idle warm sandbox (and every other process in the tree) has one.
SLEEPER = """
import threading, time
for _ in range(5):
    threading.Thread(target=time.sleep, args=(120,), daemon=True).start()
time.sleep(120)
"""
SLEEPER_CALL = {"code": SLEEPER, "timeout": 110, "allowed_imports": ["threading"]}


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def descendants(pid: int) -> list[int]:
    """Every process below `pid`, from each process's parent in /proc/PID/stat (the
    `children` files miss children that fork while they are read, as proc(5) warns)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        # A process may exit while we walk /proc: its entry vanishes mid-listing.
        with contextlib.suppress(OSError, ValueError, IndexError):
            stat = (entry / "stat").read_text()
            parent = int(stat[stat.rindex(")") + 2 :].split()[1])
            children.setdefault(parent, []).append(int(entry.name))
    found: list[int] = []
    todo = [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        found += kids
        todo += kids
    return found


def busy_sandboxes(server_pid: int) -> list[int]:
    """Processes under the server running SLEEPER (see there)."""
    busy = []
    for pid in descendants(server_pid):
        with contextlib.suppress(OSError):
            status = Path(f"/proc/{pid}/status").read_text()
            threads = int(status.split("Threads:")[1].split()[0])
            if threads >= 6:
                busy.append(pid)
    return busy


async def wait_for(predicate: Callable[[], bool], what: str, seconds: float = 20) -> None:
    deadline = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < deadline, f"gave up waiting: {what}"
        await anyio.sleep(0.05)


def server_pid_of_stdio() -> int:
    """The `codecage serve` child that the stdio client spawned from this process."""
    for pid in descendants(os.getpid()):
        with contextlib.suppress(OSError):
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            if len(argv) > 1 and argv[-2:] == [b"serve", b""]:
                return pid
    pytest.fail("no `codecage serve` child found")


@contextlib.asynccontextmanager
async def stdio_session(workdir: Path, mode: str) -> AsyncIterator[tuple[Client, int]]:
    params = StdioServerParameters(command=CODECAGE, args=["serve"], cwd=str(workdir))
    with (workdir / "stderr.log").open("w", encoding="utf-8") as errlog:
        transport = stdio_client(params, errlog=errlog)
        async with Client(transport, mode=mode, read_timeout_seconds=60) as client:
            yield client, server_pid_of_stdio()


@contextlib.asynccontextmanager
async def http_session(url: str, mode: str) -> AsyncIterator[Client]:
    async with (
        httpx2.AsyncClient(timeout=httpx2.Timeout(30, read=150)) as http,
        Client(streamable_http_client(url, http_client=http), mode=mode) as client,
    ):
        yield client


async def cancel_a_sleeping_call_and_go_on(client: Client, server_pid: int) -> None:
    """Start SLEEPER, see its sandbox run, cancel the call, see the sandbox die; then the
    next call on the same client is served."""
    async with anyio.create_task_group() as group:
        group.start_soon(client.call_tool, "execute_code", SLEEPER_CALL)
        await wait_for(lambda: bool(busy_sandboxes(server_pid)), "the sleeper to start")
        group.cancel_scope.cancel()
    await wait_for(lambda: not busy_sandboxes(server_pid), "the cancelled sandbox to die", 10)
    assert value_of(await client.call_tool("execute_code", {"code": "6 * 7"})) == 42


def value_of(result: CallToolResult) -> Any:
    text = "\n".join(b.text for b in result.content if isinstance(b, TextContent))
    assert not result.is_error, text
    assert result.structured_content is not None, text
    return result.structured_content["return_value"]


@pytest.mark.parametrize("mode", MODES)
async def test_a_cancelled_stdio_call_kills_its_sandbox_and_the_session_goes_on(
    tmp_path: Path, mode: str
) -> None:
    async with stdio_session(tmp_path, mode) as (client, server_pid):
        await cancel_a_sleeping_call_and_go_on(client, server_pid)


@pytest.mark.parametrize("mode", MODES)
async def test_a_cancelled_http_call_kills_its_sandbox_and_the_server_goes_on(
    tmp_path: Path, mode: str
) -> None:
    with serving_http(tmp_path) as server:
        async with http_session(server.url, mode) as client:
            await cancel_a_sleeping_call_and_go_on(client, server.proc.pid)


@pytest.mark.parametrize("mode", MODES)
async def test_an_http_client_that_disconnects_mid_call_has_its_sandbox_killed(
    tmp_path: Path, mode: str
) -> None:
    with serving_http(tmp_path) as server:
        pid = server.proc.pid
        with anyio.move_on_after(60):
            async with http_session(server.url, mode) as client, anyio.create_task_group() as g:
                g.start_soon(client.call_tool, "execute_code", SLEEPER_CALL)
                await wait_for(lambda: bool(busy_sandboxes(pid)), "the sleeper to start")
                g.cancel_scope.cancel()  # leaves both blocks: the connection closes
        await wait_for(lambda: not busy_sandboxes(pid), "the abandoned sandbox to die", 10)
        async with http_session(server.url, mode) as client:  # a new client is served
            assert value_of(await client.call_tool("execute_code", {"code": "1 + 1"})) == 2


async def test_a_stdio_client_that_goes_away_mid_call_leaves_nothing(tmp_path: Path) -> None:
    """The host closing the pipe (or dying) ends the server, and its sandboxes with it."""
    async with stdio_session(tmp_path, "legacy") as (client, server_pid):
        with anyio.move_on_after(1):
            async with anyio.create_task_group() as group:
                group.start_soon(client.call_tool, "execute_code", SLEEPER_CALL)
                await wait_for(lambda: bool(busy_sandboxes(server_pid)), "the sleeper to start")
                await anyio.sleep(30)  # cancelled by move_on_after... after 1 s at most
    # The client is closed: stdin's end reaches the server, which exits.
    await wait_for(lambda: not Path(f"/proc/{server_pid}").exists(), "the server to exit", 20)
    assert left_behind(server_pid) == {}


async def test_concurrent_calls_are_served_while_long_ones_run(tmp_path: Path) -> None:
    """Two long runs occupy two of the four slots; quick calls still come back at once,
    and the info tool answers while everything runs."""
    with serving_http(tmp_path, "--max-concurrent", "4") as server:
        async with http_session(server.url, "legacy") as client:
            results: list[Any] = []

            async def run(code: str) -> None:
                results.append(value_of(await client.call_tool("execute_code", {"code": code})))

            async with anyio.create_task_group() as group:
                for _ in range(2):
                    group.start_soon(run, "import time\ntime.sleep(3)\n'slow'")
                await anyio.sleep(0.5)
                started = time.monotonic()
                quick = await client.call_tool("execute_code", {"code": "'quick'"})
                info = await client.call_tool("get_sandbox_info", {})
                assert time.monotonic() - started < 2.5, "quick calls waited for slow ones"
                assert value_of(quick) == "quick"
                assert not info.is_error
            assert sorted(results) == ["slow", "slow"]


async def test_past_the_queue_limit_calls_are_refused_with_a_busy_error(
    tmp_path: Path,
) -> None:
    """One slot and a queue of 3: of 12 concurrent calls, those past the queue are told
    the server is busy, and once the queue drains, calls are served again."""
    options = ("--max-concurrent", "1", "--max-queued", "3")
    with serving_http(tmp_path, *options) as server:
        async with http_session(server.url, "legacy") as client:
            outcomes: list[CallToolResult] = []

            async def run() -> None:
                outcomes.append(
                    await client.call_tool(
                        "execute_code", {"code": "import time\ntime.sleep(0.2)\n1"}
                    )
                )

            async with anyio.create_task_group() as group:
                for _ in range(12):
                    group.start_soon(run)
            refused = [o for o in outcomes if o.is_error]
            served = [o for o in outcomes if not o.is_error]
            assert refused, "no call was refused past the queue limit"
            assert len(served) >= 4  # one running + 3 queued
            busy = "\n".join(b.text for b in refused[0].content if isinstance(b, TextContent))
            assert "busy" in busy, busy
            assert value_of(await client.call_tool("execute_code", {"code": "2"})) == 2


def test_a_stdio_client_closing_as_the_sdks_do_leaves_nothing_even_with_an_empty_cache(
    tmp_path: Path,
) -> None:
    """The SDKs' stdio clients close the server's stdin, send SIGTERM two seconds later if
    it has not exited, and SIGKILL two seconds after that. A server whose warm pool is still
    starting its first sandbox (an empty cache makes that take seconds: the Inspector runs
    servers with a HOME of its own) must be gone by then without leaving a run directory, a
    mount or cgroups behind. (The Inspector's stdio tests did, once, in a fresh clone under
    the whole suite's load: the host facts were worked out inside the start, with the
    sandbox's directory and cgroup already made, and a SIGTERM cut the cleanup short.)"""
    messages = [
        INITIALIZE,
        {"jsonrpc": "2.0", "method": "notifications/initialized"},
        {"jsonrpc": "2.0", "id": 2, "method": "tools/list"},
    ]
    proc = spawn_serve(tmp_path, env=server_env(XDG_CACHE_HOME=str(tmp_path / "empty-cache")))
    assert proc.stdin is not None and proc.stdout is not None
    with proc:
        send_lines(proc, messages)
        for _ in range(2):  # the two answers
            assert proc.stdout.readline(), "the server closed stdout without answering"
        proc.stdin.close()
        for then in (signal.SIGTERM, signal.SIGKILL):
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=2)
                break
            proc.send_signal(then)
        proc.wait(timeout=30)
    # Cleaned up by the server itself, or (if the SIGKILL came first) by its guardian.
    assert gone_soon(proc.pid) == {}


def test_a_server_killed_with_sigkill_leaves_nothing_behind(tmp_path: Path) -> None:
    """SIGKILL (the OOM killer, a client's last resort) gives the server no chance to clean
    up: its guardian process removes the warm sandbox's run directory, mount and cgroup."""
    proc = spawn_serve(tmp_path)
    assert proc.stdin is not None and proc.stdout is not None
    with proc:
        send_lines(proc, [INITIALIZE])
        assert proc.stdout.readline()
        deadline = time.monotonic() + 30
        while not left_behind(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.05)  # the warm pool's sandbox is being made
        assert left_behind(proc.pid), "the server made no warm sandbox to leave behind"
        proc.kill()
        proc.wait(timeout=30)
    assert gone_soon(proc.pid) == {}


def test_sigterms_during_the_cleanup_do_not_cut_it_short(tmp_path: Path) -> None:
    """Once the client has hung up, the server only cleans up; a SIGTERM then (here one
    every 50 ms until it is gone) must not stop that half-way."""
    proc = spawn_serve(tmp_path)
    assert proc.stdin is not None and proc.stdout is not None
    with proc:
        send_lines(proc, [INITIALIZE])
        assert proc.stdout.readline(), "the server closed stdout without answering"
        proc.stdin.close()
        deadline = time.monotonic() + 30
        while proc.poll() is None and time.monotonic() < deadline:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
            time.sleep(0.05)
        proc.wait(timeout=30)
    assert left_behind(proc.pid) == {}
