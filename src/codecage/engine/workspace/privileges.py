"""Taking S_ISUID and S_ISGID off everything in a workspace that outlives its run.

The guest's uid is the host uid that runs codecage, root included, so a setuid file it left
in a ``--workspace DIR`` would be a setuid-root binary on the host. The seccomp filter
already refuses to set these bits; this is the second layer.
"""

from __future__ import annotations

import logging
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path

from codecage.engine.workspace import fds
from codecage.output import neutralise_line

log = logging.getLogger(__name__)

_SETID_BITS = stat.S_ISUID | stat.S_ISGID
_PATH_FLAGS = os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC


@dataclass(slots=True)
class _Stripping:
    changed: int = 0
    incomplete: list[str] = field(default_factory=list)
    """Why some of the tree may keep its bits (each reason once)."""
    entries_left: int = fds.MAX_ENTRIES_SCANNED

    def missed(self, why: str) -> None:
        if why not in self.incomplete:
            self.incomplete.append(why)


def strip_privilege_bits(ws_path: Path, *, keep_on_root: int = 0) -> int:
    """Take S_ISUID and S_ISGID off every regular file and directory under `ws_path`,
    `ws_path` itself included (except the bits of `keep_on_root` on it: those the operator
    had set on the directory before the run); return how many were changed.

    Call it after every run on a workspace that outlives the run (``--workspace DIR``): the
    guest's uid is the host uid that started the sandbox, root included, so a setuid or
    setgid file the guest left there would be a privilege-escalation plant on the host.
    The seccomp filter already refuses to set these bits; this is the second layer.

    The walk is like `listing.list_files`'s: directory fds, ``O_NOFOLLOW`` on every
    component, no symlink followed, at most `fds.MAX_DEPTH` directories down and 100,000
    entries in all. Each mode is changed with ``fchmod`` on an fd of the very file or
    directory that ``fstat`` checked, never through its name (when codecage is not root and
    may not read it: through that O_PATH fd's /proc link, the same inode). S_ISVTX and the
    permission bits are kept; symlinks, FIFOs, sockets and devices are left alone. What the
    walk could not reach
    (too deep, too many entries, unreadable, not ours to chmod) is logged at WARNING as
    ``workspace_privilege_bits_not_all_checked``.

    Raises:
        SandboxError: `ws_path` itself is missing, a symlink or not a directory.
    """
    state = _Stripping()
    root_fd = fds.open_root(ws_path, "check for setuid files")
    try:
        _strip_fd(root_fd, ".", state, keep=keep_on_root & _SETID_BITS)
        _strip_dir(root_fd, 0, state)
    finally:
        os.close(root_fd)
    if state.changed:
        log.warning(
            "workspace_privilege_bits_stripped",
            extra={"path": str(ws_path), "count": state.changed},
        )
    if state.incomplete:
        log.warning(
            "workspace_privilege_bits_not_all_checked",
            extra={"path": str(ws_path), "reasons": state.incomplete},
        )
    return state.changed


def _strip_dir(dir_fd: int, depth: int, state: _Stripping) -> None:
    """Strip the entries of `dir_fd`, and below; `depth` is that of `dir_fd`'s entries."""
    entries, scanned, more = fds.scan(dir_fd, state.entries_left)
    if more:
        state.missed(f"more than {fds.MAX_ENTRIES_SCANNED} entries")
    state.entries_left -= scanned
    for entry in entries:
        if entry.kind == "file":
            _strip_entry(dir_fd, entry.name, fds.FILE_FLAGS, state)
            continue
        if entry.kind != "dir":
            continue  # symlinks, FIFOs, sockets, devices
        if depth >= fds.MAX_DEPTH:
            state.missed(f"directories deeper than {fds.MAX_DEPTH}")
            _strip_entry(dir_fd, entry.name, fds.DIR_FLAGS, state)
            continue
        try:
            child = os.open(entry.name, fds.DIR_FLAGS, dir_fd=dir_fd)
        except PermissionError:
            _strip_entry(dir_fd, entry.name, fds.DIR_FLAGS, state)
            state.missed("directories this user cannot read")
            continue
        except OSError:
            continue  # gone, or replaced by a symlink (ELOOP), since it was listed
        try:
            _strip_fd(child, entry.name, state)
            _strip_dir(child, depth + 1, state)
        finally:
            os.close(child)


def _strip_entry(dir_fd: int, name: str, flags: int, state: _Stripping) -> None:
    """Strip the file or directory `name` of `dir_fd`, opened with `flags` (O_NOFOLLOW)."""
    by_path_fd = False
    try:
        fd = os.open(name, flags, dir_fd=dir_fd)
    except PermissionError:
        # Only when codecage is not root: something we may not read (e.g. mode 04111, still
        # executable by others) cannot be opened for fchmod, but an O_PATH fd can be had.
        try:
            fd = os.open(name, _PATH_FLAGS, dir_fd=dir_fd)
        except OSError:
            state.missed("entries this user cannot open")
            return
        by_path_fd = True
    except OSError:
        return  # gone, or replaced by a symlink (ELOOP), since it was listed
    try:
        _strip_fd(fd, name, state, by_path_fd=by_path_fd)
    finally:
        os.close(fd)


def _strip_fd(
    fd: int, name: str, state: _Stripping, *, by_path_fd: bool = False, keep: int = 0
) -> None:
    st = os.fstat(fd)
    if not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)):
        return
    strip = _SETID_BITS & ~keep
    if not st.st_mode & strip:
        return
    mode = stat.S_IMODE(st.st_mode) & ~strip
    try:
        if by_path_fd:
            # fchmod refuses O_PATH fds; chmod through the fd's /proc link changes exactly
            # the inode that fd holds and fstat checked, never what a symlink swapped in
            # under the name points to.
            Path(f"/proc/self/fd/{fd}").chmod(mode)
        else:
            os.fchmod(fd, mode)
    except OSError as exc:
        # The name is the guest's: neutralised like any guest text, even at DEBUG.
        log.debug(
            "privilege_bits_not_stripped",
            extra={"entry": neutralise_line(name), "error": exc.strerror},
        )
        state.missed("entries this user may not chmod")
        return
    state.changed += 1
