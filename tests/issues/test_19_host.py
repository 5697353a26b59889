"""Issue 19: one host runtime per process (`codecage.host`), a thin `Sandbox` over it.

1. `codecage run --code 'print(1)'` reads the config once and validates `Limits` once (the
   config's); a limit flag adds exactly one validation (the merge).
2. The MCP server runs `execute_code` with `allowed_imports` / `profile`, and `validate_code`
   with a profile, as per-run requests of its one host runtime: no `Sandbox` is built per
   call.
3. Such calls share the server's one warm pool: a profile's sandboxes are kept warm and
   taken, and an import list adds no pool key.
4. Process-wide state (the sweep of stale runs, the self-test verdict) is shared by every
   Host of the process.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import pytest
from mcp import Client
from mcp_types import CallToolResult, TextContent
from tests._anyio import anyio_backend  # noqa: F401 - a fixture
from tests._cli import serve_configured

from codecage import host
from codecage.config import load
from codecage.mcp.server import build_server
from codecage.options import Options
from codecage.sandbox import Sandbox

CODECAGE = str(Path(sys.executable).with_name("codecage"))

# Runs the CLI in this process after wrapping `config.load` and the validator of `Limits`
# with counters, and prints the counts as JSON on stderr's last line.
COUNTING_CLI = """
import collections, json, sys
from codecage import config
from codecage.models import Limits
import codecage.cli.run  # the command's modules first: their constants are not the run's

counts = collections.Counter()
real_load = config.load
def load(*args, **kwargs):
    counts["config_load"] += 1
    return real_load(*args, **kwargs)
config.load = load

real_validator = Limits.__pydantic_validator__
class Counting:
    def __getattr__(self, name):
        attr = getattr(real_validator, name)
        if not name.startswith("validate"):
            return attr
        def validate(*args, **kwargs):
            counts["limits_validated"] += 1
            return attr(*args, **kwargs)
        return validate
Limits.__pydantic_validator__ = Counting()

from codecage.cli import main
try:
    main(sys.argv[1:])
finally:
    print(json.dumps(counts), file=sys.stderr)
"""


def counted_cli_run(env: dict[str, str], *flags: str) -> dict[str, int]:
    p = subprocess.run(
        [sys.executable, "-c", COUNTING_CLI, "run", "--json", "--code", "print(1)", *flags],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["stdout"] == "1\n"
    counts: dict[str, int] = json.loads(p.stderr.strip().splitlines()[-1])
    return counts


def test_a_cli_run_reads_the_config_once_and_validates_the_limits_once(
    clean_env: dict[str, str],
) -> None:
    assert counted_cli_run(clean_env) == {"config_load": 1, "limits_validated": 1}


def test_a_limit_flag_adds_one_validation_the_merge(clean_env: dict[str, str]) -> None:
    assert counted_cli_run(clean_env, "--timeout", "5") == {
        "config_load": 1,
        "limits_validated": 2,
    }


# --- the MCP server: per-run requests, not a Sandbox per call ------------------------------


def text_of(result: CallToolResult) -> str:
    return "\n".join(b.text for b in result.content if isinstance(b, TextContent))


def test_the_server_runs_calls_with_imports_or_a_profile_without_building_a_sandbox(
    clean_env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    server = build_server(Sandbox(pool=False, options=Options(config=load(environ={}))).host)
    built: list[dict[str, Any]] = []
    real_init = Sandbox.__init__

    def counting_init(self: Sandbox, **kwargs: Any) -> None:
        built.append(kwargs)
        real_init(self, **kwargs)

    monkeypatch.setattr(Sandbox, "__init__", counting_init)

    async def main() -> list[CallToolResult]:
        async with Client(server, read_timeout_seconds=120) as client:
            return [
                await client.call_tool(
                    "execute_code",
                    {"code": "import csv\ncsv.__name__", "profile": "basic"},
                ),
                await client.call_tool(
                    "execute_code",
                    {
                        "code": "import sqlite3\nsqlite3.__name__",
                        "profile": "basic",
                        "allowed_imports": ["sqlite3"],
                    },
                ),
                await client.call_tool(
                    "execute_code", {"code": "import sqlite3", "profile": "basic"}
                ),
                await client.call_tool("validate_code", {"code": "import os", "profile": "basic"}),
            ]

    with_profile, with_imports, refused, validated = anyio.run(main)
    assert (with_profile.structured_content or {}).get("return_value") == "csv", text_of(
        with_profile
    )
    assert (with_imports.structured_content or {}).get("return_value") == "sqlite3", text_of(
        with_imports
    )
    # The extra import was that call's alone: the next call under basic is refused it.
    assert (refused.structured_content or {}).get("status") == "error", text_of(refused)
    assert "sqlite3" in text_of(refused)
    assert (validated.structured_content or {}).get("valid") is False, text_of(validated)
    assert built == []


@pytest.fixture(scope="module")
async def pooled_server(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Client]:
    """`codecage serve` with its warm pool, in its own process (which stops the pool)."""
    async with serve_configured(tmp_path_factory.mktemp("serve-pool"), None) as client:
        yield client


@pytest.mark.anyio
async def test_profile_and_import_calls_share_the_servers_one_warm_pool(
    pooled_server: Client,
) -> None:
    async def pool_keys() -> dict[str, dict[str, Any]]:
        info = await pooled_server.call_tool("get_sandbox_info", {"detail": True})
        keys = (info.structured_content or {})["detail"]["pool"]["keys"]
        return {key["profile"]: key for key in keys}

    for _ in range(20):  # the first call registers basic; a later one finds one warm
        run = await pooled_server.call_tool("execute_code", {"code": "1", "profile": "basic"})
        assert (run.structured_content or {}).get("status") == "ok", text_of(run)
        if (await pool_keys())["basic"]["hits"] >= 1:
            break
    keys = await pool_keys()
    assert keys["basic"]["hits"] >= 1, keys
    run = await pooled_server.call_tool(
        "execute_code",
        {"code": "import sqlite3\n1", "profile": "basic", "allowed_imports": ["sqlite3"]},
    )
    assert (run.structured_content or {}).get("status") == "ok", text_of(run)
    assert set(await pool_keys()) == set(keys)  # an import list keeps no key of its own


# --- process-wide state --------------------------------------------------------------------


def test_every_host_of_a_process_shares_one_self_test_verdict(clean_env: dict[str, str]) -> None:
    first = Sandbox(pool=False)
    first.run("1")
    verdicts = dict(host._PROCESS.verdicts)
    assert verdicts and host._PROCESS.swept
    second = Sandbox(pool=False, profile="basic")
    assert second.host is not first.host
    assert second.run("1").status == "ok"
    assert host._PROCESS.verdicts == verdicts  # proved once, not per Host
