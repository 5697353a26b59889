"""`codecage serve` end to end: the real server process, driven by the official MCP client.

One stdio server serves the whole module (its warm pool makes each call a few ms); the HTTP
tests start `codecage serve --http` on a free loopback port and kill it afterwards. No mocks:
every call crosses a real transport into a real sandbox.
"""

from __future__ import annotations

import base64
import contextlib
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import httpx2
import jsonschema
import pytest
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from mcp_types import CallToolResult, ImageContent, TextContent
from mcp_types.version import LATEST_HANDSHAKE_VERSION
from tests._anyio import anyio_backend  # noqa: F401 - a fixture
from tests._cli import serve_stdio
from tests._session_audit import SESSION_STORE

from reliability._load import HttpServer, free_port, http_serve, stop
from reliability._load import named_leftovers as left_behind  # the other tests take it here

CODECAGE = str(Path(sys.executable).with_name("codecage"))
TOKEN = "secret"  # noqa: S105 - the bearer token of a test server on loopback
pytestmark = pytest.mark.anyio


TOOL_NAMES = {
    "execute_code",
    "validate_code",
    "get_sandbox_info",
    "open_session",
    "close_session",
    "list_sessions",
}
"""The tools `codecage serve` lists."""

# A raw client's first request (id 1), in the handshake era.
INITIALIZE: dict[str, Any] = {
    "jsonrpc": "2.0",
    "id": 1,
    "method": "initialize",
    "params": {
        "protocolVersion": LATEST_HANDSHAKE_VERSION,
        "capabilities": {},
        "clientInfo": {"name": "test", "version": "0"},
    },
}


def session_input(tool: str, arguments: dict[str, object]) -> bytes:
    """A raw stdio session's requests: initialize (id 1), initialized, a tool call (id 2)."""
    messages = [
        INITIALIZE,
        {"jsonrpc": "2.0", "method": "notifications/initialized"},
        {
            "jsonrpc": "2.0",
            "id": 2,
            "method": "tools/call",
            "params": {"name": tool, "arguments": arguments},
        },
    ]
    return "".join(json.dumps(m) + "\n" for m in messages).encode()


