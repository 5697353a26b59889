"""Cancelling a run kills its sandbox: the library's `cancel` event and `arun`'s task
cancellation (what the MCP server does when a client goes away)."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from pathlib import Path

import pytest

from codecage import Options, Sandbox
from codecage.engine import RUN_DIR_PREFIX
from codecage.engine import workspace as workspaces

SLEEPER = "import time\nprint('started', flush=True)\ntime.sleep(30)\n'finished'"


def _own_run_dirs() -> list[Path]:
    return list(workspaces.private_parent().glob(f"{RUN_DIR_PREFIX}{os.getpid()}-*"))


def _cancel_after(event: threading.Event, seconds: float) -> threading.Timer:
    timer = threading.Timer(seconds, event.set)
    timer.start()
    return timer


@pytest.mark.parametrize("pool", [False, True], ids=["cold", "warm"])
def test_setting_the_cancel_event_kills_the_run_and_says_so(pool: bool) -> None:
    with Sandbox(pool=pool, options=Options(import_policy=False)) as sandbox:
        if pool:
            assert sandbox.warm(60)
        cancel = threading.Event()
        timer = _cancel_after(cancel, 0.5)
        started = time.monotonic()
        r = sandbox.run(SLEEPER, limits={"timeout": 20}, cancel=cancel)
        timer.join()
    assert time.monotonic() - started < 5
    assert (r.status, r.signal) == ("killed", "SIGKILL")
    assert "cancelled" in [e.kind for e in r.events]
    assert r.return_value is None
    assert "started" in r.stdout


def test_an_unset_cancel_event_changes_nothing() -> None:
    r = Sandbox(pool=False, options=Options(import_policy=False)).run(
        "6 * 7", cancel=threading.Event()
    )
    assert (r.status, r.return_value) == ("ok", 42)
    assert "cancelled" not in [e.kind for e in r.events]


def test_cancelling_an_arun_task_kills_its_sandbox() -> None:
    sandbox = Sandbox(pool=False, options=Options(import_policy=False))
    sandbox.run("1")  # a fork server's template (a run dir of its own) is up by now
    before = set(_own_run_dirs())

    async def cancel_midway() -> None:
        task = asyncio.create_task(sandbox.arun(SLEEPER, limits={"timeout": 25}))
        deadline = time.monotonic() + 10
        while not set(_own_run_dirs()) - before:  # the sandbox exists
            assert time.monotonic() < deadline, "the run never started"
            await asyncio.sleep(0.02)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        # Checked here, not after asyncio.run: that waits for the worker thread, which
        # would hide a sandbox left to run until its 25 s timeout.
        deadline = time.monotonic() + 5
        while set(_own_run_dirs()) - before:
            assert time.monotonic() < deadline, "the cancelled run's sandbox is still there"
            await asyncio.sleep(0.05)

    asyncio.run(cancel_midway())
