"""Issue 36: the tools' descriptions say what the tools do. Each sentence a model reads in
tools/list is named below by a phrase it must hold, and each such claim that behaviour can
show is checked against a real `codecage serve` over stdio (open_session said a timeout
closes the session; it keeps its state, which is what the description now says)."""

from __future__ import annotations

import contextlib
import re
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import pytest
from mcp import Client
from mcp_types import CallToolResult, ImageContent, TextContent
from tests._cli import serve_stdio

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(600)]

# Each sentence of a description holds one of its tool's phrases; each phrase is in the
# description, and the test named beside it checks what it claims (None: advice, nothing a
# test can see).
CLAIMS: dict[str, dict[str, str | None]] = {
    "open_session": {
        "lasts between execute_code calls given its session_id": "state_lasts",
        "load once, then explore": None,
        "a timeout interrupts the run (KeyboardInterrupt) and keeps the state": "timeout_keeps",
        "Memory, profile, imports and hosts are set here": "set_at_open",
        "The session ends after 600 s unused or 5 s in all": "ends",
        "Its idle_ttl_seconds may be at most 1800": "idle_ttl_max",
        "At most 2 open per client": "at_most",
    },
    "close_session": {"freeing its sandbox; its state is gone": "ends"},
    "list_sessions": {"id, runs, seconds until each closes unless used": "listed"},
    "execute_code": {
        "Run Python 3.11 code in a fresh sandbox": "fresh",
        "The text holds stdout, stderr, the last expression's value and the traceback": "text",
        "No network: this server allows no host": "no_network",
        "The whole standard library and the installed data packages": "imports",
        "A POSIX shell and common tools work through subprocess": "shell",
        "Defaults: timeout 30 s (at most 120), memory 512 MiB (at most 2048)": "defaults",
        "PNG, JPEG, GIF and WebP files the code saves come back as images": "images",
        "The reply stays within about 20,000 tokens": "budget",
    },
}

CONFIG = "[sessions]\nmax_per_client = 2\nlifetime = 5\n"


@pytest.fixture(scope="module")
async def server(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Client]:
    workdir = tmp_path_factory.mktemp("descriptions")
    config = workdir / "config.toml"
    config.write_text(CONFIG, encoding="utf-8")
    config.chmod(0o600)
    async with serve_stdio(
        workdir, "--no-pool", env={"CODECAGE_CONFIG": str(config)}, read_timeout=120
    ) as client:
        yield client


def _text(result: CallToolResult) -> str:
    return "\n".join(b.text for b in result.content if isinstance(b, TextContent))


async def _call(client: Client, tool: str, **arguments: Any) -> CallToolResult:
    return await client.call_tool(tool, arguments)


async def _run(client: Client, code: str, **arguments: Any) -> dict[str, Any]:
    result = await _call(client, "execute_code", code=code, **arguments)
    assert not result.is_error and result.structured_content is not None, _text(result)
    return result.structured_content


@contextlib.asynccontextmanager
async def _session(client: Client, **arguments: Any) -> AsyncIterator[str]:
    opened = await _call(client, "open_session", **arguments)
    assert not opened.is_error, _text(opened)
    session_id = (opened.structured_content or {})["session_id"]
    try:
        yield session_id
    finally:
        await _call(client, "close_session", session_id=session_id)


async def test_every_sentence_of_each_description_is_a_claim_named_here(server: Client) -> None:
    tools = {t.name: t for t in (await server.list_tools()).tools}
    for name, claims in CLAIMS.items():
        description = tools[name].description or ""
        for phrase in claims:
            assert phrase in description, (name, phrase, description)
        for sentence in re.split(r"(?<=[.)])\s+(?=[A-Z])", description):
            assert any(p in sentence for p in claims), (name, sentence)


async def test_state_lasts(server: Client, tmp_path: Path) -> None:
    async with _session(server) as sid:
        await _run(
            server,
            "import json\nx = 41\ndef f(v):\n    return v + 1\n"
            "open('/workspace/kept.txt', 'w').write('kept')",
            session_id=sid,
        )
        later = await _run(
            server, "(f(x), json.dumps(1), open('/workspace/kept.txt').read())", session_id=sid
        )
    assert later["return_value"] == [42, "1", "kept"]


