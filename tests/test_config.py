"""The TOML config file, its search order, and precedence: argument > env > file > default."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tests._cli import codecage

from codecage import ConfigError, Options, Sandbox
from codecage.config import load
from codecage.models import PoolSizes
from codecage.policy.scrub import CATEGORIES

CONFIG = """
[limits]
timeout = 10
memory_mb = 256

[policy]
profile = "analyst"
allowed_imports = ["os.path"]
enabled_profiles = ["basic", "analyst"]

[profiles.analyst]
extends = ["basic"]
modules = ["fnmatch"]
"""


@pytest.fixture
def config_file(tmp_path: Path) -> Path:
    path = tmp_path / "codecage.toml"
    path.write_text(CONFIG)
    return path


def test_the_file_sets_defaults_and_every_value_says_where_it_came_from(
    config_file: Path,
) -> None:
    settings = load(config_file, environ={})
    assert settings.limits.timeout == 10 and settings.limits.memory_mb == 256
    assert settings.sources["timeout"] == f"file {config_file}"
    assert settings.sources["cpu_seconds"] == "default"
    assert settings.profile == "analyst" and settings.sources["profile"] == f"file {config_file}"
    assert "fnmatch" in settings.custom_profiles["analyst"]
    assert "json" in settings.custom_profiles["analyst"]  # extends basic


def test_env_beats_the_file_and_arguments_beat_env(
    config_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = load(config_file, environ={"CODECAGE_TIMEOUT": "5", "CODECAGE_PROFILE": "basic"})
    assert settings.limits.timeout == 5 and settings.sources["timeout"] == "env CODECAGE_TIMEOUT"
    assert settings.profile == "basic"
    monkeypatch.setenv("CODECAGE_TIMEOUT", "5")
    sandbox = Sandbox(config=config_file)
    assert sandbox.limits.timeout == 5
    assert sandbox.run("1", limits={"timeout": 3}).limits.timeout == 3  # the call wins


def test_the_file_is_found_through_codecage_config_and_the_user_config_dir_never_the_cwd(
    config_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    found = load(environ={"CODECAGE_CONFIG": str(config_file)})
    assert (found.config_file, found.config_origin) == (config_file, "env")
    monkeypatch.chdir(tmp_path)  # ./codecage.toml is there: it does not count
    assert load(environ={"XDG_CONFIG_HOME": str(tmp_path / "none")}).config_file is None
    user = tmp_path / "xdg" / "codecage" / "config.toml"
    user.parent.mkdir(parents=True)
    user.write_text(CONFIG)
    found = load(environ={"XDG_CONFIG_HOME": str(tmp_path / "xdg")})
    assert (found.config_file, found.config_origin) == (user, "user")


def test_operator_profiles_and_enabled_profiles_govern_runs(config_file: Path) -> None:
    sandbox = Sandbox(config=config_file)
    r = sandbox.run("import fnmatch\nfrom os import path\npath.join('a', 'b')")
    assert (r.status, r.return_value) == ("ok", "a/b"), r.error
    assert sandbox.run("import shutil").status == "error"
    with pytest.raises(ConfigError) as info:
        Sandbox(config=config_file, profile="filesystem")
    assert "not enabled" in str(info.value) and "analyst" in info.value.hint
    report = sandbox.info()
    assert report.config_file == str(config_file)
    assert [p.name for p in report.profiles] == ["basic", "analyst"]


def refused(path: Path, text: str, env: dict[str, str]) -> tuple[Path, ConfigError]:
    """The config file `path` holding `text`, and the error `load` refuses it with."""
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load(path, environ=env)
    return path, info.value


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("[limits]\nmemroy_mb = 300\n", "limits.memroy_mb"),
        ("[limits]\nmemory_mb = 3\n", "memory_mb=3 from file"),
        ("[limits\n", "not valid TOML"),
        ("[polcy]\nprofile = 'basic'\n", "polcy"),
        ("[profiles.x]\nextends = ['nope']\n", "profiles.x.extends"),
    ],
)
def test_an_invalid_config_names_the_file_the_key_and_the_reason(
    tmp_path: Path, text: str, expected: str
) -> None:
    path, error = refused(tmp_path / "bad.toml", text, {})
    assert expected in str(error)
    assert str(path) in str(error)


def test_a_missing_explicit_config_file_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError):
        load(tmp_path / "absent.toml", environ={})


# --- the warm pool ([pool], CODECAGE_POOL*) ------------------------------------------------

POOL_CONFIG = """
[pool]
enabled = true
sizes = { min_idle = 2, max_idle = 8 }
profiles.data_science = { min_idle = 1, max_idle = 2 }
"""


def test_the_pool_table_sets_sizes_per_profile_and_says_where_it_came_from(
    tmp_path: Path,
) -> None:
    path = tmp_path / "codecage.toml"
    path.write_text(POOL_CONFIG)
    settings = load(path, environ={})
    assert settings.pool.enabled
    assert settings.pool.sizes == PoolSizes(min_idle=2, max_idle=8)
    assert settings.pool.sizes_for("data_science") == PoolSizes(min_idle=1, max_idle=2)
    assert settings.pool.sizes_for("basic") == PoolSizes(min_idle=2, max_idle=8)
    assert settings.sources["pool"] == f"file {path}"


@pytest.fixture
def no_pool_config(tmp_path: Path) -> Path:
    path = tmp_path / "plain.toml"
    path.write_text("[limits]\ntimeout = 10\n")
    return path


def test_the_pool_is_off_unless_configured(no_pool_config: Path) -> None:
    settings = load(no_pool_config, environ={})
    assert not settings.pool.enabled and settings.sources["pool"] == "default"
    assert settings.pool.sizes == PoolSizes(min_idle=1, max_idle=4)


def test_pool_environment_variables_beat_the_file(tmp_path: Path) -> None:
    path = tmp_path / "codecage.toml"
    path.write_text(POOL_CONFIG)
    env = {"CODECAGE_POOL": "off", "CODECAGE_POOL_MIN_IDLE": "3", "CODECAGE_POOL_MAX_IDLE": "5"}
    settings = load(path, environ=env)
    assert not settings.pool.enabled
    assert settings.pool.sizes == PoolSizes(min_idle=3, max_idle=5)
    assert settings.pool.sizes_for("data_science") == PoolSizes(min_idle=1, max_idle=2)
    assert settings.sources["pool"].startswith("env CODECAGE_POOL")
    assert load(environ={"CODECAGE_POOL": "1"}).pool.enabled


@pytest.mark.parametrize(
    ("text", "env", "expected"),
    [
        ("[pool]\nsizes = { min_idle = 5, max_idle = 2 }\n", {}, "max_idle=2 is below min_idle=5"),
        ("[pool]\nmin_idle = 2\n", {}, "pool.min_idle"),
        ("[pool]\nenabled = 'maybe'\n", {}, "pool.enabled"),
        ("[pool]\nprofiles.basic = { min_idle = -1 }\n", {}, "pool.profiles.basic.min_idle"),
        ("", {"CODECAGE_POOL": "maybe"}, "CODECAGE_POOL='maybe' is not a yes/no value"),
        ("", {"CODECAGE_POOL_MIN_IDLE": "9"}, "env CODECAGE_POOL_MIN_IDLE"),
        ("", {"CODECAGE_POOL_MAX_IDLE": "lots"}, "CODECAGE_POOL_MAX_IDLE"),
    ],
    ids=[
        "min-above-max",
        "size-outside-sizes",
        "enabled-not-bool",
        "negative-profile-size",
        "pool-env-not-yes-no",
        "min-idle-env-above-max",
        "max-idle-env-not-int",
    ],
)
def test_an_invalid_pool_setting_is_refused_naming_the_setting_and_the_reason(
    tmp_path: Path, text: str, env: dict[str, str], expected: str
) -> None:
    path, error = refused(tmp_path / "codecage.toml", text, env)
    assert expected in str(error)
    if text:
        assert str(path) in str(error)
    else:
        assert error.hint


def test_codecage_pool_turns_the_warm_pool_on_for_a_sandbox_that_does_not_choose(
    no_pool_config: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = no_pool_config
    assert Sandbox(config=path).host.pool is None
    info = Sandbox(config=path).info()
    assert info.pool is not None and not info.pool.enabled and info.pool.keys == []
    monkeypatch.setenv("CODECAGE_POOL", "1")
    monkeypatch.setenv("CODECAGE_POOL_MIN_IDLE", "0")  # nothing needs to start here
    assert Sandbox(config=path, pool=False).host.pool is None  # the argument wins
    with Sandbox(config=path, profile="basic") as sandbox:
        assert sandbox.host.pool is not None
        info = sandbox.info()
        assert info.pool is not None and info.pool.enabled
        (key,) = info.pool.keys
        assert (key.profile, key.min_idle, key.max_idle) == ("basic", 0, 4)


# --- [scrub] -------------------------------------------------------------------------------


def test_scrubbing_is_on_for_every_category_unless_configured(tmp_path: Path) -> None:
    settings = load(environ={"CODECAGE_CONFIG": str(tmp_path / "absent.toml")})
    assert settings.scrub.enabled
    assert settings.scrub.categories() == list(CATEGORIES)  # the scrubber's, same order
    assert settings.sources["scrub"] == "default"


def test_the_scrub_table_switches_categories_and_env_beats_it(tmp_path: Path) -> None:
    path = tmp_path / "codecage.toml"
    path.write_text('[scrub]\nip = false\nphone = false\nsecrets_env = ["X_TOKEN"]\n')
    settings = load(path, environ={})
    assert settings.scrub.categories() == ["email", "ssn", "credit_card", "iban", "secret"]
    assert settings.scrub.secrets_env == ["X_TOKEN"]
    assert settings.sources["scrub"] == f"file {path}"
    off = load(path, environ={"CODECAGE_SCRUB": "0"})
    assert not off.scrub.enabled and off.sources["scrub"] == "env CODECAGE_SCRUB"
    narrowed = load(path, environ={"CODECAGE_SCRUB_CATEGORIES": "ip, email"})
    assert narrowed.scrub.categories() == ["email", "ip"]


@pytest.mark.parametrize(
    ("text", "env", "expected"),
    [
        ("[scrub]\nemails = true\n", {}, "scrub.emails"),
        ("[scrub]\nenabled = 'sometimes'\n", {}, "scrub.enabled"),
        ("", {"CODECAGE_SCRUB": "maybe"}, "CODECAGE_SCRUB='maybe' is not a yes/no value"),
        ("", {"CODECAGE_SCRUB_CATEGORIES": "mail"}, "unknown scrub categories: mail"),
    ],
    ids=["unknown-key", "enabled-not-bool", "env-not-yes-no", "env-unknown-category"],
)
def test_an_invalid_scrub_setting_is_refused_naming_it(
    tmp_path: Path, text: str, env: dict[str, str], expected: str
) -> None:
    _, error = refused(tmp_path / "codecage.toml", text, env)
    assert expected in str(error)


def test_a_configured_secret_too_short_to_scrub_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "codecage.toml"
    path.write_text('[scrub]\nsecrets = ["abc"]\n')
    with pytest.raises(ConfigError, match="too short"):
        Sandbox(config=path)
    path.write_text('[scrub]\nphone_region = "XX"\n')
    with pytest.raises(ConfigError, match="phone_region"):
        Sandbox(config=path)


# --- [mcpServers.*] and [tools]: upstream servers from the config file ----------------------

MEMORY_BIN = Path(__file__).resolve().parent.parent / "tools" / "node_modules" / ".bin"


# Three calls of a tool; each call's outcome: "ok" or the ToolCallError's kind.
THREE_TOOL_CALLS = """
from codecage.runtime import ToolCallError, call_tool_sync
kinds = []
for _ in range(3):
    try:
        call_tool_sync("memory", "read_graph")
        kinds.append("ok")
    except ToolCallError as exc:
        kinds.append(exc.kind)
