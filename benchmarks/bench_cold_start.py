"""How long does one cold run take, next to its floors?

Measures in ONE run, interleaved so that machine drift hits every variant alike:

    python_pass       the sandbox's interpreter, `python -I -S -c pass`, as a whole process
    python_snippet    the same with a tiny snippet
    raw_bwrap         bubblewrap + that interpreter, no codecage (the cost of isolation alone)
    codecage_lib      `Sandbox().run(snippet)` in this process, no pool (issue 4 adds one)
    codecage_cli      `codecage run --code snippet --json` as a whole process

Prints a table and writes one JSON file to benchmarks/results/ with host, kernel, cores,
python, git sha, n, p50/p95/p99 per variant and the ratio of each p50 to python_pass.

    .venv/bin/python benchmarks/bench_cold_start.py            # n=30
    .venv/bin/python benchmarks/bench_cold_start.py -n 3 --no-write   # smoke (the test suite)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

from codecage import Sandbox
from codecage.isolation import rootfs

ROOT = Path(__file__).resolve().parent.parent
SNIPPET = "import json; print(json.dumps(sum(range(1000))))"


def _python() -> str:
    return str(rootfs.find_interpreter().executable)


def _raw_bwrap_argv(code: str) -> list[str]:
    interp = rootfs.find_interpreter()
    argv = ["bwrap", "--unshare-all", "--die-with-parent", "--new-session"]
    for lib in interp.libraries:
        argv += ["--ro-bind", str(lib), str(lib)]
    argv += ["--ro-bind", str(interp.executable), "/opt/python/bin/python3"]
    argv += ["--ro-bind", str(interp.stdlib), f"/opt/python/lib/python{interp.version}"]
    if interp.libpython is not None:
        argv += ["--ro-bind", str(interp.libpython), f"/opt/python/lib/{interp.libpython.name}"]
        argv += ["--setenv", "LD_LIBRARY_PATH", "/opt/python/lib"]
    argv += ["--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp"]
    return [*argv, "/opt/python/bin/python3", "-I", "-S", "-c", code]


def _timed(fn: Callable[[], None]) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1000


def _run(argv: list[str]) -> Callable[[], None]:
    def go() -> None:
        subprocess.run(argv, check=True, capture_output=True, cwd="/", env={"PATH": os.defpath})

    return go


def variants(sandbox: Sandbox) -> dict[str, Callable[[], None]]:
    python = _python()
    cli = [str(ROOT / ".venv" / "bin" / "codecage"), "run", "--code", SNIPPET, "--json"]

    def lib() -> None:
        result = sandbox.run(SNIPPET)
        if not result.ok:
            raise RuntimeError(f"benchmark run failed: {result.status} {result.error}")

    return {
        "python_pass": _run([python, "-I", "-S", "-c", "pass"]),
        "python_snippet": _run([python, "-I", "-S", "-c", SNIPPET]),
        "raw_bwrap": _run(_raw_bwrap_argv(SNIPPET)),
        "codecage_lib": lib,
        "codecage_cli": _run(cli),
    }


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[index]


def measure(n: int) -> dict[str, list[float]]:
    sandbox = Sandbox()
    fns = variants(sandbox)
    for fn in fns.values():  # warm caches (ldd list, self-test) outside the timings
        fn()
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(n):  # interleaved: each round runs every variant once
        for name, fn in fns.items():
            samples[name].append(_timed(fn))
    return samples


def summarise(samples: dict[str, list[float]]) -> dict[str, dict[str, float]]:
    floor = statistics.median(samples["python_pass"])
    return {
        name: {
            "p50_ms": round(statistics.median(values), 2),
            "p95_ms": round(percentile(values, 0.95), 2),
            "p99_ms": round(percentile(values, 0.99), 2),
            "ratio_to_python_pass": round(statistics.median(values) / floor, 2),
        }
        for name, values in samples.items()
    }


def environment(n: int) -> dict[str, object]:
    sha = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=False,
    ).stdout.strip()
    return {
        "bench": "cold_start",
        "when": datetime.now(UTC).isoformat(timespec="seconds"),
        "host": platform.node(),
        "kernel": platform.release(),
        "cores": os.cpu_count(),
        "python": _python(),
        "git_sha": sha,
        "n": n,
        "snippet": SNIPPET,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", type=int, default=30, help="rounds (default 30)")
    parser.add_argument("--no-write", action="store_true", help="print only, write no JSON")
    args = parser.parse_args(argv)
    table = summarise(measure(args.n))
    print(f"{'variant':<16}{'p50 ms':>9}{'p95 ms':>9}{'p99 ms':>9}{'x pass':>8}")
    for name, row in table.items():
        print(
            f"{name:<16}{row['p50_ms']:>9.1f}{row['p95_ms']:>9.1f}{row['p99_ms']:>9.1f}"
            f"{row['ratio_to_python_pass']:>8.2f}"
        )
    if not args.no_write:
        out = ROOT / "benchmarks" / "results"
        out.mkdir(exist_ok=True)
        stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
        path = out / f"cold_start-{stamp}.json"
        path.write_text(json.dumps({**environment(args.n), "results": table}, indent=2) + "\n")
        print(f"wrote {path.relative_to(ROOT)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
