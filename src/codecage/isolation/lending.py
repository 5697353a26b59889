"""A directory lent read-write to a sandbox (``--workspace DIR``): what it may never be, and
what inside it stays read-only.

Everything the code writes in a lent directory stays on the host after the run, where the
operator's own tools read it. Some files there are not data but instructions that those
tools *run* without being asked to: a ``.pth`` file in a virtualenv's site-packages runs at
every start of that Python, ``.git/hooks/*`` and ``core.fsmonitor`` at the next
``git status``, ``.bashrc`` at the next shell, ``.envrc`` at the next ``cd``, ``.vscode/``
when the folder is opened. So (DESIGN principle 6):

- `check`: a directory that is, holds or lies inside one of codecage's own places (its
  interpreter and virtualenv, every directory its Python imports from, the codecage package,
  its state, config and packages directories) is never lent; nor one that is, or lies in,
  a virtualenv or a site-packages directory.
- `scan` + `plan`: inside the lent directory, the entries of `PROTECTED` (at its top, and
  where `scan` finds them below, to `MAX_SCAN_DEPTH`), every virtualenv, site-packages
  directory and ``*.pth`` file it finds, a linked worktree's or submodule's git directory,
  and the paths a git config there names (``core.hooksPath``, ``core.fsmonitor``,
  ``include.path``, ...) are bound read-only over the read-write bind; each directory on
  the way to one is bound onto itself, so it cannot be renamed away and replaced (a mount
  point cannot be renamed or removed). A protected name that does not exist is bound
  over an empty read-only directory (`make_placeholders` makes its mount point, and
  `remove_placeholders` removes it after the run), so the code cannot create it.

`plan` is pure; `scan` reads the directory through fds that never follow a link, within
fixed bounds. A backend that cannot bind one thing over another (Landlock: its rules only
ever add access) lends no directory (`engine.run.start` refuses it).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import re
import site
import stat
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final, Literal

from codecage.errors import ConfigError
from codecage.isolation.rootfs import Mount

log = logging.getLogger(__name__)

_GIT = "git runs what it names (hooks, core.fsmonitor, core.hooksPath, filters, aliases)"
_SHELL = "a shell runs it when it starts"
_VENV = "a virtualenv: its bin/ and the *.pth files of its site-packages run on the host"
_EDITOR = "editors and coding agents run the tasks, hooks and servers it names"
_MISE = "mise runs its hooks and sources its env at the next cd (a path trusted once)"

PROTECTED: Final[dict[str, str]] = {
    # git
    ".git": _GIT,
    ".gitmodules": "git reads submodule URLs and commands from it",
    ".gitconfig": "git's own configuration when this is someone's home",
    ".husky": "a usual core.hooksPath: git runs the hooks in it",
    ".githooks": "a usual core.hooksPath: git runs the hooks in it",
    ".pre-commit-config.yaml": "pre-commit runs the hooks it names at the next commit",
    ".hg": "Mercurial runs the hooks and loads the extensions its hgrc names",
    ".hgrc": "Mercurial's configuration when this is someone's home (hooks, extensions)",
    # Python
    ".venv": _VENV,
    "venv": _VENV,
    ".direnv": "direnv's layouts (a virtualenv among them), loaded at the next cd",
    ".pip": "pip.conf: the index pip installs from",
    ".pypirc": "where and as whom packages are uploaded",
    ".python-version": "pyenv picks the Python it runs from it (CVE-2022-35861: a path there)",
    ".tool-versions": "asdf and mise pick each tool from it ('path:' runs a program here)",
    ".mise.toml": _MISE,
    "mise.toml": _MISE,
    ".mise.local.toml": _MISE,
    "mise.local.toml": _MISE,
    ".mise": _MISE,
    ".rtx.toml": _MISE,
    # shells
    ".bashrc": _SHELL,
    ".bash_profile": _SHELL,
    ".bash_login": _SHELL,
    ".bash_logout": "bash runs it when a login shell exits",
    ".profile": _SHELL,
    ".zshrc": _SHELL,
    ".zprofile": _SHELL,
    ".zshenv": _SHELL,
    ".zlogin": _SHELL,
    ".zlogout": "zsh runs it when a login shell exits",
    ".kshrc": _SHELL,
    ".cshrc": _SHELL,
    ".tcshrc": _SHELL,
    ".login": _SHELL,
    ".inputrc": "readline binds keys to commands from it",
    ".pam_environment": "the environment of every login",
    ".xprofile": "run at a graphical login",
    ".xinitrc": "run by startx",
    ".xsession": "run at a graphical login",
    ".envrc": "direnv runs it at the next cd into the directory",
    ".tmux.conf": "tmux runs its run-shell and if-shell commands when it starts",
    ".screenrc": "screen runs its exec commands when it starts",
    ".curlrc": "curl's options (output, config) when this is someone's home",
    ".wgetrc": "wget's options when this is someone's home",
    ".gnupg": "gpg's configuration (the agent and helper programs it runs)",
    ".docker": "docker's credential helpers and CLI plugins, run by name",
    ".kube": "kubectl runs a kubeconfig's exec credential plugin",
    ".aws": "the AWS tools run a profile's credential_process",
    ".ipython": "IPython runs profile_default/startup/* at every start",
    ".jupyter": "Jupyter runs its *_config.py files at every start",
    ".config": "every tool's configuration when this is someone's home (git, fish, autostart)",
    ".local": "~/.local/bin is on PATH and its site-packages' *.pth files run",
    ".ssh": "authorized_keys and the ssh client's commands (ProxyCommand)",
    # editors and agents
    ".vscode": _EDITOR,
    ".idea": _EDITOR,
    ".devcontainer": "VS Code runs its lifecycle commands on the host",
    ".devcontainer.json": "VS Code runs its lifecycle commands (initializeCommand) on the host",
    ".claude": _EDITOR,
    ".cursor": _EDITOR,
    ".mcp.json": "MCP clients start the servers it names",
    ".zed": _EDITOR,
    ".gemini": _EDITOR,
    ".codex": _EDITOR,
    ".amazonq": _EDITOR,
    ".roo": _EDITOR,
    ".kiro": _EDITOR,
    ".continue": _EDITOR,
    ".windsurf": _EDITOR,
    ".aider.conf.yml": "aider runs its lint-cmd and test-cmd after each edit",
    ".exrc": "vim and nvim run it when 'exrc' is set",
    ".vimrc": "vim runs it when 'exrc' is set",
    ".nvimrc": "nvim runs it when 'exrc' is set",
    ".nvim.lua": "nvim runs it when 'exrc' is set",
    ".vim": "vim loads its plugin/ at every start when this is someone's home",
    ".emacs": "Emacs runs it at every start when this is someone's home",
    ".emacs.d": "Emacs runs its init.el at every start when this is someone's home",
    ".gdbinit": "gdb runs its commands",
    ".lldbinit": "lldb runs its commands",
    # other tools' configuration that names a program to run
    ".ripgreprc": "ripgrep's options (--pre runs a program on every file)",
    ".npmrc": "npm's options (node-options, script-shell run programs)",
    ".yarnrc": "yarn's options (yarn-path runs a program)",
    ".yarnrc.yml": "yarn's options (yarnPath runs a program)",
    ".pnpmfile.cjs": "pnpm runs it at every install",
}
"""Names kept read-only in every lent directory, with why. At the top of the directory they
are always protected (a missing one cannot be created); below it, where `scan` finds them.
A directory name protects its whole tree. Project files that a tool runs only when the
operator asks it to run the project (Makefile, package.json scripts, conftest.py, noxfile,
setup.py) are not here: running them is running what the run wrote (docs/security-model.md)."""

_SITE_DIRS: Final = frozenset({"site-packages", "dist-packages"})
_VENV_MARK: Final = "pyvenv.cfg"

MAX_SCAN_DEPTH: Final = 4
"""Directory levels below the lent directory's top that `scan` looks into."""
MAX_SCAN_DIRS: Final = 2_000
"""Directories `scan` opens in all; past it, what lies deeper is not looked at."""
MAX_SCAN_ENTRIES: Final = 50_000
"""Directory entries `scan` looks at in all."""
MAX_PROTECTED: Final = 512
"""Protected entries at most (each is a mount); past it the directory is refused."""
_MAX_CONFIG_BYTES: Final = 256 * 1024

