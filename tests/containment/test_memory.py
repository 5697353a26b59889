"""Memory layer: the memory cgroup bounds the whole sandbox, tmpfs and memfd pages
included (Limits.memory_mb), and a run killed by it ends as "memory_limit".

These run only in the real sandbox: on the null runner a memory bomb would eat the host.
"""

from __future__ import annotations

import os

import pytest

from codecage import ExecutionResult, Sandbox
from codecage.isolation import cgroups

pytestmark = pytest.mark.timeout(60)

MEMORY_MB = 64
SLACK_MB = 4

GROWTH = """
chunks = bytearray()
while True:
    chunks += b"x" * (1 << 20)
"""

FILL_FILE = """
with open({path!r}, "wb") as f:
    for _ in range(200):
        f.write(b"x" * (1 << 20))
"done"
"""

FILL_MEMFD = """
import os
fd = os.memfd_create("fill")
for _ in range(200):
    os.write(fd, b"x" * (1 << 20))
"done"
"""

# Four processes of 24 MiB each: none is over the limit alone, together they are.
SPREAD = """
import os, sys, time
children = []
for _ in range(4):
    pid = os.fork()
    if pid == 0:
        block = b"x" * (24 << 20)
        time.sleep(1)
        os._exit(0)
    children.append(pid)
killed = [pid for pid in children if os.WIFSIGNALED(os.waitpid(pid, 0)[1])]
if killed:
    sys.exit(f"{len(killed)} children were killed")
"""


@pytest.fixture(autouse=True)
def _needs_memory_cgroup() -> None:
    # As an ordinary user they run, as strict xfails by name (_hostmode.NONROOT_GAPS).
    if cgroups.detect() is None and os.geteuid() == 0:
        pytest.skip("no writable cgroup: RLIMIT_AS is per process and does not count tmpfs")


def _assert_killed_at_the_limit(r: ExecutionResult) -> None:
    assert r.status == "memory_limit", (r.status, r.error, r.stderr[-500:])
    assert r.error is not None and r.error.type == "MemoryError"
    assert r.return_value is None
    assert r.usage.peak_memory_mb is not None
    assert r.usage.peak_memory_mb <= MEMORY_MB + SLACK_MB


def test_a_memory_bomb_ends_as_memory_limit(sandbox: Sandbox) -> None:
    r = sandbox.run(GROWTH, limits={"memory_mb": MEMORY_MB, "timeout": 20})
    _assert_killed_at_the_limit(r)


@pytest.mark.parametrize(
    "code",
    [
        pytest.param(FILL_FILE.format(path="/tmp/fill"), id="tmp-tmpfs"),
        pytest.param(FILL_FILE.format(path="/dev/shm/fill"), id="dev-shm"),
        pytest.param(FILL_MEMFD, id="memfd"),
    ],
)
def test_memory_held_in_tmpfs_or_memfd_counts_against_the_limit(
    sandbox: Sandbox, code: str
) -> None:
    # /tmp is made far larger than the memory limit, so only the memory limit can stop it.
    r = sandbox.run(code, limits={"memory_mb": MEMORY_MB, "tmp_mb": 512, "timeout": 20})
    _assert_killed_at_the_limit(r)


def test_kernel_memory_of_many_empty_files_counts_against_the_limit(sandbox: Sandbox) -> None:
    # Empty files cost no tmpfs size, only inodes and dentries: kernel memory.
    code = (
        "import os\n"
        "for n in range(1_000_000):\n"
        "    os.close(os.open(f'/tmp/{n}', os.O_CREAT | os.O_WRONLY, 0o600))\n"
    )
    r = sandbox.run(code, limits={"memory_mb": MEMORY_MB, "timeout": 20})
    _assert_killed_at_the_limit(r)


def test_the_limit_is_for_the_sandbox_as_a_whole_not_per_process(sandbox: Sandbox) -> None:
    r = sandbox.run(SPREAD, limits={"memory_mb": MEMORY_MB, "timeout": 20})
    assert r.status == "memory_limit", (r.status, r.error, r.stderr[-500:])


def test_peak_memory_is_reported_and_below_the_limit(sandbox: Sandbox) -> None:
    r = sandbox.run("block = b'x' * (16 << 20)\nlen(block)", limits={"memory_mb": MEMORY_MB})
    assert r.status == "ok"
    assert r.usage.peak_memory_mb is not None
    assert 16 <= r.usage.peak_memory_mb <= MEMORY_MB
