"""CPU layer: the host sums the CPU time of every process of the run (cgroup accounting)
and kills the sandbox when the total passes cpu_seconds; the wall timeout is separate.

Real sandbox only: the statuses are the host's judgement, which the null runner lacks.
"""

from __future__ import annotations

import os
import time

import pytest

from codecage import Sandbox
from codecage.isolation import cgroups

pytestmark = pytest.mark.timeout(60)

SPIN = "while True:\n    pass\n"

# Five busy processes (four children and the parent) on a machine with fewer cores: each
# alone would take far longer than the wall bound below to use cpu_seconds.
SPIN_IN_FIVE = """
import os
for _ in range(4):
    if os.fork() == 0:
        break
while True:
    pass
"""


def test_an_endless_loop_ends_as_cpu_limit_well_before_the_timeout(sandbox: Sandbox) -> None:
    started = time.monotonic()
    r = sandbox.run(SPIN, limits={"cpu_seconds": 1, "timeout": 20})
    elapsed = time.monotonic() - started
    assert r.status == "cpu_limit"
    assert elapsed < 10
    assert r.exit_code is None and r.signal in ("SIGKILL", "SIGXCPU")


def test_cpu_time_is_summed_over_every_process_of_the_run(sandbox: Sandbox) -> None:
    if cgroups.detect() is None and os.geteuid() == 0:  # non-root: _hostmode.NONROOT_GAPS
        pytest.skip("no writable cgroup: RLIMIT_CPU is per process")
    started = time.monotonic()
    r = sandbox.run(SPIN_IN_FIVE, limits={"cpu_seconds": 2, "timeout": 20})
    elapsed = time.monotonic() - started
    assert r.status == "cpu_limit"
    assert r.usage.cpu_ms is not None
    # Per process (RLIMIT_CPU alone), the five would use 5 x 2 s before the last one died.
    assert 2000 <= r.usage.cpu_ms < 2 * 2000
    assert elapsed < 10


def test_an_endless_loop_under_a_short_timeout_ends_as_timeout(sandbox: Sandbox) -> None:
    started = time.monotonic()
    r = sandbox.run(SPIN, limits={"cpu_seconds": 30, "timeout": 1})
    elapsed = time.monotonic() - started
    assert r.status == "timeout"
    assert r.signal == "SIGKILL"
    assert elapsed < 4


def test_a_sleeping_program_does_not_use_cpu_time(sandbox: Sandbox) -> None:
    r = sandbox.run("import time\ntime.sleep(1.5)", limits={"cpu_seconds": 1, "timeout": 10})
    assert r.status == "ok"
