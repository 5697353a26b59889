"""Issue 18, items 5 and 6: install like a Python tool, reuse the MCP servers a host already
has (`--mcp-host`), and a CLI that teaches (--version, -h, help at 80 columns, usage errors
as JSON, errors with their reason, hints only where they help)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from tests._source import top_level_imports

import codecage
from codecage.bridge import hosts
from codecage.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]


def _commands() -> list[str]:
    """Every command and sub-command of the CLI, as typed after `codecage` ("" for itself)."""
    import typer

    from codecage.cli import app

    found, pending = [], [("", typer.main.get_command(app))]
    while pending:
        path, command = pending.pop(0)
        found.append(path)
        for name, sub in sorted(getattr(command, "commands", {}).items()):
            pending.append((f"{path} {name}".strip(), sub))
    return found


COMMANDS = _commands()
TIME_SERVER = str(Path(sys.executable).parent / "mcp-server-time")


def cli(
    *args: str, env: dict[str, str] | None = None, cwd: Path | None = None, columns: int = 80
) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("CODECAGE_")}
    base |= {"COLUMNS": str(columns), "NO_COLOR": "1", "TERM": "dumb"}
    return subprocess.run(
        [sys.executable, "-m", "codecage.cli", *args],
        input="",
        capture_output=True,
        text=True,
        env=base | (env or {}),
        cwd=cwd,
        timeout=120,
        check=False,
    )


# --- item 6: a CLI that teaches ---------------------------------------------------------


@pytest.mark.parametrize("flag", ["--version", "-V"])
def test_version_flag_prints_the_version(flag: str) -> None:
    p = cli(flag)
    assert p.returncode == 0, p.stderr
    assert p.stdout == f"codecage {codecage.__version__}\n"


@pytest.mark.parametrize("command", COMMANDS)
def test_dash_h_is_help_on_every_command(command: str) -> None:
    short = cli(*command.split(), "-h")
    assert short.returncode == 0, short.stderr
    assert short.stdout == cli(*command.split(), "--help").stdout
    assert "Usage: codecage" in short.stdout


def _prose(help_text: str) -> list[list[str]]:
    """The paragraphs of the help above the first panel, as lists of lines."""
    paragraphs: list[list[str]] = [[]]
    for line in help_text.split("╭", 1)[0].splitlines():
        if line.strip():
            paragraphs[-1].append(line.rstrip())
        elif paragraphs[-1]:
            paragraphs.append([])
    return [p for p in paragraphs if p and not p[0].lstrip().startswith("Usage:")]


@pytest.mark.parametrize("command", COMMANDS)
def test_help_wraps_cleanly_at_80_columns(command: str) -> None:
    text = cli(*command.split(), "--help").stdout
    lines = text.splitlines()
    assert all(len(line) <= 80 for line in lines), [x for x in lines if len(x) > 80]
    assert "…" not in text, "a cell of the help was cut off"
    for paragraph in _prose(text):
        examples = [line for line in paragraph if line.startswith("     ")]
        if examples:  # one example a line, never wrapped onto a second
            assert len(examples) == len(paragraph), paragraph
            continue
        # Wrapped prose fills its lines: a short line before the last is an orphan break.
        for line in paragraph[:-1]:
            assert len(line) >= 50, (command, paragraph)


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["run", "--bogus"], "--bogus"),
        (["run", "--timeout", "abc", "--code", "1"], "--timeout"),
        (["validate", "--json", "--code"], "--code"),
        (["info", "--pool", "extra-argument"], "extra-argument"),
    ],
)
def test_usage_errors_with_json_are_one_json_object(args: list[str], needle: str) -> None:
    p = cli(args[0], "--json", *args[1:])
    assert p.returncode == 2, p.stderr
    error = json.loads(p.stdout)["error"]  # the whole of stdout is one object
    assert error["type"] == "UsageError"
    assert needle in error["message"]
    assert "--help" in error["hint"]


def test_usage_errors_without_json_keep_stdout_empty() -> None:
    p = cli("run", "--bogus")
    assert p.returncode == 2
    assert p.stdout == ""
    assert "No such option: --bogus" in p.stderr


def test_an_unreadable_file_says_why(tmp_path: Path) -> None:
    p = cli("run", "--file", "nope.py", cwd=tmp_path)
    assert p.returncode == 2
    assert "cannot read nope.py: No such file or directory" in p.stderr
    assert "Hint:" not in p.stderr  # the reason says it all
    j = json.loads(cli("run", "--file", "nope.py", "--json", cwd=tmp_path).stdout)["error"]
    assert j["message"] == "cannot read nope.py: No such file or directory"
    assert j["hint"] is None
    (tmp_path / "dir.py").mkdir()
    assert "is a directory" in cli("run", "--file", "dir.py", cwd=tmp_path).stderr


def test_errors_get_their_own_hint_not_the_limits_one(tmp_path: Path) -> None:
    bad = tmp_path / "mcp.json"
    bad.write_text("{not json", encoding="utf-8")
    for args in (
        ["run", "--mcp-config", str(bad), "--code", "1"],
        ["gen", "--mcp-config", str(bad)],
        ["validate", "--file", str(tmp_path / "missing.py")],
        ["run", "--mcp-host", "emacs", "--code", "1"],
    ):
        p = cli(*args)
        assert p.returncode == 2, (args, p.stderr)
        assert "codecage info" not in p.stderr, (args, p.stderr)


def test_a_bad_limit_still_points_at_codecage_info() -> None:
    p = cli("run", "--memory-mb", "0", "--code", "1")
    assert p.returncode == 2
    assert "codecage info" in p.stderr


def test_the_cli_reference_is_rendered_at_80_columns() -> None:
    doc = (ROOT / "docs" / "cli.md").read_text(encoding="utf-8")
    blocks = re.findall(r"## codecage[a-z ]*\n\n```text\n(.*?)```", doc, re.DOTALL)
    assert len(blocks) >= 7
    for block in blocks:
        assert max(len(line) for line in block.splitlines()) <= 80


# --- item 5: install like a Python tool ---------------------------------------------------


def _runtime_closure() -> set[str]:
    """Distributions `pip install .` brings: pyproject's dependencies and theirs, no extras."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    pending = [Requirement(r) for r in project["dependencies"]]
    seen: set[str] = set()
    while pending:
        req = pending.pop()
        name = req.name.lower().replace("_", "-")
        if name in seen or (req.marker is not None and not req.marker.evaluate({"extra": ""})):
            continue
        seen.add(name)
        pending += [Requirement(r) for r in metadata.requires(req.name) or []]
    return seen


