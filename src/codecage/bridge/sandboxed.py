"""Upstream MCP servers in a sandbox of their own (`"sandbox": true` in a server's entry).

A sandboxed stdio upstream is started through a Backend like every sandbox: `start` with a
`LaunchSpec` whose stdin and stdout are the MCP transport (`LaunchSpec.stdio`), on the
backend that serves stdio (`backends.base.stdio_backend`: bubblewrap's), so it has every
layer a run's sandbox has. Nothing here names a backend or writes its command line:

- its own user, pid, ipc, uts, cgroup and **network** namespaces (no interface but an
  unused loopback) and the project's seccomp filter (`isolation.seccomp`: no socket
  family but AF_UNIX, no ptrace, mount, unshare, bpf, ...), no capabilities,
  no_new_privs, nested user namespaces disabled;
- a host identity that is never root (`isolation.identity`: as root, the dedicated id;
  checked on the sandbox's first process before the server starts, as for every run);
- a cgroup of its own with the entry's `memory_mb` and `max_processes` (memory and pids;
  the process is moved in before the server starts, between bwrap's "namespaces made"
  and "go"), where the host has cgroups;
- rlimits (open files, file size, processes, no core dumps), set by util-linux `prlimit`
  inside the sandbox before the server starts, so every process of the server has them;
- a root of its own: /usr and the /lib directories read-only, a private /etc (passwd,
  group, hosts, nsswitch.conf; the host's CA certificates, ld.so.cache and time zone),
  a read-only /proc with the same entries masked as in a run's (`rootfs.PROC_MASKED`),
  the command's own files read-only (its executable through its links, a script's
  interpreter, a venv and its base interpreter, a `node_modules` tree a script is in;
  staged by `isolation.staging` where the sandbox's id cannot read them), a private
  /tmp, the server's state directory read-write at `/state` (HOME and the working
  directory; it persists across calls and restarts), and its `roots` read-write at their
  own paths. No $HOME, /root, host /tmp, host /etc, codecage config.
- an environment of the entry's `env` plus PATH, HOME and LANG only.

Everything the sandbox is made of (its run directory with the private /etc, its cgroup)
belongs to `sandboxed_stdio_client` and is gone when the session ends; the server's
processes end with bwrap (`--die-with-parent`, the pid namespace) and its cgroup.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import re
import shutil
import tempfile
import threading
import uuid
from collections.abc import AsyncGenerator, Callable, Iterable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

import anyio
import anyio.lowlevel
import anyio.to_thread
from anyio.abc import ByteReceiveStream, ByteSendStream
from mcp.client import stdio as sdk
from mcp.client._transport import TransportStreams

from codecage.backends.base import LaunchSpec, SandboxProcess, stdio_backend
from codecage.bridge.stdio_client import bounded_transport
from codecage.bridge.upstreams import Upstream
from codecage.egress.environment import proxy_env
from codecage.egress.servers import ServerEgress
from codecage.errors import BridgeError, CodecageError, ConfigError
from codecage.guest import contract
from codecage.guest import relay as relay_module
from codecage.isolation import cgroups, lending, rootfs, seccomp, staging
from codecage.isolation import identity as identities
from codecage.isolation.cgroups import CgroupHandle
from codecage.isolation.identity import Identity
from codecage.isolation.rootfs import Mount
from codecage.models import Limits

log = logging.getLogger(__name__)

STATE = "/state"
"""Where the server's state directory is inside: its HOME and working directory."""

PATH = "/usr/local/bin:/usr/bin:/bin"
_SYSTEM = ("/usr", "/lib", "/lib64", "/lib32", "/libx32", "/bin", "/sbin")
_HOST_ETC = ("/etc/ld.so.cache", "/etc/ssl/certs", "/etc/localtime", "/etc/timezone")
_TMP_BYTES = 256 * 1024 * 1024
_PYTHON = re.compile(r"python(\d+\.\d+)$")
# prlimit's names and values: descriptors, the largest file (MiB), tasks (threads count:
# node starts a dozen), no core dumps.
RLIMITS: tuple[tuple[str, int], ...] = (
    ("nofile", 1024),
    ("fsize", 1024 * 1024 * 1024),
    ("nproc", 1024),
    ("core", 0),
)