async def test_timeout_keeps(server: Client) -> None:
    async with _session(server) as sid:
        await _run(server, "x = 41", session_id=sid)
        stopped = await _call(
            server, "execute_code", code="while True:\n    pass", session_id=sid, timeout=2
        )
        assert (stopped.structured_content or {})["status"] == "timeout"
        assert "KeyboardInterrupt" in _text(stopped)
        after = await _run(server, "x + 1", session_id=sid)
    assert after["return_value"] == 42


async def test_set_at_open(server: Client) -> None:
    async with _session(server, memory_limit_mb=256, profile="basic") as sid:
        listed = await _call(server, "list_sessions")
        (mine,) = [
            s for s in (listed.structured_content or {})["sessions"] if s["session_id"] == sid
        ]
        assert (mine["memory_limit_mb"], mine["profile"]) == (256, "basic")
        for name, value in (
            ("memory_limit_mb", 512),
            ("profile", "standard"),
            ("allowed_imports", ["socket"]),
            ("allow_hosts", ["example.com"]),
        ):
            refused = await _call(server, "execute_code", code="1", session_id=sid, **{name: value})
            assert refused.is_error and "open_session" in _text(refused), name
        ran = await _run(server, "1", session_id=sid, timeout=5)  # its own timeout: fine
        assert ran["limits"]["timeout"] == 5


@pytest.mark.parametrize(
    "ending",
    [
        "close_session",
        "idle",
        "lifetime",
        "import os\nos._exit(3)",
        "b = bytearray(10**10)",
        "import time\nwhile True:\n    try:\n        time.sleep(0.05)\n"
        "    except KeyboardInterrupt:\n        pass",
    ],
    ids=["close", "idle", "lifetime", "os_exit", "memory", "ignores_timeout"],
)
async def test_ends(server: Client, ending: str) -> None:
    arguments: dict[str, Any] = {"memory_limit_mb": 128}
    if ending == "idle":
        arguments["idle_ttl_seconds"] = 1
    opened = await _call(server, "open_session", **arguments)
    assert not opened.is_error, _text(opened)
    sid = (opened.structured_content or {})["session_id"]
    await _run(server, "x = 1", session_id=sid)
    if ending == "close_session":
        assert not (await _call(server, "close_session", session_id=sid)).is_error
    elif ending in ("idle", "lifetime"):
        # Unused (idle), or used all along (lifetime): it ends. The bound is only there so
        # that a session that never ends fails the test rather than hang it.
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            listed = await _call(server, "list_sessions")
            ids = [s["session_id"] for s in (listed.structured_content or {})["sessions"]]
            if sid not in ids:
                break
            if ending == "lifetime":
                await _call(server, "execute_code", code="x", session_id=sid)
            await anyio.sleep(0.2)
        assert sid not in ids
    else:
        await _call(server, "execute_code", code=ending, session_id=sid, timeout=2)
    after = await _call(server, "execute_code", code="x", session_id=sid)
    assert after.is_error and "open_session" in _text(after), _text(after)


async def test_at_most(server: Client) -> None:
    async with _session(server), _session(server):
        third = await _call(server, "open_session")
        assert third.is_error and "close_session" in _text(third)


async def test_idle_ttl_max(server: Client) -> None:
    over = await _call(server, "open_session", idle_ttl_seconds=1801)
    assert over.is_error and "idle_ttl_seconds" in _text(over) and "1800" in _text(over)
    async with _session(server, idle_ttl_seconds=1800) as sid:
        listed = await _call(server, "list_sessions")
        (mine,) = (listed.structured_content or {})["sessions"]
        assert mine["session_id"] == sid


async def test_listed(server: Client) -> None:
    async with _session(server) as sid:
        await _run(server, "1", session_id=sid)
        listed = await _call(server, "list_sessions")
    (mine,) = (listed.structured_content or {})["sessions"]
    assert mine["session_id"] == sid and mine["runs"] == 1
    assert 0 < mine["expires_in_seconds"] <= 600
    assert f"{sid}: 1 runs, closes in" in _text(listed)