_DIR_FLAGS: Final = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE_FLAGS: Final = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC

_PACKAGE: Final = Path(__file__).resolve().parents[1]
"""The installed codecage package (this file is its isolation/lending.py)."""

Kind = Literal["dir", "file", "missing"]


# --- what a lent directory may never be ---------------------------------------------------


@dataclass(frozen=True, slots=True)
class Place:
    """One of codecage's own places, which a lent directory must neither be, hold nor lie
    in; `what` says what it is, for the refusal."""

    path: Path
    what: str
    imports: bool = False
    """A directory Python imports from (`sys.path`): being it or holding it counts, lying
    inside it does not (that would refuse everything below the current directory, which
    `python -m` puts there); its site-packages are refused by name all the same."""


def own_places(
    *,
    state: Iterable[Path] = (),
    config: Iterable[Path] = (),
    packages: Iterable[Path] = (),
) -> tuple[Place, ...]:
    """codecage's places: this interpreter (its prefixes, its executable's directory and the
    real one), the codecage package, every directory on `sys.path`, the user site-packages,
    and the caller's `state`, `config` and `packages` directories."""
    interpreter = "codecage's own Python interpreter"
    places = [
        Place(Path(sys.prefix), "codecage's virtualenv (sys.prefix)"),
        Place(Path(sys.base_prefix), f"{interpreter} (sys.base_prefix)"),
        Place(Path(sys.exec_prefix), f"{interpreter} (sys.exec_prefix)"),
        Place(Path(sys.executable).parent, f"the directory of {interpreter}"),
        Place(Path(sys.executable).resolve().parent, f"the directory of {interpreter}"),
        Place(_PACKAGE, "the installed codecage package"),
        Place(Path(site.getusersitepackages()), "this Python's user site-packages"),
    ]
    places += [
        Place(Path(entry or "."), "a directory codecage's Python imports from (sys.path)", True)
        for entry in sys.path
        if not entry.endswith(".zip")
    ]
    places += [Place(p, "codecage's state directory") for p in state]
    places += [Place(p, "a place codecage reads its configuration from") for p in config]
    places += [Place(p, "codecage's packages directory") for p in packages]
    return tuple(places)


