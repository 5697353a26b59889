"""The Landlock backend: the labelled fallback where user namespaces are unavailable.

No namespace at all: the guest runs on the host's filesystem view, in the host's pid,
network, ipc and uts namespaces. What contains it (`isolation/landlock.py`'s launcher):

- Landlock: read and execute only the interpreter, its libraries, the guest package, the
  tools and packages the mount table binds, /proc (read) and a few devices; read-write
  only the workspace and a private tmp directory; TCP bind/connect refused (ABI 4+);
  signals and abstract unix sockets scoped to the sandbox (ABI 6+); pathname unix sockets
  made outside it unreachable (ABI 9+);
- the same seccomp filter as bubblewrap's (sockets other than AF_UNIX refused, no ptrace,
  no mount, no namespaces, no setuid bits), and below ABI 9 no connect and no addressed
  send at all (the host's pathname unix sockets are on the same filesystem);
- a new session and process group, death with its parent, every capability dropped,
  no_new_privs, the sandbox identity when codecage runs as root and one is set, the
  guest's rlimits and the run's cgroup (when there is one), the sandbox's env only.

The guest's fixed paths (/opt/python, /workspace, /servers, ...) cannot exist on the host,
so the mount table becomes a per-run tree of symlinks (`plan_tree`): in the run directory,
`root/<dest>` -> `<source>` for each bind, with real directories where binds nest (a bind
inside another, e.g. the hidden site-packages of the stdlib, is a directory of one link
per entry). The guest learns the tree's root from one environment variable,
`contract.GUEST_ROOT_ENV`, which only this backend sets (the host never reads it), and
the argv and environment the engine wrote for /opt/python are rewritten to the tree.

It is never picked silently: only by name (`--backend landlock`) or by `auto` when the
caller allowed degraded isolation, and every result says what is missing
(`LOST_LAYERS`, as `degraded_isolation` events).
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from codecage.backends.base import (
    Backend,
    ExitStatus,
    HostOverhead,
    LauncherFds,
    LaunchSpec,
    OnCreated,
    SandboxProcess,
    spawn,
)
from codecage.errors import ConfigError, HostError, SandboxError
from codecage.guest import contract
from codecage.isolation import landlock, rootfs
from codecage.isolation.rootfs import Mount
from codecage.models import LayerStatus

log = logging.getLogger(__name__)

LOST_LAYERS: tuple[str, ...] = (
    "user namespace: the guest runs as a host uid (the sandbox identity, or the caller's)",
    "pid namespace: the host's process list is visible in /proc (signals and ptrace to "
    "them are refused by Landlock scoping and seccomp)",
    "mount namespace: the host's file tree is visible to stat and readlink (Landlock "
    "refuses opening anything outside the run's paths); /workspace is not at that path",
    "network namespace: the host's network is shared (seccomp refuses every socket but "
    "AF_UNIX, Landlock refuses TCP bind and connect)",
    "ipc and uts namespaces: host SysV IPC and hostname are shared",
    "size-limited /tmp: the private tmp directory is bounded by RLIMIT_FSIZE per file only",
)
"""What this backend does not provide that bwrap does: each a `degraded_isolation` event."""

SELFTEST_GAPS: frozenset[str] = frozenset({"namespaces", "filesystem"})
"""The self-test's layers this backend fails by design (they probe namespaces and a
private root); explained by `LOST_LAYERS`, so they do not refuse a run chosen by name."""

_TREE = "root"  # in the run directory: the guest's paths as symlinks
_TMP = "tmp"  # in the run directory: the guest's private /tmp
_LAUNCHER = Path(landlock.__file__)
_SHELL = "/bin/sh"  # what subprocess and os.system run, whatever PATH says
_DEVICES_RW = ("/dev/null", "/dev/zero", "/dev/full", "/dev/tty")  # tty: ENXIO, no ctty
_DEVICES_RO = ("/dev/urandom", "/dev/random")


class LandlockBackend:
    """Landlock, seccomp, rlimits, a session of its own; see the module docstring."""

    name = "landlock"
    lost_layers = LOST_LAYERS
    selftest_gaps = SELFTEST_GAPS
    # The guest runs as a host uid in the host's user namespace, where RLIMIT_NPROC counts
    # every process of that uid on the host (other runs' too): where a run has a pids
    # cgroup, that alone bounds its processes (engine.run._guest_limits).
    shares_host_user_namespace = True
    # Landlock's rules only ever add access: nothing inside a writable directory can be
    # kept read-only, nor a name kept from being made (isolation.lending), so no directory
    # is lent here (engine.run.start refuses).
    lends_directories = False
    # No init of the backend's: the launcher execs the guest, so the run's pids cgroup holds
    # the guest's processes alone.
    host_overhead = HostOverhead(pids=0)
    # Each sandbox is a fresh launcher with a guest's two channels; it becomes the
    # sandbox's id before anything runs; the guest runs on the host's kernel as that id.
    forks_templates = False
    serves_stdio = False
    runs_bubblewrap = False
    root_launcher = False
    guest_is_sentry_root = False
    # filters_unix_addressing: set per host in __init__ (Landlock's ABI).

    def __init__(self) -> None:
        self.abi = landlock.abi()
        if self.abi < 1:
            raise HostError(
                "Landlock is not available on this kernel",
                hint="the Landlock backend needs Linux 5.13 or later with landlock in the "
                "lsm= boot parameter (CONFIG_SECURITY_LANDLOCK); or enable user namespaces "
                "for the bwrap backend (`codecage doctor` says how)",
            )
        self.python = str(Path(getattr(sys, "_base_executable", sys.executable)).resolve())
        # Below ABI 9 Landlock cannot refuse a host's pathname unix socket (the guest shares
        # the host's filesystem): the run's seccomp filter refuses connect and addressed
        # sends instead (seccomp.SeccompPlan.unix_addressing; engine.run reads this).
        self.filters_unix_addressing = self.abi < landlock.ABI_RESOLVE_UNIX

    def version(self) -> str | None:
        return f"abi {self.abi}"

    def probe(self) -> list[LayerStatus]:
        rights = ["filesystem"]
        rights += ["TCP bind/connect"] if self.abi >= 4 else []
        rights += ["signal and abstract-socket scoping"] if self.abi >= 6 else []
        rights += [
            "pathname unix sockets: only the run's own"
            if self.abi >= landlock.ABI_RESOLVE_UNIX
            else "pathname unix sockets: not by Landlock below ABI 9; seccomp refuses "
            "connect and addressed sends (the run's own sockets too)"
        ]
        return [
            LayerStatus(
                name="namespaces",
                active=False,
                mechanism="none (the Landlock fallback)",
                detail="; ".join(LOST_LAYERS),
            ),
            LayerStatus(
                name="landlock",
                active=True,
                mechanism=f"Landlock ABI {self.abi}",
                detail=", ".join(rights),
            ),
        ]

    def start(self, spec: LaunchSpec, on_created: OnCreated | None = None) -> SandboxProcess:
        """Write the run's tree, start the launcher (blocked on a pipe), call `on_created`
        with its pid, then let it go: nothing of the guest runs before `on_created`
        returns.

        Raises:
            ConfigError: the run is allowed network (`spec.network`): without a network
                namespace of its own, IP sockets would reach the host's network.
            SandboxError: the tree or the launcher could not be made.
        """
        if spec.network:
            raise ConfigError(
                "network egress needs the sandbox's own network namespace, which the landlock "
                "backend does not have (IP sockets there would reach the host's network)",
                hint="use the bwrap or gvisor backend for runs with allowed hosts",
            )
        if spec.stdio:
            raise SandboxError(
                "the landlock backend starts a guest with its two channels only",
                hint="start a stdio server's sandbox with the bwrap backend",
            )
        try:
            tree = plan_tree(spec.mounts, spec.cwd / _TREE, spec.cwd / _TMP)
            write_tree(tree, identity=spec.identity)
        except OSError as exc:
            raise SandboxError(f"cannot write the sandbox's tree: {exc}") from exc
        ruleset = landlock.Ruleset.plan(self.abi, tree.rules, network=spec.network)
        root = str(tree.root)
        with _Fds.opened(spec.seccomp) as fds:
            config = {
                "block_fd": fds.block_read,
                "ready_fd": fds.ready_write,
                "seccomp_fd": fds.seccomp,
                "parent_pid": os.getpid(),
                "identity": None
                if spec.identity is None
                else [spec.identity.uid, spec.identity.gid],
                "cwd": str(tree.workspace),
                "ruleset": ruleset.to_json(),
                "argv": [tree.translate(a) for a in spec.guest_argv],
                "env": {
                    **{k: tree.translate_list(v) for k, v in spec.env.items()},
                    contract.GUEST_ROOT_ENV: root,
                },
            }
            os.write(fds.config, json.dumps(config).encode())
            os.lseek(fds.config, 0, os.SEEK_SET)
            argv = [self.python, "-I", "-S", "-B", str(_LAUNCHER), "--config-fd", str(fds.config)]
            # Its own session (the launcher makes it so: setsid), never a process group
            # of the host's; nothing inherited but these fds.
            process = spawn(
                argv,
                pass_fds=(
                    fds.config,
                    fds.seccomp,
                    fds.block_read,
                    fds.ready_write,
                    *spec.channel_fds(),
                ),
                env={},
                cwd=spec.cwd,
                exit_status=exit_status,
                new_session=True,
            )
            try:
                fds.close_sandbox_ends()
                # The launcher says it has become the sandbox's identity (or it dies: EOF,
                # and its stderr says why); only then is it checked and put in its cgroup.
                if os.read(fds.ready_read, 1) and on_created is not None:
                    on_created(process.pid)
                with contextlib.suppress(OSError):  # the launcher died; its stderr says why
                    os.write(fds.block_write, b"1")
            except BaseException:
                process.close()
                raise
        return process


def exit_status(returncode: int) -> ExitStatus:
    """The launcher execs the guest: its exit is the guest's (negative: a signal)."""
    if returncode < 0:
        return ExitStatus(code=None, signal=-returncode)
    return ExitStatus(code=returncode)


