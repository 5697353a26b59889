"""Faults, the clock jumping: the wall clock of a `codecage serve --http` process moves by an
hour while it serves, and its deadlines, rate limits, audit records and pool behave.

The machine's clock is never set (it is shared; the harness's timers depend on it). The
server gets a sitecustomize (CLOCK_HOOK) on its PYTHONPATH that adds the offset written in
a file (re-read every 50 ms) to `time.time`, `time.time_ns` and `datetime.datetime.now` /
`utcnow` (its `datetime.datetime` is a subclass whose `now` is shifted).

What this covers: every wall-clock read of the server's Python code (codecage's and its
libraries') through those functions. What it does not: `time.monotonic` (the clock deadlines
must use, left true on purpose), C code reading the clock itself (sqlite's 'now', OpenSSL's
certificate times, the kernel's file times), `datetime.date.today()`, anything in the guest
(the sandbox's Python starts isolated, -I -S: no sitecustomize) and other processes (a
fork server's template, upstream servers). A real jump (NTP, a VM resumed) moves all of
them at once; this moves only the server's Python view.
"""

from __future__ import annotations

import contextlib
import sqlite3
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import anyio
import httpx2
import pytest
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from mcp_types import CallToolResult

import codecage
from test_serve_clients import ALICE, BOB, clients_config
from test_server import HttpServer, serving_http, structured, text_of

pytestmark = pytest.mark.anyio

SOURCE = str(Path(codecage.__file__).resolve().parent.parent)
HOUR = 3600.0
CONFIG = clients_config(3)

CLOCK_HOOK = r'''
"""Test hook (tests/reliability/test_faults_clock.py): a shifted wall clock."""
import datetime as _dt
import os
import time

_file = os.environ.get("CODECAGE_TEST_CLOCK_FILE")
if _file:
    _real_time, _real_time_ns, _real_dt = time.time, time.time_ns, _dt.datetime
    _state = [-1.0, 0.0]  # when last read (monotonic), the offset in seconds

    def _offset():
        now = time.monotonic()
        if now - _state[0] > 0.05:
            try:
                with open(_file, encoding="utf-8") as f:
                    _state[1] = float(f.read().strip() or 0)
            except (OSError, ValueError):
                _state[1] = 0.0
            _state[0] = now
        return _state[1]

    class _ShiftedDatetime(_real_dt):
        @classmethod
        def now(cls, tz=None):
            return _real_dt.now(tz) + _dt.timedelta(seconds=_offset())

        @classmethod
        def utcnow(cls):
            return _real_dt.now(_dt.timezone.utc).replace(tzinfo=None) + _dt.timedelta(
                seconds=_offset()
            )

    time.time = lambda: _real_time() + _offset()
    time.time_ns = lambda: _real_time_ns() + int(_offset() * 1e9)
    _dt.datetime = _ShiftedDatetime
    with open(_file + ".loaded", "w", encoding="utf-8") as f:
        f.write(str(os.getpid()))
'''


@dataclass
class Clock:
    file: Path

    def shift(self, seconds: float) -> None:
        self.file.write_text(str(seconds), encoding="utf-8")
        time.sleep(0.2)  # the hook re-reads it every 50 ms


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def shifted(tmp_path: Path) -> Iterator[tuple[HttpServer, Clock, Path]]:
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(CLOCK_HOOK, encoding="utf-8")
    clock = Clock(tmp_path / "clock")
    clock.shift(0)
    config = tmp_path / "config.toml"
    config.write_text(CONFIG, encoding="utf-8")
    db = tmp_path / "audit.db"
    env = {
        "PYTHONPATH": f"{SOURCE}:{hook}",
        "CODECAGE_TEST_CLOCK_FILE": str(clock.file),
        "ALICE_TOKEN": ALICE,
        "BOB_TOKEN": BOB,
    }
    with serving_http(tmp_path, "--config", str(config), "--audit", str(db), **env) as server:
        loaded = Path(f"{clock.file}.loaded")
        assert loaded.read_text() == str(server.proc.pid), "the clock hook is not in the server"
        yield server, clock, db