def check(directory: str | Path, places: Iterable[Place]) -> Path:
    """`directory` resolved, when it may be lent read-write: it neither is, holds nor lies in
    one of `places` (compared by real path, symlinks resolved, and as given), and it is
    not, nor lies in, a virtualenv (``pyvenv.cfg``) or a site-packages directory.

    Raises:
        ConfigError: the message names the place it collides with and why.
    """
    given = Path(directory)
    root = given.resolve()
    forms = {root, given.absolute()}
    places = tuple(places)
    for place in places:
        for spot in {place.path.absolute(), place.path.resolve()}:
            for form in forms:
                if spot == form:
                    how = "is"
                elif spot.is_relative_to(form):
                    how = "holds"
                elif form.is_relative_to(spot) and not place.imports:
                    how = "lies inside"
                else:
                    continue
                raise ConfigError(
                    f"the workspace {given} {how} {spot}, {place.what}: code run there "
                    "could change what codecage itself runs on this host",
                    hint="pass {workspace} a directory of data of its own, apart from "
                    "codecage's installation, state and configuration (e.g. a new "
                    "directory under /srv or your home), or omit it to get a fresh one",
                )
    _refuse_aliases(given, root, places)
    _refuse_tool_places(given, root)
    for level in (root, *root.parents):
        if level.name in _SITE_DIRS or (level / _VENV_MARK).is_file():
            what = "a site-packages directory" if level.name in _SITE_DIRS else "a virtualenv"
            how = "is" if level == root else "lies inside"
            raise ConfigError(
                f"the workspace {given} {how} {what} ({level}): a Python on this host "
                "would run what the code writes there",
                hint="pass {workspace} a directory of data that holds no Python "
                "installation, or omit it to get a fresh one",
            )
    return root


def _refuse_aliases(given: Path, root: Path, places: tuple[Place, ...]) -> None:
    """Refuse `root` when it is, or lies in, one of `places` reached by another path (a
    bind mount of codecage's state directory elsewhere): compared by device and inode.

    Raises:
        ConfigError: the message names the place.
    """
    known: dict[tuple[int, int], Place] = {}
    for place in places:
        with contextlib.suppress(OSError):
            st = place.path.stat()
            known.setdefault((st.st_dev, st.st_ino), place)
    for level in (root, *root.parents):
        try:
            st = level.stat()
        except OSError:
            continue
        alias = known.get((st.st_dev, st.st_ino))
        if alias is None or (alias.imports and level != root):
            continue
        how = "is" if level == root else f"lies inside {level}, which is"
        raise ConfigError(
            f"the workspace {given} {how} {alias.path} by another path, {alias.what}: code "
            "run there could change what codecage itself runs on this host",
            hint="pass {workspace} a directory of data of its own, apart from codecage's "
            "installation, state and configuration, or omit it to get a fresh one",
        )


_SYSTEM_DIRS: Final = tuple(
    Path(p) for p in ("/etc", "/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32",
                      "/boot", "/var/spool", "/var/lib/systemd")
)  # fmt: skip
"""The host's programs, libraries and the configuration and queues its services run."""


