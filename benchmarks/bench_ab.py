"""A/B: one benchmark, run on an older commit's code and on this checkout's, in alternating
rounds (base first, then new first, ...), so that machine drift hits both alike.

The base is `git archive REV` unpacked into a temporary directory that borrows this
checkout's `.venv` and `tools/node_modules`; each run gets `PYTHONPATH=<tree>/src`, so the
bench and every codecage process it starts (`codecage serve`, `codecage run`) use that
tree's code (see OWN_SCRIPT for which tree's bench script runs). Each run writes its usual
JSON; this script reads the key figures out of them (and removes them) and writes
benchmarks/results/ab-<bench>-<UTC timestamp>.json with every round and, per figure, the
median of the rounds for each side and their ratio.

    .venv/bin/python benchmarks/bench_ab.py --base 9ca428d --bench mcp --rounds 3 -- -n 150
    .venv/bin/python benchmarks/bench_ab.py --base 9ca428d --bench suite -- --only cold,warm
    .venv/bin/python benchmarks/bench_ab.py --base 48b1aaa --bench throughput \
        -- --only latency --save

A ratio above 1 means the new code is slower (for latencies) or faster (for runs/s): the
table says which way each figure goes.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import statistics
import subprocess
import sys
import tarfile
import tempfile
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
BENCHES = {
    "mcp": ("bench_mcp.py", "mcp-"),
    "suite": ("bench_suite.py", "suite-"),
    "throughput": ("bench_throughput.py", "throughput-"),
}
OWN_SCRIPT = {"suite"}
"""Benches that import codecage's internals run from each tree; the others (bench_mcp talks to
`codecage serve` over stdio only) run from this checkout on both sides: the same instrument,
only the code under it differs."""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base", required=True, help="the older commit (any git revision)")
    parser.add_argument("--bench", choices=sorted(BENCHES), required=True)
    parser.add_argument("--rounds", type=int, default=2, help="base-then-new pairs")
    parser.add_argument("--no-write", action="store_true", help="print only")
    parser.add_argument("bench_args", nargs="*", help="after --: passed to the bench")
    args = parser.parse_args()
    script, prefix = BENCHES[args.bench]
    with tempfile.TemporaryDirectory(prefix="codecage-ab-") as tmp:
        base = _unpack(args.base, Path(tmp) / "base")
        trees = {"base": base, "new": ROOT}
        rounds = []
        for number in range(1, args.rounds + 1):
            # Odd rounds base first, even rounds new first: what runs second in a pair
            # tends to be slower (drift), and alternating cancels it out in the medians.
            order = list(trees.items()) if number % 2 else list(reversed(trees.items()))
            for side, tree in order:
                bench = (tree if args.bench in OWN_SCRIPT else ROOT) / "benchmarks" / script
                figures = _run(tree, bench, prefix, args.bench_args)
                print(f"round {number} {side}: {_short(figures)}", file=sys.stderr)
                rounds.append({"round": number, "code": side, "figures": figures})
    summary = _summary(rounds)
    _print(summary)
    if not args.no_write:
        _write(args, rounds, summary)
    return 0


def _unpack(rev: str, where: Path) -> Path:
    """`git archive rev` at `where`, with this checkout's environment borrowed."""
    archive = subprocess.run(
        ["git", "archive", rev], capture_output=True, cwd=ROOT, check=True
    ).stdout
    where.mkdir(parents=True)
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(where, filter="data")
    (where / ".venv").symlink_to(ROOT / ".venv")
    modules = ROOT / "tools" / "node_modules"
    if modules.exists():
        (where / "tools" / "node_modules").symlink_to(modules)
    return where