def spawn_serve(
    cwd: Path, *args: str, env: dict[str, str] | None = None
) -> subprocess.Popen[bytes]:
    """`codecage serve ARGS` in `cwd` with its stdin and stdout piped (bytes) and its
    stderr dropped; `env` defaults to `server_env()`."""
    return subprocess.Popen(
        [CODECAGE, "serve", *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        cwd=cwd,
        env=server_env() if env is None else env,
    )


def send_lines(proc: subprocess.Popen[bytes], messages: list[dict[str, Any]]) -> None:
    """`messages` written to the server's stdin, one JSON line each, and flushed."""
    assert proc.stdin is not None
    proc.stdin.write("".join(json.dumps(m) + "\n" for m in messages).encode())
    proc.stdin.flush()


def call_over_stdio(cwd: Path, *args: str, code: str, timeout: float = 60) -> list[dict[str, Any]]:
    """`codecage serve ARGS` fed a raw stdio session (initialize, initialized, an
    execute_code call of `code`, id 2): its two answers, read before stdin closes (EOF
    would cancel a call in flight); then the server exits, sending what is waiting first."""
    call = {
        "jsonrpc": "2.0",
        "id": 2,
        "method": "tools/call",
        "params": {"name": "execute_code", "arguments": {"code": code}},
    }
    messages = [INITIALIZE, {"jsonrpc": "2.0", "method": "notifications/initialized"}, call]
    with spawn_serve(cwd, *args) as proc:
        assert proc.stdin is not None and proc.stdout is not None
        send_lines(proc, messages)
        answers = [json.loads(proc.stdout.readline()) for _ in range(2)]
        proc.stdin.close()
        proc.wait(timeout=timeout)
    return answers


def server_env(**extra: str) -> dict[str, str]:
    """The test's environment without any CODECAGE_* setting (a token, a config file) but
    CODECAGE_AUDIT: this test run's own store (conftest), never the host-wide default one
    (`extra` may name another)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CODECAGE_")}
    return env | {"CODECAGE_AUDIT": str(SESSION_STORE)} | extra


# --- the stdio server --------------------------------------------------------------------


@dataclass
class StdioServer:
    client: Client
    stderr_path: Path
    transport_faults: list[Exception]


@pytest.fixture(scope="module")
async def stdio(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[StdioServer]:
    """`codecage serve` spawned by the SDK's stdio client, in an empty working directory."""
    workdir = tmp_path_factory.mktemp("serve-stdio")
    faults: list[Exception] = []
    async with serve_stdio(workdir, faults=faults) as c:
        yield StdioServer(c, workdir / "stderr.log", faults)


async def call(server: StdioServer, tool: str, **arguments: Any) -> CallToolResult:
    return await server.client.call_tool(tool, arguments)


def text_of(result: CallToolResult) -> str:
    return "\n".join(b.text for b in result.content if isinstance(b, TextContent))


def structured(result: CallToolResult) -> dict[str, Any]:
    assert not result.is_error, text_of(result)
    assert result.structured_content is not None, text_of(result)
    return result.structured_content


# --- tools -------------------------------------------------------------------------------


async def test_the_server_lists_its_tools_with_descriptions_and_parameter_schemas(
    stdio: StdioServer,
) -> None:
    tools = {t.name: t for t in (await stdio.client.list_tools()).tools}
    assert set(tools) == TOOL_NAMES
    for tool in tools.values():
        assert tool.description and len(tool.description) > 20, tool.name
        assert tool.input_schema["type"] == "object", tool.name
    execute_params = set(tools["execute_code"].input_schema["properties"])
    assert execute_params >= {
        "code",
        "timeout",
        "profile",
        "allowed_imports",
        "memory_limit_mb",
        "files",
        "return_files",
        "session_id",
        "allow_hosts",
    }
    assert tools["execute_code"].input_schema.get("required") == ["code"]
    assert "ctx" not in tools["execute_code"].input_schema["properties"]
    assert set(tools["validate_code"].input_schema["properties"]) >= {"code", "profile"}
    assert set(tools["get_sandbox_info"].input_schema.get("properties", {})) == {"detail"}


async def test_execute_code_returns_the_output_and_the_last_expression_value(
    stdio: StdioServer,
) -> None:
    result = await call(stdio, "execute_code", code="print('hi')\n6 * 7")
    run = structured(result)
    assert run["status"] == "ok"
    assert run["exit_code"] == 0
    assert run["stdout"] == "in the text"  # not repeated in the structured content
    assert run["return_value"] == 42
    assert run["error"] is None
    assert {"wall_ms", "cpu_ms", "peak_memory_mb"} <= set(run["usage"])
    summary = text_of(result)
    assert summary.startswith("hi")  # the output first, then how the run ended
    assert "ok" in summary


async def test_an_uploaded_csv_file_is_read_from_the_workspace(stdio: StdioServer) -> None:
    code = (
        "import csv\n"
        "with open('sales.csv', newline='') as f:\n"
        "    rows = list(csv.DictReader(f))\n"
        "sum(int(r['a']) + int(r['b']) for r in rows)"
    )
    result = await call(stdio, "execute_code", code=code, files={"sales.csv": "a,b\n1,2\n3,4\n"})
    run = structured(result)
    assert run["status"] == "ok", run["error"]
    assert run["return_value"] == 10
    assert "sales.csv" in {f["path"] for f in run["files"]}


async def test_a_base64_upload_arrives_byte_for_byte(stdio: StdioServer) -> None:
    blob = bytes(range(256)) + b"\x89PNG\r\n\x1a\n\x00\xff"
    upload = "base64:" + base64.b64encode(blob).decode("ascii")
    code = "with open('data/blob.bin', 'rb') as f:\n    data = f.read()\nlist(data)"
    result = await call(stdio, "execute_code", code=code, files={"data/blob.bin": upload})
    run = structured(result)
    assert run["status"] == "ok", run["error"]
    assert bytes(run["return_value"]) == blob


async def test_return_files_come_back_inline_as_text(stdio: StdioServer) -> None:
    code = "with open('report.txt', 'w') as f:\n    f.write('total: 10\\n')"
    result = await call(stdio, "execute_code", code=code, return_files=["report.txt"])
    assert structured(result)["status"] == "ok"
    inline = [b.text for b in result.content[1:] if isinstance(b, TextContent)]
    assert any("total: 10" in text for text in inline), result.content


async def test_what_execute_code_returns_is_scrubbed_inline_files_too(stdio: StdioServer) -> None:
    code = (
        "print('customer', 'alice@example.com')\n"
        "with open('crm.txt', 'w') as f:\n"
        "    f.write('call +1 415 555 2671 or mail bob@example.org\\n')\n"
        "{'owner': 'carol@example.net'}"
    )
    result = await call(stdio, "execute_code", code=code, return_files=["crm.txt"])
    run = structured(result)
    assert text_of(result).startswith("customer [EMAIL]\n")
    assert run["return_value"] == {"owner": "[EMAIL]"}
    assert run["redactions"] == {"email": 3, "phone": 1}
    inline = [b.text for b in result.content[1:] if isinstance(b, TextContent)]
    assert inline == ["--- crm.txt ---\ncall [PHONE] or mail [EMAIL]\n"]
    summary = text_of(result)
    assert "redacted (personal data and secrets, by the host): 3 email, 1 phone" in summary
    everything = json.dumps([run, [b.model_dump() for b in result.content]])
    assert "@example" not in everything and "555 2671" not in everything


async def test_a_run_past_its_timeout_is_a_timeout_result_not_a_tool_error(
    stdio: StdioServer,
) -> None:
    started = time.monotonic()
    result = await call(stdio, "execute_code", code="while True:\n    pass", timeout=1)
    assert time.monotonic() - started < 15
    run = structured(result)  # asserts is_error is false
    assert run["status"] == "timeout"
    assert "timeout" in text_of(result)


async def test_a_blocked_import_is_an_error_result_that_names_the_profile(
    stdio: StdioServer,
) -> None:
    result = await call(stdio, "execute_code", code="import socket", profile="basic")
    run = structured(result)
    assert run["status"] == "error"
    assert run["error"]["type"] in ("ImportError", "ModuleNotFoundError")
    assert "socket" in run["error"]["message"]
    assert "basic" in run["error"]["message"]
    assert "ImportError" in text_of(result) or "ModuleNotFoundError" in text_of(result)


async def test_an_exception_in_the_code_comes_back_with_its_traceback(stdio: StdioServer) -> None:
    result = await call(stdio, "execute_code", code="def f():\n    1 / 0\nf()")
    run = structured(result)
    assert run["status"] == "error"
    assert run["error"]["type"] == "ZeroDivisionError"
    assert "ZeroDivisionError" in text_of(result)
    assert "line 2" in text_of(result)


@pytest.mark.skipif(
    importlib.util.find_spec("matplotlib") is None, reason="matplotlib is not installed"
)
async def test_a_matplotlib_figure_comes_back_as_a_png_image_block(stdio: StdioServer) -> None:
    code = (
        "import matplotlib\n"
        "matplotlib.use('Agg')\n"
        "import matplotlib.pyplot as plt\n"
        "plt.plot([1, 3, 2])\n"
        "plt.savefig('plot.png')\n"
    )
    result = await call(stdio, "execute_code", code=code, profile="data_science", timeout=60)
    run = structured(result)
    assert run["status"] == "ok", run["error"]
    images = [b for b in result.content if isinstance(b, ImageContent)]
    assert len(images) == 1, result.content
    assert images[0].mime_type == "image/png"
    assert base64.b64decode(images[0].data).startswith(b"\x89PNG\r\n\x1a\n")
    assert "plot.png" in {f["path"] for f in run["files"]}


SVG = "<svg xmlns='http://www.w3.org/2000/svg' width='8' height='8'><rect width='8'/></svg>"


async def test_an_svg_is_never_an_image_block_but_return_files_gives_it_as_text(
    stdio: StdioServer,
) -> None:
    # An SVG is XML: it can hold scripts and text the scrubber never read.
    code = f"with open('pic.svg', 'w') as f:\n    f.write({SVG!r})"
    result = await call(stdio, "execute_code", code=code, return_files=["pic.svg"])
    run = structured(result)
    assert run["status"] == "ok", run["error"]
    assert [f["mime"] for f in run["files"]] == ["image/svg+xml"]
    assert not [b for b in result.content if isinstance(b, ImageContent)], result.content
    inline = [b.text for b in result.content[1:] if isinstance(b, TextContent)]
    assert inline == [f"--- pic.svg ---\n{SVG}"]


PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


async def test_image_blocks_are_bounded_in_number(stdio: StdioServer) -> None:
    code = f"for i in range(20):\n    open(f'pic{{i}}.png', 'wb').write({PNG_MAGIC!r} + bytes(8))"
    result = await call(stdio, "execute_code", code=code)
    assert len(structured(result)["files"]) == 20
    images = [b for b in result.content if isinstance(b, ImageContent)]
    assert len(images) == 5  # docs/mcp.md: at most 5 (5 x 1,600 tokens fit the default budget)


def reply_bytes(result: CallToolResult) -> int:
    """The size of a reply as the server sent it (the JSON of the CallToolResult)."""
    return len(result.model_dump_json(by_alias=True, exclude_none=True))


async def test_a_reply_over_the_budget_is_cut_to_fit_and_says_what_was_cut(
    stdio: StdioServer,
) -> None:
    code = "print('x' * 3_000_000)\n'v' * 900_000"
    result = await call(stdio, "execute_code", code=code)
    run = structured(result)
    assert run["status"] == "ok"
    assert reply_bytes(result) <= 20_000 * 4  # the default budget: 20,000 tokens of ASCII
    assert run["stdout"] == "in the text" and run["stdout_truncated"]
    assert text_of(result).startswith("xxxx")
    # The value (a string) as JSON, its head and tail, no larger than what the text shows.
    value = run["return_value"]
    assert value.startswith("vvv") and value.endswith("vvv") and "cut here" in value
    assert run["return_value_truncated"] and len(value) <= 2_500  # 2,000 and the marker
    assert "→ 'vvvv" in text_of(result)
    trimmed = run["events"][0]
    assert trimmed["kind"] == "reply_trimmed", run["events"]
    assert "stdout" in trimmed["detail"] and "the return value" in trimmed["detail"]
    assert "note: reply_trimmed: to keep the reply within 20,000 tokens" in text_of(result)


async def test_images_that_do_not_fit_in_the_reply_are_left_out_largest_first(
    stdio: StdioServer,
) -> None:
    # Random bytes do not compress: 3 x 400 KB of PNG is 1.6 MB as base64.
    code = (
        "import random\n"
        "for i, size in enumerate([400_000, 100_000, 400_000, 400_000]):\n"
        "    data = b'\\x89PNG\\r\\n\\x1a\\n' + random.randbytes(size)\n"
        "    open(f'pic{i}.png', 'wb').write(data)\n"
    )
    result = await call(stdio, "execute_code", code=code)
    run = structured(result)
    assert run["status"] == "ok", run["error"]
    assert reply_bytes(result) <= 1_000_000
    images = [b for b in result.content if isinstance(b, ImageContent)]
    sizes = sorted(len(base64.b64decode(i.data)) for i in images)
    assert sizes == [100_008, 400_008], "the small one and one large one fit"
    detail = run["events"][0]["detail"]
    assert detail.count("an image (image/png, 400008 bytes) left out") == 2, detail
    assert len(run["files"]) == 4  # the files list still names every file


@pytest.mark.parametrize(
    ("arguments", "mentions"),
    [
        pytest.param({"code": 123}, "code", id="code-not-a-string"),
        pytest.param({"code": "1", "timeout": -1}, "timeout", id="negative-timeout"),
        pytest.param({"code": "1", "timeout": 10**6}, "timeout", id="timeout-above-maximum"),
        pytest.param({"code": "1", "profile": "no_such_profile"}, "no_such_profile", id="profile"),
        pytest.param(
            {"code": "1", "memory_limit_mb": 10**6}, "memory_limit_mb", id="memory-above-maximum"
        ),
        pytest.param({"code": "#" * (20 * 1024 * 1024)}, "MiB", id="20-MB-of-code"),
    ],
)
async def test_bad_arguments_are_a_tool_error_and_the_server_keeps_serving(
    stdio: StdioServer, arguments: dict[str, Any], mentions: str
) -> None:
    refused = await stdio.client.call_tool("execute_code", arguments)
    assert refused.is_error, refused.structured_content
    message = text_of(refused)
    assert mentions in message, message
    assert len(message) < 2000  # a readable message, not a dump of the request

    after = await call(stdio, "execute_code", code="1 + 1")
    assert structured(after)["return_value"] == 2


EXECUTE_CODE_ARGUMENTS = (
    "code, timeout, profile, allowed_imports, memory_limit_mb, files, return_files, backend, "
    "session_id, allow_hosts"
)


@pytest.mark.parametrize(
    ("arguments", "lines"),
    [
        pytest.param(
            {"code": "1", "timeout": -1},
            ["timeout: must be greater than 0 (got -1)"],
            id="negative-timeout",
        ),
        pytest.param({"code": 123}, ["code: must be a valid string (got 123)"], id="code-int"),
        pytest.param(
            {"code": "1", "timeout": "soon", "allowed_imports": "csv", "files": ["a.csv"]},
            [
                'timeout: must be a valid number, unable to parse string as a number (got "soon")',
                'allowed_imports: must be a valid list (got "csv")',
                'files: must be a valid dictionary (got ["a.csv"])',
            ],
            id="three-wrong-types",
        ),
        pytest.param(
            {"code": "1", "memory_limit_mb": 8},
            ["memory_limit_mb: must be greater than or equal to 32 (got 8)"],
            id="memory-below-minimum",
        ),
        pytest.param({"timeout": 5}, ["code: required, but not given"], id="no-code"),
        pytest.param(
            {"code": "1", "timout": 5},
            [f"timout: not an argument of execute_code; it takes {EXECUTE_CODE_ARGUMENTS}"],
            id="unknown-argument",
        ),
    ],
)
async def test_each_bad_argument_gets_one_readable_line_and_the_server_keeps_serving(
    stdio: StdioServer, arguments: dict[str, Any], lines: list[str]
) -> None:
    refused = await stdio.client.call_tool("execute_code", arguments)
    assert refused.is_error
    assert refused.structured_content is None
    message = text_of(refused).splitlines()
    assert message[0] == "Invalid arguments for execute_code (nothing ran):"
    assert message[1:] == lines

    after = await call(stdio, "execute_code", code="1 + 1")
    assert structured(after)["return_value"] == 2


async def test_an_unknown_argument_is_refused_not_ignored_by_every_tool(
    stdio: StdioServer,
) -> None:
    # With the typo ignored, this would run for 30 s (the default) instead of timing out.
    slow = await stdio.client.call_tool(
        "execute_code", {"code": "while True:\n    pass", "timout": 1}
    )
    assert slow.is_error
    assert "timout: not an argument of execute_code" in text_of(slow)
    info = await stdio.client.call_tool("get_sandbox_info", {"verbose": True})
    assert text_of(info).splitlines()[1:] == [
        "verbose: not an argument of get_sandbox_info; it takes detail"
    ]
    check = await stdio.client.call_tool("validate_code", {"code": "1", "strict": True})
    assert "it takes code, profile" in text_of(check)
    tools = (await stdio.client.list_tools()).tools
    assert all(t.input_schema.get("additionalProperties") is False for t in tools)


def untyped_schemas(schema: Any, path: str = "") -> list[str]:
    """The subschemas that constrain nothing (no type, $ref, anyOf, enum, ...) or that spell
    the type as an array: what the MCP Inspector warns about (untyped-schema, type-union)."""
    keywords = {"type", "$ref", "anyOf", "oneOf", "allOf", "enum", "const", "not", "properties"}
    found: list[str] = []
    if not isinstance(schema, dict):
        return found
    if not keywords & schema.keys() or isinstance(schema.get("type"), list):
        found.append(path or "/")
    for key in ("properties", "$defs"):
        for name, sub in schema.get(key, {}).items():
            found += untyped_schemas(sub, f"{path}/{key}/{name}")
    for key in ("anyOf", "oneOf", "allOf"):
        for i, sub in enumerate(schema.get(key, [])):
            found += untyped_schemas(sub, f"{path}/{key}/{i}")
    for key in ("items", "additionalProperties"):
        found += untyped_schemas(schema.get(key), f"{path}/{key}")
    return found


async def test_every_value_in_the_tools_schemas_has_a_type(stdio: StdioServer) -> None:
    tools = {t.name: t for t in (await stdio.client.list_tools()).tools}
    for tool in tools.values():
        assert untyped_schemas(tool.input_schema) == [], tool.name
        assert tool.output_schema is not None, tool.name
        assert untyped_schemas(tool.output_schema) == [], tool.name
    return_value = tools["execute_code"].output_schema["properties"]["return_value"]
    accepts = jsonschema.Draft202012Validator(return_value)
    for value in (None, True, 42, 1.5, "repr()", [1, "a"], {"a": [1]}):
        assert accepts.is_valid(value), value
    assert untyped_schemas({"properties": {"x": {"description": "any"}}}) == ["/properties/x"]


async def test_execute_code_returns_values_of_every_json_type_under_its_output_schema(
    stdio: StdioServer,
) -> None:
    # The SDK's client validates structured content against the output schema.
    for value in [None, True, 1, 1.5, "x", [1], {"a": 1}]:
        result = await call(stdio, "execute_code", code=repr(value))
        assert structured(result)["return_value"] == value
    unjsonable = structured(await call(stdio, "execute_code", code="{1, 2}"))
    assert unjsonable["return_value"] == "{1, 2}"  # its repr


async def test_each_call_logs_one_structured_line_on_stderr(stdio: StdioServer) -> None:
    await call(stdio, "execute_code", code="6 * 7")
    await stdio.client.call_tool("execute_code", {"code": "1", "timeout": -1})
    lines = stdio.stderr_path.read_text(encoding="utf-8").splitlines()
    calls = [line for line in lines if line.startswith("INFO codecage.mcp.server server.call ")]
    ran, refused = calls[-2:]
    assert 'tool="execute_code" status="ok" ' in ran, ran
    assert re.search(
        r" wall_ms=\d+(\.\d+)? queue_ms=\d+(\.\d+)? execution_id=\"[0-9a-f]{32}\"$", ran
    )
    assert 'status="refused"' in refused and refused.endswith("execution_id=null"), refused
    assert "-1" not in refused  # the arguments are the caller's data: not logged at INFO
    assert any(line.startswith("INFO codecage.mcp.server server.start ") for line in lines)


async def test_validate_code_finds_a_refused_import_and_passes_clean_code(
    stdio: StdioServer,
) -> None:
    report = structured(await call(stdio, "validate_code", code="import os", profile="basic"))
    assert report["valid"] is False
    assert report["findings"], report
    assert any("os" in f["message"] for f in report["findings"]), report["findings"]
    assert report["message"]

    clean = structured(await call(stdio, "validate_code", code="sum(range(10))"))
    assert clean["valid"] is True
    assert clean["message"]


async def test_get_sandbox_info_lists_profiles_limits_and_the_pool(stdio: StdioServer) -> None:
    short = structured(await call(stdio, "get_sandbox_info"))
    assert {"basic", "data_science"} <= set(short["profiles"])
    assert "timeout" in short["default_limits"]
    assert short["call_maximums"] == {"timeout": 120, "memory_limit_mb": 2048}  # the defaults
    info = structured(await call(stdio, "get_sandbox_info", detail=True))["detail"]
    names = {p["name"] for p in info["profiles"]}
    assert {"basic", "data_science"} <= names
    assert info["pool"] is not None  # the server runs with the warm pool
    assert info["layers"]
    assert info["tools"]["max_calls"] == 200  # the bounds of the code's tool calls


async def test_the_stdio_server_wrote_only_protocol_messages_to_stdout(
    stdio: StdioServer,
) -> None:
    # Output from the sandboxed code must not reach the server's own stdout either.
    result = await call(stdio, "execute_code", code="for i in range(200):\n    print('x' * 80)")
    assert text_of(result).count("x" * 80 + "\n") == 200
    assert stdio.transport_faults == []
    # Refusals and failed runs before this one are results, not crashes in the server.
    assert "Traceback" not in stdio.stderr_path.read_text(encoding="utf-8", errors="replace")


@pytest.mark.parametrize("flags", [[], ["--verbose"]], ids=["info", "verbose"])
def test_a_raw_stdio_session_sees_only_json_rpc_lines_on_stdout(
    tmp_path: Path, flags: list[str]
) -> None:
    """Without the SDK's tolerant reader: every stdout line must parse as JSON-RPC, while
    the server logs (one line per call at least, DEBUG with --verbose)."""
    stdin = session_input("execute_code", {"code": "print('out')\n1/0"}).decode()
    proc = subprocess.Popen(
        [CODECAGE, "serve", *flags],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        encoding="utf-8",
        cwd=tmp_path,
        env=server_env(),
    )
    try:
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write(stdin)
        proc.stdin.flush()
        replies: dict[int, dict[str, Any]] = {}
        deadline = time.monotonic() + 30
        while 2 not in replies and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            message = json.loads(line)  # anything else on stdout fails here
            assert message["jsonrpc"] == "2.0"
            if "id" in message:
                replies[message["id"]] = message
        out, err = proc.communicate(timeout=20)  # closes stdin: the server ends
    finally:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        proc.wait()
    for line in out.splitlines():
        assert json.loads(line)["jsonrpc"] == "2.0"
    assert replies[2]["result"]["structuredContent"]["status"] == "error"
    assert replies[2]["result"]["isError"] is False
    assert "server.call" in err, "each call should be logged on stderr"
    assert proc.returncode == 0, err
    assert left_behind(proc.pid) == {}  # the end of stdin ends the server cleanly


# --- HTTP --------------------------------------------------------------------------------


@contextlib.contextmanager
def serving_http(workdir: Path, *args: str, **env: str) -> Iterator[HttpServer]:
    """`codecage serve --http` on a free loopback port, until the block ends (then killed).
    Without a token (--token or CODECAGE_TOKEN) it is started with --insecure-no-token, the
    loopback opt-out, for clients that send no Authorization."""
    if not {"--token", "--insecure-no-token"} & set(args) and "CODECAGE_TOKEN" not in env:
        args = (*args, "--insecure-no-token")
    with http_serve(workdir, args, server_env(**env), log="stderr", bound_s=30) as server:
        yield server


def gone_soon(server_pid: int, seconds: float = 10) -> dict[str, list[str]]:
    """What the server left behind once nothing more goes within `seconds` (its own
    cleanup, or its guardian's after a SIGKILL: engine/guardian.py)."""
    deadline = time.monotonic() + seconds
    while (left := left_behind(server_pid)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


@pytest.fixture(scope="module")
def http_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HttpServer]:
    """`codecage serve --http --host 127.0.0.1 --token secret`."""
    workdir = tmp_path_factory.mktemp("serve-http")
    with serving_http(workdir, "--host", "127.0.0.1", "--token", TOKEN) as server:
        yield server


async def execute_over_http(url: str, headers: dict[str, str], code: str) -> CallToolResult:
    async with (
        httpx2.AsyncClient(headers=headers, timeout=httpx2.Timeout(30, read=60)) as http,
        Client(streamable_http_client(url, http_client=http)) as client,
    ):
        return await client.call_tool("execute_code", {"code": code})


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=lambda s: s.name)
async def test_stopping_the_http_server_with_a_signal_leaves_no_run_dirs_or_mounts(
    tmp_path: Path, sig: signal.Signals
) -> None:
    # SIGTERM is what systemd, docker and kubernetes send.
    with serving_http(tmp_path) as server:
        result = await execute_over_http(server.url, {}, "6 * 7")
        assert structured(result)["return_value"] == 42
        deadline = time.monotonic() + 10
        while not left_behind(server.proc.pid):  # the warm pool's next sandbox is starting
            assert time.monotonic() < deadline, "the server made no run dir: nothing to check"
            await anyio.sleep(0.05)
        stop(server.proc, sig)
    assert left_behind(server.proc.pid) == {}


