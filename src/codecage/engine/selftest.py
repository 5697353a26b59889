"""`codecage doctor`: prove, by running code in a real sandbox, that each layer holds.

The host plants a secret file under its own /tmp and opens a TCP listener on 127.0.0.1;
a probe program inside the sandbox tries to read the one and reach the other, checks its
identity and environment, calls denied syscalls, and sets off the memory and process
limits in child processes. The library runs this once at start-up (cached per boot, per
codecage and backend version, `cache_key`) and refuses to run code if a layer it promises is
missing. It runs through the engine directly, as a plain function of the backend.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import secrets
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path

from codecage._version import __version__
from codecage.backends.base import Backend
from codecage.engine.run import HostContext, RunRequest, execute
from codecage.isolation import cgroups
from codecage.isolation.identity import Identity, IdentityPlan
from codecage.models import DoctorReport, ExecutionResult, Limits, ProbeResult

log = logging.getLogger(__name__)

NAMESPACES = ("user", "pid", "mnt", "net", "ipc", "uts")
"""What a sandbox must not share with the host for the `namespaces` layer to hold."""

PROBE_LIMITS = Limits(timeout=30, memory_mb=64, max_processes=16, cpu_seconds=20)

# Runs inside the sandbox; prints one JSON object. Kept to the stdlib and to facts the
# host can check against what it planted.
_PROBE_PROGRAM = r"""
import ctypes, errno, json, os, socket, sys, time

PLANTED, TOKEN, PORT, ALLOWED_ENV = {planted!r}, {token!r}, {port!r}, {allowed_env!r}
out = {{}}
open("doctor-owner", "w").close()  # in the workspace: the host looks at who owns it
libc = ctypes.CDLL(None, use_errno=True)

def status_field(name):
    for line in open("/proc/self/status"):
        if line.startswith(name + ":"):
            return line.split()[1]

out["identity"] = {{
    "uid": os.getuid(), "cap_eff": status_field("CapEff"),
    # gVisor's /proc/self/status has no NoNewPrivs line: ask prctl(PR_GET_NO_NEW_PRIVS).
    "no_new_privs": status_field("NoNewPrivs") or str(libc.prctl(39, 0, 0, 0, 0)),
    "pid": os.getpid(),
    "tty": os.path.exists("/dev/tty") and os.isatty(0),
}}
def namespace(kind):
    try:
        return os.readlink("/proc/self/ns/" + kind)
    except OSError:
        return None
out["namespaces"] = {{kind: namespace(kind) for kind in {namespaces!r}}}
try:
    leaked = TOKEN in open(PLANTED).read()
except OSError:
    leaked = False
def _try_write(path, mode="w"):
    try:
        open(path, mode).close()
        return True
    except OSError:
        return False

out["filesystem"] = {{
    "planted_readable": leaked,
    "host_paths_visible": [p for p in ("/root", "/home", "/etc/shadow", "/var", "/run")
                           if os.path.exists(p)],
    "root_writable": _try_write("/probe") or _try_write("/etc/probe"),
    "workspace_writable": _try_write("/workspace/probe"),
    "proc_sys_writable": _try_write("/proc/sys/kernel/core_uses_pid", "a"),
}}
out["environment"] = sorted(set(os.environ) - set(ALLOWED_ENV))

def connect():
    try:
        socket.create_connection(("127.0.0.1", PORT), timeout=2).close()
        return "connected"
    except OSError as e:
        return errno.errorcode.get(e.errno, str(e.errno))
out["network"] = connect()

def denied(fn, *args):
    ctypes.set_errno(0)
    rc = fn(*args)
    return rc == -1 and ctypes.get_errno() == errno.EPERM
out["seccomp"] = {{
    "ptrace": denied(libc.ptrace, 0, 0, 0, 0),
    "unshare_user": denied(libc.unshare, 0x10000000),
    "mount": denied(libc.mount, b"none", b"/tmp", b"tmpfs", 0, None),
    "mode": status_field("Seccomp"),
}}

def child_outcome(body):
    pid = os.fork()
    if pid == 0:
        try:
            body()
            os._exit(0)
        except MemoryError:
            os._exit(3)
        except BaseException:
            os._exit(4)
    _, st = os.waitpid(pid, 0)
    return os.WTERMSIG(st) if os.WIFSIGNALED(st) else -os.WEXITSTATUS(st)

def hog():
    blocks = []
    for _ in range(64):
        blocks.append(bytearray(8 * 1024 * 1024))   # 512 MiB in all, limit is 64
out["memory"] = child_outcome(hog)

def forks():
    kids, failed = [], False
    for _ in range(64):
        try:
            pid = os.fork()
        except OSError:
            failed = True
            break
        if pid == 0:
            time.sleep(5)
            os._exit(0)
        kids.append(pid)
    for k in kids:
        os.kill(k, 9)
        os.waitpid(k, 0)
    print(json.dumps({{"forked": len(kids), "refused": failed}}), file=sys.stderr)
    os._exit(0 if failed else 5)
