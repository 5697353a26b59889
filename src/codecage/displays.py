"""A run's display outputs on the host: described in one line for a person or a model, and
saved as files (`figure-1.png`, `display-2.html`, ...).

The outputs come from the sandbox (`ExecutionResult.displays`): their text is the code's,
so what is shown is neutralised, and what is written never follows a link nor replaces a
file.
"""

from __future__ import annotations

import base64
import binascii
import json
import os
from pathlib import Path

from codecage.errors import ConfigError
from codecage.models import DisplayOutput
from codecage.models.result import DisplayMime
from codecage.output import neutralise_line, size_text

__all__ = ["describe", "image_bytes", "label", "png_size", "save", "text_form"]

# The form of a MIME type as a file, richest first; text/plain only when it is all there is.
_SUFFIXES: dict[DisplayMime, str] = {
    "image/png": ".png",
    "image/jpeg": ".jpg",
    "image/svg+xml": ".svg",
    "text/html": ".html",
    "text/markdown": ".md",
    "application/json": ".json",
}
_IMAGES: tuple[DisplayMime, ...] = ("image/png", "image/jpeg")
_WRITE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def label(display: DisplayOutput) -> str:
    """ "figure 1" for an output with an image, "display 2" otherwise (numbered from 1)."""
    kind = "figure" if any(m in display.data for m in _IMAGES) else "display"
    return f"{kind} {display.index + 1}"


def image_bytes(display: DisplayOutput) -> tuple[DisplayMime, bytes] | None:
    """The output's raster image (PNG first), decoded; None when it has none."""
    for mime in _IMAGES:
        value = display.data.get(mime)
        if isinstance(value, str):
            try:
                return mime, base64.b64decode(value, validate=True)
            except (binascii.Error, ValueError):
                return None
    return None


def png_size(data: bytes) -> tuple[int, int] | None:
    """Width and height from a PNG's header; None when `data` is not a PNG."""
    if len(data) < 24 or not data.startswith(b"\x89PNG\r\n\x1a\n") or data[12:16] != b"IHDR":
        return None
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


def text_form(display: DisplayOutput) -> str | None:
    """The text a person or a model reads of an output without an image: its markdown,
    else its plain text (a DataFrame's table); None for an image (a figure's text/plain,
    "<Figure size ...>", says nothing its image does not) or an output without text.

    Raises:
        Nothing.
    """
    if image_bytes(display) is not None:
        return None
    for mime in ("text/markdown", "text/plain"):
        value = display.data.get(mime)
        if isinstance(value, str):
            return value
    return None


def describe(display: DisplayOutput) -> str:
    """One line: "figure 1: image/png 640x480, 23.4 KB", or "display 2: " and the start
    of its text (neutralised: the code chose it).

    Raises:
        Nothing.
    """
    image = image_bytes(display)
    if image is not None:
        mime, data = image
        size = png_size(data) if mime == "image/png" else None
        dimensions = f" {size[0]}x{size[1]}" if size else ""
        return f"{label(display)}: {mime}{dimensions}, {size_text(len(data))}"
    text = display.data.get("text/markdown") or display.data.get("text/plain") or ""
    shown = neutralise_line(str(text))
    return f"{label(display)}: {shown[:200]}" + ("…" if len(shown) > 200 else "")


def save(displays: list[DisplayOutput], directory: Path) -> list[Path]:
    """Write each output's forms to `directory` (made if missing, one level): figure-1.png,
    display-2.html, display-3.json, ...; an output with only text as display-N.txt. Never
    follows a link (the directory itself, or a name in it) and never replaces a file: every
    name is checked before anything is written.

    Raises:
        ConfigError: `directory` is a link or not a directory, cannot be made or written,
            or one of the names is taken.
    """
    planned = [(name, data) for display in displays for name, data in _files_of(display)]
    dir_fd = _open_directory(directory)
    try:
        taken = [name for name, _ in planned if _exists(name, dir_fd)]
        if taken:
            raise ConfigError(
                f"{directory} already has {', '.join(taken[:5])}: display outputs are never "
                "written over a file",
                hint="choose an empty directory, or remove those files",
            )
        return [directory / _write(name, data, dir_fd, directory) for name, data in planned]
    finally:
        os.close(dir_fd)


def _files_of(display: DisplayOutput) -> list[tuple[str, bytes]]:
    stem = label(display).replace(" ", "-")
    files: list[tuple[str, bytes]] = []
    for mime, suffix in _SUFFIXES.items():
        value = display.data.get(mime)
        if value is None:
            continue
        if mime in _IMAGES:
            try:
                files.append((stem + suffix, base64.b64decode(str(value), validate=True)))
            except (binascii.Error, ValueError):
                continue  # checked by the host when it came; a made-up result may not be
        elif mime == "application/json":
            files.append((stem + suffix, json.dumps(value, indent=2).encode("utf-8")))
        else:
            files.append((stem + suffix, str(value).encode("utf-8", "surrogatepass")))
    if not files:
        plain = str(display.data.get("text/plain", ""))
        files.append((stem + ".txt", plain.encode("utf-8", "surrogatepass")))
    return files


def _open_directory(directory: Path) -> int:
    try:
        directory.mkdir(mode=0o755, exist_ok=True)
    except OSError as exc:
        raise ConfigError(
            f"cannot make the directory {directory}: {exc.strerror}",
            hint="give a directory whose parent exists and is writable",
        ) from exc
    try:
        return os.open(directory, _DIR_FLAGS)
    except OSError as exc:
        raise ConfigError(
            f"cannot write display outputs to {directory}: it is a link or not a directory "
            f"({exc.strerror})",
            hint="give a real directory, not a symbolic link",
        ) from exc


def _exists(name: str, dir_fd: int) -> bool:
    try:
        os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return True


def _write(name: str, data: bytes, dir_fd: int, directory: Path) -> str:
    try:
        fd = os.open(name, _WRITE_FLAGS, 0o644, dir_fd=dir_fd)
    except OSError as exc:  # e.g. made by someone else since the check: still not replaced
        raise ConfigError(
            f"cannot write {directory / name}: {exc.strerror}",
            hint="choose an empty directory, or remove that file",
        ) from exc
    with os.fdopen(fd, "wb") as out:
        out.write(data)
    return name
