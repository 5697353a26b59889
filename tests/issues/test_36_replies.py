"""Issue 36: an MCP reply spends its budget where the model reads it (the text), and the
tool list is small enough to load without thinking twice. Through a real MCP client over
stdio (`codecage serve` as a host starts it)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from mcp_types import CallToolResult, TextContent
from tests._cli import serve_stdio

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
