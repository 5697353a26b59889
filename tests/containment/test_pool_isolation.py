"""The warm pool is not a side channel: a pooled sandbox runs one request and nothing of it
reaches another request, whether the runs come one after another or at the same time.

The tests take the `pooled` fixture, which runs each test twice: once on a real warm pool,
and once on a *reused worker* (one long-lived `python3` that runs every request in turn,
in the same interpreter and working directory: the naive "warm pool"), where the test is
expected to fail (strict xfail). A test that passes on the reused worker proves nothing.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Protocol

import pytest
from tests._proc import end

from codecage import Options, Sandbox
from codecage.backends.base import load_backend
from codecage.engine import RunRequest, SandboxSpec, forkserver, run_in
from codecage.engine.pool import Pool
from codecage.isolation import tmpfs
from codecage.models import Limits, PoolConfig, PoolSizes

from ._support import (
    Outcome,
    against_baseline,
    guest,
    host_pids_with,
    kill_marked,
    outcome_of,
    report,
)

pytestmark = pytest.mark.timeout(60)

STAY = "import time; time.sleep(60)"

# A guest helper: the pids of this sandbox whose argv holds the token.
MARKED = """
def marked():
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/cmdline", "rb") as f:
                argv = f.read().split(b"\\0")
        except OSError:
            continue
        found += [w.decode() for w in argv if w.startswith($token.encode())]
    return sorted(found)
"""

# A guest helper: leave a process behind (own session, no stdio), marked by `word`.
DAEMON = """
def daemon(word):
    if os.fork() == 0:
        try:
            os.setsid()
            devnull = os.open("/dev/null", os.O_RDWR)
            for fd in (0, 1, 2):
                os.dup2(devnull, fd)
            os.execv(sys.executable, [sys.executable, "-c", $stay, word])
        finally:
            os._exit(1)
"""


def _wait_for(predicate: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"not within {timeout:g} s: {what}"
        time.sleep(0.02)


# --- the two runners: a warm pool vs one reused interpreter -----------------------------


class PooledRunner(Protocol):
    def __call__(self, code: str, **limits: Any) -> Outcome: ...

    def warm_runs(self) -> int:
        """How many runs so far were served by an already started sandbox/interpreter."""
        ...


class _PoolRunner:
    def __init__(self, pool: Pool) -> None:
        self.sandbox = Sandbox(options=Options(pool=pool, import_policy=False, scrub=False))
        assert self.sandbox.warm(30), "the pool did not get ready"

    def __call__(self, code: str, **limits: Any) -> Outcome:
        return outcome_of(self.sandbox.run(code, limits=limits))

    def warm_runs(self) -> int:
        pool = self.sandbox.info().pool
        assert pool is not None
        return sum(k.hits for k in pool.keys)


_WORKER = """
import contextlib, io, json, sys, traceback
dumps, protocol = json.dumps, sys.stdout  # kept: the requests may tamper with both
for line in sys.stdin:
    out, err, status = io.StringIO(), io.StringIO(), "ok"
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            exec(compile(json.loads(line), "main.py", "exec"), {"__name__": "__main__"})
        except BaseException:
            traceback.print_exc()
            status = "error"
    protocol.write(dumps([status, out.getvalue(), err.getvalue()]) + "\\n")
    protocol.flush()
