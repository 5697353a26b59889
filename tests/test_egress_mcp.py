"""Egress through the MCP face, end to end: a real `codecage serve` over stdio, a real MCP
client, a local HTTP server whose name comes from the config's resolver table."""

from __future__ import annotations

import http.server
import json
import threading
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
from mcp import Client
from tests._cli import serve_stdio


class _Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = json.dumps({"path": self.path}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def port() -> Iterator[int]:
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield httpd.server_address[1]
    httpd.shutdown()
    httpd.server_close()


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
async def client(tmp_path_factory: pytest.TempPathFactory, port: int) -> AsyncIterator[Client]:
    workdir = tmp_path_factory.mktemp("serve-egress")
    config = workdir / "config.toml"
    hosts = [f"api.test:{port}", f"127.0.0.1:{port}"]
    config.write_text(
        f"[network]\nceiling = {json.dumps(hosts)}\n"
        '[network.resolve]\n"api.test" = ["127.0.0.1"]\n',
        encoding="utf-8",
    )
    config.chmod(0o600)
    async with serve_stdio(workdir, env={"CODECAGE_CONFIG": str(config)}, read_timeout=120) as c:
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
