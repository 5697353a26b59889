"""How long does one whole `codecage run --code 1` process take, next to its floors?

Measures in ONE run, interleaved so that machine drift hits every variant alike:

    python_pass       the host interpreter, `python -c pass`, as a whole process
    import_codecage   `python -c "import codecage"`: the library's package
    stdlib_client     `python -c "import json, socket, http.client"`: the floor of a thin
                      client that would hand its run to a running server
    import_cli        `python -c "import codecage.cli"`: the CLI's package
    codecage_run      `codecage run --code 1` (the installed entry point), as a whole process,
                      in-process (CODECAGE_HANDOFF=0)
    codecage_json     the same with --json
    codecage_run_handoff   `codecage run --code 1` handed to the local server (cli/handoff.py)
    codecage_json_handoff  the same with --json
    serve_initialize  `codecage serve` (stdio) started, an MCP `initialize` written at once:
                      the time until its answer is read (then stdin closes and the server's
                      exit is waited for, outside the timing); its CPU column is the whole
                      process's, exit included

Each measurement is spaced from the one before (--gap, 0.2 s by default) so that one
process's teardown does not run into the next one's start.

The code measured is this checkout's (`src/` goes first on PYTHONPATH), run with the
caller's environment, so as root it is the CLI as it runs by default. For the hand-off rows
a local server is started first (`codecage session start-server`, in a runtime directory
of the bench's own, with an audit store there: CODECAGE_AUDIT) and stopped at the end; the
in-process rows run in the same environment (so they record their runs too) with the
hand-off off, and the server's log is checked to hold
one hand-off per hand-off run. With several --src trees, the hand-off rows are the first
tree's. Prints the load average before and after, a table of p50/p90 and the ratio of each
p50 to python_pass; writes nothing.

--phases runs `codecage run --code 1` in this process instead, n times each in a fresh
interpreter, with a timer around each step of the run (config load, self-test verdict,
guardian, sandbox start, ...), and prints the median of each step.

    .venv/bin/python benchmarks/bench_cli_startup.py          # n=20
    .venv/bin/python benchmarks/bench_cli_startup.py --phases # where one run's time goes
    .venv/bin/python benchmarks/bench_cli_startup.py --src OLD/src --src src  # before/after
    .venv/bin/python benchmarks/bench_cli_startup.py -n 2     # smoke (the test suite)

Prints p50 and p90 of the wall time (and p50 of the CPU time) of each variant.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BIN = ROOT / ".venv" / "bin"


def variants() -> dict[str, list[str]]:
    python = str(BIN / "python")
    codecage = str(BIN / "codecage")
    return {
        "python_pass": [python, "-c", "pass"],
        "import_codecage": [python, "-c", "import codecage"],
        "stdlib_client": [python, "-c", "import json, socket, http.client"],
        "import_cli": [python, "-c", "import codecage.cli"],
        "codecage_run": [codecage, "run", "--code", "1"],
        "codecage_json": [codecage, "run", "--code", "1", "--json"],
        "codecage_run_handoff": [codecage, "run", "--code", "1"],
        "codecage_json_handoff": [codecage, "run", "--code", "1", "--json"],
        "serve_initialize": [codecage, "serve"],
    }


HANDOFF = "_handoff"  # the suffix of the rows handed to the local server


INITIALIZE = (
    json.dumps(
        {
            "jsonrpc": "2.0",
            "id": 1,
            "method": "initialize",
            "params": {
                "protocolVersion": "2025-06-18",
                "capabilities": {},
                "clientInfo": {"name": "bench_cli_startup", "version": "0"},
            },
        }
    )
    + "\n"
).encode()


FLOORS = {"python_pass", "stdlib_client"}  # the same whatever the source tree
SOURCES = [ROOT / "src"]  # --src sets it: the trees measured, side by side


def environment(src: Path | None = None) -> dict[str, str]:
    env = dict(os.environ)
    # The entry point's own install may point at another checkout: measure this one.
    first = str(src or SOURCES[0])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [first, env.get("PYTHONPATH")]))
    return env


def compile_sources() -> None:
    """Bring each tree's .pyc files up to date first: with PYTHONDONTWRITEBYTECODE set (as
    here) a process never writes them, and every run would compile what is stale."""
    for src in SOURCES:
        subprocess.run(
            [str(BIN / "python"), "-m", "compileall", "-q", str(src)], check=True, cwd=ROOT
        )


GAP_S = [0.2]  # --gap sets it


def timed(argv: list[str], env: dict[str, str]) -> tuple[float, float]:
    """Wall ms, and CPU ms (user + system) of the process and all it waited for: on a
    shared machine the CPU figure moves less with the load than the wall one."""
    time.sleep(GAP_S[0])
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    if argv[1:] == ["serve"]:
        wall = _first_answer(argv, env, start)
    else:
        subprocess.run(argv, check=True, capture_output=True, env=env, cwd=ROOT)
        wall = (time.perf_counter() - start) * 1000
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime) * 1000
    return wall, cpu


def _first_answer(argv: list[str], env: dict[str, str], start: float) -> float:
    """Start a stdio server, write `initialize` at once and return the ms until its answer
    is read; then close stdin and wait for the server's exit (not timed)."""
    proc = subprocess.Popen(
        argv,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        env=env,
        cwd=ROOT,
    )
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(INITIALIZE)
    proc.stdin.flush()
    answer = proc.stdout.readline()
    wall = (time.perf_counter() - start) * 1000
    proc.stdin.close()
    proc.wait(timeout=120)
    if b'"id":1' not in answer.replace(b" ", b"") or b'"result"' not in answer:
        raise SystemExit(f"serve did not answer initialize: {answer[:200]!r}")
    return wall


