"""What one sandbox's launch needs of the host, before its plan (`engine.plan`): the facts
found (`facts`: the interpreter, what it binds) and the resources acquired in one place
(`acquire`: its host ids, run directory, workspace, staged copies, channels, egress
socket); and sweeping what runs of dead host processes left behind.

Everything made here is registered on the caller's ExitStack, so any exit path undoes it.
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
from typing import TYPE_CHECKING

from codecage import packages
from codecage.backends.base import Backend
from codecage.engine import egress as egress_wiring
from codecage.engine import owner
from codecage.engine import workspace as workspaces
from codecage.engine.plan import HostFacts, Resources, SandboxSpec, host_sources
from codecage.engine.workspace import fds as workspace_fds
from codecage.errors import ConfigError
from codecage.guest import contract
from codecage.isolation import cgroups, datadir, lending, rootfs, seccomp, shell, staging
from codecage.isolation import identity as identities
from codecage.isolation.identity import Identity, IdentityPlan
from codecage.policy import profiles
from codecage.policy.profiles import ImportPolicy

if TYPE_CHECKING:
    from codecage.egress.proxy import RunEgress

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


def facts(spec: SandboxSpec) -> HostFacts:
    """What the host has for a sandbox of `spec`: found before anything is made for it (a
    process killed meanwhile, the first time with an empty cache, takes seconds, and must
    leave no run directory, mount or cgroup).

    Raises:
        ConfigError: a servers or skills directory does not exist.
        HostError: the host facts cannot be found (ldd fails, the cache is not writable).
    """
    interpreter = rootfs.find_interpreter()
    return HostFacts(
        interpreter=interpreter,
        root=rootfs.facts(interpreter),
        binds=binds(spec.policy, spec.packages_dir, spec.servers_dir, spec.skills_dir, interpreter)
        + datadir.mounts(spec.data_dir),
        pip=egress_wiring.pip_package() if spec.egress is not None else None,
    )


@dataclass(frozen=True, slots=True)
class Acquired:
    """What `acquire` made for one sandbox, each undone by its cleanup: the plain values
    the plan reads (`resources`) and the live things the started sandbox keeps."""

    resources: Resources
    workspace: workspaces.Workspace
    channel: Channels
    egress: RunEgress | None  # its socket on the proxy (spec.egress), else None
    own_id: bool  # its host id is its own (lent from a range), not shared


def acquire(
    spec: SandboxSpec,
    found: HostFacts,
    backend: Backend,
    cleanup: contextlib.ExitStack,
    *,
    execution_id: str,
    workspace_dir: Path | None = None,
    as_template: bool = False,
) -> Acquired:
    """Everything one sandbox holds on the host before it starts, in one place, each
    registered on `cleanup`: its host ids (first, so returned last: once its processes are
    gone and its files removed or given back), its run directory and what is written
    there, its workspace, the readable copies of what its ids cannot read, its channels,
    a template's runs' filter and its socket on the egress proxy.

    Raises:
        ConfigError: a lent workspace is refused (held by another run, ...).
        HostError: this host cannot provide it (no id free, no tmpfs, ...).
    """
    # A template runs as its range's own id, in a user namespace that maps the range:
    # each run it forks drops to the id it is lent then (engine/forkserver.py).
    id_map = template_ids(spec) if as_template else None
    own_id = False
    if id_map is not None:
        identity = Identity(id_map.base, id_map.base)
    else:
        lent = cleanup.enter_context(identities.lease(spec.identity))
        identity, own_id = lent.identity, lent.own
    run_dir = make_run_dir(cleanup)
    rootfs.write_etc(run_dir / "etc")
    (run_dir / "empty").mkdir(mode=0o555)
    rootfs.write_empty_file(run_dir)
    ws = prepare_workspace(workspace_dir, spec.workspace_mb, run_dir, cleanup, owner=identity)
    staged = _stage(found, identity)
    channel = Channels.open(cleanup)
    filter_fd = runs_filter_fd(cleanup) if as_template else None
    listener = None
    if spec.egress is not None:
        listener = egress_wiring.open_socket(
            spec.egress,
            run_dir,
            cleanup,
            identity,
            # gVisor's Sentry (root's) connects for the guest (--host-uds=open).
            launcher=Identity(os.geteuid(), os.getegid()) if backend.root_launcher else None,
        )
    return Acquired(
        resources=Resources(
            name=f"{owner.key()}-{execution_id}",
            identity=identity,
            id_map=None if id_map is None else (id_map.base, id_map.count),
            run_dir=run_dir,
            workspace=ws.bind_source,
            protected=ws.protected,
            staged=staged,
            control_fd=channel.guest_control.fileno(),
            bridge_fd=channel.guest_bridge.fileno(),
            runs_filter_fd=filter_fd,
        ),
        workspace=ws,
        channel=channel,
        egress=listener,
        own_id=own_id,
    )


def template_ids(spec: SandboxSpec) -> identities.IdRange | None:
    """The range a template of `spec` maps, so that each run it forks has its own id;
    None when its runs all share one id (the caller's or the config's)."""
    ids = spec.identity if spec.identity is not None else identities.plan()
    if isinstance(ids, IdentityPlan) and os.geteuid() == 0:
        return ids.range
    return None


def _stage(found: HostFacts, identity: Identity) -> tuple[tuple[str, str], ...]:
    """The readable copy of each host source the sandbox binds that its host `identity`
    cannot read (`isolation.staging`: only when codecage is root and the sandbox another
    id); the stdlib without its site-packages, which the sandbox never sees."""
    if os.geteuid() != 0 or identity.uid == 0:
        return ()
    stdlib = str(found.interpreter.stdlib)
    copies: list[tuple[str, str]] = []
    for source in host_sources(found):
        skip = ("site-packages",) if source == stdlib else ()
        copy = str(staging.readable(Path(source), identity, skip=skip))
        if copy != source:
            copies.append((source, copy))
    return tuple(copies)


@functools.cache
def sandbox_filter(chosen: seccomp.SeccompPlan) -> bytes:
    """The filter a plan chose (`plan.LaunchPlan.seccomp`), compiled: the same few programs
    in every process, so compiled once each (~3 ms of every cold start otherwise)."""
    return seccomp.compile_bpf(chosen)


def runs_filter_fd(cleanup: contextlib.ExitStack) -> int:
    """A memfd holding the filter a template's runs install (guest/template.py), closed
    by `cleanup` (the template has read it by then, or failed)."""
    fd = os.memfd_create("codecage-run-filter", os.MFD_CLOEXEC)
    cleanup.callback(os.close, fd)
    os.write(fd, sandbox_filter(seccomp.plan()))
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