out["processes"] = child_outcome(forks)
print(json.dumps(out))
"""

# PWD is set by the backend (the sandbox's working directory); the rest by
# engine.plan.sandbox_env.
_ALLOWED_ENV = (
    "PATH", "HOME", "LANG", "TMPDIR", "LD_LIBRARY_PATH", "PWD", "MPLBACKEND", "MPLCONFIGDIR"
)  # fmt: skip


def run_probes(backend: Backend, identity: Identity | IdentityPlan | None = None) -> DoctorReport:
    """Run the probe program in a fresh sandbox of `backend` as `identity` (an id, or a
    plan whose range lends the sandbox one; None: this process's default) with no import
    policy and no self-test (it is the self-test), and judge each layer from what came
    back and from who owns what it made on the host.

    Raises:
        HostError: the host cannot start a sandbox at all.
        SandboxError: the sandbox itself failed.
    """
    token = secrets.token_hex(16)
    with _planted_file(token) as planted, _loopback_listener() as port:
        program = _PROBE_PROGRAM.format(
            planted=str(planted),
            token=token,
            port=port,
            allowed_env=_ALLOWED_ENV,
            namespaces=NAMESPACES,
        )
        owners: list[tuple[int, int]] = []
        request = RunRequest(
            code=program,
            filename="doctor.py",
            limits=PROBE_LIMITS,
            context=HostContext(identity=identity),
            on_files=lambda ws, _files: owners.extend(_owner(ws / "doctor-owner")),
        )
        result = execute(request, backend)
    probes = _judge(result, token, sentry_root=backend.guest_is_sentry_root)
    if result.status == "ok":
        probes.insert(2, _host_identity(owners, identity))
    # A layer the backend lacks by design (the Landlock fallback's namespaces and private
    # root) is not in force: WEAK, never PASS, and no failure of the backend either.
    gaps = backend.selftest_gaps
    probes = [
        p.model_copy(update={"weak": True}) if p.layer in gaps and not p.passed else p
        for p in probes
    ]
    return DoctorReport(backend=backend.name, passed=all(p.passed for p in probes), probes=probes)


def _judge(result: ExecutionResult, token: str, *, sentry_root: bool = False) -> list[ProbeResult]:
    if result.status != "ok":
        detail = f"the probe program ended with {result.status}: {result.stderr[-500:]}"
        if result.error is not None:
            detail += f" {result.error.type}: {result.error.message}"
        return [ProbeResult(layer="sandbox", passed=False, detail=detail)]
    try:
        facts = json.loads(result.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return [ProbeResult(layer="sandbox", passed=False, detail="probe output unreadable")]
    leaked = token in result.stdout or token in result.stderr
    # Which mechanism stopped the memory and process probes: said, since rlimits keep far
    # less than a cgroup (docs/security-model.md).
    no_cgroup = cgroups.why_unavailable()
    by = "a cgroup" if no_cgroup is None else f"rlimits only (no cgroup: {no_cgroup})"
    return [
        _namespaces(facts["namespaces"]),
        _privileges(facts["identity"], sentry_root=sentry_root),
        _filesystem(facts["filesystem"], leaked),
        _check(
            "environment",
            facts["environment"] == [],
            f"only {', '.join(_ALLOWED_ENV)} are set",
            f"unexpected variables: {facts['environment']}",
        ),
        _check(
            "network",
            facts["network"] != "connected",
            f"a listener on host 127.0.0.1 is unreachable ({facts['network']})",
            "reached a TCP listener on the host's loopback",
        ),
        _seccomp(facts["seccomp"]),
        _check(
            "memory",
            facts["memory"] in (9, -3),
            f"a child allocating 512 MiB under a {PROBE_LIMITS.memory_mb} MiB limit was stopped"
            f" by {by}",
            f"a child allocated 512 MiB under a {PROBE_LIMITS.memory_mb} MiB limit",
        ),
        _check(
            "processes",
            facts["processes"] == 0,
            f"fork was refused below {PROBE_LIMITS.max_processes + 1} processes by {by}",
            f"64 forks succeeded under a limit of {PROBE_LIMITS.max_processes}",
        ),
    ]


def _check(layer: str, passed: bool, ok_detail: str, fail_detail: str) -> ProbeResult:
    return ProbeResult(layer=layer, passed=passed, detail=ok_detail if passed else fail_detail)


def _owner(path: Path) -> list[tuple[int, int]]:
    with contextlib.suppress(OSError):
        st = path.lstat()
        return [(st.st_uid, st.st_gid)]
    return []


def _host_identity(
    owners: list[tuple[int, int]], identity: Identity | IdentityPlan | None = None
) -> ProbeResult:
    """Who the sandbox is on the host, seen from the host: the owner of a file it made, and
    the range it came from when each sandbox has its own. (Every start also refuses a
    sandbox whose first process is host root or not the id it was lent.)"""
    if not owners:
        return _check("host identity", False, "", "the probe's file was not found on the host")
    uid, gid = owners[0]
    ids = identity.range if isinstance(identity, IdentityPlan) else None
    if ids is not None:
        whose = f"(its own id, lent from the range {ids.base + 1} to {ids.last})"
        good = uid in ids and uid != ids.base and gid == uid
    else:
        whose = "(the user running codecage)" if uid == os.getuid() else "(a dedicated id)"
        good = True
    return _check(
        "host identity",
        uid != 0 and gid != 0 and good,
        f"the sandbox is host uid {uid}, gid {gid}, not root {whose}",
        f"the sandbox is host uid {uid}, gid {gid}: root, or not an id of its range {whose}",
    )


def _privileges(facts: dict[str, object], *, sentry_root: bool = False) -> ProbeResult:
    """`sentry_root`: the backend's guest is uid 0 of a kernel of its own (rootless gVisor:
    the owner of its files there, never host root), and must then hold no capability."""
    good = (
        (facts["uid"] != 0 or sentry_root)
        and facts["cap_eff"] == "0000000000000000"
        and facts["no_new_privs"] == "1"
        and facts["tty"] is False
    )
    return _check(
        "privileges",
        good,
        f"uid {facts['uid']}, no capabilities, no_new_privs, no terminal",
        f"privileges not dropped: {facts}",
    )


def _namespaces(inside: dict[str, str | None]) -> ProbeResult:
    """Each namespace of the sandbox against this process's own, by their ids
    (/proc/self/ns/*): one it shares with the host is not in force. One it cannot read
    there is its own (gVisor's kernel shows none of the host's)."""
    shared = [kind for kind in NAMESPACES if inside.get(kind) is not None and
              inside.get(kind) == _own_namespace(kind)]  # fmt: skip
    return _check(
        "namespaces",
        not shared,
        f"its own {', '.join(NAMESPACES)} namespaces (none of the host's)",
        f"not in force: the sandbox shares the host's {', '.join(shared)} namespace"
        + ("s" if len(shared) > 1 else ""),
    )


def _own_namespace(kind: str) -> str | None:
    try:
        return str(Path(f"/proc/self/ns/{kind}").readlink())
    except OSError:
        return None


def _filesystem(facts: dict[str, object], leaked: bool) -> ProbeResult:
    good = (
        not leaked
        and facts["planted_readable"] is False
        and facts["host_paths_visible"] == []
        and facts["root_writable"] is False
        and facts["workspace_writable"] is True
        and facts["proc_sys_writable"] is False
    )
    return _check(
        "filesystem",
        good,
        "a file planted in the host's /tmp is invisible; / and /proc/sys are read-only; "
        "/workspace is writable",
        f"filesystem not contained: {facts}",
    )


def _seccomp(facts: dict[str, object]) -> ProbeResult:
    good = facts["mode"] == "2" and all(
        facts[k] is True for k in ("ptrace", "unshare_user", "mount")
    )
    return _check(
        "seccomp",
        good,
        "ptrace, unshare(CLONE_NEWUSER) and mount fail with EPERM",
        f"seccomp not in force: {facts}",
    )


@contextlib.contextmanager
def _planted_file(token: str) -> Iterator[Path]:
    fd, name = tempfile.mkstemp(prefix="codecage-doctor-", dir="/tmp")
    try:
        os.write(fd, f"secret {token}\n".encode())
        os.close(fd)
        Path(name).chmod(0o644)  # readable by anyone on the host: only isolation hides it
        yield Path(name)
    finally:
        Path(name).unlink(missing_ok=True)


@contextlib.contextmanager
def _loopback_listener() -> Iterator[int]:
    with socket.create_server(("127.0.0.1", 0)) as server:
        yield server.getsockname()[1]


def cache_key(backend: Backend, identity: Identity | None = None) -> str:
    """Results hold until reboot or until codecage, the backend (or its version), the
    kernel or the sandbox's host ids change."""
    try:
        boot_id = Path("/proc/sys/kernel/random/boot_id").read_text(encoding="utf-8").strip()
    except OSError:
        boot_id = "unknown"
    probe = hashlib.sha256((_PROBE_PROGRAM + repr(_ALLOWED_ENV)).encode()).hexdigest()
    parts = [boot_id, __version__, backend.name, backend.version() or "", os.uname().release]
    parts.append(probe)
    parts.append(str(os.geteuid()))
    if identity is not None:
        parts.append(f"{identity.uid}:{identity.gid}")
    digest = hashlib.sha256("|".join(parts).encode()).hexdigest()[:24]
    return digest
