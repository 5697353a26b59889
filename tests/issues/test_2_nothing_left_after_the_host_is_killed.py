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
from codecage.engine import workspace as workspaces
from codecage.isolation import cgroups

HOST = """
import sys
from codecage import Sandbox
sb = Sandbox()
print("ready", flush=True)
sb.run("import time; print('started', flush=True); time.sleep(60)", limits={"timeout": 60})
"""


def _leftovers(pid: int) -> list[str]:
    found = [str(p) for p in workspaces.private_parent().glob(f"codecage-run-{pid}-*")]
    support = cgroups.detect()
    if support is not None:
        for parent in support.parents.values():
            found += [str(d) for d in parent.glob(f"{pid}-*")]
    return found


def test_a_killed_host_leaves_runs_that_the_next_process_removes() -> None:
    host = subprocess.Popen([sys.executable, "-c", HOST], stdout=subprocess.PIPE, text=True)
    assert host.stdout is not None
    assert host.stdout.readline().strip() == "ready"
    deadline = time.monotonic() + 30
    while not _leftovers(host.pid) and time.monotonic() < deadline:
        time.sleep(0.02)
    time.sleep(0.3)  # let the run get going: mount, cgroup, sandbox
    os.kill(host.pid, signal.SIGKILL)
    host.wait()
    host.stdout.close()
    assert _leftovers(host.pid), "the killed host should have left its run behind"

    assert engine.sweep_stale_runs() >= 1
    assert _leftovers(host.pid) == []
    mounts = Path("/proc/self/mountinfo").read_text()
    assert f"codecage-run-{host.pid}-" not in mounts
