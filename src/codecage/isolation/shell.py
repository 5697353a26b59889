"""The shell and the command-line tools agents call, inside the sandbox, read-only.

Model-written code calls `subprocess.run("ls -la", shell=True)`, `os.system(...)` and
`subprocess.run(["wc", "-l", path])` all the time; without a shell each is a wasted turn.
These are the host's own binaries (Debian's dash, coreutils, grep, sed, mawk, findutils,
tar, gzip, diffutils), bound file by file and read-only at /usr/bin/NAME, with the shared
libraries they link against (found with `ldd`, like the interpreter's), and /bin as a
symlink to usr/bin. Nothing else of the host's /usr is shared.

They add no capability the code does not already have: the code can run any native code
it writes to /workspace or /tmp (`docs/security-model.md`), and every one of these
programs runs under the same namespaces, seccomp filter, limits and read-only root. A
tool the host does not have is left out, and `missing` says which.
"""

from __future__ import annotations

import functools
import shutil
from dataclasses import dataclass
from pathlib import Path

from codecage.isolation.rootfs import Mount, resolve_shared_libraries

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

    binaries: tuple[tuple[str, Path], ...]  # (command name, real host file), sorted by name
    libraries: tuple[Path, ...]
    missing: tuple[str, ...]  # commands of TOOLS this host does not have

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.binaries)


@functools.cache
def find() -> ShellTools:
    """The tools of `TOOLS` this host has, with their shared libraries (cached per process).

    Raises:
        HostError: `ldd` is missing or fails (from `resolve_shared_libraries`).
    """
    binaries: list[tuple[str, Path]] = []
    missing: list[str] = []
    for name in TOOLS:
        found = shutil.which(name, path=_HOST_PATH)
        if found is None:
            missing.append(name)
        else:
            binaries.append((name, Path(found).resolve()))
    real_files = sorted({path for _, path in binaries})
    libraries = resolve_shared_libraries(real_files) if real_files else ()
    return ShellTools(tuple(binaries), libraries, tuple(missing))


def mounts(tools: ShellTools, *, already_bound: frozenset[str]) -> tuple[Mount, ...]:
    """Read-only binds of each tool at /usr/bin/NAME and of the libraries not yet bound,
    then /bin -> usr/bin (pure)."""
    plan = [
        Mount("ro-bind", str(lib), str(lib))
        for lib in tools.libraries
        if str(lib) not in already_bound
    ]
    plan += [Mount("ro-bind", f"{GUEST_BIN}/{name}", str(path)) for name, path in tools.binaries]
    if tools.binaries:
        plan.append(Mount("symlink", "/bin", "usr/bin"))
    return tuple(plan)
