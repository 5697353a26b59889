"""Every latency question at once, side by side, each next to its floor, in ONE run.

Sections (`--only` takes a comma-separated list of these names):

    floors        the sandbox's interpreter as a whole process: `-I -S -c pass`, `-I -S -c
                  SNIPPET`; and /usr/bin/python3 with the snippet, for context
    raw_bwrap     bubblewrap + that interpreter, no codecage (the cost of isolation alone)
    cold          codecage without a pool: `Sandbox(pool=False).run()` in this process, and
                  `codecage run --code SNIPPET --json` as a whole process
    warm          `Sandbox(pool=True).run()` latency; the pool is refilled (`warm()`) before
                  each run, outside the timing, so this is a run's latency, not the refill rate
    throughput    runs per second at concurrency 1, 2, 4, 8 (threads calling `run`, sustained,
                  the pool refilling under load): failures, hits/misses, leaks; and the bound,
                  how fast the pool can start sandboxes
    data_science  a pandas snippet, cold vs warm (the data_science profile preloads pandas)
    memory        RSS of this host process and RSS/PSS of one idle pooled sandbox, per profile
    sessions      a run in an open session (its interpreter kept) beside a warm run and its
                  paired python_pass, interleaved; and opening a session from the pool
                  (`Sandbox(pool=True).session()`: a pooled sandbox becomes the session), the
                  pool refilled and the session closed before each, outside the timing
    gvisor        bwrap vs gVisor side by side: cold `Sandbox(pool=False).run()` on each, the
                  runsc floor (`runsc do true`) and raw runsc + the interpreter with the
                  snippet (interleaved rounds); then warm runs on a pool of each (interleaved,
                  both pools refilled before each run). Skipped, and said, where the gvisor
                  backend is not available (runsc missing, not root)

floors, raw_bwrap and cold run interleaved in rounds (each round runs every variant once), so
machine drift hits them alike; warm and data_science interleave their variants the same way,
warm with a paired `python_pass`. Prints tables and the issue's targets marked met / not met,
and writes benchmarks/results/suite-<UTC timestamp>.json.

    .venv/bin/python benchmarks/bench_suite.py                     # full, a few minutes
    .venv/bin/python benchmarks/bench_suite.py --quick --no-write  # smoke (the test suite)
    .venv/bin/python benchmarks/bench_suite.py --only warm,memory -n warm=500

Exit code 0 when the suite ran to its end. Targets not met, failed throughput runs and
leaks do not change it: they are printed (targets, problems) and kept in the JSON. A run
that fails outside the throughput phase stops the suite with a traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench_cold_start import ROOT, SNIPPET, _python, _raw_bwrap_argv, _run, _timed, percentile

from codecage import Options, Sandbox
from codecage.backends.base import load_backend
from codecage.engine import RUN_DIR_PREFIX
from codecage.engine import workspace as workspaces
from codecage.engine.pool import Pool
from codecage.errors import CodecageError
from codecage.isolation import cgroups
from codecage.models import Limits, PoolConfig, PoolSizes

SECTIONS = (
    "floors", "raw_bwrap", "cold", "warm", "throughput", "data_science", "memory", "sessions",
    "gvisor",
)  # fmt: skip
SNIPPET_STDOUT = "499500\n"
PANDAS = "import pandas as pd; df = pd.DataFrame({'a': range(100)}); print(df['a'].sum())"
PANDAS_STDOUT = "4950\n"
SYSTEM_PYTHON = Path("/usr/bin/python3")
WARM_TIMEOUT_S = 120.0


@dataclass(frozen=True, slots=True)
class Sizes:
    """How many of each: `-n NAME=N` overrides one."""

    cold: int = 30  # rounds of floors / raw_bwrap / cold
    warm: int = 300  # warm runs (each paired with a python_pass)
    throughput: int = 2000  # runs across the whole throughput phase, split over the levels
    fill: int = 16  # sandboxes started from empty to measure the pool's start rate
    ds_warm: int = 30  # warm pandas runs
    ds_cold: int = 5  # cold pandas runs
    gv_cold: int = 20  # rounds of bwrap cold / gvisor cold / runsc floors
    gv_warm: int = 50  # warm runs on each of the bwrap and gvisor pools
    sessions: int = 300  # session runs (with as many warm runs) and 50 session opens


QUICK = Sizes(
    cold=2, warm=10, throughput=40, fill=2, ds_warm=2, ds_cold=1, gv_cold=1, gv_warm=2, sessions=4
)


@dataclass(frozen=True, slots=True)
class Target:
    """One of the issue's targets: `value <= limit` (or >= when `at_least`)."""

    name: str
    limit: float
    unit: str
    at_least: bool = False