kinds
"""


def tool_config(directory: Path, memory_file: Path, extra: str = "") -> Path:
    path = directory / "codecage.toml"
    path.write_text(
        f"""
[mcpServers.memory]
command = "{MEMORY_BIN / "mcp-server-memory"}"
env = {{ MEMORY_FILE_PATH = "{memory_file}" }}

[tools]
servers_dir = "generated"
{extra}
""",
        encoding="utf-8",
    )
    return path


def test_the_tool_tables_are_read_and_paths_are_relative_to_the_file(tmp_path: Path) -> None:
    settings = load(tool_config(tmp_path, tmp_path / "m.jsonl", 'allow = ["memory.read_*"]'))
    assert set(settings.mcp_servers) == {"memory"}
    assert settings.tools.allow == ["memory.read_*"]
    assert settings.config_relative(settings.tools.servers_dir) == tmp_path / "generated"


def test_a_bad_key_in_the_tools_table_is_named(tmp_path: Path) -> None:
    path = tmp_path / "codecage.toml"
    path.write_text("[tools]\nserver_dir = 'x'\n", encoding="utf-8")
    with pytest.raises(ConfigError, match=r"tools\.server_dir"):
        load(path)


def test_a_bad_server_in_the_config_file_names_the_file(tmp_path: Path) -> None:
    from codecage.bridge import tooling

    path = tmp_path / "codecage.toml"
    path.write_text("[mcpServers.broken]\nargs = ['x']\n", encoding="utf-8")
    with pytest.raises(ConfigError, match=r"codecage\.toml \[mcpServers\]"):
        tooling.configured_servers(None, load(path))


@pytest.mark.skipif(
    not (MEMORY_BIN / "mcp-server-memory").exists(), reason="scripts/setup installs npm servers"
)
def test_gen_and_run_take_the_servers_and_tools_from_the_config_file(tmp_path: Path) -> None:
    memory_file = tmp_path / "memory.jsonl"
    config = tool_config(tmp_path, memory_file, 'allow = ["memory.create_*"]')
    gen = codecage("gen", "--all", "--config", str(config), cwd=tmp_path / "..")
    assert gen.returncode == 0, gen.stderr
    assert (tmp_path / "generated" / "memory" / "create_entities.py").is_file()
    code = """