# Modules imported only when their extra is wanted (the store by a postgresql:// URL, a batch
# with --ray), each with the extra that installs what it imports; the test below checks that.
_OPTIONAL_MODULES = {"audit/postgres.py": "postgres", "audit/web.py": "web", "ray.py": "ray"}


def _third_party_imports() -> set[str]:
    found: set[str] = set()
    for path in (ROOT / "src" / "codecage").rglob("*.py"):
        if "guest" in path.parts:  # runs inside the sandbox, on the stdlib only
            continue
        if path.relative_to(ROOT / "src" / "codecage").as_posix() in _OPTIONAL_MODULES:
            continue
        found |= top_level_imports(path)
    return found - set(sys.stdlib_module_names) - {"codecage", "servers", "__future__"}


def test_a_module_of_an_extra_imports_only_what_its_extra_installs() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    owners = metadata.packages_distributions()
    for module, extra in _OPTIONAL_MODULES.items():
        wanted = {Requirement(r).name.lower() for r in project["optional-dependencies"][extra]}
        imports = top_level_imports(ROOT / "src" / "codecage" / module)
        third = imports - set(sys.stdlib_module_names) - {"codecage", "__future__"}
        for name in third:
            dists = {d.lower() for d in owners.get(name, [])}
            assert dists & wanted, f"{module} imports {name}, not installed by [{extra}]"


def test_every_module_the_host_imports_comes_with_pip_install() -> None:
    closure = _runtime_closure()
    owners = metadata.packages_distributions()
    missing = {
        module: owners.get(module)
        for module in _third_party_imports()
        if not any(d.lower().replace("_", "-") in closure for d in owners.get(module, []))
    }
    assert not missing, f"imported but not installed by `pip install .`: {missing}"
    assert not closure & {"pytest", "mypy", "ruff", "hypothesis"}, "test tools at run time"


def test_the_test_tools_are_in_the_dev_extra_and_data_packages_in_data() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    extras = project["optional-dependencies"]
    dev = {Requirement(r).name for r in extras["dev"]}
    assert {"pytest", "mypy", "ruff"} <= dev
    assert {"numpy", "pandas"} <= {Requirement(r).name for r in extras["data"]}
    assert project["scripts"]["codecage"] == "codecage.cli:main"


