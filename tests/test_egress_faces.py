"""The faces' `allow_hosts`: `Sandbox(allow_hosts=)` and `run(allow_hosts=)`, `codecage run
--allow-host`, `codecage serve --allow-host` and MCP `execute_code(allow_hosts=)`, down to the
`egress` of the `host.Request` each face makes. Egress itself (the proxy, the relay) is not
wired yet: these runs are real, and what they prove is the policy a run is given, the network
modules its import policy allows with it, and the refusals worded for each face."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from mcp_types import TextContent
from tests._cli import codecage, serve_stdio

from codecage import Sandbox, host
from codecage.errors import ConfigError

CONFIG = """\
[network]
allow = ["api.example.com"]
deny = ["secret.example.com"]
ceiling = ["*.example.org", "files.example.net:8443"]

[network.profiles.data_science]
allow = ["data.example.org"]
"""

IMPORT_HTTP = "import http.client, urllib.request\n'imported'"


@pytest.fixture
def config_file(tmp_path: Path, clean_env: dict[str, str]) -> Path:
    path = tmp_path / "codecage.toml"
    path.write_text(CONFIG, encoding="utf-8")
    return path


class _Spy:
    """A Host (which cannot be changed once built) seen through: its `run` requests are
    kept, every other attribute is the Host's own."""

    def __init__(self, real: host.Host, requests: list[host.Request]) -> None:
        self._real = real
        self._requests = requests

    def run(self, request: host.Request) -> Any:
        self._requests.append(request)
        return self._real.run(request)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


class Recorded:
    """The `host.Request`s a Sandbox's host runtime was given (each still runs for real)."""

    def __init__(self, sandbox: Sandbox) -> None:
        self.requests: list[host.Request] = []
        sandbox.host = _Spy(sandbox.host, self.requests)  # type: ignore[assignment]

    def allowed(self) -> list[str]:
        egress = self.requests[-1].egress
        assert egress is not None
        return [r.text for r in egress.allow]


@pytest.fixture
def basic(config_file: Path) -> Iterator[tuple[Sandbox, Recorded]]:
    """A Sandbox of the curated `basic` profile (no network modules) under CONFIG."""
    with Sandbox(config=config_file, profile="basic", pool=False, allow_hosts=["pypi.org"]) as sb:
        yield sb, Recorded(sb)


# --- the library -------------------------------------------------------------------------


def test_a_sandboxs_runs_get_the_configs_and_its_own_hosts(basic: tuple[Sandbox, Recorded]) -> None:
    sandbox, recorded = basic
    result = sandbox.run(IMPORT_HTTP)
    assert result.status == "ok", result.error
    assert recorded.allowed() == ["api.example.com", "pypi.org"]
    egress = recorded.requests[-1].egress
    assert egress is not None and [r.text for r in egress.deny] == ["secret.example.com"]
    policy = recorded.requests[-1].policy
    assert policy is not None and policy.profile == "basic" and policy.allows("socket")


def test_run_allow_hosts_within_the_ceiling_is_added(basic: tuple[Sandbox, Recorded]) -> None:
    sandbox, recorded = basic
    result = sandbox.run("1", allow_hosts=["a.example.org", "files.example.net:8443"])
    assert result.status == "ok", result.error
    assert recorded.allowed() == [
        "api.example.com",
        "pypi.org",
        "a.example.org",
        "files.example.net:8443",
    ]


def test_run_allow_hosts_outside_the_ceiling_is_refused_before_anything_runs(
    basic: tuple[Sandbox, Recorded],
) -> None:
    sandbox, recorded = basic
    with pytest.raises(ConfigError) as caught:
        sandbox.run("1", allow_hosts=["evil.example", "a.example.org"])
    assert recorded.requests == []
    assert str(caught.value).startswith("allow_hosts asks for evil.example, outside")
    assert "*.example.org" in str(caught.value) and "pypi.org" in str(caught.value)
    assert "Sandbox(allow_hosts=[...])" in caught.value.hint


@pytest.mark.anyio
async def test_arun_takes_allow_hosts_too(basic: tuple[Sandbox, Recorded]) -> None:
    sandbox, recorded = basic
    result = await sandbox.arun("1", allow_hosts=["b.example.org"])
    assert result.status == "ok", result.error
    assert recorded.allowed()[-1] == "b.example.org"
    with pytest.raises(ConfigError, match=r"secret\.example\.com is denied"):
        await sandbox.arun("1", allow_hosts=["secret.example.com"])


def test_a_profiles_hosts_go_to_its_runs(config_file: Path) -> None:
    with Sandbox(config=config_file, profile="data_science", pool=False) as sandbox:
        recorded = Recorded(sandbox)
        assert sandbox.run("1", allow_hosts=["x.example.org"]).status == "ok"
    assert recorded.allowed() == ["api.example.com", "data.example.org", "x.example.org"]


def test_without_any_host_a_run_has_no_egress_and_no_network_modules(clean_env: object) -> None:
    with Sandbox(profile="basic", pool=False) as sandbox:
        recorded = Recorded(sandbox)
        result = sandbox.run(IMPORT_HTTP)
        with pytest.raises(ConfigError, match="outside what this host permits per call: no host"):
            sandbox.run("1", allow_hosts=["api.example.com"])
    assert recorded.requests[-1].egress is None
    assert result.status == "error" and result.error is not None
    assert "http.client" in result.error.message  # refused by the import policy
    kinds = [e.kind for e in result.events]
    assert "import_blocked" in kinds


