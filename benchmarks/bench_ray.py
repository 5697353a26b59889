"""What going through Ray costs a batch: runs/s of `codecage.ray.run_many` on one and on two
local Ray nodes beside `Sandbox.run_many` on this host, in the same run, and the driver's
memory for a large batch.

Sections, in this order:

    local        `Sandbox(pool=True).run_many` of N tiny programs at c=2 (after a warm-up)
    ray_1node    `codecage.ray.run_many` on a one-node local cluster (the head), c=2 per node
    ray_2nodes   the same after a second node joins (both nodes are this machine: they share
                 its cores, so this measures the per-item cost of Ray, not a speed-up)
    memory       the driver's Python heap at its peak (tracemalloc) and its RSS growth while
                 `codecage.ray.run_many` runs a batch of --big programs (default 10,000)

Each node is small (1 CPU for Ray, an 80 MB object store): the machine is shared.

    .venv/bin/python benchmarks/bench_ray.py                 # N=400, --big 10000
    .venv/bin/python benchmarks/bench_ray.py -n 20 --big 200 --no-write
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import resource
import sys
import time
import tracemalloc
from pathlib import Path
from typing import Any

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

RESULTS = Path(__file__).resolve().parent / "results"
NODE: dict[str, Any] = {"num_cpus": 1, "object_store_memory": 80 * 2**20}
CONCURRENCY = 2


def _programs(n: int) -> list[str]:
    return [f"sum(range({i % 100}))" for i in range(n)]


def _rate(run: Any, n: int) -> dict[str, Any]:
    started = time.monotonic()
    results = run(_programs(n))
    wall = time.monotonic() - started
    bad = sum(1 for r in results if r.status != "ok")
    return {
        "programs": n,
        "wall_s": round(wall, 3),
        "runs_per_s": round(n / wall, 1),
        "not_ok": bad,
    }


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", type=int, default=400, help="programs per rate (default 400)")
    parser.add_argument("--big", type=int, default=10_000, help="the memory batch's programs")
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args(argv)

    from ray.cluster_utils import Cluster

    from codecage import Sandbox
    from codecage import ray as on_ray

    report: dict[str, Any] = {"n": args.n, "concurrency_per_node": CONCURRENCY}
    with Sandbox(pool=True) as local:
        local.run_many(_programs(CONCURRENCY * 2), concurrency=CONCURRENCY)  # warm the pool
        report["local"] = _rate(lambda p: local.run_many(p, concurrency=CONCURRENCY), args.n)
    print("local", report["local"], flush=True)

    cluster = Cluster(initialize_head=True, head_node_args={**NODE, "include_dashboard": False})
    try:
        on_ray.connect(cluster.address)

        def on_cluster(programs: list[str]) -> Any:
            return on_ray.run_many(programs, concurrency=CONCURRENCY)

        on_cluster(_programs(CONCURRENCY * 2))  # the head's actor starts (not timed)
        report["ray_1node"] = _rate(on_cluster, args.n)
        print("ray_1node", report["ray_1node"], flush=True)
        cluster.add_node(**NODE)
        cluster.wait_for_nodes()
        on_cluster(_programs(CONCURRENCY * 4))  # the second node's actor starts
        report["ray_2nodes"] = _rate(on_cluster, args.n)
        print("ray_2nodes", report["ray_2nodes"], flush=True)

        rss_before = _rss_mb()
        tracemalloc.start()
        big = _rate(on_cluster, args.big)
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        report["memory"] = {
            **big,
            "driver_heap_peak_mb": round(peak / 2**20, 1),
            "driver_heap_per_program_kb": round(peak / 1024 / args.big, 2),
            "driver_rss_growth_mb": round(_rss_mb() - rss_before, 1),
        }
        print("memory", report["memory"], flush=True)
    finally:
        import ray

        on_ray.shutdown()
        ray.shutdown()
        cluster.shutdown()

    if not args.no_write:
        stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%SZ")
        path = RESULTS / f"ray-{stamp}.json"
        path.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
