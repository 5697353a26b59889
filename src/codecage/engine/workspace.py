"""The run's /workspace on the host side, and the one way files leave it.

Everything in the workspace was written by untrusted code. It may hold symlinks to host
files, FIFOs that block a reader, directories chmod-ed to 0, names with terminal escape
sequences or invalid UTF-8, and trees deeper than Python's recursion limit. So:

- files are listed and read only through directory fds, with ``O_NOFOLLOW`` on every
  component, and only when ``fstat`` says "regular file"; reads are bounded;
- names are neutralised before they reach a result, a log or a terminal;
- S_ISUID and S_ISGID are taken off everything in a workspace the user keeps
  (`strip_privilege_bits`): the guest's uid is the host uid that runs codecage, root
  included, so a setuid file it left would be a setuid-root binary on the host;
- removal walks the tree itself (iteratively, fd-based, never following a symlink, taking
  back permissions the guest removed), because ``shutil.rmtree`` recurses once per level
  and so fails on a tree a few thousand directories deep, leaving it behind.

Run directories (and other temp trees of one codecage process) live in a parent private to
the effective uid (`private_parent`), never directly in a world-writable /tmp: nobody else
can plant, swap or symlink an entry there, so sweeping what a killed process left cannot be
turned against another directory or a live run's mount.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import hashlib
import itertools
import logging
import mimetypes
import os
import stat
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from codecage.errors import ConfigError, HostError, SandboxError
from codecage.models import FileInfo, LayerStatus
from codecage.output import neutralise_line

__all__ = [
    "MAX_DEPTH",
    "RootState",
    "Workspace",
    "can_mount_tmpfs",
    "check_files",
    "create_ephemeral",
    "destroy",
    "list_files",
    "private_parent",
    "read_file",
    "restore_root",
    "save_root",
    "strip_privilege_bits",
    "sweep_stale",
    "use_existing",
    "write_files",
]

log = logging.getLogger(__name__)

MAX_DEPTH = 32
"""Directories below the workspace root that `list_files` descends into (and the most
components, minus the file name, that `read_file` accepts)."""

_MAX_ENTRIES_SCANNED = 100_000
"""Directory entries `list_files` looks at in all, whatever their kind: FIFOs and empty
directories do not count as files, and must not make a listing unbounded either."""

_TEXT_SNIFF_BYTES = 64 * 1024
"""Files up to this size are read whole to decide whether they are UTF-8 text."""

_MAGIC_BYTES = 16
_READ_CHUNK = 1024 * 1024

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_PATH_DIR_FLAGS = os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# O_NONBLOCK: opening a FIFO for reading must not wait for a writer. O_NOCTTY: a tty must
# never become our controlling terminal. fstat then rejects anything not regular.
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC

# <sys/mount.h>
_MS_NOSUID = 0x2
_MS_NODEV = 0x4
_MNT_DETACH = 0x2
_UMOUNT_NOFOLLOW = 0x8
_CAP_SYS_ADMIN = 21

_MAGIC = (
    (b"\x89PNG\r\n\x1a\n", "image/png"),
    (b"\xff\xd8\xff", "image/jpeg"),
    (b"GIF87a", "image/gif"),
    (b"GIF89a", "image/gif"),
    (b"%PDF-", "application/pdf"),
    (b"PK\x03\x04", "application/zip"),
    (b"PK\x05\x06", "application/zip"),
    (b"PK\x07\x08", "application/zip"),
    (b"\x1f\x8b", "application/gzip"),
)

# Compressed files are reported as what they are on disk: "data.csv.gz" is gzip, not CSV.
_ENCODING_MIME = {
    "gzip": "application/gzip",
    "bzip2": "application/x-bzip2",
    "xz": "application/x-xz",
    "compress": "application/x-compress",
    "br": "application/x-brotli",
}

# What data-analysis code often writes and Python 3.11's built-in table does not know.
_EXTRA_TYPES = {
    ".md": "text/markdown",
    ".parquet": "application/vnd.apache.parquet",
    ".xlsx": "application/vnd.openxmlformats-officedocument.spreadsheetml.sheet",
    ".docx": "application/vnd.openxmlformats-officedocument.wordprocessingml.document",
    ".pptx": "application/vnd.openxmlformats-officedocument.presentationml.presentation",
}


@dataclass(frozen=True, slots=True)
class Workspace:
    """A run's workspace directory on the host (bind-mounted at /workspace in the sandbox)."""

    path: Path
    tmpfs: bool
    """A size-limited tmpfs is mounted at `path`; `destroy` unmounts it."""
    owned: bool
    """codecage created `path` and `destroy` removes it; False for a user's --workspace DIR."""


# --- mounting -------------------------------------------------------------------------


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


def _mount_tmpfs(path: Path, size_mb: int) -> None:
    # Inodes are not counted in size=: bound them too, or a run could make millions of empty
    # files in host memory. 256 per MiB is far more files than agent code writes.
    nr_inodes = max(4096, size_mb * 256)
    options = f"size={size_mb}m,nr_inodes={nr_inodes},mode=0700".encode("ascii")
    rc: int = _libc().mount(b"tmpfs", os.fsencode(path), b"tmpfs", _MS_NOSUID | _MS_NODEV, options)
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), str(path))
    log.debug("workspace_tmpfs_mounted", extra={"path": str(path), "size_mb": size_mb})


