"""Lending a ``--workspace DIR`` to the sandbox's host id, and taking it back.

When codecage runs as root, the sandbox runs as its own unprivileged host id
(`isolation.identity`), which owns nothing on the host. A directory the user lends must
be writable by it for the run, and must come back owned by the user: so everything in it
is given to the sandbox's ids before the run, and everything (what the code made
included) is given back to the directory's owner after it. A fresh workspace needs
neither: its tmpfs or directory is made for the sandbox's ids.

The walk is fd-based like every walk of a workspace (`fds`): ``O_NOFOLLOW`` on every
component, ``fchownat(AT_SYMLINK_NOFOLLOW)`` on entries (a symlink itself changes owner,
never its target), bounded in depth and entries; what it could not reach is logged.
"""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

from codecage.engine.workspace import fds
from codecage.isolation.identity import Identity

log = logging.getLogger(__name__)


def needs_lending(owner: Identity | None, path_uid: int) -> bool:
    """Does a directory owned by `path_uid` have to change hands for `owner` to write it?
    Only root can give files away, and only when the sandbox is someone else."""
    return owner is not None and os.geteuid() == 0 and owner.uid != path_uid


def give(ws_path: Path, uid: int, gid: int, *, skip_linked: bool = False) -> int:
    """Make every entry under `ws_path` (and it) owned by uid:gid; return how many changed.
    `skip_linked`: leave regular files with more than one hard link alone (when lending: such
    a file may also be somewhere else on the host, which the sandbox must not be able to
    write through it).

    Raises:
        SandboxError: `ws_path` itself is missing, a symlink or not a directory.
    """
    budget = [fds.MAX_ENTRIES_SCANNED]
    changed = 0
    root_fd = fds.open_root(ws_path, "change the owner of")
    try:
        st = os.fstat(root_fd)
        if (st.st_uid, st.st_gid) != (uid, gid):
            os.fchown(root_fd, uid, gid)
            changed += 1
        changed += _give_below(root_fd, uid, gid, 0, budget, skip_linked)
    finally:
        os.close(root_fd)
    if budget[0] <= 0:
        log.warning("workspace_owner_not_all_changed", extra={"path": str(ws_path)})
    return changed


def _give_below(
    dir_fd: int, uid: int, gid: int, depth: int, budget: list[int], skip_linked: bool
) -> int:
    entries, scanned, _more = fds.scan(dir_fd, budget[0])
    budget[0] -= scanned
    changed = 0
    for entry in entries:
        try:
            st = os.stat(entry.name, dir_fd=dir_fd, follow_symlinks=False)
            if skip_linked and stat.S_ISREG(st.st_mode) and st.st_nlink > 1:
                log.warning("workspace_linked_file_not_lent", extra={"links": st.st_nlink})
                continue
            if (st.st_uid, st.st_gid) != (uid, gid):
                os.chown(entry.name, uid, gid, dir_fd=dir_fd, follow_symlinks=False)
                changed += 1
        except OSError:
            continue  # gone since it was listed
        if entry.kind != "dir" or depth >= fds.MAX_DEPTH:
            continue
        try:
            child = os.open(entry.name, fds.DIR_FLAGS, dir_fd=dir_fd)
        except OSError:
            continue  # replaced by a symlink (ELOOP) or gone since it was listed
        try:
            changed += _give_below(child, uid, gid, depth + 1, budget, skip_linked)
        finally:
            os.close(child)
    return changed
