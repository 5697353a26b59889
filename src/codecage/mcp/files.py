"""Files of an `execute_code` call: uploads decoded and checked before the run, and what is
read back from the run's workspace after it (raster images, the asked-for text files).

Uploads are written into the run's own size-limited workspace (warm or cold) by the engine;
images and asked-for files are read before the workspace goes (`Request.on_files`).
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import urllib.parse
from collections.abc import Mapping
from pathlib import Path

from mcp.server.mcpserver.exceptions import ToolError
from mcp_types import (
    BlobResourceContents,
    ContentBlock,
    EmbeddedResource,
    ImageContent,
    TextContent,
)

from codecage import host
from codecage.errors import CodecageError
from codecage.models import FileInfo
from codecage.output import neutralise_line, neutralise_text
from codecage.policy.scrub import Scrubber, merge_counts

MAX_UPLOAD_FILES = 100
MAX_UPLOAD_BYTES = 20 * 1024 * 1024
MAX_IMAGES = 5
MAX_IMAGE_BYTES = 640 * 1024  # as base64, one fits in a reply (reply.MAX_REPLY_BYTES)
MAX_INLINE_FILE_BYTES = 256 * 1024
MAX_RETURN_FILES = 20
MAX_BINARY_FILE_BYTES = 640 * 1024  # an embedded resource; the reply's budget may drop it
# Files listed as one of these are read as image candidates; only raster content whose
# magic bytes say so (`_raster_type`) goes back as an image. SVG never does: it is XML
# that can carry scripts and text the scrubber never read (return_files gives it as
# scrubbed text).
_IMAGE_TYPES = frozenset({"image/png", "image/jpeg", "image/gif", "image/webp"})
_RASTER_MAGIC = (
    (b"\x89PNG\r\n\x1a\n", "image/png"),
    (b"\xff\xd8\xff", "image/jpeg"),
    (b"GIF87a", "image/gif"),
    (b"GIF89a", "image/gif"),
)


def decode_uploads(files: Mapping[str, str]) -> dict[str, bytes]:
    """The `files` argument as bytes: text as UTF-8, "base64:..." decoded.

    Raises:
        ToolError: too many or too large files, bad base64, or a name outside /workspace.
    """
    if len(files) > MAX_UPLOAD_FILES:
        raise ToolError(f"too many files: {len(files)} (at most {MAX_UPLOAD_FILES})")
    decoded: dict[str, bytes] = {}
    for name, value in files.items():
        _check_upload_name(name)
        if value.startswith("base64:"):
            try:
                decoded[name] = base64.b64decode(value[len("base64:") :], validate=True)
            except (binascii.Error, ValueError) as exc:
                raise ToolError(f"file {name!r}: not valid base64 after 'base64:'") from exc
        else:
            decoded[name] = value.encode("utf-8", "surrogatepass")
    total = sum(len(data) for data in decoded.values())
    if total > MAX_UPLOAD_BYTES:
        raise ToolError(
            f"the files are {total} bytes together; at most {MAX_UPLOAD_BYTES} are accepted"
        )
    return decoded


def _check_upload_name(name: str) -> None:
    parts = name.split("/")
    if (
        not name
        or name.startswith("/")
        or any(p in ("", ".", "..") for p in parts)
        or "\x00" in name
        or len(name) > 255
    ):
        raise ToolError(
            f"bad file name {neutralise_text(name)!r}: use a relative path inside /workspace, "
            "such as data.csv or input/data.csv"
        )


def files_back(
    workdir: Path, written: list[FileInfo], return_files: list[str], scrubber: Scrubber | None
) -> tuple[list[ContentBlock], dict[str, int]]:
    """Raster images the code wrote, and the text files asked for, scrubbed like the rest of
    the result (images cannot be: a picture of a card number leaves as it is).

    Files are read by their names as on disk (`FileInfo.raw_path`): a name with an escape
    sequence, a line break or an undecodable byte is listed neutralised, and a path asked
    for as the listing shows it is read under its real name. When two files show as the
    same name (their names differ only in characters shown as escapes, e.g. ESC and a
    literal backslash-x1b), asking for it is refused with a message, never guessed."""
    blocks: list[ContentBlock] = []
    counts: list[dict[str, int]] = []
    images = [f for f in written if f.mime in _IMAGE_TYPES and f.size <= MAX_IMAGE_BYTES]
    for info in images[:MAX_IMAGES]:
        with contextlib.suppress(CodecageError):
            data = host.read_file(workdir, info.raw_path(), max_bytes=MAX_IMAGE_BYTES)
            mime = _raster_type(data)
            if mime is not None:
                encoded = base64.b64encode(data).decode("ascii")
                blocks.append(ImageContent(type="image", data=encoded, mime_type=mime))
    on_disk: dict[str, list[str]] = {}
    mimes: dict[str, str] = {}
    for info in written:
        on_disk.setdefault(info.path, []).append(info.raw_path())
        mimes[info.raw_path()] = info.mime
    for asked in return_files:
        shown = neutralise_line(asked)
        names = on_disk.get(asked, [asked])
        if len(names) > 1:
            blocks.append(
                TextContent(
                    type="text",
                    text=f"{shown}: {len(names)} files are listed under this name (their "
                    "names differ only in characters shown as escapes); rename them in the "
                    "code to read them",
                )
            )
            continue
        try:
            data = host.read_file(workdir, names[0], max_bytes=MAX_BINARY_FILE_BYTES)
        except CodecageError as exc:
            blocks.append(TextContent(type="text", text=f"{shown}: {exc}"))
            continue
        if not _is_text(data):
            blocks.append(_embedded(names[0], data, mimes.get(names[0])))
            continue
        if len(data) > MAX_INLINE_FILE_BYTES:
            blocks.append(
                TextContent(
                    type="text",
                    text=f"{shown}: a text file of {len(data)} bytes, over the "
                    f"{MAX_INLINE_FILE_BYTES}-byte limit of text returned inline; print "
                    "the part you need, or return a smaller file",
                )
            )
            continue
        text = data.decode("utf-8", "replace")
        if scrubber is not None:
            scrubbed = scrubber.scrub(text)  # whole: a larger file is refused, not cut
            text = scrubbed.text
            counts.append(scrubbed.counts)
        blocks.append(TextContent(type="text", text=f"--- {shown} ---\n{neutralise_text(text)}"))
    return blocks, merge_counts(*counts)


def _is_text(data: bytes) -> bool:
    """UTF-8 without NUL: returned inline and scrubbed; anything else is binary."""
    if b"\x00" in data:
        return False
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def _embedded(name: str, data: bytes, mime: str | None) -> EmbeddedResource:
    """A binary file as an embedded resource: base64, its MIME type, and a file:// URI
    of its place in the sandbox (the name percent-encoded, so no control character or
    space reaches the client raw). Binary content cannot be scrubbed (like images)."""
    uri = "file:///workspace/" + urllib.parse.quote(
        name.encode("utf-8", "surrogateescape"), safe="/"
    )
    return EmbeddedResource(
        type="resource",
        resource=BlobResourceContents(
            uri=uri,
            mime_type=mime or "application/octet-stream",
            blob=base64.b64encode(data).decode("ascii"),
        ),
    )


def _raster_type(data: bytes) -> str | None:
    """The MIME type of a PNG, JPEG, GIF or WebP image by its first bytes; None otherwise
    (whatever the file's name says)."""
    for magic, mime in _RASTER_MAGIC:
        if data.startswith(magic):
            return mime
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "image/webp"
    return None
