"""Process layer: the pids cgroup bounds processes and threads of the whole sandbox.

The fork bombs run only in the real sandbox: on the null runner they would bomb the host.
"""

from __future__ import annotations

import os

import pytest

from codecage import Sandbox
from codecage.isolation import cgroups

from ._support import Runner, report

pytestmark = pytest.mark.timeout(60)

MAX_PROCESSES = 16
BWRAP_INIT = 1  # bwrap's PID 1 lives in the cgroup too, and codecage adds one pid for it

# Every process forks for one second, children too; then the first one counts what exists
# and exits, which ends the sandbox (and with it the others).
COUNTING_BOMB = """
import os, time
first = os.getpid()
deadline = time.monotonic() + 1.0
forks = refusals = 0
while time.monotonic() < deadline:
    try:
        os.fork()
        forks += 1
    except OSError:
        refusals += 1
        time.sleep(0.005)
if os.getpid() != first:
    time.sleep(60)
    os._exit(0)
pids = [p for p in os.listdir("/proc") if p.isdigit()]
{"processes": len(pids), "forks": forks, "refusals": refusals}
"""

ENDLESS_BOMB = """
import os
while True:
    try:
        os.fork()
    except OSError:
        pass
"""


@pytest.fixture(autouse=True)
def _needs_pids_cgroup() -> None:
    # As an ordinary user, RLIMIT_NPROC binds (per host user): the tests run.
    if cgroups.detect() is None and os.geteuid() == 0:
        pytest.skip("no writable cgroup: RLIMIT_NPROC does not bind root (see probe())")


def test_a_fork_bomb_is_held_to_max_processes(sandbox: Sandbox) -> None:
    r = sandbox.run(COUNTING_BOMB, limits={"max_processes": MAX_PROCESSES, "timeout": 10})
    assert r.status == "ok", (r.error, r.stderr)
    got = r.return_value
    assert got["refusals"] > 0  # the limit was reached, and refused further forks
    assert got["processes"] <= MAX_PROCESSES + BWRAP_INIT
    assert got["processes"] >= MAX_PROCESSES // 2  # it did fork


def test_an_endless_fork_bomb_is_stopped_by_the_host_and_the_host_stays_healthy(
    sandbox: Sandbox,
) -> None:
    """What ends it is the host's limit, not the clock of this test: under load a cold
    sandbox and the teardown of its processes take what they take (the module's pytest
    timeout is what bounds it). It was `elapsed < 4 + 5`, which failed on a busy host."""
    r = sandbox.run(ENDLESS_BOMB, limits={"max_processes": MAX_PROCESSES, "timeout": 4})
    # It never ends on its own: whatever stops it, the run did not succeed.
    assert r.status in ("timeout", "cpu_limit", "error"), (r.status, r.error)
    if r.status == "timeout":  # the host's wall timer stopped it, at its limit, not before
        assert r.usage.wall_ms >= 4000, r.usage
    after = sandbox.run("import os\nos.fork() or os.wait()\n'fine'")
    assert (after.status, after.return_value) == ("ok", "fine")


def test_threads_count_against_max_processes(runner: Runner) -> None:
    code = """
import json, threading
release = threading.Event()
threads, refusal = [], None
try:
    for _ in range(200):
        t = threading.Thread(target=release.wait)
        t.start()
        threads.append(t)
except RuntimeError as exc:
    refusal = str(exc)
release.set()
for t in threads:
    t.join()
print(json.dumps({"started": len(threads), "refusal": refusal}))
"""
    got = report(runner(code, max_processes=MAX_PROCESSES, timeout=10))
    assert got["refusal"] == "can't start new thread"
    assert got["started"] < MAX_PROCESSES
