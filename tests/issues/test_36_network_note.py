"""Issue 36: a refused network call says that the sandbox has no network and how to allow a
host, in the terms of the face that ran it (it read like flaky DNS: "Temporary failure in
name resolution"). Real runs on each face: the library, `codecage run`, `codecage serve`
over stdio."""

from __future__ import annotations

from pathlib import Path

import pytest
from mcp_types import TextContent
from tests._cli import codecage, serve_stdio

from codecage import Sandbox
from codecage.offline import NOTE_START

pytestmark = pytest.mark.timeout(180)

FETCH = "import urllib.request\nurllib.request.urlopen('http://example.com/', timeout=10)\n"
CONNECT = "import socket\nsocket.create_connection(('192.0.2.1', 80), timeout=10)\n"


@pytest.mark.parametrize("code", [FETCH, CONNECT], ids=["by-name", "by-address"])
def test_the_library_says_no_network_and_names_allow_hosts(code: str) -> None:
    with Sandbox(pool=False) as sandbox:
        result = sandbox.run(code)
    assert result.status == "error" and result.error is not None
    last = result.error.traceback.rstrip("\n").splitlines()[-1]
    assert last.startswith(NOTE_START), result.error.traceback
    assert "allow_hosts=['api.example.com']" in last and "--allow-host" not in last


def test_an_error_that_is_not_about_the_network_gets_no_note() -> None:
    with Sandbox(pool=False) as sandbox:
        result = sandbox.run("raise OSError('Temporary failure of the disk')")
    assert result.error is not None and NOTE_START not in result.error.traceback


def test_the_cli_says_no_network_and_names_the_flag(tmp_path: Path) -> None:
    done = codecage("run", "--code", FETCH, cwd=tmp_path)
    assert done.returncode == 1
    assert "Temporary failure in name resolution" in done.stderr  # what Python said, kept
    assert f"{NOTE_START}: this run may reach no host" in done.stderr
    assert "--allow-host HOST" in done.stderr and "allow_hosts=" not in done.stderr


@pytest.mark.anyio
async def test_mcp_says_no_network_in_the_tools_terms(tmp_path: Path) -> None:
    async with serve_stdio(tmp_path) as client:
        closed = await client.call_tool("execute_code", {"code": FETCH})
    config = tmp_path / "config.toml"  # a call may ask for example.org; none is given
    config.write_text('[network]\nceiling = ["example.org"]\n', encoding="utf-8")
    config.chmod(0o600)
    async with serve_stdio(tmp_path, env={"CODECAGE_CONFIG": str(config)}) as client:
        open_to_some = await client.call_tool("execute_code", {"code": FETCH})
    for result in (closed, open_to_some):
        block = result.content[0]
        assert isinstance(block, TextContent)
        assert NOTE_START in block.text and "--allow-host HOST" not in block.text.split("(")[0]
    closed_text = closed.content[0].text  # type: ignore[union-attr]
    assert "this server permits no host: its operator can allow some" in closed_text
    some_text = open_to_some.content[0].text  # type: ignore[union-attr]
    assert "call execute_code with allow_hosts=['api.example.com']" in some_text