def post_initialize(url: str, headers: dict[str, str]) -> int:
    body = json.dumps(INITIALIZE).encode()
    request = urllib.request.Request(  # noqa: S310 - a fixed http://127.0.0.1 URL
        url,
        data=body,
        method="POST",
        headers={
            "Content-Type": "application/json",
            "Accept": "application/json, text/event-stream",
            **headers,
        },
    )
    try:
        with urllib.request.urlopen(request, timeout=10) as response:  # noqa: S310
            return int(response.status)
    except urllib.error.HTTPError as err:
        err.close()
        return int(err.code)


def test_http_without_the_bearer_token_gets_401(http_server: HttpServer) -> None:
    assert post_initialize(http_server.url, {}) == 401
    assert post_initialize(http_server.url, {"Authorization": "Bearer wrong"}) == 401
    assert post_initialize(http_server.url, {"Authorization": TOKEN}) == 401


async def test_execute_code_over_streamable_http_with_the_bearer_token(
    http_server: HttpServer,
) -> None:
    headers = {"Authorization": f"Bearer {TOKEN}"}
    timeout = httpx2.Timeout(30, read=60)
    async with (
        httpx2.AsyncClient(headers=headers, timeout=timeout) as http,
        Client(streamable_http_client(http_server.url, http_client=http)) as client,
    ):
        names = {t.name for t in (await client.list_tools()).tools}
        assert names >= {"execute_code", "validate_code", "get_sandbox_info", "open_session"}
        result = await client.call_tool("execute_code", {"code": "print('hi')\n6 * 7"})
        run = structured(result)
        assert run["status"] == "ok"
        assert run["return_value"] == 42
        assert "hi" in text_of(result)

        refused = await client.call_tool("execute_code", {"code": "1", "timeout": -1})
        assert refused.is_error
        assert "timeout" in text_of(refused)


