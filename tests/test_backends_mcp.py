"""execute_code(backend=...): a call may ask for a backend the operator enabled ([serve]
backends), through a real MCP client over stdio; any other is refused in the terms of the
tool's arguments. Issue 20, items 3 and 5."""

from __future__ import annotations

import os
import shutil
from collections.abc import AsyncIterator
from typing import Any

import pytest
from mcp import Client
from tests._anyio import anyio_backend  # noqa: F401 - a fixture
from tests._cli import serve_configured

pytestmark = [
    pytest.mark.anyio,
    pytest.mark.skipif(
        shutil.which("runsc") is None or os.geteuid() != 0, reason="the gVisor backend needs root"
    ),
]


@pytest.fixture(scope="module")
async def client(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Client]:
    workdir = tmp_path_factory.mktemp("serve-backends")
    async with serve_configured(workdir, '[serve]\nbackends = ["bwrap", "gvisor"]\n') as c:
        yield c


async def _run(client: Client, **arguments: Any) -> Any:
    return await client.call_tool("execute_code", arguments)


async def test_the_tool_names_the_backends_the_operator_enabled(client: Client) -> None:
    tools = {tool.name: tool for tool in (await client.list_tools()).tools}
    described = tools["execute_code"].input_schema["properties"]["backend"]["description"]
    assert "bwrap (the default)" in described and "gvisor" in described


async def test_a_call_runs_on_the_backend_it_asks_for(client: Client) -> None:
    default = await _run(client, code="6 * 7")
    on_gvisor = await _run(client, code="6 * 7", backend="gvisor")
    assert default.structured_content["backend"] == "bwrap"
    assert on_gvisor.structured_content["backend"] == "gvisor"
    assert on_gvisor.structured_content["return_value"] == 42


async def test_a_backend_not_enabled_is_refused_naming_the_choices(client: Client) -> None:
    refused = await _run(client, code="1", backend="landlock")
    assert refused.is_error
    text = refused.content[0].text  # type: ignore[union-attr]
    assert "landlock" in text and "bwrap, gvisor" in text
