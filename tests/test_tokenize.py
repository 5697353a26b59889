"""Tokenization through the broker, end to end with real upstream servers.

Customer records with personal data sit in a directory served by npm's reference
filesystem server. Agent code in the sandbox reads them through the bridge, and writes
each customer into npm's reference memory server. With tokenization on, the code (and so
its output, the model's view) sees only tokens such as [EMAIL_1], while the memory server
receives the real values, because the broker puts them back into the arguments.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from codecage import Options, Sandbox
from codecage.bridge import upstreams
from codecage.bridge.broker import Broker

ROOT = Path(__file__).resolve().parent.parent
BIN = ROOT / "tools" / "node_modules" / ".bin"

CUSTOMERS = [
    {"name": "Ana Lima", "email": "ana.lima@example.com", "phone": "+1 415 555 0132"},
    {"name": "Bo Chen", "email": "bo.chen@example.org", "phone": "+44 20 7946 0958"},
]

AGENT = """
import json
from codecage.runtime import call_tool

text = await call_tool("files", "read_text_file", {"path": DATA + "/customers.json"})
if isinstance(text, dict):
    text = text.get("content", "")
customers = json.loads(text)
print("read", customers)
await call_tool("memory", "create_entities", {"entities": [
    {"name": c["name"], "entityType": "customer",
     "observations": ["email " + c["email"], "phone " + c["phone"]]}
    for c in customers
]})
graph = await call_tool("memory", "read_graph", {})
print("graph", json.dumps(graph))
[c["email"] for c in customers]
"""

pytestmark = pytest.mark.skipif(
    not (BIN / "mcp-server-memory").exists(), reason="scripts/setup installs the npm servers"
)


@pytest.fixture
def world(tmp_path: Path) -> Iterator[tuple[Broker, Path, Path]]:
    data = tmp_path / "data"
    data.mkdir()
    (data / "customers.json").write_text(json.dumps(CUSTOMERS), encoding="utf-8")
    memory_file = tmp_path / "memory.jsonl"
    config = {
        "mcpServers": {
            "files": {"command": str(BIN / "mcp-server-filesystem"), "args": [str(data)]},
            "memory": {
                "command": str(BIN / "mcp-server-memory"),
                "env": {"MEMORY_FILE_PATH": str(memory_file)},
            },
        }
    }
    broker = Broker(upstreams.parse(config, source="test", environ={}))
    try:
        yield broker, data, memory_file
    finally:
        broker.close()


def run_agent(broker: Broker, data: Path, *, tokenize: bool) -> tuple[str, object]:
    with Sandbox(tools=broker, pool=False, options=Options(tokenize=tokenize)) as sandbox:
        result = sandbox.run(f"DATA = {str(data)!r}\n" + AGENT, limits={"timeout": 60})
    assert result.status == "ok", (result.error, result.stderr, result.events)
    return result.stdout, result.return_value


def test_the_sandbox_sees_tokens_while_the_destination_gets_the_real_values(
    world: tuple[Broker, Path, Path],
) -> None:
    broker, data, memory_file = world
    stdout, value = run_agent(broker, data, tokenize=True)

    for customer in CUSTOMERS:
        assert customer["email"] not in stdout
        assert customer["email"].split("@")[0] not in stdout
        assert customer["phone"] not in stdout
        assert customer["name"] in stdout  # names are not a category: they pass
    assert value == ["[EMAIL_1]", "[EMAIL_2]"]
    assert "[PHONE_1]" in stdout and "[PHONE_2]" in stdout
    # Read back from the memory server, the values are tokenized again, the same tokens.
    graph_line = next(line for line in stdout.splitlines() if line.startswith("graph "))
    assert "email [EMAIL_1]" in graph_line and "email [EMAIL_2]" in graph_line

    stored = memory_file.read_text(encoding="utf-8")
    for customer in CUSTOMERS:
        assert f"email {customer['email']}" in stored
        assert f"phone {customer['phone']}" in stored
    assert "[EMAIL_" not in stored and "[PHONE_" not in stored


def test_without_tokenization_the_code_sees_the_values(
    world: tuple[Broker, Path, Path],
) -> None:
    broker, data, memory_file = world
    stdout, value = run_agent(broker, data, tokenize=False)
    # Scrubbing still hides them in what leaves the sandbox (if it is on); the return
    # value shows what the code itself held.
    assert value is not None
    assert "[EMAIL_1]" not in json.dumps(value) and "[EMAIL_1]" not in stdout
    assert "ana.lima@example.com" in memory_file.read_text(encoding="utf-8")


def test_a_token_the_vault_never_issued_reaches_the_tool_unchanged(
    world: tuple[Broker, Path, Path],
) -> None:
    broker, _data, memory_file = world
    code = """
from codecage.runtime import call_tool
await call_tool("memory", "create_entities", {"entities": [
    {"name": "guess", "entityType": "probe", "observations": ["[EMAIL_7]"]}]})
"""
    with Sandbox(tools=broker, pool=False, options=Options(tokenize=True)) as sandbox:
        result = sandbox.run(code, limits={"timeout": 60})
    assert result.status == "ok", result.error
    assert '"[EMAIL_7]"' in memory_file.read_text(encoding="utf-8")


def test_each_run_has_its_own_vault(world: tuple[Broker, Path, Path]) -> None:
    """A token from one run means nothing in the next: the vault went with the run."""
    broker, data, memory_file = world
    run_agent(broker, data, tokenize=True)
    code = """
from codecage.runtime import call_tool
await call_tool("memory", "add_observations", {"observations": [
    {"entityName": "Ana Lima", "contents": ["again [EMAIL_1]"]}]})
"""
    with Sandbox(tools=broker, pool=False, options=Options(tokenize=True)) as sandbox:
        result = sandbox.run(code, limits={"timeout": 60})
    assert result.status == "ok", result.error
    stored = memory_file.read_text(encoding="utf-8")
    assert "again [EMAIL_1]" in stored
    assert "again ana.lima@example.com" not in stored
