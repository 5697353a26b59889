"""The workspace helper: `workspace` (a `Workspace` over /workspace), files by paths
relative to it, every path checked to stay inside."""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..contract import WORKSPACE_DIR

if TYPE_CHECKING:
    from pathlib import Path


class WorkspacePathError(ValueError):
    """A path that leads outside the workspace (absolute elsewhere, `..`, a link out)."""


class Workspace:
    """Files in the workspace (/workspace), by paths relative to it.

    Every path is resolved (links followed) and must stay inside the workspace, or the
    call raises `WorkspacePathError` before touching anything; an absolute path is fine
    when it is inside. Writes create the parent directories. The sandbox is what keeps
    the code from the host's files; these rules only catch mistakes early and clearly.
    """

    def __init__(self, root: str | os.PathLike[str] = WORKSPACE_DIR) -> None:
        self._root = os.fspath(root)

    def __repr__(self) -> str:
        return f"Workspace({self._root!r})"

    @property
    def path(self) -> Path:
        """The workspace's root directory."""
        from pathlib import Path

        return Path(self._root)

    def resolve(self, path: str | os.PathLike[str]) -> Path:
        """The absolute path of `path` (relative to the workspace), checked to be inside it.

        Hand it to libraries that take paths: `pandas.read_csv(workspace.resolve("a.csv"))`.

        Raises:
            WorkspacePathError: `path` leads outside the workspace.
        """
        from pathlib import Path

        return Path(self._inside(path))

    def read_text(self, path: str | os.PathLike[str], encoding: str = "utf-8") -> str:
        """The text of a file.

        Raises:
            WorkspacePathError: `path` leads outside the workspace.
            OSError: it cannot be read (FileNotFoundError, IsADirectoryError, ...).
        """
        with open(self._inside(path), encoding=encoding) as f:
            return f.read()

    def read_bytes(self, path: str | os.PathLike[str]) -> bytes:
        """The bytes of a file.

        Raises:
            WorkspacePathError: `path` leads outside the workspace.
            OSError: it cannot be read.
        """
        with open(self._inside(path), "rb") as f:
            return f.read()

    def read_json(self, path: str | os.PathLike[str]) -> Any:
        """A JSON file's value.

        Raises:
            WorkspacePathError: `path` leads outside the workspace.
            OSError: it cannot be read.
            ValueError: it is not JSON (json.JSONDecodeError).
        """
        return json.loads(self.read_text(path))

    def write_text(self, path: str | os.PathLike[str], text: str, encoding: str = "utf-8") -> Path:
        """Write `text` to a file (replacing it); return its absolute path.

        Raises:
            WorkspacePathError: `path` leads outside the workspace.
            OSError: it cannot be written (e.g. the workspace size limit).
        """
        target = self._writable(path)
        with open(target, "w", encoding=encoding) as f:
            f.write(text)
        return target

    def write_bytes(self, path: str | os.PathLike[str], data: bytes) -> Path:
        """Write `data` to a file (replacing it); return its absolute path.

        Raises:
            WorkspacePathError: `path` leads outside the workspace.
            OSError: it cannot be written.
        """
        target = self._writable(path)
        with open(target, "wb") as f:
            f.write(data)
        return target

    def write_json(self, path: str | os.PathLike[str], value: Any) -> Path:
        """Write `value` as JSON (indented by 2, UTF-8); return the file's absolute path.

        Raises:
            WorkspacePathError: `path` leads outside the workspace.
            TypeError: `value` is not JSON-serialisable (nothing is written then).
            OSError: it cannot be written.
        """
        text = json.dumps(value, indent=2, ensure_ascii=False) + "\n"
        return self.write_text(path, text)

    def list(self, pattern: str = "*") -> list[str]:
        """Relative paths of the regular files whose path matches `pattern`, sorted.

        Recursive, like `Path.rglob`: "*" is every file, "*.csv" every CSV file at any
        depth, "out/*.json" the JSON files directly in any directory named out. Links are
        not followed and not listed.

        Raises:
            WorkspacePathError: `pattern` is absolute or has a `..` part.
        """
        from fnmatch import fnmatchcase

        parts = [p for p in pattern.replace(os.sep, "/").split("/") if p not in ("", ".")]
        if pattern.startswith("/") or ".." in parts:
            raise WorkspacePathError(
                f"list({pattern!r}): a pattern is matched inside the workspace; it may not be "
                "absolute or hold '..'"
            )
        parts = parts or ["*"]
        root = os.path.realpath(self._root)
        found: list[str] = []
        for directory, _dirs, files in os.walk(root, followlinks=False):
            relative_dir = os.path.relpath(directory, root)
            prefix = [] if relative_dir == "." else relative_dir.split(os.sep)
            for name in files:
                full = os.path.join(directory, name)
                try:
                    if not stat.S_ISREG(os.lstat(full).st_mode):
                        continue
                except OSError:
                    continue
                segments = [*prefix, name]
                if _match_tail(segments, parts, fnmatchcase):
                    found.append("/".join(segments))
        return sorted(found)

    def exists(self, path: str | os.PathLike[str]) -> bool:
        """Whether `path` exists in the workspace (a file or a directory).

        Raises:
            WorkspacePathError: `path` leads outside the workspace.
        """
        return os.path.exists(self._inside(path))

    def delete(self, path: str | os.PathLike[str], missing_ok: bool = False) -> None:
        """Remove a file (a link is removed, not what it points to) or an empty directory.

        Raises:
            WorkspacePathError: `path` leads outside the workspace, or is its root.
            FileNotFoundError: there is nothing at `path` (unless `missing_ok`).
            OSError: it cannot be removed (e.g. a directory that is not empty).
        """
        text = os.fspath(path)
        root = os.path.realpath(self._root)
        lexical = os.path.normpath(os.path.join(root, text))
        if not _within(lexical, root):
            self._inside(text)  # raises, naming the rule broken
        if lexical == root:
            raise WorkspacePathError(f"{text!r} is the workspace itself: it cannot be deleted")
        # The last part is not resolved: a link is removed, not what it points to.
        parent, name = os.path.split(lexical)
        target = os.path.join(self._inside(parent, asked=text), name)
        try:
            mode = os.lstat(target).st_mode
        except FileNotFoundError:
            if missing_ok:
                return
            raise
        if stat.S_ISDIR(mode):
            os.rmdir(target)
        else:
            os.unlink(target)

    def _inside(self, path: str | os.PathLike[str], asked: str | None = None) -> str:
        """`path` resolved against the root (links followed); it must be inside.

        `asked` is the path the caller was given, if `path` was derived from it: the
        error names it, and the rule it broke.
        """
        text = os.fspath(path)
        if not isinstance(text, str):
            raise TypeError(f"workspace paths are strings, not {type(text).__name__}")
        root = os.path.realpath(self._root)
        target = os.path.realpath(os.path.join(root, text))
        if _within(target, root):
            return target
        text = text if asked is None else asked
        if os.path.isabs(text):
            rule = "an absolute path must be inside the workspace"
        elif not _lexically_inside(text):
            rule = "'..' may not climb above the workspace"
        else:
            rule = "it goes through a symbolic link that points out of the workspace"
        raise WorkspacePathError(
            f"{text!r} is outside the workspace {root}: {rule}; use a path relative to the "
            "workspace, such as 'data/report.csv'"
        )

    def _writable(self, path: str | os.PathLike[str]) -> Path:
        from pathlib import Path

        target = self._inside(path)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        return Path(target)


def _within(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def _lexically_inside(relative: str) -> bool:
    depth = 0
    for part in relative.split(os.sep):
        if part == "..":
            depth -= 1
            if depth < 0:
                return False
        elif part not in ("", "."):
            depth += 1
    return True


def _match_tail(segments: list[str], pattern: list[str], match: Callable[[str, str], bool]) -> bool:
    """Whether `pattern` ("**" = any number of parts) matches the end of `segments`."""

    def at(i: int, j: int) -> bool:
        if j == len(pattern):
            return i == len(segments)
        if pattern[j] == "**":
            return any(at(k, j + 1) for k in range(i, len(segments) + 1))
        return i < len(segments) and match(segments[i], pattern[j]) and at(i + 1, j + 1)

    return any(at(start, 0) for start in range(len(segments)))


workspace = Workspace()
"""The sandbox's workspace, /workspace: the program's files, and what it hands back."""


# Public as the package's (codecage.runtime): tracebacks and pickles name it so.
Workspace.__module__ = __package__ or Workspace.__module__
WorkspacePathError.__module__ = __package__ or WorkspacePathError.__module__