@dataclass(frozen=True, slots=True)
class ServerSandbox:
    """How to start one sandboxed upstream: its mount table, the command run inside (the
    server's, behind prlimit), where it starts, its environment and host identity."""

    mounts: tuple[Mount, ...]
    argv: tuple[str, ...]
    chdir: str
    env: dict[str, str]
    state_dir: Path
    identity: Identity


def state_dir(name: str, config: Upstream) -> Path:
    """The server's persistent state directory on the host: `state_dir` when set, else
    /var/lib/codecage/servers/NAME (root) or $XDG_DATA_HOME/codecage/servers/NAME."""
    if config.state_dir is not None:
        return Path(config.state_dir)
    if os.geteuid() == 0:
        return Path("/var/lib/codecage/servers") / name
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "codecage" / "servers" / name


@dataclass(frozen=True, slots=True)
class ServerNetwork:
    """A server allowed hosts: its socket's directory on the host (bound read-only at
    `contract.EGRESS_DIR`) and whether the proxy has a CA bundle there."""

    socket_dir: Path
    with_ca: bool


def plan(
    name: str,
    config: Upstream,
    *,
    run_dir: Path,
    network: ServerNetwork | None = None,
) -> ServerSandbox:
    """What `name`'s sandbox is made of: its mounts, the command inside (prlimit, then the
    server's) and environment. Not pure: it resolves the command, stages what the
    sandbox's id cannot read, makes the state directory and writes the private /etc and
    the empty directory and file that mask /proc entries into `run_dir`.

    Raises:
        BridgeError: the command is missing, or a path it needs is not given to it.
        HostError: a file cannot be staged for the sandbox's id.
    """
    who = identities.plan().identity
    state = _make_state_dir(name, config, who)
    command = _resolve_command(name, config)
    roots = _roots(name, config, who)
    _check_arguments(name, config, roots)
    etc_dir = run_dir / "etc"
    _write_etc(etc_dir)
    (run_dir / "empty").mkdir(mode=0o555)
    rootfs.write_empty_file(run_dir)
    mounts = [
        *_system_mounts(),
        *_etc_mounts(etc_dir),
        Mount("proc", "/proc"),
        Mount("remount-ro", "/proc"),
        *rootfs.proc_masks(run_dir / "empty"),
        Mount("dev", "/dev"),
        Mount("tmpfs", "/tmp", size_bytes=_TMP_BYTES),  # noqa: S108 - private, size-limited
        # After the private /tmp: a program that lives under the host's /tmp (a checkout
        # there) is bound over it, not hidden by it.
        *_program_mounts(command, config, who),
        Mount("bind", STATE, str(state)),
        *(Mount("bind", str(root), str(root)) for root in roots),
        *(_relay_mounts(network, who) if network is not None else ()),
    ]
    server = (str(command), *config.args)
    if network is not None:
        server = _behind_the_relay(server)
    env = {"PATH": PATH, "HOME": STATE, "LANG": "C.UTF-8", **config.env}
    if network is not None:
        env.update(proxy_env(with_ca=network.with_ca))
    return ServerSandbox(
        mounts=tuple(mounts),
        argv=_limited(server),
        chdir=config.cwd or STATE,
        env=env,
        state_dir=state,
        identity=who,
    )


def launch_spec(
    server: ServerSandbox, *, seccomp_bpf: bytes, run_dir: Path, network: bool
) -> LaunchSpec:
    """The Backend's description of a server's sandbox: like a run's, with the server's
    stdio as its transport instead of a guest's two channels."""
    return LaunchSpec(
        mounts=server.mounts,
        env=server.env,
        guest_argv=server.argv,
        seccomp=seccomp_bpf,
        cwd=run_dir,
        identity=server.identity,
        network=network,
        chdir=server.chdir,
        stdio=True,
    )


