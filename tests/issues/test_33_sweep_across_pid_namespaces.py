"""Issue 33, item 6: the stale sweep never removes a live run, whatever PID namespace the
sweeper is in.

The sweep decided liveness with `kill(pid, 0)` in its own PID namespace: a codecage started
in another one (a container, `unshare --pid`) saw every host process as gone and wiped every
live run of the host (its run dir, workspace mount and cgroup, the sandbox killed with it).
Liveness is now an owner lock (`engine.owner`) that a live process holds and the kernel drops
when it ends. Each test runs the sweep for real in a new PID namespace (`unshare --pid
--fork --mount-proc`, same /run, /tmp and cgroup fs) beside a real run in this one.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from tests._proc import end

from codecage.audit import journal, open_store
from codecage.engine import owner
from codecage.engine import workspace as workspaces
from reliability._load import leftovers

pytestmark = pytest.mark.skipif(
    shutil.which("unshare") is None or os.geteuid() != 0,
    reason="needs unshare(1) and root to make a PID namespace",
)

HOST = """
import json, sys
from codecage import Sandbox
code = '''
import os, time
open("/workspace/started", "w").close()
deadline = time.monotonic() + 120
while not os.path.exists("/workspace/go") and time.monotonic() < deadline:
    time.sleep(0.02)
print("went", os.path.exists("/workspace/go"))
'''
result = Sandbox().run(code, workspace=sys.argv[1], limits={"timeout": 150})
print(json.dumps({"status": result.status, "stdout": result.stdout}), flush=True)
"""


SAME_MOUNTS = ("--pid", "--fork")
OWN_MOUNTS = ("--pid", "--fork", "--mount-proc")
"""A new PID namespace with this one's mount table, or with a copy of it of its own."""


