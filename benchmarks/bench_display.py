"""What capturing figures costs a run (issue 21, rich results).

Spaced warm runs (the pool is ready again before each one), interleaved round by round so
that machine drift cancels, under the `data_science` profile (its warm sandboxes preload pyplot):

    show      plt.plot(...); plt.show()      the figure captured as a display output
    savefig   plt.plot(...); plt.savefig(...); plt.close()   the same figure, as a file
    print     print(1)                        no figure: what every run pays
    print@base  print(1) on the baseline tree (--baseline SRC, e.g. the main checkout's
              src/): the same run before display outputs existed

Each variant runs in a worker process of its own source tree (this one, or the baseline),
driven over stdin/stdout. Reports p50 and p95 of the caller's wall time per run (ms) and
the run's own wall_ms, and the ratios show/savefig and print/print@base.

    PYTHONPATH=src .venv/bin/python benchmarks/bench_display.py -n 50 --baseline /work/main/src
    PYTHONPATH=src .venv/bin/python benchmarks/bench_display.py -n 3        # smoke
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PLOT = "import matplotlib.pyplot as plt\nplt.plot([1, 3, 2])\n"
CODES = {
    "show": PLOT + "plt.show()\n",
    "savefig": PLOT + "plt.savefig('chart.png')\nplt.close()\n",
    "print": "print(1)\n",
}


def worker() -> None:
    """Run each code read from stdin in a warm sandbox; answer its timings as JSON."""
    from codecage import Sandbox

    # data_science: its warm sandboxes preload pyplot, so the import is not what is timed.
    with Sandbox(profile="data_science", pool=True) as sandbox:
        sandbox.warm(120)
        print(json.dumps({"ready": True}), flush=True)
        for line in sys.stdin:
            code = json.loads(line)
            sandbox.warm(60)  # spaced: a warm sandbox is waiting
            started = time.perf_counter()
            r = sandbox.run(code)
            caller_ms = (time.perf_counter() - started) * 1000
            answer = {
                "ok": r.ok,
                "caller_ms": caller_ms,
                "wall_ms": r.usage.wall_ms,
                "displays": len(r.displays),
            }
            print(json.dumps(answer), flush=True)


class Worker:
    def __init__(self, src: Path) -> None:
        env = {**os.environ, "PYTHONPATH": str(src)}
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        assert json.loads(self._read())["ready"]

    def _read(self) -> str:
        assert self.proc.stdout is not None
        return self.proc.stdout.readline()

    def run(self, code: str) -> dict[str, float]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(code) + "\n")
        self.proc.stdin.flush()
        answer: dict[str, float] = json.loads(self._read())
        if not answer["ok"]:
            raise SystemExit(f"a run failed: {code!r}")
        return answer

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(60)


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", type=int, default=50, help="rounds (default 50)")
    parser.add_argument("--baseline", type=Path, help="src/ of the tree before the change")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker()
        return
    workers = {"here": Worker(ROOT / "src")}
    if args.baseline is not None:
        workers["base"] = Worker(args.baseline)
    samples: dict[str, list[dict[str, float]]] = {}
    try:
        for _ in range(args.n):
            for name, code in CODES.items():
                samples.setdefault(name, []).append(workers["here"].run(code))
            if "base" in workers:
                samples.setdefault("print@base", []).append(workers["base"].run(CODES["print"]))
    finally:
        for w in workers.values():
            w.close()
    p50 = {}
    print(f"{'variant':<12} {'p50 ms':>8} {'p95 ms':>8} {'wall_ms p50':>12}  displays")
    for name, runs in samples.items():
        caller = [r["caller_ms"] for r in runs]
        p50[name] = statistics.median(caller)
        wall = statistics.median(r["wall_ms"] for r in runs)
        print(
            f"{name:<12} {p50[name]:>8.1f} {_pct(caller, 0.95):>8.1f} {wall:>12.1f}  "
            f"{int(runs[0]['displays'])}"
        )
    print(f"show / savefig      {p50['show'] / p50['savefig']:.3f}")
    if "print@base" in p50:
        print(f"print / print@base  {p50['print'] / p50['print@base']:.3f}")


if __name__ == "__main__":
    main()