@pytest.mark.parametrize("mode", ["legacy", "2026-07-28"])
async def test_a_large_reply_reaches_an_http_client_of_either_protocol_era(
    tmp_path: Path, mode: str
) -> None:
    """Clients before 2026-07-28 read the reply as one SSE event, refused over 1 MiB."""
    with serving_http(tmp_path) as server:
        async with (
            httpx2.AsyncClient(timeout=httpx2.Timeout(30, read=60)) as http,
            Client(streamable_http_client(server.url, http_client=http), mode=mode) as client,
        ):
            result = await client.call_tool("execute_code", {"code": "print('x' * 3_000_000)"})
    run = structured(result)
    assert run["status"] == "ok" and run["stdout_truncated"]
    assert run["events"][0]["kind"] == "reply_trimmed"


async def test_over_http_large_uploads_work_and_20_mb_of_code_is_a_readable_tool_error(
    tmp_path: Path,
) -> None:
    """The SDK refuses HTTP bodies over 4 MiB with a 413 by default; the server's own limits
    (20 MB of uploads, 10 MiB of code) are what a caller meets instead."""
    upload = "x" * (6 * 1024 * 1024)
    with serving_http(tmp_path) as server:
        async with (
            httpx2.AsyncClient(timeout=httpx2.Timeout(30, read=60)) as http,
            Client(streamable_http_client(server.url, http_client=http)) as client,
        ):
            big = await client.call_tool("execute_code", {"code": "#" * (20 * 1024 * 1024)})
            sized = await client.call_tool(
                "execute_code",
                {"code": "len(open('big.txt').read())", "files": {"big.txt": upload}},
            )
    assert big.is_error and "MiB" in text_of(big), text_of(big)
    assert structured(sized)["return_value"] == len(upload)