# --- item 5: the servers an MCP host already has ------------------------------------------


def _home(tmp_path: Path) -> Path:
    home = tmp_path / "home"
    home.mkdir(mode=0o700)
    return home


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    path.write_text(text, encoding="utf-8")
    path.chmod(0o600)
    return path


def _env(home: Path, **more: str) -> dict[str, str]:
    return {"HOME": str(home), "PATH": os.environ.get("PATH", ""), **more}


def test_claude_code_user_servers_are_read_and_sse_is_skipped(tmp_path: Path) -> None:
    home = _home(tmp_path)
    _write(
        home / ".claude.json",
        json.dumps(
            {
                "numStartups": 4,
                "projects": {"/work": {"mcpServers": {"local-only": {"command": "x"}}}},
                "mcpServers": {
                    "time": {"type": "stdio", "command": TIME_SERVER, "args": [], "env": {}},
                    "api": {
                        "type": "http",
                        "url": "${API_BASE:-https://api.example/mcp}",
                        "headers": {"Authorization": "Bearer ${API_KEY}"},
                    },
                    "old": {"type": "sse", "url": "https://example/sse"},
                },
            }
        ),
    )
    found = hosts.read("claude-code", _env(home, API_KEY="k1"))
    assert sorted(found.servers) == ["api", "time"]  # not the project-local one
    assert found.servers["api"].url == "https://api.example/mcp"
    assert found.servers["api"].headers == {"Authorization": "Bearer k1"}
    assert "SSE" in found.skipped["old"]
    assert found.files == [home / ".claude.json"]
    # An unset variable without a default skips that server, and says which.
    unset = hosts.read("claude-code", _env(home))
    assert "API_KEY" in unset.skipped["api"]


def test_cursor_and_claude_desktop_files(tmp_path: Path) -> None:
    home = _home(tmp_path)
    entry = {"mcpServers": {"time": {"command": TIME_SERVER, "env": {"TZ": "${env:ZONE}"}}}}
    _write(home / ".cursor" / "mcp.json", json.dumps(entry))
    _write(home / ".config" / "Claude" / "claude_desktop_config.json", json.dumps(entry))
    for host in ("cursor", "claude-desktop"):
        found = hosts.read(host, _env(home, ZONE="UTC"))
        assert found.servers["time"].command == TIME_SERVER
        assert found.servers["time"].env == {"TZ": "UTC"}


def test_vscode_mcp_json_with_comments_and_settings_json(tmp_path: Path) -> None:
    home = _home(tmp_path)
    user = home / ".config" / "Code" / "User"
    _write(
        user / "mcp.json",
        """{
  // servers for every workspace
  "servers": {
    "time": {"type": "stdio", "command": "${userHome}/bin/time", "args": ["--x"],},
    "gh": {"type": "http", "url": "https://api.example/mcp",
           "headers": {"Authorization": "Bearer ${input:token}"}},
    "dotenv": {"type": "stdio", "command": "x", "envFile": "${workspaceFolder}/.env"},
    /* a block comment, with "quotes" */
  },
  "inputs": [{"id": "token", "type": "promptString", "password": true}],
}""",
    )
    _write(
        user / "settings.json",
        '{"editor.fontSize": 13, "mcp": {"servers": {"remote": '
        '{"type": "http", "url": "https://remote.example/mcp"}}}, }',
    )
    found = hosts.read("vscode", _env(home))
    assert found.servers["time"].command == f"{home}/bin/time"
    assert found.servers["time"].args == ("--x",)
    assert found.servers["remote"].url == "https://remote.example/mcp"
    assert "${input:token}" in found.skipped["gh"]
    assert "envFile" in found.skipped["dotenv"]


def test_untrusted_host_files_are_refused(tmp_path: Path) -> None:
    home = _home(tmp_path)
    path = _write(home / ".cursor" / "mcp.json", '{"mcpServers": {}}')
    path.chmod(0o666)
    with pytest.raises(ConfigError, match="writable by group and others"):
        hosts.read("cursor", _env(home))
    path.chmod(0o600)
    (home / ".cursor").chmod(0o777)
    with pytest.raises(ConfigError, match="not trusted"):
        hosts.read("cursor", _env(home))
    (home / ".cursor").chmod(0o700)
    if os.geteuid() == 0:
        os.chown(path, 12345, 12345)
        with pytest.raises(ConfigError, match="owned by uid 12345"):
            hosts.read("cursor", _env(home))