def test_a_malformed_or_denied_sandbox_grant_is_refused_when_it_is_built(
    config_file: Path,
) -> None:
    with pytest.raises(ConfigError, match="no URL") as caught:
        Sandbox(config=config_file, pool=False, allow_hosts=["https://api.example.com/"])
    assert "HOST[:PORT]" in caught.value.hint
    with pytest.raises(ConfigError, match="denied by the operator's"):
        Sandbox(config=config_file, pool=False, allow_hosts=["secret.example.com"])


def test_the_sandboxs_info_shows_the_network_settings(basic: tuple[Sandbox, Recorded]) -> None:
    network = basic[0].info().network
    assert network is not None
    assert network.allow == ["api.example.com"] and network.granted == ["pypi.org"]
    assert network.deny == ["secret.example.com"]
    assert network.ceiling == [
        "*.example.org",
        "files.example.net:8443",
        "api.example.com",
        "pypi.org",
    ]
    assert network.profiles == {"data_science": ["data.example.org"]}


# --- the CLI -----------------------------------------------------------------------------


def test_codecage_run_allow_host_gives_the_run_network_modules(
    tmp_path: Path, clean_env: dict[str, str]
) -> None:
    args = ("run", "--profile", "basic", "--json")
    hosts = ("--allow-host", "pypi.org,*.pythonhosted.org", "--allow-host", "a.example.org")
    done = codecage(*args, *hosts, "--code", IMPORT_HTTP, env=clean_env)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["return_value"] == "imported"


def test_codecage_run_without_hosts_refuses_the_network_modules(
    tmp_path: Path, clean_env: dict[str, str]
) -> None:
    done = codecage("run", "--profile", "basic", "--json", "--code", IMPORT_HTTP, env=clean_env)
    assert done.returncode == 1, done.stderr
    assert json.loads(done.stdout)["error"]["type"] == "ImportError"


@pytest.mark.parametrize(
    ("rule", "said"),
    [
        ("https://api.example.com", "--allow-host: 'https://api.example.com': write the host"),
        ("api.example.com:0", "--allow-host: 'api.example.com:0': the port must be"),
        ("secret.example.com", "--allow-host: secret.example.com is denied"),
    ],
)
@pytest.mark.parametrize("command", ["run", "serve"])
def test_a_bad_allow_host_is_a_usage_error_in_the_flags_terms(
    config_file: Path, clean_env: dict[str, str], command: str, rule: str, said: str
) -> None:
    code = ("--code", "1") if command == "run" else ()
    done = codecage(
        command, "--config", str(config_file), "--allow-host", rule, *code, env=clean_env
    )
    assert done.returncode == 2, done.stderr
    assert said in done.stderr
    assert "Hint:" in done.stderr and "--allow-host" in done.stderr.split("Hint:")[1]


def test_codecage_info_shows_the_network_settings(
    config_file: Path, clean_env: dict[str, str]
) -> None:
    done = codecage("info", "--config", str(config_file), "--json", env=clean_env)
    assert done.returncode == 0, done.stderr
    network = json.loads(done.stdout)["network"]
    assert network["allow"] == ["api.example.com"] and network["deny"] == ["secret.example.com"]
    assert "*.example.org" in network["ceiling"]
    assert network["profiles"] == {"data_science": ["data.example.org"]}
    human = codecage("info", "--config", str(config_file), env=clean_env)
    assert "network: every run may reach api.example.com" in human.stdout
    assert "a call may ask for" in human.stdout


# --- MCP ---------------------------------------------------------------------------------


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _text(result: Any) -> str:
    return "\n".join(b.text for b in result.content if isinstance(b, TextContent))


@pytest.mark.anyio
async def test_execute_code_allow_hosts_over_stdio(tmp_path: Path, config_file: Path) -> None:
    args = ("--config", str(config_file), "--allow-host", "pypi.org", "--no-pool")
    async with serve_stdio(tmp_path, *args) as client:
        tools = {t.name: t for t in (await client.list_tools()).tools}
        execute = tools["execute_code"]
        # Hosts may be allowed, so a run can reach beyond the sandbox: the hint says so
        # (test_18_replies checks it is false on a server that allows none).
        assert execute.annotations is not None and execute.annotations.open_world_hint is True
        allow_hosts = execute.input_schema["properties"]["allow_hosts"]
        assert allow_hosts["type"] == "array"  # optional: left out, not anyOf [array, null]
        for described in (allow_hosts["description"], execute.description or ""):
            assert "*.example.org" in described and "pypi.org" in described

        within = await client.call_tool(
            "execute_code",
            {"code": IMPORT_HTTP, "profile": "basic", "allow_hosts": ["a.example.org"]},
        )
        outside = await client.call_tool(
            "execute_code", {"code": "1", "allow_hosts": ["evil.example"]}
        )
        malformed = await client.call_tool(
            "execute_code", {"code": "1", "allow_hosts": ["http://a.example.org/x"]}
        )
        denied = await client.call_tool(
            "execute_code", {"code": "1", "allow_hosts": ["secret.example.com"]}
        )
        info = await client.call_tool("get_sandbox_info", {})
    assert not within.is_error, _text(within)
    assert within.structured_content is not None
    assert within.structured_content["return_value"] == "imported"
    assert outside.is_error
    assert "allow_hosts asks for evil.example, outside" in _text(outside)
    assert "*.example.org" in _text(outside) and "ask the operator" in _text(outside)
    assert malformed.is_error and "allow_hosts: 'http://a.example.org/x'" in _text(malformed)
    assert denied.is_error and "secret.example.com is denied" in _text(denied)
    assert info.structured_content is not None
    network = info.structured_content["network"]
    assert network["allow"] == ["api.example.com", "pypi.org"]
    assert network["deny"] == ["secret.example.com"]
    assert "execute_code's allow_hosts may ask for *.example.org" in _text(info)
