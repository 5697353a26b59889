"""codecage's cgroup v2 path, on a host that runs cgroup v1 (issue 20).

A child process gets a mount namespace of its own and mounts a cgroup2 hierarchy over
/sys/fs/cgroup, where `isolation.cgroups` looks; it then drives the real functions and
prints what it saw. What cannot be tested here: memory, pids and cpu are bound to v1
hierarchies on this host, so v2 has none of them (only hugetlb), and memory.max, pids.max,
memory.peak and OOM counting are never exercised. hugetlb stands in for them where only
"some controller" matters (enabling controllers for a subtree, the no-internal-processes
rule). The hierarchy is the kernel's one unified hierarchy: the child removes what it made.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

import codecage

SRC = Path(codecage.__file__).resolve().parent.parent  # the codecage under test

COMMON = """
import json, os, subprocess, time
from codecage.errors import HostError
from codecage.isolation import cgroups
from codecage.models import Limits

root = cgroups.CGROUP_ROOT
out = {"controllers": (root / "cgroup.controllers").read_text().split()}

def fresh(controllers):
    cgroups._V2_CONTROLLERS = controllers
    cgroups.detect.cache_clear()
    cgroups.why_unavailable.cache_clear()
"""

AS_ROOT = """
out["own"] = cgroups._own_cgroups().get("")
out["real_detect"] = cgroups.detect() is not None
out["real_why"] = cgroups.why_unavailable()
out["real_probe"] = [layer.mechanism for layer in cgroups.probe()]
standin = ("hugetlb",)
made = []
sleepers = []

def sleeper():
    # Forks its second sleep only after a line on stdin: after it was moved.
    p = subprocess.Popen(["sh", "-c", "read x; sleep 60 & exec sleep 60"],
                         stdin=subprocess.PIPE, start_new_session=True)
    sleepers.append(p)
    return p

def wait_for(handle, n):
    deadline = time.monotonic() + 5
    while len(cgroups.pids_in(handle)) < n and time.monotonic() < deadline:
        time.sleep(0.01)
    return len(cgroups.pids_in(handle))

try:
    fresh(standin)
    support = cgroups.detect()
    out["support"] = None if support is None else [support.version, str(support.parents["unified"])]
    parent = support.parents["unified"]
    made.append(parent)
    out["root_subtree"] = (root / "cgroup.subtree_control").read_text().split()
    out["parent_subtree"] = (parent / "cgroup.subtree_control").read_text().split()

    try:
        cgroups.create("run-create", Limits())
        out["create"] = "made"
    except HostError as exc:
        out["create"] = str(exc)
    out["create_left_behind"] = (parent / "run-create").exists()

    handle = cgroups.CgroupHandle(2, {"unified": parent / "run-1"})
    handle.dirs["unified"].mkdir()
    made.insert(0, handle.dirs["unified"])
    p = sleeper()
    cgroups.attach(handle, p.pid)
    p.stdin.write(b"go\\n"); p.stdin.flush()
    out["pids_in"] = wait_for(handle, 2)
    out["cpu_ms"] = cgroups.cpu_usage_ms(handle)
    out["peak"] = cgroups.peak_memory_mb(handle)
    out["oom_kills"] = cgroups.oom_kills(handle)
    cgroups.kill_all(handle)
    out["after_kill"] = cgroups.pids_in(handle)
    out["sleeper_signal"] = -p.wait(5)
    cgroups.remove(handle)
    out["removed"] = not handle.dirs["unified"].exists()

    stale = cgroups.CgroupHandle(2, {"unified": parent / "run-stale"})
    stale.dirs["unified"].mkdir()
    made.insert(0, stale.dirs["unified"])
    q = sleeper()
    cgroups.attach(stale, q.pid)
    out["swept"] = cgroups.sweep_stale(lambda name: name == "run-stale")
    out["stale_gone"] = not stale.dirs["unified"].exists()
    out["stale_signal"] = -q.wait(5)

    # Not delegated: our own process sits in a non-root group, so no controller can be
    # enabled for its children (EBUSY), and detection must fall back.
    inner = root / "codecage-test-inner"
    inner.mkdir()
    made.insert(0, inner)
    (inner / "cgroup.procs").write_text(str(os.getpid()))
    fresh(standin)
    out["inner_own"] = cgroups._own_cgroups().get("")
    out["inner_detect"] = cgroups.detect() is not None
    out["inner_why"] = cgroups.why_unavailable()
