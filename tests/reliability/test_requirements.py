"""Requirements stated on their own, not read from the code's tables (issue 25).

Each test below names the requirement and where it is written (docs/, a standard), and the
deliberate break of the issue that it must catch. Values are written here, never imported
from the module under test: a test that reads the constant it checks moves with it.
"""

from __future__ import annotations

import os
import sys
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from mcp import Client
from mcp.client.stdio import StdioServerParameters, stdio_client
from mcp_types import ImageContent
from tests._anyio import anyio_backend  # noqa: F401 - a fixture
from tests._upstreams import attempt_code
from tests.reliability._requirements import (
    CAPPED_STREAM_BYTES,
    DEFAULT_MAX_OUTPUT_BYTES,
    MAX_IMAGES_PER_REPLY,
    flood,
)

from codecage import Options, Sandbox
from codecage.bridge import upstreams
from codecage.bridge.broker import Broker

FLAKY = Path(__file__).resolve().parent.parent / "fixtures" / "flaky_server.py"
CODECAGE = str(Path(sys.executable).with_name("codecage"))


@pytest.fixture(scope="module")
def box() -> Iterator[Sandbox]:
    """A real sandbox, no import policy and no scrubbing: the caps are what is looked at."""
    with Sandbox(pool=False, options=Options(import_policy=False, scrub=False)) as sandbox:
        yield sandbox


# --- output caps: docs/configuration.md, `max_output_bytes` -------------------------------
# "bytes, for stdout and for stderr each | 1,048,576 | 1024 - 268,435,456". Break caught:
# the stderr cap multiplied by 1000 (nothing flooded stderr before).


@pytest.mark.parametrize("stream", ["stderr", "stdout"])
def test_a_flooded_stream_is_kept_within_the_cap_the_run_asked_for(
    box: Sandbox, stream: str
) -> None:
    result = box.run(
        flood(stream, 200 * CAPPED_STREAM_BYTES),
        limits={"max_output_bytes": CAPPED_STREAM_BYTES, "timeout": 60},
    )
    assert result.status == "ok", (result.error, result.stderr[-500:])
    kept = getattr(result, stream)
    assert 0 < len(kept.encode("utf-8")) <= CAPPED_STREAM_BYTES
    assert getattr(result, f"{stream}_truncated") is True
    assert kept.startswith("e" * 99)  # the head is the program's, not only a marker


def test_stderr_flooded_past_the_documented_default_is_held_to_it(box: Sandbox) -> None:
    result = box.run(flood("stderr", 3 * DEFAULT_MAX_OUTPUT_BYTES), limits={"timeout": 60})
    assert result.status == "ok", (result.error, result.stderr[-500:])
    assert len(result.stderr.encode("utf-8")) <= DEFAULT_MAX_OUTPUT_BYTES
    assert result.stderr_truncated is True


# --- the import rule: docs/configuration.md (profiles), policy/profiles.py's docstring ------
# "xml.etree allows xml.etree.ElementTree and the parent package xml as a stepping stone,
# not xml.dom (nor `from xml import dom`)". Break caught: any submodule of an allowed
# package let through.


@pytest.fixture(scope="module")
def basic_box() -> Iterator[Sandbox]:
    with Sandbox(profile="basic", pool=False, options=Options(scrub=False)) as sandbox:
        yield sandbox


@pytest.mark.parametrize(
    "statement",
    [
        "import xml.dom",
        "from xml import dom",
        "import urllib.request",
        "from urllib import request",
    ],
)
def test_a_denied_submodule_of_an_allowed_package_is_refused_in_the_sandbox(
    basic_box: Sandbox, statement: str
) -> None:
    result = basic_box.run(statement)
    assert result.status == "error", result.return_value
    assert result.error is not None and result.error.type == "ImportError"
    assert "is not allowed by the profile 'basic'" in result.error.message


def test_an_allowed_submodule_and_its_parent_import_in_the_sandbox(basic_box: Sandbox) -> None:
    result = basic_box.run("import xml.etree.ElementTree\nfrom urllib import parse\n'fine'")
    assert (result.status, result.return_value) == ("ok", "fine"), result.error


