"""One sandbox's launch as a pure plan: from what the sandbox is made with (`SandboxSpec`),
what the host has for it (`HostFacts`, found by `launch.facts`) and what was acquired for
it (`Resources`, by `launch.acquire`), `plan` works out everything the Backend is handed:
the mount table, the ids, the cgroup's limits, the seccomp filter, the environment and
the guest's command line. It reads nothing and makes nothing; `engine.run.start` then
makes the cgroup and hands the plan to the Backend.

The order of a cold start, top to bottom as nsjail's containProc: facts, acquire, plan,
start (`engine/run.py`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from codecage.backends.base import Backend, LaunchSpec
from codecage.engine import egress as egress_wiring
from codecage.guest import contract
from codecage.isolation import cgroups, datadir, lending, rootfs, seccomp, shell
from codecage.isolation.identity import Identity, IdentityPlan
from codecage.isolation.rootfs import Mount
from codecage.models import Limits
from codecage.policy.profiles import ImportPolicy

if TYPE_CHECKING:
    from codecage.egress.setup import EgressSetup


@dataclass(frozen=True, slots=True)
class SandboxSpec:
    """What a sandbox is made with and cannot change once it started: the warm pool keys
    its sandboxes by this. Per-run limits are not part of it (see `run.run_in`)."""

    policy: ImportPolicy | None = None
    workspace_mb: int = Limits.model_fields["workspace_mb"].default
    tmp_mb: int = Limits.model_fields["tmp_mb"].default
    preload: tuple[str, ...] = ()  # modules the guest imports before it says it is ready
    servers_dir: Path | None = None  # `codecage gen`'s tree, read-only at /servers
    skills_dir: Path | None = None  # reusable functions, read-only at /skills
    packages_dir: Path | None = None  # the operator's added packages, at /opt/packages
    data_dir: Path | None = None  # the operator's data, read-only at /data (isolation.datadir)
    # The host ids the sandbox runs as (never 0): one id, or a plan whose range lends each
    # sandbox its own for its life (`isolation.identity.lease`); None: this process's
    # default (`isolation.identity.plan()`: a range for root, the caller's own otherwise).
    identity: Identity | IdentityPlan | None = None
    # Made with a socket on this proxy, a relay and IP sockets (engine/egress.py); None:
    # no network at all. A run's hosts are granted per run, not part of the spec.
    egress: EgressSetup | None = None


@dataclass(frozen=True, slots=True)
class HostFacts:
    """What the host has for a sandbox of one spec, found (`launch.facts`) before anything
    is made for it: the interpreter, its root's facts and what it binds besides."""

    interpreter: rootfs.Interpreter
    root: rootfs.RootFacts
    binds: tuple[Mount, ...]  # tools, packages, tool trees, the data directory
    pip: Path | None  # the host's pip package, bound for a run allowed egress


@dataclass(frozen=True, slots=True)
class Resources:
    """What was acquired on the host for one sandbox before it starts (`launch.acquire`,
    each undone by the run's cleanup), as the plain values the plan reads."""

    name: str  # the run's name on the host (its cgroup's): owner key and execution id
    identity: Identity  # its host ids (lent for its life, or a template's range's base)
    id_map: tuple[int, int] | None  # a template's: (first host id, count) it maps
    run_dir: Path  # its private directory: /etc, the empty dir and file, the egress socket
    workspace: Path  # the host directory bound at /workspace
    protected: lending.Found | None  # a lent workspace's entries kept read-only
    # Host sources the sandbox's ids cannot read, and their readable copies
    # (`isolation.staging`; only when codecage is root and the sandbox another id).
    staged: tuple[tuple[str, str], ...]
    control_fd: int  # the guest's ends of its channels (`launch.Channels`)
    bridge_fd: int
    runs_filter_fd: int | None  # a template's: the memfd of the filter its runs install


@dataclass(frozen=True, slots=True)
class CgroupPlan:
    """The run's cgroup: its name and limits, and the backend's own processes' share."""

    name: str
    limits: Limits
    extra_pids: int
    pids_per_process: int
    extra_memory_mb: int


@dataclass(frozen=True, slots=True)
class LaunchPlan:
    """Everything one sandbox is started with; `engine.run.start` carries it out."""

    mounts: tuple[Mount, ...]
    env: tuple[tuple[str, str], ...]
    argv: tuple[str, ...]  # the guest's command line inside
    identity: Identity
    id_map: tuple[int, int] | None
    cgroup: CgroupPlan
    seccomp: seccomp.SeccompPlan  # the filter chosen; compiled (once a process) at start
    cwd: Path  # the launcher's host cwd: the run's directory
    control_fd: int
    bridge_fd: int
    extra_fds: tuple[int, ...]
    network: bool
    template: bool
    # What its first process must be on the host (never root); None: a backend whose
    # launcher is root's checks its own way (gVisor's Sentry).
    expected: Identity | None

    def launch_spec(self, bpf: bytes) -> LaunchSpec:
        """The Backend's description of it, with its filter compiled into `bpf`."""
        return LaunchSpec(
            mounts=self.mounts,
            env=dict(self.env),
            guest_argv=self.argv,
            seccomp=bpf,
            control_fd=self.control_fd,
            bridge_fd=self.bridge_fd,
            cwd=self.cwd,
            identity=self.identity,
            network=self.network,
            template=self.template,
            extra_fds=self.extra_fds,
            id_map=self.id_map,
        )


