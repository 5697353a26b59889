"""npm's reference `server-everything` (a server that exercises the whole protocol) through
`codecage gen`, the broker and a real sandbox.

Its tools return text, structured content with an output schema, images, and progress
notifications; its `get-env` tool sends its whole environment back, as a careless server
might, so the operator's credential given in its `env` must not leave in the result.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from tests._upstreams import generated, value

from codecage import Options, Sandbox
from codecage.bridge.broker import Broker

ROOT = Path(__file__).resolve().parent.parent
EVERYTHING = ROOT / "tools" / "node_modules" / ".bin" / "mcp-server-everything"
CREDENTIAL = "everything-" + uuid.uuid4().hex

pytestmark = pytest.mark.skipif(
    not EVERYTHING.exists(), reason="scripts/setup installs the npm servers"
)


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Broker, Path]]:
    config = {
        "mcpServers": {
            "everything": {"command": str(EVERYTHING), "env": {"EVERYTHING_TOKEN": CREDENTIAL}}
        }
    }
    servers = tmp_path_factory.mktemp("tree") / "servers"
    with generated(config, ["everything"], servers) as broker:
        yield broker, servers


@pytest.fixture(scope="module")
def sandbox(world: tuple[Broker, Path]) -> Iterator[Sandbox]:
    broker, servers = world
    with Sandbox(
        tools=broker, pool=False, options=Options(servers_dir=servers, scrub=False)
    ) as box:
        yield box


def test_gen_writes_one_module_per_tool_with_readable_names(world: tuple[Broker, Path]) -> None:
    _, servers = world
    modules = {p.stem for p in (servers / "everything").glob("*.py")}
    assert {"echo", "get_sum", "get_structured_content", "get_tiny_image"} <= modules


def test_one_program_calls_several_tools_and_keeps_what_matters(sandbox: Sandbox) -> None:
    code = """
from servers.everything import echo, get_structured_content, get_sum
total = get_sum.call_sync(a=2, b=40)
weather = [get_structured_content.call_sync(location=city)
           for city in ("New York", "Chicago", "Los Angeles")]
said = echo.call_sync(message="hello from the sandbox")
{"sum": total, "cities": len(weather), "keys": sorted(weather[0]), "echo": said}
"""
    result = value(sandbox, code)
    assert "42" in str(result["sum"])
    assert result["cities"] == 3
    assert "temperature" in result["keys"]
    assert "hello from the sandbox" in str(result["echo"])


def test_an_image_result_reaches_the_code_as_a_placeholder(sandbox: Sandbox) -> None:
    text = value(
        sandbox, "from servers.everything import get_tiny_image\nget_tiny_image.call_sync()"
    )
    assert "[image: image/png," in str(text)


def test_a_call_with_progress_notifications_completes(sandbox: Sandbox) -> None:
    code = """
from servers.everything import trigger_long_running_operation as op
op.call_sync(duration=1, steps=2)
"""
    assert "completed" in str(value(sandbox, code)).lower()


def test_a_server_that_echoes_its_credential_does_not_leak_it_in_the_result(
    world: tuple[Broker, Path],
) -> None:
    broker, servers = world
    with Sandbox(tools=broker, pool=False, options=Options(servers_dir=servers)) as scrubbing:
        result = scrubbing.run(
            "from servers.everything import get_env\nprint(get_env.call_sync())",
            limits={"timeout": 60},
        )
    assert result.status == "ok", result.error
    assert "EVERYTHING_TOKEN" in result.stdout  # the server did send its environment
    assert CREDENTIAL not in result.stdout
    assert result.redactions.get("secret", 0) >= 1
