"""Issue 36: scripts/setup waits for another apt that holds dpkg's lock, for a bounded time,
and says that it is waiting (it failed with "Could not get lock
/var/lib/dpkg/lock-frontend"). The script's own apt functions, run by bash, against a real
fcntl lock held by another process on a lock file of the test's (the real dpkg lock is not
touched), with a stand-in apt-get on PATH: this test must not install Debian packages."""

from __future__ import annotations

import os
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[2]
HOLD = (
    "import fcntl, sys\n"
    "f = open(sys.argv[1], 'w')\n"
    "fcntl.lockf(f, fcntl.LOCK_EX)\n"
    "print('held', flush=True)\n"
    "sys.stdin.read()\n"
)
# The script's say() and apt functions, as they are in scripts/setup, then one apt call.
SCRIPT = (
    "set -euo pipefail\n"
    "source <(sed -n '/^say()/p; /^apt_lock_wait=/,/^install_debian_packages()/p' "
    "scripts/setup | sed '$d')\n"
    'apt_locks=("$TEST_LOCK")\n'
    "apt_get install -y -qq bubblewrap\n"
)


def _fake_apt(tmp_path: Path) -> tuple[Path, Path]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "apt-calls"
    fake = bin_dir / "apt-get"
    fake.write_text(f'#!/bin/sh\necho "$*" >> {calls}\n', encoding="utf-8")
    fake.chmod(0o755)
    return bin_dir, calls


def _setup_functions(tmp_path: Path, lock: Path, wait_s: int) -> subprocess.Popen[str]:
    bin_dir, _ = _fake_apt(tmp_path)
    env = {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "TEST_LOCK": str(lock),
        "CODECAGE_APT_LOCK_WAIT": str(wait_s),
    }
    return subprocess.Popen(
        ["bash", "-c", SCRIPT], cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True
    )


def _holder(lock: Path) -> subprocess.Popen[str]:
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(lock)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdout is not None and holder.stdout.readline() == "held\n"
    return holder


def test_setup_waits_for_the_lock_says_so_then_runs_apt(tmp_path: Path) -> None:
    lock = tmp_path / "lock-frontend"
    lock.touch()
    holder = _holder(lock)
    setup = _setup_functions(tmp_path, lock, wait_s=600)
    assert setup.stderr is not None
    said = ""
    deadline = time.monotonic() + 60
    while "waiting" not in said and time.monotonic() < deadline:
        if select.select([setup.stderr], [], [], 1)[0]:
            said += setup.stderr.readline()
    assert f"waiting for another apt to finish (process {holder.pid} holds" in said, said
    assert not (tmp_path / "apt-calls").exists()  # not while the lock is held
    holder.communicate("")  # the other apt finishes
    setup.communicate(timeout=60)
    assert setup.returncode == 0
    calls = (tmp_path / "apt-calls").read_text(encoding="utf-8")
    assert calls.startswith("-o DPkg::Lock::Timeout=") and "install -y -qq bubblewrap" in calls


def test_setup_waits_a_bounded_time_and_leaves_the_rest_to_apt(tmp_path: Path) -> None:
    lock = tmp_path / "lock-frontend"
    lock.touch()
    holder = _holder(lock)
    try:
        setup = _setup_functions(tmp_path, lock, wait_s=2)
        _, err = setup.communicate(timeout=60)
    finally:
        holder.communicate("")
    assert setup.returncode == 0 and "waiting for another apt" in err
    calls = (tmp_path / "apt-calls").read_text(encoding="utf-8")
    assert calls.startswith("-o DPkg::Lock::Timeout=1 install")


def test_without_a_lock_holder_apt_runs_at_once_and_nothing_is_said(tmp_path: Path) -> None:
    lock = tmp_path / "lock-frontend"
    lock.touch()
    setup = _setup_functions(tmp_path, lock, wait_s=600)
    _, err = setup.communicate(timeout=60)
    assert setup.returncode == 0 and "waiting" not in err
    calls = (tmp_path / "apt-calls").read_text(encoding="utf-8")
    assert calls.startswith("-o DPkg::Lock::Timeout=600 install")
