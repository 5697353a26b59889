"""codecage.runtime as agent code sees it: inside a real sandbox, with the import policy on.

The bridge's failure modes are in test_bridge.py; tokenization in test_tokenize.py.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from tests._cli import codecage

from codecage import Options, Sandbox
from codecage.bridge import tooling, upstreams
from codecage.bridge.broker import Broker

ROOT = Path(__file__).resolve().parent.parent
BIN = ROOT / "tools" / "node_modules" / ".bin"

needs_npm = pytest.mark.skipif(
    not (BIN / "mcp-server-memory").exists(), reason="scripts/setup installs the npm servers"
)


@pytest.fixture(scope="module")
def plain() -> Iterator[Sandbox]:
    with Sandbox(pool=False) as sandbox:
        yield sandbox


@pytest.fixture(scope="module")
def memory(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sandbox]:
    """A sandbox with the memory server's tools generated into its `/servers`."""
    if not (BIN / "mcp-server-memory").exists():
        pytest.skip("scripts/setup installs the npm servers")
    tmp = tmp_path_factory.mktemp("memory")
    config = {
        "mcpServers": {
            "memory": {
                "command": str(BIN / "mcp-server-memory"),
                "env": {"MEMORY_FILE_PATH": str(tmp / "memory.jsonl")},
            }
        }
    }
    broker = Broker(upstreams.parse(config, source="test", environ={}))
    servers = tmp / "servers"
    tooling.generate(broker, ["memory"], servers)
    try:
        with Sandbox(
            tools=broker, pool=False, allowed_imports=["sys"], options=Options(servers_dir=servers)
        ) as sandbox:
            yield sandbox
    finally:
        broker.close()


def ok(sandbox: Sandbox, code: str) -> object:
    result = sandbox.run(code, limits={"timeout": 60})
    assert result.status == "ok", (result.error, result.stderr)
    return result.return_value


def test_the_runtime_imports_under_the_basic_profile(plain: Sandbox) -> None:
    value = ok(plain, "import codecage.runtime as r\nsorted(r.__all__)")
    assert isinstance(value, list) and "call_tool" in value and "search_tools" in value


def test_a_tool_call_without_upstream_servers_is_a_clear_error(plain: Sandbox) -> None:
    code = """
from codecage.runtime import ToolCallError, call_tool_sync
try:
    call_tool_sync("memory", "read_graph")
except ToolCallError as exc:
    result = [exc.kind, str(exc)]
result
"""
    kind, message = ok(plain, code)  # type: ignore[misc]
    assert kind == "no_servers"
    assert "--mcp-config" in message


def test_scrub_asks_the_host(plain: Sandbox) -> None:
    value = ok(plain, "from codecage.runtime import scrub\nscrub('mail ana@example.com now')")
    assert value == "mail [EMAIL] now"


@pytest.mark.parametrize("path", ["../etc/passwd", "/etc/passwd", "a/../../x"])
def test_workspace_paths_cannot_leave_it(plain: Sandbox, path: str) -> None:
    code = f"""
from codecage.runtime import WorkspacePathError, workspace
try:
    workspace.read_text({path!r})
    outcome = "read"
except WorkspacePathError as exc:
    outcome = str(exc)
outcome
"""
    assert "outside the workspace" in str(ok(plain, code))


def test_workspace_round_trip_and_listing(plain: Sandbox) -> None:
    code = """
from codecage.runtime import workspace
workspace.write_json("out/report.json", {"n": 3})
workspace.write_text("notes.txt", "hi")
[workspace.list(), workspace.read_json("out/report.json")]
"""
    assert ok(plain, code) == [["notes.txt", "out/report.json"], {"n": 3}]


def test_run_async_works_inside_top_level_await_code(plain: Sandbox) -> None:
    code = """
import asyncio
from codecage.runtime import run_async
async def twice(x):
    await asyncio.sleep(0)
    return 2 * x
await asyncio.sleep(0)
run_async(twice(21))
"""
    assert ok(plain, code) == 42


def test_the_logger_writes_json_lines_to_stderr(plain: Sandbox) -> None:
    result = plain.run(
        'from codecage.runtime import logger\nlogger.info("done", extra={"rows": 3})'
    )
    assert result.status == "ok"
    entry = json.loads(result.stderr.strip().splitlines()[-1])
    assert entry == {"level": "info", "msg": "done", "rows": 3}


@needs_npm
def test_search_tools_finds_generated_tools_without_importing_them(memory: Sandbox) -> None:
    code = """
import sys
from codecage.runtime import search_tools
found = search_tools("create entity", detail="basic", limit=3)
[[str(r.module), r.summary] for r in found] + [[m for m in sys.modules if m.startswith("servers")]]
"""
    *found, imported = ok(memory, code)  # type: ignore[misc]
    assert found[0][0] == "servers.memory.create_entities"
    assert "entities" in found[0][1].lower()
    assert imported == []  # nothing of /servers was imported to search it


@needs_npm
def test_generated_modules_call_the_real_server_from_the_sandbox(memory: Sandbox) -> None:
    code = """
from codecage.runtime import search_tools
from servers.memory import create_entities, read_graph
await create_entities.call(entities=[{"name": "n1", "entityType": "t", "observations": []}])
ref = search_tools("read graph", detail="name", limit=1)[0]
graph = ref.load().call_sync()
[e["name"] for e in graph["entities"]]
"""
    assert ok(memory, code) == ["n1"]


@needs_npm
def test_the_tool_tree_is_read_only_in_the_sandbox(memory: Sandbox) -> None:
    result = memory.run(
        "open('/servers/memory/read_graph.py', 'a').write('x')", limits={"timeout": 30}
    )
    assert result.status == "error"
    assert result.error is not None and result.error.type in ("OSError", "PermissionError")


@pytest.mark.skipif(
    not (ROOT / "tools" / "demo" / "node_modules" / ".bin" / "mcp-server-memory").exists(),
    reason="scripts/setup --demo (or --test) installs the demo's memory server",
)
def test_the_readme_demo_runs(tmp_path: Path) -> None:
    """`scripts/demo`'s main step: the example agent program against the memory server."""
    env = {**os.environ, "MEMORY_FILE_PATH": str(tmp_path / "memory.jsonl")}
    run = codecage(
        "run",
        "--json",
        "--mcp-config",
        "examples/mcp.json",
        "--file",
        "examples/memory_agent.py",
        cwd=ROOT,
        env=env,
    )
    assert run.returncode == 0, run.stderr
    result = json.loads(run.stdout)
    assert result["return_value"] == {
        "python_projects": ["atlas", "codecage"],
        "maintained_by_ana": ["atlas", "codecage"],
    }
    calls = [e["data"]["tool"] for e in result["events"] if e["kind"] == "tool_call"]
    assert calls == ["create_entities", "create_relations", "read_graph"]
    assert "codecage" in (tmp_path / "memory.jsonl").read_text(encoding="utf-8")
