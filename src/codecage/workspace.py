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
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from codecage.errors import ConfigError, HostError, SandboxError
from codecage.models import FileInfo, LayerStatus
from codecage.output import neutralise_line, neutralise_text

__all__ = [
    "MAX_DEPTH",
    "Workspace",
    "can_mount_tmpfs",
    "create_ephemeral",
    "destroy",
    "list_files",
    "read_file",
    "strip_privilege_bits",
    "use_existing",
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
            hint="pass --workspace-mb 1 or more; `codecage info` lists the defaults",
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
    shown = neutralise_text(str(path))
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
            f"cannot remove the workspace {ws.path}: {neutralise_text(str(exc))}",
            hint=f"remove {ws.path} by hand (`umount -l` it first if it is still mounted)",
        ) from exc


def _remove_tree(path: Path) -> None:
    try:
        parent_fd = os.open(path.parent, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    except FileNotFoundError:
        return
    try:
        try:
            st = os.stat(path.name, dir_fd=parent_fd, follow_symlinks=False)
        except FileNotFoundError:
            return
        if stat.S_ISDIR(st.st_mode):
            _empty_dir(parent_fd, path.name)
            _ignore_missing(os.rmdir, path.name, parent_fd)
        else:
            _ignore_missing(os.unlink, path.name, parent_fd)
    finally:
        os.close(parent_fd)


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


def strip_privilege_bits(ws_path: Path) -> int:
    """Take S_ISUID and S_ISGID off every regular file and directory under `ws_path`,
    `ws_path` itself included; return how many were changed.

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
        _strip_fd(root_fd, ".", state)
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


def _strip_fd(fd: int, name: str, state: _Stripping, *, by_path_fd: bool = False) -> None:
    st = os.fstat(fd)
    if not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)):
        return
    if not st.st_mode & _SETID_BITS:
        return
    mode = stat.S_IMODE(st.st_mode) & ~_SETID_BITS
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
            extra={"name": neutralise_text(name), "error": exc.strerror},
        )
        state.missed("entries this user may not chmod")
        return
    state.changed += 1


# --- reading ----------------------------------------------------------------------------


def _split_relpath(relpath: str) -> list[str]:
    shown = neutralise_line(relpath)
    hint = "pass a path relative to the workspace, as `files` lists it (e.g. 'out/report.csv')"
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
