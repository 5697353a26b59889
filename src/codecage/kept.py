"""The files a run left, kept in the host's memory after its workspace is gone: what
`ExecutionResult.read_file` and `save_files` give back to a library caller.

The engine reads them at the one moment the workspace can be read (`on_files`), through
`engine.workspace.read_file` (no link followed, regular files only, bounded); what did not
fit in the bound is named here with the reason, never silently missing. Saving writes into
a caller's directory without following a link there either: each component is made and
opened relative to the previous one with ``O_NOFOLLOW``, files with ``O_EXCL``.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from codecage.errors import ConfigError
from codecage.fdio import write_all
from codecage.output import neutralise_line

DEFAULT_KEEP_FILES_MB = 64
"""MiB of a run's files a library result keeps by default (all files together)."""

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_PATH_HINT = "pass a path relative to /workspace as `result.files` lists it, e.g. 'out/a.csv'"


@dataclass(frozen=True, slots=True)
class KeptFiles:
    """A run's files by their names on disk: the bytes of those kept, and for the others
    why not (e.g. over `keep_files_mb`). `aliases` maps a name as the result lists it
    (neutralised) to its name on disk, when the two differ."""

    data: Mapping[str, bytes] = field(default_factory=dict)
    not_kept: Mapping[str, str] = field(default_factory=dict)
    aliases: Mapping[str, str] = field(default_factory=dict)

    def read(self, path: str) -> bytes:
        """The bytes of the file `path` (as `result.files` lists it, or as on disk).

        Raises:
            ConfigError: a bad path ('..', absolute, NUL, empty), a file the run did not
                write, or one that was not kept (the message says why).
        """
        name = self._name_of(path)
        if name in self.data:
            return self.data[name]
        shown = neutralise_line(path)
        if name in self.not_kept:
            raise ConfigError(
                f"'{shown}' was not kept: {self.not_kept[name]}",
                hint="pass a larger {keep_files_mb} to run() or Options(), or read it "
                "in an `on_files` callback while the workspace exists",
            )
        raise ConfigError(
            f"the run left no file '{shown}' in /workspace",
            hint="pass one of the paths `result.files` lists",
        )

    def _name_of(self, path: str) -> str:
        check_relpath(path)
        return self.aliases.get(path, path)

    def save(self, directory: Path, *, overwrite: bool, partial: bool) -> list[Path]:
        """Write the kept files under `directory` (made when missing) and return their
        paths. Refused before anything is written when a file was not kept (unless
        `partial`) or, without `overwrite`, when one exists already.

        Raises:
            ConfigError: a file was not kept, one exists, a link or a file is in the way,
                or writing failed.
        """
        if self.not_kept and not partial:
            names = ", ".join(sorted(neutralise_line(n) for n in self.not_kept)[:5])
            raise ConfigError(
                f"{len(self.not_kept)} file(s) of the run were not kept ({names}): "
                f"{next(iter(self.not_kept.values()))}",
                hint="pass partial=True to save the others, or a larger {keep_files_mb}",
            )
        root_fd = _open_destination(directory)
        try:
            if not overwrite:
                for name in self.data:
                    _refuse_existing(root_fd, name, directory)
            return [
                _save_one(root_fd, directory, name, data, overwrite=overwrite)
                for name, data in self.data.items()
            ]
        finally:
            os.close(root_fd)


def check_relpath(path: str, *, hint: str = _PATH_HINT) -> list[str]:
    """`path`'s components, when it is a plain relative path inside the workspace (the one
    rule for a path a caller names in a workspace: uploads, reads, kept files).

    Raises:
        ConfigError: it is empty, absolute, holds a NUL or a lone surrogate, or an empty, '.'
            or '..' component.
    """
    shown = neutralise_line(path)
    if not path:
        raise ConfigError("the file path is empty", hint=hint)
    if "\x00" in path:
        raise ConfigError(f"the file path '{shown}' contains a NUL byte", hint=hint)
    try:
        os.fsencode(path)  # a lone surrogate names no file: os.stat would raise, not refuse
    except UnicodeEncodeError:
        raise ConfigError(
            f"the file path '{shown}' is not valid text (a lone surrogate)", hint=hint
        ) from None
    if path.startswith("/"):
        raise ConfigError(f"the file path '{shown}' is absolute", hint=hint)
    parts = path.split("/")
    if any(part in ("", ".", "..") for part in parts):
        raise ConfigError(f"the file path '{shown}' has an empty, '.' or '..' component", hint=hint)
    return parts


def _open_destination(directory: Path) -> int:
    """`directory`'s fd, made first when missing; the directory itself must not be a link.

    Raises:
        ConfigError: it cannot be made, or it is a link or not a directory.
    """
    try:
        directory.mkdir(parents=True, exist_ok=True)
        return os.open(directory, _DIR_FLAGS)
    except OSError as exc:
        raise ConfigError(
            f"cannot save the files into {directory}: {exc.strerror}"
            + (" (it is a symlink: links are never followed)" if directory.is_symlink() else ""),
            hint="pass a directory that is not a symlink, or a path where one can be made",
        ) from exc


def _refuse_existing(root_fd: int, name: str, directory: Path) -> None:
    parts = name.split("/")
    dir_fd = os.dup(root_fd)
    try:
        for part in parts[:-1]:
            try:
                next_fd = os.open(part, _DIR_FLAGS, dir_fd=dir_fd)
            except FileNotFoundError:
                return
            except OSError as exc:
                raise _save_refusal(directory, name, exc) from exc
            os.close(dir_fd)
            dir_fd = next_fd
        with contextlib.suppress(FileNotFoundError):
            os.stat(parts[-1], dir_fd=dir_fd, follow_symlinks=False)
            raise ConfigError(
                f"{directory / neutralise_line(name)} exists already",
                hint="pass {overwrite} to replace it, or save into an empty directory",
            )
    finally:
        os.close(dir_fd)


def _save_one(root_fd: int, directory: Path, name: str, data: bytes, *, overwrite: bool) -> Path:
    parts = name.split("/")
    dir_fd = os.dup(root_fd)
    try:
        try:
            for part in parts[:-1]:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(part, 0o755, dir_fd=dir_fd)
                next_fd = os.open(part, _DIR_FLAGS, dir_fd=dir_fd)  # a link here: ELOOP
                os.close(dir_fd)
                dir_fd = next_fd
            if overwrite:
                _replace(dir_fd, parts[-1])
            fd = os.open(parts[-1], _CREATE_FLAGS, 0o644, dir_fd=dir_fd)
        except OSError as exc:
            raise _save_refusal(directory, name, exc) from exc
        try:
            write_all(fd, data)
        finally:
            os.close(fd)
    finally:
        os.close(dir_fd)
    return directory.joinpath(*parts)


def _replace(dir_fd: int, name: str) -> None:
    """Remove what `overwrite` replaces: a file or a link (the link itself, never what it
    points to); a directory stays and the create then fails."""
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(st.st_mode):
        os.unlink(name, dir_fd=dir_fd)


def _save_refusal(directory: Path, name: str, exc: OSError) -> ConfigError:
    why = exc.strerror or str(exc)
    if exc.errno in (errno.ELOOP, errno.ENOTDIR):
        why += " (a symlink or a file is in the way; links are never followed)"
    return ConfigError(
        f"cannot write {directory / neutralise_line(name)}: {why}",
        hint="save into another directory, or remove what is in the way",
    )
