"""What preloading the data packages costs a warm sandbox, and what it saves a run.

The warm pool refills every sandbox it hands out: whatever a warm sandbox imports before
its request is paid once per run, by every run of that pool key, whether or not the run
uses it. This measures, under the default profile (`standard`), one warm sandbox started
and run at a time, interleaved per round:

    preload   none | numpy | numpy+pandas+matplotlib (profiles.PRELOAD)
    code      print(1) | import pandas
    ready_ms        wall time from start until the guest is ready (the refill's latency)
    startup_cpu_ms  CPU the sandbox used before its request (the refill's cost, cgroup)
    peak_mb         the run's peak memory (cgroup): with print(1), what the sandbox holds
                    resident from its start-up, i.e. what each idle warm sandbox costs
    run_wall_ms     the request's wall time in the ready sandbox
    run_cpu_ms      the request's own CPU time

Prints a table and writes benchmarks/results/preload-<time>.json (medians of n rounds).

    .venv/bin/python benchmarks/bench_preload.py            # n=7
    .venv/bin/python benchmarks/bench_preload.py -n 1 --no-write   # smoke
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import time
from datetime import UTC, datetime
from pathlib import Path

from codecage import engine
from codecage.backends.base import load_backend
from codecage.models import Limits
from codecage.policy import profiles

ROOT = Path(__file__).resolve().parent.parent
VARIANTS: dict[str, tuple[str, ...]] = {
    "none": (),
    "numpy": ("numpy",),
    "numpy+pandas+matplotlib": profiles.PRELOAD,
}
CODES = {"print(1)": "print(1)", "import pandas": "import pandas as pd\nprint(pd.__version__)"}


def one(preload: tuple[str, ...], code: str) -> dict[str, float]:
    backend = load_backend("auto")
    policy = profiles.resolve([profiles.DEFAULT_PROFILE])
    limits = Limits()
    started = time.monotonic()
    sandbox = engine.start(engine.SandboxSpec(policy=policy, preload=preload), limits, backend)
    try:
        engine.wait_ready(sandbox, 60)
        ready_ms = (time.monotonic() - started) * 1000
        startup_cpu = sandbox.baseline.cpu_ms if sandbox.baseline is not None else 0
        request = engine.RunRequest(code=code, filename="main.py", limits=limits, policy=policy)
        run_start = time.monotonic()
        result = engine.run_in(sandbox, request, backend_name=backend.name)
        run_ms = (time.monotonic() - run_start) * 1000
        if result.status != "ok":
            raise RuntimeError(f"{code!r} with preload {preload}: {result.status} {result.error}")
        return {
            "ready_ms": ready_ms,
            "startup_cpu_ms": startup_cpu,
            "run_wall_ms": run_ms,
            "run_cpu_ms": result.usage.cpu_ms,
            "peak_mb": result.usage.peak_memory_mb or 0.0,
        }
    finally:
        sandbox.destroy()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("-n", type=int, default=7, help="rounds (default 7)")
    parser.add_argument("--no-write", action="store_true", help="print only, write no JSON")
    args = parser.parse_args(argv)
    samples: dict[tuple[str, str], list[dict[str, float]]] = {}
    for _ in range(args.n):  # interleaved: machine drift hits every variant alike
        for variant, preload in VARIANTS.items():
            for label, code in CODES.items():
                samples.setdefault((variant, label), []).append(one(preload, code))
    table = []
    for (variant, label), rows in samples.items():
        medians = {key: round(statistics.median(r[key] for r in rows), 1) for key in rows[0]}
        table.append({"preload": variant, "code": label, **medians})
        print(
            f"preload={variant:24s} code={label:14s} "
            + " ".join(f"{k}={v:g}" for k, v in medians.items())
        )
    if not args.no_write:
        sha = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            cwd=ROOT,
            check=False,
        ).stdout.strip()
        stamp = datetime.now(UTC)
        out = ROOT / "benchmarks" / "results" / f"preload-{stamp:%Y%m%dT%H%M%SZ}.json"
        env = {
            "bench": "preload",
            "when": stamp.isoformat(timespec="seconds"),
            "host": platform.node(),
            "kernel": platform.release(),
            "cores": os.cpu_count(),
            "load_avg_1m": os.getloadavg()[0],
            "git_sha": sha,
            "n": args.n,
        }
        out.write_text(json.dumps({**env, "results": table}, indent=2) + "\n", encoding="utf-8")
        print(f"wrote {out.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
