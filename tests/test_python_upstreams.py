"""Upstream MCP servers from PyPI, nobody here wrote: `mcp-server-time` and `mcp-server-git`.

`codecage gen` writes their tool tree, and agent code in a real sandbox calls them through
the broker: typed structured results (time), text results filtered in code (git), a
change made on the host by a tool (git commit) and the server's own refusal of a path
outside its repository, which reaches the code as a `ToolCallError`.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from tests._upstreams import generated, value

from codecage import Options, Sandbox

VENV_BIN = Path(sys.executable).parent
pytestmark = pytest.mark.skipif(
    not (VENV_BIN / "mcp-server-git").exists(), reason="scripts/setup installs the PyPI servers"
)


def git(repo: Path, *args: str) -> str:
    identity = ["-c", "user.name=Ana", "-c", "user.email=ana@example.com"]
    return subprocess.run(
        ["git", *identity, *args], cwd=repo, check=True, capture_output=True, text=True
    ).stdout


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    repo = tmp_path_factory.mktemp("repo")
    git(repo, "init", "-q", "-b", "main")
    for name, message in [("a.txt", "Add a"), ("b.txt", "Fix b"), ("c.txt", "Fix c")]:
        (repo / name).write_text(name, encoding="utf-8")
        git(repo, "add", name)
        git(repo, "commit", "-q", "-m", message)
    return repo


@pytest.fixture(scope="module")
def sandbox(repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sandbox]:
    config = {
        "mcpServers": {
            "time": {
                "command": str(VENV_BIN / "mcp-server-time"),
                "args": ["--local-timezone", "UTC"],
            },
            "git": {
                "command": str(VENV_BIN / "mcp-server-git"),
                "args": ["--repository", str(repo)],
            },
        }
    }
    servers = tmp_path_factory.mktemp("tree") / "servers"
    with (
        generated(config, ["time", "git"], servers) as broker,
        Sandbox(tools=broker, pool=False, options=Options(servers_dir=servers, scrub=False)) as box,
    ):
        yield box


def test_time_tools_return_typed_structured_results(sandbox: Sandbox) -> None:
    code = """
from servers.time import convert_time, get_current_time
now = get_current_time.call_sync(timezone="UTC")
tokyo = convert_time.call_sync(
    source_timezone="UTC", time="12:00", target_timezone="Asia/Tokyo"
)
[now["timezone"], tokyo["target"]["datetime"][11:16], tokyo["time_difference"]]
"""
    assert value(sandbox, code) == ["UTC", "21:00", "+9.0h"]


def test_agent_code_filters_the_git_log_in_the_sandbox(sandbox: Sandbox, repo: Path) -> None:
    code = f"""
from codecage.runtime import search_tools
log_tool = search_tools("commit logs", limit=1)[0].load()
text = log_tool.call_sync(repo_path={str(repo)!r}, max_count=10)
[line.split(": ", 1)[1] for line in text.splitlines() if line.startswith("Message: Fix")]
"""
    assert value(sandbox, code) == ["Fix c", "Fix b"]


def test_a_tool_commits_on_the_host_and_the_code_reads_it_back(
    sandbox: Sandbox, repo: Path
) -> None:
    (repo / "notes.txt").write_text("from the host", encoding="utf-8")
    code = f"""
from servers.git import git_add, git_commit, git_log
repo = {str(repo)!r}
git_add.call_sync(repo_path=repo, files=["notes.txt"])
git_commit.call_sync(repo_path=repo, message="Add notes from the sandbox")
git_log.call_sync(repo_path=repo, max_count=1)
"""
    assert "Add notes from the sandbox" in str(value(sandbox, code))
    assert git(repo, "log", "-1", "--format=%s").strip() == "Add notes from the sandbox"


def test_the_servers_refusal_of_another_repository_reaches_the_code(sandbox: Sandbox) -> None:
    code = """
from codecage.runtime import ToolCallError
from servers.git import git_status
try:
    git_status.call_sync(repo_path="/etc")
    outcome = ["ok", ""]
except ToolCallError as exc:
    outcome = [exc.kind, exc.message]
outcome
"""
    kind, message = value(sandbox, code)
    assert kind == "tool_error"
    assert "/etc" in message


def test_each_call_is_an_event_of_the_result(sandbox: Sandbox) -> None:
    result = sandbox.run(
        "from servers.time import get_current_time\nget_current_time.call_sync(timezone='UTC')"
    )
    calls = [event.data for event in result.events if event.kind == "tool_call"]
    assert [(call["server"], call["tool"], call["status"]) for call in calls] == [
        ("time", "get_current_time", "ok")
    ]
    assert json.dumps(result.return_value)  # the structured result is plain JSON
