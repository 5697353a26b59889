"""Cleanup: nothing a run starts or creates outlives it, whatever the code does to stay
(daemons, setsid, ignored SIGTERM, held pipes) and however the run ends; and no amount of
output costs the host more than the cap."""

from __future__ import annotations

import os
import resource
import secrets
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from codecage import Sandbox
from codecage.engine import workspace as workspaces
from codecage.isolation import cgroups

from ._support import Runner, guest, host_pids_with, kill_marked, report

pytestmark = pytest.mark.timeout(60)

STAY_ALIVE = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(300)"


@pytest.fixture
def marker() -> Iterator[str]:
    """A unique argv word for the processes a test starts; any left at the end are killed
    (by pid: only processes carrying this marker)."""
    word = f"codecage-marker-{secrets.token_hex(8)}"
    yield word
    kill_marked(word)


@pytest.fixture
def wall(request: pytest.FixtureRequest) -> float:
    """The wall timeout for a run whose pass never waits for it: a sandbox's start counts
    against it, and a gVisor start under the suite's parallel workers once took over 10 s
    in CI, so sandboxes get 40 s. The null runner, which must fail by waiting, gets 10 s so
    that its expected failure stays cheap."""
    return 10.0 if request.node.callspec.params.get("runner") == "null" else 40.0


def _host_mounts() -> str:
    return Path("/proc/self/mountinfo").read_text()


def test_a_double_forked_daemon_ignoring_sigterm_is_gone_after_the_run(
    runner: Runner, marker: str, wall: float
) -> None:
    code = guest(
        """
        import json, os, signal, sys, time
        if os.fork() == 0:
            os.setsid()
            if os.fork() == 0:
                signal.signal(signal.SIGTERM, signal.SIG_IGN)
                devnull = os.open("/dev/null", os.O_RDWR)
                for fd in (0, 1, 2):
                    os.dup2(devnull, fd)
                os.execv(sys.executable, [sys.executable, "-c", $stay, $marker])
            os._exit(0)
        os.wait()
        def daemon_running():
            for pid in os.listdir("/proc"):
                try:
                    with open(f"/proc/{pid}/cmdline", "rb") as f:
                        if $marker.encode() in f.read():
                            return True
                except OSError:
                    pass
            return False
        deadline = time.monotonic() + 5
        while not daemon_running() and time.monotonic() < deadline:
            time.sleep(0.01)
        print(json.dumps({"daemon_running": daemon_running()}))
        """,
        stay=STAY_ALIVE,
        marker=marker,
    )
    seen = runner(code, timeout=wall)
    assert report(seen) == {"daemon_running": True}  # it was really started
    _gone(lambda: host_pids_with(marker) == [], "the daemon")


def test_a_grandchild_holding_stdout_does_not_make_the_run_hang(
    runner: Runner, marker: str, wall: float
) -> None:
    code = guest(
        """
        import os, sys
        if os.fork() == 0:
            os.execv(sys.executable, [sys.executable, "-c", $stay, $marker])
        print("parent done", flush=True)
        """,
        stay=STAY_ALIVE,
        marker=marker,
    )
    # The grandchild never exits by itself: a run that waited for it would end by its
    # wall timeout, as "timeout". "ok" says it ended when its parent did.
    seen = runner(code, timeout=wall)
    assert seen.status == "ok"
    assert seen.stdout == "parent done\n"
    _gone(lambda: host_pids_with(marker) == [], "the grandchild")


def test_nothing_is_left_after_a_timeout(sandbox: Sandbox, marker: str) -> None:
    # The guest learns its host run dir from bwrap's argv (/proc/1/cmdline), prints it,
    # starts a few children and spins until the wall timeout kills the sandbox. A forked
    # sandbox's init has no such argv (engine/forkserver.py): then no run dir may be new.
    sandbox.run("1")  # a fork server's template is started by now
    before = _own_run_dirs()
    code = guest(
        """
        import os, re, sys
        with open("/proc/1/cmdline", "rb") as f:
            found = re.search(rb"codecage-run-[^/\\0]+", f.read())
        print(found.group().decode() if found else "forked", flush=True)
        for _ in range(3):
            if os.fork() == 0:
                os.execv(sys.executable, [sys.executable, "-c", $stay, $marker])
        while True:
            pass
        """,
        stay=STAY_ALIVE,
        marker=marker,
    )
    r = sandbox.run(code, limits={"timeout": 1})
    assert r.status == "timeout"
    run_dir = r.stdout.strip()
    templates = sandbox.host.templates
    if run_dir == "forked" and templates is not None:
        # Its run dir goes with it; a sandbox forked ahead for the next run (prefork) has
        # one of its own, which is no leftover of this run.
        _gone(lambda: len(_own_run_dirs() - before) <= templates.spares(), "its run dir")
        run_dir = f"codecage-run-{r.execution_id}"  # checked below for form's sake
    assert run_dir.startswith("codecage-run-"), r.stdout
    _gone(lambda: host_pids_with(marker) == [], "its children")
    assert host_pids_with(run_dir) == []  # bwrap's argv names the run dir
    assert not (workspaces.private_parent() / run_dir).exists()
    assert run_dir not in _host_mounts()
    support = cgroups.detect()
    if support is not None:
        for parent in support.parents.values():
            assert not (parent / r.execution_id).exists()


def _gone(predicate: Callable[[], bool], what: str, timeout_s: float = 5.0) -> None:
    """Wait until `predicate` holds: a run started anew is destroyed before its result
    comes back (it holds at once); a forked one by its templates' keeper thread
    `forkserver.HOLD_OFF_S` after the result, off the caller's path, as a pooled run's
    sandbox by the pool's reaper (test_pool_isolation.py)."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"{what} still there after {timeout_s:g} s"
        time.sleep(0.02)


def _own_run_dirs() -> set[str]:
    """This process's run directories (other codecage processes of the machine share the
    parent)."""
    own = f"codecage-run-{os.getpid()}-"
    return {name for name in os.listdir(workspaces.private_parent()) if name.startswith(own)}


def test_an_output_flood_is_capped_without_the_host_ballooning(sandbox: Sandbox) -> None:
    before_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    r = sandbox.run(
        "while True:\n    print('x' * 1000)",
        limits={"max_output_bytes": 4096, "timeout": 3},
    )
    after_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    assert r.status == "timeout"
    assert len(r.raw_stdout()) <= 4096
    assert len(r.stdout.encode()) <= 4096
    assert r.stdout_truncated
    truncated = [e for e in r.events if e.kind == "output_truncated"]
    assert len(truncated) == 1 and truncated[0].detail.startswith("stdout:")
    assert after_kib - before_kib < 100 * 1024
