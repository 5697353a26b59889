"""Faults, space: a full workspace filesystem and a full state directory.

- The guest writes past its workspace's size (a size-limited tmpfs, as root): the write
  fails with ENOSPC in the guest, the run ends (an OSError if the code does not catch it)
  with a `workspace_full` event, and the host's own disk is untouched. Out of inodes too.
- A `codecage serve` whose audit store and journal live on a 1 MiB tmpfs that fills: every
  call is still answered, the server does not crash, and once there is room again the
  records of the runs made meanwhile are written.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from tests._disk import big_code, fill, small_tmpfs

from codecage import Limits, Options, Sandbox
from conftest import leak_snapshot
from reliability._faults import (
    call,
    new_leaks,
    recorded_ids,
    reply,
    send,
    serve,
)

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="size-limited tmpfs mounts need root")

FILL_WORKSPACE = """
chunk = b"x" * (1 << 20)
with open("big.bin", "wb") as out:
    for _ in range(64):  # 64 MiB into a 4 MiB workspace
        out.write(chunk)
"""

FILL_CAUGHT = """
written = 0
try:
    with open("big.bin", "wb") as out:
        for _ in range(64):
            written += out.write(b"x" * (1 << 20))
except OSError as exc:
    caught = exc.errno
print("still running")
[caught, written]
"""

MANY_FILES = """
made = 0
try:
    for i in range(200_000):
        open(f"f{i}", "w").close()
        made += 1
except OSError as exc:
    made = (made, exc.errno)
made
"""


@pytest.fixture(scope="module", params=[True, False], ids=["forked", "started"])
def sandbox(request: pytest.FixtureRequest) -> Iterator[Sandbox]:
    limits = Limits(workspace_mb=4, max_file_size_mb=64, timeout=60)
    with Sandbox(limits=limits, options=Options(fork_server=request.param, scrub=False)) as box:
        yield box


@needs_root
def test_writing_past_the_workspace_is_an_enospc_error_and_the_host_is_fine(
    sandbox: Sandbox,
) -> None:
    host_free = os.statvfs("/tmp").f_bavail
    result = sandbox.run(FILL_WORKSPACE)
    assert result.status == "error", (result.status, result.stderr)
    assert result.error is not None and result.error.type == "OSError"
    assert "No space left on device" in (result.error.message or "")
    assert [e.kind for e in result.events].count("workspace_full") == 1
    full = next(e for e in result.events if e.kind == "workspace_full")
    assert "raise --workspace-mb" in full.detail
    # The host's own disk did not pay for it (a generous bound: others share the machine).
    assert os.statvfs("/tmp").f_bavail * os.statvfs("/tmp").f_frsize > (
        host_free * os.statvfs("/tmp").f_frsize - 32 * (1 << 20)
    )
    assert sandbox.run("6 * 7").return_value == 42


@needs_root
def test_code_that_catches_enospc_goes_on_and_the_run_says_the_workspace_was_full(
    sandbox: Sandbox,
) -> None:
    result = sandbox.run(FILL_CAUGHT)
    assert result.status == "ok", (result.error, result.stderr)
    errno_seen, written = result.return_value
    assert errno_seen == 28  # ENOSPC
    assert written < 5 * (1 << 20)
    assert "still running" in result.stdout
    assert "workspace_full" in [e.kind for e in result.events]


@needs_root
def test_running_out_of_workspace_inodes_is_reported_too(sandbox: Sandbox) -> None:
    result = sandbox.run(MANY_FILES)
    assert result.status == "ok", (result.error, result.stderr)
    made, errno_seen = result.return_value
    assert errno_seen == 28, result.return_value
    assert "workspace_full" in [e.kind for e in result.events], (made, result.events)
    assert sandbox.run("6 * 7").return_value == 42


def test_nothing_of_the_full_workspaces_is_left() -> None:
    """Counted over the module's runs by conftest's leak_guard; this one run checks that a
    full workspace's tmpfs is unmounted and removed like any other."""
    before = leak_snapshot()
    with Sandbox(limits=Limits(workspace_mb=1), pool=False) as box:
        box.run(FILL_WORKSPACE)
    assert not new_leaks(before)


# --- a full state directory ------------------------------------------------------------


@pytest.fixture
def small_state(tmp_path: Path) -> Iterator[Path]:
    """A 1 MiB tmpfs to hold the server's audit store and journal."""
    with small_tmpfs(tmp_path / "state") as where:
        yield where


def test_a_server_whose_state_directory_fills_answers_every_call_and_recovers(
    small_state: Path, tmp_path: Path
) -> None:
    db = small_state / "audit.db"
    with serve(tmp_path, CODECAGE_AUDIT=str(db)) as proc:
        send(proc, call(1, {"code": big_code(0)}))
        first = reply(proc)["result"]["structuredContent"]
        filler = fill(small_state)
        during = []
        for i in range(1, 4):
            send(proc, call(10 + i, {"code": big_code(i)}))
            answer = reply(proc)
            assert "result" in answer, answer  # answered, not a JSON-RPC error
            during.append(answer["result"]["structuredContent"])
        assert all(r["status"] == "ok" for r in during), during
        assert proc.poll() is None, "the server is still up"
        filler.unlink()
        send(proc, call(20, {"code": "print('room again')"}))
        after = reply(proc)["result"]["structuredContent"]
        assert after["status"] == "ok"
    stderr = "".join(p.read_text(encoding="utf-8") for p in tmp_path.glob("stderr-*.log"))
    assert "audit.write_failed" in stderr, "the failing store is reported"
    expected = {r["execution_id"] for r in [first, *during, after]}
    assert expected <= recorded_ids(db)
