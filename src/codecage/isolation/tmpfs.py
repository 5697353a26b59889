"""Size- and inode-limited tmpfs mounts: what bounds a run's fresh /workspace (and the
bind mount that brings a lent one where the sandbox's host id can reach it).

Only a process with CAP_SYS_ADMIN over its mount namespace (root, in practice) can mount;
`can_mount_tmpfs` proves it once by mounting, and `probe` says whether the workspace quota
(`workspace_mb`) is in force on this host.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import logging
import os
import tempfile
from pathlib import Path

from codecage.models import LayerStatus

__all__ = ["bind", "can_mount_tmpfs", "mount", "probe", "umount", "umount_fd"]

log = logging.getLogger(__name__)

# <sys/mount.h>
_MS_NOSUID = 0x2
_MS_NODEV = 0x4
_MS_REMOUNT = 0x20
_MS_BIND = 0x1000
_MNT_DETACH = 0x2
_UMOUNT_NOFOLLOW = 0x8
_CAP_SYS_ADMIN = 21


@functools.cache
def _libc() -> ctypes.CDLL:
    # dlopen(NULL): libc is already in the process, so no library search (which would run
    # ldconfig in a subprocess) is needed.
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mount.argtypes = (
        ctypes.c_char_p,
        ctypes.c_char_p,
        ctypes.c_char_p,
        ctypes.c_ulong,
        ctypes.c_char_p,
    )
    libc.mount.restype = ctypes.c_int
    libc.umount2.argtypes = (ctypes.c_char_p, ctypes.c_int)
    libc.umount2.restype = ctypes.c_int
    return libc


def mount(path: Path, size_mb: int, owner: tuple[int, int] | None = None) -> None:
    """Mount a tmpfs of `size_mb` MiB (mode 0700, nosuid, nodev) on `path`, its root owned
    by `owner` (uid, gid) when given (the sandbox's host ids), else by the caller.

    Raises:
        OSError: the kernel refused (EPERM without privilege over the mount namespace).
    """
    # Inodes are not counted in size=: bound them too, or a run could make millions of empty
    # files in host memory. 256 per MiB is far more files than agent code writes.
    nr_inodes = max(4096, size_mb * 256)
    options_text = f"size={size_mb}m,nr_inodes={nr_inodes},mode=0700"
    if owner is not None:
        options_text += f",uid={owner[0]},gid={owner[1]}"
    options = options_text.encode("ascii")
    rc: int = _libc().mount(b"tmpfs", os.fsencode(path), b"tmpfs", _MS_NOSUID | _MS_NODEV, options)
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), str(path))
    log.debug("workspace_tmpfs_mounted", extra={"path": str(path), "size_mb": size_mb})


def bind(source_fd: int, target: Path) -> None:
    """Bind the directory `source_fd` holds (not a path a symlink could redirect) on
    `target`, nosuid and nodev: how a lent ``--workspace DIR`` under a directory the
    sandbox's host id cannot pass through (a home, mode 0700) reaches the sandbox.

    Raises:
        OSError: the kernel refused (EPERM without privilege over the mount namespace).
    """
    libc = _libc()
    source = f"/proc/self/fd/{source_fd}".encode("ascii")
    if libc.mount(source, os.fsencode(target), None, _MS_BIND, None) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), str(target))
    flags = _MS_REMOUNT | _MS_BIND | _MS_NOSUID | _MS_NODEV
    if libc.mount(None, os.fsencode(target), None, flags, None) != 0:
        err = ctypes.get_errno()
        umount(target)
        raise OSError(err, os.strerror(err), str(target))
    log.debug("workspace_bound", extra={"path": str(target)})


def umount(path: Path) -> None:
    """Detach the mount at `path`; nothing mounted there (any more) is not an error.

    Raises:
        OSError: the kernel refused otherwise.
    """
    rc: int = _libc().umount2(os.fsencode(path), _MNT_DETACH | _UMOUNT_NOFOLLOW)
    if rc != 0:
        err = ctypes.get_errno()
        if err in (errno.EINVAL, errno.ENOENT):
            return
        raise OSError(err, os.strerror(err), str(path))
    log.debug("workspace_tmpfs_unmounted", extra={"path": str(path)})


def umount_fd(fd: int, name: str) -> None:
    """Detach the mount that the O_PATH directory fd `fd` holds (`name` names it in errors).

    /proc/self/fd/N leads to exactly the mount and directory this fd holds (umount2 follows
    that one link, as it must without UMOUNT_NOFOLLOW), so a name swapped meanwhile cannot
    make us detach anything else.

    Raises:
        OSError: the kernel refused.
    """
    rc: int = _libc().umount2(f"/proc/self/fd/{fd}".encode("ascii"), _MNT_DETACH)
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), name)


def _has_cap_sys_admin() -> bool:
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("CapEff:"):
                    return bool(int(line.split()[1], 16) >> _CAP_SYS_ADMIN & 1)
    except (OSError, ValueError, IndexError):
        pass
    return os.geteuid() == 0


@functools.cache
def probe() -> LayerStatus:
    """Whether the workspace size limit (workspace_mb) is enforced on this host."""
    if can_mount_tmpfs():
        return LayerStatus(
            name="workspace",
            active=True,
            mechanism="size- and inode-limited tmpfs per run",
            detail="workspace_mb bounds the fresh workspace; a --workspace DIR has no quota",
        )
    return LayerStatus(
        name="workspace",
        active=False,
        mechanism="plain directory",
        detail="cannot mount a tmpfs here (not root): only max_file_size_mb bounds each file",
    )


@functools.cache
def can_mount_tmpfs() -> bool:
    """True when this process can mount a tmpfs (root, or CAP_SYS_ADMIN over its mount
    namespace). Proven once per process by mounting and unmounting a 1 MiB tmpfs in a fresh
    temp dir, since a capability alone does not say so (e.g. inside a user namespace that
    does not own the mount namespace); the answer is cached, so runs do not pay for it.

    Raises:
        Nothing: any failure means False.
    """
    if not _has_cap_sys_admin():
        return False
    try:
        probe = Path(tempfile.mkdtemp(prefix="codecage-mount-probe-"))
    except OSError:
        return False
    try:
        mount(probe, 1)
        umount(probe)
    except OSError as exc:
        log.debug("tmpfs_probe_failed", extra={"error": str(exc)})
        return False
    finally:
        try:
            probe.rmdir()
        except OSError as exc:
            log.warning("tmpfs_probe_not_removed", extra={"path": str(probe), "error": str(exc)})
    return True