def measure(n: int) -> dict[str, list[tuple[float, float]]]:
    """Each variant of each source tree, interleaved round by round; the hand-off rows
    against a local server started for them (and stopped after)."""
    compile_sources()
    with local_server(environment()) as served:
        runs = {}
        for i, src in enumerate(SOURCES):
            env = environment(src)
            for name, argv in variants().items():
                if name.endswith(HANDOFF) and i:
                    continue  # one server, of the first tree
                label = f"{name}@{i}" if len(SOURCES) > 1 and name not in FLOORS else name
                runs[label] = (argv, _env_of(name, env, served))
        for argv, env in runs.values():  # warm: .pyc files, the self-test cache, page cache
            timed(argv, env)
        samples: dict[str, list[tuple[float, float]]] = {name: [] for name in runs}
        for _ in range(n):
            for name, (argv, env) in runs.items():
                samples[name].append(timed(argv, env))
        handed = sum(1 for name in runs if name.endswith(HANDOFF)) * (n + 1)
        taken = _handed_off(served)
        if taken != handed:
            raise SystemExit(f"the local server took {taken} runs, not {handed}: see its log")
    return samples


def _env_of(name: str, env: dict[str, str], served: dict[str, str]) -> dict[str, str]:
    """A variant's environment: the runs of codecage in the local server's, handed off or
    (CODECAGE_HANDOFF=0) not; the rest as the caller's."""
    if name.endswith(HANDOFF):
        return {**served, "PYTHONPATH": env["PYTHONPATH"]}
    if name.startswith("codecage_") or name == "serve_initialize":
        return {**served, "PYTHONPATH": env["PYTHONPATH"], "CODECAGE_HANDOFF": "0"}
    return env


@contextlib.contextmanager
def local_server(env: dict[str, str]) -> Iterator[dict[str, str]]:
    """A local server in a runtime directory of its own (its audit store there too), and
    the environment that finds it; stopped, and the directory removed, after."""
    runtime = Path(tempfile.mkdtemp(prefix="cc-bench-", dir="/tmp"))  # a socket path is short
    # The audit store too, for every run of the comparison (the in-process ones record as
    # well then): the server keeps one by default, in the user's state directory.
    served = {**env, "XDG_RUNTIME_DIR": str(runtime), "CODECAGE_AUDIT": str(runtime / "audit.db")}
    served.pop("CODECAGE_HANDOFF", None)
    codecage = str(BIN / "codecage")
    try:
        subprocess.run(
            [codecage, "session", "start-server"], env=served, check=True, capture_output=True
        )
        yield served
    finally:
        subprocess.run([codecage, "session", "stop-server"], env=served, capture_output=True)
        shutil.rmtree(runtime, ignore_errors=True)


def _handed_off(served: dict[str, str]) -> int:
    log = Path(served["XDG_RUNTIME_DIR"]) / "codecage" / "server.log"
    return log.read_text(encoding="utf-8", errors="replace").count("handoff.run")


