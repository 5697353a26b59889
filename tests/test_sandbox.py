"""The library facade: defaults from the environment, and what `info` says of them."""

from __future__ import annotations

import pytest

from codecage import ConfigError, Limits, Sandbox
from codecage.config import load
from codecage.isolation import landlock


def test_limit_variables_set_the_defaults_and_say_so() -> None:
    settings = load(environ={"CODECAGE_MEMORY_MB": "256", "UNRELATED": "x"})
    assert settings.limits.memory_mb == 256 and settings.limits.timeout == 30
    assert settings.sources["memory_mb"] == "env CODECAGE_MEMORY_MB"
    assert settings.sources["timeout"] == "default"


def test_a_bad_limit_variable_is_refused_with_a_hint() -> None:
    with pytest.raises(ConfigError) as info:
        load(environ={"CODECAGE_TIMEOUT": "forever"})
    assert "timeout" in str(info.value) and "CODECAGE_TIMEOUT" in str(info.value)


def test_info_reports_where_each_default_came_from(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CODECAGE_MAX_PROCESSES", "32")
    report = Sandbox().info()
    assert report.default_limits.max_processes == 32
    assert report.limit_sources["max_processes"] == "env CODECAGE_MAX_PROCESSES"
    assert {layer.name for layer in report.layers} >= {"workspace", "seccomp", "namespaces"}
    assert set(report.backends) == {"bwrap", "gvisor", "landlock"}  # each named
    assert report.backends["bwrap"] is True
    assert report.backends["landlock"] is (landlock.abi() >= 1)


def test_explicit_limits_win_over_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CODECAGE_MEMORY_MB", "64")
    sandbox = Sandbox(limits=Limits(memory_mb=128))
    assert sandbox.limits.memory_mb == 128
    assert sandbox.host.limit_sources["memory_mb"] == "argument"


def test_limits_may_be_a_dict_of_overrides_and_anything_else_is_refused_at_once() -> None:
    """Issue 25's faults suite: a dict was taken and the first run failed with AttributeError."""
    sandbox = Sandbox(limits={"timeout": 3}, pool=False)
    assert (sandbox.limits.timeout, sandbox.limits.memory_mb) == (3, Limits().memory_mb)
    assert sandbox.host.limit_sources["timeout"] == "argument"
    assert sandbox.host.limit_sources["memory_mb"] != "argument"
    assert sandbox.run("6 * 7").return_value == 42
    sandbox.close()
    for bad, said in (({"timeout": -1}, "timeout"), ({"nope": 1}, "nope"), (5, "int")):
        with pytest.raises(ConfigError, match=said):
            Sandbox(limits=bad, pool=False)  # type: ignore[arg-type]