def _run(tree: Path, bench: Path, prefix: str, bench_args: list[str]) -> dict[str, float]:
    """Run `bench` with `tree`'s code; its figures, from the JSON it wrote (then removed)."""
    results = bench.parent / "results"
    before = set(results.glob(f"{prefix}*.json"))
    env = {**os.environ, "PYTHONPATH": str(tree / "src")}
    subprocess.run(
        [str(ROOT / ".venv" / "bin" / "python"), str(bench), *bench_args],
        cwd=tree,
        env=env,
        check=True,
        stdout=subprocess.DEVNULL,
    )
    written = sorted(set(results.glob(f"{prefix}*.json")) - before)
    if not written:
        raise SystemExit(f"{bench} wrote no result (was --no-write passed?)")
    data = json.loads(written[-1].read_text(encoding="utf-8"))
    written[-1].unlink()  # the A/B file keeps what is compared
    written[-1].with_suffix(".txt").unlink(missing_ok=True)  # bench_throughput's printout
    return _figures(data)


def _figures(data: dict[str, Any]) -> dict[str, float]:
    """The figures worth comparing: each variant's p50 (and p99), runs/s per concurrency."""
    figures: dict[str, float] = {}
    variants = data.get("variants") or data.get("results") or {}
    for name, row in variants.items():
        for key in ("p50_ms", "p99_ms"):
            if key in row:
                figures[f"{name} {key}"] = row[key]
    for level in (data.get("throughput") or {}).get("levels", []):
        figures[f"throughput c={level['concurrency']} runs_per_s"] = level["runs_per_s"]
    for mode, row in (data.get("latency") or {}).items():  # bench_throughput --only latency
        for load in ("spaced", "caller_cpu_spaced", "back_to_back"):
            if load in row:
                figures[f"{mode} {load} p50_ms"] = row[load]["p50_ms"]
                figures[f"{mode} {load} p99_ms"] = row[load]["p99_ms"]
    return figures


def _summary(rounds: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    names = sorted({name for r in rounds for name in r["figures"]})
    summary = {}
    for name in names:
        sides = {
            side: statistics.median(
                r["figures"][name] for r in rounds if r["code"] == side and name in r["figures"]
            )
            for side in ("base", "new")
            if any(r["code"] == side and name in r["figures"] for r in rounds)
        }
        if len(sides) == 2 and sides["base"]:
            sides["new_over_base"] = round(sides["new"] / sides["base"], 3)
        summary[name] = sides
    return summary


def _short(figures: dict[str, float]) -> str:
    return ", ".join(f"{k}={v}" for k, v in figures.items() if "p50" in k or "runs_per_s" in k)


def _print(summary: dict[str, dict[str, float]]) -> None:
    print(f"{'figure':45s} {'base':>9s} {'new':>9s} {'new/base':>9s}  better")
    for name, sides in summary.items():
        better = "higher" if "runs_per_s" in name else "lower"
        print(
            f"{name:45s} {sides.get('base', float('nan')):9.2f} "
            f"{sides.get('new', float('nan')):9.2f} {sides.get('new_over_base', float('nan')):9.3f}"
            f"  {better}"
        )


def _write(args: argparse.Namespace, rounds: list[dict[str, Any]], summary: Any) -> None:
    head = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT
    ).stdout.strip()
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    path = ROOT / "benchmarks" / "results" / f"ab-{args.bench}-{stamp}.json"
    path.write_text(
        json.dumps(
            {
                "bench": f"{BENCHES[args.bench][0]} A/B",
                "how": f"{args.rounds} rounds, each: the base commit's code and this checkout's "
                "(base first in odd rounds, new first in even ones), same machine, same "
                f"arguments: {' '.join(args.bench_args)}",
                "base_commit": args.base,
                "new_commit": head,
                "when": datetime.now(UTC).isoformat(timespec="seconds"),
                "host": platform.node(),
                "cores": os.cpu_count(),
                "loadavg_at_end": list(os.getloadavg()),
                "rounds": rounds,
                "summary": summary,
            },
            indent=1,
        ),
        encoding="utf-8",
    )
    print(f"wrote {path.relative_to(ROOT)}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
