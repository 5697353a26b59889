"""Named HTTP clients of `codecage serve --http` ([serve.clients.NAME]): each its own token
(from its variable), its name in the audit trail, its rate, concurrent runs and largest
limits enforced with a tool error that says when to retry; tokens never logged."""
# ruff: noqa: S106 - token_env names a variable, it holds no token

from __future__ import annotations

import contextlib
import json
import sqlite3
import subprocess
import threading
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
from codecage.models import ClientSettings, SessionSettings
from test_server import CODECAGE, server_env, serving_http, structured, text_of

pytestmark = pytest.mark.anyio

ALICE = "alice-token-" + "a" * 32
BOB = "bob-token-" + "b" * 32


def clients_config(alice_runs_per_minute: int, bob: str = "") -> str:
    """Two clients of `codecage serve`, whose tokens it reads from ALICE_TOKEN and BOB_TOKEN:
    alice with at most `alice_runs_per_minute` runs a minute, bob with the `bob` settings
    (TOML lines)."""
    alice = f'token_env = "ALICE_TOKEN"\nruns_per_minute = {alice_runs_per_minute}\n'
    return f'[serve.clients.alice]\n{alice}\n[serve.clients.bob]\ntoken_env = "BOB_TOKEN"\n{bob}'


CONFIG = clients_config(2, bob="max_memory_mb = 128\nmax_timeout = 20\n")


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


def test_a_refused_start_starts_no_sandbox_and_always_exits_2(tmp_path: Path) -> None:
    """The tokens are checked before the Sandbox is built: its warm pool used to be
    compiling its first seccomp filter on a starter thread as the refusal exited, and the
    exit freed that filter under it (SIGSEGV, exit 139, a few starts in a hundred; the
    unit-level race is test_seccomp's test_the_exit_never_frees_a_filter_a_thread_is_
    compiling). Now nothing of the isolation layer runs before the refusal (-v logs it)."""
    config = tmp_path / "config.toml"
    config.write_text(CONFIG)
    argv = [CODECAGE, "serve", "--http", "-v", "--config", str(config), "--port", "1"]
    for _ in range(3):
        done = subprocess.run(
            argv, capture_output=True, text=True, env=server_env(ALICE_TOKEN=ALICE), timeout=120
        )
        assert done.returncode == 2, done.stderr
        assert "BOB_TOKEN" in done.stderr
        assert "server.start" not in done.stderr
        assert "codecage.isolation" not in done.stderr


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


# --- the same limits and the same caller on every face (issue 33, item 3) ------------------


async def call_tool(
    url: str, authorization: str, name: str, arguments: dict[str, Any]
) -> CallToolResult:
    """One MCP tool call over HTTP with `authorization` sent as it is (any spelling)."""
    headers = {"Authorization": authorization}
    async with (
        httpx2.AsyncClient(headers=headers, timeout=httpx2.Timeout(30, read=60)) as http,
        Client(streamable_http_client(url, http_client=http)) as client,
    ):
        return await client.call_tool(name, arguments)


def run_code(url: str, token: str, body: dict[str, Any]) -> httpx2.Response:
    """SandboxFusion's POST /run_code with `token`."""
    return httpx2.post(
        url.removesuffix("/mcp") + "/run_code",
        json={"language": "python", **body},
        headers={"Authorization": f"Bearer {token}"},
        timeout=120,
    )


FACES_CONFIG = """
[serve.clients.alice]
token_env = "ALICE_TOKEN"
runs_per_minute = 2
max_concurrent = 1
max_memory_mb = 256
max_timeout = 5

[serve.clients.carol]
token_env = "CAROL_TOKEN"
max_concurrent = 1
"""
CAROL = "carol-token-" + "c" * 32


async def test_run_code_is_held_to_its_clients_bounds_and_recorded_in_its_name(
    tmp_path: Path,
) -> None:
    """POST /run_code gets a named client's limits (refused above them, lowered to them
    unasked), its admission (counted with its execute_code calls: over the rate a 429 with
    Retry-After) and its name on the audit record; not the server's 2048 MiB and 120 s as
    `library:root`."""
    config = tmp_path / "config.toml"
    config.write_text(FACES_CONFIG)
    db = tmp_path / "audit.db"
    args = ("--config", str(config), "--audit", str(db), "--no-scrub")
    with serving_http(tmp_path, *args, ALICE_TOKEN=ALICE, CAROL_TOKEN=CAROL) as server:
        too_big = run_code(server.url, ALICE, {"code": "1", "memory_limit_MB": 2048}).json()
        too_long = run_code(server.url, ALICE, {"code": "1", "run_timeout": 60}).json()
        first = run_code(server.url, ALICE, {"code": "print('one')"})
        second = await call_tool(server.url, f"Bearer {ALICE}", "execute_code", {"code": "2"})
        over = run_code(server.url, ALICE, {"code": "print('three')"})
        over_mcp = await call_tool(server.url, f"Bearer {ALICE}", "execute_code", {"code": "4"})
    assert too_big["status"] == "SandboxError"
    assert "memory_limit_MB=2048 is above client 'alice''s maximum of 256 MiB" in too_big["message"]
    assert too_long["status"] == "SandboxError"
    assert "run_timeout=60 is above client 'alice''s maximum of 5 s" in too_long["message"]
    assert first.status_code == 200 and first.json()["run_result"]["stdout"] == "one\n"
    assert structured(second)["status"] == "ok"
    # The third run in the minute, whichever face: refused, saying when to retry.
    assert over.status_code == 429, over.text
    assert int(over.headers["retry-after"]) >= 1
    assert "over its rate of 2 runs per minute" in over.json()["detail"]
    assert over_mcp.is_error and "over its rate of 2 runs per minute" in text_of(over_mcp)
    with contextlib.closing(sqlite3.connect(db)) as conn:
        rows = conn.execute(
            "SELECT caller_kind, caller_name, caller_version, limits FROM executions "
            "ORDER BY started_at"
        ).fetchall()
    assert [(kind, name) for kind, name, _, _ in rows] == [("http", "alice")] * 2
    assert sorted(version for _, _, version, _ in rows)[-1] == "run_code"
    limits = json.loads(next(row[3] for row in rows if row[2] == "run_code"))
    # Unasked: run_timeout's default (10) and the server's memory, lowered to the bounds.
    assert (limits["memory_mb"], limits["timeout"]) == (256, 5)