@asynccontextmanager
async def sandboxed_stdio_client(
    name: str,
    config: Upstream,
    errlog: TextIO,
    *,
    max_line_bytes: int,
    on_overflow: Callable[[], None],
    egress: ServerEgress | None = None,
) -> AsyncGenerator[TransportStreams, None]:
    """A session's streams to `config`'s command started in its own sandbox through the
    Backend that serves stdio, each line it writes bounded as `bounded_stdio_client` does.

    Raises:
        BridgeError: the sandbox cannot be made for this server (the message says why and
            what to change in its entry).
        SandboxError: the backend could not start it.
        HostError: no backend here serves stdio (bubblewrap is not installed).
        HostError: its cgroup cannot be made although the host has cgroups.
    """
    with contextlib.ExitStack() as owned:
        network = config.sandbox and bool(config.allow_hosts) and egress is not None
        run_dir = Path(tempfile.mkdtemp(prefix=f"codecage-upstream-{os.getpid()}-"))
        owned.callback(shutil.rmtree, run_dir, True)
        run_dir.chmod(0o755)  # bwrap runs as the sandbox's id and binds the /etc in it
        server_network = None
        if network and egress is not None:
            who = identities.plan().identity
            listener = egress.open(name, config.allow_hosts, run_dir / "egress", who)
            owned.callback(egress.closed, name, listener)
            server_network = ServerNetwork(run_dir / "egress", egress.setup().ca_bundle is not None)
        try:
            # In a thread: the first start may stage an interpreter (seconds), and the
            # broker's loop serves the other upstreams meanwhile.
            server = await anyio.to_thread.run_sync(
                functools.partial(plan, name, config, run_dir=run_dir, network=server_network)
            )
        except BridgeError:
            raise
        except CodecageError as exc:  # a host problem: said with what to do, as a bridge error
            raise BridgeError(f"{exc} ({exc.hint})") from exc
        cgroup = cgroups.create(
            f"{os.getpid()}-upstream-{uuid.uuid4().hex}",
            Limits(memory_mb=config.memory_mb, max_processes=config.max_processes),
        )
        if cgroup is not None:
            owned.callback(cgroups.destroy, cgroup)
        spec = launch_spec(
            server,
            seccomp_bpf=seccomp.compile_bpf(seccomp.plan(network=network)),
            run_dir=run_dir,
            network=network,
        )
        # On the broker loop's own thread, which lives as long as the broker: bwrap dies
        # with the thread that started it (--die-with-parent), and a worker thread of
        # anyio's is let go when idle.
        process = stdio_backend().start(spec, functools.partial(_on_created, cgroup))
        owned.callback(_stopped, process, cgroup)
        _copy_stderr(process, errlog)
        stdin, stdout = _HeldPipe(process, "stdin"), _HeldPipe(process, "stdout")

        async def stop() -> None:
            await stdin.aclose()
            with anyio.move_on_after(sdk.PROCESS_TERMINATION_TIMEOUT):
                while process.alive():
                    await anyio.sleep(0.05)
            await stdout.aclose()
            await anyio.to_thread.run_sync(_stopped, process, cgroup)

        async with bounded_transport(
            stdin, stdout, stop, max_line_bytes=max_line_bytes, on_overflow=on_overflow
        ) as streams:
            yield streams


def _on_created(cgroup: CgroupHandle | None, pid: int) -> None:
    """Between "namespaces made" and the server's start, as for a run: never host root
    (checked on the process itself), and in its cgroup from its first instruction."""
    identities.ensure_not_root(pid)
    if cgroup is not None:
        cgroups.attach(cgroup, pid)


def _stopped(process: SandboxProcess, cgroup: CgroupHandle | None) -> None:
    """Kill every process of the server's sandbox (bwrap's, then what is left in its
    cgroup), reap it and close its pipes; idempotent."""
    process.kill()
    if cgroup is not None:
        cgroups.kill_all(cgroup)
    process.close()


def _copy_stderr(process: SandboxProcess, errlog: TextIO) -> None:
    """The server's stderr into `errlog` (whose tail explains a crash), on a thread of its
    own until the pipe ends (every process of the sandbox is gone)."""

    def copy() -> None:
        with contextlib.suppress(OSError, ValueError):
            fd = process.stderr.fileno()
            for chunk in iter(lambda: os.read(fd, 65536), b""):
                errlog.write(chunk.decode("utf-8", "replace"))
                errlog.flush()

    threading.Thread(target=copy, name="codecage-upstream-stderr", daemon=True).start()


