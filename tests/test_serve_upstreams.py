"""`codecage serve --mcp-config`: an MCP host's model writes one program that orchestrates
an upstream MCP server, and codecage runs it.

The real `codecage serve` process, driven by the official SDK client over stdio; the
upstream is npm's server-memory (with its file in a temp dir); the tool tree comes from the
real `codecage gen`. Nothing is mocked: the client's call crosses stdio into the server, the
code runs in a sandbox, its tool calls cross the bridge to the broker, the broker's cross
stdio to server-memory, whose file on disk is checked at the end.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from mcp import Client
from mcp_types import CallToolResult, TextContent
from tests._anyio import anyio_backend  # noqa: F401 - a fixture
from tests._cli import serve_stdio

ROOT = Path(__file__).resolve().parent.parent
MEMORY = ROOT / "tools" / "node_modules" / ".bin" / "mcp-server-memory"
CODECAGE = str(Path(sys.executable).with_name("codecage"))

pytestmark = [
    pytest.mark.anyio,
    pytest.mark.skipif(not MEMORY.exists(), reason="scripts/setup installs the npm servers"),
]


@dataclass
class Served:
    client: Client
    memory_file: Path
    stdout_faults: list[Exception]


@pytest.fixture(scope="module")
async def served(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Served]:
    work = tmp_path_factory.mktemp("serve-upstreams")
    memory_file = work / "memory.jsonl"
    config = work / "mcp.json"
    config.write_text(
        json.dumps(
            {
                "mcpServers": {
                    "memory": {
                        "command": str(MEMORY),
                        "env": {"MEMORY_FILE_PATH": str(memory_file)},
                    }
                }
            }
        ),
        encoding="utf-8",
    )
    servers = work / "servers"
    subprocess.run(
        [CODECAGE, "gen", "--mcp-config", str(config), "--all", "--out", str(servers)],
        check=True,
        capture_output=True,
        timeout=120,
    )
    faults: list[Exception] = []
    env = {k: v for k, v in os.environ.items() if not k.startswith("CODECAGE_")}
    async with serve_stdio(
        work,
        *("--mcp-config", str(config), "--servers-dir", str(servers)),
        *("--allow-tool", "memory.create_*,memory.read_graph,memory.search_nodes"),
        env=env,
        read_timeout=120,
        faults=faults,
    ) as c:
        yield Served(c, memory_file, faults)


async def execute(served: Served, code: str) -> dict[str, Any]:
    result: CallToolResult = await served.client.call_tool(
        "execute_code", {"code": code, "timeout": 60}
    )
    text = "\n".join(b.text for b in result.content if isinstance(b, TextContent))
    assert not result.is_error, text
    assert result.structured_content is not None, text
    return result.structured_content


async def test_the_tool_description_tells_the_model_how_to_call_the_servers(
    served: Served,
) -> None:
    tools = {t.name: t for t in (await served.client.list_tools()).tools}
    description = tools["execute_code"].description or ""
    assert "memory" in description
    assert "from servers.<server> import <tool>" in description
    assert "search_tools" in description


async def test_one_program_searches_calls_and_filters_through_the_server(
    served: Served,
) -> None:
    code = """
from codecage.runtime import search_tools
from servers.memory import create_entities, create_relations, read_graph
found = [str(ref.module) for ref in search_tools("create entities", limit=2)]
await create_entities.call(entities=[
    {"name": "codecage", "entityType": "project", "observations": ["python", "sandbox"]},
    {"name": "atlas", "entityType": "project", "observations": ["python"]},
    {"name": "zeta", "entityType": "project", "observations": ["rust"]},
    {"name": "ana", "entityType": "person", "observations": []},
])
maintains = {"from": "ana", "to": "codecage", "relationType": "maintains"}
await create_relations.call(relations=[maintains])
graph = read_graph.call_sync()
python = sorted(e["name"] for e in graph["entities"] if "python" in e["observations"])
{"found": found[0], "python": python, "relations": len(graph["relations"])}
"""
    run = await execute(served, code)
    assert run["status"] == "ok", run["error"]
    assert run["return_value"] == {
        "found": "servers.memory.create_entities",
        "python": ["atlas", "codecage"],
        "relations": 1,
    }
    calls = [(e["data"]["tool"], e["data"]["status"]) for e in run["events"]]
    assert calls == [
        ("create_entities", "ok"),
        ("create_relations", "ok"),
        ("read_graph", "ok"),
    ]
    stored = served.memory_file.read_text(encoding="utf-8")
    assert '"name":"zeta"' in stored.replace(" ", "")  # the upstream wrote it on the host


async def test_a_tool_outside_the_allow_list_is_refused_to_the_code(served: Served) -> None:
    code = """
from codecage.runtime import ToolCallError
from servers.memory import create_entities, delete_entities
# Its own entity (this test may run alone: the tiers pick tests, not files).
create_entities.call_sync(entities=[{"name": "zeta", "entityType": "project", "observations": []}])
try:
    delete_entities.call_sync(entityNames=["zeta"])
    outcome = "deleted"
except ToolCallError as exc:
    outcome = exc.kind
outcome
"""
    run = await execute(served, code)
    assert run["return_value"] == "not_allowed"
    calls = [e["data"] for e in run["events"] if e["kind"] == "tool_call"]
    assert [(c["tool"], c["status"]) for c in calls][-1] == ("delete_entities", "not_allowed")
    assert '"zeta"' in served.memory_file.read_text(encoding="utf-8").replace(" ", "")


async def test_the_upstream_server_never_writes_on_the_protocol_stream(served: Served) -> None:
    await execute(served, "from servers.memory import read_graph\nread_graph.call_sync()")
    assert served.stdout_faults == []
