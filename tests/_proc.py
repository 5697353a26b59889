"""What /proc says of a process: for the leak guard and the load probes."""

from __future__ import annotations

from pathlib import Path


def cmdline(pid: int | str) -> str:
    """The process's command line, spaces for its NULs and cut at 300 characters; `(gone)`
    when it has exited."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return "(gone)"
    return raw.replace(b"\0", b" ").decode(errors="replace")[:300]
