"""Issue 18, item 2: model-sized replies.

Every MCP tool reply stays within a token budget (text and structured content together),
long output keeps its head and tail with a marker saying how much was cut and how to get
all of it, the structured content does not repeat the text, get_sandbox_info is short and
shows no host paths, the tools carry truthful annotations, and hints speak each face's
terms. Through the in-memory MCP client (`Client(server)`), plus one real stdio server.

Token counts here are this file's own estimate, written apart from reply.py's: 4 ASCII
characters a token, one token per UTF-8 byte of anything else, an image 1,600.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import jsonschema
import pytest
from mcp import Client
from mcp.client.stdio import StdioServerParameters, stdio_client
from mcp_types import CallToolResult, ImageContent, TextContent
from tests._anyio import anyio_backend  # noqa: F401 - a fixture

from codecage import config, errors
from codecage.errors import ConfigError
from codecage.mcp.server import ServerLimits, build_server
from codecage.models import Limits
from codecage.options import Options
from codecage.sandbox import Sandbox

CODECAGE = str(Path(sys.executable).with_name("codecage"))
pytestmark = pytest.mark.anyio


def tokens(result: CallToolResult) -> int:
    """The reply's estimated tokens, as the module docstring says (images at 1,600)."""
    data = result.model_dump(mode="json", by_alias=True, exclude_none=True)
    images = 0
    for block in data["content"]:
        if block["type"] == "image":
            images += 1
            block["data"] = ""
    sent = json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    ascii_chars = sum(1 for ch in sent if ord(ch) < 128)
    other_bytes = len(sent.encode("utf-8", "surrogatepass")) - ascii_chars
    return -(-ascii_chars // 4) + other_bytes + 1600 * images


def reply_bytes(result: CallToolResult) -> int:
    return len(result.model_dump_json(by_alias=True, exclude_none=True).encode())


def text_of(result: CallToolResult) -> str:
    return "\n".join(b.text for b in result.content if isinstance(b, TextContent))


def _settings(directory: Path) -> config.Settings:
    """Settings whose default profile lets the floods below import sys and os."""
    path = directory / "codecage.toml"
    path.write_text('[policy]\nallowed_imports = ["sys", "os", "zlib", "struct"]\n', "utf-8")
    path.chmod(0o600)
    directory.chmod(0o700)
    return config.load(path, environ={})


@pytest.fixture(scope="module")
async def client(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Client]:
    settings = _settings(tmp_path_factory.mktemp("cfg"))
    server = build_server(Sandbox(pool=False, options=Options(config=settings)).host)
    async with Client(server, read_timeout_seconds=180) as c:
        yield c


@pytest.fixture(scope="module")
async def small_client(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Client]:
    """A server whose operator set a small budget (4,000 tokens)."""
    settings = _settings(tmp_path_factory.mktemp("cfg"))
    server = build_server(
        Sandbox(pool=False, options=Options(config=settings)).host,
        limits=ServerLimits(reply_max_tokens=4000),
    )
    async with Client(server, read_timeout_seconds=180) as c:
        yield c


# Each kind of output a run can flood a reply with.
FLOODS = {
    "huge_stdout": "for i in range(200_000):\n    print(i, 'x' * 30)",
    "huge_stderr": "import sys\nfor i in range(100_000):\n    print('warn', i, file=sys.stderr)",
    "huge_return_value": "[{'id': i, 'name': f'row {i}'} for i in range(100_000)]",
    "huge_string_value": "'v' * 3_000_000",
    "many_files": (
        "import os\nos.makedirs('d', exist_ok=True)\n"
        "for i in range(3000):\n    open(f'd/file_with_a_long_name_{i:05}.txt', 'w').write('x')"
    ),
    "long_traceback": (
        "def f(n):\n    return f(n + 1) if n < 900 else 1 / 0\n"
        "raise ValueError('m' * 200_000) from None if f(0) else None"
    ),
    "recursion_traceback": "def f(n):\n    return f(n + 1)\nf(0)",
    "non_ascii": "for i in range(50_000):\n    print('日本語のテキスト 🎉', i)",
    "one_endless_line": "print('ab' * 2_000_000, end='')",
    "everything_at_once": (
        "import sys\nprint('o' * 900_000)\nprint('é' * 500_000, file=sys.stderr)\n'r' * 900_000"
    ),
}


@pytest.mark.parametrize("kind", sorted(FLOODS))
async def test_no_execute_code_reply_passes_the_default_budget(client: Client, kind: str) -> None:
    result = await client.call_tool("execute_code", {"code": FLOODS[kind], "timeout": 60})
    assert not result.is_error, text_of(result)
    assert tokens(result) <= 20_000, (kind, tokens(result))
    assert reply_bytes(result) <= 1_000_000
    assert result.structured_content is not None
    assert result.structured_content["status"] in ("ok", "error"), result.structured_content


@pytest.mark.parametrize("kind", sorted(FLOODS))
async def test_no_reply_passes_a_budget_the_operator_set(small_client: Client, kind: str) -> None:
    result = await small_client.call_tool("execute_code", {"code": FLOODS[kind], "timeout": 60})
    assert not result.is_error, text_of(result)
    assert tokens(result) <= 4000, (kind, tokens(result))
    # The model still learns how the run ended.
    assert "status: " in text_of(result)


async def test_inline_files_and_images_fit_the_budget_too(small_client: Client) -> None:
    code = (
        "import zlib, struct\n"
        "for i in range(5):\n    open(f'log{i}.txt', 'w').write('line of a log\\n' * 15000)\n"
        "def png(w, h):\n"
        "    raw = b''.join(b'\\x00' + bytes([i % 256]) * (w * 3) for i in range(h))\n"
        "    def chunk(t, d):\n"
        "        return struct.pack('>I', len(d)) + t + d + struct.pack('>I', zlib.crc32(t + d))\n"
        "    head = struct.pack('>IIBBBBB', w, h, 8, 2, 0, 0, 0)\n"
        "    return (b'\\x89PNG\\r\\n\\x1a\\n' + chunk(b'IHDR', head)\n"
        "            + chunk(b'IDAT', zlib.compress(raw)) + chunk(b'IEND', b''))\n"
        "for i in range(5):\n    open(f'chart{i}.png', 'wb').write(png(64, 64))\n"
    )
    return_files = [f"log{i}.txt" for i in range(5)]
    result = await small_client.call_tool(
        "execute_code", {"code": code, "return_files": return_files}
    )
    assert not result.is_error, text_of(result)
    assert tokens(result) <= 4000, tokens(result)
    # A long file keeps its head and tail, with a marker.
    assert "line of a log" in text_of(result) and "cut here" in text_of(result)
    events = result.structured_content["events"] if result.structured_content else []
    assert events[0]["kind"] == "reply_trimmed", events


async def test_long_output_keeps_head_and_tail_with_a_marker_saying_how_to_get_it(
    client: Client,
) -> None:
    code = "for i in range(100_000):\n    print('line', i)\nprint('RESULT = 42')"
    result = await client.call_tool("execute_code", {"code": code})
    text = text_of(result)
    lines = text.splitlines()
    assert lines[0] == "line 0"
    assert "RESULT = 42" in lines, text[-2000:]  # the tail: where results are
    markers = [line for line in lines if "cut here" in line]
    assert markers, text[:3000]
    assert any("return_files" in m for m in markers), markers
    assert all("lines /" in m for m in markers), markers
    assert result.structured_content is not None
    assert result.structured_content["stdout_truncated"] is True


async def test_a_traceback_after_long_output_is_kept_whole(client: Client) -> None:
    code = "for i in range(100_000):\n    print('line', i)\nraise KeyError('the real problem')"
    result = await client.call_tool("execute_code", {"code": code})
    text = text_of(result)
    assert "KeyError: 'the real problem'" in text
    assert "status: error" in text


async def test_the_structured_content_does_not_repeat_the_text(client: Client) -> None:
    code = (
        "import sys\nfor i in range(300):\n    print('UNIQUE-OUT', i)\n"
        "print('UNIQUE-ERR', file=sys.stderr)\nraise RuntimeError('UNIQUE-EXC')"
    )
    result = await client.call_tool("execute_code", {"code": code})
    text = text_of(result)
    assert "UNIQUE-OUT 299" in text and "UNIQUE-ERR" in text and "Traceback" in text
    structured = result.structured_content
    assert structured is not None
    dumped = json.dumps(structured)
    assert "UNIQUE-OUT" not in dumped and "UNIQUE-ERR" not in dumped
    assert "Traceback" not in dumped
    # ...but says where the output is, and keeps what a program needs.
    assert structured["stdout"] == "in the text" and structured["stderr"] == "in the text"
    assert structured["error"]["type"] == "RuntimeError"
    assert structured["error"]["message"] == "UNIQUE-EXC"
    assert structured["error"]["traceback"] == "in the text"
    assert structured["status"] == "error" and structured["exit_code"] == 1
    tools = {t.name: t for t in (await client.list_tools()).tools}
    jsonschema.validate(structured, tools["execute_code"].output_schema or {})


async def test_the_return_value_is_in_the_structured_content_as_json(client: Client) -> None:
    result = await client.call_tool("execute_code", {"code": "{'a': [1, 2], 'b': None}"})
    assert result.structured_content is not None
    assert result.structured_content["return_value"] == {"a": [1, 2], "b": None}
    assert "→ {'a': [1, 2], 'b': None}" in text_of(result)
    assert result.structured_content["stdout"] == ""


async def test_every_tools_output_validates_against_its_schema(client: Client) -> None:
    tools = {t.name: t for t in (await client.list_tools()).tools}
    calls = {
        "execute_code": {"code": "print(1)\n2"},
        "validate_code": {"code": "import os\nprint(1)"},
        "get_sandbox_info": {"detail": True},
    }
    for name, arguments in calls.items():
        result = await client.call_tool(name, arguments)
        assert not result.is_error, text_of(result)
        assert tools[name].output_schema is not None, name
        jsonschema.validate(result.structured_content, tools[name].output_schema)


async def test_validate_code_of_huge_code_stays_within_the_budget(small_client: Client) -> None:
    code = "\n".join(f"import mod{i}\neval('x{i}')" for i in range(20_000))
    result = await small_client.call_tool("validate_code", {"code": code})
    assert tokens(result) <= 4000, tokens(result)


async def test_a_2000_token_budget_holds_for_the_other_tools_too() -> None:
    server = build_server(Sandbox(pool=False).host, limits=ServerLimits(reply_max_tokens=2000))
    risky = "\n".join(f"import subprocess\nsubprocess.run('x{i}', shell=True)" for i in range(500))
    async with Client(server, read_timeout_seconds=120) as c:
        tools = {t.name: t for t in (await c.list_tools()).tools}
        for name, arguments in (
            ("get_sandbox_info", {"detail": True}),
            ("validate_code", {"code": risky}),
        ):
            result = await c.call_tool(name, arguments)
            assert not result.is_error, text_of(result)
            assert tokens(result) <= 2000, (name, tokens(result))
            jsonschema.validate(result.structured_content, tools[name].output_schema or {})


def _host_paths() -> list[str]:
    home = str(Path.home())
    return [p for p in {sys.executable, sys.prefix, home, os.getcwd()} if len(p) > 1]


@pytest.fixture
def config_file(tmp_path: Path) -> Path:
    skills = tmp_path / "my-skills"
    skills.mkdir()
    path = tmp_path / "codecage.toml"
    path.write_text(
        f'[serve]\nreply_max_tokens = 5000\n[tools]\nskills_dir = "{skills}"\n', encoding="utf-8"
    )
    path.chmod(0o600)
    tmp_path.chmod(0o700)
    return path


async def test_get_sandbox_info_is_short_and_shows_no_host_paths(config_file: Path) -> None:
    settings = config.load(config_file, environ={})
    server = build_server(Sandbox(pool=False, options=Options(config=settings)).host)
    async with Client(server, read_timeout_seconds=120) as c:
        short = await c.call_tool("get_sandbox_info", {})
        detail = await c.call_tool("get_sandbox_info", {"detail": True})
    assert not short.is_error and not detail.is_error
    assert tokens(short) < 700, tokens(short)
    assert tokens(detail) <= 5000, tokens(detail)  # the operator's budget, from the file
    text = text_of(short)
    for needed in ("backend", "isolation", "timeout", "memory_limit_mb", "basic", "execute_code"):
        assert needed in text, (needed, text)
    assert short.structured_content is not None
    assert short.structured_content["reply_max_tokens"] == 5000
    for reply in (short, detail):
        sent = reply.model_dump_json(by_alias=True)
        for path in [*_host_paths(), str(config_file), str(config_file.parent)]:
            assert path not in sent, path
    assert "modules" in json.dumps(detail.structured_content)


async def test_tools_carry_truthful_annotations(client: Client) -> None:
    tools = {t.name: t for t in (await client.list_tools()).tools}
    run = tools["execute_code"].annotations
    assert run is not None and tools["execute_code"].title  # the tool's title, given once
    assert run.read_only_hint is False and run.idempotent_hint is False
    assert run.destructive_hint is False  # nothing outside the throwaway sandbox changes
    assert run.open_world_hint is False  # no network, no upstream tools configured here
    for name in ("validate_code", "get_sandbox_info"):
        notes = tools[name].annotations
        assert notes is not None and tools[name].title, name
        assert notes.read_only_hint is True and notes.idempotent_hint is True, name
        assert notes.destructive_hint is False and notes.open_world_hint is False, name


# --- hints in each face's terms -------------------------------------------------------------


def test_a_hint_template_is_spelled_per_face() -> None:
    render_hint = errors.render_hint
    template = "pass {memory_mb=256} or less, or raise {workspace_mb}; {info} lists them"
    assert render_hint(template, "cli") == (
        "pass --memory-mb 256 or less, or raise --workspace-mb; `codecage info` lists them"
    )
    library = render_hint(template, "library")
    assert 'limits={"memory_mb": 256}' in library and "--" not in library
    mcp = render_hint(template, "mcp")
    assert "memory_limit_mb=256" in mcp and "--" not in mcp
    assert "operator" in mcp and "get_sandbox_info" in mcp
    assert render_hint("a {dict} stays {as=is}", "mcp") == "a {dict} stays {as=is}"


async def test_mcp_refusals_name_the_tools_arguments_not_cli_flags(client: Client) -> None:
    unknown = await client.call_tool("execute_code", {"code": "1", "profile": "nope"})
    assert unknown.is_error
    assert "profile" in text_of(unknown) and "--" not in text_of(unknown), text_of(unknown)
    bad_name = await client.call_tool("execute_code", {"code": "1", "allowed_imports": ["a b"]})
    assert bad_name.is_error
    assert "allowed_imports" in text_of(bad_name) and "--" not in text_of(bad_name)


async def test_an_upload_over_the_workspace_asks_the_operator_over_mcp() -> None:
    server = build_server(Sandbox(pool=False, limits=Limits(workspace_mb=1)).host)
    async with Client(server, read_timeout_seconds=120) as c:
        result = await c.call_tool("execute_code", {"code": "1", "files": {"a": "x" * 2**21}})
    assert result.is_error
    text = text_of(result)
    assert "--workspace-mb" not in text and "workspace_mb" in text and "operator" in text, text


async def test_a_profile_not_enabled_is_refused_in_the_tools_terms(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text('[policy]\nprofile = "basic"\nenabled_profiles = ["basic"]\n', encoding="utf-8")
    path.chmod(0o600)
    tmp_path.chmod(0o700)
    server = build_server(
        Sandbox(pool=False, options=Options(config=config.load(path, environ={}))).host
    )
    async with Client(server, read_timeout_seconds=120) as c:
        result = await c.call_tool("execute_code", {"code": "1", "profile": "filesystem"})
    assert result.is_error
    assert "profile" in text_of(result) and "--profile" not in text_of(result), text_of(result)


def test_library_refusals_name_keyword_arguments_and_the_cli_keeps_flags() -> None:
    sandbox = Sandbox(pool=False)
    with pytest.raises(ConfigError) as bad_limit:
        sandbox.run("1", limits={"memory_mb": 1})
    assert 'limits={"memory_mb"' in bad_limit.value.hint and "--" not in bad_limit.value.hint
    assert "--memory-mb" in bad_limit.value.hint_for("cli")
    with pytest.raises(ConfigError) as bad_profile:
        Sandbox(profile="nope", pool=False)
    assert "profile" in bad_profile.value.hint and "--profile" not in bad_profile.value.hint
    assert "--profile" in bad_profile.value.hint_for("cli")


def test_the_cli_still_prints_flags_in_its_hints() -> None:
    done = subprocess.run(
        [CODECAGE, "run", "-c", "1", "--profile", "nope"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2, done.stderr
    assert "Hint: pass --profile as one of" in done.stderr, done.stderr


# --- the budget's setting, and the host reader --------------------------------------------


def test_the_budget_is_one_setting_in_four_spellings(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text("[serve]\nreply_max_tokens = 8000\n", encoding="utf-8")
    path.chmod(0o600)
    tmp_path.chmod(0o700)
    assert config.load(path, environ={}).serve.reply_max_tokens == 8000
    from_env = config.load(path, environ={"CODECAGE_REPLY_MAX_TOKENS": "3000"})
    assert from_env.serve.reply_max_tokens == 3000
    assert from_env.sources["reply_max_tokens"] == "env CODECAGE_REPLY_MAX_TOKENS"
    assert config.load(None, environ={"HOME": str(tmp_path)}).serve.reply_max_tokens == 20_000
    with pytest.raises(ConfigError, match="CODECAGE_REPLY_MAX_TOKENS"):
        config.load(path, environ={"CODECAGE_REPLY_MAX_TOKENS": "10"})
    helped = subprocess.run(
        [CODECAGE, "serve", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
        env={**os.environ, "COLUMNS": "200"},
    )
    assert "--reply-max-tokens" in helped.stdout


def test_the_library_and_cli_get_head_and_tail_from_the_host_reader() -> None:
    code = "for i in range(50_000):\n    print('row', i)\nprint('THE END')"
    result = Sandbox(pool=False).run(code, limits={"max_output_bytes": 8192})
    assert result.stdout_truncated
    assert result.stdout.startswith("row 0\n")
    assert result.stdout.rstrip().endswith("THE END")
    assert "cut here" in result.stdout and "lines /" in result.stdout
    assert len(result.raw_stdout()) <= 8192
    done = subprocess.run(
        [CODECAGE, "run", "--max-output-bytes", "8192", "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.stdout.startswith("row 0\n") and "THE END" in done.stdout, done.stdout[-500:]


# --- one real stdio server ----------------------------------------------------------------


async def test_a_real_stdio_server_keeps_its_replies_within_the_budget_from_the_env(
    tmp_path: Path,
) -> None:
    env = {k: v for k, v in os.environ.items() if k == "PYTHONPATH"}
    env["CODECAGE_REPLY_MAX_TOKENS"] = "3000"
    params = StdioServerParameters(
        command=CODECAGE, args=["serve", "--no-pool"], cwd=str(tmp_path), env=env
    )
    with (tmp_path / "stderr.log").open("w", encoding="utf-8") as errlog:
        async with Client(stdio_client(params, errlog=errlog), read_timeout_seconds=120) as c:
            result = await c.call_tool(
                "execute_code", {"code": "for i in range(100_000):\n    print('n', i)"}
            )
            info = await c.call_tool("get_sandbox_info", {})
    assert tokens(result) <= 3000, tokens(result)
    text = text_of(result)
    assert text.startswith("n 0\n") and "n 99999" in text and "cut here" in text
    assert not any(isinstance(b, ImageContent) for b in result.content)
    assert info.structured_content is not None
    assert info.structured_content["reply_max_tokens"] == 3000
