"""File-descriptor helpers the host shares: an exclusive lock file held for a block, a lock
taken only when nobody holds it (the liveness test of journals and run owners), and a
whole write. Low in the layers: it imports nothing of codecage's."""

from __future__ import annotations

import contextlib
import fcntl
import os
import stat
from collections.abc import Iterator
from pathlib import Path

LOCK_FILE_FLAGS = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    """Hold an exclusive flock on `path` (made 0600 if missing, never through a link)
    for the block: one process at a time does what it guards, the others wait."""
    fd = os.open(path, LOCK_FILE_FLAGS, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def lock_if_unheld(fd: int) -> int | None:
    """`fd` holding an exclusive lock when no process held one and the file is still
    linked (a writer that is gone), else None with `fd` closed: its holder lives, or a
    sweeper already recovered and unlinked it."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        if os.fstat(fd).st_nlink > 0:
            return fd
    except OSError:
        pass  # held: its holder is alive
    os.close(fd)
    return None


def write_all(fd: int, data: bytes) -> None:
    """Write all of `data` to the blocking `fd` (os.write may write part of it)."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def is_stream(fd: int) -> bool:
    """Whether `fd` is a pipe or a socket (what an MCP host hands a stdio server), not a
    terminal, a file or a closed descriptor."""
    try:
        mode = os.fstat(fd).st_mode
    except OSError:
        return False
    return stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode)
