"""Issue 24: a whole `codecage run --code 1` process is cheap to start. Its plain path (no
tools, no network, no audit web view) imports none of the heavy modules other commands
need, and starts exactly one sandbox, never a warm pool, even when the config turns the
pool on. No timing is asserted here (benchmarks/bench_cli_startup.py measures it)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# Modules only other commands or options need: the MCP SDK and its HTTP stack (serve,
# session, --mcp-config), the audit web view and its server, the egress proxy, asyncio
# (the async methods), metrics and tracing exporters.
HEAVY = (
    "mcp",
    "mcp_types",
    "httpx",
    "httpx2",
    "anyio",
    "starlette",
    "uvicorn",
    "asyncio",
    "multiprocessing",
    "datasette",
    "prometheus_client",
    "opentelemetry",
    "cryptography",
    "rich.table",
    "codecage.mcp",
    "codecage.bridge.broker",
    "codecage.egress.proxy",
    "codecage.audit.web",
)

# Runs `codecage run --code 1 --json` in this interpreter, counting the warm pools built and
# the sandboxes started, then prints what it saw as one JSON line on stderr.
_PROBE = r"""
import json, sys
for name in sys.argv[2:]:
    __import__(name)
import codecage.engine, codecage.engine.run, codecage.host
from codecage.cli import main
pools, starts = [], []
start, make_pool = codecage.engine.run.start, codecage.host.Pool.__init__
def counted_start(*args, **kwargs):
    starts.append(1)
    return start(*args, **kwargs)
def counted_pool(*args, **kwargs):
    pools.append(1)
    return make_pool(*args, **kwargs)
codecage.engine.run.start = codecage.engine.start = counted_start
codecage.host.Pool.__init__ = counted_pool
try:
    main(["run", "--code", "1", "--json"])
except SystemExit as exc:
    status = exc.code
heavy = sorted(m for m in json.loads(sys.argv[1]) if m in sys.modules)
print(json.dumps({"status": status, "heavy": heavy, "pools": len(pools), "starts": len(starts)}),
      file=sys.stderr)
"""


def probe(*preimported: str, env: dict[str, str] | None = None) -> dict[str, object]:
    """What one plain `codecage run` did in a fresh interpreter (this checkout's code)."""
    environ = {**os.environ, "PYTHONPATH": str(ROOT / "src"), **(env or {})}
    proc = subprocess.run(
        [sys.executable, "-c", _PROBE, json.dumps(HEAVY), *preimported],
        capture_output=True,
        text=True,
        env=environ,
        cwd=ROOT,
        timeout=120,
        check=False,
    )
    assert '"status": "ok"' in proc.stdout, proc.stdout + proc.stderr
    seen: dict[str, object] = json.loads(proc.stderr.strip().splitlines()[-1])
    return seen


def test_a_plain_run_imports_none_of_the_heavy_modules() -> None:
    seen = probe()
    assert seen["status"] == 0
    assert seen["heavy"] == []


def test_the_import_check_sees_a_heavy_module_that_is_imported() -> None:
    # The check above could pass by looking at nothing: here it must see what was imported.
    assert {"asyncio", "uvicorn"} <= set(probe("uvicorn", "asyncio")["heavy"])  # type: ignore[arg-type]


@pytest.mark.parametrize("pool", ["0", "1"])
def test_a_plain_run_starts_one_sandbox_and_no_pool_whatever_the_config(pool: str) -> None:
    seen = probe(env={"CODECAGE_POOL": pool})
    assert seen["status"] == 0
    assert (seen["pools"], seen["starts"]) == (0, 1)
