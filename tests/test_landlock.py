"""The Landlock fallback (backends/landlock.py): where user namespaces are really gone it
is refused unless allowed, works when allowed, and says so; and attacks specific to a
sandbox without namespaces fail, each because of the layer it names (Landlock, seccomp)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from codecage import Options, Sandbox
from codecage.backends import landlock as backend
from codecage.isolation import landlock

SRC = Path(__file__).resolve().parent.parent / "src"

pytestmark = pytest.mark.skipif(landlock.abi() < 6, reason="needs Landlock ABI 6 (scoping)")

# Installs a seccomp filter that refuses user namespaces (unshare, clone with
# CLONE_NEWUSER; clone3 as ENOSYS, as Docker's default profile does), then runs the CLI.
_NO_USERNS = """
import errno, os, sys
import pyseccomp as s
f = s.SyscallFilter(defaction=s.ALLOW)
f.add_rule(s.ERRNO(errno.EPERM), "unshare")
f.add_rule(s.ERRNO(errno.EPERM), "clone", s.Arg(0, s.MASKED_EQ, 0x10000000, 0x10000000))
f.add_rule(s.ERRNO(errno.ENOSYS), "clone3")
f.load()
os.execv(sys.executable, [sys.executable, "-m", "codecage.cli", *sys.argv[1:]])
"""


def _cli_without_userns(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CODECAGE_")}
    env["PYTHONPATH"] = str(SRC)
    return subprocess.run(
        [sys.executable, "-c", _NO_USERNS, *args],
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
        check=False,
    )


def test_without_user_namespaces_auto_refuses_and_says_what_to_change() -> None:
    proc = _cli_without_userns("run", "--code", "print('hi')", "--json")
    assert proc.returncode != 0
    said = proc.stdout + proc.stderr
    assert "user namespaces are unavailable" in said
    assert "unshare(CLONE_NEWUSER) fails" in said
    assert "--backend landlock" in said and "--allow-degraded" in said
    assert "hostUsers: false" in said and "seccomp" in said
    assert "hi" not in proc.stdout.splitlines()


def test_without_user_namespaces_allow_degraded_runs_on_landlock_and_says_so() -> None:
    proc = _cli_without_userns("run", "--code", "print('hi')", "--json", "--allow-degraded")
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["status"] == "ok"
    assert result["stdout"] == "hi\n"
    assert result["backend"] == "landlock"
    details = [e["detail"] for e in result["events"] if e["kind"] == "degraded_isolation"]
    assert any("pid namespace" in d for d in details), result["events"]
    assert any("network namespace" in d for d in details)


def test_auto_never_picks_landlock_where_user_namespaces_work() -> None:
    from codecage.backends.base import load_backend
    from codecage.isolation import userns

    assert userns.available()[0]
    assert load_backend("auto", allow_degraded=True).name == "bwrap"


_BWRAP_WITHOUT_PROC = """#!/bin/sh
# bubblewrap as it behaves in a container that masks /proc: it loads, it makes its
# namespaces, but a sandbox that mounts a proc (every real one) is refused.
for arg in "$@"; do
    if [ "$arg" = "--proc" ]; then
        echo "bwrap: Can't mount proc on /newroot/proc: Operation not permitted" >&2
        exit 1
    fi
