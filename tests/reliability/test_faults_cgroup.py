"""Faults, cgroup creation failing: codecage's parent cgroups made read-only for real (a
read-only bind mount of each over itself, in a private mount namespace of the host
process's own, so nothing else on the machine sees it) while a run is in flight, then
restored.

- A run asking for a new cgroup during the outage gets a clear HostError ("cannot set up
  the run's cgroup: ... Read-only file system" and a hint), or, from a warm pool, runs in a
  sandbox made before the outage.
- The run in flight finishes ok; its cgroup cannot be removed while the hierarchy is
  read-only, and is removed at the next run after the restore (a fix in
  isolation/cgroups.py: before it, it stayed until the host process exited).
- After the restore, runs work, and once the Sandbox is closed nothing of its runs is left.

On a cgroup v2 host `cgroup.max.descendants` would be another way in; the bind mount works
on both versions (this machine's is v1, which has no such knob).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import codecage
from codecage.isolation import cgroups

SOURCE = str(Path(codecage.__file__).resolve().parent.parent)  # this checkout's code

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or cgroups.detect() is None or shutil.which("unshare") is None,
    reason="needs root, delegated cgroups and unshare(1)",
)

HOST = r"""
import json, os, subprocess, sys, threading, time
from codecage import Sandbox
from codecage.isolation import cgroups

parents = [str(p) for p in cgroups.detect().parents.values()]
report = {}

def attempt(sandbox, code):
    try:
        r = sandbox.run(code, limits={"timeout": 30})
        return {"status": r.status, "value": r.return_value}
    except Exception as exc:
        return {"raised": type(exc).__name__, "message": str(exc), "hint": exc.hint}

def mine():
    own = f"{os.getpid()}-"
    return sorted(f"{p}/{d}" for p in parents for d in os.listdir(p) if d.startswith(own))

with Sandbox(pool=sys.argv[1] == "pool", allowed_imports=["time"]) as sandbox:
    report["before"] = attempt(sandbox, "1")
    in_flight = {}
    thread = threading.Thread(
        target=lambda: in_flight.update(attempt(sandbox, "import time; time.sleep(2); 'done'"))
    )
    thread.start()
    time.sleep(0.7)
    for p in parents:  # the outage
        subprocess.run(["mount", "--bind", p, p], check=True)
        subprocess.run(["mount", "-o", "remount,bind,ro", p], check=True)
    report["during"] = [attempt(sandbox, str(i)) for i in range(3)]
    thread.join()
    report["in_flight"] = in_flight
    for p in parents:  # the end of the outage
        subprocess.run(["umount", p], check=True)
    report["after"] = [attempt(sandbox, "6 * 7") for _ in range(2)]
report["left_after_close"] = mine()
print(json.dumps(report), flush=True)
"""


def outage(pooled: bool) -> dict[str, Any]:
    proc = subprocess.run(
        ["unshare", "-m", "--propagation", "private", sys.executable, "-c", HOST]
        + (["pool"] if pooled else ["no-pool"]),
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": SOURCE},
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report: dict[str, Any] = json.loads(proc.stdout.splitlines()[-1])
    print(json.dumps(report, indent=1)[:3000])
    return report


def test_a_run_without_a_cgroup_is_a_clear_host_error_and_runs_work_after() -> None:
    report = outage(pooled=False)
    assert report["before"] == {"status": "ok", "value": 1}
    for refused in report["during"]:
        assert refused["raised"] == "HostError", refused
        assert refused["message"].startswith("cannot set up the run's cgroup:")
        assert "Read-only file system" in refused["message"]
        assert "doctor" in refused["hint"]
    assert report["in_flight"] == {"status": "ok", "value": "done"}
    assert report["after"] == [{"status": "ok", "value": 42}] * 2
    assert report["left_after_close"] == []


def test_a_warm_pool_serves_through_a_cgroup_outage_and_refills_after() -> None:
    report = outage(pooled=True)
    assert report["in_flight"] == {"status": "ok", "value": "done"}
    for answer in report["during"]:
        # A warm sandbox (made before) serves; with none left, the error is clear.
        assert answer == {"status": "ok", "value": int(answer.get("value", -1))} or (
            answer.get("raised") == "HostError" and "cgroup" in answer["message"]
        ), answer
    assert report["after"] == [{"status": "ok", "value": 42}] * 2
    assert report["left_after_close"] == []
