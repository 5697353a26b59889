"""What a run printed before it was killed reaches the host, however the run ends (issue
21: the guest's stdout was block-buffered and flushed only at a normal exit). None of these
programs flushes: that is the point."""

from __future__ import annotations

import pytest

from codecage import Sandbox

pytestmark = pytest.mark.timeout(60)

CASES = {
    "timeout": (
        "print('working...')\nimport time\ntime.sleep(60)",
        {"timeout": 2},
        "timeout",
    ),
    "memory_limit": (
        "print('allocating...')\nheld = []\nwhile True:\n    held.append(b'x' * (32 << 20))",
        {"memory_mb": 128, "timeout": 20},
        "memory_limit",
    ),
    "cpu_limit": (
        "print('spinning...')\nwhile True:\n    pass",
        {"cpu_seconds": 1, "timeout": 20},
        "cpu_limit",
    ),
    "os._exit": (
        "print('leaving...')\nimport os\nos._exit(3)",
        {"timeout": 10},
        "error",
    ),
    "killed by a signal": (
        "print('dying...')\nimport os, signal\nos.kill(os.getpid(), signal.SIGKILL)",
        {"timeout": 10},
        "killed",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_output_printed_before_the_end_is_kept(sandbox: Sandbox, case: str) -> None:
    code, limits, status = CASES[case]
    r = sandbox.run(code, limits=limits)
    assert r.status == status, (r.status, r.stderr[-500:])
    said = code.split("'")[1]
    assert said in r.stdout, (case, r.stdout, r.stderr[-500:])


def test_output_of_a_forked_child_killed_by_the_timeout_is_kept(sandbox: Sandbox) -> None:
    code = (
        "import os, time\n"
        "if os.fork() == 0:\n"
        "    print('child working...')\n"
        "    time.sleep(60)\n"
        "os.wait()\n"
    )
    r = sandbox.run(code, limits={"timeout": 2})
    assert r.status == "timeout"
    assert "child working..." in r.stdout