done
exec {real} "$@"
"""


def test_auto_passes_over_a_backend_whose_self_test_sandbox_cannot_start(
    tmp_path: Path,
) -> None:
    """A bwrap that cannot mount /proc (a container that masks it) failed the self-test
    with a SandboxError that ended the host's start: no other backend was tried. Now that
    candidate fails and the next one that holds is chosen. The bwrap here is a real one
    behind a wrapper that refuses --proc as such a container does (no container runs in
    the suite); the self-test cache is this test's own."""
    real = shutil.which("bwrap")
    assert real is not None
    fake = tmp_path / "bin" / "bwrap"
    fake.parent.mkdir()
    fake.write_text(_BWRAP_WITHOUT_PROC.format(real=real), encoding="utf-8")
    fake.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith("CODECAGE_")}
    env |= {"PATH": f"{fake.parent}:{env['PATH']}", "XDG_CACHE_HOME": str(tmp_path / "cache")}
    probe = (
        "from codecage import Options, Sandbox\n"
        "with Sandbox(pool=False, options=Options(allow_degraded=True)) as sb:\n"
        "    print(sb.host.backend.name, sb.run('print(6 * 7)').stdout.strip())\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    chosen, printed = done.stdout.split()
    assert chosen != "bwrap" and printed == "42", done.stdout


# --- attacks on the fallback itself ----------------------------------------------------


@pytest.fixture(scope="module")
def fallback() -> Sandbox:
    return Sandbox(backend="landlock", options=Options(import_policy=False, scrub=False))


def _report(sb: Sandbox, code: str) -> object:
    r = sb.run(code, limits={"timeout": 20})
    assert r.status == "ok", (r.error, r.stderr)
    assert "degraded_isolation" in [e.kind for e in r.events]
    return r.return_value


@pytest.fixture
def host_dir(tmp_path: Path) -> Iterator[Path]:
    """A host directory anyone may read and write, with a readable secret in it: only the
    sandbox's own layers stand between the guest and it."""
    tmp_path.chmod(0o777)
    secret = tmp_path / "secret.txt"
    secret.write_text("host-secret-7f3a")
    secret.chmod(0o666)
    yield tmp_path


def test_writing_outside_the_workspace_and_tmp_is_refused_by_landlock(
    fallback: Sandbox, host_dir: Path
) -> None:
    code = f"""
import os, tempfile
out = {{}}
for path in ({str(host_dir / "planted")!r}, {str(host_dir / "secret.txt")!r}):
    try:
        with open(path, "a") as f:
            f.write("x")
        out[path] = "written"
    except OSError as exc:
        out[path] = type(exc).__name__
with open("mine.txt", "w") as f:
    f.write("ok")
with open(os.path.join(tempfile.gettempdir(), "t"), "w") as f:
    f.write("ok")
out
"""
    got = _report(fallback, code)
    assert got == {
        str(host_dir / "planted"): "PermissionError",
        str(host_dir / "secret.txt"): "PermissionError",
    }
    assert not (host_dir / "planted").exists()
    assert (host_dir / "secret.txt").read_text() == "host-secret-7f3a"


def test_reading_root_home_and_a_host_file_is_refused_by_landlock(
    fallback: Sandbox, host_dir: Path
) -> None:
    code = f"""
import os
out = {{}}
for path in ("/root", "/home", "/etc"):
    try:
        out[path] = len(os.listdir(path))
    except OSError as exc:
        out[path] = type(exc).__name__
for path in ({str(host_dir / "secret.txt")!r}, "/etc/shadow", "/proc/1/environ"):
    try:
        out[path] = open(path).read()[:40]
    except OSError as exc:
        out[path] = type(exc).__name__
out
"""
    got = _report(fallback, code)
    assert isinstance(got, dict)
    assert set(got.values()) == {"PermissionError"}, got
    assert "host-secret" not in json.dumps(got)


def test_a_loopback_tcp_listener_is_unreachable_seccomp_refuses_the_socket(
    fallback: Sandbox,
) -> None:
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        code = f"""
import errno, socket
try:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
except OSError as exc:
    out = ["socket", errno.errorcode[exc.errno]]
else:
    try:
        s.settimeout(2)
        s.connect(("127.0.0.1", {port}))
        out = ["connected", ""]
    except OSError as exc:
        out = ["connect", errno.errorcode.get(exc.errno, "?")]
out
"""
        got = _report(fallback, code)
    assert got == ["socket", "EPERM"]


def test_signalling_or_reading_a_host_process_is_refused(fallback: Sandbox) -> None:
    victim = subprocess.Popen(["sleep", "60"])
    try:
        code = f"""
import ctypes, os
out = {{}}
try:
    os.kill({victim.pid}, 9)
    out["kill"] = "sent"
except OSError as exc:
    out["kill"] = type(exc).__name__
try:
    open("/proc/{victim.pid}/environ", "rb").read()
    out["environ"] = "read"
except OSError as exc:
    out["environ"] = type(exc).__name__
libc = ctypes.CDLL(None, use_errno=True)
out["ptrace"] = libc.ptrace(16, {victim.pid}, 0, 0) == 0  # PTRACE_ATTACH
out
"""
        got = _report(fallback, code)
        assert got == {"kill": "PermissionError", "environ": "PermissionError", "ptrace": False}
        assert victim.poll() is None  # still alive
    finally:
        victim.send_signal(signal.SIGKILL)
        victim.wait()


def test_a_setuid_file_cannot_be_made_seccomp_refuses_the_bit(fallback: Sandbox) -> None:
    code = """
import os, stat
with open("tool", "w") as f:
    f.write("#!/bin/sh\\n")
try:
    os.chmod("tool", 0o4755)
    how = "chmod"
except OSError as exc:
    how = type(exc).__name__
[how, bool(os.stat("tool").st_mode & stat.S_ISUID)]
"""
    assert _report(fallback, code) == ["PermissionError", False]


_UNIX_PROBE = """
import errno, socket
def attempt(kind, address):
    s = socket.socket(socket.AF_UNIX, kind)
    try:
        if kind == socket.SOCK_STREAM:
            s.connect(address)
        else:
            s.sendto(b"x", address)
        return "reached"
    except OSError as exc:
        return errno.errorcode.get(exc.errno, "?")
    finally:
        s.close()
a, b = socket.socketpair()  # the run's own sockets, unaddressed, still work
a.send(b"ping")
out = {{"own": b.recv(4).decode()}}
out["stream"] = attempt(socket.SOCK_STREAM, {stream!r})
out["dgram"] = attempt(socket.SOCK_DGRAM, {dgram!r})
out["abstract"] = attempt(socket.SOCK_STREAM, {abstract!r})
out
"""


@dataclass
class HostSockets:
    """A host's unix sockets a run aims at, and what reached them."""

    addresses: dict[str, str]
    listeners: dict[str, socket.socket]

    def reached(self) -> list[str]:
        """Which of them got a connection or a datagram (non-blocking; closes what came)."""
        got = []
        for name, sock in self.listeners.items():
            sock.setblocking(False)
            try:
                if sock.type == socket.SOCK_STREAM:
                    sock.accept()[0].close()
                else:
                    sock.recv(1)
            except BlockingIOError:
                continue
            got.append(name)
        return got


@pytest.fixture
def host_unix_sockets() -> Iterator[HostSockets]:
    """A host stream listener and a datagram socket in a directory of /tmp anyone may
    enter (pytest's own temp directories are closed to the sandbox's uid), both writable by
    anyone (so that file modes do not refuse it), and an abstract listener: only the
    sandbox's own layers stand between the guest and them."""
    where = Path(tempfile.mkdtemp(prefix="codecage-test-sockets-", dir="/tmp"))
    where.chmod(0o755)
    addresses = {
        "stream": str(where / "host.sock"),
        "dgram": str(where / "host.dgram"),
        "abstract": f"\0codecage-test-{os.getpid()}",
    }
    with contextlib.ExitStack() as cleanup:
        cleanup.callback(shutil.rmtree, where, True)
        listeners = {
            name: cleanup.enter_context(socket.socket(socket.AF_UNIX, kind))
            for name, kind in (
                ("stream", socket.SOCK_STREAM),
                ("dgram", socket.SOCK_DGRAM),
                ("abstract", socket.SOCK_STREAM),
            )
        }
        for name, sock in listeners.items():
            sock.bind(addresses[name])
            if sock.type == socket.SOCK_STREAM:
                sock.listen()
        for name in ("stream", "dgram"):
            os.chmod(addresses[name], 0o777)  # noqa: S103 - the point: modes refuse no one
        yield HostSockets(addresses, listeners)


def test_host_unix_sockets_are_unreachable_pathname_and_abstract(
    fallback: Sandbox, host_unix_sockets: HostSockets
) -> None:
    """Pathname sockets: Landlock's FS_RESOLVE_UNIX from ABI 9, below it the run's seccomp
    filter (no connect, no addressed send); abstract ones: Landlock's scope (ABI 6)."""
    got = _report(fallback, _UNIX_PROBE.format(**host_unix_sockets.addresses))
    assert isinstance(got, dict)
    assert got["own"] == "ping"
    assert got["stream"] == "EACCES" and got["dgram"] == "EACCES"
    assert got["abstract"] in ("EPERM", "EACCES")
    assert host_unix_sockets.reached() == []


@pytest.mark.xfail(
    landlock.abi() < landlock.ABI_RESOLVE_UNIX,
    reason="Landlock refuses pathname unix sockets from ABI 9 (Linux 7.1, "
    "LANDLOCK_ACCESS_FS_RESOLVE_UNIX); below it only the seccomp filter does",
    strict=True,
)
def test_landlock_alone_refuses_a_host_pathname_unix_socket(
    host_unix_sockets: HostSockets, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The Landlock layer without the seccomp stand-in (a backend that believes its ABI
    has FS_RESOLVE_UNIX): refused only where the kernel has it."""
    monkeypatch.setattr(landlock, "ABI_RESOLVE_UNIX", 0)
    alone = Sandbox(backend="landlock", options=Options(import_policy=False, scrub=False))
    got = _report(alone, _UNIX_PROBE.format(**host_unix_sockets.addresses))
    assert isinstance(got, dict)
    assert got["abstract"] == "EPERM"  # the scope (ABI 6) holds alone
    assert got["stream"] == "EACCES" and got["dgram"] == "EACCES"
    assert host_unix_sockets.reached() == []


def test_doctor_reports_the_namespaces_it_lacks_as_weak_never_pass() -> None:
    """`doctor` on Landlock checks each namespace against the host's own: not in force
    (WEAK), where it used to print PASS from the uid and capabilities alone."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CODECAGE_")}
    proc = subprocess.run(
        [sys.executable, "-m", "codecage.cli", "doctor", "--backend", "landlock"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        check=False,
    )
    lines = proc.stdout.splitlines()
    assert any(line.startswith("WEAK namespaces") for line in lines), proc.stdout
    assert not any(line.startswith("PASS namespaces") for line in lines)
    assert any(line.startswith("PASS privileges") for line in lines)
    assert "not in force by design: namespaces" in proc.stdout
    assert proc.returncode == 1  # not every layer holds; none fails that it provides
    report = Sandbox(backend="landlock", options=Options(selftest=False)).doctor()
    namespaces = next(p for p in report.probes if p.layer == "namespaces")
    assert not namespaces.passed and namespaces.weak
    assert "pid" in namespaces.detail and "mnt" in namespaces.detail
    assert not report.passed


# --- the plan ----------------------------------------------------------------------------


def test_the_ruleset_handles_every_right_of_the_abi() -> None:
    rules = (landlock.Rule("/x", landlock.READ_WRITE | landlock.FS_IOCTL_DEV),)
    v1 = landlock.Ruleset.plan(1, rules)
    assert v1.handled_fs == (1 << 13) - 1 and v1.handled_net == 0 and v1.scoped == 0
    assert v1.rules[0].access & landlock.FS_REFER == 0  # not handled: cut
    v7 = landlock.Ruleset.plan(7, rules)
    assert v7.handled_fs == (1 << 16) - 1
    assert v7.handled_net == landlock.NET_BIND_TCP | landlock.NET_CONNECT_TCP
    assert v7.scoped == landlock.SCOPE_ABSTRACT_UNIX_SOCKET | landlock.SCOPE_SIGNAL
    assert landlock.Ruleset.plan(7, rules, network=True).handled_net == 0
    assert landlock.Ruleset.from_json(v7.to_json()) == v7
    # ABI 9: pathname unix sockets are handled; the run's own (read-write) paths keep them.
    assert v7.handled_fs & landlock.FS_RESOLVE_UNIX == 0
    v9 = landlock.Ruleset.plan(9, rules)
    assert v9.handled_fs & landlock.FS_RESOLVE_UNIX
    assert v9.rules[0].access & landlock.FS_RESOLVE_UNIX


def test_below_abi_9_the_backend_asks_seccomp_to_refuse_unix_addressing() -> None:
    from codecage.isolation import seccomp

    assert backend.LandlockBackend().filters_unix_addressing == (
        landlock.abi() < landlock.ABI_RESOLVE_UNIX
    )
    rules = [r.describe() for r in seccomp._rules(seccomp.plan(unix_addressing=False),
                                                   clone_flags_arg=0)]  # fmt: skip
    assert {"connect -> EACCES", "sendmsg -> EACCES", "sendmmsg -> EACCES"} <= set(rules)
    assert "sendto if a4 != 0x0 -> EACCES" in rules
    default = seccomp._rules(seccomp.plan(), clone_flags_arg=0)
    assert not any("EACCES" in r.describe() for r in default)


def test_nested_binds_become_a_directory_of_links(tmp_path: Path) -> None:
    from codecage.isolation.rootfs import Mount

    stdlib = tmp_path / "stdlib"
    (stdlib / "site-packages").mkdir(parents=True)
    (stdlib / "os.py").write_text("")
    empty = tmp_path / "empty"
    empty.mkdir()
    mounts = (
        Mount("ro-bind", "/opt/python/lib/python3.11", str(stdlib)),
        Mount("ro-bind", "/opt/python/lib/python3.11/site-packages", str(empty)),
        Mount("bind", "/workspace", str(tmp_path / "ws")),
        Mount("tmpfs", "/tmp"),
        Mount("proc", "/proc"),
    )
    tree = backend.plan_tree(mounts, tmp_path / "root", tmp_path / "tmp")
    links = {str(p.relative_to(tmp_path / "root")): t for p, t in tree.links}
    assert links["opt/python/lib/python3.11/os.py"] == str(stdlib / "os.py")
    assert links["opt/python/lib/python3.11/site-packages"] == str(empty)
    rules = {r.path: r.access for r in tree.rules}
    assert str(stdlib) not in rules  # its site-packages is not readable through a rule
    assert rules[str(tmp_path / "ws")] == landlock.READ_WRITE
    assert tree.translate("/tmp/x") == f"{tmp_path / 'root'}/tmp/x"
    assert tree.translate("/proc/self") == "/proc/self"
    assert tree.workspace == tmp_path / "ws"