def _umount(path: Path) -> None:
    """Detach the mount at `path`; nothing mounted there (any more) is not an error."""
    rc: int = _libc().umount2(os.fsencode(path), _MNT_DETACH | _UMOUNT_NOFOLLOW)
    if rc != 0:
        err = ctypes.get_errno()
        if err in (errno.EINVAL, errno.ENOENT):
            return
        raise OSError(err, os.strerror(err), str(path))
    log.debug("workspace_tmpfs_unmounted", extra={"path": str(path)})


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


def can_mount_tmpfs() -> bool:
    """True when this process can mount a tmpfs (root, or CAP_SYS_ADMIN over its mount
    namespace). Proven once by mounting and unmounting a 1 MiB tmpfs in a fresh temp dir,
    since a capability alone does not say so (e.g. inside a user namespace that does not
    own the mount namespace); the answer is cached.

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
        _mount_tmpfs(probe, 1)
        _umount(probe)
    except OSError as exc:
        log.debug("tmpfs_probe_failed", extra={"error": str(exc)})
        return False
    finally:
        try:
            probe.rmdir()
        except OSError as exc:
            log.warning("tmpfs_probe_not_removed", extra={"path": str(probe), "error": str(exc)})
    return True


# --- the private parent of run directories --------------------------------------------

_SYSTEM_RUN_DIR = Path("/run")


def private_parent() -> Path:
    """The directory that holds this effective uid's run directories and temp trees,
    created 0700 on first use: ``/run/codecage`` for root (only root can write /run),
    else ``codecage-<euid>`` in the temp directory ($TMPDIR, else /tmp).

    It is checked on every call, through an ``O_NOFOLLOW`` fd: a directory (not a symlink),
    owned by the effective uid; a wider mode is narrowed to 0700. Another user who made
    that name first (in a shared /tmp) gets codecage refused, never used.

    Raises:
        HostError: the directory cannot be created, or is not ours.
    """
    fd = _open_private_parent()
    os.close(fd)
    return _private_parent_path()


def _private_parent_path() -> Path:
    euid = os.geteuid()
    if euid == 0:
        try:
            st = os.lstat(_SYSTEM_RUN_DIR)
        except OSError:
            pass
        else:
            if stat.S_ISDIR(st.st_mode) and st.st_uid == 0 and not st.st_mode & 0o022:
                return _SYSTEM_RUN_DIR / "codecage"
    return Path(tempfile.gettempdir()) / f"codecage-{euid}"


def _open_private_parent() -> int:
    """`private_parent`, created if need be, as a checked directory fd."""
    path = _private_parent_path()
    euid = os.geteuid()
    hint = (
        f"{path} must be a directory owned by uid {euid} (not a symlink): remove what is "
        "there if you do not know who made it, or set TMPDIR to a directory of your own"
    )
    with contextlib.suppress(FileExistsError):
        path.mkdir(mode=0o700)
    try:
        fd = os.open(path, _DIR_FLAGS)
    except OSError as exc:
        raise HostError(
            f"cannot use {path} for codecage's run directories: {exc.strerror}", hint=hint
        ) from exc
    try:
        st = os.fstat(fd)
        if st.st_uid != euid:
            raise HostError(
                f"{path} belongs to uid {st.st_uid}, not to this user (uid {euid}): codecage "
                "will not keep its run directories there",
                hint=hint,
            )
        if stat.S_IMODE(st.st_mode) != 0o700:
            os.fchmod(fd, 0o700)
    except BaseException:
        os.close(fd)
        raise
    return fd


def sweep_stale(prefixes: tuple[str, ...], is_stale: Callable[[str], bool]) -> int:
    """Remove the entries of `private_parent` whose name is a prefix of `prefixes` followed
    by a string that `is_stale` says True of (e.g. "<pid of a dead process>-..."): what a
    killed codecage process could not remove. Returns how many were removed.

    Descriptors all the way: the parent is opened ``O_NOFOLLOW`` and checked as ours, each
    entry is opened ``O_NOFOLLOW`` relative to it and must be a directory owned by the
    effective uid, its workspace tmpfs is unmounted through the very directory fd that was
    checked (never by a name that could be swapped meanwhile), and the tree is removed with
    the fd-based walk of `destroy`. Anything else is left alone (and logged).

    Raises:
        Nothing: what cannot be removed is logged at WARNING as
        ``workspace_stale_entry_not_removed``.
    """
    try:
        parent_fd = _open_private_parent()
    except HostError as exc:
        log.warning("workspace_stale_sweep_skipped", extra={"error": str(exc)})
        return 0
    removed = 0
    try:
        with os.scandir(parent_fd) as entries:
            names = sorted(entry.name for entry in entries)
        for name in names:
            prefix = next((p for p in prefixes if name.startswith(p)), None)
            if prefix is None or not is_stale(name.removeprefix(prefix)):
                continue
            try:
                removed += _remove_stale(parent_fd, name)
            except OSError as exc:
                log.warning(
                    "workspace_stale_entry_not_removed",
                    extra={"entry": neutralise_line(name), "error": neutralise_line(str(exc))},
                )
    finally:
        os.close(parent_fd)
    return removed


def _remove_stale(parent_fd: int, name: str) -> bool:
    try:
        fd = os.open(name, _DIR_FLAGS, dir_fd=parent_fd)
    except FileNotFoundError:
        return False
    except OSError as exc:
        if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
            raise
        log.warning("workspace_stale_entry_not_a_directory", extra={"entry": neutralise_line(name)})
        return False
    try:
        st = os.fstat(fd)
        if st.st_uid != os.geteuid():
            log.warning("workspace_stale_entry_not_ours", extra={"entry": neutralise_line(name)})
            return False
        _unmount_below(fd, "workspace", st.st_dev)
    finally:
        os.close(fd)
    _remove_at(parent_fd, name)
    return True


def _unmount_below(dir_fd: int, name: str, dir_dev: int) -> None:
    """Detach what is mounted on `name` in `dir_fd` (a directory we checked), if anything."""
    for _ in range(8):  # a mount stacked on a mount: a few, never unbounded
        try:
            fd = os.open(name, _PATH_DIR_FLAGS, dir_fd=dir_fd)
        except OSError:
            return  # missing, a symlink or not a directory: nothing of ours is mounted there
        try:
            if os.fstat(fd).st_dev == dir_dev:
                return  # not a mount point
            # /proc/self/fd/N leads to exactly the mount and directory this fd holds (umount2
            # follows that one link, as it must without UMOUNT_NOFOLLOW), so a name swapped
            # meanwhile cannot make us detach anything else.
            rc: int = _libc().umount2(f"/proc/self/fd/{fd}".encode("ascii"), _MNT_DETACH)
            if rc != 0:
                err = ctypes.get_errno()
                raise OSError(err, os.strerror(err), name)
            log.debug("workspace_stale_tmpfs_unmounted")
        finally:
            os.close(fd)


# --- creating and destroying ------------------------------------------------------------


def create_ephemeral(parent: Path, size_mb: int) -> Workspace:
    """Create ``parent/"workspace"`` (mode 0700) for one run.

    When `can_mount_tmpfs()`, a tmpfs of `size_mb` MiB (mode 0700, nosuid, nodev) is mounted
    on it, so the run's files live in memory, are bounded in total and vanish at unmount.
    Otherwise it is a plain directory and only the per-file rlimit bounds what is written.

    Args:
        parent: the run's private 0700 temp dir.
        size_mb: size of the tmpfs in MiB.

    Raises:
        ConfigError: `size_mb` is below 1.
        HostError: the kernel refused the tmpfs mount (no privilege over the mount namespace).
        SandboxError: the directory could not be created, or the mount failed otherwise.
    """
    if size_mb < 1:
        raise ConfigError(
            f"workspace size_mb={size_mb} is below 1",
            hint="pass {workspace_mb=1} or more; {info} lists the defaults",
        )
    path = parent / "workspace"
    try:
        path.mkdir(mode=0o700)
        # mkdir's mode is filtered by the umask; the workspace must be 0700 whatever it is.
        path.chmod(0o700)
    except OSError as exc:
        raise SandboxError(
            f"cannot create the workspace {path}: {exc.strerror}",
            hint=f"check that {parent} exists, is a directory and is writable by this user",
        ) from exc
    if not can_mount_tmpfs():
        return Workspace(path=path, tmpfs=False, owned=True)
    try:
        _mount_tmpfs(path, size_mb)
    except OSError as exc:
        with contextlib.suppress(OSError):
            path.rmdir()
        if exc.errno in (errno.EPERM, errno.EACCES):
            raise HostError(
                f"mounting a {size_mb} MiB tmpfs on {path} was refused: {exc.strerror}",
                hint="run codecage as root (or with CAP_SYS_ADMIN) for a size-limited "
                "workspace, or run it unprivileged to get a plain directory",
            ) from exc
        raise SandboxError(
            f"mounting a {size_mb} MiB tmpfs on {path} failed: {exc.strerror}",
            hint="pass a smaller --workspace-mb, or check the host's memory and mount table",
        ) from exc
    return Workspace(path=path, tmpfs=True, owned=True)


def use_existing(path: Path) -> Workspace:
    """Use a host directory the user passed (``--workspace DIR``). It is never removed.

    Raises:
        ConfigError: `path` does not exist, is a symlink or is not a directory.
    """
    shown = neutralise_line(str(path))
    try:
        st = path.lstat()
    except FileNotFoundError as exc:
        raise ConfigError(
            f"workspace {shown} does not exist",
            hint="create the directory first, or omit --workspace to get a fresh one per run",
        ) from exc
    except OSError as exc:
        raise ConfigError(
            f"workspace {shown} cannot be examined: {exc.strerror}",
            hint="pass a directory this user can read and write",
        ) from exc
    if stat.S_ISLNK(st.st_mode):
        raise ConfigError(
            f"workspace {shown} is a symlink",
            hint="pass the directory it points to, so that what is shared is explicit",
        )
    if not stat.S_ISDIR(st.st_mode):
        raise ConfigError(
            f"workspace {shown} is not a directory",
            hint="pass a directory, or omit --workspace to get a fresh one per run",
        )
    return Workspace(path=path.absolute(), tmpfs=False, owned=False)


def check_files(files: Mapping[str, bytes], size_mb: int) -> None:
    """Refuse, before any sandbox starts, files that cannot be put in a fresh workspace of
    `size_mb` MiB: a name that is not a plain relative path, or more bytes than fit.

    Raises:
        ConfigError: the message names the file, or the sizes.
    """
    total = 0
    for name, data in files.items():
        _upload_parts(name)
        total += len(data)
    if total > size_mb * 2**20:
        raise ConfigError(
            f"the files are {total} bytes together, more than the workspace's {size_mb} MiB",
            hint="upload less in {files}, or raise {workspace_mb}",
        )


_UPLOAD_NAME_HINT = "name each file by a relative path inside /workspace, e.g. 'input/data.csv'"


def _upload_parts(name: str) -> list[str]:
    parts = _split_relpath(name, hint=_UPLOAD_NAME_HINT)
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        raise ConfigError(
            f"the file name '{neutralise_line(name)}' is not valid text (a lone surrogate)",
            hint=_UPLOAD_NAME_HINT,
        ) from None
    return parts


_CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


def write_files(ws: Workspace, files: Mapping[str, bytes], size_mb: int) -> None:
    """Write `files` (relative path -> content) into the fresh workspace `ws` before the
    code runs: in its tmpfs when it has one, so they count against its `size_mb` MiB like
    everything the code writes, and go with it.

    Every component is created and opened relative to the previous one with
    ``O_NOFOLLOW``, files with ``O_EXCL``: nothing is written through a link.

    Raises:
        ConfigError: a bad name, two names that collide (a file where another needs a
            directory), or the files do not fit in the workspace.
        SandboxError: writing failed otherwise.
    """
    root_fd = _open_workspace_root(ws.path, "write the files into")
    try:
        for name, data in files.items():
            parts = _upload_parts(name)
            try:
                _write_one(root_fd, parts, data)
            except OSError as exc:
                raise _write_refusal(name, exc, size_mb) from exc
    finally:
        os.close(root_fd)


def _write_one(root_fd: int, parts: list[str], data: bytes) -> None:
    dir_fd = os.dup(root_fd)
    try:
        for part in parts[:-1]:
            with contextlib.suppress(FileExistsError):
                os.mkdir(part, 0o755, dir_fd=dir_fd)
            next_fd = os.open(part, _DIR_FLAGS, dir_fd=dir_fd)
            os.close(dir_fd)
            dir_fd = next_fd
        fd = os.open(parts[-1], _CREATE_FLAGS, 0o644, dir_fd=dir_fd)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
        finally:
            os.close(fd)
    finally:
        os.close(dir_fd)


def _write_refusal(name: str, exc: OSError, size_mb: int) -> ConfigError | SandboxError:
    shown = neutralise_line(name)
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return ConfigError(
            f"the files do not fit in the workspace's {size_mb} MiB (writing '{shown}': "
            f"{exc.strerror})",
            hint="upload less in {files}, or raise {workspace_mb}",
        )
    if exc.errno in (
        errno.EEXIST,
        errno.ENOTDIR,
        errno.EISDIR,
        errno.ELOOP,
        errno.ENAMETOOLONG,
        errno.EINVAL,
    ):
        return ConfigError(
            f"cannot write '{shown}' into the workspace: {exc.strerror} (a file and a "
            "directory of the same name, or a name too long)",
            hint=_UPLOAD_NAME_HINT,
        )
    return SandboxError(
        f"writing '{shown}' into the workspace failed: {exc.strerror}",
        hint="run it again; if it persists, check the host's memory and mount table",
    )


@dataclass(slots=True)
class RootState:
    """A ``--workspace DIR``'s own mode and owner before a run, and an fd of DIR that
    `restore_root` puts them back through (the path could name something else by then)."""

    fd: int
    mode: int
    uid: int
    gid: int


def save_root(ws: Workspace) -> RootState:
    """Record `ws`'s own mode and owner before a run (for `restore_root`).

    Raises:
        SandboxError: the directory is missing, a symlink or not a directory.
    """
    fd = _open_workspace_root(ws.path, "record the mode of")
    st = os.fstat(fd)
    return RootState(fd=fd, mode=stat.S_IMODE(st.st_mode), uid=st.st_uid, gid=st.st_gid)


def restore_root(state: RootState) -> None:
    """Give the workspace directory back the mode and owner `save_root` recorded, whatever
    the code did to it (the code runs as the host uid, so it may chmod /workspace itself,
    e.g. to 01777); then close the fd. Call it once, after the sandbox is gone.

    Raises:
        SandboxError: the mode or owner could not be restored.
    """
    try:
        st = os.fstat(state.fd)
        if (st.st_uid, st.st_gid) != (state.uid, state.gid):
            os.fchown(state.fd, state.uid, state.gid)  # clears setid bits: chmod comes after
            st = os.fstat(state.fd)
        if stat.S_IMODE(st.st_mode) != state.mode:
            os.fchmod(state.fd, state.mode)
            log.warning(
                "workspace_mode_restored",
                extra={"was": oct(stat.S_IMODE(st.st_mode)), "restored": oct(state.mode)},
            )
    except OSError as exc:
        raise SandboxError(
            f"cannot restore the workspace directory's mode {oct(state.mode)}: {exc.strerror}",
            hint="check its mode and owner by hand (`ls -ld`)",
        ) from exc
    finally:
        os.close(state.fd)


def destroy(ws: Workspace) -> None:
    """Unmount the workspace's tmpfs (if any) and remove the directory (if owned).

    Never follows a symlink, takes back permissions the guest removed, copes with trees of
    any depth, and may be called again: what is already gone is not an error.

    Raises:
        SandboxError: something could not be unmounted or removed (the message names it).
    """
    try:
        if ws.tmpfs:
            _umount(ws.path)
        if ws.owned:
            _remove_tree(ws.path)
    except OSError as exc:
        raise SandboxError(
            # The error may name a file the guest named: neutralise it like any guest text.
            f"cannot remove the workspace {ws.path}: {neutralise_line(str(exc))}",
            hint=f"remove {ws.path} by hand (`umount -l` it first if it is still mounted)",
        ) from exc


def _remove_tree(path: Path) -> None:
    try:
        parent_fd = os.open(path.parent, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    except FileNotFoundError:
        return
    try:
        _remove_at(parent_fd, path.name)
    finally:
        os.close(parent_fd)


def _remove_at(parent_fd: int, name: str) -> None:
    """Remove the entry `name` of `parent_fd`, and everything under it when a directory."""
    try:
        st = os.stat(name, dir_fd=parent_fd, follow_symlinks=False)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(st.st_mode):
        _empty_dir(parent_fd, name)
        _ignore_missing(os.rmdir, name, parent_fd)
    else:
        _ignore_missing(os.unlink, name, parent_fd)


def _ignore_missing(remove: Callable[..., object], name: str, dir_fd: int) -> None:
    with contextlib.suppress(FileNotFoundError):
        remove(name, dir_fd=dir_fd)


@dataclass(slots=True)
class _Level:
    """One directory on the way down: its subdirectories still to remove, and how to check
    that ``..`` leads back to its parent."""

    pending: list[str]
    name: str = ""
    parent_id: tuple[int, int] = (0, 0)


def _empty_dir(parent_fd: int, name: str) -> None:
    """Remove everything inside ``name`` (a directory in `parent_fd`), depth first.

    Iterative, with one open fd at a time: the way back up is ``..``, checked against the
    (st_dev, st_ino) seen on the way down, so a directory moved meanwhile cannot lead the
    removal out of the tree.
    """
    fd = _open_dir_for_removal(parent_fd, name)
    try:
        root_dev = os.fstat(fd).st_dev
        levels = [_Level(pending=_unlink_non_dirs(fd))]
        while levels:
            level = levels[-1]
            if level.pending:
                sub = level.pending.pop()
                try:
                    child = _open_dir_for_removal(fd, sub)
                except FileNotFoundError:
                    continue
                here = os.fstat(fd)
                if os.fstat(child).st_dev != root_dev:
                    os.close(child)
                    raise OSError(errno.EXDEV, "a mount point inside the workspace", sub)
                os.close(fd)
                fd = child
                levels.append(
                    _Level(_unlink_non_dirs(fd), name=sub, parent_id=(here.st_dev, here.st_ino))
                )
                continue
            levels.pop()
            if not levels:
                break
            up = os.open("..", _DIR_FLAGS, dir_fd=fd)
            up_st = os.fstat(up)
            if (up_st.st_dev, up_st.st_ino) != level.parent_id:
                os.close(up)
                raise OSError(errno.ESTALE, "the tree was moved while being removed", level.name)
            os.close(fd)
            fd = up
            _ignore_missing(os.rmdir, level.name, fd)
    finally:
        os.close(fd)


def _unlink_non_dirs(dir_fd: int) -> list[str]:
    """Unlink every entry of `dir_fd` that is not a directory; return the directories."""
    subdirs: list[str] = []
    with os.scandir(dir_fd) as entries:
        listed = list(entries)
    for entry in listed:
        if entry.is_dir(follow_symlinks=False):
            subdirs.append(entry.name)
        else:
            _ignore_missing(os.unlink, entry.name, dir_fd)
    return subdirs


def _open_dir_for_removal(parent_fd: int, name: str) -> int:
    """Open a directory to empty it, first giving its owner (us) back rwx on it: the guest
    may have chmod-ed it to 0, which would otherwise leave it behind when not root."""
    try:
        fd = os.open(name, _DIR_FLAGS, dir_fd=parent_fd)
    except PermissionError:
        # chmod through an O_PATH fd's /proc link changes exactly the directory opened
        # with O_NOFOLLOW, never what a symlink swapped in under that name points to.
        path_fd = os.open(name, _PATH_DIR_FLAGS, dir_fd=parent_fd)
        try:
            Path(f"/proc/self/fd/{path_fd}").chmod(0o700)
        finally:
            os.close(path_fd)
        fd = os.open(name, _DIR_FLAGS, dir_fd=parent_fd)
    try:
        mode = stat.S_IMODE(os.fstat(fd).st_mode)
        if mode & stat.S_IRWXU != stat.S_IRWXU:
            os.fchmod(fd, mode | stat.S_IRWXU)
    except BaseException:
        os.close(fd)
        raise
    return fd


# --- listing ----------------------------------------------------------------------------


@dataclass(slots=True)
class _Listing:
    max_files: int
    max_total_bytes: int
    max_hash_bytes: int
    files: list[FileInfo] = field(default_factory=list)
    truncated: bool = False
    hashed_bytes: int = 0
    entries_left: int = _MAX_ENTRIES_SCANNED


def list_files(
    ws_path: Path,
    *,
    max_files: int = 1000,
    max_total_bytes: int = 256 * 2**20,
    max_hash_bytes: int = 64 * 2**20,
) -> tuple[list[FileInfo], bool]:
    """List the regular files under `ws_path`, sorted by path, without following symlinks.

    Symlinks, FIFOs, sockets and devices are skipped (never opened in a way that could
    block). Each file gets its size (fstat), its SHA-256 (None when it is over
    `max_hash_bytes`, when hashing it would pass `max_total_bytes` read in all, or when it
    cannot be opened) and a MIME type: from the name's suffix (Python's built-in table, the
    same on every host), else from magic numbers (png, jpeg, gif, pdf, zip, gzip), else
    "text/plain" for a file of at most 64 KiB of NUL-free UTF-8, else
    "application/octet-stream". Paths are relative and '/'-separated; `FileInfo` neutralises
    each to one line (`output.neutralise_line`) and keeps the name as on disk aside
    (`FileInfo.raw_path()`), so a name can neither carry escape sequences or line breaks
    into a result nor stop the file from being read back.

    Returns:
        ``(files, truncated)``: `truncated` is True when files were left out (more than
        `max_files`, deeper than `MAX_DEPTH` directories, more than 100,000 entries, an
        unreadable directory) or a file was not hashed because `max_total_bytes` was spent.

    Raises:
        SandboxError: `ws_path` itself is missing, a symlink or not a directory.
    """
    state = _Listing(
        max_files=max_files, max_total_bytes=max_total_bytes, max_hash_bytes=max_hash_bytes
    )
    root_fd = _open_workspace_root(ws_path, "list")
    try:
        _list_dir(root_fd, "", 0, state)
    finally:
        os.close(root_fd)
    state.files.sort(key=lambda info: info.path)
    return state.files, state.truncated


def _list_dir(dir_fd: int, prefix: str, depth: int, state: _Listing) -> bool:
    """Add the files under `dir_fd` to `state`; return True when the listing must stop."""
    with os.scandir(dir_fd) as it:
        entries = list(itertools.islice(it, state.entries_left + 1))
    if len(entries) > state.entries_left:
        state.truncated = True
        entries = entries[: state.entries_left]
    state.entries_left -= len(entries)
    # Walk in name order, so that which files a bound leaves out does not depend on
    # the order the filesystem returns them in.
    entries.sort(key=lambda entry: entry.name)
    for entry in entries:
        try:
            is_dir = entry.is_dir(follow_symlinks=False)
            is_file = not is_dir and entry.is_file(follow_symlinks=False)
        except OSError:
            continue
        # As on disk (surrogate-escaped where not UTF-8): FileInfo shows it neutralised.
        relpath = prefix + entry.name
        if is_dir:
            if depth >= MAX_DEPTH:
                state.truncated = True
                continue
            try:
                child = os.open(entry.name, _DIR_FLAGS, dir_fd=dir_fd)
            except OSError:
                state.truncated = True
                continue
            try:
                if _list_dir(child, relpath + "/", depth + 1, state):
                    return True
            finally:
                os.close(child)
        elif is_file:
            if len(state.files) >= state.max_files:
                state.truncated = True
                return True
            info = _describe_file(dir_fd, entry.name, relpath, state)
            if info is not None:
                state.files.append(info)
    return False


def _describe_file(dir_fd: int, name: str, relpath: str, state: _Listing) -> FileInfo | None:
    try:
        fd = os.open(name, _FILE_FLAGS, dir_fd=dir_fd)
    except PermissionError:
        return _describe_unreadable(dir_fd, name, relpath)
    except OSError:
        # Gone, or replaced by a symlink (ELOOP) since it was listed.
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return None
        size = st.st_size
        hash_it = size <= state.max_hash_bytes
        if hash_it and state.hashed_bytes + size > state.max_total_bytes:
            hash_it = False
            state.truncated = True
        digest: str | None = None
        if size <= _TEXT_SNIFF_BYTES:
            head = _pread_up_to(fd, size)
            whole = len(head) == size
            if hash_it:
                digest = hashlib.sha256(head).hexdigest()
        else:
            head = _pread_up_to(fd, _MAGIC_BYTES)
            whole = False
            if hash_it:
                digest = _sha256_of(fd, size)
        if hash_it:
            state.hashed_bytes += size
        return FileInfo(path=relpath, size=size, sha256=digest, mime=_guess_mime(name, head, whole))
    finally:
        os.close(fd)


def _describe_unreadable(dir_fd: int, name: str, relpath: str) -> FileInfo | None:
    # A file the guest chmod-ed to 0 (and we are not root): it exists, so list it, with
    # what lstat and its name can tell.
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except OSError:
        return None
    if not stat.S_ISREG(st.st_mode):
        return None
    mime = _mime_from_name(name) or "application/octet-stream"
    return FileInfo(path=relpath, size=st.st_size, sha256=None, mime=mime)


def _pread_up_to(fd: int, size: int) -> bytes:
    parts: list[bytes] = []
    offset = 0
    while offset < size:
        chunk = os.pread(fd, min(_READ_CHUNK, size - offset), offset)
        if not chunk:
            break
        parts.append(chunk)
        offset += len(chunk)
    return b"".join(parts)


def _sha256_of(fd: int, size: int) -> str:
    """SHA-256 of the first `size` bytes (the size fstat gave: a file that grows while
    being read is hashed as it was when listed)."""
    digest = hashlib.sha256()
    offset = 0
    while offset < size:
        chunk = os.pread(fd, min(_READ_CHUNK, size - offset), offset)
        if not chunk:
            break
        digest.update(chunk)
        offset += len(chunk)
    return digest.hexdigest()


@functools.cache
def _mime_table() -> mimetypes.MimeTypes:
    # A private table built from Python's defaults only, so that a file's MIME type is the
    # same on every host (the module-level functions also read /etc/mime.types).
    table = mimetypes.MimeTypes()
    for suffix, mime in _EXTRA_TYPES.items():
        table.add_type(mime, suffix, strict=False)
    return table


def _mime_from_name(name: str) -> str | None:
    # Only the suffixes are looked up: guess_type reads a whole name as a URL, and a file
    # named "data:text/html,..." must not choose its own type.
    suffixes = "".join(PurePosixPath(name).suffixes)
    if not suffixes:
        return None
    mime, encoding = _mime_table().guess_type("file" + suffixes, strict=False)
    if encoding is not None:
        return _ENCODING_MIME.get(encoding, "application/octet-stream")
    return mime


def _guess_mime(name: str, head: bytes, whole: bool) -> str:
    by_name = _mime_from_name(name)
    # ".bin" and the like say "octet-stream", which is no answer: the content may know better.
    if by_name is not None and by_name != "application/octet-stream":
        return by_name
    for magic, mime in _MAGIC:
        if head.startswith(magic):
            return mime
    if whole and b"\x00" not in head:
        try:
            head.decode("utf-8", errors="strict")
        except UnicodeDecodeError:
            pass
        else:
            return "text/plain"
    return "application/octet-stream"


# --- taking S_ISUID and S_ISGID away ---------------------------------------------------

_SETID_BITS = stat.S_ISUID | stat.S_ISGID
_PATH_FLAGS = os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC


@dataclass(slots=True)
class _Stripping:
    changed: int = 0
    incomplete: list[str] = field(default_factory=list)
    """Why some of the tree may keep its bits (each reason once)."""
    entries_left: int = _MAX_ENTRIES_SCANNED

    def missed(self, why: str) -> None:
        if why not in self.incomplete:
            self.incomplete.append(why)


def _open_workspace_root(ws_path: Path, action: str) -> int:
    """The workspace's own directory fd, never through a symlink.

    Raises:
        SandboxError: `ws_path` is missing, a symlink or not a directory.
    """
    try:
        return os.open(ws_path, _DIR_FLAGS)
    except OSError as exc:
        raise SandboxError(
            f"cannot {action} the workspace {ws_path}: {exc.strerror}",
            hint="the workspace must be a directory (not a symlink) that still exists",
        ) from exc


def strip_privilege_bits(ws_path: Path, *, keep_on_root: int = 0) -> int:
    """Take S_ISUID and S_ISGID off every regular file and directory under `ws_path`,
    `ws_path` itself included (except the bits of `keep_on_root` on it: those the operator
    had set on the directory before the run); return how many were changed.

    Call it after every run on a workspace that outlives the run (``--workspace DIR``): the
    guest's uid is the host uid that started the sandbox, root included, so a setuid or
    setgid file the guest left there would be a privilege-escalation plant on the host.
    The seccomp filter already refuses to set these bits; this is the second layer.

    The walk is `list_files`'s: directory fds, ``O_NOFOLLOW`` on every component, no
    symlink followed, at most `MAX_DEPTH` directories down and 100,000 entries in all.
    Each mode is changed with ``fchmod`` on an fd of the very file or directory that
    ``fstat`` checked, never through its name (when codecage is not root and may not read
    it: through that O_PATH fd's /proc link, the same inode). S_ISVTX and the permission
    bits are kept;
    symlinks, FIFOs, sockets and devices are left alone. What the walk could not reach
    (too deep, too many entries, unreadable, not ours to chmod) is logged at WARNING as
    ``workspace_privilege_bits_not_all_checked``.

    Raises:
        SandboxError: `ws_path` itself is missing, a symlink or not a directory.
    """
    state = _Stripping()
    root_fd = _open_workspace_root(ws_path, "check for setuid files")
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
    with os.scandir(dir_fd) as it:
        entries = list(itertools.islice(it, state.entries_left + 1))
    if len(entries) > state.entries_left:
        state.missed(f"more than {_MAX_ENTRIES_SCANNED} entries")
        entries = entries[: state.entries_left]
    state.entries_left -= len(entries)
    for entry in entries:
        try:
            is_dir = entry.is_dir(follow_symlinks=False)
            is_file = not is_dir and entry.is_file(follow_symlinks=False)
        except OSError:
            continue
        if is_file:
            _strip_entry(dir_fd, entry.name, _FILE_FLAGS, state)
            continue
        if not is_dir:
            continue  # symlinks, FIFOs, sockets, devices
        if depth >= MAX_DEPTH:
            state.missed(f"directories deeper than {MAX_DEPTH}")
            _strip_entry(dir_fd, entry.name, _DIR_FLAGS, state)
            continue
        try:
            child = os.open(entry.name, _DIR_FLAGS, dir_fd=dir_fd)
        except PermissionError:
            _strip_entry(dir_fd, entry.name, _DIR_FLAGS, state)
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


# --- reading ----------------------------------------------------------------------------


def _split_relpath(
    relpath: str,
    *,
    hint: str = "pass a path relative to the workspace, as `files` lists it "
    "(e.g. 'out/report.csv')",
) -> list[str]:
    shown = neutralise_line(relpath)
    if not relpath:
        raise ConfigError("the file path is empty", hint=hint)
    if "\x00" in relpath:
        raise ConfigError(f"the file path '{shown}' contains a NUL byte", hint=hint)
    if relpath.startswith("/"):
        raise ConfigError(f"the file path '{shown}' is absolute", hint=hint)
    parts = relpath.split("/")
    for part in parts:
        if part in ("", ".", ".."):
            raise ConfigError(
                f"the file path '{shown}' has an empty, '.' or '..' component", hint=hint
            )
    if len(parts) > MAX_DEPTH + 1:
        raise ConfigError(
            f"the file path '{shown}' is deeper than {MAX_DEPTH} directories", hint=hint
        )
    return parts


def read_file(ws_path: Path, relpath: str, *, max_bytes: int) -> bytes:
    """Return the content of the regular file `relpath` under `ws_path`: the one function
    through which file content leaves a workspace.

    Each component is opened relative to the previous one with ``O_NOFOLLOW``, so no
    symlink is followed anywhere on the way; the file must be regular by ``fstat`` and is
    read up to `max_bytes`.

    Raises:
        ConfigError: `relpath` is empty, absolute, has an empty, '.' or '..' component, is
            too deep, names nothing, goes through or to a symlink, names something that is
            not a regular file or cannot be read, or the file is larger than `max_bytes`.
        SandboxError: the workspace itself cannot be opened, or reading failed.
    """
    parts = _split_relpath(relpath)
    shown = neutralise_line(relpath)
    try:
        dir_fd = os.open(ws_path, _PATH_DIR_FLAGS)
    except OSError as exc:
        raise SandboxError(
            f"cannot open the workspace {ws_path}: {exc.strerror}",
            hint="the workspace must be a directory (not a symlink) that still exists",
        ) from exc
    try:
        for part in parts[:-1]:
            try:
                next_fd = os.open(part, _PATH_DIR_FLAGS, dir_fd=dir_fd)
            except OSError as exc:
                raise _refusal(
                    shown, exc, "a directory on its way is missing or a symlink"
                ) from exc
            os.close(dir_fd)
            dir_fd = next_fd
        return _read_regular(dir_fd, parts[-1], shown, max_bytes)
    finally:
        os.close(dir_fd)


def _read_regular(dir_fd: int, name: str, shown: str, max_bytes: int) -> bytes:
    # lstat first, so that a FIFO or device is refused without ever being opened; fstat
    # after opening closes the race with a swap.
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except OSError as exc:
        raise _refusal(shown, exc, "it does not exist") from exc
    if stat.S_ISLNK(st.st_mode):
        raise _refusal(shown, None, "it is a symlink, and symlinks are never followed")
    if not stat.S_ISREG(st.st_mode):
        raise _refusal(shown, None, "it is not a regular file")
    try:
        fd = os.open(name, _FILE_FLAGS, dir_fd=dir_fd)
    except OSError as exc:
        raise _refusal(shown, exc, "it cannot be opened") from exc
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _refusal(shown, None, "it is not a regular file")
        size = st.st_size
        if size > max_bytes:
            raise ConfigError(
                f"'{shown}' is {size} bytes, over the {max_bytes}-byte read limit",
                hint="read a smaller file, or raise the limit if the caller allows it",
            )
        try:
            data = _pread_up_to(fd, max_bytes + 1)
        except OSError as exc:
            raise SandboxError(
                f"reading '{shown}' from the workspace failed: {exc.strerror}",
                hint="run it again; if it persists, check the host's disk and memory",
            ) from exc
    finally:
        os.close(fd)
    if len(data) > max_bytes:
        raise ConfigError(
            f"'{shown}' grew past the {max_bytes}-byte read limit while being read",
            hint="read it again once nothing writes to it",
        )
    return data


_REFUSED_ERRNOS = frozenset(
    {
        errno.ENOENT,
        errno.ENOTDIR,
        errno.ELOOP,
        errno.EACCES,
        errno.EPERM,
        errno.ENAMETOOLONG,
        errno.ENXIO,
    }
)


def _refusal(shown: str, exc: OSError | None, why: str) -> ConfigError | SandboxError:
    hint = "pass the path of a regular file as `files` lists it; symlinks are not followed"
    if exc is None:
        return ConfigError(f"cannot read '{shown}' from the workspace: {why}", hint=hint)
    if exc.errno in _REFUSED_ERRNOS:
        return ConfigError(
            f"cannot read '{shown}' from the workspace: {why} ({exc.strerror})", hint=hint
        )
    return SandboxError(
        f"cannot read '{shown}' from the workspace: {exc.strerror}",
        hint="run it again; if it persists, check the host's disk and memory",
    )
