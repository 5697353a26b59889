"""One host identity per run: two runs alive at once have different host uids, and neither
reaches the other's processes (signals, /proc), Unix sockets or workspace files; a fork
bomb in one does not keep the other from forking (RLIMIT_NPROC counts each run's own).

The runs are real and concurrent: run A does its part, prints a line the host waits for
(streamed by `on_output`), and holds until the host cancels it once run B is over. Run A
names its process (`PR_SET_NAME`) so the host finds it in its /proc. On bwrap the pid
namespace already hides A from B; on the Landlock fallback it does not, and the host id is
what keeps B out. What B cannot do is also checked from the host: a process of B's host
uid opening A's files through a descriptor of A's workspace the host opened as root.
"""

from __future__ import annotations

import json
import os
import secrets
from pathlib import Path
from typing import Any

import pytest
from tests._forking import in_forked_child

from codecage import Sandbox

from ._support import fork_and_reap, guest, held_run, report

pytestmark = [
    pytest.mark.timeout(180),
    pytest.mark.skipif(os.geteuid() != 0, reason="as an ordinary user every run is the caller"),
]


def _hold_forever() -> str:
    return """
import time
while True:
    time.sleep(1)
"""


def _run_a(token: str) -> str:
    """Run A: named `token` on the host, a file and a listening Unix socket in its
    workspace, then hold."""
    return (
        guest(
            """
        import ctypes, os, socket
        ctypes.CDLL(None).prctl(15, $token.encode(), 0, 0, 0)  # PR_SET_NAME
        with open("mine", "w") as f:
            f.write("run A's")
        os.chmod("mine", 0o666)  # even open to every id: the directory is A's alone
        server = socket.socket(socket.AF_UNIX)
        server.bind("a.sock")
        os.chmod("a.sock", 0o777)
        server.listen(4)
        print("READY", flush=True)
        """,
            token=token,
        )
        + _hold_forever()
    )


def _find(token: str) -> int:
    """The host pid of the process named `token` (run A's guest)."""
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if (entry / "comm").read_text().strip() == token:
                    return int(entry.name)
            except OSError:
                continue
    raise AssertionError(f"no host process is named {token}")