def plan(
    spec: SandboxSpec,
    limits: Limits,
    backend: Backend,
    facts: HostFacts,
    held: Resources,
    *,
    pooled: bool = False,
    as_template: bool = False,
) -> LaunchPlan:
    """The launch of one sandbox of `spec`, its cgroup set to `limits`, by `backend`. Pure:
    no file read or written, no process, no descriptor; the same inputs give an equal plan."""
    network = spec.egress is not None
    overhead = backend.host_overhead
    argv = guest_argv(held.control_fd, held.bridge_fd, spec.preload, pooled=pooled)
    env = sandbox_env(facts.interpreter)
    mounts = _mounts(spec, facts, held, as_template=as_template)
    extra_fds: tuple[int, ...] = ()
    if held.runs_filter_fd is not None:
        extra_fds = (held.runs_filter_fd,)
        argv = (*argv, contract.TEMPLATE_ARG, str(held.runs_filter_fd))
    if spec.egress is not None:
        mounts += egress_wiring.mounts(held.run_dir, facts.pip)
        env.update(egress_wiring.env(spec.egress, pip=facts.pip is not None))
        argv = (*argv, contract.EGRESS_ARG)
    return LaunchPlan(
        mounts=mounts,
        env=tuple(env.items()),
        argv=argv,
        identity=held.identity,
        id_map=held.id_map,
        cgroup=CgroupPlan(
            name=held.name,
            limits=limits,
            extra_pids=overhead.pids,
            pids_per_process=overhead.pids_per_process,
            extra_memory_mb=overhead.memory_mb,
        ),
        seccomp=seccomp.plan(
            network=network,
            template=as_template,
            # A backend whose guest shares the host's filesystem and cannot keep it from
            # the host's pathname unix sockets otherwise (the Landlock fallback below ABI 9).
            unix_addressing=not backend.filters_unix_addressing,
        ),
        cwd=held.run_dir,
        control_fd=held.control_fd,
        bridge_fd=held.bridge_fd,
        extra_fds=extra_fds,
        network=network,
        template=as_template,
        expected=None if backend.root_launcher else held.identity,
    )


def _mounts(
    spec: SandboxSpec, facts: HostFacts, held: Resources, *, as_template: bool
) -> tuple[Mount, ...]:
    """The root (the interpreter, the run's /etc, /proc, /dev, /tmp, /workspace with a
    lent one's protected entries) and the binds, every host source as the sandbox's ids
    can read it; a template's without the /proc masks (its runs mask their own /proc)."""
    staged = dict(held.staged)
    interpreter = _staged_interpreter(facts.interpreter, staged)
    mounts = rootfs.plan(
        interpreter,
        facts.root,
        workspace=held.workspace,
        etc_dir=held.run_dir / "etc",
        empty_dir=held.run_dir / "empty",
        tmp_bytes=spec.tmp_mb * cgroups.MiB,
    )
    if held.protected is not None:
        mounts += lending.plan(
            held.protected,
            source=str(held.workspace),
            dest=rootfs.WORKSPACE,
            empty_dir=str(held.run_dir / "empty"),
        )
    mounts = tuple(_readable(m, staged) for m in mounts + facts.binds)
    if as_template:
        mounts = tuple(m for m in mounts if m.dest not in rootfs.PROC_MASKED)
    return mounts


def _staged_interpreter(
    interpreter: rootfs.Interpreter, staged: dict[str, str]
) -> rootfs.Interpreter:
    libpython = interpreter.libpython
    return replace(
        interpreter,
        executable=Path(staged.get(str(interpreter.executable), interpreter.executable)),
        stdlib=Path(staged.get(str(interpreter.stdlib), interpreter.stdlib)),
        libpython=None if libpython is None else Path(staged.get(str(libpython), libpython)),
    )


def _readable(mount: Mount, staged: dict[str, str]) -> Mount:
    """`mount` from its staged copy when its source has one."""
    if mount.kind in ("ro-bind", "bind") and mount.source in staged:
        return replace(mount, source=staged[mount.source])
    return mount


def host_sources(facts: HostFacts) -> tuple[str, ...]:
    """Every host path a sandbox with these facts binds from outside its run directory,
    but the data directory (its readers are the operator's, it is never copied): what
    `launch.acquire` stages for ids that cannot read it. Pure."""
    run_dir = Path("/nonexistent/run-dir")  # a name only: the run's own sources are skipped
    root = rootfs.plan(
        facts.interpreter,
        facts.root,
        workspace=run_dir / "workspace",
        etc_dir=run_dir / "etc",
        empty_dir=run_dir / "empty",
        tmp_bytes=0,
    )
    return tuple(
        dict.fromkeys(
            m.source
            for m in root + facts.binds
            if m.kind in ("ro-bind", "bind")
            and m.source is not None
            and not m.source.startswith(f"{run_dir}/")
            and m.dest != datadir.DATA_DIR
        )
    )


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


def guest_argv(
    control_fd: int, bridge_fd: int, preload: tuple[str, ...], *, pooled: bool
) -> tuple[str, ...]:
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
        str(control_fd),
        "--bridge-fd",
        str(bridge_fd),
    )
    if pooled:
        argv = (*argv, "--pooled")
    return (*argv, "--preload", ",".join(preload)) if preload else argv
