"""Files in and out of a workspace: uploads written before the run, and `read_file`, the
one way file content leaves it.

Both take a name from outside (a caller's upload, a path the result listed), so each is
split into plain relative components and opened one at a time relative to the previous one
with ``O_NOFOLLOW``: nothing is written or read through a link.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Mapping
from pathlib import Path

from codecage.backends.base import Identity
from codecage.engine.workspace import fds
from codecage.engine.workspace.lifecycle import Workspace
from codecage.errors import CodecageError, ConfigError, SandboxError
from codecage.fdio import write_all
from codecage.kept import KeptFiles, check_relpath
from codecage.models import FileInfo
from codecage.output import neutralise_line


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


def write_files(
    ws: Workspace, files: Mapping[str, bytes], size_mb: int, *, replace: bool = False
) -> None:
    """Write `files` (relative path -> content) into the fresh workspace `ws` before the
    code runs: in its tmpfs when it has one, so they count against its `size_mb` MiB like
    everything the code writes, and go with it.

    Every component is created and opened relative to the previous one with
    ``O_NOFOLLOW``, files with ``O_EXCL``: nothing is written through a link.

    Raises:
        ConfigError: a bad name, two names that collide (a file where another needs a
            directory), a name taken (unless `replace`: a session's workspace, where the
            name is unlinked first, a link itself and never its target), or the files do
            not fit in the workspace.
        SandboxError: writing failed otherwise.
    """
    root_fd = fds.open_root(ws.path, "write the files into")
    # The sandbox's own host id owns what is in its workspace: it may change its inputs.
    owner = ws.owner if ws.owner is not None and ws.owner.uid != os.geteuid() else None
    try:
        for name, data in files.items():
            parts = _upload_parts(name)
            try:
                _write_one(root_fd, parts, data, owner, replace=replace)
            except OSError as exc:
                raise _write_refusal(name, exc, size_mb) from exc
    finally:
        os.close(root_fd)


def _write_one(
    root_fd: int, parts: list[str], data: bytes, owner: Identity | None, *, replace: bool
) -> None:
    dir_fd = os.dup(root_fd)
    try:
        for part in parts[:-1]:
            with contextlib.suppress(FileExistsError):
                os.mkdir(part, 0o755, dir_fd=dir_fd)
            next_fd = os.open(part, fds.DIR_FLAGS, dir_fd=dir_fd)
            os.close(dir_fd)
            dir_fd = next_fd
            if owner is not None:
                os.fchown(dir_fd, owner.uid, owner.gid)
        if replace:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(parts[-1], dir_fd=dir_fd)  # a directory stays: EISDIR, refused
        fd = os.open(parts[-1], _CREATE_FLAGS, 0o644, dir_fd=dir_fd)
        try:
            if owner is not None:
                os.fchown(fd, owner.uid, owner.gid)
            write_all(fd, data)
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


def _split_relpath(
    relpath: str,
    *,
    hint: str = "pass a path relative to the workspace, as `files` lists it "
    "(e.g. 'out/report.csv')",
) -> list[str]:
    parts = check_relpath(relpath, hint=hint)
    shown = neutralise_line(relpath)
    if len(parts) > fds.MAX_DEPTH + 1:
        raise ConfigError(
            f"the file path '{shown}' is deeper than {fds.MAX_DEPTH} directories", hint=hint
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
        dir_fd = os.open(ws_path, fds.PATH_DIR_FLAGS)
    except OSError as exc:
        raise SandboxError(
            f"cannot open the workspace {ws_path}: {exc.strerror}",
            hint="the workspace must be a directory (not a symlink) that still exists",
        ) from exc
    try:
        for part in parts[:-1]:
            try:
                next_fd = os.open(part, fds.PATH_DIR_FLAGS, dir_fd=dir_fd)
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
        fd = os.open(name, fds.FILE_FLAGS, dir_fd=dir_fd)
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
            data = fds.pread_up_to(fd, max_bytes + 1)
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


def keep(ws_path: Path, listing: list[FileInfo], max_bytes: int) -> KeptFiles:
    """The bytes of the files `listing` names, read through `read_file` while the workspace
    exists, up to `max_bytes` together: a file that does not fit in what is left is named
    with the reason, not kept; so is one that cannot be read (it changed, or is a link now).
    """
    data: dict[str, bytes] = {}
    not_kept: dict[str, str] = {}
    aliases: dict[str, str] = {}
    left = max_bytes
    for info in listing:
        name = info.raw_path()
        if info.path != name:
            aliases[info.path] = name
        if info.size > left:
            not_kept[name] = (
                f"it is {info.size} bytes and the run's files kept may be "
                f"{max_bytes} bytes together (keep_files_mb)"
            )
            continue
        try:
            data[name] = read_file(ws_path, name, max_bytes=left)
        except CodecageError as exc:
            not_kept[name] = str(exc)
            continue
        left -= len(data[name])
    return KeptFiles(data=data, not_kept=not_kept, aliases=aliases)
