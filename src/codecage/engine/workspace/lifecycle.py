"""A workspace's life on the host: where run directories live (a parent private to the
effective uid, swept of what killed processes left), creating a fresh workspace (a tmpfs
when the host lets us mount) or using the user's ``--workspace DIR``, guarding that
directory's own mode and owner across a run, and removing it all afterwards.

Run directories (and other temp trees of one codecage process) live in a parent private to
the effective uid (`private_parent`), never directly in a world-writable /tmp: nobody else
can plant, swap or symlink an entry there, so sweeping what a killed process left cannot be
turned against another directory or a live run's mount.

Removal walks the tree itself (iteratively, fd-based, never following a symlink, taking
back permissions the guest removed), because ``shutil.rmtree`` recurses once per level and
so fails on a tree a few thousand directories deep, leaving it behind.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import stat
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from codecage.engine.workspace import fds
from codecage.errors import ConfigError, HostError, SandboxError
from codecage.isolation import lending, tmpfs
from codecage.isolation.identity import Identity
from codecage.output import neutralise_line

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Workspace:
    """A run's workspace directory on the host (bind-mounted at /workspace in the sandbox)."""

    path: Path
    tmpfs: bool
    """A size-limited tmpfs is mounted at `path`; `destroy` unmounts it."""
    owned: bool
    """codecage created `path` and `destroy` removes it; False for a user's --workspace DIR."""
    owner: Identity | None = None
    """The sandbox's host ids, which own what is in it during the run (None: this process's)."""
    mount_point: Path | None = None
    """Where a lent `path` is bound for the sandbox (in the run's directory, which the
    sandbox's host id can reach when `path`'s parents are closed to it); None: `path`."""
    protected: lending.Found | None = None
    """In a lent `path`: what stays read-only during the run (`isolation.lending`)."""

    @property
    def bind_source(self) -> Path:
        """The host directory bound at /workspace."""
        return self.mount_point or self.path


# --- the private parent of run directories --------------------------------------------

_SYSTEM_RUN_DIR = Path("/run")


def private_parent() -> Path:
    """The directory that holds this effective uid's run directories and temp trees,
    created on first use: ``/run/codecage`` for root (only root can write /run), else
    ``codecage-<euid>`` in the temp directory ($TMPDIR, else /tmp).

    Its mode is 0700, or 0711 for root: sandboxes then run as another host id
    (`isolation.identity`), whose launcher must pass through it to its own run directory
    (random names, which it cannot list). It is checked on every call, through an
    ``O_NOFOLLOW`` fd: a directory (not a symlink), owned by the effective uid; any other
    mode is set back. Another user who made that name first (in a shared /tmp) gets
    codecage refused, never used.

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


def run_dir_mode() -> int:
    """0711 for root, whose sandboxes run as another id and must pass through; else 0700."""
    return 0o711 if os.geteuid() == 0 else 0o700


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
        fd = os.open(path, fds.DIR_FLAGS)
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
        if stat.S_IMODE(st.st_mode) != run_dir_mode():
            os.fchmod(fd, run_dir_mode())
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


def entry_names(prefixes: tuple[str, ...]) -> list[str]:
    """The names in `private_parent` after one of `prefixes` (what `sweep_stale` judges);
    none when the parent cannot be used."""
    try:
        parent_fd = _open_private_parent()
    except HostError:
        return []
    try:
        with os.scandir(parent_fd) as entries:
            names = [entry.name for entry in entries]
    finally:
        os.close(parent_fd)
    return [n.removeprefix(p) for n in names for p in prefixes if n.startswith(p)]


def _remove_stale(parent_fd: int, name: str) -> bool:
    try:
        fd = os.open(name, fds.DIR_FLAGS, dir_fd=parent_fd)
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
        _unmount_below(fd, "workspace")
    finally:
        os.close(fd)
    _remove_at(parent_fd, name)
    return True


def _unmount_below(dir_fd: int, name: str) -> None:
    """Detach what is mounted on `name` in `dir_fd` (a directory we checked), if anything."""
    for _ in range(8):  # a mount stacked on a mount: a few, never unbounded
        try:
            fd = os.open(name, fds.PATH_DIR_FLAGS, dir_fd=dir_fd)
        except OSError:
            return  # missing, a symlink or not a directory: nothing of ours is mounted there
        try:
            if fds.same_mount(fd, dir_fd):
                return  # not a mount point
            # Through the very fd checked above, never by a name that could be swapped.
            tmpfs.umount_fd(fd, name)
            log.debug("workspace_stale_tmpfs_unmounted")
        finally:
            os.close(fd)


# --- creating and destroying ------------------------------------------------------------


def create_ephemeral(parent: Path, size_mb: int, owner: Identity | None = None) -> Workspace:
    """Create ``parent/"workspace"`` (mode 0700, owned by `owner` when given) for one run.

    When `tmpfs.can_mount_tmpfs()`, a tmpfs of `size_mb` MiB (mode 0700, nosuid, nodev) is
    mounted on it, so the run's files live in memory, are bounded in total and vanish at
    unmount.
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
        if owner is not None:
            os.chown(path, owner.uid, owner.gid, follow_symlinks=False)
    except OSError as exc:
        raise SandboxError(
            f"cannot create the workspace {path}: {exc.strerror}",
            hint=f"check that {parent} exists, is a directory and is writable by this user",
        ) from exc
    if not tmpfs.can_mount_tmpfs():
        return Workspace(path=path, tmpfs=False, owned=True, owner=owner)
    try:
        tmpfs.mount(path, size_mb, None if owner is None else (owner.uid, owner.gid))
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
    return Workspace(path=path, tmpfs=True, owned=True, owner=owner)


