"""Hostile configuration: the config file and the `CODECAGE_*` variables (issue 25).

Property: `config.load` gives `Settings` or a `ConfigError` that names where the bad value
came from (the file and the key, or the variable), never another exception; and no place
inside the current directory or a workspace is ever read as configuration.

Findings (fixed in config.py `_read`, regression tests below): a config file with arrays or
tables nested too deeply raised RecursionError, and an integer of more than 4300 digits
(valid TOML) ValueError, out of `config.load`, instead of a ConfigError; a bad
`CODECAGE_*` value was repeated whole in the error (a 5,000-digit value, a 5,000-character
message): now cut to 80 characters.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from codecage import config
from codecage.config import ConfigFile, Settings
from codecage.errors import ConfigError
from codecage.models import Limits

# --- a small TOML writer: any value, valid TOML or (on purpose) not -------------------------


def toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        return ("inf" if value > 0 else "-inf") if math.isinf(value) else repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # TOML's basic string, or invalid (a surrogate, DEL): fine
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    return "{" + ", ".join(f"{json.dumps(k)} = {toml_value(v)}" for k, v in value.items()) + "}"


def toml_document(sections: dict[str, dict[str, Any]]) -> str:
    lines = []
    for section, keys in sections.items():
        lines.append(f"[{json.dumps(section)}]")
        lines += [f"{json.dumps(key)} = {toml_value(value)}" for key, value in keys.items()]
    return "\n".join(lines) + "\n"


SECTIONS = [*sorted(ConfigFile.model_fields), "mcpServers"]
KNOWN_KEYS = sorted(
    set(Limits.model_fields)
    | {"profile", "allowed_imports", "enabled_profiles", "modules", "extends", "enabled"}
    | {"sizes", "min_idle", "max_idle", "fork_server", "ip", "email", "secrets_env"}
    | {"reply_max_tokens", "data_dir", "idle_ttl", "lifetime", "cpu_seconds", "allow"}
    | {"servers_dir", "skills_dir", "max_calls", "dir", "uid", "gid", "backends", "store"}
    | {"require", "timeout", "command", "args", "env", "webhook"}
)
scalars = st.one_of(
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.sampled_from([0, 1, -1, 2**31, 2**63, 10**30]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=30),
    st.sampled_from(["", "..", "/", "/etc/shadow", "~", "a\x00b", "\u202e", "basic", "high"]),
)
values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(st.sampled_from(KNOWN_KEYS) | st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=10,
)
documents = st.dictionaries(
    st.sampled_from(SECTIONS) | st.text(max_size=12),
    st.dictionaries(st.sampled_from(KNOWN_KEYS) | st.text(max_size=12), values, max_size=5),
    max_size=4,
)


def write_config(directory: Path, data: bytes) -> Path:
    """A config file the trust rule accepts (ours, 0600, in a 0700 directory)."""
    path = directory / "config.toml"
    path.write_bytes(data)
    path.chmod(0o600)
    return path


def load_or_refusal(path: Path | None, environ: dict[str, str]) -> Settings | ConfigError:
    """The property itself: `load` gives Settings or a ConfigError (anything else fails)."""
    try:
        return config.load(path, environ=environ)
    except ConfigError as exc:
        assert str(exc).strip(), "a refusal says what is wrong"
        return exc


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An empty directory for XDG_CONFIG_HOME: the machine's own config is never read."""
    made = tmp_path_factory.mktemp("fuzz-config")
    made.chmod(0o700)
    return made


def _env(home: Path, **extra: str) -> dict[str, str]:
    return {"XDG_CONFIG_HOME": str(home / "xdg"), **extra}