"""


class _ReusedWorker:
    """One interpreter, started once, that runs every request in turn: no isolation
    between requests at all."""

    def __init__(self, cwd: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _WORKER],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            encoding="utf-8",
            cwd=cwd,
            env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")},
        )
        self.lock = threading.Lock()
        self.runs = 0

    def __call__(self, code: str, **limits: Any) -> Outcome:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        with self.lock:
            self.proc.stdin.write(json.dumps(code) + "\n")
            self.proc.stdin.flush()
            status, stdout, stderr = json.loads(self.proc.stdout.readline())
            self.runs += 1
        return Outcome(status, stdout, stderr)

    def warm_runs(self) -> int:
        return self.runs

    def close(self) -> None:
        end(self.proc, grace=5)


@pytest.fixture(scope="module")
def warm_pool() -> Iterator[Pool]:
    config = PoolConfig(enabled=True, sizes=PoolSizes(min_idle=3, max_idle=6))
    with Pool(load_backend("auto"), config, Limits()) as pool:
        yield pool


@pytest.fixture(scope="module")
def forked_pool() -> Iterator[Pool]:
    """A warm pool whose sandboxes are forked from a fork server's template
    (engine/forkserver.py): the same cross-run properties must hold."""
    backend = load_backend("auto")
    why_not = forkserver.supported(backend)
    if why_not is not None:
        pytest.skip(f"no fork server here: {why_not}")
    templates = forkserver.Templates(backend, Limits())
    config = PoolConfig(enabled=True, sizes=PoolSizes(min_idle=3, max_idle=6))
    try:
        with Pool(backend, config, Limits(), templates=templates) as pool:
            yield pool
        assert templates.forked > 0, "the pool's sandboxes were not forked"
    finally:
        templates.close()


@pytest.fixture
def token() -> Iterator[str]:
    """A unique word for the files and processes of one test; the processes left by the
    reused worker (only those carrying it) and its host /tmp files are removed after."""
    word = f"codecage-pool-{secrets.token_hex(8)}"
    yield word
    kill_marked(word)
    for path in Path(tempfile.gettempdir()).glob(f"*{word}*"):
        with contextlib.suppress(OSError):
            path.unlink()


@pytest.fixture(
    params=[
        "forked",
        *against_baseline(
            "pool", "reused", "a reused interpreter isolates nothing: the test must fail"
        ),
    ]
)
def pooled(request: pytest.FixtureRequest) -> Iterator[PooledRunner]:
    if request.param in ("pool", "forked"):
        pool = request.getfixturevalue("warm_pool" if request.param == "pool" else "forked_pool")
        yield _PoolRunner(pool)
        return
    with tempfile.TemporaryDirectory() as cwd:
        worker = _ReusedWorker(cwd)
        try:
            yield worker
        finally:
            worker.close()


def _two_warm_runs(pooled: PooledRunner, first: str, second: str) -> tuple[Outcome, Outcome]:
    warm_before = pooled.warm_runs()
    one = pooled(first)
    assert one.status == "ok", one.stderr
    two = pooled(second)
    assert two.status == "ok", two.stderr
    assert pooled.warm_runs() - warm_before == 2, "both runs should have been warm"
    return one, two


# --- one run after another ----------------------------------------------------------------


def test_files_a_pooled_run_wrote_are_gone_for_the_next_run(
    pooled: PooledRunner, token: str
) -> None:
    first = guest(
        """
        import os
        open("left-" + $token, "w").write($token)
        os.mkdir("dir-" + $token)
        open("/tmp/left-" + $token, "w").write($token)
        print(sorted(os.listdir(".")))
        """,
        token=token,
    )
    second = guest(
        """
        import json, os
        print(json.dumps({
            "workspace": sorted(os.listdir(".")),
            "tmp": sorted(n for n in os.listdir("/tmp") if $token in n),
        }))
        """,
        token=token,
    )
    one, two = _two_warm_runs(pooled, first, second)
    assert token in one.stdout  # the first run really wrote them
    assert report(two) == {"workspace": [], "tmp": []}


def test_a_process_a_pooled_run_left_behind_is_gone_for_the_next_run(
    pooled: PooledRunner, token: str
) -> None:
    first = guest(
        "import json, os, sys, time\n"
        + MARKED
        + DAEMON
        + """
daemon($token + "-daemon")
deadline = time.monotonic() + 5
while not marked() and time.monotonic() < deadline:
    time.sleep(0.01)
