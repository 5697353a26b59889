"""Egress through the MCP face, end to end: a real `codecage serve` over stdio, a real MCP
client, a local HTTP server whose name comes from the config's resolver table."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
from mcp import Client
from tests._anyio import anyio_backend  # noqa: F401 - a fixture
from tests._cli import serve_configured
from tests._web import QuietHandler, serving_http_on_loopback


class _Handler(QuietHandler):
    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        self.reply(json.dumps({"path": self.path}).encode())


@pytest.fixture(scope="module")
def port() -> Iterator[int]:
    with serving_http_on_loopback(_Handler) as httpd:
        yield httpd.server_address[1]


@pytest.fixture(scope="module")
async def client(tmp_path_factory: pytest.TempPathFactory, port: int) -> AsyncIterator[Client]:
    workdir = tmp_path_factory.mktemp("serve-egress")
    hosts = [f"api.test:{port}", f"127.0.0.1:{port}"]
    config = (
        f'[network]\nceiling = {json.dumps(hosts)}\n[network.resolve]\n"api.test" = ["127.0.0.1"]\n'
    )
    async with serve_configured(workdir, config) as c:
        yield c


def _fetch(port: int, path: str) -> str:
    return (
        "import urllib.request\n"
        f"urllib.request.urlopen('http://api.test:{port}{path}', timeout=10).read().decode()\n"
    )


def _text(result: Any) -> str:
    return "\n".join(getattr(block, "text", "") for block in result.content)


@pytest.mark.anyio
async def test_execute_code_reaches_the_hosts_it_asks_for_within_the_ceiling(
    client: Client, port: int
) -> None:
    hosts = [f"api.test:{port}", f"127.0.0.1:{port}"]
    ran = await client.call_tool(
        "execute_code", {"code": _fetch(port, "/mcp"), "allow_hosts": hosts}
    )
    data = ran.structured_content
    assert data["status"] == "ok", _text(ran)
    assert json.loads(data["return_value"]) == {"path": "/mcp"}
    assert [e["kind"] for e in data["events"]].count("network_allowed") == 1
    without = await client.call_tool("execute_code", {"code": _fetch(port, "/none")})
    assert without.structured_content["status"] == "error"
    outside = await client.call_tool(
        "execute_code", {"code": "1", "allow_hosts": ["elsewhere.test"]}
    )
    assert outside.is_error and "allow_hosts" in _text(outside)


@pytest.mark.anyio
async def test_a_session_opened_with_hosts_reaches_them_in_every_run(
    client: Client, port: int
) -> None:
    hosts = [f"api.test:{port}", f"127.0.0.1:{port}"]
    opened = await client.call_tool("open_session", {"allow_hosts": hosts})
    assert not opened.is_error, _text(opened)
    session_id = opened.structured_content["session_id"]
    try:
        for path in ("/s1", "/s2"):
            ran = await client.call_tool(
                "execute_code", {"code": _fetch(port, path), "session_id": session_id}
            )
            assert json.loads(ran.structured_content["return_value"]) == {"path": path}, _text(ran)
        mixed = await client.call_tool(
            "execute_code", {"code": "1", "session_id": session_id, "allow_hosts": hosts}
        )
        assert mixed.is_error and "open_session" in _text(mixed)
    finally:
        await client.call_tool("close_session", {"session_id": session_id})
