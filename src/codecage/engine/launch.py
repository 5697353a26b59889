"""Preparing one sandbox's launch: what it binds, its run directory and workspace, the
channels shared with the guest, its environment and the guest's command line; and sweeping
what runs of dead host processes left behind.

Everything made here is registered on the caller's ExitStack, so any exit path undoes it.
Nothing here knows which backend starts the sandbox (`backends.base.LaunchSpec` is the
description it is given).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
import shutil
import socket
import tempfile
from dataclasses import dataclass
from pathlib import Path

from codecage import packages
from codecage.engine import owner
from codecage.engine import workspace as workspaces
from codecage.engine.workspace import fds as workspace_fds
from codecage.errors import ConfigError
from codecage.guest import contract
from codecage.isolation import cgroups, datadir, lending, rootfs, seccomp, shell, staging
from codecage.isolation.identity import Identity
from codecage.policy import profiles
from codecage.policy.profiles import ImportPolicy

log = logging.getLogger(__name__)

RUN_DIR_PREFIX = "codecage-run-"
SERVERS_DIR_PREFIX = "codecage-servers-"
"""Both followed by the host process's owner key (`engine.owner`, "<pid>-<token>-"): what a
process that was killed left in the private parent (a run's directory, the tool tree
`codecage gen` wrote for a process's upstream servers) is swept by the next one
(`sweep_stale_runs`), once it holds that owner's lock."""


def binds(
    policy: ImportPolicy | None,
    packages_dir: Path | None,
    servers_dir: Path | None,
    skills_dir: Path | None,
    interpreter: rootfs.Interpreter,
) -> tuple[rootfs.Mount, ...]:
    """What a sandbox binds besides its root: tools, packages, the tool trees. The first
    time, with an empty cache, this reads every package's RECORD and runs ldd (seconds).

    Raises:
        ConfigError: a servers or skills directory does not exist.
        HostError: the host facts cannot be found.
    """
    return (
        _shell_mounts(interpreter)
        + _package_mounts(policy, interpreter)
        + _added_package_mounts(policy, packages_dir, interpreter)
        + _tool_tree_mounts(servers_dir, skills_dir)
    )


def root_mounts(
    interpreter: rootfs.Interpreter,
    workspace: Path,
    run_dir: Path,
    tmp_mb: int,
    identity: Identity,
    protected: lending.Found | None = None,
) -> tuple[rootfs.Mount, ...]:
    """The sandbox's root: the interpreter, a private /etc and the empty dirs it needs
    (written into `run_dir` now), /workspace (with the `protected` entries of a lent one
    read-only over it) and a /tmp of `tmp_mb`; every bound source one the sandbox's host
    `identity` can read (`reachable`)."""
    rootfs.write_etc(run_dir / "etc")
    (run_dir / "empty").mkdir(mode=0o555)
    rootfs.write_empty_file(run_dir)
    if _stages_for(identity):
        interpreter = _reachable_interpreter(interpreter, identity)
    mounts = rootfs.plan(
        interpreter,
        workspace=workspace,
        etc_dir=run_dir / "etc",
        empty_dir=run_dir / "empty",
        tmp_bytes=tmp_mb * cgroups.MiB,
    )
    if protected is None:
        return mounts
    return mounts + lending.plan(
        protected, source=str(workspace), dest=rootfs.WORKSPACE, empty_dir=str(run_dir / "empty")
    )


def reachable(
    mounts: tuple[rootfs.Mount, ...], identity: Identity, run_dir: Path
) -> tuple[rootfs.Mount, ...]:
    """`mounts` with every bind source the sandbox's host `identity` cannot read replaced
    by its staged copy (`isolation.staging`; only when codecage is root and
    the sandbox another id). The run's own directory is made for it and left as is."""
    if not _stages_for(identity):
        return mounts
    own = f"{run_dir}/"
    found: list[rootfs.Mount] = []
    for m in mounts:
        # The data directory is never copied (isolation.datadir): its readers are the operator's.
        if m.dest == datadir.DATA_DIR:
            pass
        elif m.kind in ("ro-bind", "bind") and m.source and not m.source.startswith(own):
            source = _reachable_source(m.source, identity)
            if source != m.source:
                m = dataclasses.replace(m, source=source)
        found.append(m)
    return tuple(found)


@functools.cache
def _reachable_source(source: str, identity: Identity) -> str:
    """Every run binds the same few hundred host paths: decided once per process."""
    return str(staging.readable(Path(source), identity))


def _stages_for(identity: Identity) -> bool:
    return os.geteuid() == 0 and identity.uid != 0


def _reachable_interpreter(
    interpreter: rootfs.Interpreter, identity: Identity
) -> rootfs.Interpreter:
    """The interpreter's own files, staged where its host id cannot read them (a pyenv
    under /root); its stdlib without site-packages, which the sandbox never sees."""
    libpython = interpreter.libpython
    return dataclasses.replace(
        interpreter,
        executable=staging.readable(interpreter.executable, identity),
        stdlib=staging.readable(interpreter.stdlib, identity, skip=("site-packages",)),
        libpython=None if libpython is None else staging.readable(libpython, identity),
    )


def _shell_mounts(interpreter: rootfs.Interpreter) -> tuple[rootfs.Mount, ...]:
    """The shell and command-line tools (isolation/shell.py), minus libraries already bound."""
    return shell.mounts(shell.find(), already_bound=frozenset(map(str, interpreter.libraries)))


def _package_mounts(
    policy: ImportPolicy | None, interpreter: rootfs.Interpreter
) -> tuple[rootfs.Mount, ...]:
    """Third-party packages the policy allows, bound read-only: those a curated profile
    names, or every installed data package under the default profile or no policy."""
    found = rootfs.packages_for(profiles.packages_to_bind(policy))
    known = {str(lib) for lib in interpreter.libraries}
    return tuple(
        m for m in rootfs.package_mounts(found) if m.kind != "ro-bind" or m.dest not in known
    ) + rootfs.font_list_mounts(found)


def _added_package_mounts(
    policy: ImportPolicy | None, packages_dir: Path | None, interpreter: rootfs.Interpreter
) -> tuple[rootfs.Mount, ...]:
    """The packages the operator added (`codecage packages`), read-only at /opt/packages
    when the policy allows any of them (codecage.packages.mounts)."""
    if packages_dir is None:
        return ()
    known = frozenset(map(str, interpreter.libraries))
    return packages.mounts(packages_dir, policy, known=known)


def _tool_tree_mounts(
    servers_dir: Path | None, skills_dir: Path | None
) -> tuple[rootfs.Mount, ...]:
    """The generated tool modules and the skills, read-only: at /servers and /skills to
    read (search_tools), and under the guest package root to import (`servers.x.y`)."""
    mounts: list[rootfs.Mount] = []
    trees = (
        ("servers", contract.SERVERS_DIR, servers_dir),
        ("skills", contract.SKILLS_DIR, skills_dir),
    )
    for name, readable_at, source in trees:
        if source is None:
            continue
        if not source.is_dir():
            raise ConfigError(
                f"the {name} directory {source} does not exist",
                hint="run `codecage gen --mcp-config FILE` first"
                if name == "servers"
                else "check the path given with --skills-dir",
            )
        mounts.append(rootfs.Mount("ro-bind", readable_at, str(source.resolve())))
        mounts.append(
            rootfs.Mount("ro-bind", f"{rootfs.GUEST_PACKAGE_ROOT}/{name}", str(source.resolve()))
        )
    return tuple(mounts)


@functools.cache
def sandbox_filter(
    *, network: bool = False, template: bool = False, unix_addressing: bool = True
) -> bytes:
    """The seccomp filter every sandbox gets (with IP sockets for a run allowed egress; a
    fork server's template its own, `seccomp.plan(template=True)`; without connect and
    addressed sends where the backend asks, `SeccompPlan.unix_addressing`): the same
    program each time, so compiled once (~3 ms of every cold start otherwise)."""
    return seccomp.compile_bpf(
        seccomp.plan(network=network, template=template, unix_addressing=unix_addressing)
    )


def runs_filter_fd(cleanup: contextlib.ExitStack) -> int:
    """A memfd holding the filter a template's runs install (guest/template.py), closed
    by `cleanup` (the template has read it by then, or failed)."""
    fd = os.memfd_create("codecage-run-filter", os.MFD_CLOEXEC)
    cleanup.callback(os.close, fd)
    os.write(fd, sandbox_filter())
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def make_run_dir(cleanup: contextlib.ExitStack) -> Path:
    """A fresh private directory for one run (its /etc, the launcher's cwd, its workspace
    mount point), removed by `cleanup`."""
    # The owner key in the name lets a later process clean up after one that was killed
    # (engine.owner); the private parent (not /tmp itself) keeps other users from planting
    # names to be swept.
    run_dir = Path(
        tempfile.mkdtemp(prefix=f"{RUN_DIR_PREFIX}{owner.key()}-", dir=workspaces.private_parent())
    )  # mode 0700
    cleanup.callback(_remove_run_dir, run_dir)
    # 0711 for root: the sandbox's own host id passes through to what it binds from here.
    run_dir.chmod(workspaces.run_dir_mode())
    return run_dir


def _remove_run_dir(run_dir: Path) -> None:
    """Remove a run's directory, unless its workspace is still a mount point (an unmount
    that failed): removing through it would delete a lent directory's files."""
    with contextlib.ExitStack() as opened:
        try:
            dir_fd = os.open(run_dir, workspace_fds.PATH_DIR_FLAGS)
            opened.callback(os.close, dir_fd)
            ws_fd = os.open("workspace", workspace_fds.PATH_DIR_FLAGS, dir_fd=dir_fd)
            opened.callback(os.close, ws_fd)
        except OSError:
            pass  # no workspace (or no run dir): nothing can be mounted there
        else:
            if not workspace_fds.same_mount(ws_fd, dir_fd):
                log.error("engine.run_dir_kept", extra={"path": str(run_dir)})
                return
    shutil.rmtree(run_dir, ignore_errors=True)


def prepare_workspace(
    workspace_dir: Path | None,
    size_mb: int,
    run_dir: Path,
    cleanup: contextlib.ExitStack,
    owner: Identity | None = None,
) -> workspaces.Workspace:
    """The user's directory, or a fresh tmpfs of `size_mb` in `run_dir`; `cleanup` gives
    the one back as it was lent and destroys the other. What is in it belongs to `owner`
    (the sandbox's host ids) during the run."""
    if workspace_dir is not None:
        ws = workspaces.use_existing(workspace_dir, owner, run_dir)
    else:
        ws = workspaces.create_ephemeral(run_dir, size_mb, owner)
    cleanup.callback(workspaces.destroy, ws)
    if not ws.owned:
        # A user's directory outlives the run. ExitStack is LIFO, so this runs after the
        # sandbox is reaped, on every exit path.
        root = workspaces.save_root(ws)
        try:
            # One run at a time: another's placeholders, removed when it ends, would take
            # this run's read-only covers with them (held until `restore_root` closes the
            # fd); and the scan, under that hold, before anything in it changes: a
            # directory it refuses is left exactly as it was.
            lending.hold(root.fd, ws.path)
            found = lending.scan(ws.path)
        except BaseException:
            os.close(root.fd)
            raise
        cleanup.callback(_hand_back, ws.path, root, owner)
        if workspaces.ownership.needs_lending(owner, root.uid) and owner is not None:
            workspaces.ownership.give(ws.path, owner.uid, owner.gid, skip_linked=True)
        made = lending.make_placeholders(ws.path, found)
        cleanup.callback(lending.remove_placeholders, ws.path, made)
        ws = dataclasses.replace(ws, protected=found)
    return ws


def _hand_back(path: Path, root: workspaces.RootState, owner: Identity | None) -> None:
    """Give a user's --workspace DIR back as it was lent: no setuid/setgid file planted in
    it (seccomp refuses setting the bits; this is the second layer), everything in it owned
    by DIR's owner again (what the sandbox's own host id made included), and DIR itself
    with its own mode and owner (the code may chmod /workspace, e.g. to 01777). The bits
    the operator had set on DIR are the operator's: neither step takes them away."""
    try:
        workspaces.strip_privilege_bits(path, keep_on_root=root.mode)
        if workspaces.ownership.needs_lending(owner, root.uid):
            workspaces.ownership.give(path, root.uid, root.gid)
    finally:
        workspaces.restore_root(root)


@dataclass(slots=True)
class Channels:
    """The sockets shared with one sandbox: the control socket (request, ready, result,
    end) and the tool bridge (docs/tool-bridge.md). The host closes the guest's ends once
    the sandbox started; closing a socket twice is harmless."""

    host_control: socket.socket
    guest_control: socket.socket
    host_bridge: socket.socket
    guest_bridge: socket.socket

    @classmethod
    def open(cls, cleanup: contextlib.ExitStack) -> Channels:
        host, guest = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            host_bridge, guest_bridge = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        except BaseException:
            host.close()
            guest.close()
            raise
        channel = cls(host, guest, host_bridge, guest_bridge)
        cleanup.callback(channel.close_all)
        return channel

    def close_guest_ends(self) -> None:
        self.guest_control.close()
        self.guest_bridge.close()

    def close_all(self) -> None:
        for sock in (self.guest_control, self.host_control, self.guest_bridge, self.host_bridge):
            sock.close()


def sandbox_env(interpreter: rootfs.Interpreter) -> dict[str, str]:
    """The sandbox's whole environment: a fixed allow-list, nothing from the host."""
    env = {
        "PATH": f"{rootfs.GUEST_PREFIX}/bin:{shell.GUEST_BIN}:/bin",
        "HOME": rootfs.WORKSPACE,
        "LANG": "C.UTF-8",
        "TMPDIR": "/tmp",  # noqa: S108 - the sandbox's own private tmpfs
        # matplotlib: draw to files (no display), and keep its cache in the private /tmp.
        "MPLBACKEND": "Agg",
        "MPLCONFIGDIR": "/tmp/matplotlib",  # noqa: S108
    }
    library_path = rootfs.library_path(interpreter)
    if library_path is not None:
        env["LD_LIBRARY_PATH"] = library_path
    return env


def guest_argv(channel: Channels, preload: tuple[str, ...], *, pooled: bool) -> tuple[str, ...]:
    """The guest's command line inside the sandbox: the bootstrap, told its fds."""
    # -I: isolated (no env vars, no user site, no cwd on sys.path); -S: no site module, so
    # no .pth files run; -B: no bytecode writes; utf8 mode: text I/O is UTF-8 whatever LANG.
    argv: tuple[str, ...] = (
        rootfs.GUEST_PYTHON,
        "-I",
        "-S",
        "-B",
        "-X",
        "utf8",
        rootfs.GUEST_BOOTSTRAP_PYC,
        "--control-fd",
        str(channel.guest_control.fileno()),
        "--bridge-fd",
        str(channel.guest_bridge.fileno()),
    )
    if pooled:
        argv = (*argv, "--pooled")
    return (*argv, "--preload", ",".join(preload)) if preload else argv


def sweep_stale_runs(only: str | None = None) -> int:
    """Remove what runs of dead codecage processes left behind (a host process killed with
    SIGKILL cannot clean up): their run dirs, workspace mounts, generated tool trees and
    cgroups; only `only`'s (an owner key) when given. Returns how many were removed.

    An entry is removed only while this process holds the lock of the owner it is named
    after (`engine.owner`): a live owner holds it, in whatever PID namespace either of them
    runs, so runs of live processes are never touched.

    Run dirs and tool trees live in `workspaces.private_parent()` (0700, ours), and are
    swept through descriptors (`workspaces.sweep_stale`): no other user can put a name
    there, and a name swapped for a symlink is never followed."""
    prefixes = (RUN_DIR_PREFIX, SERVERS_DIR_PREFIX)
    with owner.dead_owners(only) as dead:
        if not dead.keys:
            return 0
        # The cgroups first: what still runs there (a sandbox that outlived its host) may
        # keep its workspace's mount busy.
        removed = cgroups.sweep_stale(dead.owns)
        removed += workspaces.sweep_stale(prefixes, dead.owns)
        dead.still_named(workspaces.entry_names(prefixes) + cgroups.run_names())
    if removed:
        log.warning("engine.stale_runs_removed", extra={"count": removed})
    return removed