async def test_http_on_loopback_with_the_insecure_opt_out_serves_without_authorization(
    tmp_path: Path,
) -> None:
    with serving_http(tmp_path, "--insecure-no-token") as server:
        result = await execute_over_http(server.url, {}, "6 * 7")
    assert structured(result)["return_value"] == 42


async def test_the_token_can_come_from_the_codecage_token_environment_variable(
    tmp_path: Path,
) -> None:
    with serving_http(tmp_path, CODECAGE_TOKEN=TOKEN) as server:
        assert post_initialize(server.url, {}) == 401
        headers = {"Authorization": f"Bearer {TOKEN}"}
        result = await execute_over_http(server.url, headers, "6 * 7")
    assert structured(result)["return_value"] == 42


def serve_refused(
    workdir: Path, *args: str, timeout: float = 30
) -> subprocess.CompletedProcess[str]:
    """`codecage serve --http ARGS`, which is to refuse to start: how it exited (a test
    failure if it is still running after `timeout` seconds)."""
    try:
        return subprocess.run(
            [CODECAGE, "serve", "--http", *args],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            cwd=workdir,
            env=server_env(),
            timeout=timeout,
            check=False,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"codecage serve --http {' '.join(args)} kept running")


def test_http_on_a_non_loopback_host_without_a_token_is_refused_at_start(
    tmp_path: Path,
) -> None:
    anywhere = "0.0.0.0"  # noqa: S104 - refused before it binds
    p = serve_refused(tmp_path, "--host", anywhere, "--port", str(free_port()))
    assert p.returncode == 2, p.stderr
    assert p.stdout == ""
    assert "token" in p.stderr.lower()
