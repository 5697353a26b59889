"""Listing what a run left in its workspace: each regular file's path, size, SHA-256 and
MIME type, read through directory fds and bounded in files, bytes, depth and entries.
"""

from __future__ import annotations

import functools
import hashlib
import mimetypes
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from codecage.engine.workspace import fds
from codecage.models import FileInfo

_TEXT_SNIFF_BYTES = 64 * 1024
"""Files up to this size are read whole to decide whether they are UTF-8 text."""

_MAGIC_BYTES = 16

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


@dataclass(slots=True)
class _Listing:
    max_files: int
    max_total_bytes: int
    max_hash_bytes: int
    files: list[FileInfo] = field(default_factory=list)
    truncated: bool = False
    hashed_bytes: int = 0
    entries_left: int = fds.MAX_ENTRIES_SCANNED


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
        `max_files`, deeper than `fds.MAX_DEPTH` directories, more than 100,000 entries, an
        unreadable directory) or a file was not hashed because `max_total_bytes` was spent.

    Raises:
        SandboxError: `ws_path` itself is missing, a symlink or not a directory.
    """
    state = _Listing(
        max_files=max_files, max_total_bytes=max_total_bytes, max_hash_bytes=max_hash_bytes
    )
    root_fd = fds.open_root(ws_path, "list")
    try:
        _list_dir(root_fd, "", 0, state)
    finally:
        os.close(root_fd)
    state.files.sort(key=lambda info: info.path)
    return state.files, state.truncated


def _list_dir(dir_fd: int, prefix: str, depth: int, state: _Listing) -> bool:
    """Add the files under `dir_fd` to `state`; return True when the listing must stop."""
    entries, scanned, more = fds.scan(dir_fd, state.entries_left)
    if more:
        state.truncated = True
    state.entries_left -= scanned
    # Walk in name order, so that which files a bound leaves out does not depend on
    # the order the filesystem returns them in.
    entries.sort(key=lambda entry: entry.name)
    for entry in entries:
        # As on disk (surrogate-escaped where not UTF-8): FileInfo shows it neutralised.
        relpath = prefix + entry.name
        if entry.kind == "dir":
            if depth >= fds.MAX_DEPTH:
                state.truncated = True
                continue
            try:
                child = os.open(entry.name, fds.DIR_FLAGS, dir_fd=dir_fd)
            except OSError:
                state.truncated = True
                continue
            try:
                if _list_dir(child, relpath + "/", depth + 1, state):
                    return True
            finally:
                os.close(child)
        elif entry.kind == "file":
            if len(state.files) >= state.max_files:
                state.truncated = True
                return True
            info = _describe_file(dir_fd, entry.name, relpath, state)
            if info is not None:
                state.files.append(info)
    return False


def _describe_file(dir_fd: int, name: str, relpath: str, state: _Listing) -> FileInfo | None:
    try:
        fd = os.open(name, fds.FILE_FLAGS, dir_fd=dir_fd)
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
            head = fds.pread_up_to(fd, size)
            whole = len(head) == size
            if hash_it:
                digest = hashlib.sha256(head).hexdigest()
        else:
            head = fds.pread_up_to(fd, _MAGIC_BYTES)
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


def _sha256_of(fd: int, size: int) -> str:
    """SHA-256 of the first `size` bytes (the size fstat gave: a file that grows while
    being read is hashed as it was when listed)."""
    digest = hashlib.sha256()
    for chunk in fds.read_chunks(fd, size):
        digest.update(chunk)
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