# --- tool allow-lists: docs/security-model.md, docs/configuration.md ----------------------
# "the server's own allow_tools ... a run's --allow-tool narrows the servers' own
# allow-lists": a run can never widen what the server allows. Break caught: a run's
# allow-list overriding the server's.

ATTEMPT = attempt_code("flaky")


@pytest.fixture(scope="module")
def echo_only_broker() -> Iterator[Broker]:
    config = {
        "mcpServers": {
            "flaky": {
                "command": sys.executable,
                "args": [str(FLAKY), f"requirements-{uuid.uuid4().hex[:8]}"],
                "env": {"PATH": os.environ.get("PATH", "")},
                "allow_tools": ["echo"],
            }
        }
    }
    with Broker(upstreams.parse(config, source="test", environ={})) as broker:
        yield broker


@pytest.mark.parametrize(
    "run_allows", [["flaky.fail"], ["flaky.*"], ["*.*"], ["flaky.fail", "*.e*"]]
)
def test_a_runs_allow_list_never_widens_the_servers(
    echo_only_broker: Broker, run_allows: list[str]
) -> None:
    with Sandbox(
        tools=echo_only_broker, allowed_tools=run_allows, pool=False, options=Options(scrub=False)
    ) as sb:
        result = sb.run(ATTEMPT + 'attempt("fail", message="m")', limits={"timeout": 60})
    assert result.status == "ok", (result.error, result.stderr[-500:])
    kind, message = result.return_value
    assert kind == "not_allowed", message
    assert "server's allow-list" in message


def test_a_tool_both_allow_lists_permit_is_called(echo_only_broker: Broker) -> None:
    # The refusal above is the allow-list's, not a broken bridge.
    with Sandbox(
        tools=echo_only_broker, allowed_tools=["flaky.*"], pool=False, options=Options(scrub=False)
    ) as sb:
        result = sb.run(ATTEMPT + 'attempt("echo", text="hi")', limits={"timeout": 60})
    assert result.status == "ok", (result.error, result.stderr[-500:])
    assert result.return_value[0] == "ok", result.return_value


# --- images in an MCP reply: docs/mcp.md ---------------------------------------------------
# "PNG, JPEG, GIF and WebP images the code writes come back as image content (at most 5)".
# With a reply budget large enough for 30 images, the cap and not the budget must be what
# holds them to 5. Break caught: the image cap raised from 5 to 19.

TWENTY_PNGS = (
    "for i in range(20):\n    open(f'pic{i}.png', 'wb').write(b'\\x89PNG\\r\\n\\x1a\\n' + bytes(8))"
)


@pytest.fixture
async def roomy_server(tmp_path: Path) -> AsyncIterator[Client]:
    """`codecage serve` over stdio, with a reply budget of 100,000 tokens (room for 31
    images at half the budget), PYTHONPATH passed so that it runs the code under test."""
    env = {k: v for k, v in os.environ.items() if k == "PYTHONPATH"}
    env["CODECAGE_REPLY_MAX_TOKENS"] = "100000"
    params = StdioServerParameters(command=CODECAGE, args=["serve"], cwd=str(tmp_path), env=env)
    with (tmp_path / "stderr.log").open("w", encoding="utf-8") as errlog:
        async with Client(stdio_client(params, errlog=errlog), read_timeout_seconds=60) as client:
            yield client


@pytest.mark.anyio
async def test_a_run_that_writes_twenty_images_gets_exactly_five(roomy_server: Client) -> None:
    result = await roomy_server.call_tool("execute_code", {"code": TWENTY_PNGS})
    assert not result.is_error, result.content
    structured: dict[str, Any] = result.structured_content or {}
    assert structured.get("status") == "ok", structured
    assert len(structured["files"]) == 20
    images = [b for b in result.content if isinstance(b, ImageContent)]
    assert len(images) == MAX_IMAGES_PER_REPLY
