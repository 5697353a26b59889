"""How long does an `execute_code` round trip take over stdio, next to an empty tool?

Measures with the official SDK's client, in ONE run:

    empty_tool       a tool that returns "ok" on a bare MCPServer (the SDK's own floor)
    empty_tool_fast  the same tool served by codecage's stdio transport (codecage.mcp.stdio),
                     which `codecage serve` uses: what the sandbox adds is the difference
                     between this and execute_code
    execute_code     codecage serve's execute_code of a tiny snippet, warm pool

Each execute_code call starts when the pool has had time to refill (a pause between calls,
outside the timing), so this is a call's latency, not the pool's creation rate
(bench_suite.py measures that).

    .venv/bin/python benchmarks/bench_mcp.py            # n=200
    .venv/bin/python benchmarks/bench_mcp.py -n 5 --no-write   # smoke (the test suite)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import anyio
from mcp.client.session import ClientSession
from mcp.client.stdio import StdioServerParameters, get_default_environment, stdio_client

ROOT = Path(__file__).resolve().parent.parent
SNIPPET = "sum(range(1000))"
EMPTY_SERVER = """
from mcp.server.mcpserver import MCPServer
server = MCPServer(name="empty")

@server.tool()
def empty() -> str:
    return "ok"

server.run("stdio")
"""
EMPTY_SERVER_FAST = EMPTY_SERVER.replace(
    'server.run("stdio")',
    "try:\n    from codecage.mcp import stdio\n"
    "except ImportError:  # code from before the mcp/ package (bench_ab.py's base)\n"
    "    from codecage import stdio\n"
    "stdio.serve(server)",
)
# The SDK starts servers with a minimal environment; PYTHONPATH is kept so that they run the
# code this bench was pointed at (bench_ab.py runs it against an older commit's src too).
SERVER_ENV = {
    **get_default_environment(),
    **({"PYTHONPATH": os.environ["PYTHONPATH"]} if os.environ.get("PYTHONPATH") else {}),
}


async def _timed_calls(
    params: StdioServerParameters, tool: str, args: dict[str, object], n: int, pause: float
) -> list[float]:
    times: list[float] = []
    # The server logs a line per call on stderr: kept out of the report (its cost is in).
    with open(os.devnull, "w", encoding="utf-8") as server_log:
        async with (
            stdio_client(params, errlog=server_log) as (read, write),
            ClientSession(read, write) as session,
        ):
            await session.initialize()
            await session.call_tool(tool, args)  # first call: warm-up, not counted
            for _ in range(n):
                await anyio.sleep(pause)
                start = time.perf_counter()
                result = await session.call_tool(tool, args)
                times.append((time.perf_counter() - start) * 1000)
                if result.is_error:
                    raise RuntimeError(f"{tool} failed: {result.content}")
    return times


def _percentiles(times: list[float]) -> dict[str, float]:
    ordered = sorted(times)

    def at(q: float) -> float:
        return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 2)

    return {"p50_ms": at(0.5), "p90_ms": at(0.9), "p99_ms": at(0.99)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("-n", type=int, default=200, help="timed calls per variant")
    parser.add_argument("--pause", type=float, default=0.1, help="seconds between calls")
    parser.add_argument("--no-write", action="store_true", help="do not write a JSON result")
    args = parser.parse_args()
    empty = StdioServerParameters(command=sys.executable, args=["-c", EMPTY_SERVER], env=SERVER_ENV)
    empty_fast = StdioServerParameters(
        command=sys.executable, args=["-c", EMPTY_SERVER_FAST], env=SERVER_ENV
    )
    codecage = StdioServerParameters(
        command=str(ROOT / ".venv" / "bin" / "codecage"), args=["serve"], env=SERVER_ENV
    )
    results = {
        "empty_tool": _percentiles(anyio.run(_timed_calls, empty, "empty", {}, args.n, args.pause)),
        "empty_tool_fast": _percentiles(
            anyio.run(_timed_calls, empty_fast, "empty", {}, args.n, args.pause)
        ),
        "execute_code": _percentiles(
            anyio.run(_timed_calls, codecage, "execute_code", {"code": SNIPPET}, args.n, args.pause)
        ),
    }
    floor = results["empty_tool"]["p50_ms"]
    print(f"{'variant':<16}{'p50 ms':>9}{'p90 ms':>9}{'p99 ms':>9}  vs empty tool")
    for name, row in results.items():
        ratio = row["p50_ms"] / floor if floor else float("nan")
        print(f"{name:<16}{row['p50_ms']:>9}{row['p90_ms']:>9}{row['p99_ms']:>9}  {ratio:.2f}x")
    added = results["execute_code"]["p50_ms"] - results["empty_tool_fast"]["p50_ms"]
    verdict = "met" if results["execute_code"]["p50_ms"] <= 5 else "NOT MET"
    print(
        f"execute_code p50 <= 5 ms: {verdict}; the sandbox adds {added:.2f} ms "
        "to an empty tool on the same transport"
    )
    if not args.no_write:
        _write(args, results)
    return 0


def _write(args: argparse.Namespace, results: dict[str, dict[str, float]]) -> None:
    sha = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT
    ).stdout.strip()
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    out = ROOT / "benchmarks" / "results" / f"mcp-{stamp}.json"
    out.write_text(
        json.dumps(
            {
                "bench": "mcp",
                "when": datetime.now(UTC).isoformat(timespec="seconds"),
                "host": platform.node(),
                "kernel": platform.release(),
                "git_sha": sha,
                "n": args.n,
                "pause_s": args.pause,
                "snippet": SNIPPET,
                "results": results,
            },
            indent=2,
        )
        + "\n",
        encoding="utf-8",
    )
    print(f"wrote {out.relative_to(ROOT)}")


if __name__ == "__main__":
    sys.exit(main())