# (module, attribute path, label): each is wrapped in a timer by `_phases_child`. Nested
# steps are included in their parents' time.
PHASES = [
    ("codecage.cli.run", "load_config", "config load"),
    ("codecage.cli.run", "Sandbox", "Sandbox(...): host set-up"),
    ("codecage.host", "choose_backend", "  backend choice + self-test verdict"),
    ("codecage.host", "selftest.cache_key", "    self-test cache key"),
    ("codecage.host", "_read_cached", "    cached verdict read"),
    ("codecage.host", "_PROCESS.sweep_once", "  sweep of stale runs"),
    ("codecage.host", "guardian.ensure", "  guardian start"),
    ("codecage.host", "redaction.build_scrubber", "  scrubber"),
    ("codecage.host", "_pool", "  pool"),
    ("codecage.sandbox", "Sandbox.run", "Sandbox.run"),
    ("codecage.engine.run", "start", "  sandbox start"),
    ("codecage.engine.run", "launch.facts", "    host facts (interpreter, binds)"),
    ("codecage.engine.launch", "rootfs.packages_for", "      the profile's packages"),
    ("codecage.engine.run", "launch.acquire", "    resources (id, run dir, workspace, ...)"),
    ("codecage.engine.launch", "prepare_workspace", "      workspace"),
    ("codecage.engine.launch", "_stage", "      staged copies"),
    ("codecage.engine.run", "plans.plan", "    the launch plan"),
    ("codecage.engine.run", "launch.sandbox_filter", "    seccomp filter"),
    ("codecage.engine.run", "cgroups.create", "    cgroup set-up"),
    ("codecage.backends.bwrap", "BwrapBackend.start", "    bwrap spawn"),
    ("codecage.engine.run", "run_in", "  run (guest start + code + result)"),
    ("codecage.engine.run", "StartedSandbox.destroy", "  teardown"),
    ("codecage.sandbox", "Sandbox.close", "Sandbox close"),
]

_CHILD = r"""
import functools, importlib, json, sys, time
t0 = time.perf_counter()
from codecage.cli import main
import codecage.cli.app, codecage.cli.run  # what `main` imports for `run` (it loads lazily)
imported = time.perf_counter()
totals = {}
for module, path, label in json.loads(sys.argv[1]):
    owner = importlib.import_module(module)
    *parents, name = path.split(".")
    for part in parents:
        owner = getattr(owner, part)
    inner = getattr(owner, name)
    def timer(*a, __inner=inner, __label=label, **k):
        start = time.perf_counter()
        try:
            return __inner(*a, **k)
        finally:
            totals[__label] = totals.get(__label, 0.0) + time.perf_counter() - start
    setattr(owner, name, functools.wraps(inner)(timer))
set_up = time.perf_counter()
try:
    main(["run", "--code", "1", "--json"])
except SystemExit:
    pass
end = time.perf_counter()
totals["imports (codecage.cli)"] = imported - t0
totals["CLI total after imports"] = end - set_up
print(json.dumps({k: v * 1000 for k, v in totals.items()}))
"""


def phases(n: int) -> dict[str, list[float]]:
    env = environment()
    compile_sources()
    argv = [str(BIN / "python"), "-c", _CHILD, json.dumps(PHASES)]
    samples: dict[str, list[float]] = {}
    for _ in range(n + 1):
        proc = subprocess.run(argv, check=True, capture_output=True, text=True, env=env, cwd=ROOT)
        timings = json.loads(proc.stdout.splitlines()[-1])
        for label, ms in timings.items():
            samples.setdefault(label, []).append(ms)
    order = ["imports (codecage.cli)", *(label for _, _, label in PHASES)]
    order.append("CLI total after imports")
    return {label: samples[label][1:] for label in order if label in samples}  # 1st warms


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("-n", type=int, default=20, help="rounds (default 20)")
    parser.add_argument("--phases", action="store_true", help="time each step of one run")
    parser.add_argument(
        "--gap", type=float, default=0.2, help="seconds between measurements (default 0.2)"
    )
    parser.add_argument(
        "--src",
        type=Path,
        action="append",
        help="a source tree to measure instead of this checkout's src/; repeat to compare "
        "(variants are suffixed @0, @1, ... in that order)",
    )
    args = parser.parse_args(argv)
    GAP_S[0] = args.gap
    if args.src:
        SOURCES[:] = [p.resolve() for p in args.src]
    if args.phases:
        print(f"{'step':<40}{'p50 ms':>9}")
        for label, values in phases(args.n).items():
            print(f"{label:<40}{statistics.median(values):>9.1f}")
        return 0
    load_before = os.getloadavg()
    samples = measure(args.n)
    load_after = os.getloadavg()
    floor = statistics.median(wall for wall, _ in samples["python_pass"])
    cores = os.cpu_count()
    print(f"load average before {load_before[0]:.2f}, after {load_after[0]:.2f}; {cores} cores")
    for i, src in enumerate(SOURCES):
        print(f"@{i}: {src}")
    print(f"{'variant':<22}{'p50 ms':>9}{'p90 ms':>9}{'x pass':>8}{'CPU p50 ms':>12}")
    for name, pairs in samples.items():
        walls = [wall for wall, _ in pairs]
        p50 = statistics.median(walls)
        cpu = statistics.median(c for _, c in pairs)
        p90 = percentile(walls, 0.90)
        print(f"{name:<22}{p50:>9.1f}{p90:>9.1f}{p50 / floor:>8.2f}{cpu:>12.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