def test_run_code_holds_a_clients_concurrent_runs(tmp_path: Path) -> None:
    """While one run of a client allowed one at a time goes on, its next gets a 429 with
    Retry-After; once the run has ended, the next runs."""
    config = tmp_path / "config.toml"
    config.write_text(FACES_CONFIG)
    args = ("--config", str(config), "--audit", str(tmp_path / "audit.db"))
    with serving_http(tmp_path, *args, ALICE_TOKEN=ALICE, CAROL_TOKEN=CAROL) as server:
        slow: list[httpx2.Response] = []
        body = {"code": "import time; time.sleep(4)", "run_timeout": 30}

        def run_slowly() -> None:  # again if a probe ran first and it was the one refused
            while (response := run_code(server.url, CAROL, body)).status_code == 429:
                pass
            slow.append(response)

        runner = threading.Thread(target=run_slowly)
        runner.start()
        refused = None
        while runner.is_alive() and refused is None:  # probes until one meets the slow run
            probe = run_code(server.url, CAROL, {"code": "1"})
            if probe.status_code == 429:
                refused = probe
        runner.join()
        after = run_code(server.url, CAROL, {"code": "print('after')"})
    assert refused is not None, "no probe was refused while the slow run went on"
    assert refused.headers["retry-after"] == "1"
    assert "runs going, its maximum" in refused.json()["detail"]
    assert slow[0].status_code == 200, slow[0].text
    assert after.status_code == 200 and after.json()["status"] == "Success", after.text
    assert after.json()["run_result"]["stdout"] == "after\n"


SESSIONS_CONFIG = """
[serve.clients.bob]
token_env = "BOB_TOKEN"
max_memory_mb = 128

[sessions]
max_per_client = 2
"""


async def test_open_session_is_held_to_the_clients_memory_and_the_servers_idle_ttl(
    tmp_path: Path,
) -> None:
    config = tmp_path / "config.toml"
    config.write_text(SESSIONS_CONFIG)
    args = ("--config", str(config), "--audit", str(tmp_path / "audit.db"))
    with serving_http(tmp_path, *args, BOB_TOKEN=BOB) as server:
        bob = f"Bearer {BOB}"
        too_big = await call_tool(server.url, bob, "open_session", {"memory_limit_mb": 1024})
        too_idle = await call_tool(server.url, bob, "open_session", {"idle_ttl_seconds": 86_400})
        opened = await call_tool(server.url, bob, "open_session", {"idle_ttl_seconds": 1800})
        session_id = structured(opened)["session_id"]
        await call_tool(server.url, bob, "close_session", {"session_id": session_id})
    assert too_big.is_error
    assert "memory_limit_mb=1024 is above client 'bob''s maximum of 128 MiB" in text_of(too_big)
    assert too_idle.is_error
    # [sessions] max_idle_ttl unset: 1800 s (idle_ttl is 600).
    assert "idle_ttl_seconds=86400 is above this server's maximum of 1800 s" in text_of(too_idle)
    # Unasked, the session's memory is lowered to the client's bound.
    assert structured(opened)["memory_limit_mb"] == 128
    assert structured(opened)["idle_ttl_seconds"] == 1800


def test_the_longest_idle_ttl_is_the_operators_and_holds_its_default() -> None:
    assert SessionSettings().most_idle_ttl == 1800
    assert SessionSettings(idle_ttl=7200).most_idle_ttl == 7200  # the default is allowed
    assert SessionSettings(idle_ttl=60, max_idle_ttl=120).most_idle_ttl == 120
    with pytest.raises(ValueError, match=r"idle_ttl \(600\) is above max_idle_ttl \(120\)"):
        SessionSettings(max_idle_ttl=120)


async def test_the_session_cap_counts_a_token_however_its_header_is_spelled(
    tmp_path: Path,
) -> None:
    """The per-client cap (2) is keyed by the client the token verified, not by the raw
    Authorization header: `Bearer`, `bearer` and extra spaces are one client."""
    config = tmp_path / "config.toml"
    config.write_text(SESSIONS_CONFIG)
    spellings = [f"Bearer {BOB}", f"bearer {BOB}", f"Bearer    {BOB}", f"BEARER {BOB}"]
    args = ("--config", str(config), "--audit", str(tmp_path / "audit.db"))
    with serving_http(tmp_path, *args, BOB_TOKEN=BOB) as server:
        opened = [await call_tool(server.url, s, "open_session", {}) for s in spellings]
        listed = await call_tool(server.url, f"bearer  {BOB}", "list_sessions", {})
        ids = [structured(r)["session_id"] for r in opened if not r.is_error]
        closed = [
            await call_tool(server.url, spellings[-1], "close_session", {"session_id": i})
            for i in ids
        ]
    assert [r.is_error for r in opened] == [False, False, True, True]
    assert "max_per_client=2" in text_of(opened[2])
    assert sorted(s["session_id"] for s in structured(listed)["sessions"]) == sorted(ids)
    assert not any(r.is_error for r in closed)