# --- the tree -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Tree:
    """The run's guest paths as a tree of links, and the Landlock rules that go with it."""

    root: Path
    tmp: Path
    workspace: Path  # the real (host) path of the workspace
    dirs: tuple[Path, ...]  # real directories to create, parents first
    links: tuple[tuple[Path, str], ...]  # (link in the tree, its target)
    copies: tuple[tuple[Path, Path], ...]  # (file in the tree, host file): hard link or copy
    rules: tuple[landlock.Rule, ...]
    top: frozenset[str]  # the tree's top-level names ("opt", "workspace", ...)

    def translate(self, value: str) -> str:
        """A guest path as it is on the host (inside the tree); anything else unchanged."""
        if value.startswith("/") and value.split("/")[1] in self.top:
            return f"{self.root}{value}"
        return value

    def translate_list(self, value: str) -> str:
        """A ':'-separated list of paths (PATH, LD_LIBRARY_PATH), each translated."""
        return ":".join(self.translate(part) for part in value.split(":"))


def plan_tree(mounts: tuple[Mount, ...], root: Path, tmp: Path) -> Tree:
    """The tree of `mounts` under `root`, and the rules that let the guest read (and, for
    read-write binds and /tmp, write) what the links point to. Reads the sources'
    directory listings where binds nest; creates nothing.

    A later mount at the same path replaces an earlier one (as in bwrap); /proc and /dev
    are the host's, opened up by rules (/proc to read; null, zero, full, urandom, random).
    """
    table: dict[str, Mount] = {}
    for m in mounts:
        if m.dest.startswith(("/proc/", "/dev/")):
            continue  # the host's, opened up by the rules below (no masks: no mounts)
        if m.kind in ("ro-bind", "bind", "tmpfs", "symlink", "dir"):
            table[m.dest.rstrip("/") or "/"] = m
    dests = sorted(table)
    dirs: list[Path] = [root, tmp]
    links: list[tuple[Path, str]] = []
    copies: list[tuple[Path, Path]] = []
    rules: list[landlock.Rule] = [landlock.Rule(str(root), landlock.READ_ONLY)]
    workspace = tmp

    def nested(dest: str) -> list[str]:
        return [d for d in dests if d.startswith(dest + "/")]

    def place(dest: str, source: str, writable: bool) -> None:
        """`dest` shows `source`: a link, or (when binds nest below it) a directory of
        links to its entries."""
        access = landlock.READ_WRITE if writable else landlock.READ_ONLY
        inner = nested(dest)
        if not inner or not Path(source).is_dir():
            if dest == rootfs.GUEST_PYTHON:
                # The interpreter finds its stdlib next to its own real path: a link would
                # lead it to the host's prefix. A hard link (or copy) sits in the tree.
                copies.append((root / dest.lstrip("/"), Path(source)))
            else:
                links.append((root / dest.lstrip("/"), source))
            rules.append(landlock.Rule(source, access))
            return
        dirs.append(root / dest.lstrip("/"))
        for entry in sorted(p.name for p in Path(source).iterdir()):
            child = f"{dest}/{entry}"
            if child in table:
                continue  # its own mount places it
            if any(d.startswith(child + "/") for d in inner):
                place(child, f"{source}/{entry}", writable)
            else:
                links.append((root / child.lstrip("/"), f"{source}/{entry}"))
                rules.append(landlock.Rule(f"{source}/{entry}", access))

    for dest in dests:
        m = table[dest]
        if any(dest.startswith(d + "/") and table[d].kind in ("ro-bind", "bind") and
               not Path(str(table[d].source)).is_dir() for d in dests):  # fmt: skip
            continue  # under a file bind: cannot exist
        parent = (root / dest.lstrip("/")).parent
        if parent != root:
            dirs.append(parent)
        match m.kind:
            case "ro-bind" | "bind":
                source = str(m.source)
                place(dest, source, writable=m.kind == "bind")
                if dest == contract.WORKSPACE_DIR:
                    workspace = Path(source)
            case "tmpfs":
                links.append((root / dest.lstrip("/"), str(tmp)))
                rules.append(landlock.Rule(str(tmp), landlock.READ_WRITE))
            case "symlink":
                links.append((root / dest.lstrip("/"), str(m.source)))
            case "dir":
                dirs.append(root / dest.lstrip("/"))
    rules += [landlock.Rule("/proc", landlock.PROC_RO)]
    rules += [landlock.Rule(d, landlock.DEVICE_RW) for d in _DEVICES_RW]
    rules += [landlock.Rule(d, landlock.DEVICE_RO) for d in _DEVICES_RO]
    shell = _host_shell(table)
    if shell is not None:
        rules.append(landlock.Rule(shell, landlock.FS_READ_FILE | landlock.FS_EXECUTE))
    top = frozenset(d.split("/")[1] for d in dests if d != "/")
    return Tree(
        root=root,
        tmp=tmp,
        workspace=workspace,
        dirs=tuple(dict.fromkeys(dirs)),
        links=tuple(links),
        copies=tuple(copies),
        rules=tuple(rules),
        top=top,
    )