TARGETS = {
    "warm_p50": Target("warm run p50", 3.0, "ms"),
    "warm_p99": Target("warm run p99", 15.0, "ms"),
    "cold_vs_raw": Target("cold lib p50 / raw bwrap p50", 1.5, "x"),
    "throughput_c4": Target("throughput at concurrency 4, 0 failures, no leaks", 50, "/s", True),
    "ds_warm_p50": Target("warm pandas p50", 15.0, "ms"),
    "idle_basic_rss": Target("idle basic sandbox RSS", 15.0, "MB"),
    "session_vs_warm": Target("session run p50 / warm run p50", 1.0, "x"),
}

# The ratios reported for each variant: its p50 over the p50 of each of these measured here.
FLOORS_OF = {
    "python_snippet": ("python_pass",),
    "system_python_snippet": ("python_pass", "python_snippet"),
    "raw_bwrap": ("python_pass", "python_snippet"),
    "cold_lib": ("raw_bwrap", "python_pass"),
    "cold_cli": ("raw_bwrap", "python_pass"),
    "warm_lib": ("python_pass_paired", "python_pass", "raw_bwrap", "cold_lib"),
    "ds_cold_pandas": ("raw_bwrap", "python_pass"),
    "ds_warm_pandas": ("ds_cold_pandas", "python_pass_paired", "python_pass", "warm_lib"),
    "session_run": ("session_warm_lib", "session_python_pass"),
    "session_open": ("session_warm_lib",),
    "raw_runsc": ("runsc_floor",),
    "gvisor_cold": ("bwrap_cold", "runsc_floor", "raw_runsc"),
    "gvisor_warm": ("bwrap_warm",),
}


# --- timing ----------------------------------------------------------------------------


def interleave(
    fns: dict[str, Callable[[], None]],
    counts: dict[str, int],
    settle: Callable[[], None] = lambda: None,
) -> dict[str, list[float]]:
    """Time each fn `counts[name]` times, in rounds, each fn spread evenly over the rounds.
    `settle` runs before every timed call, outside the timing. One untimed call of each
    first (caches, self-test, imports)."""
    for fn in fns.values():
        settle()
        fn()
    rounds = max(counts.values())
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for i in range(rounds):
        for name, fn in fns.items():
            c = counts[name]
            if (i + 1) * c // rounds > i * c // rounds:
                settle()
                samples[name].append(_timed(fn))
    return samples


def stats(values: list[float]) -> dict[str, float | int]:
    return {
        "n": len(values),
        "p50_ms": round(statistics.median(values), 2),
        "p90_ms": round(percentile(values, 0.90), 2),
        "p99_ms": round(percentile(values, 0.99), 2),
        "mean_ms": round(statistics.fmean(values), 2),
        "min_ms": round(min(values), 2),
        "max_ms": round(max(values), 2),
    }


def _lib_run(sandbox: Sandbox, code: str, expected: str, what: str) -> Callable[[], None]:
    def go() -> None:
        r = sandbox.run(code)
        if not r.ok or r.stdout != expected:
            raise RuntimeError(f"{what} failed: {r.status} {r.error} stdout={r.stdout[:200]!r}")

    return go


def _warm_or_fail(sandbox: Sandbox) -> Callable[[], None]:
    def settle() -> None:
        if not sandbox.warm(WARM_TIMEOUT_S):
            state = sandbox.info().pool
            raise RuntimeError(f"pool not ready within {WARM_TIMEOUT_S:g} s: {state}")

    return settle


@contextmanager
def pooled(
    profile: str, sizes: PoolSizes | None = None, backend: str = "auto"
) -> Iterator[tuple[Pool, Sandbox]]:
    """A pool of our own (model defaults unless `sizes`), and a Sandbox of `profile` on it."""
    config = PoolConfig(enabled=True, sizes=sizes or PoolSizes())
    with (
        Pool(load_backend(backend), config, Limits()) as pool,
        Sandbox(profile=profile, options=Options(pool=pool)) as sandbox,
    ):
        yield pool, sandbox


# --- sections ----------------------------------------------------------------------------