def _refuse_tool_places(given: Path, root: Path) -> None:
    """Refuse `root` (the real path of `given`) when it is or lies in a place the host runs
    from as a whole, where the read-only list inside cannot help since what is run there
    is not found by name: a directory of a name `PROTECTED` keeps (a repository's ``.git``
    with its hooks and config, ``~/.ssh``, ``~/.config``, ``.vscode``, ...), a bare git
    repository (its ``hooks/`` run at a push), a directory on this process's ``PATH``, or
    one of the host's system directories (``/etc``, ``/usr``, ...).

    Raises:
        ConfigError: the message names the place and why.
    """
    path_dirs = {Path(p).resolve() for p in os.environ.get("PATH", "").split(os.pathsep) if p}
    for level in (root, *root.parents):
        how = "is" if level == root else "lies inside"
        what = None
        if level.name in PROTECTED:
            what = f"{level.name} ({PROTECTED[level.name]})"
        elif (level / "HEAD").is_file() and (level / "objects").is_dir():
            what = "a git directory (git runs its hooks/ and what its config names)"
        elif level in path_dirs:
            what = "a directory on PATH (the host runs the programs in it by name)"
        elif level in _SYSTEM_DIRS:
            what = "a system directory (the host's programs, configuration and services)"
        if what is not None:
            where = "" if level == root else f" {level},"
            raise ConfigError(
                f"the workspace {given} {how}{where} {what}: the host would run what "
                "the code writes there",
                hint="pass {workspace} a directory of data of its own (e.g. a new "
                "directory under /srv), or omit it to get a fresh one",
            )


# --- what stays read-only inside it -------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Entry:
    """One protected path of a lent directory, relative to its top ('/'-separated)."""

    path: str
    kind: Kind
    """"dir" or "file" as found (never a symlink), or "missing": an empty read-only
    directory takes its place for the run (`make_placeholders`)."""
    why: str


@dataclass(frozen=True, slots=True)
class Found:
    """What `scan` found to protect in a lent directory."""

    entries: tuple[Entry, ...]
    complete: bool = True
    """False: the scan stopped at a bound (`MAX_SCAN_DIRS`, `MAX_SCAN_ENTRIES`); what it did
    not reach is protected only by its name at the top."""


@dataclass(slots=True)
class _Scan:
    root_fd: int
    real_root: str
    entries: dict[str, Entry] = field(default_factory=dict)
    gitdirs: dict[str, str] = field(default_factory=dict)
    """Git directories found, each with its work tree (relative paths)."""
    dirs: int = 0
    seen: int = 0
    complete: bool = True

    def add(self, path: str, kind: Kind, why: str) -> None:
        if path in self.entries or _under_any(path, self.entries):
            return
        for inner in [p for p in self.entries if p.startswith(path + "/")]:
            del self.entries[inner]  # a protected directory covers what is in it
        self.entries[path] = Entry(path, kind, why)
        if len(self.entries) > MAX_PROTECTED:
            raise ConfigError(
                f"the workspace holds more than {MAX_PROTECTED} entries that codecage keeps "
                "read-only (git repositories, virtualenvs, *.pth files, editor settings)",
                hint="pass {workspace} a directory of data only, or omit it",
            )


def scan(root: Path) -> Found:
    """The entries of `root` (a directory being lent) to keep read-only: every name of
    `PROTECTED` at its top (found or not), and below it, to `MAX_SCAN_DEPTH` levels, those
    names, virtualenvs, site-packages directories and ``*.pth`` files, the git directory a
    ``.git`` file points to, and what the git configs found name. Nothing is followed
    through a link.

    Raises:
        ConfigError: a protected name is a symbolic link or a hard-linked file (neither can
            be kept read-only), `root` is a virtualenv, or there are too many entries.
    """
    try:
        root_fd = os.open(root, _DIR_FLAGS)
    except OSError as exc:
        raise ConfigError(
            f"the workspace {root} cannot be opened: {exc.strerror}",
            hint="pass {workspace} a directory (not a link) this user can read",
        ) from exc
    state = _Scan(root_fd, str(root.resolve()))
    try:
        _walk(state, root)
        for name, why in PROTECTED.items():
            if name not in state.entries:
                state.add(name, "missing", why)
        for gitdir, worktree in list(state.gitdirs.items()):
            _named_by_git_config(state, gitdir, worktree)
        _named_from_outside(state, root)
    finally:
        os.close(root_fd)
    if not state.complete:
        log.warning("workspace_scan_incomplete", extra={"workspace": str(root)})
    entries = tuple(sorted(state.entries.values(), key=lambda e: e.path))
    return Found(entries=entries, complete=state.complete)


