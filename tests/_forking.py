"""A function run in a forked child of the test process, for tests of fork safety: what a
pre-forking server or `multiprocessing` (fork) does to codecage objects made before it."""

from __future__ import annotations

import contextlib
import os
import select
import signal
from collections.abc import Callable


def in_forked_child(
    work: Callable[[], bytes],
    *,
    timeout: float,
    after_fork: Callable[[], None] = lambda: None,
) -> bytes | None:
    """The bytes `work()` returns in a forked child; None when it does not finish within
    `timeout` (the child is killed), b"" when it raised. `after_fork` runs in the parent
    right after the fork."""
    read_end, write_end = os.pipe()
    child = os.fork()
    if child == 0:
        try:
            os.close(read_end)
            os.write(write_end, work())
        finally:
            os._exit(0)  # no atexit, no pytest teardown: those are the parent's
    os.close(write_end)
    after_fork()
    try:
        with os.fdopen(read_end, "rb") as reader:
            ready, _, _ = select.select([reader], [], [], timeout)
            return reader.read() if ready else None
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, signal.SIGKILL)  # a child stuck (on a lock, a dead loop) ends here
        os.waitpid(child, 0)
