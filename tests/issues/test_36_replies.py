"""Issue 36: an MCP reply spends its budget where the model reads it (the text), and the
tool list is small enough to load without thinking twice. Through a real MCP client over
stdio (`codecage serve` as a host starts it)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
from mcp_types import CallToolResult, TextContent
from tests._cli import serve_stdio

from codecage.mcp import reply, sessions
from codecage.mcp.tools import SandboxInfoReply
from codecage.models import ValidationReport

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(180)]

BIG_DICT = "{f'key{i:05}': i for i in range(50_000)}"


def _text(result: CallToolResult) -> str:
    block = result.content[0]
    assert isinstance(block, TextContent)
    return block.text


def _size(value: Any) -> int:
    return len(json.dumps(value, ensure_ascii=False, separators=(",", ":")))


async def test_a_big_return_value_is_spent_in_the_text_and_structured_as_json(
    tmp_path: Path,
) -> None:
    async with serve_stdio(tmp_path) as client:
        result = await client.call_tool("execute_code", {"code": BIG_DICT})
    assert not result.is_error, _text(result)
    text = _text(result)
    data = result.structured_content
    assert data is not None
    value = data["return_value"]
    # The text holds most of the reply: far more than the old 2 KB of the repr.
    assert len(text) > 40_000, len(text)
    assert text.count("'key") > 2_000 and "'key00000': 0" in text and "'key49999': 49999" in text
    assert "cut here" in text and "return_files" in text  # says what was cut and what to do
    # Structured: the value as JSON (a mapping, not a quoted repr), its head only, and never
    # more than the text shows.
    assert isinstance(value, dict) and data["return_value_truncated"] is True
    assert list(value)[:2] == ["key00000", "key00001"] and value["key00001"] == 1
    assert all(f"'{key}': {n}" in text for key, n in value.items())
    assert _size(value) < len(text) // 10
    assert _size(data) < len(text)


async def test_a_value_that_fits_is_whole_in_both(tmp_path: Path) -> None:
    async with serve_stdio(tmp_path) as client:
        result = await client.call_tool("execute_code", {"code": "{'a': [1, 2], 'b': None}"})
    data = result.structured_content
    assert data is not None
    assert data["return_value"] == {"a": [1, 2], "b": None}
    assert data["return_value_truncated"] is False
    assert "→ {'a': [1, 2], 'b': None}" in _text(result)


# --- tools/list ---------------------------------------------------------------------------

TOOLS_LIST_BYTES = 12_000
# What a typed client builds its result type from: each type, property, item, $ref, union
# and small enum. (Descriptions, titles, defaults, bounds, `required` and the values of an
# open enum such as the event kinds are left out of the published output schemas.)
_TYPE_KEYWORDS = {"type", "properties", "items", "$ref", "anyOf", "$defs", "enum"}


def _skeleton(schema: Any) -> Any:
    if isinstance(schema, list):
        return [_skeleton(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    kept: dict[str, Any] = {}
    for key, value in schema.items():
        if key in ("properties", "$defs"):
            kept[key] = {name: _skeleton(sub) for name, sub in value.items()}
        elif key == "additionalProperties" and isinstance(value, dict):
            kept[key] = _skeleton(value)
        elif key == "enum" and len(value) > 8:
            continue
        elif key in _TYPE_KEYWORDS:
            kept[key] = _skeleton(value)
    return kept


def _upstream_config(tmp_path: Path) -> Path:
    config = tmp_path / "mcp.json"
    server = {"command": sys.executable, "args": ["-m", "mcp_server_time"]}
    config.write_text(json.dumps({"mcpServers": {"time": server}}), encoding="utf-8")
    return config


@pytest.mark.parametrize("configured", [False, True], ids=["defaults", "tools-and-network"])
async def test_tools_list_is_small_and_keeps_every_type_a_typed_client_uses(
    tmp_path: Path, configured: bool
) -> None:
    args = ("--mcp-config", str(_upstream_config(tmp_path)), "--allow-host", "example.com")
    async with serve_stdio(tmp_path, *(args if configured else ())) as client:
        listed = await client.list_tools()
        # As sent on the wire (the SDK writes compact JSON).
        sent = listed.model_dump_json(by_alias=True, exclude_none=True)
        tools = {t.name: t for t in listed.tools}
        ran = await client.call_tool("execute_code", {"code": "{'a': [1, 2]}"})
    assert len(sent.encode()) <= TOOLS_LIST_BYTES, len(sent.encode())
    if configured:
        assert "time" in (tools["execute_code"].description or "")
    models = {
        "execute_code": reply.ExecutionReply,
        "validate_code": ValidationReport,
        "get_sandbox_info": SandboxInfoReply,
        "open_session": sessions.SessionReply,
        "list_sessions": sessions.SessionsReply,
        "close_session": sessions.ClosedReply,
    }
    for name, model in models.items():
        published = tools[name].output_schema
        assert published is not None, name
        assert _skeleton(published) == _skeleton(model.model_json_schema()), name
    # The input schemas keep what a model reads to call a tool: each argument's description.
    for tool in tools.values():
        for name, argument in tool.input_schema.get("properties", {}).items():
            assert argument.get("description"), (tool.name, name)
    # The SDK's client checked this result against the published schema as it came.
    assert not ran.is_error and (ran.structured_content or {})["return_value"] == {"a": [1, 2]}
