"""The sandbox's filesystem: a minimal read-only root built from what the interpreter needs.

Nothing of the host's `/` is shared wholesale. The root is an empty tmpfs (made by bwrap,
remounted read-only at the end) into which we bind, read-only and file by file:

- the interpreter binary at /opt/python/bin/python3 and its stdlib at /opt/python/lib/python3.X
  (relocated, so a pyenv interpreter under /root does not bring /root along);
- the shared libraries it and its stdlib extension modules link against, found with `ldd`;
- the guest bootstrap package at /opt/codecage/codecage (stdlib only);
- /usr/share/zoneinfo (for `zoneinfo`), and a synthetic /etc (passwd, group, hosts).

Then a private /proc and minimal /dev, a size-limited tmpfs /tmp, and /workspace read-write.
The shell and the common command-line tools are bound beside it (`isolation/shell.py`).
There is no /home, no /root, no host /tmp, no /etc/shadow, no /var.
"""

from __future__ import annotations

import compileall
import contextlib
import functools
import hashlib
import json
import logging
import os
import py_compile
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Literal

from codecage.errors import HostError
from codecage.guest import contract

log = logging.getLogger(__name__)

# The guest's paths are the contract's (codecage.guest.contract); these are their names here.
GUEST_PREFIX = contract.GUEST_PREFIX
GUEST_PYTHON = f"{GUEST_PREFIX}/bin/python3"
GUEST_PACKAGE_ROOT = contract.GUEST_PACKAGE_ROOT
GUEST_BOOTSTRAP = contract.GUEST_BOOTSTRAP
GUEST_BOOTSTRAP_PYC = contract.GUEST_BOOTSTRAP_PYC  # what the guest runs
WORKSPACE = contract.WORKSPACE_DIR
SANDBOX_UID = 1000
SANDBOX_GID = 1000

# Extension modules whose libraries pull in a desktop stack (X11, Tk, terminals): useless
# headless, and leaving their libraries out keeps the root small. They fail to import.
_HEADLESS_SKIP = ("_tkinter", "readline", "_curses", "_curses_panel")

MountKind = Literal["ro-bind", "bind", "tmpfs", "proc", "dev", "symlink", "dir", "remount-ro"]

# /proc files that tell about the host or other users (Docker masks the same): hidden behind
# an empty file or directory. Only those that exist on this kernel are masked. In the
# contract: a fork server's init masks them in each run's own /proc (guest/template.py).
PROC_MASKED = contract.PROC_MASKED


@dataclass(frozen=True, slots=True)
class Mount:
    """One entry of the sandbox's mount table, in the order bwrap applies them."""

    kind: MountKind
    dest: str
    source: str | None = None
    size_bytes: int | None = None


@dataclass(frozen=True, slots=True)
class Interpreter:
    """The host interpreter that runs inside the sandbox, and what it needs."""

    executable: Path  # real binary, symlinks resolved
    stdlib: Path  # .../lib/python3.X
    version: str  # "3.11"
    libpython: Path | None  # when the interpreter links libpython dynamically
    libraries: tuple[Path, ...]  # shared libraries to bind at their own paths


def find_interpreter() -> Interpreter:
    """The interpreter of this venv's base installation, with its shared libraries.

    Raises:
        HostError: the interpreter or its stdlib cannot be found.
    """
    return _find_interpreter(Path(getattr(sys, "_base_executable", sys.executable)))


@functools.cache
def _find_interpreter(base_executable: Path) -> Interpreter:
    executable = base_executable.resolve()
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    stdlib = Path(sys.base_prefix) / "lib" / f"python{version}"
    if not (stdlib / "os.py").is_file():
        raise HostError(
            f"cannot find the standard library of {executable} (looked in {stdlib})",
            hint="codecage needs a CPython installed with its stdlib on disk",
        )
    dynload = stdlib / "lib-dynload"
    extensions = sorted(p for p in dynload.glob("*.so") if not p.name.startswith(_HEADLESS_SKIP))
    libs = resolve_shared_libraries([executable, *extensions])
    libpython = next((lib for lib in libs if lib.name.startswith("libpython")), None)
    others = tuple(lib for lib in libs if lib != libpython)
    return Interpreter(executable, stdlib, version, libpython, others)


