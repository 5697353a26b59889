"""What the audit trail adds to a run (issue 23: added p50 per run <= 0.2 ms, warm pool).

One Sandbox with a warm pool; its audit trail (a SQLite file in a temp dir, WAL) is switched
on and off run by run, interleaved so that machine drift cancels. Two loads:

    spaced        the pool is ready again before each run (sandbox.warm): an agent's pace
    back-to-back  runs one after another, one caller: a batch's pace

Reported, in ms: p50/p95 of the caller's wall time per run with the trail off (the floor)
and on, their difference; and the trail's own cost measured where it is paid (building the
record and committing it, `AuditTrail.record`, timed inside the same runs). Beside it, the
peer: one JSON row INSERT + COMMIT into a SQLite WAL file with the same pragmas, the least a
durable write of the same record can cost.

    PYTHONPATH=src .venv/bin/python benchmarks/bench_audit.py -n 300
    PYTHONPATH=src .venv/bin/python benchmarks/bench_audit.py -n 5      # smoke
"""

from __future__ import annotations

import argparse
import json
import sqlite3
import statistics
import tempfile
import time
from pathlib import Path

from codecage import Sandbox
from codecage.audit import AuditTrail, Finished, Query
from codecage.models import AuditSettings

CODE = "x = sum(range(100))\nprint(x)"


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def timed_trail(trail: AuditTrail, into: list[float]) -> None:
    """Wrap `trail.record` to time each call (the trail's whole cost in the run's path)."""
    inner = trail.record

    def record(finished: Finished) -> None:
        started = time.perf_counter()
        inner(finished)
        into.append((time.perf_counter() - started) * 1000)

    trail.record = record  # type: ignore[method-assign]


def measure(sandbox: Sandbox, trail: AuditTrail, n: int, spaced: bool) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {"off": [], "on": []}
    for i in range(2 * n):
        mode = "on" if i % 2 else "off"
        # A Host is complete once built; the A/B swaps its trail in place on purpose.
        object.__setattr__(sandbox.host, "audit", trail if mode == "on" else None)
        if spaced:
            sandbox.warm(60)
        started = time.perf_counter()
        result = sandbox.run(CODE)
        times[mode].append((time.perf_counter() - started) * 1000)
        assert result.ok, result.stderr
    object.__setattr__(sandbox.host, "audit", None)
    return times


def peer(n: int, directory: Path, record_json: str) -> list[float]:
    db = sqlite3.connect(directory / "peer.db", isolation_level=None)
    for pragma in ("journal_mode = WAL", "synchronous = NORMAL"):
        db.execute(f"PRAGMA {pragma}")
    db.execute("CREATE TABLE t (id INTEGER PRIMARY KEY, record TEXT)")
    times = []
    for _ in range(n):
        started = time.perf_counter()
        db.execute("BEGIN IMMEDIATE")
        db.execute("INSERT INTO t (record) VALUES (?)", (record_json,))
        db.execute("COMMIT")
        times.append((time.perf_counter() - started) * 1000)
    db.close()
    return times


def row(name: str, values: list[float]) -> str:
    return f"  {name:<34} p50 {percentile(values, 0.5):7.3f}   p95 {percentile(values, 0.95):7.3f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", type=int, default=300, help="runs per mode and load")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp, Sandbox(pool=True) as sandbox:
        directory = Path(tmp)
        trail = AuditTrail.open(
            AuditSettings(store=str(directory / "audit.db")), sandbox.host.audit_scrub
        )
        record_ms: list[float] = []
        timed_trail(trail, record_ms)
        sandbox.warm(120)
        report = [f"bench_audit: {args.n} runs per mode and load, CODE={CODE!r}"]
        for load, spaced in (("spaced", True), ("back-to-back", False)):
            record_ms.clear()
            times = measure(sandbox, trail, args.n, spaced)
            added = statistics.median(times["on"]) - statistics.median(times["off"])
            report += [
                f"{load} (one caller; the trail on and off interleaved), caller wall ms:",
                row("trail off (floor)", times["off"]),
                row("trail on", times["on"]),
                f"  {'added p50 (on - off)':<34} {added:+.3f}",
                row("AuditTrail.record itself", record_ms),
            ]
        stored = trail.store.query(Query(limit=1))
        peer_ms = peer(args.n, directory, json.dumps(stored[0].model_dump(mode="json")))
        report += ["peer: one JSON row INSERT + COMMIT, SQLite WAL:", row("peer", peer_ms)]
        trail.close()
    print("\n".join(report))


if __name__ == "__main__":
    main()
