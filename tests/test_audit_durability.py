"""The audit trail is never in the way and never loses a record: a run whose result came back
is on disk even when the host process is killed right after; a store that cannot be written
(full, locked) makes the trail report an error and keep the records until it can, or, with
`[audit] required`, refuse new runs; many concurrent MCP calls are each on record once."""

from __future__ import annotations

import contextlib
import json
import logging
import sqlite3
import subprocess
from collections.abc import Iterator
from pathlib import Path

import anyio
import httpx2
import pytest
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from tests._disk import big_code, fill, small_tmpfs

from codecage import AuditError, Options, Sandbox
from codecage.audit import journal, open_store
from codecage.mcp import health
from test_server import (
    CODECAGE,
    INITIALIZE,
    send_lines,
    server_env,
    serving_http,
    spawn_serve,
    structured,
)

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def recorded_ids(db: Path) -> list[str]:
    with contextlib.closing(sqlite3.connect(db)) as conn:
        return [row[0] for row in conn.execute("SELECT execution_id FROM executions")]


def test_runs_answered_before_a_sigkill_are_on_record(tmp_path: Path) -> None:
    """The server is killed the moment the last answer is read: every answered run is in
    the file (written before the answer left), however abruptly the process ended."""
    db = tmp_path / "audit.db"
    calls = [
        {
            "jsonrpc": "2.0",
            "id": 10 + i,
            "method": "tools/call",
            "params": {"name": "execute_code", "arguments": {"code": f"print({i})"}},
        }
        for i in range(5)
    ]
    messages = [INITIALIZE, {"jsonrpc": "2.0", "method": "notifications/initialized"}, *calls]
    with spawn_serve(tmp_path, "--audit", str(db)) as proc:
        assert proc.stdin is not None and proc.stdout is not None
        send_lines(proc, messages)
        answers = [json.loads(proc.stdout.readline()) for _ in range(1 + len(calls))]
        proc.kill()
    ids = [a["result"]["structuredContent"]["execution_id"] for a in answers[1:]]
    assert len(set(ids)) == len(calls)
    # In the store, or in the dead server's journal beside it, which the next user of the
    # store (a trail, `codecage audit`) puts into it.
    store = open_store(db)
    try:
        journal.recover(store, journal.directory_for(str(db)))
    finally:
        store.close()
    assert sorted(recorded_ids(db)) == sorted(ids)


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 1 MiB tmpfs: a state directory that fills up."""
    with small_tmpfs(tmp_path / "small") as where:
        yield where


def test_a_full_disk_is_reported_and_the_records_are_written_once_there_is_room(
    small_disk: Path, caplog: pytest.LogCaptureFixture
) -> None:
    db = small_disk / "audit.db"
    with Sandbox(pool=False, options=Options(audit=db)) as sandbox:
        trail = sandbox.host.audit
        assert trail is not None
        first = sandbox.run(big_code(0))
        assert trail.flush()
        filler = fill(small_disk)
        with caplog.at_level(logging.ERROR, logger="codecage.audit.trail"):
            during = [sandbox.run(big_code(i)) for i in range(1, 4)]
        assert all(r.status == "ok" for r in during), "runs go on (not required)"
        assert any(r.message == "audit.write_failed" for r in caplog.records)
        assert trail.failure
        assert not trail.flush(timeout=2)
        assert recorded_ids(db) == [first.execution_id]
        filler.unlink()
        after = sandbox.run("print('room again')")
    expected = [first, *during, after]
    assert sorted(recorded_ids(db)) == sorted(r.execution_id for r in expected)


def test_a_required_trail_refuses_runs_while_its_store_fails(small_disk: Path) -> None:
    config = small_disk.parent / "config.toml"
    config.write_text("[audit]\nrequired = true\n")
    db = small_disk / "audit.db"
    with Sandbox(pool=False, config=config, options=Options(audit=db)) as sandbox:
        sandbox.run(big_code(0))
        filler = fill(small_disk)
        unrecorded = sandbox.run(big_code(1))  # this one's write fails: it ran already
        with pytest.raises(AuditError, match="required"):
            sandbox.run("print('refused')")
        assert "audit" in (health.host_readiness(sandbox.host).reason or "")  # /readyz: 503
        filler.unlink()
        again = sandbox.run("print('accepted again')")
    assert again.status == "ok"
    assert unrecorded.execution_id in recorded_ids(db)  # kept, written once there was room


def test_a_locked_store_keeps_the_record_until_the_lock_is_gone(tmp_path: Path) -> None:
    db = tmp_path / "audit.db"
    with Sandbox(pool=False, options=Options(audit=db)) as sandbox:
        holder = sqlite3.connect(db, isolation_level=None)
        holder.execute("BEGIN EXCLUSIVE")  # another process's long write transaction
        try:
            locked = sandbox.run("print('while locked')")
            trail = sandbox.host.audit
            assert trail is not None
            assert not trail.flush(timeout=2)  # busy: kept, retried
            assert trail.failure
        finally:
            holder.execute("ROLLBACK")
            holder.close()
        after = sandbox.run("print('after')")
    assert sorted(recorded_ids(db)) == sorted([locked.execution_id, after.execution_id])


async def test_fifty_concurrent_mcp_calls_are_each_on_record_exactly_once(tmp_path: Path) -> None:
    db = tmp_path / "audit.db"
    ids: list[str] = []
    refused: list[str] = []
    with serving_http(tmp_path, "--audit", str(db), "--max-queued", "64") as server:

        async def call(i: int) -> None:
            async with (
                httpx2.AsyncClient(timeout=httpx2.Timeout(60, read=120)) as http,
                Client(streamable_http_client(server.url, http_client=http)) as client,
            ):
                result = await client.call_tool("execute_code", {"code": f"{i} * 2"})
                if result.is_error:
                    refused.append(str(result.content))
                else:
                    ids.append(structured(result)["execution_id"])

        async with anyio.create_task_group() as group:
            for i in range(50):
                group.start_soon(call, i)
    assert not refused
    assert len(ids) == 50 == len(set(ids))
    on_record = recorded_ids(db)
    assert sorted(on_record) == sorted(ids)  # each once: no duplicate, none missing


@pytest.fixture
def read_only_dir(tmp_path: Path) -> Iterator[Path]:
    """A directory with an audit store in it, then made read-only by a read-only bind mount
    (root ignores file modes, so a mode would prove nothing)."""
    if __import__("os").geteuid() != 0:
        pytest.skip("a read-only bind mount needs root")
    where = tmp_path / "state"
    where.mkdir()
    with Sandbox(pool=False, options=Options(audit=where / "audit.db")) as sandbox:
        sandbox.run("1")
    subprocess.run(["mount", "--bind", str(where), str(where)], check=True)
    try:
        subprocess.run(["mount", "-o", "remount,bind,ro", str(where)], check=True)
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def test_a_read_only_state_directory_stops_serve_with_a_clear_error(read_only_dir: Path) -> None:
    done = subprocess.run(
        [CODECAGE, "serve", "--audit", str(read_only_dir / "audit.db")],
        input="",
        capture_output=True,
        text=True,
        env=server_env(),
        timeout=120,
    )
    assert done.returncode != 0
    assert "audit" in done.stderr and "cannot be" in done.stderr
    assert "--audit off" in done.stderr  # what to do, in flag terms