def _host_uid(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Uid:"):
            return int(line.split()[1])
    raise AssertionError(f"no Uid line for {pid}")


def _run_b(pid_a: int, workspace_a: str) -> str:
    """Run B: everything it tries against run A, each outcome by name ("ok" = reached)."""
    return guest(
        """
        import errno, json, os, signal, socket
        pid, ws = $pid, $ws
        out = {}
        def attempt(name, action):
            try:
                action()
                out[name] = "ok"
            except OSError as exc:
                out[name] = errno.errorcode.get(exc.errno, str(exc.errno))
        attempt("signal 0", lambda: os.kill(pid, 0))
        attempt("SIGSTOP", lambda: os.kill(pid, signal.SIGSTOP))
        attempt("read /proc environ", lambda: open(f"/proc/{pid}/environ", "rb").read())
        attempt("read /proc mem", lambda: open(f"/proc/{pid}/mem", "rb").close())
        attempt("read /proc cwd", lambda: os.listdir(f"/proc/{pid}/cwd"))
        attempt("read its file", lambda: open(ws + "/mine").read())
        attempt("write its file", lambda: open(ws + "/mine", "a").write("B was here"))
        def connect():
            s = socket.socket(socket.AF_UNIX)
            try:
                s.connect(ws + "/a.sock")
            finally:
                s.close()
        attempt("connect its socket", connect)
        with open("theirs", "w") as f:
            f.write("run B's")
        print(json.dumps(out))
        """,
        pid=pid_a,
        ws=workspace_a,
    )


_HOST_PROCESSES = ("bwrap", "bwrap-fork", "landlock")
"""Backends whose guest is a host process the host finds by name (gVisor's runs in its
Sentry: its files are checked by `test_two_concurrent_runs_write_files_of_different_host_uids`)."""


@pytest.fixture
def host_process_sandbox(sandbox: Sandbox, request: pytest.FixtureRequest) -> Sandbox:
    if request.node.callspec.params["sandbox"] not in _HOST_PROCESSES:
        pytest.skip("the guest is not a host process here (gVisor's Sentry)")
    return sandbox


def test_a_run_cannot_reach_a_concurrent_runs_processes_sockets_or_files(
    host_process_sandbox: Sandbox,
) -> None:
    sandbox = host_process_sandbox
    token = "cc" + secrets.token_hex(6)
    with held_run(sandbox, _run_a(token)):
        pid_a = _find(token)
        uid_a = _host_uid(pid_a)
        ws_fd = os.open(f"/proc/{pid_a}/cwd", os.O_RDONLY | os.O_DIRECTORY)
        try:
            workspace_a = _host_path(ws_fd)
            owners: list[int] = []
            b = sandbox.run(
                _run_b(pid_a, workspace_a),
                limits={"timeout": 60},
                on_files=lambda ws, _f: owners.append((ws / "theirs").stat().st_uid),
            )
            reached = report(b)
            assert {name: got for name, got in reached.items() if got == "ok"} == {}, reached
            assert owners and owners[0] not in (0, uid_a), (owners, uid_a)
            # From the host: B's host uid cannot open A's files (nor list its workspace).
            assert _as_uid(owners[0], ws_fd) == {"read": "EACCES", "write": "EACCES"}
        finally:
            os.close(ws_fd)
        assert Path(f"/proc/{pid_a}").exists(), "run A was not alive the whole time"
        assert _host_uid(pid_a) == uid_a


def _host_path(ws_fd: int) -> str:
    """Where run A's workspace (a tmpfs of its own) is mounted on the host: the path run B
    would use to reach it (on Landlock it sees the host's tree)."""
    st = os.fstat(ws_fd)
    device = f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split()
        if fields[2] == device and fields[3] == "/":
            return fields[4]
    raise AssertionError(f"run A's workspace ({device}) is not mounted on the host")


def _as_uid(uid: int, ws_fd: int) -> dict[str, str]:
    """Open A's file `mine` through `ws_fd` for reading and for writing, in a child that
    is host uid and gid `uid` (no groups, no capability); the errno name of each."""

    def child() -> bytes:  # no thread, nothing of the parent's used but the fds
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
        out = {}
        for name, flags in (("read", os.O_RDONLY), ("write", os.O_WRONLY | os.O_APPEND)):
            try:
                os.close(os.open("mine", flags, dir_fd=ws_fd))
                out[name] = "ok"
            except OSError as exc:
                out[name] = {13: "EACCES", 1: "EPERM"}.get(exc.errno, str(exc.errno))
        return json.dumps(out).encode()

    data = in_forked_child(child, timeout=60)
    assert data, f"the child as uid {uid} reported nothing"
    result: dict[str, str] = json.loads(data)
    return result


def test_two_concurrent_runs_write_files_of_different_host_uids(sandbox: Sandbox) -> None:
    """Seen from the host: the owner of a file each run wrote, while both were alive."""
    seen: dict[str, int] = {}
    code_a = "open('mine', 'w').write('a')\nprint('READY', flush=True)\n" + _hold_forever()

    def owner_of(name: str) -> Any:
        return lambda ws, _files: seen.__setitem__(name, (ws / "mine").stat().st_uid)

    with held_run(sandbox, code_a, on_files=owner_of("a")) as a:
        b = sandbox.run("open('mine', 'w').write('b')", on_files=owner_of("b"))
        assert b.status == "ok", b.stderr
        assert a.thread.is_alive(), "run A ended before run B: they did not overlap"
    assert set(seen) == {"a", "b"}, seen
    assert 0 not in seen.values()
    assert seen["a"] != seen["b"], f"two runs at once had one host uid: {seen}"


def test_a_fork_bomb_in_one_run_does_not_keep_another_from_forking(
    sandbox: Sandbox, request: pytest.FixtureRequest
) -> None:
    """Run A forks until it is refused and holds every process; run B, at the same time
    and with the same limit, still forks what it asks for, under an RLIMIT_NPROC of its
    own (counted over its own host uid: `isolation.identity`)."""
    bomb = """
import os, time
held = 0
while True:
    try:
        pid = os.fork()
    except OSError:
        break
    if pid == 0:
        while True:
            time.sleep(60)
    held += 1
print("READY", held, flush=True)
""" + _hold_forever()
    said = '{"forked": len(pids), "nproc": resource.getrlimit(resource.RLIMIT_NPROC)}'
    code_b = "import json, os, resource\n" + fork_and_reap(10) + f"print(json.dumps({said}))\n"
    with held_run(sandbox, bomb, max_processes=20) as a:
        assert int("".join(a.lines).split()[1]) >= 10, a.lines  # it really filled its share
        b = report(sandbox.run(code_b, limits={"timeout": 60, "max_processes": 20}))
    # bwrap's init counts too, as in pids.max; on gVisor's own kernel the code is PID 1.
    expected = 20 if request.node.callspec.params["sandbox"] == "gvisor" else 21
    assert b == {"forked": 10, "nproc": [expected, expected]}


_SYSV_LEFT = """
import ctypes, json, os
libc = ctypes.CDLL(None, use_errno=True)
libc.shmat.restype = ctypes.c_void_p
made = {}
shm = libc.shmget(0, 4096, 0o1000 | 0o600)  # IPC_PRIVATE, owner-only
if shm >= 0:
    ctypes.memmove(libc.shmat(shm, None, 0), b"left by the run", 15)
made["shm"] = shm
made["msg"] = libc.msgget(0, 0o1000 | 0o600)
made["sem"] = libc.semget(0, 1, 0o1000 | 0o600)
open("mine", "w").write("the run's")
print(json.dumps({"made": made}))
"""


def _sysv_owned_by(uid: int) -> list[str]:
    """The host's SysV IPC objects (in this process's IPC namespace) owned or made by `uid`."""
    found = []
    for kind, (owner, creator) in {"shm": (7, 9), "msg": (7, 9), "sem": (4, 6)}.items():
        for row in Path(f"/proc/sysvipc/{kind}").read_text().splitlines()[1:]:
            cols = row.split()
            if str(uid) in (cols[owner], cols[creator]):
                found.append(f"{kind}: {row}")
    return found


def test_a_run_leaves_no_sysv_ipc_object_for_the_next_run_of_its_id(sandbox: Sandbox) -> None:
    """SysV shared memory, message queues and semaphores outlive their maker. On the
    Landlock fallback (no IPC namespace) a run's objects stayed on the host after it, holding
    host memory and readable by the next run lent the same host id; the id is returned only
    once they are removed (`identity.clear_ipc`)."""
    host_uid: list[int] = []
    seen = sandbox.run(
        _SYSV_LEFT, on_files=lambda ws, _files: host_uid.append((ws / "mine").stat().st_uid)
    )
    assert seen.status == "ok", seen.stderr
    made = report(seen)["made"]
    assert host_uid and host_uid[0] != 0, host_uid
    left = _sysv_owned_by(host_uid[0])
    assert left == [], f"the run (host uid {host_uid[0]}, made {made}) left SysV IPC objects"
