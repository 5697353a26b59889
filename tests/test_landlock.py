"""The Landlock fallback (backends/landlock.py): where user namespaces are really gone it
is refused unless allowed, works when allowed, and says so; and attacks specific to a
sandbox without namespaces fail, each because of the layer it names (Landlock, seccomp)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from codecage import Sandbox
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


# --- attacks on the fallback itself ----------------------------------------------------


@pytest.fixture(scope="module")
def fallback() -> Sandbox:
    return Sandbox(backend="landlock", import_policy=False, scrub=False)


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