def test_a_projects_own_files_are_never_read(tmp_path: Path) -> None:
    home = _home(tmp_path)
    project = tmp_path / "project"
    marker = tmp_path / "started"
    # What a cloned project could ship: each would start this command on the host.
    script = _write(project / "evil.sh", f"#!/bin/sh\ntouch {marker}\n")
    script.chmod(0o700)
    evil = json.dumps({"mcpServers": {"evil": {"command": str(script)}}})
    for name in (".mcp.json", ".cursor/mcp.json", "mcp.json", ".claude.json"):
        _write(project / name, evil)
    _write(project / ".vscode" / "mcp.json", json.dumps({"servers": {"evil": {"command": "x"}}}))
    for host in hosts.HOSTS:
        p = cli(
            "gen", "--mcp-host", host, "--all", "--json", env=_env(home), cwd=project
        )  # fmt: skip
        assert p.returncode == 2, p.stderr
        assert "no MCP servers" in json.loads(p.stdout)["error"]["message"]
    assert not marker.exists()


def test_run_calls_a_tool_of_a_server_found_in_the_host_config(tmp_path: Path) -> None:
    home = _home(tmp_path)
    _write(
        home / ".claude.json",
        json.dumps({"mcpServers": {"time": {"type": "stdio", "command": TIME_SERVER}}}),
    )
    code = (
        "from servers.time import get_current_time as g\n"
        "g.call_sync(g.Params(timezone='UTC'))['timezone']"
    )
    p = cli("run", "--mcp-host", "claude-code", "--code", code, "--json", env=_env(home))
    assert p.returncode == 0, p.stderr
    result = json.loads(p.stdout)
    assert result["return_value"] == "UTC"
    assert result["mcp_hosts"] == [
        {"host": "claude-code", "files": [str(home / ".claude.json")], "servers": ["time"],
         "skipped": {}}
    ]  # fmt: skip
    assert "MCP servers of claude-code" in p.stderr and ": time" in p.stderr


def test_gen_writes_the_host_servers_tools_and_reports_them(tmp_path: Path) -> None:
    home = _home(tmp_path)
    _write(
        home / ".cursor" / "mcp.json",
        json.dumps({"mcpServers": {"time": {"command": TIME_SERVER}}}),
    )
    out = tmp_path / "servers"
    p = cli("gen", "--mcp-host", "cursor", "--all", "--out", str(out), "--json", env=_env(home))
    assert p.returncode == 0, p.stderr
    report = json.loads(p.stdout)
    assert report["servers"] == ["time"]
    assert report["mcp_hosts"][0]["servers"] == ["time"]
    assert (out / "time" / "get_current_time.py").is_file()


def test_a_workspace_holding_the_host_file_is_refused(tmp_path: Path) -> None:
    home = _home(tmp_path)
    _write(home / ".cursor" / "mcp.json", json.dumps({"mcpServers": {"t": {"command": "x"}}}))
    workspace = str(home / ".cursor")  # code run there could rewrite the host's servers
    p = cli("run", "--mcp-host", "cursor", "--workspace", workspace, "--code", "1", env=_env(home))
    assert p.returncode == 2
    assert "could rewrite the commands" in p.stderr


def test_an_unknown_host_names_the_known_ones() -> None:
    with pytest.raises(ConfigError) as caught:
        hosts.read("emacs")
    assert caught.value.hint is not None and "claude-code" in caught.value.hint


def test_a_server_in_both_mcp_config_and_the_host_is_the_files_and_said(tmp_path: Path) -> None:
    home = _home(tmp_path)
    entry = {"mcpServers": {"time": {"command": TIME_SERVER}}}
    _write(home / ".cursor" / "mcp.json", json.dumps(entry))
    mine = _write(tmp_path / "mine.json", json.dumps(entry))
    out = tmp_path / "servers"
    p = cli(
        "gen", "--mcp-config", str(mine), "--mcp-host", "cursor", "--all", "--out", str(out),
        "--json", env=_env(home),
    )  # fmt: skip
    assert p.returncode == 0, p.stderr
    cursor = json.loads(p.stdout)["mcp_hosts"][0]
    assert cursor["servers"] == [] and "--mcp-config" in cursor["skipped"]["time"]
