"""What going through Ray costs a batch: runs/s of `codecage.ray.run_many` on one and on two
local Ray nodes beside `Sandbox.run_many` on this host, in the same run, and the driver's
memory for a large batch.

Sections, in this order:

    local        `Sandbox(pool=True).run_many` of N tiny programs at c=2 (after a warm-up)
    ray_1node    `codecage.ray.run_many` on a one-node local cluster (the head), c=2 per node
    ray_2nodes   the same after a second node joins (both nodes are this machine: they share
                 its cores, so this measures the per-item cost of Ray, not a speed-up)
    serve_local  POST /run_code through `codecage serve --http` (its warm pool), N requests
                 from 2 client threads at once, --max-concurrent 2
    serve_ray    the same through `codecage serve --http --ray` on the two-node cluster (one
                 run at a time per node: 2 at once), with the load average beside each
    memory       the driver's Python heap at its peak (tracemalloc) and its RSS growth while
                 `codecage.ray.run_many` runs a batch of --big programs (default 10,000)

Each node is small (1 CPU for Ray, an 80 MB object store): the machine is shared.

    .venv/bin/python benchmarks/bench_ray.py                 # N=400, --big 10000
    .venv/bin/python benchmarks/bench_ray.py -n 20 --big 200 --no-write
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import resource
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import tracemalloc
import urllib.request
from collections.abc import Iterator
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


CODECAGE = str(Path(sys.executable).with_name("codecage"))
SERVE_CLIENTS = 2


@contextlib.contextmanager
def _serving(*args: str) -> Iterator[str]:
    """`codecage serve --http --audit off` on a free loopback port (no token: loopback),
    yielding its /run_code URL once a run has come back; Ctrl-C when done."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    argv = [CODECAGE, "serve", "--http", "--port", str(port), "--insecure-no-token"]
    argv += ["--no-scrub", "--audit", "off", "--max-concurrent", str(SERVE_CLIENTS), *args]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}/run_code"
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                _post(url, "1")
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"serve {' '.join(args)} did not start") from None
                time.sleep(0.5)
        yield url
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _post(url: str, code: str) -> dict[str, Any]:
    body = json.dumps({"code": code, "language": "python"}).encode()
    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as answer:
        found: dict[str, Any] = json.loads(answer.read())
        return found


def _serve_rate(url: str, n: int) -> dict[str, Any]:
    """N posts from SERVE_CLIENTS threads at once: runs/s, latency, and the load average."""
    latencies: list[float] = []
    failed: list[str] = []
    codes = iter(_programs(n))
    lock = threading.Lock()

    def client() -> None:
        while True:
            with lock:
                code = next(codes, None)
            if code is None:
                return
            started = time.monotonic()
            found = _post(url, f"print({code})")
            with lock:
                latencies.append(time.monotonic() - started)
                if found["status"] != "Success":
                    failed.append(found["status"])

    load_before = os.getloadavg()[0]
    started = time.monotonic()
    threads = [threading.Thread(target=client) for _ in range(SERVE_CLIENTS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.monotonic() - started
    return {
        "programs": n,
        "clients": SERVE_CLIENTS,
        "wall_s": round(wall, 3),
        "runs_per_s": round(n / wall, 1),
        "p50_ms": round(statistics.median(latencies) * 1000, 1),
        "not_success": len(failed),
        "loadavg_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)],
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

    report: dict[str, Any] = {
        "n": args.n,
        "concurrency_per_node": CONCURRENCY,
        "cores": os.cpu_count(),
        "loadavg_at_start": [round(x, 2) for x in os.getloadavg()],
    }
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
        with _serving() as url:
            report["serve_local"] = _serve_rate(url, args.n)
        print("serve_local", report["serve_local"], flush=True)
        with _serving("--ray", cluster.address) as url:
            report["serve_ray"] = _serve_rate(url, args.n)
        print("serve_ray", report["serve_ray"], flush=True)

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