_FAST = settings(max_examples=70, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@_FAST
@given(sections=documents)
def test_any_config_document_gives_settings_or_a_refusal_naming_the_file(
    home: Path, sections: dict[str, dict[str, Any]]
) -> None:
    path = write_config(home, toml_document(sections).encode("utf-8", "surrogatepass"))
    outcome = load_or_refusal(path, _env(home))
    if isinstance(outcome, ConfigError):
        assert str(path) in str(outcome), outcome
    else:
        assert outcome.config_file == path


@_FAST
@given(data=st.binary(max_size=400) | st.text(max_size=400).map(str.encode))
def test_any_bytes_as_a_config_file_give_settings_or_a_refusal(home: Path, data: bytes) -> None:
    path = write_config(home, data)
    outcome = load_or_refusal(path, _env(home))
    if isinstance(outcome, ConfigError):
        assert str(path) in str(outcome), outcome


@pytest.mark.parametrize(
    "text",
    [
        "a = " + "[" * 5000 + "]" * 5000,
        "a = " + "{b = " * 3000 + "1" + "}" * 3000,
        "[limits]\ntimeout = " + "9" * 5000,
        "[mcpServers.x]\nargs = [" + "9" * 4301 + "]",
    ],
    ids=["deep-array", "deep-table", "huge-int-limit", "huge-int-anywhere"],
)
def test_a_config_file_past_the_parsers_bounds_is_refused_not_a_crash(
    home: Path, text: str
) -> None:
    """Regression: RecursionError / ValueError came out of `config.load`."""
    path = write_config(home, text.encode())
    with pytest.raises(ConfigError, match=str(path)):
        config.load(path, environ=_env(home))


# --- the environment ----------------------------------------------------------------------

ENV_VARS = sorted(
    {f"CODECAGE_{name.upper()}" for name in Limits.model_fields}
    | {"CODECAGE_PROFILE", "CODECAGE_ALLOWED_IMPORTS", "CODECAGE_ENABLED_PROFILES"}
    | {"CODECAGE_POOL", "CODECAGE_POOL_MIN_IDLE", "CODECAGE_POOL_MAX_IDLE"}
    | {"CODECAGE_FORK_SERVER", "CODECAGE_SCRUB", "CODECAGE_SCRUB_CATEGORIES"}
    | {"CODECAGE_REPLY_MAX_TOKENS", "CODECAGE_AUDIT"}
)
env_values = st.one_of(
    st.text(max_size=40).map(lambda t: t.replace("\x00", "")),  # an environment has no NUL
    st.integers(-(2**70), 2**70).map(str),
    st.sampled_from(["nan", "inf", "-0", "1e999", "0x10", " 1 ", "1_000", "true", "١٢"]),
    st.just("9" * 5000),
)


@_FAST
@given(assigned=st.dictionaries(st.sampled_from(ENV_VARS), env_values, min_size=1, max_size=4))
def test_any_codecage_variables_give_settings_or_a_refusal_naming_one(
    home: Path, assigned: dict[str, str]
) -> None:
    """A refusal names the variable it is about (and no other place could be at fault:
    no file is read here). A value that is taken shows where it came from."""
    outcome = load_or_refusal(None, _env(home, **assigned))
    if isinstance(outcome, ConfigError):
        assert any(name in str(outcome) for name in assigned), outcome
        assert len(str(outcome)) < 1000, "the bad value is shown cut, not whole"
        return
    for name in Limits.model_fields:
        if f"CODECAGE_{name.upper()}" in assigned:
            assert outcome.sources[name] == f"env CODECAGE_{name.upper()}"


@settings(max_examples=60, deadline=None)
@given(value=st.text(min_size=1, max_size=60).map(lambda t: t.replace("\x00", "")))
def test_any_codecage_config_value_gives_settings_or_a_refusal(home: Path, value: str) -> None:
    """CODECAGE_CONFIG names any path (relative, a directory, a device, missing): a file
    that is there is read under the trust rule or refused; never an exception."""
    if not value:
        return
    outcome = load_or_refusal(None, _env(home, CODECAGE_CONFIG=value))
    if isinstance(outcome, Settings) and outcome.config_file is not None:
        assert outcome.config_origin == "env"


@pytest.mark.parametrize("name", ["CODECAGE_TIMEOUT", "CODECAGE_POOL", "CODECAGE_POOL_MIN_IDLE"])
def test_a_huge_bad_variable_is_named_and_shown_cut(home: Path, name: str) -> None:
    """Regression: the whole value was repeated in the message."""
    with pytest.raises(ConfigError, match=name) as refused:
        config.load(None, environ=_env(home, **{name: "9" * 100_000}))
    assert len(str(refused.value)) < 1000


@pytest.mark.parametrize("target", ["/dev/zero", "/dev/null", "/proc/self/mem", "/", "/etc"])
def test_a_config_path_that_is_no_regular_file_is_refused_without_reading_it(
    home: Path, target: str
) -> None:
    with pytest.raises(ConfigError):
        config.load(Path(target), environ=_env(home))


# --- never from the current directory or a workspace -------------------------------------

PLANTED_NAMES = [
    "codecage.toml",
    ".codecage.toml",
    "config.toml",
    "codecage/config.toml",
    ".config/codecage/config.toml",
    ".codecage/config.toml",
]


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(names=st.lists(st.sampled_from(PLANTED_NAMES), min_size=1, unique=True))
def test_a_config_planted_in_the_current_directory_is_never_read(
    home: Path, names: list[str]
) -> None:
    """Whatever name it has, a config file in the current directory (where code run with
    `--workspace .` can write) configures nothing: no upstream command, no limit."""
    project = home / "project"
    for name in names:
        planted = project / name
        planted.parent.mkdir(parents=True, exist_ok=True)
        planted.write_text('[mcpServers.evil]\ncommand = "touch"\n[limits]\ntimeout = 3600\n')
        planted.chmod(0o600)
    before = os.getcwd()
    os.chdir(project)
    try:
        loaded = config.load(None, environ=_env(home))
    finally:
        os.chdir(before)
    assert loaded.config_file is None and loaded.mcp_servers == {}
    assert loaded.limits.timeout == Limits().timeout


@pytest.mark.parametrize("inside", ["the-file", "its-directory", "searched-place"])
def test_a_workspace_holding_a_place_config_is_read_from_is_refused(
    tmp_path: Path, inside: str
) -> None:
    tmp_path.chmod(0o700)
    xdg = tmp_path / "xdg"
    (xdg / "codecage").mkdir(parents=True)
    used = write_config(xdg / "codecage", b"")
    loaded = config.load(None, environ={"XDG_CONFIG_HOME": str(xdg)})
    assert loaded.config_file == used
    workspace = {"the-file": xdg / "codecage", "its-directory": xdg, "searched-place": tmp_path}
    with pytest.raises(ConfigError, match="workspace"):
        config.check_workspace(loaded, workspace[inside])
    os.unlink(used)  # nothing configured: the searched places still may not be workspaces
    with pytest.raises(ConfigError, match="workspace"):
        config.check_workspace(config.load(None, environ={"XDG_CONFIG_HOME": str(xdg)}), xdg)
