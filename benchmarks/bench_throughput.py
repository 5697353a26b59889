"""How many isolated runs per second (issue 24): each mode beside its floors and peer, ONE run.

Two modes of codecage, side by side in every section: `pool` (`Options(fork_server=False)`,
today's warm pool of single-use sandboxes) and `fork_server` (`Options(fork_server=True)`: a
template process forks each run's sandbox). A mode this checkout cannot build (no
`fork_server` keyword yet) is reported "n/a", never replaced by the other.

Sections (`--only` takes a comma-separated list of these names):

    tiny          `1` through `Sandbox.run` from 4 threads, back to back (c=4), runs/s per mode;
                  floors, same load: the raw fork rate (os.fork + os._exit + waitpid) in a
                  bare `python -I -S` (floor_fork) and in this host process (floor_fork_host:
                  what the peer's forks cost), and raw `bwrap ... python3 -I -S -c 1`
                  (bubblewrap + the sandbox's interpreter)
    batch         1,000 generated programs, each a function and its 3 asserts (some fail on
                  purpose), run by the peer and by codecage at c=4 (`Sandbox.run_many` when
                  it exists, else 4 threads): runs/s, the ratio codecage/peer (target >= 2),
                  and whether both agree on pass/fail for every program
    latency       warm library latency p50/p95 per mode, spaced (the pool ready again and a
                  pause before each run: an agent's pace) and back to back (one caller);
                  also `defaults` (`Sandbox()`, every default), and the caller's CPU per run
    data_science  `import pandas; pandas.DataFrame({'a':[1]}).a.sum()`, profile data_science,
                  runs/s at c=4 per mode
    cli           `codecage run --code 1` as a whole process (median of N) beside `python3 -c
                  1`, `python3 -I -c 'import codecage'` and raw bwrap + python, interleaved
    memory        RSS of this host process with each mode's sandbox warm, the idle pooled
                  sandbox's RSS/PSS, and the fork server's template RSS/PSS (`template_memory`)

The peer is the unsandboxed executor evaluation harnesses ship (human-eval's execution.py,
evalplus): per program a `multiprocessing.Process` (fork) that makes a temp dir, applies a
"reliability guard" (os/shutil/subprocess functions set to None, in the same interpreter:
no real isolation), runs the program under a SIGALRM timer with its output swallowed, and
sends the outcome back, here through a pipe (cheaper than human-eval's per-program Manager,
so the peer is the faster of the two); 4 threads drive it, as human-eval's thread pool does.

Rates are measured in rounds: each round gives every variant its share of the runs, back to
back, after every open pool is full again (outside the timing), so machine drift and pool
refills hit the variants alike. Each rate is printed with the machine's CPU busy share over
its runs (both cores: 100% means the cores, not the variant, were the limit).

`--soak N` (off by default) adds N tiny runs back to back at c=4 on one mode (`--soak-mode`;
default fork_server where it exists, else pool), sampling this process's RSS every 1,000 runs,
and checks afterwards that nothing is left: no run directories of this process, no child
processes, fds or cgroups beyond those before.

    PYTHONPATH=src .venv/bin/python benchmarks/bench_throughput.py            # a few minutes
    PYTHONPATH=src .venv/bin/python benchmarks/bench_throughput.py --quick    # smoke (tests)
    PYTHONPATH=src .venv/bin/python benchmarks/bench_throughput.py --only tiny,batch --save
    PYTHONPATH=src .venv/bin/python benchmarks/bench_throughput.py --only tiny --soak 100000

Prints the tables; with `--save` also writes benchmarks/results/throughput-<UTC stamp>.json
and .txt (the printed tables). Exit code 0 when it ran to its end: targets not met, failed
runs, disagreements and leaks are printed under "problems" and kept in the JSON, not turned
into an exit code.
"""

from __future__ import annotations

import argparse
import builtins
import contextlib
import dataclasses
import faulthandler
import inspect
import io
import json
import multiprocessing
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from multiprocessing.connection import Connection
from pathlib import Path
from types import FrameType
from typing import Any

from bench_cold_start import ROOT, _python, _raw_bwrap_argv, percentile
from bench_suite import environment, leak_counts, leaked, machine_jiffies

import codecage
from codecage import Sandbox
from codecage.engine import RUN_DIR_PREFIX
from codecage.engine import workspace as workspaces
from codecage.errors import CodecageError
from codecage.isolation import identity as identities

SECTIONS = ("tiny", "batch", "latency", "data_science", "cli", "memory")
# mode name -> Options(fork_server=...); every mode runs a warm pool but `fork_direct`, which
# forks each run's sandbox when the run asks (the fork server without a pool).
MODES = {"pool": False, "fork_server": True, "fork_direct": True}
UNPOOLED = {"fork_direct"}
CONCURRENCY = 4
TINY = "1"
PANDAS = "import pandas; pandas.DataFrame({'a':[1]}).a.sum()"
PEER_TIMEOUT_S = 3.0  # human-eval's default per program
WARM_TIMEOUT_S = 120.0
SOAK_SAMPLE_EVERY = 1000


@dataclass(frozen=True, slots=True)
class Sizes:
    """How many of each: `-n NAME=N` overrides one."""

    tiny: int = 1000  # tiny runs per mode (and per fork floor)
    bwrap: int = 300  # raw bwrap runs (~40/s here: the slow floor)
    batch: int = 1000  # generated programs, through the peer and each mode
    latency: int = 200  # timed runs per mode and load
    ds: int = 120  # pandas runs per mode (today's pool: ~3/s here)
    cli: int = 15  # rounds of the whole-process variants
    rounds: int = 5  # rounds the rates are split over
    pause_ms: int = 50  # pause before each spaced run


QUICK = Sizes(tiny=8, bwrap=4, batch=12, latency=4, ds=4, cli=2, rounds=2, pause_ms=5)


@dataclass(frozen=True, slots=True)
class Target:
    """One of the issue's targets: `value <= limit` (or >= when `at_least`)."""

    name: str
    limit: float
    unit: str
    at_least: bool = False