def resolve_shared_libraries(binaries: list[Path]) -> tuple[Path, ...]:
    """Every shared library `binaries` link against (transitively), as `ldd` resolves them.

    The answer is cached on disk, keyed by the binaries' paths and mtimes: `ldd` over the
    whole stdlib costs about half a second, which a CLI run should not pay every time.

    Raises:
        HostError: `ldd` is missing or fails.
    """
    key_material = json.dumps([[str(b), b.stat().st_mtime_ns] for b in binaries])
    key = hashlib.sha256(key_material.encode()).hexdigest()[:24]
    cache_file = cache_dir() / f"libs-{key}.json"
    try:
        cached = json.loads(cache_file.read_text(encoding="utf-8"))
        return tuple(Path(p) for p in cached)
    except (OSError, ValueError):
        pass
    libs = _run_ldd(binaries)
    try:
        cache_file.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        tmp = cache_file.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps([str(p) for p in libs]), encoding="utf-8")
        tmp.replace(cache_file)
    except OSError as exc:  # a cache we cannot write only costs time
        log.debug("rootfs.cache_unwritable", extra={"path": str(cache_file), "error": str(exc)})
    return libs


def _run_ldd(binaries: list[Path]) -> tuple[Path, ...]:
    try:
        proc = subprocess.run(
            ["ldd", *map(str, binaries)],
            capture_output=True,
            text=True,
            encoding="utf-8",
            errors="replace",
            check=False,
            env={"PATH": os.defpath, "LC_ALL": "C"},
            cwd="/",
            timeout=60,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise HostError(
            f"cannot list the interpreter's shared libraries: {exc}",
            hint="install the Debian package libc-bin (it provides ldd)",
        ) from exc
    found: set[Path] = set()
    for line in proc.stdout.splitlines():
        parts = line.split()
        if "=>" in parts:
            target = parts[parts.index("=>") + 1]
            if target.startswith("/"):
                found.add(Path(target))
        elif parts and parts[0].startswith("/") and "(0x" in line:
            found.add(Path(parts[0]))  # the dynamic loader itself
    return tuple(sorted(found))


def cache_dir() -> Path:
    """Where codecage keeps host facts it can recompute (library lists, self-test)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "codecage"


@functools.cache
def bootstrap_bytecode() -> Path:
    """The guest bootstrap compiled once into the cache (the interpreter in the sandbox is
    this one, so the bytecode fits): a script given as source is compiled at every start,
    ~6 ms of each cold run. Named by the source's hash, so an edit makes a new one.

    Raises:
        HostError: the cache directory cannot be written.
    """
    precompile_guest_package()
    source = guest_package_dir() / "bootstrap.py"
    text = source.read_bytes()
    digest = hashlib.sha256(text + sys.version.encode()).hexdigest()[:16]
    target = cache_dir() / f"bootstrap-{digest}.pyc"
    if not target.is_file():
        try:
            target.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            tmp = target.with_suffix(f".{os.getpid()}.tmp")
            py_compile.compile(
                str(source),
                cfile=str(tmp),
                dfile=GUEST_BOOTSTRAP,  # tracebacks and co_filename name the path in the sandbox
                doraise=True,
                invalidation_mode=py_compile.PycInvalidationMode.UNCHECKED_HASH,
            )
            tmp.replace(target)
        except (OSError, py_compile.PyCompileError) as exc:
            raise HostError(
                f"cannot compile the guest bootstrap into {target.parent}: {exc}",
                hint="make the cache directory writable (XDG_CACHE_HOME)",
            ) from exc
    return target


@functools.cache
def precompile_guest_package() -> None:
    """Write the guest package's bytecode beside its sources (subpackages included), as
    the host's own import would, where it is missing or stale: the package is read-only in
    the sandbox, so without it every start there compiles the contract again, and every
    `import codecage.runtime` (or the import policy's `codecage.imports`) its modules
    (~8 ms instead of ~1 ms). Best effort: an installed package whose directory this user
    cannot write was compiled when it was installed."""
    with contextlib.suppress(OSError):
        compileall.compile_dir(str(guest_package_dir()), quiet=2)


def guest_package_dir() -> Path:
    """The host directory of the guest bootstrap package (stdlib-only code)."""
    return Path(__file__).resolve().parent.parent / "guest"


def write_etc(etc_dir: Path, uid: int = SANDBOX_UID, gid: int = SANDBOX_GID) -> None:
    """Write the sandbox's synthetic /etc: one user (`uid`, `gid`: the ids the code runs
    as inside), one group, localhost."""
    etc_dir.mkdir(mode=0o755)
    files = {
        "passwd": f"sandbox:x:{uid}:{gid}:codecage sandbox:{WORKSPACE}:/nonexistent\n",
        "group": f"sandbox:x:{gid}:\n",
        "hosts": "127.0.0.1 localhost\n::1 localhost\n",
        "hostname": "sandbox\n",
    }
    for name, content in files.items():
        (etc_dir / name).write_text(content, encoding="utf-8")
        (etc_dir / name).chmod(0o644)


@dataclass(frozen=True, slots=True)
class RootFacts:
    """What the host has for a sandbox's root besides the interpreter, found by `facts`
    (it reads the host, and compiles the guest's bytecode into the cache the first time)
    so that `plan` reads nothing."""

    bootstrap_pyc: Path  # the guest bootstrap's bytecode (`bootstrap_bytecode`)
    guest_package: Path  # `guest_package_dir()`
    zoneinfo: bool  # the host has /usr/share/zoneinfo
    site_packages: bool  # the interpreter's stdlib has a site-packages, hidden by a bind
    masked: tuple[tuple[str, bool], ...]  # the PROC_MASKED this kernel has: (path, is a dir)


def facts(interpreter: Interpreter) -> RootFacts:
    """What `plan` needs of the host for `interpreter`'s root.

    Raises:
        HostError: the cache directory cannot be written.
    """
    return RootFacts(
        bootstrap_pyc=bootstrap_bytecode(),
        guest_package=guest_package_dir(),
        zoneinfo=Path("/usr/share/zoneinfo").is_dir(),
        site_packages=(interpreter.stdlib / "site-packages").is_dir(),
        masked=present_masks(),
    )


def present_masks() -> tuple[tuple[str, bool], ...]:
    """The `PROC_MASKED` paths this kernel has, each with whether it is a directory."""
    found: list[tuple[str, bool]] = []
    for path in PROC_MASKED:
        host = Path(path)
        if host.is_dir():
            found.append((path, True))
        elif host.exists():
            found.append((path, False))
    return tuple(found)


def plan(
    interpreter: Interpreter,
    root: RootFacts,
    *,
    workspace: Path,
    etc_dir: Path,
    empty_dir: Path,
    tmp_bytes: int,
) -> tuple[Mount, ...]:
    """The ordered mount table of one sandbox's root. Pure: what it needs of the host is
    in `interpreter` and `root` (`facts`); it creates nothing."""
    mounts: list[Mount] = []
    seen: set[str] = set()
    for lib in interpreter.libraries:
        if str(lib) not in seen:
            seen.add(str(lib))
            mounts.append(Mount("ro-bind", str(lib), str(lib)))
    mounts += [
        Mount("ro-bind", GUEST_PYTHON, str(interpreter.executable)),
        Mount(
            "ro-bind", f"{GUEST_PREFIX}/lib/python{interpreter.version}", str(interpreter.stdlib)
        ),
    ]
    if root.site_packages:
        # The base interpreter's own site-packages is not ours to expose: hide it. (Debian's
        # python3 has none there, and bwrap cannot make one in the read-only stdlib bind.)
        mounts.append(
            Mount(
                "ro-bind",
                f"{GUEST_PREFIX}/lib/python{interpreter.version}/site-packages",
                str(empty_dir),
            )
        )
    if interpreter.libpython is not None:
        mounts.append(
            Mount(
                "ro-bind",
                f"{GUEST_PREFIX}/lib/{interpreter.libpython.name}",
                str(interpreter.libpython),
            )
        )
    mounts.append(Mount("ro-bind", contract.GUEST_PACKAGE_DIR, str(root.guest_package)))
    mounts.append(Mount("ro-bind", GUEST_BOOTSTRAP_PYC, str(root.bootstrap_pyc)))
    if root.zoneinfo:
        mounts.append(Mount("ro-bind", "/usr/share/zoneinfo", "/usr/share/zoneinfo"))
    mounts += [
        Mount("ro-bind", "/etc/passwd", str(etc_dir / "passwd")),
        Mount("ro-bind", "/etc/group", str(etc_dir / "group")),
        Mount("ro-bind", "/etc/hosts", str(etc_dir / "hosts")),
        Mount("ro-bind", "/etc/hostname", str(etc_dir / "hostname")),
        Mount("proc", "/proc"),
        # Read-only /proc: the sandbox user maps to the uid that runs codecage (root, when
        # it runs as root), and root-owned sysctls in /proc/sys are writable by uid 0 without
        # any capability; bwrap's own read-only cover of /proc/sys is not reliable here.
        Mount("remount-ro", "/proc"),
        *_proc_masks(empty_dir, root.masked),
        Mount("dev", "/dev"),
        Mount("tmpfs", "/tmp", size_bytes=tmp_bytes),  # noqa: S108 - private, size-limited
        Mount("bind", WORKSPACE, str(workspace)),
    ]
    return tuple(mounts)


def bwrap_args(mounts: tuple[Mount, ...], *, open_dirs: bool = False) -> list[str]:
    """Translate a mount table into bwrap arguments (the root is remounted read-only last).
    `open_dirs`: the directories bwrap makes on the root for the mounts (mode 0700, its
    own) are opened to every id (0755): a template's runs each have an id of their own."""
    args: list[str] = []
    for m in mounts:
        match m.kind:
            case "ro-bind" | "bind":
                args += [f"--{m.kind}", _source_of(m), m.dest]
            case "tmpfs":
                if m.size_bytes is not None:
                    args += ["--size", str(m.size_bytes)]
                args += ["--perms", "1777", "--tmpfs", m.dest]
            case "proc" | "dev" | "dir" | "remount-ro":
                args += [f"--{m.kind}", m.dest]
            case "symlink":
                args += ["--symlink", _source_of(m), m.dest]
    if open_dirs:
        for directory in _made_parents(mounts):
            args += ["--chmod", "0755", directory]
    args += ["--remount-ro", "/"]
    return args


def proc_masks(empty_dir: Path) -> list[Mount]:
    """The binds that hide `PROC_MASKED` behind `empty_dir` and the empty file beside it
    (`write_empty_file`): every sandbox's, sandboxed upstream servers' too."""
    return _proc_masks(empty_dir, present_masks())


def _made_parents(mounts: tuple[Mount, ...]) -> list[str]:
    """The directories of the root's own tmpfs above the mounts: never a mount point nor
    inside one (a chmod there would change the host's directory or a tmpfs's mode)."""
    dests = [m.dest.rstrip("/") for m in mounts if m.dest not in ("", "/")]
    parents: set[str] = set()
    for dest in dests:
        parent = PurePosixPath(dest).parent
        while str(parent) != "/":
            parents.add(str(parent))
            parent = parent.parent
    return sorted(p for p in parents if not any(p == d or p.startswith(d + "/") for d in dests))


def _proc_masks(empty_dir: Path, masked: tuple[tuple[str, bool], ...]) -> list[Mount]:
    empty_file = empty_dir.parent / "empty-file"
    return [
        Mount("ro-bind", path, str(empty_dir if is_dir else empty_file)) for path, is_dir in masked
    ]


def write_empty_file(run_dir: Path) -> None:
    """The empty regular file that masks /proc files (a device node would not open: nodev)."""
    path = run_dir / "empty-file"
    path.touch(mode=0o444)


def _source_of(mount: Mount) -> str:
    if mount.source is None:
        raise ValueError(f"{mount.kind} mount of {mount.dest} has no source")
    return mount.source


def library_path(interpreter: Interpreter) -> str | None:
    """LD_LIBRARY_PATH the relocated interpreter needs to find libpython, if any."""
    return f"{GUEST_PREFIX}/lib" if interpreter.libpython is not None else None


# --- third-party packages (the data_science profile) -------------------------------------


@dataclass(frozen=True, slots=True)
class PackageSet:
    """Installed distributions a run may import, as host paths to bind read-only."""

    entries: tuple[Path, ...]  # top-level files and dirs in site-packages (modules, *.libs)
    libraries: tuple[Path, ...]  # shared libraries their extension modules need


def packages_for(top_level_names: frozenset[str]) -> PackageSet:
    """The distributions providing `top_level_names` and everything they require.

    Names that are not installed are skipped (`profiles.importable` reports them).

    Raises:
        HostError: `ldd` fails on the packages' extension modules.
    """
    return _packages_for(tuple(sorted(top_level_names)))


@functools.cache
def _packages_for(names: tuple[str, ...]) -> PackageSet:
    entries, extension_modules = _package_files(names)
    libraries = resolve_shared_libraries(extension_modules) if extension_modules else ()
    inside = tuple(sorted(e for e in entries if e.exists()))
    system_libs = tuple(lib for lib in libraries if not any(_under(lib, e) for e in inside))
    return PackageSet(entries=inside, libraries=system_libs)


def _package_files(names: tuple[str, ...]) -> tuple[set[Path], list[Path]]:
    """The site-packages entries of `names`' distributions and the extension modules in
    them, cached on disk like the library lists: finding them reads every distribution's
    RECORD and walks the packages' trees (~0.6 s for the default profile's data packages),
    which each `codecage run` would otherwise pay. The key holds the mtimes of the path's
    directories, which an install or removal changes; a cached entry outside them is not
    believed."""
    roots = _site_directories()
    key_material = json.dumps([names, [[str(r), r.stat().st_mtime_ns] for r in roots]])
    key = hashlib.sha256(key_material.encode()).hexdigest()[:24]
    cache_file = cache_dir() / f"packages-{key}.json"
    try:
        cached = json.loads(cache_file.read_text(encoding="utf-8"))
        entries = {Path(p) for p in cached["entries"]}
        extension_modules = [Path(p) for p in cached["extension_modules"]]
        if all(any(_under(p, r) for r in roots) for p in [*entries, *extension_modules]):
            return entries, extension_modules
    except (OSError, ValueError, KeyError, TypeError):
        pass
    entries, extension_modules = _find_package_files(names)
    try:
        cache_file.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        tmp = cache_file.with_suffix(f".{os.getpid()}.tmp")
        data = {
            "entries": sorted(map(str, entries)),
            "extension_modules": list(map(str, extension_modules)),
        }
        tmp.write_text(json.dumps(data), encoding="utf-8")
        tmp.replace(cache_file)
    except OSError as exc:  # a cache we cannot write only costs time
        log.debug("rootfs.cache_unwritable", extra={"path": str(cache_file), "error": str(exc)})
    return entries, extension_modules


def _site_directories() -> list[Path]:
    """Where distributions are installed (not the whole sys.path: the current directory's
    mtime changes with every file written there)."""
    import site
    import sysconfig

    paths = sysconfig.get_paths()
    found = {paths["purelib"], paths["platlib"], *site.getsitepackages()}
    found.add(site.getusersitepackages())
    return [Path(p) for p in sorted(found) if Path(p).is_dir()]


def _find_package_files(names: tuple[str, ...]) -> tuple[set[Path], list[Path]]:
    from importlib import metadata

    providers = metadata.packages_distributions()
    wanted = {dist for name in names for dist in providers.get(name, [])}
    closure = _requirement_closure(wanted)
    entries: set[Path] = set()
    for dist_name in sorted(closure):
        dist = metadata.distribution(dist_name)
        base = Path(str(dist.locate_file("")))
        for file in dist.files or []:
            top = file.parts[0]
            if top.endswith((".dist-info", ".data")) or top in ("..", "__pycache__"):
                continue
            if top.endswith(".pth"):
                continue  # -S: .pth files never run in the sandbox
            entries.add(base / top)
    extension_modules = sorted(
        so for entry in entries if entry.is_dir() for so in entry.rglob("*.so*") if so.is_file()
    )
    return entries, extension_modules


def _requirement_closure(roots: set[str]) -> set[str]:
    from importlib import metadata

    from packaging.requirements import Requirement

    seen: set[str] = set()
    todo = list(roots)
    while todo:
        name = todo.pop()
        key = name.lower().replace("_", "-")
        if key in seen:
            continue
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        seen.add(key)
        for spec in dist.requires or []:
            req = Requirement(spec)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return seen


def _under(path: Path, root: Path) -> bool:
    return path == root or root in path.parents


def package_mounts(packages: PackageSet) -> tuple[Mount, ...]:
    """Read-only binds of the packages at /opt/site-packages, and of their system libraries."""
    mounts = [
        Mount("ro-bind", f"{contract.GUEST_SITE_PACKAGES}/{entry.name}", str(entry))
        for entry in packages.entries
    ]
    mounts += [Mount("ro-bind", str(lib), str(lib)) for lib in packages.libraries]
    return tuple(mounts)


_FONT_LIST_SCRIPT = """
import json, os, tempfile
with tempfile.TemporaryDirectory() as home:
    os.environ["MPLCONFIGDIR"] = home
    import matplotlib
    from matplotlib import font_manager
    name = f"fontlist-v{font_manager.FontManager.__version__}.json"
    with open(os.path.join(matplotlib.get_cachedir(), name), encoding="utf-8") as f:
        data = json.load(f)
for key in ("ttflist", "afmlist"):
    data[key] = [e for e in data.get(key, []) if not os.path.isabs(e.get("fname", "/"))]
print(json.dumps({"name": name, "data": data}))
"""


@functools.cache
def matplotlib_font_list() -> Path | None:
    """matplotlib's font list (`fontlist-v*.json`) as a sandbox would build it, made once
    per matplotlib version in the cache: a sandbox that imports pyplot otherwise scans
    the fonts into its private /tmp every time (~0.1 s of a cold run measured here). Only
    the fonts matplotlib ships are kept (their paths are relative to its data directory,
    the same in the sandbox); the host's system fonts are not in the sandbox. None when
    matplotlib is not installed or the list cannot be made (the sandbox then builds its
    own, as before)."""
    from importlib import metadata

    try:
        version = metadata.version("matplotlib")
    except metadata.PackageNotFoundError:
        return None
    folder = cache_dir() / "matplotlib-fonts" / version
    found = sorted(folder.glob("fontlist-v*.json")) if folder.is_dir() else []
    if found:
        return found[0]
    try:
        made = subprocess.run(
            [sys.executable, "-I", "-c", _FONT_LIST_SCRIPT],
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        )
        answer = json.loads(made.stdout)
        name = str(answer["name"])
        if "/" in name or not name.startswith("fontlist-v"):
            return None
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        target = folder / name
        tmp = target.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(answer["data"]), encoding="utf-8")
        tmp.replace(target)
    except (OSError, subprocess.SubprocessError, ValueError, KeyError, TypeError) as exc:
        log.warning("rootfs.font_list_failed", extra={"error": str(exc)[:300]})
        return None
    return target


def font_list_mounts(packages: PackageSet) -> tuple[Mount, ...]:
    """The font list, read-only in the guest package, when matplotlib is bound."""
    if not any(entry.name == "matplotlib" for entry in packages.entries):
        return ()
    font_list = matplotlib_font_list()
    if font_list is None:
        return ()
    return (Mount("ro-bind", f"{contract.MATPLOTLIB_FONTS_DIR}/{font_list.name}", str(font_list)),)