class _HeldPipe(ByteReceiveStream, ByteSendStream):
    """The server's stdin or stdout pipe, held by its `SandboxProcess`, as an anyio byte
    stream: non-blocking, waited on with the loop's own readiness (`aclose` wakes a
    waiting task); the fd itself is closed by the process's `close`."""

    def __init__(self, process: SandboxProcess, which: str) -> None:
        pipe = process.stdin if which == "stdin" else process.stdout
        if pipe is None:
            raise BridgeError(f"the sandboxed server was started without a {which} pipe")
        self._fd = pipe.fileno()
        os.set_blocking(self._fd, False)
        self._closed = False

    async def receive(self, max_bytes: int = 65536) -> bytes:
        while True:
            if self._closed:
                raise anyio.ClosedResourceError
            try:
                data = os.read(self._fd, max_bytes)
            except BlockingIOError:
                await anyio.wait_readable(self._fd)
                continue
            if not data:
                raise anyio.EndOfStream
            return data

    async def send(self, item: bytes) -> None:
        view = memoryview(item)
        while view:
            if self._closed:
                raise anyio.ClosedResourceError
            try:
                view = view[os.write(self._fd, view) :]
            except BlockingIOError:
                await anyio.wait_writable(self._fd)
            except BrokenPipeError as exc:
                raise anyio.BrokenResourceError from exc

    async def aclose(self) -> None:
        if not self._closed:
            self._closed = True
            anyio.notify_closing(self._fd)
        await anyio.lowlevel.checkpoint()


_RELAY = "/opt/codecage-relay/relay.py"


def _relay_mounts(network: ServerNetwork, who: Identity) -> list[Mount]:
    """The proxy's socket, and what the relay runs with: the host's interpreter (its
    files, as a command's are bound) and guest/relay.py."""
    wanted: dict[Path, tuple[str, ...]] = {}
    _needs(rootfs.find_interpreter().executable, wanted, depth=0)
    kept = {p: s for p, s in wanted.items() if not any(_inside(p, other) for other in wanted)}
    relay = Path(relay_module.__file__ or "relay.py")
    return [
        Mount("ro-bind", contract.EGRESS_DIR, str(network.socket_dir)),
        *(
            Mount("ro-bind", str(path), str(staging.readable(path, who, skip=skip)))
            for path, skip in sorted(kept.items())
        ),
        Mount("ro-bind", _RELAY, str(staging.readable(relay, who))),
    ]


def _behind_the_relay(server: tuple[str, ...]) -> tuple[str, ...]:
    """The server's argv, started once the relay listens (guest/relay.py's main binds the
    port, forks the relay and returns): HTTP_PROXY then reaches the proxy from the start."""
    python = str(rootfs.find_interpreter().executable)
    port, socket_path = contract.EGRESS_RELAY_PORT, contract.EGRESS_SOCKET
    script = f'{python} -I -S {_RELAY} {port} {socket_path} && exec "$@"'
    return ("/bin/sh", "-c", script, "codecage-relay", *server)


def _refused(name: str, what: str, fix: str) -> BridgeError:
    # The broker words a failed start from str(err) alone: what to do goes in it.
    return BridgeError(f"the sandboxed upstream {name!r} cannot start: {what}; {fix}", hint=fix)


def _make_state_dir(name: str, config: Upstream, who: Identity) -> Path:
    path = state_dir(name, config)
    try:
        if config.state_dir is None:
            path.parent.mkdir(parents=True, exist_ok=True, mode=0o711)
        path.mkdir(mode=0o700, exist_ok=True)
        if os.geteuid() == 0 and path.stat().st_uid != who.uid:
            os.chown(path, who.uid, who.gid)
    except OSError as exc:
        raise _refused(
            name,
            f"its state directory {path} cannot be made ({exc.strerror})",
            "set `state_dir` in its entry to a directory codecage can create",
        ) from exc
    if not identities.can_read(path, who) or not os.access(path, os.W_OK):
        raise _refused(
            name,
            f"its state directory {path} is not reachable by the sandbox's host id (uid {who.uid})",
            f"make {path} and its parents reachable by uid {who.uid}, or choose another"
            " `state_dir`",
        )
    return path


