"""Named HTTP clients of `codecage serve --http` ([serve.clients.NAME]): each its own token
(from its variable), its name in the audit trail, its rate, concurrent runs and largest
limits enforced with a tool error that says when to retry; tokens never logged."""
# ruff: noqa: S106 - token_env names a variable, it holds no token

from __future__ import annotations

import contextlib
import sqlite3
import subprocess
from pathlib import Path
from typing import Any

import anyio
import httpx2
import pytest
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from mcp_types import CallToolResult

from codecage import ConfigError
from codecage.mcp.clients import ClientLimits, ClientTokens
from codecage.models import ClientSettings
from test_server import CODECAGE, server_env, serving_http, structured, text_of

pytestmark = pytest.mark.anyio

ALICE = "alice-token-" + "a" * 32
BOB = "bob-token-" + "b" * 32
CONFIG = """
[serve.clients.alice]
token_env = "ALICE_TOKEN"
runs_per_minute = 2

[serve.clients.bob]
token_env = "BOB_TOKEN"
max_memory_mb = 128
max_timeout = 20
"""


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def call(url: str, token: str, arguments: dict[str, Any]) -> CallToolResult:
    headers = {"Authorization": f"Bearer {token}"}
    async with (
        httpx2.AsyncClient(headers=headers, timeout=httpx2.Timeout(30, read=60)) as http,
        Client(streamable_http_client(url, http_client=http)) as client,
    ):
        return await client.call_tool("execute_code", arguments)


async def test_each_client_is_named_on_record_and_held_to_its_bounds(tmp_path: Path) -> None:
    config = tmp_path / "config.toml"
    config.write_text(CONFIG)
    db = tmp_path / "audit.db"
    args = ("--config", str(config), "--audit", str(db))
    with serving_http(tmp_path, *args, ALICE_TOKEN=ALICE, BOB_TOKEN=BOB) as server:
        first = await call(server.url, ALICE, {"code": "1"})
        second = await call(server.url, ALICE, {"code": "2"})
        over = await call(server.url, ALICE, {"code": "3"})
        bob = await call(server.url, BOB, {"code": "4"})
        too_big = await call(server.url, BOB, {"code": "5", "memory_limit_mb": 256})
        too_long = await call(server.url, BOB, {"code": "6", "timeout": 60})
        with pytest.raises(Exception):  # noqa: B017 - the SDK's own error for a 401
            await call(server.url, "not-" + ALICE, {"code": "7"})
    assert [structured(r)["status"] for r in (first, second, bob)] == ["ok"] * 3
    assert over.is_error and "over its rate of 2 runs per minute" in text_of(over)
    assert "retry in" in text_of(over)
    assert too_big.is_error and "memory_limit_mb=256" in text_of(too_big)
    assert "128" in text_of(too_big)
    assert too_long.is_error and "timeout=60" in text_of(too_long)
    assert structured(bob)["limits"]["memory_mb"] == 128  # the default, lowered to its bound
    with contextlib.closing(sqlite3.connect(db)) as conn:
        names = [r[0] for r in conn.execute("SELECT caller_name FROM executions ORDER BY 1")]
    assert names == ["alice", "alice", "bob"]
    log = server.stderr_path.read_text(encoding="utf-8", errors="replace")
    assert ALICE not in log and BOB not in log


def test_a_client_whose_token_variable_is_unset_stops_the_start(tmp_path: Path) -> None:
    config = tmp_path / "config.toml"
    config.write_text(CONFIG)
    done = subprocess.run(
        [CODECAGE, "serve", "--http", "--config", str(config), "--port", "1"],
        capture_output=True,
        text=True,
        env=server_env(ALICE_TOKEN=ALICE),
        timeout=120,
    )
    assert done.returncode == 2 and "BOB_TOKEN" in done.stderr


def test_two_clients_with_one_token_are_refused() -> None:
    clients = {
        "a": ClientSettings(token_env="A"),
        "b": ClientSettings(token_env="B"),
    }
    with pytest.raises(ConfigError, match="same token"):
        ClientTokens.load(clients, None, {"A": "same", "B": "same"})


def test_a_token_names_its_client_and_nothing_else_does() -> None:
    clients = {"a": ClientSettings(token_env="A"), "b": ClientSettings(token_env="B")}
    tokens = ClientTokens.load(clients, "dflt", {"A": "ta", "B": "tb"})
    assert tokens is not None
    assert tokens.identify(b"Bearer ta") == "a"
    assert tokens.identify(b"Bearer tb") == "b"
    assert tokens.identify(b"Bearer dflt") == "default"
    for wrong in (b"", b"Bearer", b"Bearer ", b"Basic ta", b"Bearer t", b"Bearer tax", b"ta"):
        assert tokens.identify(wrong) is None, wrong


def test_the_rate_is_a_sliding_minute_and_the_retry_says_when() -> None:
    now = [1000.0]
    refused: list[tuple[str, str]] = []
    limits = ClientLimits(
        {"a": ClientSettings(token_env="A", runs_per_minute=2, max_concurrent=5)},
        on_refused=lambda client, why: refused.append((client, why)),
        clock=lambda: now[0],
    )
    limits.admit("a")
    now[0] += 20
    limits.admit("a")
    with pytest.raises(ConfigError) as over:
        limits.admit("a")
    assert over.value.hint == "retry in 40 s"
    assert refused == [("a", "client 'a' is over its rate of 2 runs per minute")]
    now[0] += 40  # the first run left the window
    limits.admit("a")
    limits.admit(None)  # not a named client: no bound
    limits.admit("unknown")


def test_concurrent_runs_are_bounded_and_freed_when_they_end() -> None:
    limits = ClientLimits({"a": ClientSettings(token_env="A", max_concurrent=1)})
    limits.admit("a")
    with pytest.raises(ConfigError, match="1 runs going"):
        limits.admit("a")
    limits.done("a")
    limits.admit("a")


async def test_concurrent_calls_over_a_clients_bound_get_the_retry_error(tmp_path: Path) -> None:
    config = tmp_path / "config.toml"
    config.write_text('[serve.clients.carol]\ntoken_env = "CAROL_TOKEN"\nmax_concurrent = 1\n')
    token = "carol-" + "c" * 32
    results: list[CallToolResult] = []
    with serving_http(tmp_path, "--config", str(config), CAROL_TOKEN=token) as server:

        async def one(i: int) -> None:
            code = "import time; time.sleep(1.5)" if i == 0 else "1"
            results.append(await call(server.url, token, {"code": code}))

        async with anyio.create_task_group() as group:
            group.start_soon(one, 0)
            await anyio.sleep(0.7)  # the first is running
            group.start_soon(one, 1)
    refused = [r for r in results if r.is_error]
    assert len(refused) == 1 and "retry when one of them has ended" in text_of(refused[0])
