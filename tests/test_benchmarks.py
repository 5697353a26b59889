"""The benchmarks run (tiny sizes). No timing is asserted here: numbers live in
benchmarks/results/, measured by `benchmarks/bench_*.py`."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_bench(script: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """benchmarks/`script` with `args`, which must exit 0."""
    p = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert p.returncode == 0, p.stderr
    return p


def test_the_cold_start_benchmark_runs_and_prints_every_variant() -> None:
    p = run_bench("bench_cold_start.py", "-n", "1", "--no-write")
    for variant in ("python_pass", "raw_bwrap", "codecage_lib", "codecage_cli"):
        assert variant in p.stdout


def test_the_cli_startup_benchmark_prints_every_variant_and_every_step() -> None:
    p = run_bench("bench_cli_startup.py", "-n", "1")
    for variant in ("python_pass", "import_cli", "codecage_run", "codecage_run_handoff"):
        assert variant in p.stdout
    p = run_bench("bench_cli_startup.py", "--phases", "-n", "1")
    for step in ("imports (codecage.cli)", "config load", "sandbox start", "teardown"):
        assert step in p.stdout


def test_the_benchmark_suite_runs_quick_and_prints_every_section() -> None:
    p = run_bench("bench_suite.py", "--quick", "--no-write", timeout=110)
    for section in (
        "floors",
        "raw_bwrap",
        "cold",
        "warm",
        "throughput",
        "data_science",
        "memory",
        "targets",
    ):
        assert f"== {section} ==" in p.stdout, section


def test_the_mcp_benchmark_runs_against_a_real_server_and_the_sdks_floor() -> None:
    p = run_bench("bench_mcp.py", "-n", "3", "--no-write")
    for variant in ("empty_tool", "empty_tool_fast", "execute_code"):
        assert variant in p.stdout


def test_the_scrub_benchmark_runs_every_variant_and_finds_no_false_positive() -> None:
    p = run_bench("bench_scrub.py", "-n", "2", "--size-kb", "64", "--no-write")
    for variant in ("all", "all_dense", "scrub_value", "result", "configured"):
        assert f"\n{variant} " in p.stdout, variant
    assert "false positives on 64000 chars of ordinary output: 0" in p.stdout


def test_the_preload_benchmark_runs_and_prints_every_variant() -> None:
    p = run_bench("bench_preload.py", "-n", "1", "--no-write")
    for variant in ("preload=none", "preload=numpy ", "preload=numpy+pandas+matplotlib"):
        assert variant in p.stdout


def test_the_cold_binds_benchmark_runs_both_pairings() -> None:
    p = run_bench("bench_cold_binds.py", "-n", "2", "--no-write")
    for side in ("with_tools", "without_tools", "standard", "basic"):
        assert side in p.stdout


def test_the_ab_benchmark_runs_both_sides_and_compares_them() -> None:
    """bench_ab.py runs a bench on an archived commit's code and on this checkout's; HEAD
    against itself here (what is compared is the plumbing, not a number)."""
    results = ROOT / "benchmarks" / "results"
    kept = set(results.iterdir())
    p = run_bench(
        "bench_ab.py",
        "--base",
        "HEAD",
        "--bench",
        "mcp",
        "--rounds",
        "1",
        "--no-write",
        "--",
        "-n",
        "2",
        "--pause",
        "0",
        timeout=300,
    )
    assert "round 1 base:" in p.stderr and "round 1 new:" in p.stderr
    assert "execute_code p50_ms" in p.stdout
    assert set(results.iterdir()) == kept  # the runs' own files removed, --no-write kept


def test_the_throughput_benchmark_runs_quick_and_its_batch_agrees_with_the_peer() -> None:
    """Every section runs, the sandboxed batch gives each program the verdict the harness
    peer gives it, and the soak leaves nothing behind; no results file without --save."""
    results = ROOT / "benchmarks" / "results"
    kept = set(results.iterdir())
    p = run_bench(
        "bench_throughput.py", "--quick", "--soak", "20", "--soak-mode", "pool", timeout=300
    )
    for section in ("tiny", "batch", "latency", "data_science", "cli", "memory", "soak"):
        assert f"== {section} ==" in p.stdout, section
    for variant in ("floor_fork", "floor_fork_host", "floor_raw_bwrap", "peer", "codecage_run"):
        assert f"\n{variant} " in p.stdout, variant
    batch_pool = next(
        line for line in p.stdout.splitlines() if line.startswith("pool ") and "peer" in line
    )
    assert "disagree 0" in batch_pool and "pass 11 fail 1" in batch_pool
    assert "left behind: nothing; own run dirs none" in p.stdout
    assert p.stdout.split("== problems ==")[1].splitlines()[1] == "none"
    assert set(results.iterdir()) == kept


def test_the_ray_benchmark_runs_local_one_and_two_nodes_the_servers_and_the_memory_batch() -> None:
    p = run_bench("bench_ray.py", "-n", "8", "--big", "20", "--no-write", timeout=400)
    sections = ("local", "ray_1node", "ray_2nodes", "serve_local", "serve_ray", "memory")
    for section in (*sections, "driver_heap_peak_mb", "loadavg_1m"):
        assert section in p.stdout
    assert "'not_success': 0" in p.stdout