def _resolve_command(name: str, config: Upstream) -> Path:
    command = config.command or ""
    search = config.env.get("PATH") or os.environ.get("PATH") or os.defpath
    found = shutil.which(command, path=search)
    if found is None:
        raise _refused(
            name,
            f"its command {command!r} is not found on this host",
            "give `command` as an absolute path of an installed program (a sandboxed server"
            " has no network: `npx -y` cannot download it, install it and name its script)",
        )
    return Path(found).absolute()


def _roots(name: str, config: Upstream, who: Identity) -> list[Path]:
    roots: list[Path] = []
    for root in config.roots:
        path = Path(root)
        if not path.is_absolute() or not path.is_dir():
            raise _refused(
                name,
                f"its root {root!r} is not an existing directory",
                "list absolute paths of existing directories in `roots`",
            )
        try:  # never codecage's own places, nor a Python installation (isolation.lending)
            lending.check(path, lending.own_places())
        except ConfigError as exc:
            raise _refused(name, f"its root {exc}", "list a directory of data in `roots`") from exc
        if not identities.can_read(path, who) or not os.access(path, os.W_OK):
            raise _refused(
                name,
                f"its root {root} is not readable and writable by the sandbox's host id"
                f" (uid {who.uid})",
                f"make it and its parents reachable by uid {who.uid} (e.g. chown -R"
                f" {who.uid}:{who.gid} {root})",
            )
        roots.append(path.resolve())
    return roots


def _check_arguments(name: str, config: Upstream, roots: list[Path]) -> None:
    """A directory of the host named in `args` or `cwd` must be one the sandbox is given:
    otherwise the server would start and fail on every call."""
    for arg in (*config.args, *([config.cwd] if config.cwd else [])):
        path = Path(arg)
        if not path.is_absolute() or not path.is_dir() or _under(path, _SYSTEM):
            continue
        real = path.resolve()
        if not any(real == root or root in real.parents for root in roots):
            raise _refused(
                name,
                f"it names the directory {arg}, which is not given to its sandbox",
                f'add "{arg}" to its `roots` (read-write inside at the same path)',
            )


def _write_etc(etc_dir: Path) -> None:
    rootfs.write_etc(etc_dir)
    (etc_dir / "passwd").write_text(
        f"sandbox:x:{rootfs.SANDBOX_UID}:{rootfs.SANDBOX_GID}:codecage upstream:{STATE}:"
        "/nonexistent\n",
        encoding="utf-8",
    )
    nsswitch = etc_dir / "nsswitch.conf"
    nsswitch.write_text("passwd: files\ngroup: files\nhosts: files\n", encoding="utf-8")
    nsswitch.chmod(0o644)


def _system_mounts() -> list[Mount]:
    mounts: list[Mount] = []
    for path in _SYSTEM:
        if Path(path).is_symlink():
            mounts.append(Mount("symlink", path, str(Path(path).readlink())))
        elif Path(path).is_dir():
            mounts.append(Mount("ro-bind", path, path))
    return mounts


def _etc_mounts(etc_dir: Path) -> list[Mount]:
    names = ("passwd", "group", "hosts", "hostname", "nsswitch.conf")
    mounts = [Mount("ro-bind", f"/etc/{n}", str(etc_dir / n)) for n in names]
    mounts += [Mount("ro-bind", p, p) for p in _HOST_ETC if Path(p).exists()]
    return mounts


def _program_mounts(command: Path, config: Upstream, who: Identity) -> list[Mount]:
    """Read-only binds of what the command needs outside the system directories, each at
    its own path (staged where the sandbox's id cannot read it)."""
    wanted: dict[Path, tuple[str, ...]] = {}
    for path in (command, *_script_arguments(config.args)):
        _needs(path, wanted, depth=0)
    kept = {p: s for p, s in wanted.items() if not any(_inside(p, other) for other in wanted)}
    return [
        Mount("ro-bind", str(path), str(staging.readable(path, who, skip=skip)))
        for path, skip in sorted(kept.items())
    ]