def _walk(state: _Scan, root: Path) -> None:
    """Breadth first, one open directory at a time, each opened from the top through
    ``O_NOFOLLOW`` components."""
    queue: list[tuple[str, int]] = [("", 0)]
    while queue:
        rel, depth = queue.pop(0)
        if state.dirs >= MAX_SCAN_DIRS:
            state.complete = False
            return
        state.dirs += 1
        listed = _listing(state.root_fd, rel)
        if listed is None:
            continue
        names = {name for name, _ in listed}
        if _VENV_MARK in names:
            if not rel:
                raise ConfigError(
                    f"the workspace {root} is a virtualenv ({_VENV_MARK}): a Python on this "
                    "host would run what the code writes there",
                    hint="pass {workspace} a directory of data that holds no Python "
                    "installation, or omit it to get a fresh one",
                )
            state.add(rel, "dir", _VENV)
            continue
        if rel and _is_git_dir(listed):
            # a bare repository (store.git, the usual home of linked worktrees): git runs
            # its hooks/ and reads its config at a push, and at every commit of a worktree
            state.add(rel, "dir", _GIT)
            state.gitdirs[rel] = rel
            continue
        for name, kind in listed:
            state.seen += 1
            if state.seen > MAX_SCAN_ENTRIES:
                state.complete = False
                return
            path = f"{rel}/{name}" if rel else name
            if name in PROTECTED or (_is_pth(name) and kind != "dir"):
                if kind in ("link", "linked"):
                    _refuse_link(root, path, kind)
                why = PROTECTED.get(name, "a .pth file runs at every start of a Python")
                state.add(path, "dir" if kind == "dir" else "file", why)
                if name == ".git":
                    if kind == "dir":
                        state.gitdirs[path] = rel
                    else:
                        _gitdir_of(state, path)
            elif kind == "dir" and name in _SITE_DIRS:
                state.add(path, "dir", "its *.pth files run at every start of that Python")
            elif kind == "dir" and depth + 1 < MAX_SCAN_DEPTH:
                queue.append((path, depth + 1))


def _is_git_dir(listed: list[tuple[str, str]]) -> bool:
    kinds = dict(listed)
    return kinds.get("HEAD") == "file" and kinds.get("objects") == kinds.get("refs") == "dir"


def _is_pth(name: str) -> bool:
    return name.endswith(".pth")


def _refuse_link(root: Path, path: str, kind: str) -> None:
    what = "a symbolic link" if kind == "link" else "a file with other hard links"
    raise ConfigError(
        f"{root / path} in the workspace is {what}: codecage keeps that name read-only "
        "during a run and cannot do so through a link (the code could write what it "
        "points to, or put something else in its place)",
        hint=f"replace {path} by a plain copy of what it points to, or pass {{workspace}} "
        "a directory without it",
    )


def _listing(root_fd: int, rel: str) -> list[tuple[str, str]] | None:
    """(name, kind) of each entry of `rel`: "dir", "file", "linked" (a regular file with more
    than one hard link), "link" or "other"; None when it cannot be opened as a directory."""
    fd = _open_dir(root_fd, rel)
    if fd is None:
        return None
    out: list[tuple[str, str]] = []
    try:
        with os.scandir(fd) as entries:
            for entry in entries:
                if entry.is_symlink():
                    out.append((entry.name, "link"))
                elif entry.is_dir(follow_symlinks=False):
                    out.append((entry.name, "dir"))
                elif entry.is_file(follow_symlinks=False):
                    try:
                        links = entry.stat(follow_symlinks=False).st_nlink
                    except OSError:
                        continue
                    out.append((entry.name, "linked" if links > 1 else "file"))
                else:
                    out.append((entry.name, "other"))
    finally:
        os.close(fd)
    return out