finally:
    for p in sleepers:
        if p.poll() is None:
            p.kill()
            p.wait()
    (root / "cgroup.procs").write_text(str(os.getpid()))
    for d in [*made, root / "codecage-test-inner" / "codecage"]:
        try:
            d.rmdir()
        except OSError:
            pass
    for d in (root / "codecage-test-inner", root / "codecage"):
        try:
            d.rmdir()
        except OSError:
            pass
    try:
        (root / "cgroup.subtree_control").write_text("-hugetlb")
    except OSError:
        pass
print(json.dumps(out))
"""

IN_USERNS = """
out["euid"] = os.geteuid()
out["root_owner"] = os.stat(root).st_uid
fresh(("hugetlb",))
support = cgroups.detect()
out["detect"] = support is not None
out["why"] = cgroups.why_unavailable()
if support is not None:  # it should not be: undo what detection did
    support.parents["unified"].rmdir()
    (root / "cgroup.subtree_control").write_text("-hugetlb")
out["processes"] = [(l.mechanism, l.active) for l in cgroups.probe() if l.name == "processes"]
print(json.dumps(out))
"""


def _child(unshare: list[str], program: str) -> dict[str, Any]:
    if shutil.which("unshare") is None:
        pytest.fail("unshare (util-linux) is missing")
    script = (
        'mount -t cgroup2 none /sys/fs/cgroup && exec "$0" -c "$1"',
        sys.executable,
        textwrap.dedent(COMMON) + textwrap.dedent(program),
    )
    env = {**os.environ, "PYTHONPATH": str(SRC), "PYTHONDONTWRITEBYTECODE": "1"}
    proc = subprocess.run(
        [*unshare, "--propagation", "private", "sh", "-c", *script],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        stdin=subprocess.DEVNULL,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return dict(json.loads(proc.stdout.strip().splitlines()[-1]))


@pytest.mark.needs_root
def test_the_v2_path_on_a_cgroup2_mount_in_a_private_mount_namespace() -> None:
    if os.geteuid() != 0:
        pytest.skip("mounting the host's cgroup2 hierarchy needs root (the userns case is below)")
    out = _child(["unshare", "--mount"], AS_ROOT)
    # The real controllers: bound to v1 here, so v2 is detected as unusable, and said so.
    assert not {"memory", "pids", "cpu"} & set(out["controllers"])
    assert out["own"] == "/"
    assert out["real_detect"] is False
    assert "cgroup v2" in out["real_why"]
    assert out["real_probe"] == ["RLIMIT_AS", "RLIMIT_NPROC", "RLIMIT_CPU"]
    # With hugetlb standing in: detection enables it for codecage's subtree.
    assert out["support"] == [2, "/sys/fs/cgroup/codecage"]
    assert "hugetlb" in out["root_subtree"] and "hugetlb" in out["parent_subtree"]
    # create() writes memory.max, which needs the memory controller: a clear error, and
    # nothing left behind.
    assert out["create"].startswith("cannot set up the run's cgroup")
    assert out["create_left_behind"] is False
    # A run's group: a moved process and the child it forks afterwards are in it; CPU is
    # accounted (cpu.stat is core in v2); cgroup.kill kills both; the group is removed.
    assert out["pids_in"] == 2
    assert isinstance(out["cpu_ms"], int) and out["cpu_ms"] >= 0
    assert out["peak"] is None and out["oom_kills"] == 0  # no memory controller
    assert out["after_kill"] == []
    assert out["sleeper_signal"] == 9
    assert out["removed"] is True
    assert (out["swept"], out["stale_gone"], out["stale_signal"]) == (1, True, 9)
    # Our own process in a non-root group: no subtree can be delegated (EBUSY): fallback.
    assert out["inner_own"] == "/codecage-test-inner"
    assert out["inner_detect"] is False
    assert "cgroup v2 without a subtree delegated" in out["inner_why"]


def test_an_undelegated_cgroup2_root_in_a_user_namespace_falls_back_to_rlimits() -> None:
    # A user and cgroup namespace of our own: we are "root" in it, but the cgroup2 root
    # belongs to the real root (unmapped: the overflow uid), as when nothing is delegated.
    if os.geteuid() == 0:
        pytest.skip(
            "as root, the namespace's root is the real root, who owns the hierarchy: "
            "scripts/test-nonroot runs this as an ordinary user"
        )
    out = _child(["unshare", "--user", "--map-root-user", "--mount", "--cgroup"], IN_USERNS)
    assert out["euid"] == 0
    assert out["root_owner"] != 0
    assert out["detect"] is False
    assert "cgroup v2 without a subtree delegated" in out["why"]
    assert out["processes"] == [["RLIMIT_NPROC", False]]  # euid 0 in the namespace