TARGETS = {
    "tiny_c4": Target("tiny runs/s at c=4", 500, "/s", True),
    "batch_ratio": Target("batch runs/s over the peer's", 2.0, "x", True),
    "warm_p50": Target("warm library p50, spaced", 1.0, "ms"),
    "template_rss": Target("idle RSS per template (pool: idle sandbox)", 15.0, "MB"),
    "ds_c4": Target("data_science runs/s at c=4", 200, "/s", True),
    "cli_p50": Target("`codecage run --code 1` whole process p50", 150, "ms"),
}


# --- sandboxes --------------------------------------------------------------------------


def open_sandbox(fork_server: bool, profile: str, pool: bool = True) -> Sandbox | str:
    """A Sandbox of `profile` in this mode (pooled unless `pool` is False), or why the
    mode is n/a here."""
    parameters = inspect.signature(Sandbox).parameters
    if "options" in parameters:  # since the structure issue: Sandbox(options=Options(...))
        try:
            options = codecage.Options(fork_server=fork_server)  # type: ignore[attr-defined]
            return Sandbox(pool=pool, profile=profile, options=options)
        except CodecageError as exc:  # e.g. a backend without a fork server
            if not fork_server:
                raise
            return f"n/a: {exc} {exc.hint or ''}".strip()
    if "fork_server" not in parameters:
        if fork_server:
            return "n/a: Sandbox has no fork_server keyword in this checkout"
        return Sandbox(pool=True, profile=profile)  # today's pool is what False means
    try:
        # through a dict: the keyword exists only in checkouts with the fork server
        mode: dict[str, Any] = {"fork_server": fork_server}
        return Sandbox(pool=pool, profile=profile, **mode)
    except CodecageError as exc:  # e.g. a backend without a fork server
        if not fork_server:
            raise
        return f"n/a: {exc} {exc.hint or ''}".strip()


@contextlib.contextmanager
def sandboxes(profile: str) -> Iterator[dict[str, Sandbox | str]]:
    """One Sandbox per mode (or the reason it is n/a), all warm, closed on the way out."""
    opened = {
        mode: open_sandbox(flag, profile, pool=mode not in UNPOOLED) for mode, flag in MODES.items()
    }
    try:
        settle(opened)
        yield opened
    finally:
        for sandbox in opened.values():
            if isinstance(sandbox, Sandbox):
                sandbox.close()


def settle(opened: dict[str, Sandbox | str]) -> None:
    """Every open pool full again, so that no refill runs during the next timed chunk."""
    for mode, sandbox in opened.items():
        if (
            isinstance(sandbox, Sandbox)
            and sandbox.host.pool is not None
            and not sandbox.warm(WARM_TIMEOUT_S)
        ):
            raise RuntimeError(f"{mode}: pool not ready within {WARM_TIMEOUT_S:g} s")


def checked_run(sandbox: Sandbox, code: str, expected: object) -> str | None:
    """Run `code`; None when it returned `expected`, else what went wrong."""
    r = sandbox.run(code)
    if r.ok and r.return_value == expected:
        return None
    detail = f" {r.error.type}: {r.error.message[:160]}" if r.error else ""
    return f"{r.status}{detail} return_value={r.return_value!r}"


# --- rates ------------------------------------------------------------------------------


@dataclass(slots=True)
class Tally:
    """A variant's runs summed over its rounds."""

    runs: int = 0
    seconds: float = 0.0
    busy_jiffies: int = 0
    total_jiffies: int = 0
    failures: list[str] = dataclasses.field(default_factory=list)

    def row(self) -> dict[str, Any]:
        return {
            "runs": self.runs,
            "seconds": round(self.seconds, 3),
            "runs_per_s": round(self.runs / self.seconds, 1) if self.seconds else None,
            "machine_busy_pct": round(100 * self.busy_jiffies / self.total_jiffies)
            if self.total_jiffies
            else None,
            "failures": len(self.failures),
            "failure_samples": sorted(set(self.failures))[:5],
        }


Work = Callable[[int], str | None]  # item index -> None, or the failure
Chunk = Callable[[int, int, Tally], None]  # (offset, count, tally): items run back to back


def threaded(concurrency: int, count: int, work: Work, tally: Tally, offset: int = 0) -> None:
    """Items offset..offset+count-1 by `concurrency` threads back to back, into `tally`."""
    lock = threading.Lock()
    next_item = offset
    end = offset + count

    def worker() -> None:
        nonlocal next_item
        while True:
            with lock:
                if next_item >= end:
                    return
                item = next_item
                next_item += 1
            try:
                failure = work(item)
            except Exception as exc:  # counted, the phase goes on
                failure = f"{type(exc).__name__}: {exc}"[:300]
            if failure is not None:
                with lock:
                    tally.failures.append(failure)

    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    busy0, total0 = machine_jiffies()
    started = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    tally.seconds += time.perf_counter() - started
    busy1, total1 = machine_jiffies()
    tally.busy_jiffies += busy1 - busy0
    tally.total_jiffies += total1 - total0
    tally.runs += count


def in_rounds(
    variants: dict[str, tuple[int, Chunk]],
    rounds: int,
    before_each: Callable[[], None],
) -> dict[str, Tally]:
    """Each variant `(total, run_chunk)` gets its share of `total` in every round;
    `run_chunk(offset, count, tally)` runs items offset.. back to back."""
    tallies = {name: Tally() for name in variants}
    done = dict.fromkeys(variants, 0)
    for r in range(rounds):
        for name, (total, run_chunk) in variants.items():
            upto = (r + 1) * total // rounds
            if upto > done[name]:
                before_each()
                run_chunk(done[name], upto - done[name], tallies[name])
                done[name] = upto
    return tallies


def fork_once(_: int) -> str | None:
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    return None if status == 0 else f"wait status {status}"


# The fork floor in a bare interpreter (`python -I -S`, a few MB): what forking costs a small
# template, not this host process (tens of MB and a pool's threads: floor_fork_host, the
# peer's own floor). It times itself, so its start-up is not counted.
FORK_LOOP = """
import os, sys, threading, time
count, workers = int(sys.argv[1]), int(sys.argv[2])
def worker(n):
    for _ in range(n):
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        os.waitpid(pid, 0)
threads = [threading.Thread(target=worker, args=((count + i) // workers,)) for i in range(workers)]
started = time.perf_counter()
for t in threads: t.start()
for t in threads: t.join()
print(time.perf_counter() - started)
"""