def _host_shell(table: dict[str, Mount]) -> str | None:
    """The host's /bin/sh, when the sandbox offers a shell: subprocess(shell=True) and
    os.system run "/bin/sh" by that name, which is the host's here."""
    tools = table.get("/usr/bin")
    if tools is None or tools.source is None or not Path(tools.source, "sh").exists():
        return None
    return str(Path(_SHELL).resolve()) if Path(_SHELL).exists() else None


def write_tree(tree: Tree, *, identity: object = None) -> None:
    """Create `tree` on disk (directories 0755, the private tmp 0700 and owned by the
    sandbox identity when there is one).

    Raises:
        OSError: a part could not be made.
    """
    for d in tree.dirs:
        d.mkdir(mode=0o755, parents=True, exist_ok=True)
    tree.tmp.chmod(0o700)
    uid, gid = getattr(identity, "uid", None), getattr(identity, "gid", None)
    if uid is not None and gid is not None and os.geteuid() == 0:
        os.chown(tree.tmp, uid, gid)
    for link, target in tree.links:
        link.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
        link.symlink_to(target)
    for dest, source in tree.copies:
        dest.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
        try:
            os.link(source, dest)
        except OSError:
            shutil.copy2(source, dest)


# --- fds ------------------------------------------------------------------------------


class _Fds(LauncherFds):
    """The launcher's config and the seccomp filter (memfds), the block pipe (host ->
    launcher) and the ready pipe (launcher -> host: it has become the sandbox's identity)."""

    sandbox_ends = ("config", "seccomp", "block_read", "ready_write")
    config = seccomp = block_read = block_write = ready_read = ready_write = -1

    def open(self, bpf: bytes) -> None:
        self.config = self.memfd("codecage-landlock", b"")
        self.seccomp = self.memfd("codecage-seccomp", bpf)
        self.block_read, self.block_write = self.pipe()
        self.ready_read, self.ready_write = self.pipe()


@functools.cache
def available() -> bool:
    """Whether this kernel has Landlock (for `auto` and `doctor`)."""
    return landlock.abi() >= 1


if TYPE_CHECKING:  # mypy checks that it is a Backend: every trait stated, with its type
    _IS_A_BACKEND: type[Backend] = LandlockBackend