def _open_dir(root_fd: int, rel: str) -> int | None:
    """`rel` below `root_fd`, each component opened ``O_NOFOLLOW``; None if not a directory."""
    fd = os.dup(root_fd)
    try:
        for part in [p for p in rel.split("/") if p]:
            nxt = os.open(part, _DIR_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = nxt
    except OSError:
        os.close(fd)
        return None
    return fd


def _kind_at(root_fd: int, rel: str) -> Kind | Literal["link", "linked", "other"]:
    """What `rel` is below `root_fd`, no component followed through a link."""
    parent, _, name = rel.rpartition("/")
    fd = _open_dir(root_fd, parent)
    if fd is None:
        return "missing"
    try:
        st = os.stat(name, dir_fd=fd, follow_symlinks=False)
    except OSError:
        return "missing"
    finally:
        os.close(fd)
    if stat.S_ISLNK(st.st_mode):
        return "link"
    if stat.S_ISDIR(st.st_mode):
        return "dir"
    if stat.S_ISREG(st.st_mode):
        return "linked" if st.st_nlink > 1 else "file"
    return "other"


def _read_small(root_fd: int, rel: str) -> str:
    parent, _, name = rel.rpartition("/")
    fd = _open_dir(root_fd, parent)
    if fd is None:
        return ""
    try:
        file_fd = os.open(name, _FILE_FLAGS, dir_fd=fd)
    except OSError:
        return ""
    finally:
        os.close(fd)
    try:
        if not stat.S_ISREG(os.fstat(file_fd).st_mode):
            return ""
        return os.read(file_fd, _MAX_CONFIG_BYTES).decode("utf-8", errors="replace")
    finally:
        os.close(file_fd)


def _inside(state: _Scan, base: str, target: str) -> str | None:
    """`target` (as a git file names it: absolute, or relative to `base`) relative to the
    lent directory's top, when it lies inside it; None otherwise."""
    if target.startswith(state.real_root + "/"):
        target, base = target.removeprefix(state.real_root + "/"), ""
    if not target or target.startswith(("/", "~")) or ":" in target.split("/")[0]:
        return None  # elsewhere, or a URL (https://..., host:path)
    parts: list[str] = [p for p in base.split("/") if p]
    for part in target.split("/"):
        if part in ("", "."):
            continue
        if part == "..":
            if not parts:
                return None
            parts.pop()
        else:
            parts.append(part)
    return "/".join(parts) or None


def _protect_named(state: _Scan, rel: str | None, why: str) -> None:
    """Protect `rel`, a path a git file names: as found, or its first missing component."""
    if rel is None:
        return
    parts = rel.split("/")
    for i in range(1, len(parts) + 1):
        prefix = "/".join(parts[:i])
        kind = _kind_at(state.root_fd, prefix)
        if kind == "missing":
            state.add(prefix, "missing", why)
            return
        if kind in ("link", "linked"):
            raise ConfigError(
                f"the workspace's {prefix} is a link, on the way to {rel}, which a git "
                "configuration there names: codecage cannot keep it read-only",
                hint="replace the link by what it points to, or pass {workspace} a "
                "directory without it",
            )
        if kind != "dir" or i == len(parts):
            state.add(prefix, "dir" if kind == "dir" else "file", why)
            return


def _gitdir_of(state: _Scan, dot_git: str) -> None:
    """A ``.git`` file ("gitdir: PATH", a linked worktree or a submodule): the git
    directory it points to is protected when it lies in the lent directory."""
    text = _read_small(state.root_fd, dot_git)
    match = re.match(r"gitdir:\s*(.+?)\s*$", text, re.MULTILINE)
    if match is not None:
        base = dot_git.rpartition("/")[0]
        target = _inside(state, base, match.group(1))
        _protect_named(state, target, _GIT)
        if target is not None and _kind_at(state.root_fd, target) == "dir":
            state.gitdirs[target] = base
            # a linked worktree's git directory holds only its HEAD and index: the hooks
            # and config git runs are in the common directory its `commondir` names
            common = _read_small(state.root_fd, f"{target}/commondir").strip()
            if common:
                shared = _inside(state, target, common)
                _protect_named(state, shared, _GIT)
                if shared is not None and _kind_at(state.root_fd, shared) == "dir":
                    state.gitdirs[shared] = base


_CONFIG_SECTION = re.compile(r"^\s*\[\s*([A-Za-z][\w.-]*)")
_CONFIG_VALUE = re.compile(r"^\s*([A-Za-z][\w.-]*)\s*=\s*(.*?)\s*$")
_COMMAND_KEYS: Final = frozenset(
    {"hookspath", "fsmonitor", "path", "sshcommand", "pager", "editor", "askpass",
     "textconv", "command", "clean", "smudge", "process", "helper", "cmd", "program",
     "external", "driver", "gitproxy", "templatedir", "alternaterefscommand", "difffilter",
     "uploadpack", "receivepack", "packobjectshook", "sendmailcmd", "smtpserver",
     "attributesfile"}
)  # fmt: skip
"""git config keys whose value is a path git reads or a program git runs."""
_COMMAND_SECTIONS: Final = frozenset({"pager"})
"""Sections each of whose keys is a program (``pager.log = ...``)."""
_SHELL_WORDS = re.compile(r"[\s;&|()<>`]+")
"""What separates the words of a command git gives to the shell."""


def _config_commands(text: str) -> Iterator[tuple[str, list[str]]]:
    """(key, words) of each value of a git config that names a program or a path: its key
    is a command key, its section one of `_COMMAND_SECTIONS`, or it is a ``!`` alias; the
    words as the shell would split them, quotes removed."""
    section = ""
    for line in text.splitlines():
        head = _CONFIG_SECTION.match(line)
        if head is not None:
            section = head.group(1).lower()
            continue
        pair = _CONFIG_VALUE.match(line)
        if pair is None:
            continue
        key, value = pair.group(1), pair.group(2).strip().strip("\"'")
        if key.lower() in _COMMAND_KEYS or section in _COMMAND_SECTIONS or value.startswith("!"):
            words = [w.strip("\"'") for w in _SHELL_WORDS.split(value.lstrip("!"))]
            yield key, [w for w in words if w]


def _named_by_git_config(state: _Scan, gitdir: str, worktree: str) -> None:
    """Every path inside the lent directory that the config of `gitdir` names as a hooks
    path, an fsmonitor, an included file, a filter's, diff or merge driver's or helper's
    program, a pager, or in a shell alias ("!..."): the first word, and every later word
    that is a path (``sh scripts/clean.sh``: git hands the line to a shell, which runs
    what its arguments name), relative to the work tree and to the git directory (git
    reads some relative to one, some to the other). A config it includes from inside the
    lent directory (``include.path = ../.gitconfig``, a project's shared settings) is read
    the same way, to `_MAX_INCLUDES` files."""
    pending, read = [f"{gitdir}/config"], set[str]()
    while pending and len(read) < _MAX_INCLUDES:
        config = pending.pop(0)
        read.add(config)
        here = config.rpartition("/")[0]
        for key, word, exists_only in _config_paths(_read_small(state.root_fd, config)):
            why = f"the git config {config} names it ({key})"
            for base in dict.fromkeys((worktree, gitdir, here)):
                target = _inside(state, base, word)
                kind = "missing" if target is None else _kind_at(state.root_fd, target)
                if exists_only and kind == "missing":
                    continue
                _protect_named(state, target, why)
                included = key.lower() == "path" and kind == "file"
                if included and target is not None and target not in read:
                    pending.append(target)


_MAX_INCLUDES: Final = 16
"""Git config files read per repository, its own and those it includes."""


def _outer_configs(root: Path) -> Iterator[tuple[Path, tuple[Path, ...]]]:
    """(config file, bases of its relative paths) of the git configs outside `root` that
    git reads in it: the repository `root` lies in (its work tree and git directory), the
    user's (``~/.gitconfig``, ``$XDG_CONFIG_HOME/git/config``) and the system's."""
    for level in root.parents:
        dot_git = level / ".git"
        if dot_git.is_dir():
            yield dot_git / "config", (level, dot_git)
            break
        if dot_git.is_file():
            match = re.match(r"gitdir:\s*(.+?)\s*$", _read_path(dot_git), re.MULTILINE)
            if match is not None:
                gitdir = (level / match.group(1)).resolve()
                yield gitdir / "config", (level, gitdir)
                commondir = _read_path(gitdir / "commondir").strip()
                if commondir:
                    common = (gitdir / commondir).resolve()
                    yield common / "config", (level, common)
            break
    xdg = Path(os.environ.get("XDG_CONFIG_HOME") or Path("~/.config").expanduser())
    for config in (Path("~/.gitconfig").expanduser(), xdg / "git" / "config"):
        yield config, ()
    yield Path("/etc/gitconfig"), ()


def _read_path(path: Path) -> str:
    try:
        with open(path, "rb") as f:
            return f.read(_MAX_CONFIG_BYTES).decode("utf-8", errors="replace")
    except OSError:
        return ""


def _named_from_outside(state: _Scan, root: Path) -> None:
    """What a git config outside the lent directory names inside it: a repository the
    directory lies in whose ``core.hooksPath`` (or filter, alias, ...) is a path in it,
    or a user's or the system's config naming one by its absolute path. The directory
    itself being such a path is refused.

    Raises:
        ConfigError: a config names the lent directory itself as a program or hooks path.
    """
    real = Path(state.real_root)
    for config, bases in _outer_configs(real):
        for key, word, exists_only in _config_paths(_read_path(config)):
            path = Path(word).expanduser() if word.startswith("~/") else Path(word)
            for base in bases if not path.is_absolute() else (Path("/"),):
                named = Path(os.path.normpath(base / path))
                if named == real:
                    raise ConfigError(
                        f"the workspace {root} is what the git config {config} names as "
                        f"{key}: git would run what the code writes there",
                        hint="pass {workspace} a directory git does not run from, or omit it",
                    )
                if not named.is_relative_to(real):
                    continue
                target = named.relative_to(real).as_posix()
                if exists_only and _kind_at(state.root_fd, target) == "missing":
                    continue
                _protect_named(state, target, f"the git config {config} names it ({key})")


def _config_paths(text: str) -> Iterator[tuple[str, str, bool]]:
    """(key, word, exists_only) of each word of a git config's commands that may be a file:
    the first word when it has a '/' (else a program found on PATH) or is a hooks path;
    each later word with a '/'; each later word without one, only where it exists (an
    argument such as ``%f`` names nothing, ``clean.py`` may be a file)."""
    for key, words in _config_commands(text):
        for i, word in enumerate(words):
            if "/" in word or (i == 0 and key.lower() == "hookspath"):
                yield key, word, False
            elif i > 0:
                yield key, word, True


def _under_any(path: str, entries: dict[str, Entry]) -> bool:
    parts = path.split("/")
    return any("/".join(parts[:i]) in entries for i in range(1, len(parts)))


def plan(found: Found, *, source: str, dest: str, empty_dir: str) -> tuple[Mount, ...]:
    """The mounts that keep `found` read-only in the lent directory bound at `dest` from
    `source` (after that read-write bind): each directory on the way to an entry bound onto
    itself (a mount point cannot be renamed, so the way cannot be swapped), each entry
    bound read-only onto itself, and `empty_dir` (an empty read-only directory) over each
    missing one, whose mount point `make_placeholders` made. Shallow first.
    """
    way: set[str] = set()
    for protected in found.entries:
        parts = protected.path.split("/")
        way.update("/".join(parts[:i]) for i in range(1, len(parts)))
    pins: list[tuple[str, Entry | None]] = [(p, None) for p in way]
    ordered = sorted(
        pins + [(e.path, e) for e in found.entries],
        key=lambda item: (item[0].count("/"), item[0]),
    )
    mounts: list[Mount] = []
    for path, entry in ordered:
        if entry is None:
            mounts.append(Mount("bind", f"{dest}/{path}", f"{source}/{path}"))
        elif entry.kind == "missing":
            mounts.append(Mount("ro-bind", f"{dest}/{path}", empty_dir))
        else:
            mounts.append(Mount("ro-bind", f"{dest}/{path}", f"{source}/{path}"))
    return tuple(mounts)


def hold(fd: int, path: Path) -> None:
    """Hold `path` (its open directory `fd`) as lent to this run until `fd` is closed: one
    run at a time, since a run's placeholders, removed when it ends, would take another's
    read-only covers with them.

    Raises:
        ConfigError: another run holds it now.
    """
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError as exc:
        raise ConfigError(
            f"the workspace {path} is lent to another run right now: one run at a time "
            "may write a lent directory",
            hint="wait for that run to end, or give each run a {workspace} of its own",
        ) from exc


# --- placeholders for what is missing --------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Placeholder:
    """An empty directory made where a protected name was missing: its path relative to
    the lent directory and its identity, so that only it is ever removed."""

    path: str
    dev: int
    ino: int


def make_placeholders(root: Path, found: Found) -> tuple[Placeholder, ...]:
    """Make an empty directory (mode 0555) at each missing entry of `found`, as the mount
    point of its read-only cover; each through ``O_NOFOLLOW`` directory fds.

    Raises:
        ConfigError: one cannot be made (the message names it); those made are removed.
    """
    made: list[Placeholder] = []
    root_fd = os.open(root, _DIR_FLAGS)
    try:
        for entry in found.entries:
            if entry.kind != "missing":
                continue
            parent, _, name = entry.path.rpartition("/")
            fd = _open_dir(root_fd, parent)
            try:
                if fd is None:
                    raise OSError(errno.ENOENT, "its directory is gone")
                os.mkdir(name, 0o555, dir_fd=fd)
                st = os.stat(name, dir_fd=fd, follow_symlinks=False)
                made.append(Placeholder(entry.path, st.st_dev, st.st_ino))
            except OSError as exc:
                remove_placeholders(root, tuple(made))
                raise ConfigError(
                    f"cannot keep {entry.path} read-only in the workspace {root}: {exc.strerror}",
                    hint="pass {workspace} a directory this user can write, or omit it",
                ) from exc
            finally:
                if fd is not None:
                    os.close(fd)
    finally:
        os.close(root_fd)
    return tuple(made)


def remove_placeholders(root: Path, made: tuple[Placeholder, ...]) -> None:
    """Remove the placeholders `make_placeholders` made, each only if it is still the
    directory made (same device and inode) and empty. Call it once the sandbox is gone.

    Raises:
        Nothing: what cannot be removed is logged (``workspace_placeholder_kept``).
    """
    if not made:
        return
    try:
        root_fd = os.open(root, _DIR_FLAGS)
    except OSError:
        log.warning("workspace_placeholder_kept", extra={"workspace": str(root)})
        return
    try:
        for holder in made:
            for _ in _removing(root_fd, holder):
                log.warning("workspace_placeholder_kept", extra={"path": holder.path})
    finally:
        os.close(root_fd)


def _removing(root_fd: int, holder: Placeholder) -> Iterator[None]:
    """Yields once if `holder` was not removed."""
    parent, _, name = holder.path.rpartition("/")
    fd = _open_dir(root_fd, parent)
    if fd is None:
        yield
        return
    try:
        st = os.stat(name, dir_fd=fd, follow_symlinks=False)
        if (st.st_dev, st.st_ino) != (holder.dev, holder.ino):
            yield
            return
        with contextlib.suppress(FileNotFoundError):
            os.rmdir(name, dir_fd=fd)
    except OSError:
        yield
    finally:
        os.close(fd)