def run_timed_loop(argv: list[str], count: int, tally: Tally) -> None:
    """Run a loop script that times itself (it prints its seconds: its start-up is not
    counted) and add its `count` runs to `tally`."""
    busy0, total0 = machine_jiffies()
    p = subprocess.run(argv, capture_output=True, text=True, cwd="/", env={}, check=False)
    busy1, total1 = machine_jiffies()
    if p.returncode != 0:
        tally.failures.append(f"exit {p.returncode}: {p.stderr[-200:]!r}")
        return
    tally.seconds += float(p.stdout)
    tally.busy_jiffies += busy1 - busy0
    tally.total_jiffies += total1 - total0
    tally.runs += count


def bare_fork_chunk(offset: int, count: int, tally: Tally) -> None:
    argv = [_python(), "-I", "-S", "-c", FORK_LOOP, str(count), str(CONCURRENCY)]
    run_timed_loop(argv, count, tally)


def argv_once(argv: list[str]) -> Work:
    def go(_: int) -> str | None:
        p = subprocess.run(argv, capture_output=True, cwd="/", env={"PATH": os.defpath})
        return None if p.returncode == 0 else f"exit {p.returncode}: {p.stderr[-200:]!r}"

    return go


def sandbox_chunk(sandbox: Sandbox, code: str, expected: object) -> Chunk:
    def chunk(offset: int, count: int, tally: Tally) -> None:
        threaded(CONCURRENCY, count, lambda _: checked_run(sandbox, code, expected), tally, offset)

    return chunk


def work_chunk(work: Work) -> Chunk:
    def chunk(offset: int, count: int, tally: Tally) -> None:
        threaded(CONCURRENCY, count, work, tally, offset)

    return chunk


def measure_rates(
    profile: str,
    code: str,
    expected: object,
    count: int,
    sizes: Sizes,
    floors: dict[str, tuple[int, Chunk]],
) -> dict[str, Any]:
    """`code` at c=4 through each mode's Sandbox.run, with `floors` in the same rounds."""
    with sandboxes(profile) as opened:
        variants = {
            mode: (count, sandbox_chunk(sandbox, code, expected))
            for mode, sandbox in opened.items()
            if isinstance(sandbox, Sandbox)
        }
        variants |= floors
        tallies = in_rounds(variants, sizes.rounds, lambda: settle(opened))
        rows: dict[str, Any] = {name: t.row() for name, t in tallies.items()}
        rows |= {mode: {"n/a": s} for mode, s in opened.items() if isinstance(s, str)}
    return rows


# The kernel's part of one forked run, without codecage: in a bwrap sandbox that keeps
# CAP_SYS_ADMIN (as a template does), fork; unshare pid, mount, ipc, uts and net namespaces;
# make the mounts private; a tmpfs /tmp; fork PID 1, which mounts its /proc; exit; reap.
NAMESPACE_LOOP = """
import ctypes, os, sys, threading, time
libc = ctypes.CDLL(None, use_errno=True)
count, workers = int(sys.argv[1]), int(sys.argv[2])
def mount(src, dst, fs, flags, data=None):
    if libc.mount(src, dst, fs, ctypes.c_ulong(flags), data) != 0:
        os._exit(3)
def one():
    pid = os.fork()
    if pid == 0:
        if libc.unshare(0x20000000 | 0x00020000 | 0x08000000 | 0x04000000 | 0x40000000):
            os._exit(2)
        mount(None, b"/", None, 0x4000 | 0x40000)
        mount(b"tmpfs", b"/tmp", b"tmpfs", 0x6, b"size=1m,mode=1777")
        init = os.fork()
        if init == 0:
            mount(b"proc", b"/proc", b"proc", 0xF)
            os._exit(0)
        os._exit(os.waitstatus_to_exitcode(os.waitpid(init, 0)[1]))
    if os.waitpid(pid, 0)[1] != 0:
        os._exit(9)  # not SystemExit: in a thread it would end the thread, not the loop
def worker(n):
    for _ in range(n):
        one()
threads = [threading.Thread(target=worker, args=((count + i) // workers,)) for i in range(workers)]
started = time.perf_counter()
for t in threads: t.start()
for t in threads: t.join()
print(time.perf_counter() - started)
"""


def namespace_chunk(offset: int, count: int, tally: Tally) -> None:
    """NAMESPACE_LOOP in a bwrap sandbox with a template's powers (root only)."""
    powers = ["--cap-drop", "ALL", "--cap-add", "CAP_SYS_ADMIN"]
    # As a template runs: the sandbox's host ids, not root (so the system's python3, which
    # those ids can read).
    ids = identities.plan().identity
    become = ["setpriv", f"--reuid={ids.uid}", f"--regid={ids.gid}", "--clear-groups"]
    argv = [
        *become,
        "bwrap", "--unshare-user", "--unshare-pid", "--unshare-net", "--uid", "1000", *powers,
        "--ro-bind", "/", "/", "--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp",
        "/usr/bin/python3", "-I", "-S", "-c", NAMESPACE_LOOP, str(count), str(CONCURRENCY),
    ]  # fmt: skip
    run_timed_loop(argv, count, tally)


def measure_tiny(sizes: Sizes) -> dict[str, Any]:
    floors = {
        "floor_fork": (sizes.tiny, bare_fork_chunk),
        **({"floor_namespaces": (sizes.tiny, namespace_chunk)} if os.geteuid() == 0 else {}),
        "floor_fork_host": (sizes.tiny, work_chunk(fork_once)),
        "floor_raw_bwrap": (sizes.bwrap, work_chunk(argv_once(_raw_bwrap_argv(TINY)))),
    }
    return measure_rates("basic", TINY, 1, sizes.tiny, sizes, floors)


def measure_data_science(sizes: Sizes) -> dict[str, Any]:
    return measure_rates("data_science", PANDAS, 1, sizes.ds, sizes, {})


# --- the peer: an evaluation harness's fork-per-test executor -----------------------------


class PeerTimeout(Exception):
    pass