def measure_processes(sections: set[str], sizes: Sizes) -> dict[str, list[float]]:
    """floors, raw_bwrap and cold, interleaved; cold brings its floors along."""
    python = _python()
    fns: dict[str, Callable[[], None]] = {}
    wanted = set(sections)
    if "cold" in wanted:
        wanted |= {"floors", "raw_bwrap"}
    if "raw_bwrap" in wanted:
        wanted.add("floors")
    if "floors" in wanted:
        fns["python_pass"] = _run([python, "-I", "-S", "-c", "pass"])
        fns["python_snippet"] = _run([python, "-I", "-S", "-c", SNIPPET])
        if SYSTEM_PYTHON.exists():
            fns["system_python_snippet"] = _run([str(SYSTEM_PYTHON), "-I", "-S", "-c", SNIPPET])
    if "raw_bwrap" in wanted:
        fns["raw_bwrap"] = _run(_raw_bwrap_argv(SNIPPET))
    if "cold" in wanted:
        cold = Sandbox(pool=False)
        fns["cold_lib"] = _lib_run(cold, SNIPPET, SNIPPET_STDOUT, "cold run")
        cli = [str(ROOT / ".venv" / "bin" / "codecage"), "run", "--code", SNIPPET, "--json"]
        fns["cold_cli"] = _run(cli)
    return interleave(fns, dict.fromkeys(fns, sizes.cold))


def measure_warm(sizes: Sizes) -> dict[str, list[float]]:
    """Warm runs, each starting when the pool has an idle sandbox, paired with python_pass."""
    pass_argv = [_python(), "-I", "-S", "-c", "pass"]
    with pooled("basic") as (_, sandbox):
        fns = {
            "warm_lib": _lib_run(sandbox, SNIPPET, SNIPPET_STDOUT, "warm run"),
            "python_pass_paired": _run(pass_argv),
        }
        return interleave(fns, dict.fromkeys(fns, sizes.warm), settle=_warm_or_fail(sandbox))


def measure_data_science(sizes: Sizes) -> dict[str, list[float]]:
    """The pandas snippet cold and warm, interleaved (the pool refilled before each)."""
    cold = Sandbox(pool=False, profile="data_science")
    with pooled("data_science") as (_, sandbox):
        fns = {
            "ds_warm_pandas": _lib_run(sandbox, PANDAS, PANDAS_STDOUT, "warm pandas run"),
            "ds_cold_pandas": _lib_run(cold, PANDAS, PANDAS_STDOUT, "cold pandas run"),
        }
        counts = {"ds_warm_pandas": sizes.ds_warm, "ds_cold_pandas": sizes.ds_cold}
        return interleave(fns, counts, settle=_warm_or_fail(sandbox))


