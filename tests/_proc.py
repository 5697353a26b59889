"""Processes a test started or watches: what /proc says of one, and ending one."""

from __future__ import annotations

import contextlib
import subprocess
from pathlib import Path
from typing import Any


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