@contextlib.contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    def expire(signum: int, frame: FrameType | None) -> None:
        raise PeerTimeout("timed out")

    signal.setitimer(signal.ITIMER_REAL, seconds)
    signal.signal(signal.SIGALRM, expire)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)


@contextlib.contextmanager
def swallow_io() -> Iterator[None]:
    sink = io.StringIO()
    with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
        old_stdin, sys.stdin = sys.stdin, io.StringIO()
        try:
            yield
        finally:
            sys.stdin = old_stdin


def reliability_guard() -> None:
    """What human-eval's guard does: switch off destructive functions in this (the child)
    interpreter. Not isolation: any program can get them back (ctypes, importlib.reload)."""
    faulthandler.disable()
    builtins.exit = None  # type: ignore[assignment]
    builtins.quit = None  # type: ignore[assignment]
    builtins.help = None  # type: ignore[assignment]
    os.environ["OMP_NUM_THREADS"] = "1"
    for name in (
        "kill", "system", "putenv", "remove", "removedirs", "rmdir", "fchdir", "setuid",
        "fork", "forkpty", "killpg", "rename", "renames", "truncate", "replace", "unlink",
        "fchmod", "fchown", "chmod", "chown", "chroot", "lchown", "getcwd", "chdir",
    ):  # fmt: skip
        setattr(os, name, None)
    for name in ("rmtree", "move", "chown"):
        setattr(shutil, name, None)
    subprocess.Popen = None  # type: ignore[assignment,misc]
    for module in ("ipdb", "joblib", "resource", "psutil", "tkinter"):
        sys.modules[module] = None  # type: ignore[assignment]


def peer_child(program: str, timeout_s: float, conn: Connection) -> None:
    # The guard takes these away; the clean-up needs them back, as human-eval restores them.
    kept = {name: getattr(os, name) for name in ("chdir", "rmdir", "unlink")}
    rmtree = shutil.rmtree
    workdir = tempfile.mkdtemp(prefix="peer-")
    os.chdir(workdir)
    reliability_guard()
    try:
        with swallow_io(), time_limit(timeout_s):
            exec(program, {"__name__": "__main__"})
        outcome = "passed"
    except PeerTimeout:
        outcome = "timed out"
    except BaseException as exc:
        outcome = f"failed: {type(exc).__name__}"
    conn.send(outcome)
    for name, fn in kept.items():
        setattr(os, name, fn)
    os.chdir("/")
    rmtree(workdir)


def peer_check(program: str, timeout_s: float = PEER_TIMEOUT_S) -> str:
    """One program in a forked child, as human-eval's check_correctness does. The outcome
    is read from the pipe, not from the child's state: with callers in 4 threads, one
    thread's `Process.start` reaps the others' children (multiprocessing's `_cleanup`), so
    `join`/`is_alive` may see a finished child as running (human-eval has the same race)."""
    ctx = multiprocessing.get_context("fork")
    receive, send = ctx.Pipe(duplex=False)
    child = ctx.Process(target=peer_child, args=(program, timeout_s, send))
    child.start()
    send.close()
    try:
        outcome = receive.recv() if receive.poll(timeout_s + 1) else "timed out"
    except EOFError:  # died without a word (a crash, os._exit)
        outcome = "failed: no outcome"
    finally:
        receive.close()
    if outcome == "timed out":
        child.kill()
    child.join()
    return str(outcome)


# --- the batch --------------------------------------------------------------------------

TEMPLATES: tuple[tuple[str, str, Callable[[int, int], object]], ...] = (
    ("def f(xs):\n    return sum(x * x for x in xs)\n", "f([{a}, {b}])",
     lambda a, b: a * a + b * b),
    ("def f(s):\n    return s[::-1]\n", "f('{a}x{b}')", lambda a, b: f"{a}x{b}"[::-1]),
    ("def f(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n",
     "f({a} % 20)", lambda a, b: fib(a % 20)),
    ("def f(n):\n    return n > 1 and all(n % d for d in range(2, int(n ** 0.5) + 1))\n",
     "f({a} + {b})", lambda a, b: is_prime(a + b)),
)  # fmt: skip


def fib(n: int) -> int:
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a


def is_prime(n: int) -> bool:
    return n > 1 and all(n % d for d in range(2, int(n**0.5) + 1))


@dataclass(frozen=True, slots=True)
class Program:
    source: str
    passes: bool  # what it was generated to do


