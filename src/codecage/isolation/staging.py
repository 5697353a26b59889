"""A readable copy of what the sandbox must read but its host id cannot reach.

When codecage runs as root, the sandbox runs as an unprivileged host id
(`isolation.identity`), and its launcher must reach every path it binds. Most are readable
by anyone (/usr, /lib, the data packages in a venv under /opt or /work); some are not: a
pyenv interpreter under /root (mode 0700), a cache under ~/.cache, a checkout in a home
directory. Those are staged: hard-linked (or, across filesystems or for files not readable
by others, copied) once into a root-owned tree under `STAGE_ROOT`, and each staged file is
checked against its source by SHA-256 before the tree is used. Every sandbox id reads the
same trees (each run has an id of its own: one copy serves them all). `STAGE_ROOT` is mode
0711: anyone may pass through it to a tree whose name they know, nobody but root may list
it, and a tree's name is a hash of its source's path and of its entries' sizes and mtimes,
which only who can read the source (root) knows. The user's home keeps its permissions,
and no other local user gains a way in.

A staged tree is named by its source's path and a signature of its contents (its direct
entries' names, sizes and mtimes), so an upgrade of the source makes a new tree; an
unchanged source is reused by every later process. Trees are made in a temporary
directory and renamed into place, so a crash leaves no half tree in use.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import shutil
import stat
import tempfile
import threading
import time
from pathlib import Path

from codecage.errors import HostError
from codecage.isolation import identity as identities
from codecage.isolation.identity import Identity

log = logging.getLogger(__name__)

# Not the former "stage" (mode 0710, group the one shared sandbox id, which ids of their
# own cannot pass): versions of codecage side by side on a host would fight over its mode.
STAGE_ROOT = Path("/var/lib/codecage/staged")
_COMPLETE = ".codecage-staged"  # written last: its presence says the tree is whole
_LOCK = threading.Lock()


@functools.lru_cache(maxsize=4096)  # bounded: each run has an id of its own
def readable(source: Path, identity: Identity, *, skip: tuple[str, ...] = ()) -> Path:
    """`source` itself when `identity` can read it, else its staged copy (made once).
    `skip` names top-level entries of a directory not to stage (e.g. a stdlib's
    site-packages, which the sandbox never sees); a skipped directory stays, empty.

    Raises:
        HostError: the copy cannot be made (the message says where and why).
    """
    if identities.can_read(source, identity):
        return source
    return _staged(source.resolve(), skip)


@functools.cache
def _staged(source: Path, skip: tuple[str, ...]) -> Path:
    signature = _signature(source, skip)
    name = hashlib.sha256(f"{source}\0{signature}".encode()).hexdigest()[:24]
    target = STAGE_ROOT / name / source.name
    with _LOCK:
        _open_stage_root()
        if not (target.parent / _COMPLETE).is_file():
            _prune_once()
            _make(source, target, skip)
    return target


_ABANDONED_AFTER_S = 3600.0  # a half-made tree this old was left by a crash


@functools.cache
def _prune_once() -> None:
    """Remove, once per process, the staged trees whose source is gone (a test's or a
    removed checkout's cache, a deleted skills directory) and the half-made trees a crash
    left. A tree whose source still exists is kept, even when it is an older copy: another
    process's sandbox may be using it."""
    with contextlib.suppress(OSError):
        for entry in STAGE_ROOT.iterdir():
            if _stale(entry):
                shutil.rmtree(entry, ignore_errors=True)
                log.info("staging.pruned", extra={"tree": entry.name})


def _stale(entry: Path) -> bool:
    try:
        if entry.name.startswith(".staging-"):
            return time.time() - entry.lstat().st_mtime > _ABANDONED_AFTER_S
        source = (entry / _COMPLETE).read_text(encoding="utf-8").strip()
    except OSError:
        return False
    return bool(source) and not os.path.lexists(source)


def _open_stage_root() -> None:
    """`STAGE_ROOT` is root's, mode 0711: every sandbox id passes through it to a tree it
    is given by name; nobody but root lists it (what is staged came from places closed to
    other users, such as /root, and a tree's name cannot be known without reading there).

    Raises:
        HostError: it cannot be made or set so.
    """
    try:
        STAGE_ROOT.mkdir(parents=True, exist_ok=True, mode=0o700)
        st = STAGE_ROOT.lstat()
        if (st.st_uid, st.st_gid) != (0, 0):
            os.chown(STAGE_ROOT, 0, 0, follow_symlinks=False)
        if stat.S_IMODE(st.st_mode) != 0o711:
            STAGE_ROOT.chmod(0o711)
    except OSError as exc:
        raise HostError(
            f"cannot prepare {STAGE_ROOT} for the sandbox: {exc.strerror}",
            hint="codecage needs to write /var/lib/codecage when it runs as root",
        ) from exc


def _signature(source: Path, skip: tuple[str, ...]) -> str:
    """The name, size and mtime of the source and of each of its direct entries, hashed.
    One level, not the whole tree (the stdlib's 7,700 files cost 100 ms to stat, which
    every `codecage run` would pay): an install or upgrade replaces entries at the top
    (a package's __init__.py, the stdlib's modules), and a file edited in place below is
    the same inode as its hard-linked stage."""
    entries = [source]
    if source.is_dir():
        entries += sorted(p for p in source.iterdir() if p.name not in skip)
    digest = hashlib.sha256()
    for path in entries:
        st = path.lstat()
        digest.update(f"{path.name}\0{st.st_size}\0{st.st_mtime_ns}\0{st.st_mode}\n".encode())
    return digest.hexdigest()


def _walk(source: Path, skip: tuple[str, ...]) -> list[tuple[str, os.stat_result]]:
    st = source.lstat()
    if not stat.S_ISDIR(st.st_mode):
        return [("", st)]
    found: list[tuple[str, os.stat_result]] = []
    for root, dirs, files in os.walk(source):
        here = Path(root)
        if here == source:
            dirs[:] = [d for d in dirs if d not in skip]
            files = [f for f in files if f not in skip]
        dirs.sort()
        for name in sorted(files) + [d for d in dirs if (here / d).is_symlink()]:
            path = here / name
            found.append((str(path.relative_to(source)), path.lstat()))
    return found


def _make(source: Path, target: Path, skip: tuple[str, ...]) -> None:
    """Build the staged tree in a temporary directory beside it, verify it, rename it."""
    try:
        work = Path(tempfile.mkdtemp(prefix=".staging-", dir=STAGE_ROOT))
    except OSError as exc:
        raise HostError(
            f"cannot stage {source} for the sandbox into {STAGE_ROOT}: {exc.strerror}",
            hint="codecage needs to write /var/lib/codecage when it runs as root",
        ) from exc
    try:
        work.chmod(0o755)
        copy = work / source.name
        _copy_tree(source, copy, skip)
        _verify(source, copy, skip)
        (work / _COMPLETE).write_text(str(source) + "\n", encoding="utf-8")
        (work / _COMPLETE).chmod(0o644)
        try:
            work.rename(target.parent)
        except OSError:
            # Another process staged the same tree meanwhile: use theirs.
            if not (target.parent / _COMPLETE).is_file():
                raise
    except OSError as exc:
        raise HostError(
            f"cannot stage {source} for the sandbox: {exc}",
            hint=f"check free space and permissions under {STAGE_ROOT}",
        ) from exc
    finally:
        shutil.rmtree(work, ignore_errors=True)
    log.info("staging.made", extra={"source": str(source), "target": str(target)})


def _copy_tree(source: Path, copy: Path, skip: tuple[str, ...]) -> None:
    if not source.is_dir():
        _link_or_copy(source, copy)
        return
    copy.mkdir(mode=0o755)
    for name in skip:  # left out, but kept as an empty directory: a mount point, maybe
        if (source / name).is_dir():
            (copy / name).mkdir(mode=0o755)
    for rel, st in _walk(source, skip):
        src, dst = source / rel, copy / rel
        dst.parent.mkdir(parents=True, exist_ok=True, mode=0o755)
        if stat.S_ISLNK(st.st_mode):
            dst.symlink_to(src.readlink())
        elif stat.S_ISREG(st.st_mode):
            _link_or_copy(src, dst)
    for directory in [copy, *(p for p in copy.rglob("*") if p.is_dir() and not p.is_symlink())]:
        directory.chmod(0o755)


def _link_or_copy(src: Path, dst: Path) -> None:
    """A hard link when the source is readable by everyone and on the same filesystem (it
    costs nothing and cannot differ), else a copy made readable by everyone."""
    st = src.stat()
    if st.st_mode & stat.S_IROTH and stat.S_ISREG(st.st_mode):
        with contextlib.suppress(OSError):
            os.link(src, dst, follow_symlinks=False)
            return
    shutil.copyfile(src, dst, follow_symlinks=True)
    dst.chmod(0o755 if st.st_mode & stat.S_IXUSR else 0o644)


def _verify(source: Path, copy: Path, skip: tuple[str, ...]) -> None:
    """Every staged regular file has its source's SHA-256 (hard links: the same inode)."""
    for rel, st in _walk(source, skip):
        if not stat.S_ISREG(st.st_mode):
            continue
        src, dst = (source / rel, copy / rel) if rel else (source, copy)
        if dst.stat().st_ino == st.st_ino and dst.stat().st_dev == st.st_dev:
            continue
        if _sha256(src) != _sha256(dst):
            raise OSError(f"the staged copy of {src} differs from it")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