async def test_fresh(server: Client) -> None:
    first = await _run(server, "import sys\nopen('left.txt', 'w').write('x')\nsys.version_info[:2]")
    assert first["return_value"] == [3, 11]
    second = await _run(server, "import os\nos.path.exists('/workspace/left.txt')")
    assert second["return_value"] is False


async def test_text(server: Client) -> None:
    result = await _call(
        server, "execute_code", code="import sys\nprint('out')\nprint('err', file=sys.stderr)\n1/0"
    )
    text = _text(result)
    assert "out" in text and "stderr:\nerr" in text and "ZeroDivisionError" in text
    data = result.structured_content or {}
    assert data["status"] == "error" and data["exit_code"] == 1 and data["usage"]["wall_ms"] >= 0
    value = await _call(server, "execute_code", code="open('f.txt', 'w').write('1')\n6 * 7")
    assert "→ 42" in _text(value)
    assert [f["path"] for f in (value.structured_content or {})["files"]] == ["f.txt"]


async def test_no_network(server: Client) -> None:
    data = await _run(
        server,
        "import socket\ntry:\n    socket.create_connection(('192.0.2.1', 80), timeout=5)\n"
        "    'connected'\nexcept OSError as e:\n    type(e).__name__",
    )
    assert data["return_value"] != "connected"


async def test_imports(server: Client) -> None:
    data = await _run(server, "import sqlite3, numpy, pandas, matplotlib\n'ok'")
    assert data["return_value"] == "ok"


async def test_shell(server: Client) -> None:
    data = await _run(
        server,
        "import asyncio, subprocess\nawait asyncio.sleep(0)\n"
        "subprocess.run(['sh', '-c', 'echo hello | wc -c'], capture_output=True, text=True)"
        ".stdout.strip()",
    )
    assert data["return_value"] == "6"


async def test_defaults(server: Client) -> None:
    data = await _run(server, "1")
    assert (data["limits"]["timeout"], data["limits"]["memory_mb"]) == (30, 512)
    for name, value in (("timeout", 121), ("memory_limit_mb", 2049)):
        refused = await _call(server, "execute_code", code="1", **{name: value})
        assert refused.is_error, name
    for name, value in (("timeout", 120), ("memory_limit_mb", 2048)):
        assert not (await _call(server, "execute_code", code="1", **{name: value})).is_error


async def test_images(server: Client) -> None:
    magic = {
        "a.png": b"\x89PNG\r\n\x1a\n" + bytes(16),
        "b.jpg": b"\xff\xd8\xff\xe0" + bytes(16),
        "c.gif": b"GIF89a" + bytes(16),
        "d.webp": b"RIFF\x10\x00\x00\x00WEBPVP8 " + bytes(16),
    }
    code = "".join(f"open({n!r}, 'wb').write({d!r})\n" for n, d in magic.items())
    code += "open('e.svg', 'w').write('<svg xmlns=\"http://www.w3.org/2000/svg\"/>')\n"
    result = await _call(server, "execute_code", code=code, return_files=["e.svg"])
    images = sorted(b.mime_type for b in result.content if isinstance(b, ImageContent))
    assert images == ["image/gif", "image/jpeg", "image/png", "image/webp"]
    assert "<svg" in "\n".join(b.text for b in result.content[1:] if isinstance(b, TextContent))


async def test_budget(server: Client) -> None:
    result = await _call(server, "execute_code", code="for i in range(300_000):\n    print(i)")
    text = _text(result)
    assert len(result.model_dump_json(by_alias=True, exclude_none=True)) <= 20_000 * 4
    assert text.startswith("0\n1\n") and "299999\n" in text and "cut here" in text


def test_the_claims_name_tests_that_exist() -> None:
    here = sys.modules[__name__]
    for claims in CLAIMS.values():
        for test in claims.values():
            assert test is None or hasattr(here, f"test_{test}"), test