def measure_sessions(sizes: Sizes) -> dict[str, list[float]]:
    """A run in an open session next to a warm run (both the snippet; the pool refilled
    before each), then opening a session from the pool."""
    pass_argv = [_python(), "-I", "-S", "-c", "pass"]
    with pooled("basic") as (_, sandbox):
        settle = _warm_or_fail(sandbox)
        session = sandbox.session()
        try:

            def in_session() -> None:
                r = session.run(SNIPPET)
                if not r.ok or r.stdout != SNIPPET_STDOUT:
                    raise RuntimeError(f"session run failed: {r.status} {r.error}")

            fns = {
                "session_run": in_session,
                "session_warm_lib": _lib_run(sandbox, SNIPPET, SNIPPET_STDOUT, "warm run"),
                "session_python_pass": _run(pass_argv),
            }
            samples = interleave(fns, dict.fromkeys(fns, sizes.sessions), settle=settle)
        finally:
            session.close()
        opened: list[Any] = []

        def settle_open() -> None:
            while opened:
                opened.pop().close()
            settle()

        opens = interleave(
            {"session_open": lambda: opened.append(sandbox.session())},
            {"session_open": max(2, sizes.sessions // 6)},
            settle=settle_open,
        )
        settle_open()
    return samples | opens


def measure_memory() -> dict[str, dict[str, Any]]:
    """host RSS and one idle sandbox's RSS/PSS, per profile, with the pool full."""
    rows: dict[str, dict[str, Any]] = {}
    for profile in ("basic", "data_science"):
        with pooled(profile) as (_, sandbox):
            _warm_or_fail(sandbox)()
            state = sandbox.info().pool
            assert state is not None
            key = state.keys[0]
            rows[profile] = {
                "host_rss_mb": state.host_rss_mb,
                "idle_rss_mb": key.idle_rss_mb,
                "idle_pss_mb": key.idle_pss_mb,
                "idle": key.idle,
                "preload": key.preload,
            }
    return rows


def gvisor_unavailable() -> str | None:
    """Why the gvisor section cannot run here, or None."""
    try:
        load_backend("gvisor")
    except CodecageError as exc:
        return str(exc)
    return None


def measure_gvisor(sizes: Sizes) -> dict[str, list[float]]:
    """bwrap vs gVisor, cold then warm, each pair interleaved, with runsc's floors."""
    runsc = shutil.which("runsc") or "runsc"
    floor_flags = ["--network=none", "--platform=ptrace", "--ignore-cgroups"]
    cold_bwrap = Sandbox(pool=False, backend="bwrap")
    cold_gvisor = Sandbox(pool=False, backend="gvisor")
    fns = {
        "bwrap_cold": _lib_run(cold_bwrap, SNIPPET, SNIPPET_STDOUT, "bwrap cold run"),
        "gvisor_cold": _lib_run(cold_gvisor, SNIPPET, SNIPPET_STDOUT, "gvisor cold run"),
        "runsc_floor": _run([runsc, *floor_flags, "do", "true"]),
        "raw_runsc": _run([runsc, *floor_flags, "do", _python(), "-I", "-S", "-c", SNIPPET]),
    }
    samples = interleave(fns, dict.fromkeys(fns, sizes.gv_cold))
    with (
        pooled("basic", backend="bwrap") as (_, warm_bwrap),
        pooled("basic", backend="gvisor") as (_, warm_gvisor),
    ):
        settles = (_warm_or_fail(warm_bwrap), _warm_or_fail(warm_gvisor))

        def settle_both() -> None:
            for settle in settles:
                settle()

        warm = {
            "bwrap_warm": _lib_run(warm_bwrap, SNIPPET, SNIPPET_STDOUT, "bwrap warm run"),
            "gvisor_warm": _lib_run(warm_gvisor, SNIPPET, SNIPPET_STDOUT, "gvisor warm run"),
        }
        samples |= interleave(warm, dict.fromkeys(warm, sizes.gv_warm), settle=settle_both)
    return samples


# --- throughput --------------------------------------------------------------------------


def _own_prefix() -> str:
    return f"{os.getpid()}-"


def leak_counts() -> dict[str, int]:
    """What a sandbox could leave behind: this process's children and fds, run dirs and
    cgroups named after this process (and, for context, those of any process)."""
    children: set[int] = set()
    for task in Path(f"/proc/{os.getpid()}/task").iterdir():
        try:
            children.update(int(p) for p in (task / "children").read_text().split())
        except OSError:
            continue
    run_dirs = [p.name for p in workspaces.private_parent().glob(f"{RUN_DIR_PREFIX}*")]
    groups: list[str] = []
    support = cgroups.detect()
    for parent in support.parents.values() if support is not None else ():
        if parent.is_dir():
            groups += [d.name for d in parent.iterdir() if d.is_dir()]
    own = _own_prefix()
    return {
        "children": len(children),
        "fds": sum(1 for _ in Path(f"/proc/{os.getpid()}/fd").iterdir()),
        "run_dirs": sum(n.startswith(f"{RUN_DIR_PREFIX}{own}") for n in run_dirs),
        "cgroups": sum(n.startswith(own) for n in groups),
        "run_dirs_any_process": len(run_dirs),
        "cgroups_any_process": len(groups),
    }


def leaked(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    """Growth of what this process owns (the *_any_process counts are context only)."""
    return {
        k: after[k] - before[k]
        for k in ("children", "fds", "run_dirs", "cgroups")
        if after[k] > before[k]
    }


def machine_jiffies() -> tuple[int, int]:
    """(busy, total) CPU time of the whole machine, all cores, from /proc/stat."""
    fields = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    total = sum(fields[:8])  # guest time is already inside user
    return total - idle, total


def throughput_level(concurrency: int, runs: int) -> dict[str, Any]:
    """`runs` runs by `concurrency` threads, back to back, the pool refilling under load."""
    latencies: list[float] = []
    failures: list[str] = []
    lock = threading.Lock()
    claimed = 0

    with pooled("basic") as (pool, sandbox):
        _warm_or_fail(sandbox)()
        before = pool.state().keys[0]

        def worker() -> None:
            nonlocal claimed
            while True:
                with lock:
                    if claimed >= runs:
                        return
                    claimed += 1
                start = time.perf_counter()
                try:
                    r = sandbox.run(SNIPPET)
                    error = None if r.ok and r.stdout == SNIPPET_STDOUT else f"{r.status}"
                    if error and r.error is not None:
                        error += f" {r.error.type}: {r.error.message[:200]}"
                except Exception as exc:  # a failure to count, not to stop the phase
                    error = f"{type(exc).__name__}: {exc}"[:300]
                elapsed_ms = (time.perf_counter() - start) * 1000
                with lock:
                    latencies.append(elapsed_ms)
                    if error is not None:
                        failures.append(error)

        threads = [threading.Thread(target=worker) for _ in range(concurrency)]
        cpu_before, machine_before = os.times(), machine_jiffies()
        start = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        seconds = time.perf_counter() - start
        cpu, machine = os.times(), machine_jiffies()
        after = pool.state().keys[0]
        config = pool.config.model_dump(mode="json")
    # This process's CPU (every thread: callers, starters, manager, reaper) is exact. The
    # sandboxes' own CPU is not countable from here (their processes are killed, not
    # waited for, so it never lands in children_*): the machine's busy share says whether
    # the cores were the limit (it includes anything else running on the host).
    host_cpu_ms = (cpu.user + cpu.system - cpu_before.user - cpu_before.system) * 1000
    busy, total = (a - b for a, b in zip(machine, machine_before, strict=True))
    started = after.started - before.started
    return {
        "concurrency": concurrency,
        "runs": len(latencies),
        "seconds": round(seconds, 3),
        "runs_per_s": round(len(latencies) / seconds, 1),
        "failures": len(failures),
        "failure_samples": sorted(set(failures))[:5],
        "hits": after.hits - before.hits,
        "misses": after.misses - before.misses,
        "started": started,
        "started_per_s": round(started / seconds, 1),
        "crashed": after.crashed - before.crashed,
        "failed_starts": after.failed_starts - before.failed_starts,
        "target_at_end": after.target,
        "host_cpu_ms_per_run": round(host_cpu_ms / max(1, len(latencies)), 1),
        "machine_busy_pct": round(100 * busy / total, 1) if total else None,
        "latency": stats(latencies),
        "pool_config": config,
    }


def fill_rate(count: int) -> dict[str, Any]:
    """The bound: from an empty pool of min_idle = max_idle = `count`, how fast does it get
    them all ready (nothing takes any meanwhile)?"""
    sizes = PoolSizes(min_idle=count, max_idle=count)
    start = time.perf_counter()
    first_ms: float | None = None
    with pooled("basic", sizes) as (pool, sandbox):
        while first_ms is None:  # the first one ready, polled
            if pool.state().keys[0].idle:
                first_ms = (time.perf_counter() - start) * 1000
            else:
                time.sleep(0.002)
        _warm_or_fail(sandbox)()
        seconds = time.perf_counter() - start
        max_starting = pool.config.max_starting
    return {
        "sandboxes": count,
        "max_starting": max_starting,
        "seconds": round(seconds, 3),
        "first_ready_ms": round(first_ms, 1),
        "started_per_s": round(count / seconds, 1),
    }


def measure_throughput(sizes: Sizes, levels: list[int]) -> dict[str, Any]:
    warmup = Sandbox(pool=False)  # one-time lazy state (self-test, caches) before the baseline
    warmup.run("pass")
    baseline = leak_counts()
    per_level = max(1, sizes.throughput // len(levels))
    rows = []
    for concurrency in levels:
        print(f"  throughput: concurrency {concurrency}, {per_level} runs", file=sys.stderr)
        before = leak_counts()
        row = throughput_level(concurrency, per_level)
        after = leak_counts()
        row["leak_counts_before"] = before
        row["leak_counts_after_close"] = after
        row["leaked"] = leaked(before, after)
        rows.append(row)
    print(f"  throughput: filling an empty pool of {sizes.fill}", file=sys.stderr)
    bound = fill_rate(sizes.fill)
    final = leak_counts()
    return {
        "levels": rows,
        "fill": bound,
        "leak_counts_before": baseline,
        "leak_counts_after": final,
        "leaked": leaked(baseline, final),
    }


# --- report ------------------------------------------------------------------------------


SECTION_OF = {
    "python_pass": "floors",
    "python_snippet": "floors",
    "system_python_snippet": "floors",
    "raw_bwrap": "raw_bwrap",
    "cold_lib": "cold",
    "cold_cli": "cold",
    "warm_lib": "warm",
    "python_pass_paired": "warm",
    "ds_warm_pandas": "data_science",
    "ds_cold_pandas": "data_science",
    "session_run": "sessions",
    "session_warm_lib": "sessions",
    "session_python_pass": "sessions",
    "session_open": "sessions",
    "bwrap_cold": "gvisor",
    "gvisor_cold": "gvisor",
    "runsc_floor": "gvisor",
    "raw_runsc": "gvisor",
    "bwrap_warm": "gvisor",
    "gvisor_warm": "gvisor",
}


def summarise(samples: dict[str, list[float]]) -> dict[str, dict[str, Any]]:
    p50 = {name: statistics.median(values) for name, values in samples.items()}
    table: dict[str, dict[str, Any]] = {}
    for name, values in samples.items():
        ratios = {
            f"p50_over_{floor}": round(p50[name] / p50[floor], 3)
            for floor in FLOORS_OF.get(name, ())
            if floor in p50
        }
        table[name] = {"section": SECTION_OF[name], **stats(values), "ratios": ratios}
    return table


def evaluate(
    variants: dict[str, dict[str, Any]],
    throughput: dict[str, Any] | None,
    memory: dict[str, dict[str, Any]] | None,
) -> list[dict[str, Any]]:
    """The issue's targets next to the measured values (None = not measured in this run)."""

    def p(name: str, field: str) -> float | None:
        return variants[name][field] if name in variants else None

    measured: dict[str, float | None] = {
        "warm_p50": p("warm_lib", "p50_ms"),
        "warm_p99": p("warm_lib", "p99_ms"),
        "cold_vs_raw": variants.get("cold_lib", {}).get("ratios", {}).get("p50_over_raw_bwrap"),
        "throughput_c4": None,
        "ds_warm_p50": p("ds_warm_pandas", "p50_ms"),
        "session_vs_warm": variants.get("session_run", {})
        .get("ratios", {})
        .get("p50_over_session_warm_lib"),
        "idle_basic_rss": memory["basic"]["idle_rss_mb"] if memory else None,
    }
    levels = throughput["levels"] if throughput else []
    c4 = next((r for r in levels if r["concurrency"] == 4), None)
    clean, note = True, ""
    if c4 is not None:
        measured["throughput_c4"] = c4["runs_per_s"]
        clean = c4["failures"] == 0 and not c4["leaked"]
        note = f"{c4['failures']} failures, leaked {c4['leaked'] or 'nothing'}"
    rows = []
    for key, target in TARGETS.items():
        value = measured[key]
        met: bool | None = None
        if value is not None:
            met = value >= target.limit if target.at_least else value <= target.limit
            met = met and (clean if key == "throughput_c4" else True)
        rows.append(
            {
                "target": target.name,
                "limit": target.limit,
                "unit": target.unit,
                "at_least": target.at_least,
                "measured": value,
                "note": note if key == "throughput_c4" else "",
                "met": met,
            }
        )
    return rows


def problems(report: dict[str, Any]) -> list[str]:
    """What went wrong beyond speed: failed runs, leaks. Printed and kept in the JSON."""
    found: list[str] = []
    tp = report.get("throughput")
    for row in tp["levels"] if tp else []:
        c = row["concurrency"]
        if row["failures"]:
            found.append(f"throughput c={c}: {row['failures']} failed runs")
        if row["leaked"]:
            found.append(f"throughput c={c}: left after closing its pool: {row['leaked']}")
        if row["failed_starts"] or row["crashed"]:
            found.append(
                f"throughput c={c}: {row['failed_starts']} failed starts,"
                f" {row['crashed']} crashed idle sandboxes"
            )
    if tp and tp["leaked"]:
        found.append(f"throughput phase: left after closing every pool: {tp['leaked']}")
    return found


def _fmt(value: object, spec: str = ".1f") -> str:
    return "-" if value is None else format(value, spec) if isinstance(value, float) else str(value)


def render(report: dict[str, Any]) -> str:
    out: list[str] = []
    variants: dict[str, dict[str, Any]] = report["variants"]
    if variants:
        out.append(f"{'latency, ms':<23}{'n':>5}{'p50':>9}{'p90':>9}{'p99':>9}  ratio of p50s")
    for section in SECTIONS:
        rows = {n: r for n, r in variants.items() if r["section"] == section}
        if rows:
            out.append(f"== {section} ==")
        for name, row in rows.items():
            ratios = ", ".join(
                f"{v:.2f}x {k.removeprefix('p50_over_')}" for k, v in row["ratios"].items()
            )
            out.append(
                f"{name:<23}{row['n']:>5}{row['p50_ms']:>9.2f}"
                f"{row['p90_ms']:>9.2f}{row['p99_ms']:>9.2f}  {ratios}"
            )
    if report.get("gvisor_skipped"):
        out.append(f"== gvisor == skipped: {report['gvisor_skipped']}")
    tp = report.get("throughput")
    if tp:
        out.append("== throughput == (basic profile, model-default pool sizes)")
        out.append(
            f"{'conc':>4}{'runs':>6}{'sec':>8}{'runs/s':>8}{'fail':>6}{'hits':>6}{'miss':>6}"
            f"{'started':>8}{'start/s':>8}{'p50 ms':>8}{'p99 ms':>8}"
            f"{'host cpu':>9}{'busy':>6}  leaked"
        )
        for r in tp["levels"]:
            lat = r["latency"]
            out.append(
                f"{r['concurrency']:>4}{r['runs']:>6}{r['seconds']:>8.2f}{r['runs_per_s']:>8.1f}"
                f"{r['failures']:>6}{r['hits']:>6}{r['misses']:>6}{r['started']:>8}"
                f"{r['started_per_s']:>8.1f}{lat['p50_ms']:>8.1f}{lat['p99_ms']:>8.1f}"
                f"{r['host_cpu_ms_per_run']:>9.1f}{r['machine_busy_pct']:>5.0f}%"
                f"  {r['leaked'] or 'nothing'}"
            )
            for failure in r["failure_samples"]:
                out.append(f"      failure: {failure}")
        fill = tp["fill"]
        out.append(
            "host cpu = this process's CPU ms per run (all its threads); busy = the whole"
            " machine's CPU use during the level, all cores (other work on the host included)"
        )
        out.append(
            f"bound: an empty pool filled {fill['sandboxes']} sandboxes in {fill['seconds']:.2f} s"
            f" = {fill['started_per_s']:.1f} started/s (max_starting={fill['max_starting']},"
            f" first ready after {fill['first_ready_ms']:.0f} ms)"
        )
        out.append(
            f"leaks over the phase (children, fds, own run dirs, own cgroups):"
            f" {tp['leaked'] or 'none'}; before {tp['leak_counts_before']},"
            f" after {tp['leak_counts_after']}"
        )
    mem = report.get("memory")
    if mem:
        out.append("== memory == (MB, each pool full)")
        out.append(f"{'profile':<14}{'host rss':>10}{'idle rss':>10}{'idle pss':>10}  preload")
        for profile, row in mem.items():
            out.append(
                f"{profile:<14}{_fmt(row['host_rss_mb']):>10}{_fmt(row['idle_rss_mb']):>10}"
                f"{_fmt(row['idle_pss_mb']):>10}  {', '.join(row['preload']) or '-'}"
            )
    out.append("== targets == (the issue's)")
    for t in report["targets"]:
        op = ">=" if t["at_least"] else "<="
        verdict = {True: "met", False: "NOT MET", None: "not measured"}[t["met"]]
        value = _fmt(t["measured"], ".2f")
        note = f" ({t['note']})" if t["note"] else ""
        limit = f"{op} {t['limit']:g} {t['unit']}"
        out.append(f"{t['target']:<52}{limit:<10} measured {value:>8}  {verdict}{note}")
    out.append("== problems == (failed runs, leaks)")
    out += report["problems"] or ["none"]
    return "\n".join(out)


def environment() -> dict[str, Any]:
    def git(*args: str) -> str:
        return subprocess.run(
            ["git", *args], capture_output=True, text=True, cwd=ROOT, check=False
        ).stdout

    support = cgroups.detect()
    return {
        "bench": "suite",
        "when": datetime.now(UTC).isoformat(timespec="seconds"),
        "host": platform.node(),
        "kernel": platform.release(),
        "cores": os.cpu_count(),
        "loadavg_at_start": [round(v, 2) for v in os.getloadavg()],
        "python": _python(),
        "system_python": str(SYSTEM_PYTHON) if SYSTEM_PYTHON.exists() else None,
        "host_python": sys.version.split()[0],
        "git_sha": git("rev-parse", "--short", "HEAD").strip(),
        # tracked files changed since that commit: the numbers are of the working tree
        "git_dirty": [
            line[3:] for line in git("status", "--porcelain", "--untracked-files=no").splitlines()
        ],
        "cgroups": f"v{support.version}" if support is not None else None,
    }


# --- main --------------------------------------------------------------------------------


def _parse_sizes(base: Sizes, overrides: list[str]) -> Sizes:
    fields = {f.name for f in dataclasses.fields(Sizes)}
    changes: dict[str, int] = {}
    for item in overrides:
        name, _, value = item.partition("=")
        if name not in fields or not value.isdigit() or int(value) < 1:
            raise SystemExit(f"-n {item!r}: expected NAME=N with N >= 1, NAME one of {fields}")
        changes[name] = int(value)
    return dataclasses.replace(base, **changes)


def _parse_sections(only: str | None) -> list[str]:
    if only is None:
        return list(SECTIONS)
    names = [s.strip() for s in only.split(",") if s.strip()]
    unknown = [s for s in names if s not in SECTIONS]
    if unknown:
        raise SystemExit(f"--only: unknown section(s) {unknown}; sections: {', '.join(SECTIONS)}")
    return [s for s in SECTIONS if s in names]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=(__doc__ or "").splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=f"sizes (-n NAME=N): {dataclasses.asdict(Sizes())}; --quick: "
        f"{dataclasses.asdict(QUICK)}",
    )
    parser.add_argument("--quick", action="store_true", help="tiny sizes (the test suite)")
    parser.add_argument("--no-write", action="store_true", help="print only, write no JSON")
    parser.add_argument(
        "-n", action="append", default=[], metavar="NAME=N", help="override one size"
    )
    parser.add_argument("--only", metavar="SECTION[,SECTION]", help=", ".join(SECTIONS))
    parser.add_argument(
        "--concurrency", default="1,2,4,8", help="throughput levels (default 1,2,4,8)"
    )
    args = parser.parse_args(argv)
    sizes = _parse_sizes(QUICK if args.quick else Sizes(), args.n)
    sections = _parse_sections(args.only)
    levels = [int(c) for c in args.concurrency.split(",") if c.strip()]

    report: dict[str, Any] = {
        **environment(),
        "parameters": {
            "quick": args.quick,
            "sections": sections,
            "sizes": dataclasses.asdict(sizes),
            "concurrency": levels,
            "snippet": SNIPPET,
            "pandas_snippet": PANDAS,
            "pool_sizes_default": PoolSizes().model_dump(),
            "pool_max_starting_default": PoolConfig().max_starting,
        },
    }
    started = time.perf_counter()
    samples: dict[str, list[float]] = {}
    if {"floors", "raw_bwrap", "cold"} & set(sections):
        print(f"floors/raw_bwrap/cold: {sizes.cold} interleaved rounds", file=sys.stderr)
        samples |= measure_processes(set(sections), sizes)
    if "warm" in sections:
        print(f"warm: {sizes.warm} runs, each paired with python_pass", file=sys.stderr)
        samples |= measure_warm(sizes)
    if "data_science" in sections:
        print(f"data_science: {sizes.ds_warm} warm, {sizes.ds_cold} cold", file=sys.stderr)
        samples |= measure_data_science(sizes)
    if "sessions" in sections:
        print(f"sessions: {sizes.sessions} session runs beside warm runs; opens", file=sys.stderr)
        samples |= measure_sessions(sizes)
    report["gvisor_skipped"] = None
    if "gvisor" in sections:
        report["gvisor_skipped"] = gvisor_unavailable()
        if report["gvisor_skipped"] is None:
            print(f"gvisor: {sizes.gv_cold} cold rounds, {sizes.gv_warm} warm", file=sys.stderr)
            samples |= measure_gvisor(sizes)
    order = list(SECTION_OF)
    report["variants"] = summarise({k: samples[k] for k in order if k in samples})
    report["throughput"] = None
    if "throughput" in sections:
        print(f"throughput: {sizes.throughput} runs over levels {levels}", file=sys.stderr)
        report["throughput"] = measure_throughput(sizes, levels)
    report["memory"] = None
    if "memory" in sections:
        print("memory: basic, data_science", file=sys.stderr)
        report["memory"] = measure_memory()
    report["targets"] = evaluate(report["variants"], report["throughput"], report["memory"])
    report["loadavg_at_end"] = [round(v, 2) for v in os.getloadavg()]
    report["suite_seconds"] = round(time.perf_counter() - started, 1)

    report["problems"] = problems(report)
    print(render(report))
    print(
        f"\nsections run: {', '.join(sections)}; {report['suite_seconds']} s;"
        f" load average {report['loadavg_at_start']} -> {report['loadavg_at_end']}"
    )
    if not args.no_write:
        out = ROOT / "benchmarks" / "results"
        out.mkdir(exist_ok=True)
        stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
        path = out / f"suite-{stamp}.json"
        path.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
        print(f"wrote {path.relative_to(ROOT)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
