"""Used sandboxes are reaped as they end, not in batches (issue 25).

Seen before: after `Sandbox.close()` that followed 300 pooled runs from 4 threads, about
80 bwrap processes stayed zombies for up to 1.5 s. A used sandbox now waits for the reaper
in a graveyard of at most `_GRAVEYARD_MAX`; past that its releaser destroys it at once,
and `close()` destroys all that wait before it returns. So at any moment at most the
graveyard's sandboxes plus one per calling thread (its run just ended, not yet released)
can be exited-but-unwaited, and no process of the sandbox is there once `close()` has
returned.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import pytest

from codecage import Options, Sandbox
from codecage.backends.base import load_backend
from codecage.engine import forkserver
from codecage.engine.pool import _GRAVEYARD_MAX

pytestmark = [pytest.mark.timeout(240), pytest.mark.needs_root]

THREADS = 4
RUNS = 300


def _children() -> set[int]:
    found: set[int] = set()
    for task in Path(f"/proc/{os.getpid()}/task").iterdir():
        try:
            found.update(int(pid) for pid in (task / "children").read_text().split())
        except OSError:
            continue
    return found


def _zombie_children() -> list[int]:
    zombies = []
    for pid in _children():
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        if stat.rpartition(")")[2].split()[0] == "Z":
            zombies.append(pid)
    return zombies


@contextmanager
def _peak_zombies() -> Iterator[list[int]]:
    """Sample this process's zombie children every 2 ms; the peak is in the list's one item."""
    peak = [0]
    done = threading.Event()

    def watch() -> None:
        while not done.wait(0.002):
            peak[0] = max(peak[0], len(_zombie_children()))

    watcher = threading.Thread(target=watch, name="zombie-watch", daemon=True)
    watcher.start()
    try:
        yield peak
    finally:
        done.set()
        watcher.join()


@pytest.mark.parametrize("forked", [False, True], ids=["bwrap", "forked"])
def test_pooled_runs_from_four_threads_leave_no_zombie_batch(forked: bool) -> None:
    if forked and (why := forkserver.supported(load_backend("bwrap"))) is not None:
        pytest.skip(f"no fork server here: {why}")
    before = _children()
    sandbox = Sandbox(
        backend="bwrap",
        pool=True,
        options=Options(fork_server=forked, import_policy=False, scrub=False),
    )
    with _peak_zombies() as peak:
        with ThreadPoolExecutor(THREADS) as calls:
            statuses = list(calls.map(lambda i: sandbox.run(f"print({i})").status, range(RUNS)))
        during = peak[0]
        sandbox.close()
        left = sorted(_children() - before)
    assert statuses == ["ok"] * RUNS
    assert during <= _GRAVEYARD_MAX + THREADS, f"{during} zombies at once while runs went on"
    # Not even live ones: close() has killed and waited for every process it started.
    assert left == [], f"children of the closed sandbox after close() returned: {left}"