print(json.dumps({"left": marked()}))
""",
        token=token,
        stay=STAY,
    )
    second = guest(
        "import json, os\n" + MARKED + 'print(json.dumps({"seen": marked()}))\n',
        token=token,
    )
    one, two = _two_warm_runs(pooled, first, second)
    assert report(one) == {"left": [f"{token}-daemon"]}  # it was really running
    assert report(two) == {"seen": []}
    # The used sandbox is destroyed in the background: its process goes with it.
    _wait_for(lambda: host_pids_with(token) == [], "the left-behind process to be killed")


def test_module_and_interpreter_changes_of_a_pooled_run_do_not_reach_the_next_run(
    pooled: PooledRunner, token: str
) -> None:
    first = guest(
        """
        import builtins, json, sys, types
        json.dumps = lambda *args, **kwargs: "tampered"
        builtins.planted = $token
        sys.modules["planted_module"] = types.ModuleType("planted_module")
        sys.path.insert(0, "/workspace/" + $token)
        print(json.dumps([1]))
        """,
        token=token,
    )
    second = guest(
        """
        import builtins, json, sys
        seen = {
            "json_dumps_intact": json.dumps([1]) == "[1]",
            "builtin": getattr(builtins, "planted", None),
            "module": "planted_module" in sys.modules,
            "path": [p for p in sys.path if $token in p],
        }
        print(json.JSONEncoder().encode(seen))
        """,
        token=token,
    )
    one, two = _two_warm_runs(pooled, first, second)
    assert one.stdout == "tampered\n"  # the first run really changed json
    assert report(two) == {"json_dumps_intact": True, "builtin": None, "module": False, "path": []}


def test_environment_cwd_and_umask_changes_of_a_pooled_run_do_not_reach_the_next_run(
    pooled: PooledRunner, token: str
) -> None:
    first = guest(
        """
        import json, os
        print(json.dumps({"cwd": os.getcwd(), "umask": os.umask(0), "env": dict(os.environ)}))
        os.environ["PLANTED"] = $token
        os.environ.pop("HOME", None)
        os.chdir("/tmp")
        """,
        token=token,
    )
    second = guest(
        """
        import json, os
        umask = os.umask(0o022)
        print(json.dumps({"cwd": os.getcwd(), "umask": umask, "env": dict(os.environ)}))
        """,
        token=token,
    )
    one, two = _two_warm_runs(pooled, first, second)
    assert report(two) == report(one)
    assert "PLANTED" not in report(two)["env"]


# --- runs at the same time --------------------------------------------------------------------


RUNS_AT_ONCE = 6
BARRIER_S = 45.0  # how long the host waits for every run to be at the barrier


@pytest.mark.timeout(180)
def test_concurrent_pooled_runs_see_only_their_own_files_processes_and_workspace(
    pooled: PooledRunner, token: str
) -> None:
    """Six runs held alive together at a barrier: each has written its file, its /tmp file
    and its daemon and taken its /workspace's device before it waits; the host lets them on
    only once all six wait (it sees each one's marker process), so every workspace is
    mounted at once and a device number cannot be one a finished run gave back (5 devices
    for 6 runs, when the runs only happened to overlap). Then each lists what it sees."""
    program = (
        "import json, os, sys, time\n"
        + MARKED
        + DAEMON
        + """
n = $n
open(f"mine-{n}", "w").write(str(n))
open(f"/tmp/{$token}-file-{n}", "w").write(str(n))
daemon(f"{$token}-proc-{n}")
deadline = time.monotonic() + 5
while f"{$token}-proc-{n}" not in marked() and time.monotonic() < deadline:
    time.sleep(0.01)
dev = [os.stat(".").st_dev, os.stat(".").st_ino]
# The barrier: a child marked ready-n, which the host kills once all runs have one.
waiter = os.fork()
if waiter == 0:
    os.execv(sys.executable, [sys.executable, "-c", $stay, f"{$token}-ready-{n}"])
os.waitpid(waiter, 0)
print(json.dumps({
    "workspace": sorted(os.listdir(".")),
    "tmp": sorted(x for x in os.listdir("/tmp") if x.startswith($token)),
    "procs": marked(),
    "dev": dev,
}))
"""
    )
    codes = [guest(program, token=token, stay=STAY, n=n) for n in range(RUNS_AT_ONCE)]
    warm_before = pooled.warm_runs()
    ready = f"{token}-ready-"
    with ThreadPoolExecutor(max_workers=RUNS_AT_ONCE) as threads:
        futures = [threads.submit(pooled, code, timeout=BARRIER_S + 60) for code in codes]
        deadline = time.monotonic() + BARRIER_S
        waiting = 0
        while time.monotonic() < deadline and not any(f.done() for f in futures):
            waiting = len(host_pids_with(ready))
            if waiting == RUNS_AT_ONCE:
                break
            time.sleep(0.05)
        # Let them on; past the bound, let every run on as it comes to the barrier, so
        # that the test fails on what was seen rather than hang.
        while not all(f.done() for f in futures):
            kill_marked(ready)
            time.sleep(0.05)
        outcomes = [f.result() for f in futures]
    assert waiting == RUNS_AT_ONCE, f"only {waiting} runs were alive at once"
    devices = set()
    for n, seen in enumerate(outcomes):
        assert seen.status == "ok", (n, seen.stderr)
        assert report(seen) | {"dev": None} == {
            "workspace": [f"mine-{n}"],
            "tmp": [f"{token}-file-{n}"],
            "procs": [f"{token}-proc-{n}"],
            "dev": None,
        }, n
        devices.add(tuple(report(seen)["dev"]))
    assert len(devices) == RUNS_AT_ONCE, "each run has a /workspace of its own"
    if tmpfs.can_mount_tmpfs():  # as root; an ordinary user's workspaces are plain dirs
        assert len({dev for dev, _ in devices}) == RUNS_AT_ONCE, "each its own tmpfs"
    assert pooled.warm_runs() - warm_before >= 3, "the 3 idle sandboxes should have served"
    _wait_for(lambda: host_pids_with(token) == [], "the runs' processes to be killed")


# --- two idle members, seen from the host ------------------------------------------------------

_MOUNTS = """
import json, os
writable = []
with open("/proc/self/mountinfo") as f:
    for line in f:
        fields = line.split()
        fstype = fields[fields.index("-") + 1]
        # Device nodes bound from the host (/dev/null, /dev/zero...) hold no data.
        if fields[5].split(",")[0] == "rw" and fstype != "devtmpfs":
            writable.append([fields[4], fields[2], fields[3]])
print(json.dumps({
    "writable": writable,
    "workspace": sorted(os.listdir("/workspace")),
    "tmp": sorted(os.listdir("/tmp")),
    "planted": open("/workspace/" + $name).read() if os.path.exists("/workspace/" + $name)
    else None,
}))
"""


def test_two_idle_pool_members_share_no_writable_path() -> None:
    # Not on the reused worker: this looks at the pool's own members. The planted file is
    # the check that can fail: it must show up in the member it was written to.
    spec = SandboxSpec()
    config = PoolConfig(enabled=True, sizes=PoolSizes(min_idle=2, max_idle=2))
    name = f"planted-{secrets.token_hex(8)}"
    with Pool(load_backend("auto"), config, Limits()) as pool:
        pool.register(spec)
        assert pool.wait_ready(30)
        with pool._cond:
            a, b = list(pool._plan.keys[spec].idle)
        assert a.workspace.path != b.workspace.path
        assert a.workspace.path.parent != b.workspace.path.parent  # the run dirs
        st_a, st_b = os.stat(a.workspace.path), os.stat(b.workspace.path)
        dev_a = st_a.st_dev
        assert (dev_a, st_a.st_ino) != (st_b.st_dev, st_b.st_ino)
        if tmpfs.can_mount_tmpfs():  # as root: each is a tmpfs of its own
            assert a.workspace.tmpfs and b.workspace.tmpfs
            assert dev_a != st_b.st_dev
        (a.workspace.path / name).write_text(name, encoding="utf-8")

        first, second = pool.take(spec), pool.take(spec)
        assert first is a and second is b
        try:
            request = RunRequest(code=guest(_MOUNTS, name=name), filename="m.py", limits=Limits())
            seen = [
                json.loads(run_in(s, request, backend_name=pool.backend.name).stdout)
                for s in (a, b)
            ]
        finally:
            for s in (a, b):
                pool.release(s)

    in_a, in_b = seen
    assert in_a["planted"] == name and in_a["workspace"] == [name]  # written where A sees it
    assert in_b["planted"] is None and in_b["workspace"] == [] and in_b["tmp"] == []
    mounts_a = {point: dev for point, dev, _ in in_a["writable"]}
    assert {"/workspace", "/tmp"} <= set(mounts_a)
    # What A sees at /workspace is what is at A's host workspace path (its tmpfs as root),
    # nothing else.
    assert mounts_a["/workspace"] == f"{os.major(dev_a)}:{os.minor(dev_a)}"
    backing_a = {(dev, root) for _, dev, root in in_a["writable"]}
    backing_b = {(dev, root) for _, dev, root in in_b["writable"]}
    assert backing_a.isdisjoint(backing_b), (in_a["writable"], in_b["writable"])