def in_another_pid_namespace(code: str, how: tuple[str, ...] = SAME_MOUNTS) -> str:
    """Run `code` with this interpreter in a new PID namespace (where no process of this
    one has its pid: its own is 1), return its stdout."""
    done = subprocess.run(
        ["unshare", *how, sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


SWEEP = (
    "import os\n"
    "from codecage.engine.launch import sweep_stale_runs\n"
    "assert os.getpid() < 10, os.getpid()  # a new PID namespace: the host's pids are not here\n"
    "print(sweep_stale_runs())\n"
)


def contents(paths: list[str]) -> list[str]:
    """Every name under `paths` (run dirs and cgroups; the workspace lent to the run too)."""
    return sorted(str(p) for top in paths for p in Path(top).rglob("*"))


def wait_for(path: Path, proc: subprocess.Popen[str]) -> None:
    deadline = time.monotonic() + 120
    while not path.exists():
        assert proc.poll() is None, "the host ended before its run started"
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.05)


@contextlib.contextmanager
def host_running(workspace: Path) -> Iterator[subprocess.Popen[str]]:
    """A codecage process whose run is under way (it waits for workspace/go)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", HOST, str(workspace)], stdout=subprocess.PIPE, text=True
    )
    try:
        wait_for(workspace / "started", proc)
        yield proc
    finally:
        end(proc)


EPHEMERAL_HOST = """
import sys
from codecage import Sandbox
def said(stream, text):
    if "started" in text:
        print("started", flush=True)
Sandbox().run(
    "import time; print('started', flush=True); time.sleep(120)",
    limits={"timeout": 150},
    on_output=said,
)
"""


def guardian_of(host: int) -> int:
    for task in Path("/proc").iterdir():
        with contextlib.suppress(OSError, ValueError):
            stat = (task / "stat").read_text().rpartition(")")[2].split()
            cmdline = (task / "cmdline").read_bytes()
            if int(stat[1]) == host and b"codecage.engine.guardian" in cmdline:
                return int(task.name)
    pytest.fail(f"no guardian under {host}")


@pytest.mark.parametrize("how", [SAME_MOUNTS, OWN_MOUNTS], ids=["same-mounts", "own-mounts"])
def test_a_sweep_in_another_pid_namespace_leaves_a_live_run_alone(
    how: tuple[str, ...], tmp_path: Path
) -> None:
    with host_running(tmp_path) as host:
        before = leftovers(host.pid)
        assert before, "the live run has a run dir (and a cgroup where there are cgroups)"
        inside = contents(before)
        in_another_pid_namespace(SWEEP, how)
        assert leftovers(host.pid) == before, "the sweep removed a live run's dir or cgroup"
        assert contents(before) == inside, "the sweep removed files of a live run"
        assert (tmp_path / "started").exists(), "the sweep emptied the live run's workspace"
        (tmp_path / "go").touch()
        assert host.stdout is not None
        result = json.loads(host.stdout.readline())
        assert host.wait(timeout=60) == 0
    assert result == {"status": "ok", "stdout": "went True\n"}


def test_a_sweep_in_another_pid_namespace_removes_a_killed_processs_run() -> None:
    # An ephemeral workspace (a tmpfs in the run dir), so that nothing of the test's lies
    # in what is swept.
    with subprocess.Popen(
        [sys.executable, "-c", EPHEMERAL_HOST], stdout=subprocess.PIPE, text=True
    ) as host:
        assert host.stdout is not None
        assert host.stdout.readline().strip() == "started"
        # Its guardian would sweep as soon as it is gone: here the sweep must do it.
        os.kill(guardian_of(host.pid), signal.SIGKILL)
        host.kill()
    left = leftovers(host.pid)
    assert left, "the killed host should have left its run behind"
    wait_for_sandbox_gone(left)
    assert int(in_another_pid_namespace(SWEEP)) >= 1
    assert leftovers(host.pid) == []
    assert f"codecage-run-{host.pid}-" not in Path("/proc/self/mountinfo").read_text()


def test_a_sweep_unmounts_a_dead_runs_lent_workspace_and_leaves_its_files(
    tmp_path: Path,
) -> None:
    """The lent workspace is bound in the run dir from the same filesystem here (same
    st_dev as /run): the sweep must see the mount (by its mount id) and detach it, never
    empty it as if it were the run's own tree."""
    with host_running(tmp_path) as host:
        os.kill(guardian_of(host.pid), signal.SIGKILL)
        host.kill()
        host.wait()
    left = leftovers(host.pid)
    wait_for_sandbox_gone(left)
    in_another_pid_namespace(SWEEP)
    assert (tmp_path / "started").exists(), "the sweep deleted the lent workspace's files"
    assert leftovers(host.pid) == []


def wait_for_sandbox_gone(left: list[str]) -> None:
    """A killed host's sandbox dies with it (--die-with-parent), a moment later. A sweeper
    in another PID namespace cannot signal it (cgroup v1 lists none of its pids there, and
    has no cgroup.kill): wait for that, as a sweep after a host's death would find it."""
    procs = [Path(d, "cgroup.procs") for d in left if Path(d, "cgroup.procs").exists()]

    def running(procs_file: Path) -> bool:
        try:
            return bool(procs_file.read_text().strip())
        except FileNotFoundError:
            return False

    deadline = time.monotonic() + 60
    while any(running(p) for p in procs):
        assert time.monotonic() < deadline, "the killed host's sandbox is still running"
        time.sleep(0.05)


JOURNAL_WRITER = """
import sys, time
from pathlib import Path
from codecage.audit import journal
j = journal.Journal(Path(sys.argv[1]))
j.append_locked(b"not a record\\n")
print(j.path, flush=True)
sys.stdin.read()
"""


def test_a_live_processs_audit_journal_is_not_recovered_from_another_pid_namespace(
    tmp_path: Path,
) -> None:
    db = tmp_path / "audit.db"
    directory = journal.directory_for(str(db))
    open_store(db).close()
    recover = textwrap.dedent(
        f"""
        from pathlib import Path
        from codecage.audit import journal, open_store
        store = open_store(Path({str(db)!r}))
        journal.recover(store, Path({str(directory)!r}))
        store.close()
        """
    )
    with subprocess.Popen(
        [sys.executable, "-c", JOURNAL_WRITER, str(directory)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    ) as writer:
        assert writer.stdout is not None and writer.stdin is not None
        path = Path(writer.stdout.readline().strip())
        in_another_pid_namespace(recover, OWN_MOUNTS)
        assert path.exists(), "a live process's journal was taken as a dead one's"
        writer.stdin.close()
        writer.wait(timeout=30)
    in_another_pid_namespace(recover)
    assert not path.exists(), "a dead process's journal is recovered (and deleted)"


def test_an_entry_whose_owner_file_is_missing_is_left_alone() -> None:
    """No owner file: another user's, another private parent's or an older codecage's
    entry, whose liveness cannot be known here (engine.owner)."""
    entry = workspaces.private_parent() / f"codecage-run-1-{'0' * 16}-orphan{os.getpid()}"
    entry.mkdir()
    try:
        in_another_pid_namespace(SWEEP)
        assert entry.is_dir()
    finally:
        entry.rmdir()


def test_a_dead_owners_file_goes_once_nothing_named_after_it_is_left() -> None:
    parent = workspaces.private_parent()
    key = f"{os.getpid()}-{'f' * 16}"
    lock = parent / f"{owner.LOCK_PREFIX}{key}"
    lock.touch(mode=0o600)  # as a killed process leaves it: unlocked
    entry = parent / f"codecage-run-{key}-left"
    entry.mkdir()
    assert int(in_another_pid_namespace(SWEEP)) >= 1
    assert not entry.exists() and not lock.exists()