def wrong(value: object) -> object:
    """A different value of the same type: the assert that fails on purpose."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value * 2 + 1
    return f"{value}!"


def generate(count: int) -> list[Program]:
    """`count` programs: a function and 3 asserts on it; every 10th has a wrong one."""
    programs = []
    for i in range(count):
        body, call, expect = TEMPLATES[i % len(TEMPLATES)]
        asserts = []
        for k in range(3):
            a, b = i + k, 3 * i + 7 * k
            want = expect(a, b)
            if i % 10 == 9 and k == 2:
                want = wrong(want)
            asserts.append(f"assert {call.format(a=a, b=b)} == {want!r}\n")
        programs.append(Program(body + "".join(asserts), passes=i % 10 != 9))
    return programs


def codecage_outcome(result: Any) -> str:
    """ "passed", "timed out" or "failed: ..." of an `ExecutionResult`, or of a `BatchResult`
    (what `run_many` returns: the result, or the error that kept the item from running)."""
    if hasattr(result, "index") and hasattr(result, "result"):  # a BatchResult
        if result.result is None:
            return f"not run: {result.error}"[:200]
        result = result.result
    if result.ok:
        return "passed"
    if result.status == "timeout":
        return "timed out"
    return f"failed: {result.error.type if result.error else result.status}"


def batch_chunk(
    sandbox: Sandbox, programs: Sequence[Program], outcomes: list[str]
) -> tuple[Chunk, str]:
    """Run programs[offset:offset+count] on `sandbox` at c=4, outcomes in order."""
    run_many = getattr(sandbox, "run_many", None)

    def by_run_many(offset: int, count: int, tally: Tally) -> None:
        assert run_many is not None
        sources = [p.source for p in programs[offset : offset + count]]
        busy0, total0 = machine_jiffies()
        started = time.perf_counter()
        results = run_many(sources, concurrency=CONCURRENCY)
        tally.seconds += time.perf_counter() - started
        busy1, total1 = machine_jiffies()
        tally.busy_jiffies += busy1 - busy0
        tally.total_jiffies += total1 - total0
        tally.runs += count
        for i, r in enumerate(results):
            outcomes[offset + i] = codecage_outcome(r)
            if outcomes[offset + i].startswith("not run"):
                tally.failures.append(outcomes[offset + i])

    def one(i: int) -> None:
        outcomes[i] = codecage_outcome(sandbox.run(programs[i].source))

    def by_threads(offset: int, count: int, tally: Tally) -> None:
        threaded(CONCURRENCY, count, lambda i: one(i), tally, offset)

    if run_many is not None:
        return by_run_many, "run_many"
    return by_threads, "threads"


def measure_batch(sizes: Sizes) -> dict[str, Any]:
    """The batch through the peer and each mode, interleaved in rounds; agreement."""
    programs = generate(sizes.batch)
    outcomes: dict[str, list[str]] = {"peer": [""] * len(programs)}

    def peer_one(i: int) -> None:
        outcomes["peer"][i] = peer_check(programs[i].source)

    with sandboxes("basic") as opened:
        variants: dict[str, tuple[int, Chunk]] = {
            "peer": (len(programs), work_chunk(lambda i: peer_one(i)))
        }
        via: dict[str, str] = {"peer": "4 threads, a forked process per program"}
        for mode, sandbox in opened.items():
            if isinstance(sandbox, Sandbox):
                outcomes[mode] = [""] * len(programs)
                chunk, via[mode] = batch_chunk(sandbox, programs, outcomes[mode])
                variants[mode] = (len(programs), chunk)
        tallies = in_rounds(variants, sizes.rounds, lambda: settle(opened))
        rows: dict[str, Any] = {}
        for name, tally in tallies.items():
            got = outcomes[name]
            passed = [o == "passed" for o in got]
            rows[name] = {
                **tally.row(),
                "via": via[name],
                "passed": sum(passed),
                "failed": len(passed) - sum(passed),
                "unexpected": sum(p != q.passes for p, q in zip(passed, programs, strict=True)),
                "outcome_samples": sorted(set(got))[:6],
            }
        rows |= {mode: {"n/a": s} for mode, s in opened.items() if isinstance(s, str)}
    peer_passed = [o == "passed" for o in outcomes["peer"]]
    for mode in MODES:
        if mode in tallies:
            mine = [o == "passed" for o in outcomes[mode]]
            rows[mode]["disagree_with_peer"] = sum(
                a != b for a, b in zip(mine, peer_passed, strict=True)
            )
            peer_rate, rate = rows["peer"]["runs_per_s"], rows[mode]["runs_per_s"]
            rows[mode]["over_peer"] = round(rate / peer_rate, 2) if peer_rate and rate else None
    return {
        "programs": len(programs),
        "generated_to_fail": sum(not p.passes for p in programs),
        "rows": rows,
    }


# --- latency ----------------------------------------------------------------------------


def latency_stats(values: list[float]) -> dict[str, Any]:
    return {
        "n": len(values),
        "p50_ms": round(statistics.median(values), 3),
        "p95_ms": round(percentile(values, 0.95), 3),
        "p99_ms": round(percentile(values, 0.99), 3),
        "max_ms": round(max(values), 3),
    }


def measure_latency(sizes: Sizes) -> dict[str, Any]:
    """Per mode: spaced runs (pool ready, a pause, then the run) and back-to-back runs
    (chunks of one caller's consecutive runs), the modes interleaved; and `defaults`,
    a `Sandbox()` with every default (profile `standard`, no pool asked for: whatever the
    checkout does then). `caller_cpu` is the CPU of the caller's thread during the call
    (the host's work on the run's path; background threads' not included)."""
    rows: dict[str, Any] = {}
    with sandboxes("basic") as opened, Sandbox() as defaults:
        live = {m: s for m, s in opened.items() if isinstance(s, Sandbox)}
        live["defaults"] = defaults
        spaced: dict[str, list[float]] = {m: [] for m in live}
        b2b: dict[str, list[float]] = {m: [] for m in live}
        cpu: dict[str, list[float]] = {m: [] for m in live}
        failures: dict[str, list[str]] = {m: [] for m in live}
        checked_run(defaults, TINY, 1)  # its template started: not in the first timed run

        def timed(mode: str, into: list[float], cpu_into: list[float] | None = None) -> None:
            started, cpu_started = time.perf_counter(), time.thread_time()
            failure = checked_run(live[mode], TINY, 1)
            into.append((time.perf_counter() - started) * 1000)
            if cpu_into is not None:
                cpu_into.append((time.thread_time() - cpu_started) * 1000)
            if failure:
                failures[mode].append(failure)

        for _ in range(sizes.latency):
            for mode, sandbox in live.items():
                sandbox.warm(WARM_TIMEOUT_S)
                time.sleep(sizes.pause_ms / 1000)
                timed(mode, spaced[mode], cpu[mode])
        per_round = max(1, sizes.latency // sizes.rounds)
        for _ in range(sizes.rounds):
            for mode in live:
                settle(opened)
                for _ in range(per_round):
                    timed(mode, b2b[mode])
        for mode in live:
            rows[mode] = {
                "spaced": latency_stats(spaced[mode]),
                "caller_cpu_spaced": latency_stats(cpu[mode]),
                "back_to_back": latency_stats(b2b[mode]),
                "failures": len(failures[mode]),
                "failure_samples": sorted(set(failures[mode]))[:5],
            }
        rows |= {mode: {"n/a": s} for mode, s in opened.items() if isinstance(s, str)}
    return rows


# --- the CLI as a whole process -----------------------------------------------------------


def measure_cli(sizes: Sizes) -> dict[str, Any]:
    """Whole processes, interleaved in rounds (one untimed call of each first)."""
    src = str(ROOT / "src")
    env = {**os.environ, "PYTHONPATH": src}  # the user's environment, this checkout's code
    python = sys.executable
    import_codecage = f"import sys; sys.path.insert(0, {src!r}); import codecage"
    variants = {
        "codecage_run": [str(ROOT / ".venv" / "bin" / "codecage"), "run", "--code", "1"],
        "python3_c_1": [python, "-c", "1"],
        "python3_import_codecage": [python, "-I", "-c", import_codecage],
        "raw_bwrap_python": _raw_bwrap_argv(TINY),
    }
    samples: dict[str, list[float]] = {name: [] for name in variants}
    for i in range(sizes.cli + 1):
        for name, argv in variants.items():
            started = time.perf_counter()
            p = subprocess.run(argv, capture_output=True, cwd="/", env=env, check=False)
            elapsed = (time.perf_counter() - started) * 1000
            if p.returncode != 0:
                raise RuntimeError(f"{name} exited {p.returncode}: {p.stderr[-400:]!r}")
            if i:  # the first round warms caches (self-test, page cache)
                samples[name].append(elapsed)
    p50 = {name: statistics.median(v) for name, v in samples.items()}
    return {
        name: {
            "n": len(v),
            "p50_ms": round(p50[name], 1),
            "p95_ms": round(percentile(v, 0.95), 1),
            "over_raw_bwrap": round(p50[name] / p50["raw_bwrap_python"], 2),
            "over_python3_c_1": round(p50[name] / p50["python3_c_1"], 2),
        }
        for name, v in samples.items()
    }


# --- memory -----------------------------------------------------------------------------


def rss_mb(pid: int | str = "self") -> float:
    for line in Path(f"/proc/{pid}/status").read_text(encoding="utf-8").splitlines():
        if line.startswith("VmRSS:"):
            return round(int(line.split()[1]) / 1024, 1)
    return 0.0


def pss_mb(pid: int) -> float | None:
    try:
        text = Path(f"/proc/{pid}/smaps_rollup").read_text(encoding="utf-8")
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("Pss:"):
            return round(int(line.split()[1]) / 1024, 1)
    return None


def descendants(pid: int) -> list[int]:
    """Every process below `pid`, parents before children."""
    found: list[int] = []
    queue = [pid]
    while queue:
        parent = queue.pop(0)
        for task in Path(f"/proc/{parent}/task").glob("*"):
            try:
                kids = [int(k) for k in (task / "children").read_text().split()]
            except OSError:
                continue
            found += kids
            queue += kids
    return found


def template_memory(sandbox: Sandbox) -> list[dict[str, Any]]:
    """RSS/PSS of each fork-server template of `sandbox` (its bwrap processes and the
    template's interpreter), as `info` reports them."""
    state = sandbox.info().pool
    fork_server = state.fork_server if state is not None else None
    if fork_server is None:
        return []
    return [t.model_dump() for t in fork_server.templates]


def measure_memory() -> dict[str, Any]:
    """Per mode, with its basic pool full: this process's RSS, an idle pooled sandbox's
    RSS/PSS (as the pool reports them), the templates' RSS/PSS."""
    rows: dict[str, Any] = {"host_rss_mb_before": rss_mb()}
    for mode, flag in MODES.items():
        sandbox = open_sandbox(flag, "basic", pool=mode not in UNPOOLED)
        if isinstance(sandbox, str):
            rows[mode] = {"n/a": sandbox}
            continue
        with sandbox:
            settle({mode: sandbox})
            state = sandbox.info().pool
            key = state.keys[0] if state is not None and state.keys else None
            rows[mode] = {
                "host_rss_mb": rss_mb(),
                "idle_sandboxes": key.idle if key else None,
                "idle_rss_mb": key.idle_rss_mb if key else None,
                "idle_pss_mb": key.idle_pss_mb if key else None,
                # today's pooled sandboxes would match too: only the fork server has templates
                "templates": template_memory(sandbox) if flag else None,
            }
    return rows


# --- soak -------------------------------------------------------------------------------


def measure_soak(runs: int, mode: str | None) -> dict[str, Any]:
    """`runs` tiny runs back to back at c=4; this process's RSS every 1,000 runs; leaks."""
    if mode is None:
        has_fork_server = "fork_server" in inspect.signature(Sandbox).parameters
        mode = "fork_server" if has_fork_server else "pool"
    before = leak_counts()
    sandbox = open_sandbox(MODES[mode], "basic", pool=mode not in UNPOOLED)
    if isinstance(sandbox, str):
        return {"mode": mode, "n/a": sandbox}
    samples: list[dict[str, Any]] = []
    lock = threading.Lock()
    done = 0
    tally = Tally()
    started = time.perf_counter()

    def work(_: int) -> str | None:
        nonlocal done
        failure = checked_run(sandbox, TINY, 1)
        with lock:
            done += 1
            if done % SOAK_SAMPLE_EVERY == 0:
                at = round(time.perf_counter() - started, 1)
                samples.append({"runs": done, "host_rss_mb": rss_mb(), "seconds": at})
                if done % (10 * SOAK_SAMPLE_EVERY) == 0:
                    print(f"  soak: {done} runs, rss {rss_mb()} MB", file=sys.stderr)
        return failure

    with sandbox:
        settle({mode: sandbox})
        samples.append({"runs": 0, "host_rss_mb": rss_mb(), "seconds": 0.0})
        threaded(CONCURRENCY, runs, work, tally)
        if done % SOAK_SAMPLE_EVERY:
            at = round(time.perf_counter() - started, 1)
            samples.append({"runs": done, "host_rss_mb": rss_mb(), "seconds": at})
    after = leak_counts()
    own_dirs = [
        p.name for p in workspaces.private_parent().glob(f"{RUN_DIR_PREFIX}{os.getpid()}-*")
    ]
    rss = [s["host_rss_mb"] for s in samples]
    return {
        "mode": mode,
        **tally.row(),
        "rss_samples": samples,
        "rss_first_last_max_mb": [rss[0], rss[-1], max(rss)] if rss else None,
        "leak_counts_before": before,
        "leak_counts_after": after,
        "leaked": leaked(before, after),
        "own_run_dirs_left": own_dirs,
    }


# --- report -----------------------------------------------------------------------------


def _rate(row: dict[str, Any] | None) -> float | None:
    return None if row is None or "n/a" in row else row.get("runs_per_s")


def evaluate(report: dict[str, Any]) -> list[dict[str, Any]]:
    """The issue's targets, one row per mode (None = not measured or n/a)."""

    def per_mode(mode: str) -> dict[str, float | None]:
        tiny, ds = report.get("tiny") or {}, report.get("data_science") or {}
        batch = (report.get("batch") or {}).get("rows", {})
        lat = (report.get("latency") or {}).get(mode, {})
        mem = (report.get("memory") or {}).get(mode, {})
        templates = mem.get("templates") or []
        return {
            "tiny_c4": _rate(tiny.get(mode)),
            "batch_ratio": batch.get(mode, {}).get("over_peer"),
            "warm_p50": lat["spaced"]["p50_ms"] if "spaced" in lat else None,
            # pool mode has no template: its idle sandbox is what stays in memory
            "template_rss": max(t["rss_mb"] for t in templates)
            if templates
            else mem.get("idle_rss_mb")
            if mode == "pool"
            else None,
            "ds_c4": _rate(ds.get(mode)),
        }

    cli = report.get("cli") or {}
    whole = {"cli_p50": cli["codecage_run"]["p50_ms"] if "codecage_run" in cli else None}
    rows = []
    modes = (*MODES, "defaults")  # defaults: `Sandbox()`, measured by `latency` only
    for mode, measured in [*((m, per_mode(m)) for m in modes), ("either", whole)]:
        for key, value in measured.items():
            target = TARGETS[key]
            met = None
            if value is not None:
                met = value >= target.limit if target.at_least else value <= target.limit
            rows.append(
                {
                    "mode": mode,
                    "target": target.name,
                    "limit": target.limit,
                    "unit": target.unit,
                    "at_least": target.at_least,
                    "measured": value,
                    "met": met,
                }
            )
    return rows


def problems(report: dict[str, Any]) -> list[str]:
    found: list[str] = []
    for section in ("tiny", "data_science"):
        for name, row in (report.get(section) or {}).items():
            if row.get("failures"):
                found.append(f"{section} {name}: {row['failures']} failed runs")
    for name, row in (report.get("batch") or {}).get("rows", {}).items():
        if row.get("unexpected"):
            found.append(f"batch {name}: {row['unexpected']} programs not as generated")
        if row.get("disagree_with_peer"):
            found.append(f"batch {name}: disagrees with the peer on {row['disagree_with_peer']}")
    for mode, row in (report.get("latency") or {}).items():
        if row.get("failures"):
            found.append(f"latency {mode}: {row['failures']} failed runs")
    soak = report.get("soak")
    if soak and "n/a" not in soak:
        if soak["failures"]:
            found.append(f"soak: {soak['failures']} failed runs")
        if soak["leaked"] or soak["own_run_dirs_left"]:
            found.append(f"soak: left {soak['leaked']}, run dirs {soak['own_run_dirs_left']}")
    return found


def _f(value: object, spec: str = ".1f") -> str:
    if value is None:
        return "-"
    return format(value, spec) if isinstance(value, float | int) else str(value)


def render_rates(
    name: str, note: str, rows: dict[str, Any], extra: Callable[[dict[str, Any]], str]
) -> list[str]:
    out = [
        f"== {name} == ({note})",
        f"{'variant':<18}{'runs':>6}{'sec':>8}{'runs/s':>9}{'busy':>6}{'fail':>6}",
    ]
    for variant, r in rows.items():
        if "n/a" in r:
            out.append(f"{variant:<18}{r['n/a']}")
            continue
        out.append(
            f"{variant:<18}{r['runs']:>6}{r['seconds']:>8.2f}{_f(r['runs_per_s']):>9}"
            f"{_f(r['machine_busy_pct'], 'd'):>5}%{r['failures']:>6}  {extra(r)}"
        )
        out += [f"      failure: {f}" for f in r["failure_samples"]]
    return out


def render(report: dict[str, Any]) -> str:
    out: list[str] = []
    if report.get("tiny"):
        tiny = report["tiny"]
        fork = _rate(tiny.get("floor_fork"))
        bw = _rate(tiny.get("floor_raw_bwrap"))

        def floors(r: dict[str, Any]) -> str:
            rate = r["runs_per_s"]
            if not rate:
                return ""
            parts = [f"{rate / f:.3f}x {n}" for n, f in (("fork", fork), ("raw bwrap", bw)) if f]
            return ", ".join(parts)

        out += render_rates(
            "tiny", f"`{TINY}`, c={CONCURRENCY}, back to back; ratio to the floors", tiny, floors
        )
    if report.get("batch"):
        batch = report["batch"]

        def agree(r: dict[str, Any]) -> str:
            ratio = f"{r['over_peer']:.2f}x peer, " if r.get("over_peer") else ""
            disagree = f", disagree {r['disagree_with_peer']}" if "disagree_with_peer" in r else ""
            return f"{ratio}pass {r['passed']} fail {r['failed']}{disagree} ({r['via']})"

        title = (
            f"{batch['programs']} programs + 3 asserts each,"
            f" {batch['generated_to_fail']} fail on purpose; c={CONCURRENCY}"
        )
        out += render_rates("batch", title, batch["rows"], agree)
    if report.get("latency"):
        out.append("== latency == (warm `1`, ms; spaced: pool ready + pause before each)")
        out.append(f"{'mode':<14}{'load':<14}{'n':>5}{'p50':>9}{'p95':>9}{'p99':>9}{'max':>9}")
        for mode, row in report["latency"].items():
            if "n/a" in row:
                out.append(f"{mode:<14}{row['n/a']}")
                continue
            for load in ("spaced", "caller_cpu_spaced", "back_to_back"):
                s = row[load]
                out.append(
                    f"{mode:<14}{load:<14}{s['n']:>5}{s['p50_ms']:>9.3f}{s['p95_ms']:>9.3f}"
                    f"{s['p99_ms']:>9.3f}{s['max_ms']:>9.3f}"
                )
    if report.get("data_science"):
        out += render_rates(
            "data_science", f"pandas, c={CONCURRENCY}", report["data_science"], lambda r: ""
        )
    if report.get("cli"):
        out.append("== cli == (whole process, ms, interleaved rounds)")
        out.append(f"{'variant':<26}{'n':>4}{'p50':>9}{'p95':>9}  ratio of p50s")
        for name, r in report["cli"].items():
            out.append(
                f"{name:<26}{r['n']:>4}{r['p50_ms']:>9.1f}{r['p95_ms']:>9.1f}"
                f"  {r['over_raw_bwrap']:.2f}x raw bwrap, {r['over_python3_c_1']:.2f}x python3 -c 1"
            )
    if report.get("memory"):
        mem = report["memory"]
        out.append(
            f"== memory == (MB; this process before any sandbox: {mem['host_rss_mb_before']})"
        )
        out.append(
            f"{'mode':<14}{'host rss':>10}{'idle':>6}{'idle rss':>10}{'idle pss':>10}"
            "  templates (rss/pss)"
        )
        for mode in MODES:
            r = mem.get(mode, {})
            if "n/a" in r:
                out.append(f"{mode:<14}{r['n/a']}")
                continue
            found = r["templates"]
            templates = (
                "-"
                if found is None
                else "none found"
                if not found
                else ", ".join(f"{t['rss_mb']}/{t['pss_mb']}" for t in found)
            )
            out.append(
                f"{mode:<14}{_f(r['host_rss_mb']):>10}{_f(r['idle_sandboxes']):>6}"
                f"{_f(r['idle_rss_mb']):>10}{_f(r['idle_pss_mb']):>10}  {templates}"
            )
    soak = report.get("soak")
    if soak:
        out.append(f"== soak == ({soak['mode']}, `{TINY}`, c={CONCURRENCY}, back to back)")
        if "n/a" in soak:
            out.append(soak["n/a"])
        else:
            out.append(
                f"{soak['runs']} runs in {soak['seconds']:.1f} s = {_f(soak['runs_per_s'])}/s,"
                f" {soak['failures']} failed; host rss first/last/max"
                f" {soak['rss_first_last_max_mb']} MB"
            )
            out.append(
                f"left behind: {soak['leaked'] or 'nothing'}; own run dirs"
                f" {soak['own_run_dirs_left'] or 'none'}"
            )
    out.append("== targets == (the issue's)")
    for t in report["targets"]:
        op = ">=" if t["at_least"] else "<="
        verdict = {True: "met", False: "NOT MET", None: "not measured / n/a"}[t["met"]]
        limit = f"{op} {t['limit']:g} {t['unit']}"
        out.append(
            f"{t['mode']:<12}{t['target']:<44}{limit:<10}"
            f" measured {_f(t['measured'], '.2f'):>8}  {verdict}"
        )
    out.append("== problems == (failed runs, disagreements, leaks)")
    out += report["problems"] or ["none"]
    return "\n".join(out)


# --- main -------------------------------------------------------------------------------


def _parse_sizes(base: Sizes, overrides: list[str]) -> Sizes:
    fields = {f.name for f in dataclasses.fields(Sizes)}
    changes: dict[str, int] = {}
    for item in overrides:
        name, _, value = item.partition("=")
        if name not in fields or not value.isdigit() or int(value) < 1:
            raise SystemExit(
                f"-n {item!r}: expected NAME=N with N >= 1, NAME one of {sorted(fields)}"
            )
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
        epilog=f"sizes (-n NAME=N): {dataclasses.asdict(Sizes())};"
        f" --quick: {dataclasses.asdict(QUICK)}",
    )
    parser.add_argument("--quick", action="store_true", help="tiny sizes (the test suite)")
    parser.add_argument(
        "--save", action="store_true", help="write JSON and text to benchmarks/results/"
    )
    parser.add_argument(
        "-n", action="append", default=[], metavar="NAME=N", help="override one size"
    )
    parser.add_argument("--only", metavar="SECTION[,SECTION]", help=", ".join(SECTIONS))
    parser.add_argument(
        "--soak",
        type=int,
        default=0,
        metavar="N",
        help="N tiny runs at c=4 after the sections (default 0: off)",
    )
    parser.add_argument(
        "--soak-mode",
        choices=list(MODES),
        help="the mode the soak runs on (default: fork_server where it exists, else pool)",
    )
    args = parser.parse_args(argv)
    sizes = _parse_sizes(QUICK if args.quick else Sizes(), args.n)
    sections = _parse_sections(args.only)
    if args.soak < 0:
        raise SystemExit(f"--soak {args.soak}: expected 0 (off) or a number of runs")

    report: dict[str, Any] = {
        **environment(),
        "bench": "throughput",
        "parameters": {
            "quick": args.quick,
            "sections": sections,
            "sizes": dataclasses.asdict(sizes),
            "concurrency": CONCURRENCY,
            "tiny": TINY,
            "pandas": PANDAS,
            "peer_timeout_s": PEER_TIMEOUT_S,
            "soak": args.soak,
            "soak_mode": args.soak_mode,
        },
    }
    started = time.perf_counter()
    measures: dict[str, Callable[[Sizes], dict[str, Any]]] = {
        "tiny": measure_tiny,
        "batch": measure_batch,
        "latency": measure_latency,
        "data_science": measure_data_science,
        "cli": measure_cli,
        "memory": lambda _: measure_memory(),
    }
    for section in SECTIONS:
        report[section] = None
        if section in sections:
            print(f"{section}: {dataclasses.asdict(sizes)}", file=sys.stderr)
            report[section] = measures[section](sizes)
    report["soak"] = None
    if args.soak:
        print(f"soak: {args.soak} runs", file=sys.stderr)
        report["soak"] = measure_soak(args.soak, args.soak_mode)
    report["targets"] = evaluate(report)
    report["problems"] = problems(report)
    report["loadavg_at_end"] = [round(v, 2) for v in os.getloadavg()]
    report["bench_seconds"] = round(time.perf_counter() - started, 1)
    text = render(report)
    footer = (
        f"\nsections run: {', '.join(sections)}; {report['bench_seconds']} s; load average"
        f" {report['loadavg_at_start']} -> {report['loadavg_at_end']}"
    )
    print(text + footer)
    if args.save:
        out = ROOT / "benchmarks" / "results"
        out.mkdir(exist_ok=True)
        stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
        path = out / f"throughput-{stamp}.json"
        path.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
        path.with_suffix(".txt").write_text(text + footer + "\n", encoding="utf-8")
        print(f"wrote {path.relative_to(ROOT)} and .txt", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
