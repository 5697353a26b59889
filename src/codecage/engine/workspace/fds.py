"""How the workspace is opened: through directory fds, with ``O_NOFOLLOW`` on every
component, and with the bounds every walk of it shares.

Everything in a workspace was written by untrusted code, so no walk ever opens anything by
a path that a symlink could redirect, nor waits on a FIFO, nor reads without a bound.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from codecage.errors import SandboxError

MAX_DEPTH = 32
"""Directories below the workspace root that `list_files` descends into (and the most
components, minus the file name, that `read_file` accepts)."""

MAX_ENTRIES_SCANNED = 100_000
"""Directory entries `list_files` looks at in all, whatever their kind: FIFOs and empty
directories do not count as files, and must not make a listing unbounded either."""

_READ_CHUNK = 1024 * 1024

DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
PATH_DIR_FLAGS = os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# O_NONBLOCK: opening a FIFO for reading must not wait for a writer. O_NOCTTY: a tty must
# never become our controlling terminal. fstat then rejects anything not regular.
FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC


def same_mount(fd: int, other_fd: int) -> bool:
    """Whether two open files are on the same mount. A bind mount of a directory of the
    same filesystem (a lent workspace under /tmp bound in a run dir on the same disk) has
    the same st_dev: the mount id (/proc/self/fdinfo) tells them apart; st_dev alone only
    where /proc is not readable."""
    if os.fstat(fd).st_dev != os.fstat(other_fd).st_dev:
        return False
    ids = mount_id(fd), mount_id(other_fd)
    return None in ids or ids[0] == ids[1]


def mount_id(fd: int) -> int | None:
    """The id of the mount `fd` is on (None: /proc/self/fdinfo cannot be read)."""
    try:
        with open(f"/proc/self/fdinfo/{fd}", encoding="ascii") as info:
            for line in info:
                if line.startswith("mnt_id:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return None


def open_root(ws_path: Path, action: str) -> int:
    """The workspace's own directory fd, never through a symlink.

    Raises:
        SandboxError: `ws_path` is missing, a symlink or not a directory.
    """
    try:
        return os.open(ws_path, DIR_FLAGS)
    except OSError as exc:
        raise SandboxError(
            f"cannot {action} the workspace {ws_path}: {exc.strerror}",
            hint="the workspace must be a directory (not a symlink) that still exists",
        ) from exc


@dataclass(frozen=True, slots=True)
class Entry:
    """One entry of a directory, as `scan` saw it (a symlink is "other", never followed)."""

    name: str
    kind: Literal["dir", "file", "other"]


def scan(dir_fd: int, most: int) -> tuple[list[Entry], int, bool]:
    """The first `most` entries of `dir_fd` in the filesystem's order, less those gone
    before they could be examined; how many entries that looked at; and whether the
    directory had more. A walk passes what is left of its budget as `most`, so that no
    directory of a million FIFOs makes it unbounded."""
    with os.scandir(dir_fd) as it:
        listed = list(itertools.islice(it, most + 1))
    more = len(listed) > most
    listed = listed[:most]
    entries: list[Entry] = []
    for entry in listed:
        try:
            is_dir = entry.is_dir(follow_symlinks=False)
            is_file = not is_dir and entry.is_file(follow_symlinks=False)
        except OSError:
            continue
        entries.append(Entry(entry.name, "dir" if is_dir else "file" if is_file else "other"))
    return entries, len(listed), more


def read_chunks(fd: int, size: int) -> Iterator[bytes]:
    """The first `size` bytes of `fd` (fewer if it is shorter), a chunk at a time, read
    with pread: the fd's offset is neither used nor moved."""
    offset = 0
    while offset < size:
        chunk = os.pread(fd, min(_READ_CHUNK, size - offset), offset)
        if not chunk:
            break
        yield chunk
        offset += len(chunk)


def pread_up_to(fd: int, size: int) -> bytes:
    """The first `size` bytes of `fd`, or all of it when it is shorter."""
    return b"".join(read_chunks(fd, size))
