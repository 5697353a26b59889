"""Real upstream MCP servers behind a broker, their tool tree generated as `codecage gen`
writes it, and agent code that calls them in a real sandbox."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from codecage import Sandbox
from codecage.bridge import tooling, upstreams
from codecage.bridge.broker import Broker


@contextlib.contextmanager
def generated(config: dict[str, Any], servers: Sequence[str], tree: Path) -> Iterator[Broker]:
    """A broker for the upstream servers of `config` (an MCP config, read with an empty
    environment), with the modules of `servers` written into `tree`; closed at the end."""
    with Broker(upstreams.parse(config, source="test", environ={})) as broker:
        tooling.generate(broker, list(servers), tree)
        yield broker


def value(sandbox: Sandbox, code: str) -> Any:
    """What `code` returns in `sandbox`; the run must succeed."""
    result = sandbox.run(code, limits={"timeout": 60})
    assert result.status == "ok", (result.error, result.stderr)
    return result.return_value


def attempt_code(server: str) -> str:
    """Guest code defining `attempt(tool, **arguments)`: ["ok", the answer] of a call of
    `tool` on `server`, or [kind, message] of the ToolCallError it raised."""
    return f"""
from codecage.runtime import ToolCallError, call_tool_sync
def attempt(tool, **arguments):
    try:
        return ["ok", call_tool_sync({server!r}, tool, arguments)]
    except ToolCallError as exc:
        return [exc.kind, exc.message]
"""
