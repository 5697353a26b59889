"""Issue 2, "nothing is left behind": a host process killed with SIGKILL cannot clean up
after itself; the next codecage process removes what it left (run dir, mount, cgroup)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from codecage import engine
from reliability._load import leftovers

HOST = """
import sys
from codecage import Sandbox
sb = Sandbox()
print("ready", flush=True)
sb.run("import time; print('started', flush=True); time.sleep(60)", limits={"timeout": 60})
"""


def test_a_killed_host_leaves_runs_that_the_next_process_removes() -> None:
    host = subprocess.Popen([sys.executable, "-c", HOST], stdout=subprocess.PIPE, text=True)
    assert host.stdout is not None
    assert host.stdout.readline().strip() == "ready"
    deadline = time.monotonic() + 30
    while not leftovers(host.pid) and time.monotonic() < deadline:
        time.sleep(0.02)
    time.sleep(0.3)  # let the run get going: mount, cgroup, sandbox
    os.kill(host.pid, signal.SIGKILL)
    host.wait()
    host.stdout.close()
    assert leftovers(host.pid), "the killed host should have left its run behind"

    assert engine.sweep_stale_runs() >= 1
    assert leftovers(host.pid) == []
    mounts = Path("/proc/self/mountinfo").read_text()
    assert f"codecage-run-{host.pid}-" not in mounts