def _script_arguments(args: Iterable[str]) -> list[Path]:
    """Files named by absolute path in the arguments (`node /x/dist/index.js`)."""
    return [Path(a) for a in args if a.startswith("/") and Path(a).is_file()]


def _needs(path: Path, wanted: dict[Path, tuple[str, ...]], *, depth: int) -> None:
    """Add to `wanted` the trees that `path` needs: itself through every link, the venv
    or node_modules it is in, a script's interpreter, a Python's stdlib and libraries."""
    if depth > 8:
        return
    for link in _link_chain(path):
        if _under(link, _SYSTEM):
            continue
        wanted.setdefault(_tree_of(link), ())
        python = _PYTHON.search(link.name)
        if python and link.parent.name == "bin" and not link.is_symlink():
            stdlib = link.parent.parent / "lib" / f"python{python.group(1)}"
            if stdlib.is_dir():
                wanted[stdlib] = ("site-packages",)
        if not link.is_symlink() and _is_elf(link):
            for lib in rootfs.resolve_shared_libraries([link]):
                if not _under(lib, _SYSTEM):
                    wanted.setdefault(lib, ())
    venv = _venv_of(path)
    if venv is not None:
        home = _venv_home(venv)
        if home is not None:
            for executable in sorted(home.glob("python3*")):
                _needs(executable, wanted, depth=depth + 1)
    interpreter = _shebang(path.resolve())
    if interpreter is not None:
        _needs(interpreter, wanted, depth=depth + 1)


def _link_chain(path: Path) -> list[Path]:
    """`path` and every path its symlinks lead through, up to the file itself."""
    chain = [Path(os.path.normpath(path.absolute()))]
    for _ in range(40):
        current = chain[-1]
        if not current.is_symlink():
            break
        chain.append(Path(os.path.normpath(current.parent / current.readlink())))
    return chain


def _tree_of(path: Path) -> Path:
    """What to bind for a file outside the system directories: its venv, the outermost
    node_modules it is in, else the file itself (a lone program) ."""
    venv = _venv_of(path)
    if venv is not None:
        return venv
    parts = path.parts
    if "node_modules" in parts:
        return Path(*parts[: parts.index("node_modules") + 1])
    if path.suffix in (".js", ".mjs", ".cjs", ".py"):
        return path.parent  # a script beside its modules
    return path


def _venv_of(path: Path) -> Path | None:
    for parent in Path(os.path.normpath(path.absolute())).parents:
        if (parent / "pyvenv.cfg").is_file():
            return parent
    return None


def _venv_home(venv: Path) -> Path | None:
    with contextlib.suppress(OSError):
        for line in (venv / "pyvenv.cfg").read_text(encoding="utf-8").splitlines():
            key, _, value = line.partition("=")
            if key.strip() == "home" and value.strip():
                return Path(value.strip())
    return None


def _shebang(path: Path) -> Path | None:
    """The interpreter a script's `#!` line names (`/usr/bin/env X` looked up as X)."""
    try:
        with path.open("rb") as file:
            head = file.read(256)
    except OSError:
        return None
    if not head.startswith(b"#!"):
        return None
    words = head[2:].split(b"\n", 1)[0].decode("utf-8", "replace").split()
    if not words:
        return None
    if words[0].endswith("/env") and len(words) > 1:
        found = shutil.which(words[-1] if words[1] == "-S" else words[1])
        return Path(found) if found else None
    return Path(words[0])


def _is_elf(path: Path) -> bool:
    try:
        with path.open("rb") as file:
            return file.read(4) == b"\x7fELF"
    except OSError:
        return False


def _under(path: Path, dirs: Iterable[str]) -> bool:
    text = os.path.normpath(path.absolute())
    return any(text == d or text.startswith(d + "/") for d in dirs)


def _inside(path: Path, other: Path) -> bool:
    return path != other and other in path.parents


def _limited(server: tuple[str, ...]) -> tuple[str, ...]:
    """The server's command behind prlimit with the server's rlimits (inside the sandbox:
    lowering one's own limits needs no privilege); prlimit execs it."""
    limits = [f"--{name}={value}:{value}" for name, value in RLIMITS]
    return ("/usr/bin/prlimit", *limits, "--", *server)
