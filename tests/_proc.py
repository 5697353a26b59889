"""Processes a test started or watches: what /proc says of one, watching some while a block
runs, and ending one."""

from __future__ import annotations

import contextlib
import subprocess
import threading
from pathlib import Path
from typing import Any, Self


def cmdline(pid: int | str) -> str:
    """The process's command line, spaces for its NULs and cut at 300 characters; `(gone)`
    when it has exited."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return "(gone)"
    return raw.replace(b"\0", b" ").decode(errors="replace")[:300]


def end(proc: subprocess.Popen[Any], grace: float = 0) -> None:
    """Ends `proc` and closes its pipes: its stdin is closed first (a worker that reads it
    then exits on its own), it gets `grace` seconds to exit, then it is killed; it is waited
    for either way."""
    if proc.stdin is not None:
        with contextlib.suppress(OSError):
            proc.stdin.close()
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    if proc.stdout is not None:
        proc.stdout.close()


class Sampling:
    """Calls `sample` every `interval` seconds, on a thread, while a `with` block runs."""

    def __init__(self, interval: float) -> None:
        self.interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def sample(self) -> None:
        raise NotImplementedError

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval)

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
