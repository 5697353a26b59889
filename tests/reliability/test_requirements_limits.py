"""Requirement: the per-process limits of docs/configuration.md's limits table, as the guest
sees them in a real sandbox (resource.getrlimit) and as a write past them fails.

    cpu_seconds       RLIMIT_CPU per process (SIGXCPU at the limit, SIGKILL a second later)
    max_open_files    RLIMIT_NOFILE
    max_file_size_mb  RLIMIT_FSIZE: a larger write fails with [Errno 27] File too large
    max_processes     pids.max = value + 1 for bwrap's init; RLIMIT_NPROC
    memory_mb         a memory cgroup; without one, RLIMIT_AS per process

The numbers are chosen unlike every default, so that a limit that is not passed through
shows.
"""

from __future__ import annotations

import errno
import resource
from collections.abc import Iterator
from typing import Any

import pytest

from codecage import Options, Sandbox
from codecage.isolation import cgroups
from codecage.isolation.rlimits import guest_limits
from codecage.models import Limits

MiB = 1024 * 1024
ASKED = {
    "cpu_seconds": 7,
    "max_open_files": 77,
    "max_file_size_mb": 3,
    "max_processes": 21,
    "memory_mb": 300,
    "timeout": 60,
}

GUEST = """
import resource
names = ["RLIMIT_CPU", "RLIMIT_NOFILE", "RLIMIT_FSIZE", "RLIMIT_NPROC", "RLIMIT_AS"]
seen = {name: list(resource.getrlimit(getattr(resource, name))) for name in names}
with open("/tmp/exact.bin", "wb") as f:
    f.write(b"x" * (3 * 1024 * 1024))
try:
    with open("/tmp/over.bin", "wb") as f:
        f.write(b"x" * (3 * 1024 * 1024 + 1))
    seen["over"] = 0
except OSError as exc:
    seen["over"] = exc.errno
seen
"""


@pytest.fixture(scope="module")
def seen() -> Iterator[dict[str, Any]]:
    with Sandbox(pool=False, options=Options(import_policy=False, scrub=False)) as box:
        result = box.run(GUEST, limits=ASKED)
    assert result.status == "ok", (result.error, result.stderr[-500:])
    yield result.return_value


def test_cpu_seconds_is_the_soft_rlimit_cpu_and_sigkill_follows_a_second_later(
    seen: dict[str, Any],
) -> None:
    # The soft limit counts from what the guest used before the request (a warm start-up,
    # well under the 3 s allowed here): the code itself gets its cpu_seconds.
    soft, hard = seen["RLIMIT_CPU"]
    assert ASKED["cpu_seconds"] <= soft <= ASKED["cpu_seconds"] + 3
    assert hard == soft + 1


def test_max_open_files_is_rlimit_nofile(seen: dict[str, Any]) -> None:
    assert seen["RLIMIT_NOFILE"] == [ASKED["max_open_files"]] * 2


def test_max_file_size_is_rlimit_fsize_and_a_larger_write_fails_efbig(
    seen: dict[str, Any],
) -> None:
    assert seen["RLIMIT_FSIZE"] == [ASKED["max_file_size_mb"] * MiB] * 2
    assert seen["over"] == errno.EFBIG


def test_processes_are_bounded_by_max_processes_and_bwraps_init(seen: dict[str, Any]) -> None:
    # With a pids cgroup, pids.max holds them (tests/containment/test_pids.py) and a sandbox
    # that shares the user namespace has no RLIMIT_NPROC; otherwise RLIMIT_NPROC does.
    if cgroups.detect() is not None:
        pytest.skip("the pids cgroup bounds the processes here (tests/containment/test_pids.py)")
    assert seen["RLIMIT_NPROC"] == [ASKED["max_processes"] + 1] * 2


def test_rlimit_as_stands_in_for_memory_only_without_a_cgroup(seen: dict[str, Any]) -> None:
    by_cgroup = cgroups.detect() is not None
    expected = resource.RLIM_INFINITY if by_cgroup else ASKED["memory_mb"] * MiB
    assert seen["RLIMIT_AS"] == [expected] * 2


@pytest.mark.parametrize("by_cgroup", [False, True])
def test_the_guest_is_asked_for_the_documented_rlimits_with_and_without_a_cgroup(
    by_cgroup: bool,
) -> None:
    # The host side of the table above, for both kinds of host (this one has a cgroup, so
    # the sandbox run covers only one): RLIMIT_AS stands in for memory without a cgroup;
    # RLIMIT_NPROC counts max_processes and bwrap's init; a session's CPU budget is passed on.
    limits = Limits(**{k: v for k, v in ASKED.items() if k != "timeout"})
    asked = guest_limits(limits, by_cgroup=by_cgroup, session_cpu_seconds=99)
    assert asked.cpu_seconds == ASKED["cpu_seconds"]
    assert asked.max_open_files == ASKED["max_open_files"]
    assert asked.max_file_size_bytes == ASKED["max_file_size_mb"] * MiB
    assert asked.max_processes == ASKED["max_processes"] + 1
    assert asked.address_space_bytes == (None if by_cgroup else ASKED["memory_mb"] * MiB)
    assert asked.session_cpu_seconds == 99