def use_existing(
    path: Path, owner: Identity | None = None, run_dir: Path | None = None
) -> Workspace:
    """Use a host directory the user passed (``--workspace DIR``). It is never removed.
    When the sandbox runs as another host id (codecage is root), the directory is bound
    at ``run_dir/"workspace"`` for it (its own parents may be closed to that id).

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
    mount_point = None
    if run_dir is not None and owner is not None and os.geteuid() == 0 and owner.uid != 0:
        mount_point = _bind_for_sandbox(path.absolute(), run_dir / "workspace")
    return Workspace(
        path=path.absolute(), tmpfs=False, owned=False, owner=owner, mount_point=mount_point
    )


def _bind_for_sandbox(path: Path, mount_point: Path) -> Path:
    """Bind `path` (opened without following a symlink) on `mount_point`.

    Raises:
        SandboxError: the bind mount failed.
    """
    fd = fds.open_root(path, "lend")
    try:
        mount_point.mkdir(mode=0o700)
        tmpfs.bind(fd, mount_point)
    except OSError as exc:
        with contextlib.suppress(OSError):
            mount_point.rmdir()
        raise SandboxError(
            f"cannot lend the workspace {neutralise_line(str(path))} to the sandbox: "
            f"{exc.strerror}",
            hint="pass a directory on a local filesystem, or omit --workspace",
        ) from exc
    finally:
        os.close(fd)
    return mount_point


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
    fd = fds.open_root(ws.path, "record the mode of")
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
            tmpfs.umount(ws.path)
        if ws.mount_point is not None:
            tmpfs.umount(ws.mount_point)
            ws.mount_point.rmdir()
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
                if os.fstat(child).st_dev != root_dev or not fds.same_mount(child, fd):
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
            up = os.open("..", fds.DIR_FLAGS, dir_fd=fd)
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
        fd = os.open(name, fds.DIR_FLAGS, dir_fd=parent_fd)
    except PermissionError:
        # chmod through an O_PATH fd's /proc link changes exactly the directory opened
        # with O_NOFOLLOW, never what a symlink swapped in under that name points to.
        path_fd = os.open(name, fds.PATH_DIR_FLAGS, dir_fd=parent_fd)
        try:
            Path(f"/proc/self/fd/{path_fd}").chmod(0o700)
        finally:
            os.close(path_fd)
        fd = os.open(name, fds.DIR_FLAGS, dir_fd=parent_fd)
    try:
        mode = stat.S_IMODE(os.fstat(fd).st_mode)
        if mode & stat.S_IRWXU != stat.S_IRWXU:
            os.fchmod(fd, mode | stat.S_IRWXU)
    except BaseException:
        os.close(fd)
        raise
    return fd
