"""The shell and the command-line tools agents call, inside the sandbox, read-only.

Model-written code calls `subprocess.run("ls -la", shell=True)`, `os.system(...)` and
`subprocess.run(["wc", "-l", path])` all the time; without a shell each is a wasted turn.
These are the host's own binaries (Debian's dash, coreutils, grep, sed, mawk, findutils,
tar, gzip, diffutils), gathered once into one directory of codecage's cache (hard links
where the filesystem allows, else copies; named by the binaries' paths, sizes and mtimes,
so an upgrade of the host's packages makes a new one) that is bound read-only at /usr/bin,
with the shared libraries they link against (found with `ldd`, like the interpreter's), and
/bin as a symlink to usr/bin. Nothing else of the host's /usr is shared. One bind of a
directory instead of one per tool: ~80 file binds cost bwrap ~14 ms per sandbox.

They add no capability the code does not already have: the code can run any native code
it writes to /workspace or /tmp (`docs/security-model.md`), and every one of these
programs runs under the same namespaces, seccomp filter, limits and read-only root. A
tool the host does not have is left out, and `missing` says which.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from codecage.errors import HostError
from codecage.isolation.rootfs import Mount, cache_dir, resolve_shared_libraries

GUEST_BIN = "/usr/bin"

TOOLS: tuple[str, ...] = (
    # the shell (subprocess's shell=True and os.system run /bin/sh)
    "sh",
    # files and directories
    "ls", "cat", "head", "tail", "wc", "cp", "mv", "rm", "mkdir", "rmdir", "touch", "ln",
    "chmod", "stat", "du", "df", "find", "xargs", "basename", "dirname", "realpath",
    "readlink", "mktemp", "pwd", "tee",
    # text
    "grep", "egrep", "fgrep", "sed", "awk", "sort", "uniq", "cut", "tr", "paste", "join",
    "comm", "nl", "fold", "fmt", "split", "csplit", "tac", "rev", "diff", "cmp", "od",
    "expand", "unexpand", "column",
    # archives and checksums
    "tar", "gzip", "gunzip", "zcat", "md5sum", "sha1sum", "sha256sum", "sha512sum",
    "base64", "cksum",
    # the shell's companions
    "env", "echo", "printf", "true", "false", "test", "[", "expr", "seq", "sleep", "date",
    "id", "uname", "whoami", "which", "timeout", "nproc", "yes",
)  # fmt: skip
"""The commands offered, when the host has them (POSIX and GNU names agents use)."""

_HOST_PATH = "/usr/bin:/bin"


@dataclass(frozen=True, slots=True)
class ShellTools:
    """The host binaries that back the sandbox's commands, and what they link against."""

    binaries: tuple[tuple[str, Path], ...]  # (command name, real host file), in TOOLS order
    libraries: tuple[Path, ...]
    missing: tuple[str, ...]  # commands of TOOLS this host does not have
    directory: Path | None = None  # the binaries gathered under their command names

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.binaries)


def find() -> ShellTools:
    """`_find()`, made again if its directory went away (a cache cleaned under a server
    that runs for days): a stat per sandbox start."""
    tools = _find()
    if tools.directory is not None and not tools.directory.is_dir():
        _find.cache_clear()
        tools = _find()
    return tools


@functools.cache
def _find() -> ShellTools:
    """The tools of `TOOLS` this host has, with their shared libraries (cached per process).

    Raises:
        HostError: `ldd` is missing or fails, or the cache directory cannot be written.
    """
    binaries: list[tuple[str, Path]] = []
    missing: list[str] = []
    for name in TOOLS:
        found = shutil.which(name, path=_HOST_PATH)
        if found is None:
            missing.append(name)
        else:
            binaries.append((name, Path(found).resolve()))
    if not binaries:
        return ShellTools((), (), tuple(missing))
    real_files = sorted({path for _, path in binaries})
    libraries = resolve_shared_libraries(real_files)
    return ShellTools(tuple(binaries), libraries, tuple(missing), _gathered(tuple(binaries)))


def mounts(tools: ShellTools, *, already_bound: frozenset[str]) -> tuple[Mount, ...]:
    """A read-only bind of the gathered tools at /usr/bin and of the libraries not yet
    bound, then /bin -> usr/bin (pure)."""
    if tools.directory is None:
        return ()
    plan = [
        Mount("ro-bind", str(lib), str(lib))
        for lib in tools.libraries
        if str(lib) not in already_bound
    ]
    plan += [Mount("ro-bind", GUEST_BIN, str(tools.directory)), Mount("symlink", "/bin", "usr/bin")]
    return tuple(plan)


def _gathered(binaries: tuple[tuple[str, Path], ...]) -> Path:
    """The directory of the cache that holds `binaries` under their command names, made
    once (in a temporary name, then renamed into place, so a reader never sees it half
    made) and named by what went into it. Older ones (from binaries since upgraded) are
    left: a long-running process may still bind them, and they are small."""
    facts = [
        [name, str(path), path.stat().st_size, path.stat().st_mtime_ns] for name, path in binaries
    ]
    key = hashlib.sha256(json.dumps(facts).encode()).hexdigest()[:24]
    target = cache_dir() / f"shell-{key}"
    if target.is_dir():
        return target
    tmp = cache_dir() / f".shell-{key}.{os.getpid()}.tmp"
    try:
        target.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(mode=0o755)
        for name, path in binaries:
            _link_or_copy(path, tmp / name)
        try:
            tmp.rename(target)
        except OSError:  # another process made it first: theirs is the same
            shutil.rmtree(tmp, ignore_errors=True)
            if not target.is_dir():
                raise
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise HostError(
            f"cannot gather the sandbox's command-line tools into {target}: {exc}",
            hint="make the cache directory writable (XDG_CACHE_HOME)",
        ) from exc
    return target


def _link_or_copy(source: Path, dest: Path) -> None:
    # A hard link costs nothing; across filesystems, or for a file another user owns
    # (fs.protected_hardlinks), it is a copy that keeps the mode.
    try:
        os.link(source, dest)
    except OSError:
        shutil.copy2(source, dest)
