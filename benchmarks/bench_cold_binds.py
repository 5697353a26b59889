"""What do the sandbox's extra binds cost a cold start: the shell tools, and the data
packages that the default profile binds?

Cold runs of `print(1)` from the library, interleaved in pairs so that the VM's drift
cancels:

    with_tools / without_tools     the default profile, the shell tools bound or not
    standard / basic               the default profile (binds the installed data packages)
                                   against the curated `basic` (binds none)

Prints p50s and writes benchmarks/results/cold_binds-<time>.json.

    .venv/bin/python benchmarks/bench_cold_binds.py            # 60 pairs each
    .venv/bin/python benchmarks/bench_cold_binds.py -n 3 --no-write   # smoke
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

from codecage import Sandbox
from codecage.engine import launch

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("-n", type=int, default=60, help="interleaved pairs per question")
    parser.add_argument("--no-write", action="store_true", help="do not write a JSON result")
    args = parser.parse_args()
    results = {"tools": _tools_pairs(args.n), "profile": _profile_pairs(args.n)}
    for question, sides in results.items():
        print(question, {side: f"{p50:.1f} ms p50" for side, p50 in sides.items()})
    if not args.no_write:
        _write(args.n, results)


def _timed(run: Callable[[], object]) -> float:
    started = time.perf_counter()
    run()
    return (time.perf_counter() - started) * 1000


def _tools_pairs(n: int) -> dict[str, float]:
    sandbox = Sandbox(pool=False)
    real = launch._shell_mounts
    sides: dict[str, list[float]] = {"with_tools": [], "without_tools": []}
    sandbox.run("print(1)")
    try:
        for _ in range(n):
            launch._shell_mounts = real
            sides["with_tools"].append(_timed(lambda: sandbox.run("print(1)")))
            launch._shell_mounts = lambda _interpreter: ()
            sides["without_tools"].append(_timed(lambda: sandbox.run("print(1)")))
    finally:
        launch._shell_mounts = real
    return {side: round(statistics.median(times), 2) for side, times in sides.items()}


def _profile_pairs(n: int) -> dict[str, float]:
    sandboxes = {"standard": Sandbox(pool=False), "basic": Sandbox(pool=False, profile="basic")}
    sides: dict[str, list[float]] = {name: [] for name in sandboxes}
    for sandbox in sandboxes.values():
        sandbox.run("print(1)")
    for _ in range(n):
        for name, sandbox in sandboxes.items():
            sides[name].append(_timed(lambda sandbox=sandbox: sandbox.run("print(1)")))
    return {side: round(statistics.median(times), 2) for side, times in sides.items()}


def _write(n: int, results: dict[str, dict[str, float]]) -> None:
    sha = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT
    ).stdout.strip()
    when = datetime.now(UTC)
    record = {
        "bench": "cold_binds",
        "when": when.isoformat(timespec="seconds"),
        "host": platform.node(),
        "kernel": platform.release(),
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "git_sha": sha,
        "pairs": n,
        "load": "cold library runs of print(1), one at a time, the two sides interleaved",
        "p50_ms": results,
    }
    out = ROOT / "benchmarks" / "results" / f"cold_binds-{when:%Y%m%dT%H%M%SZ}.json"
    out.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    print(f"wrote {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