from codecage.runtime import ToolCallError
from servers.memory import create_entities, read_graph
create_entities.call_sync(entities=[{"name": "n1", "entityType": "t", "observations": []}])
try:
    read_graph.call_sync()
    outcome = "read"
except ToolCallError as exc:
    outcome = exc.kind
outcome
"""
    run = codecage("run", "--json", "--config", str(config), "-", stdin=code)
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout)["return_value"] == "not_allowed"  # [tools] allow applies
    assert '"n1"' in memory_file.read_text(encoding="utf-8")


@pytest.mark.skipif(
    not (MEMORY_BIN / "mcp-server-memory").exists(), reason="scripts/setup installs npm servers"
)
def test_the_tools_table_bounds_each_runs_tool_calls(tmp_path: Path) -> None:
    from codecage.bridge import tooling

    config = tool_config(tmp_path, tmp_path / "m.jsonl", "max_calls = 2\nmax_result_mb = 0.5")
    (tmp_path / "generated").mkdir()  # no tree needed: the code calls by name
    setup = tooling.prepare(None, settings=load(config))
    try:
        with Sandbox(pool=False, options=Options(scrub=False, **setup.sandbox_arguments())) as box:
            result = box.run(THREE_TOOL_CALLS, limits={"timeout": 60})
    finally:
        setup.close()
    assert result.return_value == ["ok", "ok", "limit"]
    assert setup.tool_limits is not None and setup.tool_limits.max_result_bytes == 512 * 1024


def test_info_reports_the_tool_bounds_from_the_tools_table(tmp_path: Path) -> None:
    config = tool_config(tmp_path, tmp_path / "m.jsonl", "max_calls = 7\nmax_in_flight = 3")
    with Sandbox(config=config, pool=False) as box:
        tools = box.info().tools
    assert tools is not None
    assert (tools.max_calls, tools.max_in_flight, tools.max_result_mb) == (7, 3, 4)
    assert tools.servers == []  # this Sandbox was given no broker: its code calls nothing
    assert tools.configured_servers == ["memory"]


def test_without_a_tools_table_info_reports_the_built_in_bounds(tmp_path: Path) -> None:
    empty = tmp_path / "codecage.toml"
    empty.write_text("", encoding="utf-8")
    with Sandbox(config=empty, pool=False) as box:
        tools = box.info().tools
    assert tools is not None
    assert (tools.max_calls, tools.max_in_flight, tools.max_result_mb) == (200, 16, 4)
    assert tools.configured_servers == []


@pytest.mark.skipif(
    not (MEMORY_BIN / "mcp-server-memory").exists(), reason="scripts/setup installs npm servers"
)
def test_max_tool_calls_beats_the_tools_table_and_info_shows_it(tmp_path: Path) -> None:
    config = tool_config(tmp_path, tmp_path / "m.jsonl", "max_calls = 50")
    (tmp_path / "generated").mkdir()  # no tree needed: the code calls by name
    run = codecage(
        "run",
        "--json",
        "--config",
        str(config),
        "--max-tool-calls",
        "1",
        "-",
        stdin=THREE_TOOL_CALLS,
    )
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout)["return_value"] == ["ok", "limit", "limit"]
    info = codecage("info", "--config", str(config), timeout=60)
    assert info.returncode == 0, info.stderr
    assert "upstream MCP tools: memory (in the config file" in info.stdout
    assert "at most 50 tool calls" in info.stdout
