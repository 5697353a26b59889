"""Faults, the host process itself SIGKILLed mid-run: a `codecage serve --audit DB` (stdio)
that has answered some runs and has one in flight is killed with SIGKILL.

- Its guardian (engine/guardian.py) then removes what it left, and the sandboxes die with it.
- Killed together with its guardian (a machine-wide kill, the OOM killer taking both), it
  leaves its run dir, mounts and cgroups; the next `codecage serve` sweeps them at start.
- Either way no finished record is lost: every run whose answer came back is in the store
  the next start opens (from the dead server's journal if not already in it).
"""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path

import pytest

from reliability._faults import (
    SLEEPER,
    alive,
    answered_runs,
    call,
    descendants,
    only_in_full,
    recorded_ids,
    send,
    serve,
    sleeping_guests,
    wait_for,
)
from test_server import gone_soon, left_behind


def guardian_of(server: int) -> int:
    for pid in descendants(server):
        with contextlib.suppress(OSError):
            if b"codecage.engine.guardian" in Path(f"/proc/{pid}/cmdline").read_bytes():
                return pid
    pytest.fail(f"no guardian under the server {server}")


@pytest.mark.parametrize(
    "with_guardian",
    # The guardian's own sweep after a SIGKILL is test_server.py's too (gone_soon).
    [pytest.param(False, marks=only_in_full), True],
    ids=["server", "server+guardian"],
)
def test_a_server_sigkilled_mid_run_is_swept_and_loses_no_finished_record(
    tmp_path: Path, with_guardian: bool
) -> None:
    db = tmp_path / "audit.db"
    with serve(tmp_path, "--audit", str(db)) as proc:
        finished = answered_runs(proc, 3)
        send(proc, call(99, {"code": SLEEPER, "timeout": 110, "allowed_imports": ["threading"]}))
        guest = wait_for(lambda: sleeping_guests(proc.pid), "the in-flight run to start")[0]
        guardian = guardian_of(proc.pid)
        if with_guardian:
            os.kill(guardian, signal.SIGKILL)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    wait_for(lambda: not alive(guest), "the in-flight sandbox to die with its host", 10)
    if with_guardian:
        left = left_behind(proc.pid)
        assert left, "killed with its guardian, the server should have left its run behind"
    else:
        assert gone_soon(proc.pid) == {}, "the guardian removes what its server left"
    # The next start: sweeps what is left, and the store has every finished run.
    # `serve` answers initialize before its host is built (the sweep is part of that build):
    # a run waits for the build, so by its answer the sweep is done.
    with serve(tmp_path, "--audit", str(db)) as again:
        after = answered_runs(again, 1)
        assert left_behind(proc.pid) == {}, "the next start sweeps the dead server's runs"
    assert set(finished) | set(after) <= recorded_ids(db)