@contextlib.asynccontextmanager
async def client(url: str, token: str) -> AsyncIterator[Client]:
    headers = {"Authorization": f"Bearer {token}"}
    async with (
        httpx2.AsyncClient(headers=headers, timeout=httpx2.Timeout(30, read=90)) as http,
        Client(streamable_http_client(url, http_client=http)) as session,
    ):
        yield session


def retry_in(result: CallToolResult) -> int:
    text = text_of(result)
    assert result.is_error and "over its rate of 3 runs per minute" in text, text
    return int(text.split("retry in ", 1)[1].split()[0])


def pool_started(info: CallToolResult) -> tuple[int, int]:
    """(started, idle) over the pool's keys, from get_sandbox_info."""
    keys = structured(info)["detail"]["pool"]["keys"]
    return sum(k["started"] for k in keys), sum(k["idle"] for k in keys)


async def test_a_wall_clock_jump_moves_no_deadline_limit_or_pool_age(
    shifted: tuple[HttpServer, Clock, Path],
) -> None:
    server, clock, db = shifted
    async with client(server.url, ALICE) as alice:
        assert structured(await alice.call_tool("execute_code", {"code": "1"}))["status"] == "ok"

        # A 3 s timeout across a jump of +1 h: it ends after its 3 s, not at once.
        sleeper = {"code": "import time\ntime.sleep(60)", "timeout": 3, "allowed_imports": ["time"]}
        asked = time.monotonic()
        async with anyio.create_task_group() as group:
            group.start_soon(anyio.to_thread.run_sync, lambda: (time.sleep(1), clock.shift(HOUR)))
            timed_out = await alice.call_tool("execute_code", sleeper)
        took = time.monotonic() - asked
        print(f"a 3 s timeout across a +1 h jump ended after {took:.2f} s")
        assert structured(timed_out)["status"] == "timeout"
        assert 3 <= took < 45, "the deadline moved with the wall clock"

        # The rate limit: a sliding minute that a jump neither resets nor stretches.
        assert structured(await alice.call_tool("execute_code", {"code": "3"}))["status"] == "ok"
        ahead = retry_in(await alice.call_tool("execute_code", {"code": "4"}))
        clock.shift(-HOUR)
        behind = retry_in(await alice.call_tool("execute_code", {"code": "5"}))
        print(f"over the rate: retry in {ahead} s (clock +1 h), {behind} s (clock -1 h)")
        assert 0 < ahead <= 60 and 0 < behind <= 60

    # The pool: a jump ages no warm sandbox (none is replaced for it).
    async with client(server.url, BOB) as anyone:
        clock.shift(0)
        await anyio.sleep(0.8)
        before = pool_started(await anyone.call_tool("get_sandbox_info", {"detail": True}))
        clock.shift(HOUR)
        await anyio.sleep(0.8)
        clock.shift(-HOUR)
        await anyio.sleep(0.8)
        after = pool_started(await anyone.call_tool("get_sandbox_info", {"detail": True}))
        print(f"pool (started, idle) before the jumps {before}, after {after}")
        assert after == before and after[1] >= 1
        answer = await anyone.call_tool("execute_code", {"code": "6 * 7"})
        assert structured(answer)["return_value"] == 42

    # The audit trail: every run on record, its duration the measured one.
    with contextlib.closing(sqlite3.connect(db)) as conn:
        rows = conn.execute("SELECT status, wall_ms, started_at, finished_at FROM executions")
        records = list(rows)
    print("records:", records)
    assert sorted(r[0] for r in records) == ["ok", "ok", "ok", "timeout"]
    for status, wall_ms, started, finished in records:
        # wall_ms is measured (monotonic); the timestamps are wall-clock readings, so the
        # timeout's record spans the jump: finished_at - started_at is an hour more.
        assert wall_ms < 60_000
        if status == "timeout":
            assert wall_ms >= 3000, (started, finished)
